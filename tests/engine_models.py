"""Models for engine and CLI tests, loaded by path like a user's model file (``tests/engine_models.py:<name>``)."""

from __future__ import annotations

import time

import torch
from torch import nn


class SlowCNN(nn.Module):
    """Three prunable convs; each forward sleeps, so a run lasts long enough to be killed part-way."""

    def __init__(self, num_classes: int = 10, delay: float = 0.05) -> None:
        super().__init__()
        self.delay = delay
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 12, 3, padding=1, bias=False),
            nn.BatchNorm2d(12),
            nn.ReLU(),
            nn.Conv2d(12, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.head(self.features(x).mean(dim=(2, 3)))


def slow_cnn(num_classes: int = 10, delay: float = 0.05) -> nn.Module:
    """A :class:`SlowCNN` with random weights (seeded by the caller)."""
    return SlowCNN(num_classes, delay)


class ConstantLogits(nn.Module):
    """Ignores its input's content: every image gets the same logits (class 0 wins), so top1 can be 0."""

    def __init__(self, num_classes: int = 10, value: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, num_classes)
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.conv(x).mean(dim=(2, 3)) * 0
        logits = self.head(features) * 0 + torch.arange(self.head.out_features, 0, -1, dtype=x.dtype)
        return logits * self.value if self.value != 0 else logits


def constant_logits(num_classes: int = 10, value: float = 0.0) -> nn.Module:
    """Logits favour class 0 for every image; ``value=nan`` makes every logit NaN."""
    return ConstantLogits(num_classes, value)


def depthwise_cnn(num_classes: int = 10) -> nn.Module:
    """conv -> depthwise conv -> conv -> pool -> linear: the depthwise conv is not a pruning root."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt style): masking a channel is not removing it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def layernorm_cnn(num_classes: int = 10) -> nn.Module:
    """conv -> LayerNorm over channels -> conv: the first conv needs physical pruning to be measured right."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        ChannelLayerNorm(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


class DataDependent(nn.Module):
    """Branches on the input's values, which torch.fx cannot trace: the fast engine must fall back."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)
        if features.sum() > 0:
            features = features * 2
        return self.head(features.mean(dim=(2, 3)))


def data_dependent(num_classes: int = 10) -> nn.Module:
    """A :class:`DataDependent` model."""
    return DataDependent(num_classes)

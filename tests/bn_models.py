"""Small models for the BatchNorm re-estimation and channel-rounding tests (``tests/bn_models.py:<name>``)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


def conv_bn_chain(num_classes: int = 10, widths: tuple[int, ...] = (6, 8, 10, 12)) -> nn.Sequential:
    """A plain chain ``conv-bn-relu`` per width (modules ``conv0, bn0, relu0, conv1, ...``), a dropout before the
    pooled linear head: pruning ``conv1`` changes what reaches ``bn2`` and later, but not ``bn0`` nor ``bn1``."""
    layers: dict[str, nn.Module] = {}
    channels = 3
    for index, width in enumerate(widths):
        layers[f"conv{index}"] = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        layers[f"bn{index}"] = nn.BatchNorm2d(width)
        layers[f"relu{index}"] = nn.ReLU()
        channels = width
    layers["pool"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    layers["dropout"] = nn.Dropout(0.5)
    layers["fc"] = nn.Linear(channels, num_classes)
    return nn.Sequential(OrderedDict(layers))


def untracked_bn_net(num_classes: int = 10) -> nn.Sequential:
    """conv-BN-relu, conv-BN(no running statistics)-relu, conv-BN-relu, head: the middle BatchNorm always normalises
    with batch statistics, so there is nothing to re-estimate in it."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, track_running_stats=False),
        nn.ReLU(),
        nn.Conv2d(8, 12, 3, padding=1, bias=False),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12, num_classes),
    )


def groupnorm_net(num_classes: int = 10) -> nn.Sequential:
    """conv -> GroupNorm(1 group) -> conv -> BN: zeroing a channel changes the GroupNorm statistics of the others."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(1, 8),
        nn.ReLU(),
        nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12, num_classes),
    )


class RoundingNet(nn.Module):
    """16-, 24- and 32-channel convs with BatchNorm, a residual pair sharing 32 channels, and a linear head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 24, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(24)
        self.conv3 = nn.Conv2d(24, 32, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(32)
        self.conv4 = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.bn4 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.relu(self.bn3(self.conv3(x)))
        x = torch.relu(self.bn4(self.conv4(x)) + x)
        return self.fc(x.mean(dim=(2, 3)))


def rounding_net(num_classes: int = 10) -> nn.Module:
    """A :class:`RoundingNet` with random weights (seeded by the caller)."""
    return RoundingNet(num_classes)

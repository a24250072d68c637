"""Model definitions for the digits demo, loaded by path: ``arch: datasets/digits/models.py:digits_resnet``.

Only torch is needed. The second demo model is torchvision's own ``mobilenet_v2`` (see configs/demo/).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut, or a 1x1 conv-BN shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class DigitsResNet(nn.Module):
    """A small CIFAR-style ResNet: a 3x3 stem, three stages of two BasicBlocks, global pooling, a linear head."""

    def __init__(self, num_classes: int = 10, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages = []
        in_channels = widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            blocks = [BasicBlock(in_channels, width, stride)]
            blocks += [BasicBlock(width, width) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def digits_resnet(num_classes: int = 10, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 2) -> nn.Module:
    """Build the demo ResNet (about 0.17 M parameters for the default widths)."""
    if len(widths) != 3:
        raise ValueError(f"widths must list 3 stage widths, got {list(widths)}")
    return DigitsResNet(num_classes, widths, blocks_per_stage)

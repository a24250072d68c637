"""Small models for tests, loaded by path as ``tests/tiny_models.py:<name>`` (like a user's own model file)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_cnn(num_classes: int = 10, width: int = 8) -> nn.Module:
    """conv-BN-ReLU x2, global pool, linear: enough structure to load, run and evaluate quickly."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


class NotAModel:
    """A callable that returns something other than an nn.Module."""

    def __call__(self) -> str:
        return "not a model"


def not_a_model() -> str:
    """Returns a string, which the loader must refuse."""
    return "not a model"


# Architectures for the dependency-group and masking tests: each exercises one way channels are coupled.


class _BasicBlock(nn.Module):
    """ResNet BasicBlock: conv-BN-ReLU-conv-BN plus a shortcut (identity, or 1x1 conv-BN when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


class TinyResNet(nn.Module):
    """Stem, an identity BasicBlock (its conv2 is coupled to the stem by the residual add) and a strided block
    whose conv2 is coupled to its 1x1 downsample conv, then global pool and a linear classifier."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = _BasicBlock(width, width)
        self.layer2 = _BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_resnet(num_classes: int = 10) -> nn.Module:
    """Two BasicBlocks on one residual chain, the second with a 1x1 downsample shortcut (16x16 or 32x32 inputs)."""
    return TinyResNet(num_classes)


class _InvertedResidual(nn.Module):
    """MobileNetV2 block: expand 1x1 conv, depthwise 3x3 conv, linear project 1x1 conv, residual add."""

    def __init__(self, channels: int, expand: int = 4) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.depthwise = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()
        )
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.depthwise(self.expand(x)))


class TinyInvertedResidual(nn.Module):
    """Stem conv, one inverted-residual block (the expand conv's group carries the depthwise conv), a head conv."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())
        self.block = _InvertedResidual(width)
        self.head = nn.Sequential(nn.Conv2d(width, 2 * width, 1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.block(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_inverted_residual(num_classes: int = 10) -> nn.Module:
    """MobileNetV2-style net: expand 1x1, depthwise 3x3, project 1x1, residual add."""
    return TinyInvertedResidual(num_classes)


class TinyDenseNet(nn.Module):
    """DenseNet-style: each layer (BN-ReLU-conv on the concatenation of all earlier maps) appends its output with
    ``torch.cat``; a transition conv consumes the whole concatenation, so every producer's channels reach it."""

    def __init__(self, num_classes: int = 10, width: int = 8, growth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.layer1 = nn.Sequential(
            nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, growth, 3, padding=1, bias=False)
        )
        self.layer2 = nn.Sequential(
            nn.BatchNorm2d(width + growth), nn.ReLU(), nn.Conv2d(width + growth, growth, 3, padding=1, bias=False)
        )
        channels = width + 2 * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, width, 1, bias=False))
        self.norm = nn.BatchNorm2d(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.cat([x, self.layer1(x)], dim=1)
        x = torch.cat([x, self.layer2(x)], dim=1)
        x = torch.relu(self.norm(self.transition(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_densenet(num_classes: int = 10) -> nn.Module:
    """Concatenation of feature maps feeding convs (DenseNet pre-activation layout)."""
    return TinyDenseNet(num_classes)


class _SqueezeExcitation(nn.Module):
    """avgpool -> 1x1 conv reduce -> ReLU -> 1x1 conv expand -> sigmoid -> multiply with the input."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.relu = nn.ReLU()
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(self.relu(self.reduce(self.pool(x)))))


class TinySE(nn.Module):
    """Stem conv, a squeeze-excitation gate (its expand conv is coupled to the stem by the multiply), a conv."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.se = _SqueezeExcitation(width, width // 4)
        self.conv = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.se(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_se(num_classes: int = 10) -> nn.Module:
    """A squeeze-excitation block between two convs."""
    return TinySE(num_classes)


class TinyFlattenHead(nn.Module):
    """conv-BN-ReLU, then a biased conv with a sigmoid, pooled to 4x4 and flattened into a linear classifier.

    The linear's input features for channel c are the block ``c*16 .. c*16+15``. The sigmoid makes a masked channel
    0.5 rather than 0 at the linear, so masking equals removal only if those input slices are zeroed too.
    """

    def __init__(self, num_classes: int = 10, width: int = 8, side: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.conv2 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(side)
        self.fc = nn.Linear(width * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.sigmoid(self.conv2(self.conv1(x))))
        return self.fc(torch.flatten(x, 1))


def tiny_flatten_head(num_classes: int = 10) -> nn.Module:
    """conv -> flatten -> linear with a 4x4 map at the flatten (channel*H*W input blocks)."""
    return TinyFlattenHead(num_classes)


class TinyLayerNormNet(nn.Module):
    """conv -> channels-last -> LayerNorm over channels -> channels-first -> conv (ConvNeXt-style normalisation).

    Zeroing a channel changes the LayerNorm's mean and variance over the remaining channels, so masking does not
    equal removal here: the engine has to fall back to physical pruning.
    """

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.LayerNorm(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv1(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_layernorm(num_classes: int = 10) -> nn.Module:
    """LayerNorm over channels between two convs."""
    return TinyLayerNormNet(num_classes)


class TinyGroupedNet(nn.Module):
    """Stem, 1x1 conv, 3x3 conv with groups=4, 1x1 conv (ResNeXt/RegNet style).

    The 1x1 conv before the grouped conv has a bias and a sigmoid instead of BN-ReLU, so its masked channels reach
    the grouped conv as 0.5: masking equals removal only if the grouped conv's input slices are zeroed in the right
    conv groups. The grouped conv has 8 filters per conv group against 4 input channels per conv group.
    """

    def __init__(self, num_classes: int = 10, width: int = 16, groups: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.reduce = nn.Conv2d(8, width, 1)
        self.grouped = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU()
        )
        self.project = nn.Sequential(nn.Conv2d(2 * width, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sigmoid(self.reduce(self.stem(x)))
        x = self.project(self.grouped(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_grouped(num_classes: int = 10) -> nn.Module:
    """1x1 conv -> 3x3 conv with groups=4 -> 1x1 conv."""
    return TinyGroupedNet(num_classes)


class TinyChannelScale(nn.Module):
    """conv, a learnable per-channel scale (a bare ``nn.Parameter``, LayerScale-style), sigmoid, conv: the scale is
    a group member that is not a module, and the sigmoid makes masked channels 0.5 at the consumer."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, width).reshape(1, width, 1, 1))
        self.conv2 = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(torch.sigmoid(self.conv1(x) * self.scale))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_channel_scale(num_classes: int = 10) -> nn.Module:
    """A per-channel ``nn.Parameter`` scale between two convs."""
    return TinyChannelScale(num_classes)


class ResidualNet(nn.Module):
    """Stem conv (with bias), an identity block whose second conv (with bias) is coupled to the stem, a strided
    block whose second conv is coupled to its 1x1 downsample conv, and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.a = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.d = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.e = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.down = nn.Conv2d(8, 16, 1, stride=2, bias=False)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = torch.relu(x + self.b(torch.relu(self.a(x))))
        x = torch.relu(self.down(x) + self.e(torch.relu(self.d(x))))
        return self.fc(x.mean(dim=(2, 3)))

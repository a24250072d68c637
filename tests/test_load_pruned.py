"""``load_pruned`` rebuilds an exported pruned model of every architecture family from a fresh dense model, the JSON
and the state dict: layer subclasses keep what their constructor set, per-channel extras and the sizes a model cuts
its channels with follow the pruning."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis.planning.export import export_pruned, load_pruned
from analysis.structure.criteria import lowest_channels
from analysis.structure.cuts import PieceSizes, register, unregister
from analysis.structure.groups import find_prunable
from analysis.structure.physical import jointly_pruned_copy

timm = pytest.importorskip("timm")


def random_model(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` with weights and BatchNorm statistics from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def spread_removals(model: nn.Module, x: torch.Tensor, groups: int = 4) -> list[tuple[str, list[int]]]:
    """A quarter of the channels of ``groups`` prunable conv/linear units of separate groups, spread over the
    model (seeded random channel scores, evenly across conv groups where needed)."""
    units = [unit for unit in find_prunable(model, x) if unit.prunable and unit.kind != "heads"]
    scores = torch.Generator().manual_seed(0)
    taken: set[str] = set()
    removals: list[tuple[str, list[int]]] = []
    for unit in units[:: max(1, len(units) // groups)] + units:
        blocks = max(1, len(unit.conv_blocks))
        count = max(blocks, round(unit.channels / 4) // blocks * blocks)
        if unit.name in taken or count >= unit.channels or len(removals) == groups:
            continue
        taken.update([unit.name, *unit.coupled_params])
        removals.append((unit.module_name, lowest_channels(torch.rand(unit.channels, generator=scores), count,
                                                           unit.conv_blocks)))  # fmt: skip
    return removals


def assert_reloads(build: Callable[[], nn.Module], size: int, tmp_path: Path, groups: int = 4) -> dict:
    """Prune ``build()``'s model, export it, reload it into a fresh dense model built with other weights: the same
    parameter shapes and the same logits. Returns the export's JSON."""
    model, x = random_model(build, 0), torch.randn(2, 3, size, size)
    pruned = jointly_pruned_copy(model, spread_removals(model, x, groups), x)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())
    export_pruned(pruned, model, tmp_path)
    loaded = load_pruned(random_model(build, 1), tmp_path)
    assert [(n, p.shape) for n, p in loaded.named_parameters()] == [(n, p.shape) for n, p in pruned.named_parameters()]
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), pruned(x), rtol=0, atol=0)
    return json.loads((tmp_path / "pruned_channels.json").read_text())


def timm_model(name: str) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=10)


def test_efficientnet_lite_reloads_with_its_own_activation(tmp_path: Path) -> None:
    """EfficientNet-Lite's ``BatchNormAct2d`` holds ReLU6: rebuilding it from the BatchNorm arguments gave the
    default ReLU (the reloaded logits differed)."""
    changed = assert_reloads(timm_model("efficientnet_lite0"), 64, tmp_path)["changed_layers"]
    assert "BatchNormAct2d" in {shape["type"] for shape in changed.values()}


FAMILIES = [
    pytest.param("tf_efficientnetv2_b0", id="tf_efficientnetv2_b0 (Conv2dSame)"),
    pytest.param("convnext_atto", id="convnext_atto (LayerNorm2d)"),
    pytest.param("rexnet_100", id="rexnet_100 (stored slice bound)"),
    pytest.param("mixnet_s", id="mixnet_s (stored split sizes)"),
    pytest.param("nf_resnet26", id="nf_resnet26 (ScaledStdConv2d gain)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_timm_families_reload(name: str, tmp_path: Path) -> None:
    """One model per kind of layer the rebuild must keep as it is built; the coverage sweep's other families are
    built from the same layers."""
    assert_reloads(timm_model(name), 64, tmp_path)


class GainConv(nn.Conv2d):
    """A conv subclass with its own constructor arguments and a per-output-channel ``gain`` (timm's
    ``ScaledStdConv2d`` style): the base class's arguments cannot build it."""

    def __init__(self, channels_in: int, channels_out: int, *, scale: float) -> None:
        super().__init__(channels_in, channels_out, 3, padding=1)
        self.scale = scale
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, channels_out).reshape(-1, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.gain * self.scale, self.bias)


class NormAct(nn.BatchNorm2d):
    """BatchNorm with its activation inside (timm's ``BatchNormAct2d`` style)."""

    def __init__(self, channels: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__(channels)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class SplitNet(nn.Module):
    """A ``GainConv`` -> ``NormAct`` stem, a conv whose output is split at stored sizes into two convs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.norm = GainConv(3, 12, scale=2.0), NormAct(12, nn.Hardtanh)
        self.mix = nn.Conv2d(12, 12, 1)
        self.splits = [4, 8]
        self.first, self.second = nn.Conv2d(4, 4, 1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(self.mix(self.norm(self.stem(x))), self.splits, dim=1)
        return self.head(torch.cat([self.first(a), self.second(b)], dim=1).mean(dim=(2, 3)))


def test_layer_subclasses_extras_and_cut_sizes_follow_the_export(tmp_path: Path) -> None:
    """The reloaded conv keeps its own ``scale`` and loses the removed channels' ``gain``, the norm keeps its
    activation, and the split sizes the model stores are the pruned copy's (the JSON records them)."""
    register(SplitNet, PieceSizes("splits"))
    try:
        model, x = random_model(SplitNet, 0), torch.randn(2, 3, 8, 8)
        pruned = jointly_pruned_copy(model, [("stem", [1, 6, 9]), ("mix", [1, 6, 9])], x)
        export_pruned(pruned, model, tmp_path)
        description = json.loads((tmp_path / "pruned_channels.json").read_text())
        assert description["changed_sizes"] == {"": {"splits": [3, 6]}}
        assert description["changed_layers"]["stem"]["type"] == "GainConv"
        loaded = load_pruned(random_model(SplitNet, 1), tmp_path)
        assert isinstance(loaded.stem, GainConv) and loaded.stem.scale == 2.0 and loaded.stem.gain.shape[0] == 9
        assert isinstance(loaded.norm.act, nn.Hardtanh) and loaded.splits == [3, 6]
        with torch.inference_mode():
            torch.testing.assert_close(loaded(x), pruned(x), rtol=0, atol=0)
    finally:
        unregister(SplitNet)


class Mixer(nn.Module):
    """A layer whose width cannot change (its ``linear`` reads it), registered with a ``FixedWidthPruner``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x.mean(dim=(2, 3)))[:, :, None, None]


class FixedWidthNet(nn.Module):
    """A prunable conv whose group the fixed-width ``Mixer`` is not in, then the mixer."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv, self.mixer = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 6, 3, padding=1), Mixer(6)
        self.head = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.conv(torch.relu(self.stem(x)))).mean(dim=(2, 3)))


def test_a_model_with_a_fixed_width_layer_exports_and_reloads(tmp_path: Path) -> None:
    """A fixed-width customised layer (torchvision MaxViT's attention) has no channels to record: the export
    asked its pruner for them and failed."""
    from analysis.structure import custom_layers

    custom_layers.register(Mixer, custom_layers.FixedWidthPruner("its width is fixed", "linear"))
    try:
        model, x = random_model(FixedWidthNet, 0), torch.randn(2, 3, 8, 8)
        pruned = jointly_pruned_copy(model, [("stem", [0, 5])], x)
        export_pruned(pruned, model, tmp_path)
        assert "mixer" not in json.loads((tmp_path / "pruned_channels.json").read_text())["changed_layers"]
        loaded = load_pruned(random_model(FixedWidthNet, 1), tmp_path)
        assert loaded.stem.out_channels == 6
        with torch.inference_mode():
            torch.testing.assert_close(loaded(x), pruned(x), rtol=0, atol=0)
    finally:
        custom_layers.unregister(Mixer)

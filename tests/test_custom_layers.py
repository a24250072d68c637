"""Customised layers (:mod:`analysis.structure.custom_layers`): a layer scale with a stored broadcast shape (timm's
``metaformer.Scale`` in PoolFormer) is one node of the dependency graph, removed by its own pruner, and masking, cost
counting, BatchNorm re-estimation and the export treat it as removal does."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis.engine._modes import MaskCheck
from analysis.engine.batchnorm import affected_batchnorms, changed_sources
from analysis.planning.export import export_pruned, load_pruned
from analysis.structure.custom_layers import (
    OPTIONAL,
    LayerScalePruner,
    channel_pruner,
    customized_pruners,
    register,
    unregister,
)
from analysis.structure.flops import CostModel, count_cost
from analysis.structure.groups import build_dependency_graph, find_prunable, removal_group
from analysis.structure.masking import zeroed_slices
from analysis.structure.physical import pruned_copy

IMAGE = (2, 3, 16, 16)


class StoredShapeScale(nn.Module):
    """timm's metaformer.Scale: ``x * self.scale.view(self.shape)`` with ``self.shape`` stored at construction."""

    def __init__(self, dim: int, nchw: bool = True) -> None:
        super().__init__()
        self.shape = (dim, 1, 1) if nchw else (dim,)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(self.shape)


class ScaledNet(nn.Module):
    """conv -> scale -> BatchNorm -> conv -> scale, added to the BatchNorm's output, BatchNorm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = StoredShapeScale(8)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.scale2 = StoredShapeScale(8)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.scale(self.stem(x))))
        x = x + self.scale2(torch.relu(self.conv(x)))
        return self.head(torch.relu(self.bn2(x)).mean(dim=(2, 3)))


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    register(StoredShapeScale, LayerScalePruner())
    try:
        yield
    finally:
        unregister(StoredShapeScale)


def model() -> ScaledNet:
    torch.manual_seed(0)
    net = ScaledNet().eval()
    with torch.no_grad():
        for bn in (net.bn, net.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    return net


def test_the_pruner_slices_the_parameter_and_rewrites_the_stored_shape() -> None:
    scale = StoredShapeScale(6)
    scale.scale.requires_grad_(False)
    pruner = LayerScalePruner()
    assert pruner.get_out_channels(scale) == pruner.get_in_channels(scale) == 6
    assert pruner.prune_in_channels == pruner.prune_out_channels  # Torch-Pruning's mark of coupled in/out channels
    pruner.prune_out_channels(scale, [4, 1, 4])
    assert scale.shape == (4, 1, 1) and scale.scale.shape == (4,) and not scale.scale.requires_grad
    torch.testing.assert_close(scale.scale.data, torch.linspace(0.5, 1.5, 6)[[0, 2, 3, 5]])
    flat = StoredShapeScale(4, nchw=False)
    LayerScalePruner().prune_in_channels(flat, [0])
    assert flat.shape == (3,)


def test_a_registered_layer_is_one_group_member_and_every_unit_masks_exactly() -> None:
    net = model()
    x = torch.randn(IMAGE)
    units = {unit.module_name: unit for unit in find_prunable(net, x)}
    assert units["stem"].prunable and units["conv"].prunable, (units["stem"].reason, units["conv"].reason)
    assert "scale (StoredShapeScale, out)" in units["stem"].members
    assert "scale2 (StoredShapeScale, out)" in units["stem"].members  # coupled through the residual add
    graph = build_dependency_graph(net, x)
    assert channel_pruner(graph, net.scale) is customized_pruners()[StoredShapeScale]
    assert channel_pruner(graph, net.stem) is None and channel_pruner(graph, net.scale.scale) is None
    group = removal_group(graph, net.stem, [1, 5])
    assert sum(item.dep.target.module is net.scale for item in group) == 1  # in and out are one item
    assert any(tensor.data_ptr() == net.scale.scale.data_ptr() for tensor, _ in zeroed_slices(graph, group))
    checker = MaskCheck(net, graph, x)
    for name in ("stem", "conv"):
        check = checker.choose(units[name], [1, 5], None)
        assert check.mode == "mask", (name, check.difference)
    pruned = pruned_copy(net, "stem", [1, 5], x)
    assert pruned.scale.shape == (6, 1, 1) and pruned.scale2.scale.shape == (6,)


def test_costs_and_batchnorm_sources_of_a_group_with_a_registered_layer() -> None:
    net = model()
    x = torch.randn(IMAGE)
    graph = build_dependency_graph(net, x)
    costs = CostModel(net, x)
    for name in ("stem", "conv"):
        variant = costs.variant(graph, name, [0, 3, 7])
        physical = count_cost(pruned_copy(net, name, [0, 3, 7], x), x)
        assert (variant.macs, variant.params) == (physical.macs, physical.params), name
    group = removal_group(graph, net.stem, [0, 3])
    assert set(changed_sources(graph, group)) == {net.conv, net.head}  # they lose inputs; the scales keep the rest
    assert affected_batchnorms(graph, [group]) == [net.bn2]  # bn, after a scale that only loses channels, keeps its


def test_classes_of_optional_packages_take_part_once_their_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is imported to look for them: a model holding one has imported its module."""

    class Other(StoredShapeScale):
        pass

    monkeypatch.setitem(OPTIONAL, ("not_imported_here", "Other"), LayerScalePruner())
    assert Other not in customized_pruners()
    monkeypatch.setitem(sys.modules, "not_imported_here", types.SimpleNamespace(Other=Other))
    assert isinstance(customized_pruners()[Other], LayerScalePruner)
    assert customized_pruners()[StoredShapeScale] is not customized_pruners()[Other]


def test_timm_layer_scale_is_registered_when_timm_is_there() -> None:
    metaformer = pytest.importorskip("timm.models.metaformer")  # the optional extra; CI installs it
    assert isinstance(customized_pruners()[metaformer.Scale], LayerScalePruner)


def test_an_export_with_a_registered_layer_loads_into_a_fresh_dense_model(tmp_path: Path) -> None:
    """The exported JSON records the layer's channels; loading shrinks a fresh dense model with the layer's pruner."""
    net = model()
    x = torch.randn(IMAGE)
    pruned = pruned_copy(net, "stem", [1, 5], x)
    export_pruned(pruned, net, tmp_path)
    changed = json.loads((tmp_path / "pruned_channels.json").read_text())["changed_layers"]
    assert changed["scale"] == changed["scale2"] == {"type": "StoredShapeScale", "channels": 6}
    loaded = load_pruned(model(), tmp_path)
    assert loaded.scale.shape == (6, 1, 1)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), pruned(x))

"""Models Torch-Pruning cannot trace as a whole (torchvision ShuffleNetV2) are traced in parts: units whose group
stays inside a traced submodule are analysed exactly, the others are left out with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from analysis import analysis_prune
from analysis.compat.topology import dependency_sets
from analysis.engine._modes import MaskCheck
from analysis.engine.batchnorm import affected_batchnorms
from analysis.errors import ModelError
from analysis.structure.flops import CostModel, count_cost
from analysis.structure.groups import PrunableUnit, build_dependency_graph, eval_mode, find_prunable, removal_group
from analysis.structure.masking import masked
from analysis.structure.physical import jointly_pruned_copy, pruned_copy
from analysis.structure.submodule_graphs import PartGraphs

STAGES = {"stage2": 4, "stage3": 8, "stage4": 4}  # blocks per stage of shufflenet_v2_x0_5
BRANCH_UNITS = {f"{stage}.{block}.branch2.0.weight" for stage, blocks in STAGES.items() for block in range(blocks)}
SHUFFLE = "the largest part around it that Torch-Pruning can trace (it cannot map this model's channel shuffle"


def shufflenet() -> tuple[nn.Module, torch.Tensor]:
    """shufflenet_v2_x0_5 with random weights and BatchNorm statistics (so a removal changes the logits)."""
    torch.manual_seed(0)
    model = torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=10).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model, torch.randn(4, 3, 32, 32)


def block_output(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The output of ``model``'s submodule ``name`` when ``model`` runs on ``x``."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(name).register_forward_hook(lambda module, inputs, output: seen.append(output))
    try:
        with torch.inference_mode():
            model(x)
    finally:
        handle.remove()
    return seen[0]


def test_shufflenet_v2_branch_units_are_prunable_and_exact() -> None:
    """Every branch2's first 1x1 (its group: BN, depthwise conv, BN, the last 1x1's inputs) is prunable; masking it
    equals the physically pruned model, which really is narrower, and its cost equals the pruned copy's."""
    model, x = shufflenet()
    units = {unit.name: unit for unit in find_prunable(model, x)}
    assert {name for name, unit in units.items() if unit.prunable} == BRANCH_UNITS
    with eval_mode(model):
        graph = build_dependency_graph(model, x)
    assert isinstance(graph, PartGraphs)
    check, costs = MaskCheck(model, graph, x), CostModel(model, x)
    for name in sorted(BRANCH_UNITS)[::3]:  # both kinds of block in every stage, to keep the test short
        unit = units[name]
        channels = list(range(0, unit.channels // 2, 2))
        mode = check.choose(unit, channels, None)
        assert mode.mode == "mask" and float(mode.difference) <= 1e-6, (name, mode.difference)
        smaller = pruned_copy(model, unit.module_name, channels, x)
        assert smaller.get_submodule(unit.module_name).out_channels == unit.channels - len(channels)
        with torch.inference_mode():
            physical = smaller(x)
        assert mode.masked_logits is not None
        torch.testing.assert_close(physical, mode.masked_logits, rtol=0, atol=1e-6)
        block = unit.module_name.rpartition(".branch2")[0]  # a random ShuffleNet's logits barely depend on it
        change = block_output(smaller, block, x) - block_output(model, block, x)
        assert change.abs().max() > 1e-2, "the removal must change the block's output, else nothing is tested"
        assert costs.variant(graph, unit.module_name, channels) == count_cost(smaller, x)


def test_shufflenet_v2_units_crossing_a_part_carry_the_reason() -> None:
    """The stem, branch1's and branch2's last 1x1 and conv5 leave their part (their channels go through the
    concat and shuffle, or to the next block): left out with a reason about the model, the classifier as output."""
    model, x = shufflenet()
    units = {unit.name: unit for unit in find_prunable(model, x)}
    crossing = ["conv1.0", "stage2.0.branch1.2", "stage3.1.branch2.5", "stage4.3.branch2.5", "conv5.0"]
    for name in crossing:
        reason = units[f"{name}.weight"].reason
        assert reason is not None and SHUFFLE in reason, (name, reason)
    assert units["stage3.1.branch2.5.weight"].reason.startswith("its channels leave stage3.1,")  # type: ignore[union-attr]
    assert units["fc.weight"].reason == "coupled to the model output (fc)"
    assert units["stage3.1.branch2.3.weight"].reason.startswith("depthwise conv")  # type: ignore[union-attr]


def test_shufflenet_v2_joint_removal_and_downstream_batchnorms() -> None:
    """Two branch units removed together (a plan's copy) equal masking both groups; the BatchNorms a removal
    changes run on through every later part (the parts' links are not traced, so all of them count)."""
    model, x = shufflenet()
    with eval_mode(model):
        graph = build_dependency_graph(model, x)
    removals = [("stage2.1.branch2.0", [0, 3, 5]), ("stage4.2.branch2.0", [1, 2])]
    groups = [removal_group(graph, model.get_submodule(name), channels) for name, channels in removals]
    smaller = jointly_pruned_copy(model, removals, x)
    with masked(graph, groups[0]), masked(graph, groups[1]), torch.inference_mode():
        expected = model(x)
    with torch.inference_mode():
        torch.testing.assert_close(smaller(x), expected, rtol=0, atol=1e-5)
    names = {module: name for name, module in model.named_modules()}
    changed = {names[layer] for layer in affected_batchnorms(graph, groups[:1])}
    assert {"stage2.1.branch2.6", "stage3.0.branch1.1", "stage4.3.branch2.6", "conv5.1"} <= changed
    assert "stage2.1.branch2.4" not in changed and "stage2.0.branch2.6" not in changed


def test_shufflenet_v2_analysis_prune_is_exact(tmp_path: Path) -> None:
    """The whole run on two branch units: both evaluated by masking, which equals removal (difference 0)."""
    model, x = shufflenet()
    data = [(x, torch.tensor([1, 2, 3, 4]))]
    params = ["stage2.0.branch2.0.weight", "stage3.1.branch2.0.weight"]
    analysis_prune(model, data, tmp_path / "shufflenet.pkl", pruned_ratios=(0.5,), prune_params=params,
                   metric_mode="absolute", adaptive_bn=True, calibration=data, progress=False)  # fmt: skip
    sidecar = json.loads((tmp_path / "shufflenet.pkl.json").read_text())
    records = next(value for value in sidecar.values() if isinstance(value, dict) and params[0] in value)
    for name in params:
        assert records[name]["mode"] == "mask" and records[name]["mask_vs_physical_max_abs_diff"] == 0.0


def test_dependency_sets_of_a_model_traced_in_parts_are_an_error() -> None:
    """The sets of a layer whose channels leave its part would be too small: one clear error, not a wrong answer."""
    model, x = shufflenet()
    with pytest.raises(ModelError, match="only in parts"):
        dependency_sets(model, x)


# ----------------------------------------------------- a part whose unit's group reaches the part's input is not kept


def channel_shuffle(x: torch.Tensor) -> torch.Tensor:
    batch, channels, height, width = x.shape
    return x.view(batch, 2, channels // 2, height, width).transpose(1, 2).contiguous().view(batch, -1, height, width)


class _ShuffleUnit(nn.Module):
    """ShuffleNetV2's stride-1 unit (three of them in a row make Torch-Pruning raise while tracing)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.pw = nn.Conv2d(channels // 2, channels // 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=1)
        return channel_shuffle(torch.cat((x1, F.relu(self.pw(x2))), dim=1))


class _Residual(nn.Module):
    """``conv3(x + conv2(relu(conv1(x))))``: conv2's channels are the input's (a residual add inside the part)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 6, 1)
        self.conv2 = nn.Conv2d(6, channels, 3, padding=1)
        self.conv3 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(x + self.conv2(F.relu(self.conv1(x))))


class _InputCoupled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = _Residual(8)
        self.units = nn.Sequential(_ShuffleUnit(8), _ShuffleUnit(8), _ShuffleUnit(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.units(self.block(F.relu(self.stem(x)))).mean(dim=(2, 3)))


def test_a_group_reaching_the_parts_input_or_output_is_left_out() -> None:
    """``block`` traces on its own, but conv2's group runs through the residual add into the block's input, which
    the stem produces outside it: the part's graph would miss the stem, so conv2 must not be a unit. conv3's group
    is the block's output. conv1's group (conv2's inputs) stays inside and is exact."""
    model = _InputCoupled().eval()
    x = torch.randn(2, 3, 16, 16)
    units: dict[str, PrunableUnit] = {unit.module_name: unit for unit in find_prunable(model, x)}
    for name in ("block.conv2", "block.conv3", "stem"):
        assert (units[name].reason or "").startswith("its channels leave "), (name, units[name].reason)
    assert units["block.conv1"].prunable, units["block.conv1"].reason
    with eval_mode(model):
        graph = build_dependency_graph(model, x)
    mode = MaskCheck(model, graph, x).choose(units["block.conv1"], [1, 4], None)
    assert mode.mode == "mask", mode.difference

"""Channel rounding (``round_to``): every removal keeps a multiple of N channels (of lcm(N, conv groups) with grouped
convs), at least N; a ratio maps to the nearest allowed kept count, ties keeping more.

The counting rule is checked on a dense grid (hypothesis is not installed in this environment)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from analysis import analysis_prune
from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.planning._curves import interpolate, monotone_curve
from analysis.planning.export import CHANNELS_FILE, export_pruned, layer_shapes
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import build_plan, param_count, plan_from_ratios
from analysis.structure.criteria import allowed_counts, channels_to_remove, removal_count, select_channels
from analysis.structure.groups import find_prunable
from analysis.structure.physical import jointly_pruned_copy

import bn_models
import tiny_models
from helpers import batches, pseudo_labelled, randomize

RATIOS = sorted({i / 100 for i in range(1, 100)} | {1 / 3, 2 / 3, 1 / 8, 3 / 8, 5 / 8, 7 / 8, 1 / 16, 0.999})
ROUND_TO = [1, 2, 3, 4, 8, 16]
BLOCKS = [0, 2, 3, 4]


def step_of(blocks: int, round_to: int) -> int:
    return math.lcm(round_to, blocks or 1)


def expected_allowed(channels: int, blocks: int, round_to: int) -> list[int]:
    """Every count that removes nothing, or keeps a positive multiple of the step."""
    step = step_of(blocks, round_to)
    return sorted({0} | {channels - kept for kept in range(step, channels + 1, step)})


def nearest_allowed(channels: int, ratio: float, blocks: int, round_to: int) -> int:
    """The allowed count whose kept channels are nearest to the unrounded kept count; ties keep more."""
    kept = channels - channels_to_remove(channels, ratio)
    return min(expected_allowed(channels, blocks, round_to), key=lambda count: (abs(channels - count - kept), count))


def grid(blocks: int, round_to: int, multiples_of_step: bool | None = None):
    """(channels, ratio) pairs: channels 2..64 divisible by ``blocks`` (optionally only (non-)multiples of the step)."""
    step = step_of(blocks, round_to)
    for channels in range(2, 65):
        if blocks and channels % blocks:
            continue
        if multiples_of_step is not None and (channels % step == 0) != multiples_of_step:
            continue
        for ratio in RATIOS:
            yield channels, ratio


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("round_to", ROUND_TO)
def test_removal_counts_keep_positive_multiples_of_the_step_and_are_allowed(blocks: int, round_to: int) -> None:
    step = step_of(blocks, round_to)
    checked = 0
    for channels, ratio in grid(blocks, round_to):
        allowed = allowed_counts(channels, blocks, round_to)
        assert allowed == expected_allowed(channels, blocks, round_to), (channels, blocks, round_to)
        count = removal_count(channels, ratio, blocks, round_to)
        kept = channels - count
        assert count in allowed, (channels, ratio)
        assert count == 0 or (kept % step == 0 and kept >= step), (channels, ratio, count)
        assert 0 <= count < channels
        checked += 1
    assert checked > 1000


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("round_to", ROUND_TO)
def test_removal_count_never_decreases_with_the_ratio(blocks: int, round_to: int) -> None:
    for channels in range(2, 65):
        if blocks and channels % blocks:
            continue
        counts = [removal_count(channels, ratio, blocks, round_to) for ratio in RATIOS]
        assert counts == sorted(counts), (channels, blocks, round_to)


@pytest.mark.parametrize("blocks", BLOCKS)
def test_round_to_1_is_the_old_rule(blocks: int) -> None:
    pairs = list(grid(blocks, 1))
    assert len(pairs) >= 15 * len(RATIOS)
    for channels, ratio in pairs:
        step = blocks or 1
        assert removal_count(channels, ratio, blocks, 1) == channels_to_remove(channels, ratio) // step * step
    if not blocks:
        assert allowed_counts(10) == list(range(10))


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("round_to", [2, 3, 4, 8, 16])
def test_a_ratio_maps_to_the_nearest_allowed_kept_count_ties_keep_more(blocks: int, round_to: int) -> None:
    """Channel counts that are multiples of the step (the usual case: 16, 24, 32, 64 ... with round_to 8)."""
    pairs = list(grid(blocks, round_to, multiples_of_step=True))
    assert pairs  # the grid holds at least one multiple of the step (48 for the largest, lcm(16, 3))
    for channels, ratio in pairs:
        assert removal_count(channels, ratio, blocks, round_to) == nearest_allowed(channels, ratio, blocks, round_to), (
            channels, ratio
        )  # fmt: skip


@pytest.mark.parametrize("round_to", [8])
def test_nearest_allowed_count_also_when_the_channels_are_not_a_multiple_of_the_step(round_to: int) -> None:
    wrong = [
        (channels, ratio, removal_count(channels, ratio, 0, round_to), nearest_allowed(channels, ratio, 0, round_to))
        for channels, ratio in grid(0, round_to, multiples_of_step=False)
        if removal_count(channels, ratio, 0, round_to) != nearest_allowed(channels, ratio, 0, round_to)
    ]
    assert removal_count(20, 0.1, 0, round_to) == 0  # 18 kept unrounded: 20 (remove nothing) and 16 tie; keep more
    assert not wrong


@pytest.mark.parametrize(
    ("channels", "ratio", "blocks", "round_to", "count"),
    [
        (16, 0.3, 0, 8, 8),  # 5 removed unrounded, 11 kept -> 8 kept
        (16, 0.25, 0, 8, 0),  # 12 kept is halfway between 8 and 16: keep more
        (24, 0.5, 0, 8, 8),  # 12 kept: halfway between 8 and 16 -> 16
        (32, 0.3, 0, 8, 8),  # 10 removed unrounded, 22 kept -> 24
        (16, 0.99, 0, 8, 8),  # at least round_to channels stay
        (4, 0.5, 0, 8, 0),  # no multiple of 8 can be kept: nothing is removed
        (16, 0.3, 4, 1, 4),  # grouped conv alone: 5 rounded down to a multiple of 4
        (24, 0.3, 4, 3, 12),  # lcm(3, 4) = 12: 17 kept -> 12
        (16, 0.3, 4, 8, 8),  # lcm(8, 4) = 8
        (48, 0.4, 0, 16, 16),  # 19 removed unrounded, 29 kept -> 32
    ],
)
def test_worked_examples(channels: int, ratio: float, blocks: int, round_to: int, count: int) -> None:
    assert removal_count(channels, ratio, blocks, round_to) == count
    scores = torch.arange(channels, 0, -1, dtype=torch.float32)  # the last channels score lowest
    block_lists = [list(range(b * channels // blocks, (b + 1) * channels // blocks)) for b in range(blocks)]
    chosen = select_channels(scores, ratio, block_lists, round_to)
    assert len(chosen) == count
    for block in block_lists:  # even removal per conv group
        assert sum(c in block for c in chosen) == count // blocks


def analysed(tmp_path: Path, round_to: int = 8, name: str = "s.pkl") -> tuple[torch.nn.Module, list, Path]:
    torch.manual_seed(0)
    model = randomize(bn_models.rounding_net())
    data = pseudo_labelled(model, batches(count=2))
    path = tmp_path / name
    analysis_prune(model, data, path, pruned_ratios=(0.2, 0.4, 0.6), metric="ce", round_to=round_to, progress=False)
    return model, data, path


def test_analysis_with_round_to_removes_rounded_counts_and_records_them(tmp_path: Path) -> None:
    model, data, path = analysed(tmp_path)
    sidecar = load_sidecar(path)
    assert sidecar["fingerprint"]["settings"]["round_to"] == 8
    rounded_differently = 0
    for name, info in sidecar["params"].items():
        assert info["round_to"] == 8
        for ratio, variant in info["variants"].items():
            channels, removed = variant["channels"], variant["channels_removed"]
            assert channels in (16, 24, 32)
            assert (channels - removed) % 8 == 0 and channels - removed >= 8, (name, ratio)
            assert removed == removal_count(channels, float(ratio), 0, 8)
            rounded_differently += removed != channels_to_remove(channels, float(ratio))
    assert rounded_differently >= 6  # the unrounded rule would have recorded other counts
    assert len(load_sensitivities(path)) == 4
    with pytest.raises(AnalysisFileError, match=r"round_to 8 \(this run uses 1\)"):
        analysis_prune(model, data, path, pruned_ratios=(0.2, 0.4, 0.6), metric="ce", round_to=1, progress=False)
    with pytest.raises(ConfigError, match="round_to must be a positive integer"):
        analysis_prune(model, data, tmp_path / "other.pkl", round_to=0)


def test_grouped_conv_groups_keep_multiples_of_the_lcm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomize(tiny_models.tiny_grouped())
    data = pseudo_labelled(model, batches(count=1))
    analysis_prune(model, data, tmp_path / "g.pkl", pruned_ratios=(0.3, 0.6), metric="ce", round_to=8,
                   prune_params=["stem.0.weight", "reduce.weight"], progress=False)  # fmt: skip
    params = load_sidecar(tmp_path / "g.pkl")["params"]
    assert params["reduce.weight"]["conv_groups"] == 4
    for info in params.values():
        for variant in info["variants"].values():
            kept = variant["channels"] - variant["channels_removed"]
            assert kept % 8 == 0 and kept >= 8
    assert params["reduce.weight"]["variants"]["0.3"]["channels_removed"] == 8  # 5 unrounded, 11 kept -> 8


def test_budget_plan_and_export_keep_multiples_of_round_to(tmp_path: Path) -> None:
    model, data, path = analysed(tmp_path)
    example = data[0][0]
    plan = build_plan(model, example, path, 0.3)
    assert plan.groups and plan.settings["round_to"] == 8 and plan.reduction >= 0.3
    for group in plan.groups:
        assert (group.channels - len(group.removed)) % 8 == 0 and len(group.removed) > 0
    pruned = jointly_pruned_copy(model, plan.removals(), example)
    export_pruned(pruned, model, tmp_path / "export")
    changed = json.loads((tmp_path / "export" / CHANNELS_FILE).read_text())["changed_layers"]
    dense = layer_shapes(model)
    convs = [name for name, shape in changed.items() if shape["type"] == "Conv2d"]
    pruned_convs = [name for name in convs if changed[name]["out_channels"] != dense[name]["out_channels"]]
    assert pruned_convs
    assert all(changed[name]["out_channels"] % 8 == 0 for name in pruned_convs)
    assert all(s["num_features"] % 8 == 0 for s in changed.values() if s["type"] == "BatchNorm2d")


def test_measured_plan_keeps_multiples_of_round_to(tmp_path: Path) -> None:
    model, data, path = analysed(tmp_path)
    calibration = [(images + 0.5, labels) for images, labels in data]  # other images than the scored ones
    scoring = PlanScoring(data, "data", calibration, calibration[:1], "calibration")
    plan = build_measured_plan(model, data[0][0], path, 0.3, scoring, settings=SearchSettings(evaluations=12),
                               progress=False)  # fmt: skip
    assert plan.groups and plan.reduction >= 0.3 and plan.search is not None
    for group in plan.groups:
        assert (group.channels - len(group.removed)) % 8 == 0 and len(group.removed) > 0


def test_budget_plan_without_round_to_is_not_rounded(tmp_path: Path) -> None:
    """The contrast case, so that the rounding above is the setting's doing and not the model's."""
    model, data, path = analysed(tmp_path, round_to=1)
    plan = build_plan(model, data[0][0], path, 0.3)
    assert any((group.channels - len(group.removed)) % 8 for group in plan.groups)


def test_plan_from_ratios_maps_ratios_to_the_rounded_counts(tmp_path: Path) -> None:
    model, data, path = analysed(tmp_path)
    ratios = {"conv1.weight": 0.3, "conv2.weight": 0.3, "conv3.weight": 0.45}
    plan = plan_from_ratios(model, data[0][0], path, ratios)
    removed = {group.ranking_param: len(group.removed) for group in plan.groups}
    assert removed == {"conv1.weight": 8, "conv2.weight": 8, "conv3.weight": 16}
    for group in plan.groups:
        assert removed[group.ranking_param] == removal_count(group.channels, ratios[group.ranking_param], 0, 8)
    assert plan.groups[-1].members == ["conv3.weight", "conv4.weight"]  # the residual pair shares one removal
    assert plan.settings["round_to"] == 8
    sensitivities = load_sensitivities(path)
    # each prediction reads the curve at the rounded counts the analysis measured; conv3 at 0.2 (8 of 32 removed) lies
    # between the unrounded counts 6 and 13, where a curve over unrounded counts would interpolate another loss
    other = plan_from_ratios(model, data[0][0], path, {"conv3.weight": 0.2})
    for group in [*plan.groups, *other.groups]:
        name = group.ranking_param
        curve = monotone_curve(
            [(removal_count(group.channels, r, 0, 8), loss) for r, loss in sensitivities[name].items()]
        )
        count = len(group.removed)
        expected = interpolate(curve, count) if count <= curve[-1][0] else float("nan")
        assert group.predicted_loss == pytest.approx(expected, nan_ok=True)
    unrounded = plan_from_ratios(model, data[0][0], analysed(tmp_path, round_to=1, name="plain.pkl")[2], ratios)
    assert {g.ranking_param: len(g.removed) for g in unrounded.groups} == {
        "conv1.weight": 5, "conv2.weight": 7, "conv3.weight": 14
    }  # fmt: skip


def test_param_count_follows_the_analysis_rounding() -> None:
    model = randomize(bn_models.rounding_net())
    params = {p.name: p for p in find_prunable(model, torch.randn(1, 3, 16, 16)) if p.prunable}
    assert param_count(params["conv2.weight"], 0.3, 8) == 8 and param_count(params["conv2.weight"], 0.3) == 7
    assert param_count(params["conv3.weight"], 0.6, 8) == 16 and param_count(params["conv3.weight"], 0.6) == 19

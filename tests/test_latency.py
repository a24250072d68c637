"""Latency budgets: the latency table (cached, resumable), plans that meet the budget as measured, and bad settings."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from analysis import analysis_prune
from analysis.errors import UserError
from analysis.io.latency_table import LatencyTable
from analysis.io.record import load_record
from analysis.io.results import load_sidecar
from analysis.planning.latency import LatencyGoalNotReached, LatencyModel
from analysis.planning.latency_plan import MAX_ATTEMPTS, plan_for_latency
from analysis.planning.plan import ALIGNED_PROBES, evenly_spaced, open_planner, param_count
from analysis.planning.probes import measure_table
from analysis.runtimes.timing import Latency
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy

from helpers import CliResult, analysis_config, batches, pseudo_labelled, randomize, tiny_global, write_config
from latency_fakes import MacsRuntime, analysed
from tiny_models import TinyResNet, tiny_resnet


@pytest.fixture
def setting(tmp_path: Path) -> tuple[nn.Module, torch.Tensor, Path]:
    model = randomize(tiny_resnet()).eval()
    return model, batches(count=1)[0][0], analysed(model, tmp_path / "s.pkl")


@pytest.mark.parametrize("misaligned_ms", [0.0, 0.05])
@pytest.mark.parametrize("target", [0.2, 0.5])
def test_a_latency_plan_meets_its_budget_as_measured(setting: Any, target: float, misaligned_ms: float) -> None:
    model, example, path = setting
    runtime = MacsRuntime(example, misaligned_ms)
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=target, round_to=1)
    assert plan.latency is not None and plan.measure == "latency"
    pruned = jointly_pruned_copy(model, plan.removals(), example)
    measured = runtime.latency_of(pruned)
    dense = runtime.latency_of(model)
    assert plan.latency.dense_ms == dense and plan.latency.measured_ms == measured  # what was measured is the plan's
    assert measured <= dense * (1 - target) and plan.latency.met
    assert 1 <= len(plan.latency.attempts) <= MAX_ATTEMPTS
    assert plan.reduction == pytest.approx(1 - measured / dense)
    assert plan.as_dict()["latency"]["met"] is True


def test_a_latency_plan_keeps_a_multiple_of_latency_round_to_channels_in_every_group(tmp_path: Path) -> None:
    """Runtimes run aligned channel counts faster (ONNX Runtime's CPU provider ran MobileNetV2 44.7% slower than dense
    with unaligned counts): by default a latency plan keeps a multiple of 8 channels in every group it prunes, and
    its table probes only such counts; ``round_to=1`` probes the analysed counts too."""
    model = randomize(TinyResNet(width=16)).eval()
    example = batches(count=1)[0][0]
    path = analysed(model, tmp_path / "s.pkl")
    runtime = MacsRuntime(example, misaligned_ms=0.05, multiple=8)
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=0.2)
    assert plan.latency is not None and plan.latency.met and plan.groups
    assert all((group.channels - len(group.removed)) % 8 == 0 for group in plan.groups)
    with eval_mode(model):
        planner, options = open_planner(model, example, load_record(path), "macs")
        every = planner.probe_counts(options, load_record(path).sensitivities, round_to=1)
    channels = {group.key: group.channels for group in options}
    probed = json.loads(Path(plan.latency.table_file).read_text(encoding="utf-8"))["probes"]
    assert probed and all((channels[key] - int(count)) % 8 == 0 for key, by in probed.items() for count in by)
    assert any((channels[key] - count) % 8 for key, counts in every.items() for count in counts)


def test_aligned_probes_are_few_and_a_plan_takes_the_aligned_counts_between_them(tmp_path: Path) -> None:
    """With ``latency_round_to`` 8 each group is probed at its largest aligned count and one near half of it; a plan
    may take every aligned count up to the largest (the ones between probes interpolated), and none beyond it."""
    model = randomize(TinyResNet(width=32)).eval()
    example = batches(count=1)[0][0]
    record = load_record(analysed(model, tmp_path / "s.pkl"))
    with eval_mode(model):
        planner, options = open_planner(model, example, record)
        counts = planner.probe_counts(options, record.sensitivities, round_to=8)
        aligned = {}
        for group in options:
            largest = max(param_count(planner.by_name[m], r) for m in group.members for r in record.sensitivities[m])
            aligned[group.key] = {c.count for c in group.choices if 0 < c.count <= largest and
                                  (group.channels - c.count) % 8 == 0}  # fmt: skip
            assert counts[group.key] == evenly_spaced(sorted(aligned[group.key]), ALIGNED_PROBES)
            assert len(counts[group.key]) <= ALIGNED_PROBES and max(counts[group.key]) == max(aligned[group.key])
        table, _, _ = measure_table(planner, counts, MacsRuntime(example), 1, tmp_path / "s.pkl", progress=False)
        planner.use_latency(LatencyModel(table), round_to=8)
        between = 0
        for group in planner.options(record.sensitivities):
            offered = {c.count for c in group.choices if c.count}
            assert offered == aligned[group.key]
            probed = [0, *counts[group.key]]  # a saving is 0 at 0
            for count in offered - set(probed):
                below, above = (table.saving(group.key, max(c for c in probed if c < count)),
                                table.saving(group.key, min(c for c in probed if c > count)))  # fmt: skip
                assert min(below, above) <= table.saving(group.key, count) <= max(below, above)
                between += 1
    assert between  # some plan count lies between two probes


def test_plans_the_table_over_promises_are_corrected_until_measured_in_budget(setting: Any) -> None:
    """Latency concave in MACs: groups pruned together save less than their savings alone add up to, so a first plan
    can miss; the model is rescaled to the measurement and the plan made again until it meets the budget."""
    model, example, path = setting
    corrected = 0
    for target in (0.35, 0.4, 0.45, 0.5):
        runtime = MacsRuntime(example, power=0.5)
        plan = plan_for_latency(model, example, load_record(path), runtime, reduction=target, round_to=1)
        assert plan.latency is not None and plan.latency.met
        assert runtime.latency_of(jointly_pruned_copy(model, plan.removals(), example)) == plan.latency.measured_ms
        attempts = plan.latency.attempts
        if attempts[0].measured_ms > plan.latency.goal_ms:  # the additive prediction over-promised
            assert attempts[0].predicted_ms <= plan.latency.goal_ms and len(attempts) > 1
            assert attempts[-1].scale < 1.0
            corrected += 1
    assert corrected >= 2


def test_an_absolute_goal_is_met_and_an_impossible_one_refused(setting: Any) -> None:
    model, example, path = setting
    runtime = MacsRuntime(example)
    dense = runtime.latency_of(model)
    plan = plan_for_latency(model, example, load_record(path), runtime, goal_ms=0.8 * dense, round_to=1)
    assert plan.latency is not None and plan.latency.measured_ms <= 0.8 * dense
    with pytest.raises(UserError, match="not below the dense model"):
        plan_for_latency(model, example, load_record(path), runtime, goal_ms=2 * dense, round_to=1)
    with pytest.raises(LatencyGoalNotReached, match=r"not reachable within the analysed ratios: the largest plan") as e:
        plan_for_latency(model, example, load_record(path), runtime, goal_ms=0.501, round_to=1)  # overhead: 0.5 ms
    largest = e.value.outcome.largest  # the measured cause travels with the error, for a caller to show or record
    assert largest is not None and largest.candidate_median > 0.501 and f"{largest.reduction:.1%}" in str(e.value)
    assert e.value.outcome.goal_ms == 0.501 and isinstance(e.value, UserError)
    picks = e.value.outcome.largest_picks  # which plan was measured, so a caller can rebuild and check it
    with eval_mode(model):
        planner, _ = open_planner(model, example, load_record(path))
        removals = planner.removals(picks.items())
    assert len(picks) >= 2 and all(picks.values())
    assert runtime.latency_of(jointly_pruned_copy(model, removals, example)) == pytest.approx(largest.candidate_median)


def test_the_latency_model_predicts_single_groups_exactly_and_is_rescaled_to_a_measurement() -> None:
    table = LatencyTable({"runtime": "fake"}, 10.0, {"a": {2: 8.0, 4: 5.0}, "b": {3: 9.0}})
    model = LatencyModel(table)
    assert model.saved("a", 2) == 2.0 and model.saved("a", 4) == 5.0 and model.saved("a", 3) == 3.5
    assert model.saved("a", 0) == 0.0 and model.saved("b", 6) == 1.0  # beyond the largest probe: its saving
    assert model.predicted_ms({"a": 4, "b": 3}) == 4.0
    fitted = model.fitted({"a": 4, "b": 3}, 6.0)  # measured 6 ms: savings were 6 predicted, 4 real
    assert fitted.predicted_ms({"a": 4, "b": 3}) == pytest.approx(6.0)


def test_the_table_resumes_after_a_kill_without_measuring_again(setting: Any) -> None:
    model, example, path = setting
    with eval_mode(model):
        planner, options = open_planner(model, example, load_record(path))
        counts = planner.probe_counts(options, load_record(path).sensitivities)
        probes = sum(len(c) for c in counts.values())
        assert probes >= 4
        killed = MacsRuntime(example, fail_after=3)
        with pytest.raises(KeyboardInterrupt):
            measure_table(planner, counts, killed, 1, path, progress=False)
        again = MacsRuntime(example)
        table, file, _ = measure_table(planner, counts, again, 1, path, progress=False)
        # the dense model and one probe (between two dense timings) were saved before the kill; the cached dense
        # latency is from another time, so the dense model is timed again before the next probe
        assert again.calls == 1 + 2 * (probes - 1)
        fresh_file = path.with_name("other.pkl")
        fresh, _, _ = measure_table(planner, counts, MacsRuntime(example), 1, fresh_file, progress=False)
        assert table.probes == fresh.probes and table.dense_ms == fresh.dense_ms
        assert table.references == fresh.references  # each probe against the dense timings around it
        cached = MacsRuntime(example)
        measure_table(planner, counts, cached, 1, path, progress=False)
        assert cached.calls == 0 and file.exists()


class HalfTimeRuntime(MacsRuntime):
    """:class:`MacsRuntime` on a machine twice as fast (the table was measured while it was idle)."""

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        steady = super().measure(model, sample_shape, batch)
        return Latency(steady.runtime, steady.device, batch, steady.median_ms / 2, 0.0, 1)


def test_a_reduction_is_judged_against_the_dense_model_measured_beside_the_plan(setting: Any) -> None:
    """The cached table was measured on a machine twice as fast as now: the plan is judged by how much faster than
    the dense model measured beside it, not against a goal from the table's dense latency (which nothing would
    reach), and really is 30% faster."""
    model, example, path = setting
    with eval_mode(model):
        planner, options = open_planner(model, example, load_record(path))
        counts = planner.probe_counts(options, load_record(path).sensitivities)
        measure_table(planner, counts, HalfTimeRuntime(example), 1, path, progress=False)
    runtime = MacsRuntime(example)
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=0.3, round_to=1)
    assert plan.latency is not None and plan.latency.met
    dense, pruned = runtime.latency_of(model), runtime.latency_of(jointly_pruned_copy(model, plan.removals(), example))
    assert plan.latency.attempts[-1].dense_ms == dense == 2 * plan.latency.dense_ms
    assert pruned <= 0.7 * dense and plan.reduction_of("latency") == pytest.approx(1 - pruned / dense)


def test_probes_cover_the_analysed_counts_and_aligned_ones_and_plans_offer_only_probed_counts(tmp_path: Path) -> None:
    """Ratios 0.1/0.3/0.6 remove 2, 5 and 10 of 16 channels: the probes add 8 (8 kept), which no ratio gives."""
    model = randomize(tiny_resnet()).eval()
    example = batches(count=1)[0][0]
    path = tmp_path / "s.pkl"
    analysis_prune(model, pseudo_labelled(model, batches(count=2)), path, pruned_ratios=(0.1, 0.3, 0.6), progress=False)
    record = load_record(path)
    with eval_mode(model):
        planner, options = open_planner(model, example, record)
        counts = planner.probe_counts(options, record.sensitivities)
        added = []
        for group in options:
            analysed = {param_count(planner.by_name[m], r) for m in group.members for r in record.sensitivities[m]}
            largest = max(analysed)
            aligned = {c.count for c in group.choices if 0 < c.count <= largest and (group.channels - c.count) % 8 == 0}
            assert set(counts[group.key]) == (analysed - {0}) | aligned
            added += aligned - analysed
        assert added  # some aligned count is probed that no analysed ratio gives
        table, _, _ = measure_table(planner, counts, MacsRuntime(example), 1, path, progress=False)
        planner.use_latency(LatencyModel(table))
        for group in planner.options(record.sensitivities):
            offered = [c.count for c in group.choices if c.count]
            assert offered and set(offered) <= set(counts[group.key])  # latency is measured, never interpolated


LATENCY_SCRIPT = """import os, sys
onnx = sys.argv[1]
print(f"size-based latency: {os.path.getsize(onnx) / 1000:.3f} ms")
"""


def test_the_command_runtime_plans_a_latency_budget_from_the_command_line(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult]
) -> None:
    """A command whose 'latency' is the ONNX file's size in kB (deterministic, falls with pruning): the plan's
    measured value meets the budget, and the sidecar and the output say so."""
    script = tmp_path / "size.py"
    script.write_text(LATENCY_SCRIPT)
    config = analysis_config(tmp_path, list_data, "slow_cnn", {"pruned_ratios": [0.25, 0.5], "report": False},
                             arch_kwargs={"delay": 0.0})  # fmt: skip
    result = cli("plan", "--config_path", config, "--target_latency_reduction", "0.3", "--runtime", "command",
                 "--runtime_command", f"{sys.executable} {script} {{onnx}}", "--verify", "--export_dir",
                 tmp_path / "export", "--latency_round_to", "1")  # fmt: skip
    assert result.code == 0, result.err
    assert "verified (all groups pruned at once" in result.out and (tmp_path / "export" / "pruned_model.onnx").exists()
    plan = load_sidecar(tmp_path / "out" / "s.pkl")["plan"]
    latency = plan["latency"]
    assert latency["met"] and latency["attempts"][-1]["measured_ms"] <= 0.7 * latency["dense_ms"]
    assert "latency on command:" in result.out and ": met;" in result.out
    timed = plan["verification"]["runtime_latency"]  # verify times the plan on its runtime, beside its prediction
    last = latency["attempts"][-1]
    assert (timed["runtime"], timed["batch"], timed["predicted_ms"]) == ("command", 1, last["predicted_ms"])
    assert timed["dense_ms"] == pytest.approx(latency["dense_ms"], rel=1e-3)
    assert timed["pruned_ms"] == pytest.approx(latency["attempts"][-1]["measured_ms"], rel=1e-3)
    assert "latency batch 1 on command (" in result.out and "the plan predicted" in result.out


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target_latency_ms": -1.0}, "target_latency_ms must be a positive time"),
        ({"target_latency_reduction": 0.3, "target_latency_ms": 5.0}, "keep one latency budget"),
        ({"target_latency_reduction": 0.3, "latency_runtime": "tensorrt"}, "latency_runtime"),
        ({"target_latency_reduction": 0.3, "latency_runtime": "command"}, "needs SensitivityAnalysis.runtime_command"),
        ({"target_latency_reduction": 0.3, "latency_batch": 0}, "latency_batch must be a positive"),
        ({"target_latency_reduction": 0.3, "latency_table": "layer"}, "latency_table"),
        ({"target_latency_reduction": 0.3, "latency_round_to": 0}, "latency_round_to must be a positive channel"),
    ],
)
def test_bad_latency_settings_exit_2_with_one_sentence(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult], settings: dict[str, Any], message: str
) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data, arch="tests/tiny_models.py:tiny_cnn"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5], **settings},
    })  # fmt: skip
    result = cli("plan", "--config_path", config)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err


def test_a_command_printing_no_number_stops_the_plan_with_exit_2(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult]
) -> None:
    config = analysis_config(tmp_path, list_data, "slow_cnn", {"pruned_ratios": [0.5]}, arch_kwargs={"delay": 0.0})
    script = tmp_path / "say.py"
    script.write_text("print('fast')\n")
    result = cli("plan", "--config_path", config, "--target_latency_reduction", "0.3", "--runtime", "command",
                 "--runtime_command", f"{sys.executable} {script} {{onnx}}")  # fmt: skip
    assert result.code == 2 and "printed no latency" in result.err and "Traceback" not in result.err

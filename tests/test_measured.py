"""The measured plan method: it meets the budget exactly, never measures below the knapsack plan, resumes without
repeating evaluations, and runs from the command line with its evaluations kept in the sidecar."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from analysis import analysis_prune
from analysis.engine.evaluate import evaluate
from analysis.io.results import load_sidecar
from analysis.io.search_log import search_log_path
from analysis.planning._joint import JointEvaluator
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import build_plan, open_planner
from analysis.planning.verify import measure_pruned
from analysis.structure.flops import count_cost
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy

import tiny_models
from helpers import (
    TINY_MODELS,
    CliResult,
    batches,
    calibration_batches,
    pseudo_labelled,
    randomize,
    tiny_global,
    write_config,
    write_train_list,
)

RATIOS = (0.25, 0.5, 0.75)
SETTINGS = SearchSettings(evaluations=14, calibration_images=8)


class Counted:
    """Scoring batches that count the passes over them (one per evaluation) and can fail, like a kill, at the start
    of one."""

    def __init__(self, data: list, fail_at: int | None = None) -> None:
        self.data, self.fail_at, self.calls = data, fail_at, 0
        self.num_samples = sum(len(labels) for _, labels in data)

    def __iter__(self) -> Iterator:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise KeyboardInterrupt
        return iter(self.data)


def setup(tmp_path: Path) -> tuple[torch.nn.Module, list, list, Path]:
    model = randomize(tiny_models.tiny_resnet())
    data = pseudo_labelled(model, batches(count=3))
    path = tmp_path / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=RATIOS, progress=False)
    return model, data, calibration_batches(count=2), path


def scoring(data: Counted, calibration: list) -> PlanScoring:
    return PlanScoring(data, "data", calibration, calibration[:1], "calibration")


@pytest.mark.parametrize("target", [0.3, 0.5])
def test_measured_plan_meets_the_budget_and_never_measures_below_the_knapsack_plan(
    target: float, tmp_path: Path
) -> None:
    model, data, calibration, path = setup(tmp_path)
    example = data[0][0]
    plan = build_measured_plan(model, example, path, target, scoring(Counted(data), calibration), settings=SETTINGS,
                               progress=False)  # fmt: skip
    pruned = count_cost(jointly_pruned_copy(model, plan.removals(), example), example)
    assert 1 - pruned.macs / plan.dense.macs >= target  # the exact joint cost meets the budget
    assert (pruned.macs, pruned.params) == (plan.pruned.macs, plan.pruned.params)
    search = plan.search
    assert search is not None and search["budget"] == SETTINGS.evaluations
    assert search["evaluations"] == SETTINGS.evaluations or (search["exhausted"] and search["evaluations"] > 0)
    finalists = {f["name"]: f for f in search["finalists"]}
    chosen, knapsack = finalists[search["chosen"]], search["knapsack"]
    assert (chosen["top1"], -chosen["ce"]) >= (knapsack["top1"], -knapsack["ce"])
    assert len(finalists) >= 2

    # the predicted loss is the measurement: verification of the physically pruned, re-estimated copy agrees
    baseline = evaluate(model, data).top1
    _, _, recalibrated = measure_pruned(model, plan.removals(), lambda m: evaluate(m, data).metrics(), example,
                                        _calibration_set(calibration))  # fmt: skip
    assert recalibrated is not None
    measured = (baseline - recalibrated.metrics["top1"]) / baseline
    assert plan.predicted_loss == pytest.approx(measured, abs=1.5 / 24 / baseline)  # within one of the 24 images
    knapsack_plan = build_plan(model, example, path, target)
    assert 1 - knapsack_plan.pruned.macs / knapsack_plan.dense.macs >= target


def test_a_killed_search_resumes_without_repeating_evaluations(tmp_path: Path) -> None:
    model, data, calibration, path = setup(tmp_path)
    example = data[0][0]
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    for name in ("s.pkl", "s.pkl.json"):
        shutil.copy(tmp_path / name, copy_dir / name)

    uninterrupted = Counted(data)
    reference = build_measured_plan(model, example, copy_dir / "s.pkl", 0.4, scoring(uninterrupted, calibration),
                                    settings=SETTINGS, progress=False)  # fmt: skip

    killed = Counted(data, fail_at=9)
    with pytest.raises(KeyboardInterrupt):
        build_measured_plan(model, example, path, 0.4, scoring(killed, calibration), settings=SETTINGS, progress=False)
    saved = search_log_path(path).read_text().splitlines()
    assert 5 <= len(saved) < 9  # each evaluation finished before the kill was saved as it finished
    with search_log_path(path).open("a") as log:
        log.write('{"key": "cut off by a ki')  # a kill in the middle of a write leaves a partial line
    assert not (tmp_path / "s.pkl.lock").exists()

    plan = build_measured_plan(model, example, path, 0.4, scoring(Counted(data), calibration), settings=SETTINGS,
                               progress=False)  # fmt: skip
    total = search_log_path(copy_dir / "s.pkl").read_text().splitlines()
    resumed = search_log_path(path).read_text().splitlines()
    assert resumed[: len(saved)] == saved and len(resumed) == len(total)  # only the missing ones were measured
    assert {json.dumps(json.loads(line)["picks"]) for line in resumed} == {
        json.dumps(json.loads(line)["picks"]) for line in total
    }
    assert plan.removals() == reference.removals() and plan.predicted_loss == reference.predicted_loss
    assert plan.search is not None and plan.search["from_earlier_runs"] >= len(saved)

    again = Counted(data)
    build_measured_plan(model, example, path, 0.4, scoring(again, calibration), settings=SETTINGS, progress=False)
    assert again.calls == 0  # a finished search is answered from its log alone
    kept = load_sidecar(path)["plan_search"]  # and the sidecar keeps every evaluation too
    assert sum(len(log["evaluations"]) for log in kept.values()) == len(total)


def test_evaluations_are_not_reused_with_other_calibration_images(tmp_path: Path) -> None:
    model, data, calibration, path = setup(tmp_path)
    first = Counted(data)
    build_measured_plan(model, data[0][0], path, 0.4, scoring(first, calibration), settings=SETTINGS, progress=False)
    other = Counted(data)
    changed = PlanScoring(other, "data", calibration[1:], calibration[1:], "other calibration")
    build_measured_plan(model, data[0][0], path, 0.4, changed, settings=SETTINGS, progress=False)
    logs = load_sidecar(path)["plan_search"]
    assert len(logs) == 2  # one log per calibration set: nothing measured with the first images was reused
    assert all(log["evaluations"] for log in logs.values()) and other.calls > 0


def _calibration_set(calibration: list) -> object:
    """A stand-in for :class:`analysis.inputs.calibration.CalibrationSet` around in-memory batches."""

    class InMemory:
        loader = calibration

        @staticmethod
        def as_dict() -> dict[str, str]:
            return {"source": "in memory"}

    return InMemory()


def test_plan_cli_measured_method_verifies_both_numbers(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    write_train_list(list_data, 24)
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data, arch=f"{TINY_MODELS}:tiny_resnet"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": list(RATIOS)},
    })  # fmt: skip
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.3", "--method", "measured",
                 "--eval_budget", "10", "--verify", "--export_dir", tmp_path / "export", "--no_report")  # fmt: skip
    assert result.code == 0, result.err
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    search = plan["search"]
    assert plan["method"] == "measured" and search["budget"] == 10
    assert search["evaluations"] == 10 or (search["exhausted"] and search["evaluations"] > 0)
    assert "finalists" in result.out and "BatchNorm re-estimated" in result.out and "raw" in result.out
    verification = plan["verification"]
    assert verification["reestimated"]["calibration_images"] == 24
    baseline, verified = verification["baseline"]["top1"], verification["reestimated"]["metrics"]["top1"]
    assert (baseline - verified) / baseline == pytest.approx(plan["predicted_loss"], abs=1.5 / 20 / baseline)
    exported = yaml.safe_load((tmp_path / "export" / "channel_prune.yaml").read_text())["ChannelPrune"]
    assert exported["prune_params_name"]
    described = (tmp_path / "export" / "pruned_channels.json").read_text()
    assert '"reestimated": true' in described


def test_verify_without_calibration_images_reports_the_raw_numbers_and_why(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": list(RATIOS)},
    })  # fmt: skip
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.3", "--verify", "--no_report")
    assert result.code == 0, result.err
    assert "not measured (no calibration images" in result.out
    verification = load_sidecar(tmp_path / "s.pkl")["plan"]["verification"]
    assert verification["reestimated"] is None and "top1" in verification["pruned"]


@pytest.mark.parametrize("factory", [tiny_models.tiny_resnet, tiny_models.tiny_inverted_residual, tiny_models.tiny_cnn])
def test_runs_from_kept_values_equal_whole_runs_exactly(factory: Callable, tmp_path: Path) -> None:
    model = randomize(factory())
    data = pseudo_labelled(model, batches(count=2))
    path = tmp_path / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=RATIOS, progress=False)
    calibration = calibration_batches(count=2)
    with eval_mode(model):
        planner, options = open_planner(model, data[0][0], path)
        keys = [group.key for group in options]
        kept = JointEvaluator(planner, keys, data, calibration)
        whole = JointEvaluator(planner, keys, data, calibration, cache_bytes=0)
        generator = random.Random(0)

        def random_pick(key: str) -> tuple[str, int]:
            choice = generator.choice(next(g for g in options if g.key == key).choices)
            return (choice.param, choice.count)

        current = {key: random_pick(key) for key in keys}
        kept.score(current)
        kept.adopt(current)
        started_late = 0
        for step in range(12):
            candidate = dict(current)
            for key in generator.sample(keys, min(len(keys), 1 + step % 2)):
                candidate[key] = random_pick(key)
            assert kept.score(candidate).metrics == whole.score(candidate).metrics  # bit-identical numbers
            assert kept.last is not None
            started_late += kept.last.start is not None and kept.last.start.op != "placeholder"
            if step % 3 == 0:
                current = candidate
                kept.adopt(current)
    if len(keys) > 1:
        assert kept.cuts and started_late > 0  # the reuse happened (and still gave the whole run's numbers)

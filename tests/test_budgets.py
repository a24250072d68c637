"""Combined budgets: MACs, params and latency targets met at once by one plan (knapsack, measured method and a
latency plan measured end to end), with the allocation's bound checked against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from analysis import analysis_prune
from analysis.errors import UserError
from analysis.io.record import load_record
from analysis.io.results import load_sidecar
from analysis.planning.allocate import BudgetUnreachable, Choice, Constraint, GroupOptions, allocate, allocate_all
from analysis.planning.latency_plan import MeasuredMethod, plan_for_latency
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import build_plan
from analysis.runtimes.runtime import Runtime
from analysis.runtimes.timing import Latency
from analysis.structure.flops import count_cost
from analysis.structure.physical import jointly_pruned_copy

from helpers import CliResult, FakeProbe, analysis_config, batches, calibration_batches, pseudo_labelled, randomize
from tiny_models import tiny_resnet


class MacsRuntime(Runtime):
    """A deterministic runtime: 0.5 ms plus the model's MACs in units of 10^4."""

    name, device = "fake", "fake device"

    def __init__(self, example: torch.Tensor) -> None:
        self.example = example

    def latency_of(self, model: nn.Module) -> float:
        return 0.5 + count_cost(model, self.example[:1]).macs / 1e4

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        return Latency(self.name, self.device, batch, self.latency_of(model), 0.0, 1)


def analysed(model: nn.Module, path: Path) -> Path:
    analysis_prune(model, pseudo_labelled(model, batches(count=2)), path, pruned_ratios=(0.25, 0.5, 0.75),
                   progress=False)  # fmt: skip
    return path


def additive(name: str, savings: Mapping[str, list[float]], goal: float) -> Constraint:
    def joint(chosen: Mapping[str, Choice]) -> float:
        return sum(savings[key][c.count] for key, c in chosen.items())

    return Constraint(name, savings, goal, joint)


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[GroupOptions], list[Constraint]]:
    """Small knapsacks with one to three budgets: choice i of a group removes i channels (losses and savings grow)."""
    groups = draw(st.integers(1, 4))
    budgets = draw(st.integers(1, 3))
    options, savings = [], [dict() for _ in range(budgets)]
    for g in range(groups):
        size = draw(st.integers(2, 4))
        steps = draw(st.lists(st.floats(0.0, 1.0), min_size=size - 1, max_size=size - 1))
        losses = list(itertools.accumulate([0.0, *steps]))
        options.append(GroupOptions([f"g{g}"], size, [Choice(i, f"g{g}", losses[i], 0.0) for i in range(size)]))
        for b in range(budgets):
            gains = draw(st.lists(st.floats(0.0, 10.0), min_size=size - 1, max_size=size - 1))
            savings[b][f"g{g}"] = list(itertools.accumulate([0.0, *gains]))
    constraints = []
    for b in range(budgets):
        most = sum(values[-1] for values in savings[b].values())
        fraction = draw(st.floats(0.05, 1.0))
        constraints.append(additive(f"m{b}", savings[b], max(1e-3, fraction * most)))
    return options, constraints


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_budget_is_met_and_the_bound_holds_against_brute_force(problem) -> None:
    options, constraints = problem
    feasible = [
        sum(c.loss for c in pick)
        for pick in itertools.product(*(group.choices for group in options))
        if all(k.joint_saved({g.key: c for g, c in zip(options, pick, strict=True)}) >= k.goal for k in constraints)
    ]
    if not feasible:
        with pytest.raises(BudgetUnreachable):
            allocate_all(options, constraints)
        return
    found = allocate_all(options, constraints)
    assert all(k.joint_saved(found.choices) >= k.goal for k in constraints)  # every budget met
    assert found.lower_bound <= min(feasible) + 1e-9 <= found.predicted_loss + 2e-9
    assert found.predicted_loss == pytest.approx(sum(c.loss for c in found.choices.values()))
    assert all(found.choices[g.key] in g.choices for g in options)  # the groups' own choices, not reweighted copies


def test_one_budget_allocates_as_the_single_knapsack() -> None:
    options = [GroupOptions([f"g{g}"], 4, [Choice(i, f"g{g}", i * (g + 1) / 10, 0.0) for i in range(4)])
               for g in range(3)]  # fmt: skip
    savings = {f"g{g}": [i * (3 - g) for i in range(4)] for g in range(3)}
    with_savings = [GroupOptions(g.members, 4, [Choice(c.count, c.param, c.loss, savings[g.key][c.count])
                                                for c in g.choices]) for g in options]  # fmt: skip
    alone = allocate(with_savings, 7.0)
    combined = allocate_all(options, [additive("macs", savings, 7.0)])
    assert {k: c.count for k, c in combined.choices.items()} == {k: c.count for k, c in alone.choices.items()}
    assert combined.predicted_loss == pytest.approx(alone.predicted_loss)


@pytest.fixture
def setting(tmp_path: Path):
    model = randomize(tiny_resnet()).eval()
    return model, batches(count=1)[0][0], analysed(model, tmp_path / "s.pkl")


def reductions(model, example, plan) -> tuple[float, float]:
    pruned = count_cost(jointly_pruned_copy(model, plan.removals(), example), example)
    dense = count_cost(model, example)
    return 1 - pruned.macs / dense.macs, 1 - pruned.params / dense.params


def test_a_knapsack_plan_meets_macs_and_params_budgets_at_once(setting) -> None:
    model, example, path = setting
    macs_only = build_plan(model, example, path, 0.3, "macs")
    assert reductions(model, example, macs_only)[1] < 0.5  # so the params budget below changes the plan
    plan = build_plan(model, example, path, 0.3, "macs", also={"params": 0.5})
    macs, params = reductions(model, example, plan)
    assert macs >= 0.3 and params >= 0.5
    assert plan.budgets == {"macs": 0.3, "params": 0.5}
    assert plan.record().budgets == {"macs": 0.3, "params": 0.5}
    assert (plan.reduction_of("macs"), plan.reduction_of("params")) == pytest.approx((macs, params))
    assert macs_only.record().budgets is None  # one budget: no budgets entry


def test_budgets_that_cannot_all_be_reached_are_one_sentence(setting) -> None:
    model, example, path = setting
    with pytest.raises(UserError, match=r"target_macs_reduction 0\.3 and target_params_reduction 0\.99 cannot all"):
        build_plan(model, example, path, 0.3, "macs", also={"params": 0.99})


def test_a_latency_plan_meets_a_params_budget_too_as_measured(setting) -> None:
    model, example, path = setting
    runtime = MacsRuntime(example)
    latency_only = plan_for_latency(model, example, load_record(path), runtime, reduction=0.2, round_to=1)
    assert reductions(model, example, latency_only)[1] < 0.5
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=0.2, also={"params": 0.5},
                            round_to=1)  # fmt: skip
    assert plan.latency is not None and plan.latency.met
    pruned = jointly_pruned_copy(model, plan.removals(), example)
    assert runtime.latency_of(pruned) <= runtime.latency_of(model) * 0.8
    assert reductions(model, example, plan)[1] >= 0.5
    assert plan.budgets == {"latency": 0.2, "params": 0.5}


def test_the_measured_method_meets_every_budget(tmp_path: Path) -> None:
    model = randomize(tiny_resnet()).eval()
    data = pseudo_labelled(model, batches(count=2))
    calibration = calibration_batches(count=2)
    path = analysed(model, tmp_path / "s.pkl")
    example = data[0][0]
    scoring = PlanScoring(data, "data", calibration, calibration[:1], "calibration")
    plan = build_measured_plan(model, example, path, 0.3, scoring, "macs", SearchSettings(evaluations=8),
                               progress=False, also={"params": 0.5})  # fmt: skip
    macs, params = reductions(model, example, plan)
    assert plan.method == "measured" and macs >= 0.3 and params >= 0.5
    assert plan.budgets == {"macs": 0.3, "params": 0.5}


def test_the_measured_method_plans_a_latency_budget_measured_end_to_end(tmp_path: Path) -> None:
    model = randomize(tiny_resnet()).eval()
    data = pseudo_labelled(model, batches(count=2))
    path = analysed(model, tmp_path / "s.pkl")
    example = data[0][0]
    runtime = MacsRuntime(example)
    scoring = PlanScoring(data, "data", calibration_batches(count=2), calibration_batches(count=1), "calibration")
    method = MeasuredMethod(scoring, SearchSettings(evaluations=6), progress=False)
    # round_to=1: any analysed count, so the search has several finalists for the probe below
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=0.25, measured_method=method,
                            also={"params": 0.3}, round_to=1)  # fmt: skip
    assert plan.method == "measured" and plan.latency is not None and plan.latency.met
    assert plan.search is not None and plan.search["evaluations"] >= 1  # the search ran and measured plans
    pruned = jointly_pruned_copy(model, plan.removals(), example)
    assert runtime.latency_of(pruned) <= 0.75 * runtime.latency_of(model)
    assert reductions(model, example, plan)[1] >= 0.3

    # the recovered method on the same loop: the probe (which scores the measured choice worst) picks each attempt's
    # plan among its finalists, and the plan kept still meets the measured goal
    probe = FakeProbe(plan.removals())
    probed = dataclasses.replace(method, scoring=dataclasses.replace(scoring, probe=probe))
    recovered = plan_for_latency(model, example, load_record(path), runtime, reduction=0.25, measured_method=probed,
                                 also={"params": 0.3}, round_to=1)  # fmt: skip
    assert recovered.method == "recovered" and recovered.latency is not None and recovered.latency.met
    search = recovered.search
    assert search is not None and search["probe_steps"] == probe.steps and len(search["finalists"]) >= 2
    best = max(search["probed"], key=lambda finalist: finalist["top1"])  # the kept attempt's finalists
    assert search["chosen"] == best["name"] and probe.top1(recovered.removals()) == best["top1"] > 0
    assert any(sorted(call) == sorted(recovered.removals()) for call in probe.calls)
    assert sorted(recovered.removals()) != sorted(plan.removals())
    assert runtime.latency_of(jointly_pruned_copy(model, recovered.removals(), example)) <= 0.75 * runtime.latency_of(
        model
    )


def test_the_command_line_plans_for_two_budgets_and_records_both(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult]
) -> None:
    analysis = {"pruned_ratios": [0.25, 0.5, 0.75], "report": False, "target_macs_reduction": 0.95}
    config = analysis_config(tmp_path, list_data, "slow_cnn", analysis, arch_kwargs={"delay": 0.0})
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.2", "--target_params_reduction", "0.4")
    assert result.code == 0, result.err
    analysis = tmp_path / "out" / "s.pkl"
    plan = load_sidecar(analysis)["plan"]
    assert plan["budgets"] == {"macs": 0.2, "params": 0.4}
    assert plan["macs_reduction"] >= 0.2 and plan["params_reduction"] >= 0.4
    written = (tmp_path / "out" / "s.pkl.plan.yaml").read_text()
    assert "macs reduced by >= 0.2" in written and "params reduced by >= 0.4" in written
    assert yaml.safe_load(written)["ChannelPrune"]["prune_params_name"]
    alone = cli("plan", "--config_path", config, "--target_params_reduction", "0.4")  # the config's 0.95 MACs left out
    assert alone.code == 0, alone.err
    plan = load_sidecar(analysis)["plan"]
    assert plan["measure"] == "params" and "budgets" not in plan


SIZE_SCRIPT = """import os, sys
print(f"{os.path.getsize(sys.argv[1]) / 1000:.3f}")
"""


def test_the_command_line_plans_latency_and_params_with_the_measured_method(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult]
) -> None:
    """A deterministic command runtime (the ONNX file's size in kB): the measured method's latency plan meets the
    latency and the params budget, as measured, and the sidecar says how it was chosen."""
    script = tmp_path / "size.py"
    script.write_text(SIZE_SCRIPT)
    analysis = {"pruned_ratios": [0.25, 0.5, 0.75]}
    config = analysis_config(tmp_path, list_data, "slow_cnn", analysis, arch_kwargs={"delay": 0.0})
    result = cli("plan", "--config_path", config, "--target_latency_reduction", "0.3", "--target_params_reduction",
                 "0.35", "--runtime", "command", "--runtime_command", f"{sys.executable} {script} {{onnx}}",
                 "--method", "measured", "--eval_budget", "4")  # fmt: skip
    assert result.code == 0, result.err
    plan = load_sidecar(tmp_path / "out" / "s.pkl")["plan"]
    assert plan["method"] == "measured" and plan["latency"]["met"] and plan["params_reduction"] >= 0.35
    assert plan["budgets"]["params"] == 0.35 and plan["budgets"]["latency"] == pytest.approx(0.3)
    note = " ".join(line.lstrip("# ") for line in (tmp_path / "out" / "s.pkl.plan.yaml").read_text().splitlines())
    assert "the best measured plan" in note
    report = (tmp_path / "out" / "s.report.html").read_text()
    assert "budgets: latency reduced by at least 30" in report and "params reduced by at least 35" in report
    assert "measured side by side" in report and ": met after" in report

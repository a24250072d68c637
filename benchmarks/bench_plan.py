#!/usr/bin/env python
"""Pruning plans side by side: measured top1 after joint physical pruning, raw and with BatchNorm re-estimated.

For each demo model and each MACs budget, every method's plan is pruned into a physical copy of the model
(Torch-Pruning), evaluated on the demo's evaluation images with the dense model's BatchNorm statistics (raw) and
after re-estimating the statistics the pruning changed on 1,024 training images (analysis.engine.batchnorm), exactly as
``run.py verify`` does. Methods:

* uniform: one ratio for every analysed group (our channel ranking), the smallest that reaches the budget;
* Torch-Pruning global: ``MetaPruner(global_pruning=True)`` with group L1 importance
  (``GroupMagnitudeImportance(p=1)``), its own channel choice, the pruning ratio searched until the budget is reached;
* knapsack: ``run.py plan`` from the plain sensitivities;
* knapsack (adaptive BN): ``run.py plan`` from sensitivities measured with ``adaptive_bn: true``;
* measured: ``run.py plan --method measured`` (joint evaluations, BatchNorm re-estimated).

Also the predicted against the measured loss of our plans, and the wall time of each method (the analyses' times are
printed separately; a plan's time excludes the analysis it reads).

    python benchmarks/bench_plan.py                                   # both demo models, 30/40/50/60% fewer MACs
    python benchmarks/bench_plan.py --models digits_mobilenet --budgets 0.5
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch_pruning as tp

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("analysis") is None:
    sys.path.insert(0, str(REPO_ROOT))

from analysis.config import Config, load_config  # noqa: E402
from analysis.engine.evaluate import evaluate  # noqa: E402
from analysis.inputs.build import Inputs, build_inputs  # noqa: E402
from analysis.io.search_log import search_log_path  # noqa: E402
from analysis.planning.allocate import GroupOptions  # noqa: E402
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan  # noqa: E402
from analysis.planning.plan import Planner, build_plan, open_planner  # noqa: E402
from analysis.planning.verify import measure_pruned  # noqa: E402
from analysis.structure.criteria import removal_count  # noqa: E402
from analysis.structure.groups import all_parameters_require_grad, eval_mode, removal_group  # noqa: E402
from analysis.workflow.job import run_job  # noqa: E402

Removals = list[tuple[str, list[int]]]


@dataclass
class Row:
    """One method's plan at one budget, as measured."""

    model: str
    budget: float
    method: str
    macs_reduction: float
    raw_top1: float
    bn_top1: float
    seconds: float
    predicted_loss: float | None = None
    measured_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load(model_name: str, out_dir: Path, ratios: Sequence[float], adaptive_bn: bool) -> Config:
    """The demo config of ``model_name`` writing its analysis file under ``out_dir``."""
    tag = "adaptive_bn" if adaptive_bn else "plain"
    overrides = [
        f"SensitivityAnalysis.analysis_file={out_dir / model_name / f'{tag}.pkl'}",
        f"SensitivityAnalysis.pruned_ratios=[{','.join(str(r) for r in ratios)}]",
        f"SensitivityAnalysis.adaptive_bn={str(adaptive_bn).lower()}",
        "SensitivityAnalysis.report=false",
        "SensitivityAnalysis.target_loss=null",
        "Global.device=cpu",
    ]
    return load_config(REPO_ROOT / "configs" / "demo" / f"{model_name}.yaml", overrides)


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    """``function()`` and its wall time in seconds."""
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def uniform_removals(
    planner: Planner, options: Sequence[GroupOptions], target: float, round_to: int | None = None
) -> Removals:
    """One ratio for every group (ranked by its first member), the smallest whose exact joint saving reaches
    ``target`` (bisection on the ratio; the saving grows with it); each group keeps a multiple of ``round_to``
    channels (default: the analysis's)."""
    align = planner.round_to if round_to is None else round_to

    def picks(ratio: float) -> list[tuple[str, int]]:
        counts = []
        for group in options:
            param = planner.by_name[group.key]
            counts.append((group.key, removal_count(param.channels, ratio, len(param.conv_blocks), align)))
        return counts

    low, high = 0.0, 0.95
    for _ in range(30):
        middle = (low + high) / 2
        if saved(planner, picks(middle)) >= target:
            high = middle
        else:
            low = middle
    return planner.removals(picks(high))


def saved(planner: Planner, picks: Sequence[tuple[str, int]]) -> float:
    """Fraction of the dense MACs that the ``(param, channel count)`` picks save together."""
    return 1 - planner.picks_cost(picks).macs / planner.costs.dense.macs


def torch_pruning_global(
    planner: Planner, target: float, global_pruning: bool = True, round_to: int | None = None
) -> Removals:
    """Torch-Pruning's global magnitude pruning (group L1, its channel choice) at the pruning ratio that reaches
    ``target``: the channels each of its groups removes, found on a copy with ``step(interactive=True)``; with
    ``global_pruning`` False its local variant (the same ratio in every group); ``round_to``: its option of that name
    (channel counts kept at multiples of it)."""
    model, example = planner.model, planner.example_input[:1]
    classifier = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]

    def removals(ratio: float) -> Removals:
        clone = copy.deepcopy(model)
        names = {module: name for name, module in clone.named_modules()}
        ignored = [clone.get_submodule(name) for name in classifier]
        with all_parameters_require_grad(clone):
            pruner = tp.pruner.MetaPruner(clone, example, importance=tp.importance.GroupMagnitudeImportance(p=1),
                                          global_pruning=global_pruning, pruning_ratio=ratio,
                                          ignored_layers=ignored, round_to=round_to)  # fmt: skip
            chosen = [(names[group[0].dep.target.module], sorted(int(i) for i in group[0].idxs))
                      for group in pruner.step(interactive=True)]  # fmt: skip
        return [(name, channels) for name, channels in chosen if channels]

    def reduction(chosen: Removals) -> float:
        groups = [removal_group(planner.graph, model.get_submodule(name), channels) for name, channels in chosen]
        cost = planner.costs.group_cost(planner.graph, [item for group in groups for item in group])
        return 1 - cost.macs / planner.costs.dense.macs

    low, high = 0.0, 0.9
    for _ in range(16):
        middle = (low + high) / 2
        if reduction(removals(middle)) >= target:
            high = middle
        else:
            low = middle
    return removals(high)


def measure(inputs: Inputs, removals: Removals) -> tuple[float, float, float]:
    """Raw and BatchNorm re-estimated top1 of the jointly pruned copy, and its exact MACs reduction."""
    model, example = inputs.model, inputs.example_input

    def score(candidate: torch.nn.Module) -> dict[str, float]:
        return evaluate(candidate, inputs.loader, progress=False).metrics()

    pruned, raw, recalibrated = measure_pruned(model, removals, score, example, inputs.calibration)
    assert recalibrated is not None
    from analysis.structure.flops import count_cost

    reduction = 1 - count_cost(pruned, example).macs / count_cost(model, example).macs
    return raw["top1"], recalibrated.metrics["top1"], reduction


def bench_model(model_name: str, args: argparse.Namespace) -> tuple[list[Row], dict[str, float]]:
    """Every method at every budget on one demo model; also the analyses' wall times."""
    plain, adaptive = (load(model_name, args.out, args.ratios, flag) for flag in (False, True))
    inputs = build_inputs(plain, progress=False, calibration=True)
    _, plain_seconds = timed(lambda: run_job(plain, overwrite=True, progress=False, inputs=inputs))
    assert plain.SensitivityAnalysis.analysis_file is not None
    search_log_path(plain.SensitivityAnalysis.analysis_file).unlink(missing_ok=True)  # measure every evaluation
    _, adaptive_seconds = timed(lambda: run_job(adaptive, overwrite=True, progress=False, inputs=inputs))
    analyses = {"plain": plain_seconds, "adaptive_bn": adaptive_seconds}
    print(f"{model_name}: analysis {plain_seconds:.1f} s, with adaptive BN {adaptive_seconds:.1f} s", flush=True)
    model, example = inputs.model, inputs.example_input
    calibration = inputs.calibration.loader if inputs.calibration is not None else None
    baseline = evaluate(model, inputs.loader, progress=False).top1
    plain_file = plain.SensitivityAnalysis.analysis_file
    adaptive_file = adaptive.SensitivityAnalysis.analysis_file
    assert plain_file is not None and adaptive_file is not None
    rows = []
    with eval_mode(model):
        planner, options = open_planner(model, example, plain_file)
        for budget in args.budgets:
            methods: dict[str, Callable[..., tuple[Removals, float | None]]] = {  # called with no argument
                "uniform": lambda b=budget: (uniform_removals(planner, options, b), None),
                "Torch-Pruning global": lambda b=budget: (torch_pruning_global(planner, b), None),
                "knapsack": lambda b=budget: _plan(build_plan(model, example, plain_file, b)),
                "knapsack (adaptive BN)": lambda b=budget: _plan(build_plan(model, example, adaptive_file, b)),
                "measured": lambda b=budget: _plan(
                    build_measured_plan(
                        model,
                        example,
                        plain_file,
                        b,
                        PlanScoring.from_loaders(inputs.loader, calibration, 256, 0),
                        settings=SearchSettings(evaluations=args.eval_budget),
                        progress=False,
                    )
                ),
            }
            for method, make in methods.items():
                (removals, predicted), seconds = timed(make)
                raw, bn, reduction = measure(inputs, removals)
                measured = (baseline - bn) / baseline
                rows.append(Row(model_name, budget, method, reduction, raw, bn, seconds, predicted, measured))
                print(_line(rows[-1]), flush=True)
    return rows, analyses


def _plan(plan: Any) -> tuple[Removals, float]:
    return plan.removals(), plan.predicted_loss


def _line(row: Row) -> str:
    predicted = "" if row.predicted_loss is None else f"{row.predicted_loss:+.3f}"
    measured = "" if row.measured_loss is None else f"{row.measured_loss:+.3f}"
    return (
        f"| {row.model} | {row.budget:.0%} ({row.macs_reduction:.1%}) | {row.method} | {row.raw_top1:.3f} | "
        f"{row.bn_top1:.3f} | {predicted} | {measured} | {row.seconds:.1f} s |"
    )


def main(argv: list[str] | None = None) -> int:
    """Run every method on every model and budget; print one table (Markdown) and save the rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["digits_resnet", "digits_mobilenet"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    parser.add_argument("--eval_budget", type=int, help="the measured method's evaluations (default: 10 per group)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "_data" / "plans")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows: list[Row] = []
    analyses = {}
    for model_name in args.models:
        model_rows, analyses[model_name] = bench_model(model_name, args)
        rows += model_rows
    print("\n| model | MACs cut (exact) | method | top1 raw | top1 BN re-estimated | predicted loss | "
          "measured loss (BN) | plan time |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(_line(row))
    for model_name, seconds in analyses.items():
        print(f"{model_name}: analysis {seconds['plain']:.1f} s, with adaptive BN {seconds['adaptive_bn']:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": [row.__dict__ for row in rows],
                                                        "analyses": analyses}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

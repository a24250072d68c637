#!/usr/bin/env python
"""Plans judged after recovery: every plan at every budget pruned, re-estimated and recovered with the same recipe
and the same batches, scored on images neither the analysis nor the plan search saw.

For each demo model the 450 validation images are split by line, alternately: the even lines are what the analysis,
the measured method's search and recovery's best-checkpoint choice see; the odd lines (225 images) score every
figure here (held out). At each MACs budget the plans are:

* our **knapsack** (``run.py plan``), **measured** (``--method measured``) and **recovered** (``--method
  recovered``: the measured search's finalists each recovered for ``--probe-steps`` steps of this recipe, data seed 0,
  the best on the seen half kept) plans;
* a **uniform** ratio for every analysed group (our channel ranking), the smallest reaching the budget;
* **Torch-Pruning global** and **local** magnitude pruning (``MetaPruner`` with group L1 importance, its own channel
  choice), the pruning ratio searched until the budget is reached.

With ``--latency R`` (default 0.3; 0: none) one more budget: R less latency on ONNX Runtime (CPU provider, batch
``--latency-batch``, default 32; at batch 1 the demo models' calls are too short for any plan to reach 30%). Ours are
the latency plans of ``run.py plan --target_latency_reduction R`` (knapsack, measured, recovered: the latency table
measured, each plan timed against the dense model until it meets the goal); the baselines know no latency, so each
takes the smallest MACs cut (up in steps of 0.1, then bisection to 0.02) whose pruned model measured R faster between
timings of the dense model. Every latency plan keeps a multiple of ``--latency-round-to`` (8) channels per pruned
group (the baselines through Torch-Pruning's ``round_to``). Each is then timed against the dense model in a fresh
process (``independent_latency.py``: ONNX files, ``--independent-rounds`` interleaved timings), beside our planner's
verdict.

Each plan is pruned physically (``jointly_pruned_copy``), scored at once (**one-shot**), after BatchNorm
re-estimation on 1,024 training images (**BN**), after the recovered method's probe (**probe**: ``--probe-steps``
steps, data seed 0), and after recovery by ``run.py compress``'s own loop
(:func:`analysis.recovery.train.recover`) for each ``--epochs`` length and ``--seeds`` seed: distillation from the
dense model as ACT's prune_dis example configures it (l2 on the logits, Momentum, cosine learning rate), at a tenth
of the demo's training learning rate (0.005), batch 64, the demo's augmentation (crops of 60-100% of the image, no
flip), weight decay 5e-4. Each seed fixes the data order and augmentation, so every plan sees the same batches.

    python benchmarks/bench_recovery.py                   # both demos, 50% and 65% MACs, 30% latency, 3 epochs, 2 seeds
    python benchmarks/bench_recovery.py --epochs 3 10 --seeds 0 1
    python benchmarks/bench_recovery.py --finalists      # also recover every finalist of the recovered method

``--finalists`` asks whether the probe ranks the measured search's finalists as the longest recovery does: each
finalist's top1 in the search's full setting (BatchNorm re-estimated, seen half: what ``measured`` chooses by) and
after the probe (seen half: what ``recovered`` chooses by), against its held-out top1 after each recovery length.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_latency import Candidate, independent_check  # noqa: E402
from bench_plan import Removals, torch_pruning_global, uniform_removals  # noqa: E402

from analysis.config import Config, derive, load_config  # noqa: E402
from analysis.engine.batchnorm import recalibrate_copy  # noqa: E402
from analysis.engine.evaluate import evaluate  # noqa: E402
from analysis.inputs.build import Inputs, build_inputs  # noqa: E402
from analysis.inputs.data import EvalLoader, Preprocess, build_eval_loader  # noqa: E402
from analysis.io.record import load_record  # noqa: E402
from analysis.planning.allocate import GroupOptions  # noqa: E402
from analysis.planning.latency import LatencyGoalNotReached  # noqa: E402
from analysis.planning.latency_plan import MeasuredMethod, plan_for_latency  # noqa: E402
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan  # noqa: E402
from analysis.planning.plan import Plan, Planner, build_plan, open_planner  # noqa: E402
from analysis.recovery.act import read_distillation, read_train_config  # noqa: E402
from analysis.recovery.data import Sharding, build_train_batches  # noqa: E402
from analysis.recovery.train import RecoveryJob, recover  # noqa: E402
from analysis.runtimes.compare import bracket  # noqa: E402
from analysis.runtimes.runtime import make_runtime  # noqa: E402
from analysis.runtimes.settings import RuntimeSettings  # noqa: E402
from analysis.structure.flops import count_cost  # noqa: E402
from analysis.structure.groups import eval_mode  # noqa: E402
from analysis.structure.physical import jointly_pruned_copy  # noqa: E402
from analysis.workflow.job import run_job  # noqa: E402
from analysis.workflow.probe import RecoveryProbe  # noqa: E402
from analysis.workflow.recipe import Recipe, run_identity  # noqa: E402

RECIPE = {"learning_rate": {"type": "CosineAnnealingDecay", "learning_rate": 0.005},
          "optimizer_builder": {"optimizer": {"type": "Momentum"}, "weight_decay": 5e-4}}  # fmt: skip
RECOVERY = {"Recovery.batch_size": 64, "Recovery.crop_scale": [0.6, 1.0], "Recovery.hflip": 0.0}
# --recipe: what the student learns from. kd: l2 on the dense model's logits (ACT's prune_dis example); ce: the labels
# only (cross-entropy, as the demo models were trained), the distillation term weighted 0.
RECIPES = {"kd": ({"loss": "l2"}, 0.0), "ce": ({"loss": "l2", "alpha": 0.0}, 1.0)}


@dataclass
class Row:
    """One plan at one budget: its cut, its held-out top1 at each stage, and how long each took."""

    model: str
    budget: float
    method: str
    macs_reduction: float
    one_shot: float
    bn: float
    recovered: dict[str, list[float]] = field(default_factory=dict)  # "<epochs>" -> top1 per seed
    seconds: dict[str, float] = field(default_factory=dict)  # plan, and "<epochs>" -> recovery seconds per seed
    probe: float = float("nan")  # after the probe's brief recovery
    finalists: list[dict[str, Any]] = field(default_factory=list)  # --finalists: each finalist's figures
    kind: str = "macs"  # the budget's measure: macs, or latency (--latency)
    verdict: str = ""  # our latency plans: the planner's verdict (met, missed, noisy) and its measured reduction
    planner_reduction: float = float("nan")
    attempts: list[dict[str, Any]] = field(default_factory=list)  # our latency plans: each plan the planner measured
    independent: dict[str, Any] | None = None  # latency budget: independent_latency.py's JSON against the dense model

    @property
    def label(self) -> str:
        """The budget as the tables say it."""
        return f"{self.budget:.0%}" if self.kind == "macs" else f"latency {self.budget:.0%}"


@dataclass(frozen=True)
class Budget:
    """A budget every method plans for: fewer MACs, or less latency measured on ONNX Runtime (``--latency``)."""

    kind: str
    value: float


class RecordingProbe:
    """A probe that keeps the removals of every plan it scored, in order (the finalists of a search)."""

    def __init__(self, probe: RecoveryProbe) -> None:
        self.probe = probe
        self.calls: list[Removals] = []

    @property
    def setting(self) -> str:
        return self.probe.setting

    @property
    def steps(self) -> int:
        return self.probe.steps

    def score(self, removals: Removals) -> dict[str, float]:
        self.calls.append(removals)
        return self.probe.score(removals)


def split_lists(config: Config, folder: Path) -> tuple[Path, Path]:
    """The evaluation list split alternately: (seen by the analysis, search and recovery; held out)."""
    g = config.Global
    assert g.data_dir is not None
    lines = [line for line in (Path(g.data_dir) / g.val_list).read_text().splitlines() if line.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    seen, held = folder / "seen_list.txt", folder / "heldout_list.txt"
    seen.write_text("\n".join(lines[0::2]) + "\n")
    held.write_text("\n".join(lines[1::2]) + "\n")
    return seen, held


def load(model: str, folder: Path, ratios: list[float]) -> tuple[Config, Path]:
    """The demo config analysing the seen half at ``ratios`` into ``folder``, and the held-out list."""
    base = load_config(REPO_ROOT / "configs" / "demo" / f"{model}.yaml", ["Global.device=cpu"])
    seen, held = split_lists(base, folder)
    config = derive(base, {"Global.val_list": str(seen), "Global.calib_list": "train_list.txt",
                           "Recovery.train_list": "train_list.txt",
                           "SensitivityAnalysis.analysis_file": str(folder / "s.pkl"),
                           "SensitivityAnalysis.pruned_ratios": ratios,
                           "SensitivityAnalysis.target_loss": None, "SensitivityAnalysis.report": False})  # fmt: skip
    return config, held


def top1(model: torch.nn.Module, loader: EvalLoader) -> float:
    model.eval()
    return evaluate(model, loader, progress=False).top1


def probe_of(config: Config, inputs: Inputs, steps: int, recipe: str) -> RecoveryProbe:
    """The recovered method's probe with this benchmark's recipe: ``steps`` steps, data seed 0."""
    seeded = derive(config, {**RECOVERY, "Recovery.seed": 0, "Recovery.probe_steps": steps})
    preprocess = Preprocess.from_config(seeded.Global)
    distill, label_weight = RECIPES[recipe]
    seeded = derive(seeded, {"Recovery.label_loss_weight": label_weight})
    batches = build_train_batches(seeded, preprocess, labelled=label_weight > 0, sharding=Sharding())
    train = read_train_config({**RECIPE, "train_iter": steps, "eval_iter": steps, "logging_iter": steps})
    probe_recipe = Recipe(train, read_distillation(distill))
    identity = run_identity(seeded, inputs, probe_recipe, batches, preprocess, bench=recipe)
    return RecoveryProbe(seeded, inputs, probe_recipe, batches, preprocess, identity)


def plans(
    inputs: Inputs,
    analysis_file: str,
    budget: Budget,
    args: argparse.Namespace,
    probe: RecordingProbe,
    made: dict[str, Any],
) -> dict[str, Callable[[], Removals]]:
    """How each method makes its removals at ``budget``. ``made`` gets the recovered plan's search summary
    (``"search"``) and, for a latency budget, our plans by method (verdicts)."""
    model, example = inputs.model, inputs.example_input
    planner, options = open_planner(model, example, analysis_file)
    calibration = inputs.calibration.loader if inputs.calibration is not None else None
    scoring = PlanScoring.from_loaders(inputs.loader, calibration, 256, 0)
    probed = dataclasses.replace(scoring, probe=probe)
    settings = SearchSettings(evaluations=args.eval_budget)

    def searched(plan: Plan) -> Removals:
        made["search"] = plan.search
        return plan.removals()

    if budget.kind == "latency":
        scorings = {"knapsack": None, "measured": scoring, "recovered": probed}
        return latency_plans(inputs, planner, options, analysis_file, budget.value, args, scorings, made)
    target = budget.value
    return {
        "knapsack": lambda: build_plan(model, example, analysis_file, target).removals(),
        "measured": lambda: build_measured_plan(model, example, analysis_file, target, scoring, settings=settings,
                                                progress=False).removals(),
        "recovered": lambda: searched(build_measured_plan(model, example, analysis_file, target, probed,
                                                          settings=settings, progress=False)),
        "uniform": lambda: uniform_removals(planner, options, target),
        "Torch-Pruning global": lambda: torch_pruning_global(planner, target),
        "Torch-Pruning local": lambda: torch_pruning_global(planner, target, global_pruning=False),
    }  # fmt: skip


def latency_plans(
    inputs: Inputs,
    planner: Planner,
    options: list[GroupOptions],
    analysis_file: str,
    reduction: float,
    args: argparse.Namespace,
    scorings: dict[str, PlanScoring | None],
    made: dict[str, Any],
) -> dict[str, Callable[[], Removals]]:
    """Our latency plans (``run.py plan --target_latency_reduction``: planned on ONNX Runtime at ``--latency-batch``,
    measured end to end, by the knapsack or the search of ``scorings[method]``), and the baselines at their
    smallest MACs cut that measures as fast as the budget asks on the same runtime (they know no latency: their MACs
    target is searched against timings). Every plan, ours and theirs, keeps a multiple of ``--latency-round-to``
    channels in each pruned group (Torch-Pruning's ``round_to``), what a user pruning for latency sets."""
    model, example = inputs.model, inputs.example_input
    runtime = make_runtime("onnxruntime", torch.device("cpu"), settings=RuntimeSettings(threads=args.threads))
    record = load_record(analysis_file)
    align = args.latency_round_to

    def ours(method: str) -> Plan:
        if method not in made:
            scoring = scorings[method]
            search = SearchSettings(evaluations=args.eval_budget)
            searched = None if scoring is None else MeasuredMethod(scoring, search, progress=False)
            made[method] = plan_for_latency(model, example, record, runtime, reduction=reduction,
                                            batch=args.latency_batch, progress=False, measured_method=searched,
                                            round_to=align)  # fmt: skip
            if method == "recovered":
                made["search"] = made[method].search
        plan: Plan = made[method]
        return plan

    def removals_of(method: str) -> Callable[[], Removals]:
        return lambda: ours(method).removals()

    def as_fast(removals_at: Callable[[float], Removals]) -> Removals:
        """The removals of the smallest MACs target whose pruned model measured at least ``reduction`` faster than the
        dense model on the runtime (each timing between two of the dense model's): up from 0.1 in steps of 0.1 until
        one is, then bisection to 0.02. Upwards, not from the top: Torch-Pruning with ``round_to`` removes less at
        some high ratios than at lower ones (at 0.9 its local pruning removed nothing from the demo ResNet)."""
        shape = tuple(example.shape[1:])
        found: dict[float, Removals] = {}

        with runtime.prepare(model, shape) as dense:  # once for the whole search

            def fits(target: float) -> bool:
                found[target] = removals_at(target)
                pruned = jointly_pruned_copy(model, found[target], example).eval()
                with runtime.prepare(pruned, shape) as candidate:
                    return bracket(dense, candidate, args.latency_batch).reduction >= reduction

            low, high = 0.0, 0.1
            while not fits(high):
                if high >= 0.9:
                    raise NotReached(f"no plan of 10% to 90% fewer MACs measured {reduction:.0%} faster")
                low, high = high, round(high + 0.1, 6)
            while high - low > 0.02:
                middle = (low + high) / 2
                low, high = (low, middle) if fits(middle) else (middle, high)
        return found[high]

    return {
        **{method: removals_of(method) for method in scorings},
        "uniform": lambda: as_fast(lambda target: uniform_removals(planner, options, target, align)),
        "Torch-Pruning global": lambda: as_fast(lambda target: torch_pruning_global(planner, target, round_to=align)),
        "Torch-Pruning local": lambda: as_fast(lambda target: torch_pruning_global(planner, target, False, align)),
    }


class NotReached(Exception):
    """A baseline has no plan as fast as the latency budget asks."""


def recovered(
    config: Config, inputs: Inputs, pruned: torch.nn.Module, epochs: int, seed: int, folder: Path, recipe: str = "kd"
) -> tuple[torch.nn.Module, float]:
    """``pruned`` recovered for ``epochs`` with the data of ``seed`` (a copy), and the seconds it took."""
    seeded = derive(config, {**RECOVERY, "Recovery.seed": seed})
    preprocess = Preprocess.from_config(seeded.Global)
    distill, label_weight = RECIPES[recipe]
    batches = build_train_batches(seeded, preprocess, labelled=label_weight > 0, sharding=Sharding())
    train = read_train_config({**RECIPE, "epochs": epochs, "eval_iter": batches.steps_per_epoch})
    job = RecoveryJob(train, read_distillation(distill), "fp32", label_weight, folder, f"{epochs}-{seed}", preprocess,
                      resume=False, progress=False)  # fmt: skip
    student = copy.deepcopy(pruned)
    torch.manual_seed(seed)
    dense = {"top1": 1.0}
    start = time.perf_counter()
    recover(student, inputs.model, batches, lambda m: evaluate(m, inputs.loader, progress=False).metrics(), job, dense)
    return student, time.perf_counter() - start


def bench_model(
    model_name: str, args: argparse.Namespace, keep: Callable[[str, float, list[Row]], None]
) -> tuple[list[Row], float]:
    """Every method at every budget on one demo model, recovered; the dense model's held-out top1. ``keep`` is given
    the rows so far after each one (an interrupted run keeps what it measured)."""
    config, held_list = load(model_name, args.out / model_name, args.ratios)
    inputs = build_inputs(config, progress=False, calibration=True)
    run_job(config, progress=False, inputs=inputs)
    analysis_file = config.SensitivityAnalysis.analysis_file
    assert analysis_file is not None
    heldout = build_eval_loader(dataclasses.replace(config.Global, val_list=str(held_list)), torch.device("cpu"))
    model, example = inputs.model, inputs.example_input
    dense = top1(model, heldout)
    dense_macs = count_cost(model, example).macs
    print(f"{model_name}: dense top1 {dense:.4f} on {heldout.num_samples} held-out images", flush=True)
    budgets = [Budget("macs", value) for value in args.budgets]
    budgets += [Budget("latency", value) for value in ([args.latency] if args.latency is not None else [])]
    rows = []
    with eval_mode(model):
        for budget in budgets:
            probe = probe_of(config, inputs, args.probe_steps, args.recipe)
            recorder = RecordingProbe(probe)
            heldout_probe = dataclasses.replace(probe, inputs=dataclasses.replace(inputs, loader=heldout))
            made: dict[str, Any] = {}
            for method, make in plans(inputs, analysis_file, budget, args, recorder, made).items():
                if args.methods and method not in args.methods:
                    continue
                start = time.perf_counter()
                try:
                    removals = make()
                except (LatencyGoalNotReached, NotReached) as error:
                    print(
                        f"| {model_name} | latency {budget.value:.0%} | {method} | not reached: {error} |", flush=True
                    )
                    continue
                plan_seconds = time.perf_counter() - start
                pruned = jointly_pruned_copy(model, removals, example)
                reduction = 1 - count_cost(pruned, example).macs / dense_macs
                one_shot = top1(pruned, heldout)
                assert inputs.calibration is not None
                recalibrate_copy(model, pruned, removals, example, inputs.calibration.loader)
                row = Row(
                    model_name, budget.value, method, reduction, one_shot, top1(pruned, heldout), kind=budget.kind
                )
                row.seconds["plan"] = plan_seconds
                if budget.kind == "latency":
                    timed(row, made.get(method), inputs, pruned, args)
                row.probe = heldout_probe.score(removals)["top1"]
                for epochs in args.epochs:
                    scores, times = [], []
                    for seed in args.seeds:
                        run = f"{budget.kind}{budget.value}-{method}-{epochs}-{seed}".replace(" ", "_")
                        student, seconds = recovered(config, inputs, pruned, epochs, seed, args.out / model_name /
                                                     "runs" / run, args.recipe)  # fmt: skip
                        scores.append(top1(student, heldout))
                        times.append(seconds)
                    row.recovered[str(epochs)] = scores
                    row.seconds[str(epochs)] = statistics.mean(times)
                if method == "recovered" and args.finalists:
                    row.finalists = study_finalists(config, inputs, heldout, made["search"], recorder.calls, args,
                                                    args.out / model_name / "runs" / f"{budget.kind}{budget.value}-"
                                                    "finalist")  # fmt: skip
                rows.append(row)
                keep(model_name, dense, rows)
                print(line(row, args.epochs), flush=True)
    return rows, dense


def timed(row: Row, plan: Plan | None, inputs: Inputs, pruned: torch.nn.Module, args: argparse.Namespace) -> None:
    """A latency budget's row: the planner's verdict (our plans) and the pruned model timed against the dense one in a
    fresh process (``independent_latency.py``: ONNX files, ONNX Runtime, --latency-batch, interleaved)."""
    if plan is not None and plan.latency is not None:
        row.verdict = plan.latency.verdict
        row.planner_reduction = plan.latency.last.measured.reduction
        row.attempts = [{"target": a.target_reduction, "predicted": round(a.predicted_reduction, 4),
                         "measured": round(a.measured.reduction, 4),
                         "interval": [round(end, 4) for end in a.measured.interval]}
                        for a in plan.latency.attempts]  # fmt: skip
    check_args = argparse.Namespace(exporter="torchscript", independent_rounds=args.independent_rounds,
                                    threads=args.threads, independent_seconds=1.0)  # fmt: skip
    check = independent_check(inputs, Candidate(pruned.eval(), row.macs_reduction), "onnxruntime", args.latency_batch,
                              check_args)  # fmt: skip
    row.independent = check.independent if check.independent is not None else {"error": check.error}


def study_finalists(
    config: Config,
    inputs: Inputs,
    heldout: EvalLoader,
    search: dict[str, Any],
    calls: list[Removals],
    args: argparse.Namespace,
    folder: Path,
) -> list[dict[str, Any]]:
    """Every finalist of the recovered method's search: its top1 in the search's full setting and after the probe (the
    seen half, as the two methods choose), and held out after the longest recovery, each seed."""
    if len(calls) != len(search["finalists"]):
        print(f"  finalists: the probe's scores came from an earlier run's search log ({len(calls)} of "
              f"{len(search['finalists'])} probed now); run with a fresh --out to study them", flush=True)  # fmt: skip
        return []
    model, example = inputs.model, inputs.example_input
    studied = []
    for index, (removals, full, probed) in enumerate(zip(calls, search["finalists"], search["probed"], strict=True)):
        pruned = jointly_pruned_copy(model, removals, example)
        assert inputs.calibration is not None
        recalibrate_copy(model, pruned, removals, example, inputs.calibration.loader)
        entry: dict[str, Any] = {"name": full["name"], "bn": full["top1"], "probe": probed["top1"], "recovered": {},
                                 "chosen": full["name"] == search["chosen"]}  # fmt: skip
        for epochs in [max(args.epochs)]:
            runs = [recovered(config, inputs, pruned, epochs, seed, folder / f"{index}-{epochs}-{seed}", args.recipe)[0]
                    for seed in args.seeds]  # fmt: skip
            entry["recovered"][str(epochs)] = [top1(student, heldout) for student in runs]
        after = statistics.mean(entry["recovered"][str(max(args.epochs))])
        print(f"  finalist {full['name']}{' (chosen)' if entry['chosen'] else ''}: BN {entry['bn']:.3f}, probe "
              f"{entry['probe']:.3f} (seen half) | held out after {max(args.epochs)} epochs {after:.3f}",
              flush=True)  # fmt: skip
        studied.append(entry)
    return studied


def line(row: Row, epochs: list[int]) -> str:
    after = " | ".join(f"{statistics.mean(row.recovered[str(e)]):.3f} ({_spread(row.recovered[str(e)])})"
                       for e in epochs)  # fmt: skip
    per_epoch = statistics.mean(row.seconds[str(e)] / e for e in epochs)
    return (f"| {row.model} | {row.label} ({row.macs_reduction:.1%}) | {row.method} | {row.one_shot:.3f} | "
            f"{row.bn:.3f} | {row.probe:.3f} | {after} | {per_epoch:.1f} s | {_latency(row)} |")  # fmt: skip


def _latency(row: Row) -> str:
    """A latency row's independent reduction (median, smallest-largest of the rounds) and our planner's verdict."""
    measured = row.independent
    if measured is None:
        return "-"
    if "median_reduction" not in measured:
        return f"failed: {measured.get('error', '')}"
    low, high = measured["interval"]
    verdict = f"; planner: {row.verdict} at {row.planner_reduction:.1%}" if row.verdict else ""
    return f"{measured['median_reduction']:.1%} ({low:.1%} to {high:.1%}){verdict}"


def _spread(values: list[float]) -> str:
    return "/".join(f"{value:.3f}" for value in values)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks; nan when either side is constant or has a nan)."""
    if any(value != value for value in (*xs, *ys)):
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def correlation_cell(value: float) -> str:
    """A rank correlation for the table: ``-`` where it is undefined (every plan tied, as on the demo ResNet)."""
    return "-" if value != value else f"{value:+.2f}"


def rank_agreement(results: dict[str, Any]) -> list[str]:
    """Per model and budget: how well each earlier figure (one-shot, BN, the probe, a shorter recovery) ranks the plans
    as the longest recovery does (Spearman over the plans, seeds averaged), as Markdown rows; then the same over the
    recovered method's finalists (BN and probe on the seen half, as the methods choose by)."""
    longest = str(max(results["epochs"]))
    shorter = [str(e) for e in sorted(results["epochs"]) if str(e) != longest]
    lines = ["| " + " | ".join(["plans of", "budget", "one-shot", "BN", "probe", *(f"{e} epochs" for e in shorter)])
             + " |"]  # fmt: skip
    for model, data in results["models"].items():
        for kind, budget in sorted({(row.get("kind", "macs"), row["budget"]) for row in data["rows"]}, reverse=True):
            rows = [row for row in data["rows"] if (row.get("kind", "macs"), row["budget"]) == (kind, budget)]
            label = Row(model, budget, "", 0, 0, 0, kind=kind).label
            target = [statistics.mean(row["recovered"][longest]) for row in rows]
            predictors = [[row["one_shot"] for row in rows], [row["bn"] for row in rows],
                          [row.get("probe", float("nan")) for row in rows]]  # fmt: skip
            predictors += [[statistics.mean(row["recovered"][e]) for row in rows] for e in shorter]
            cells = " | ".join(correlation_cell(spearman(values, target)) for values in predictors)
            lines.append(f"| {model} | {label} | {cells} |")
            for row in rows:
                finalists = row.get("finalists") or []
                if len(finalists) < 2:
                    continue
                target = [statistics.mean(f["recovered"][longest]) for f in finalists]
                predictors = [[f["bn"] for f in finalists], [f["probe"] for f in finalists]]
                bn, probe = (correlation_cell(spearman(values, target)) for values in predictors)
                lines.append(f"| {len(finalists)} finalists, {model} | {label} | - | {bn} | {probe} |"
                             + " - |" * len(shorter))  # fmt: skip
    return lines


def summarise(path: Path) -> None:
    """Print the table and the rank agreement of a finished run's JSON."""
    results = json.loads(path.read_text())
    epochs = results["epochs"]
    for model, data in results["models"].items():
        print(f"{model}: dense top1 {data['dense']:.4f} (held out)")
        for row in data["rows"]:
            print(line(Row(**row), epochs))
    print(f"\nrank agreement with {max(epochs)} epochs (Spearman over the plans; -: every plan tied):")
    print("\n".join(rank_agreement(results)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["digits_mobilenet", "digits_resnet"])
    parser.add_argument("--budgets", nargs="*", type=float, default=[0.5, 0.65], help="MACs reductions")
    parser.add_argument("--latency", type=float, default=0.3, help="a latency reduction (0: none)")
    parser.add_argument("--latency-batch", type=int, default=32, help="images per call of the latency budget")
    parser.add_argument("--latency-round-to", type=int, default=8, help="channel alignment of every latency plan")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (planner and check); 0: default")
    parser.add_argument("--independent-rounds", type=int, default=7, help="pruned timings of each independent check")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
                        help="the analysis's ratios (the demo's 0.1-0.4 cannot reach 65%% fewer MACs)")  # fmt: skip
    parser.add_argument("--epochs", nargs="+", type=int, default=[3])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="kd",
        help="kd: distil the dense model's logits (l2); ce: learn the labels only",
    )
    parser.add_argument("--methods", nargs="+", help="only these plans (default: every one)")
    parser.add_argument("--probe-steps", type=int, default=40, help="the recovered method's probe length")
    parser.add_argument(
        "--finalists",
        action="store_true",
        help="recover every finalist of the recovered method too (the longest --epochs only)",
    )
    parser.add_argument("--eval-budget", type=int, default=None, help="the measured method's joint evaluations")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "bench_recovery")
    parser.add_argument("--summarise", type=Path, help="print the tables of a finished run's JSON and stop")
    args = parser.parse_args()
    if args.summarise is not None:
        summarise(args.summarise)
        return 0
    args.latency = args.latency or None
    args.out = args.out.resolve()  # the split lists are named by absolute path (a relative one is read from data_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, commit {commit.stdout.strip()}", flush=True)  # fmt: skip
    header = " | ".join(f"{e} epochs (seeds {'/'.join(map(str, args.seeds))})" for e in args.epochs)
    print(f"| model | MACs cut | plan | one-shot | BN | probe ({args.probe_steps} steps) | {header} | recovery per "
          f"epoch | latency (independent, batch {args.latency_batch}) |", flush=True)  # fmt: skip
    results: dict[str, Any] = {"epochs": args.epochs, "seeds": args.seeds, "recipe": args.recipe,
                               "probe_steps": args.probe_steps, "models": {}}  # fmt: skip

    def keep(model: str, dense: float, rows: list[Row]) -> None:
        results["models"][model] = {"dense": dense, "rows": [dataclasses.asdict(row) for row in rows]}
        (args.out / "bench_recovery.json").write_text(json.dumps(results, indent=2))

    for model in args.models:
        bench_model(model, args, keep)
    if len(args.epochs) > 1:
        print(f"\nrank agreement with {max(args.epochs)} epochs (Spearman over the plans; -: every plan tied):")
        print("\n".join(rank_agreement(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

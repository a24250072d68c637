#!/usr/bin/env python
"""Latency budgets: the latency plan against the MACs plan of the same measured latency, per runtime and batch.

For each model it runs the sensitivity analysis (timed), then for every setting (runtime:batch) and latency table kind:

* the latency plan: ``plan_for_latency`` for ``--reduction`` fewer ms than the dense model (its cached latency table is
  deleted first, so the table is really measured and its time is the table's cost);
* the MACs plan of the same measured latency: ``build_plan(..., "macs")`` for the smallest MACs reduction whose
  pruned model measures at most the latency plan's measured latency on the same runtime (bisection on the target,
  stopped when the bracket is narrower than ``--tolerance``);
* both plans and the dense model measured again, interleaved (``--rounds`` rounds, order alternating, medians), so
  their latencies are compared side by side;
* on the demo models (trained weights) top1 of both plans on the demo's evaluation images, raw and after
  re-estimating the BatchNorm statistics the pruning changed on the calibration images (as ``run.py verify`` does).

The torchvision models have random weights (nothing is downloaded; seed fixed) at ``--size`` px and are analysed on
``--images`` demo digits images resized to that size with ``metric: ce`` (top1 of a random network says nothing, so
it is printed as n/a). Goals checked per row: the latency plan's interleaved measured latency is within 5% of its
prediction and meets the budget (also against the dense model measured side by side); at equal latency its top1
after BatchNorm re-estimation is at least the MACs plan's (demo models); building the table took less time than the
analysis of the same model on this machine.

    python benchmarks/bench_latency.py --models digits_resnet digits_mobilenet --settings onnxruntime:1
    python benchmarks/bench_latency.py --models resnet18 --settings onnxruntime:1 onnxruntime:32 torch:1
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's package, even where an editable install points elsewhere

from analysis.config import Config, load_config  # noqa: E402
from analysis.engine.evaluate import evaluate  # noqa: E402
from analysis.errors import UserError  # noqa: E402
from analysis.inputs.build import Inputs, build_inputs  # noqa: E402
from analysis.io.record import AnalysisRecord, load_record  # noqa: E402
from analysis.planning.latency_plan import plan_for_latency  # noqa: E402
from analysis.planning.plan import Plan, build_plan  # noqa: E402
from analysis.planning.verify import measure_pruned  # noqa: E402
from analysis.runtimes.runtime import Runtime, make_runtime  # noqa: E402
from analysis.structure.physical import jointly_pruned_copy  # noqa: E402
from analysis.workflow.job import run_job  # noqa: E402

DEMO_MODELS = ("digits_resnet", "digits_mobilenet")
TORCHVISION_MODELS = ("resnet18", "mobilenet_v2", "efficientnet_b0")
TABLE_KINDS = ("model", "layers")
TABLE_KEYWORD = "table" in inspect.signature(plan_for_latency).parameters
"""Whether ``plan_for_latency`` takes ``table="model"|"layers"`` (else it has one kind of table, its default)."""

PREDICTION_TOLERANCE = 0.05


@dataclass
class Row:
    """One model, runtime, batch and table kind: the latency plan and the MACs plan of the same latency."""

    model: str
    runtime: str
    batch: int
    table: str
    status: str = "ok"
    message: str = ""
    dense_ms: float | None = None
    goal_ms: float | None = None
    table_seconds: float | None = None
    analysis_seconds: float | None = None
    attempts: list[dict[str, float]] = field(default_factory=list)
    latency_plan_seconds: float | None = None
    latency_macs_reduction: float | None = None
    latency_predicted_ms: float | None = None
    latency_planned_ms: float | None = None  # the plan's own measurement (its last attempt)
    macs_target: float | None = None
    macs_macs_reduction: float | None = None
    macs_search: list[dict[str, float]] = field(default_factory=list)
    interleaved_ms: dict[str, float] = field(default_factory=dict)  # dense, latency, macs: medians over rounds
    interleaved_runs: dict[str, list[float]] = field(default_factory=dict)
    baseline_top1: float | None = None
    latency_top1: dict[str, float] = field(default_factory=dict)  # raw, bn
    macs_top1: dict[str, float] = field(default_factory=dict)
    goals: dict[str, bool | None] = field(default_factory=dict)

    @property
    def prediction_error(self) -> float | None:
        """|measured - predicted| / measured of the latency plan, each as a fraction of its dense latency (the
        prediction of the table's, the measurement of the dense model's in the same interleaved runs), so a machine
        whose speed changed since the table was measured does not count as an error."""
        measured, dense = self.interleaved_ms.get("latency"), self.interleaved_ms.get("dense")
        if measured is None or dense is None or self.latency_predicted_ms is None or self.dense_ms is None:
            return None
        return _relative_error(self.latency_predicted_ms / self.dense_ms, measured / dense)

    @property
    def first_prediction_error(self) -> float | None:
        """The same for the first attempt, predicted from the table alone (before any correction), against its
        measurement beside the dense model."""
        if not self.attempts or self.dense_ms is None:
            return None
        first = self.attempts[0]
        return _relative_error(first["predicted_ms"] / self.dense_ms, first["measured_ms"] / first["dense_ms"])


def _relative_error(predicted: float, measured: float) -> float:
    return abs(measured - predicted) / measured


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    """``function()`` and its wall time in seconds."""
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def model_config(name: str, args: argparse.Namespace) -> Config:
    """The config analysing ``name`` into ``args.out/<name>/``: the demo's own for the demo models, else torchvision
    with random weights at ``args.size`` px on ``args.images`` digits images resized to it, with ``metric: ce``."""
    folder = args.out / name
    folder.mkdir(parents=True, exist_ok=True)
    ratios = f"[{','.join(str(r) for r in args.ratios)}]"
    common = [
        f"SensitivityAnalysis.analysis_file={folder / 'sensitivity.pkl'}",
        f"SensitivityAnalysis.pruned_ratios={ratios}",
        "SensitivityAnalysis.report=false",
        "SensitivityAnalysis.target_loss=null",
        "Global.device=cpu",
    ]
    if name in DEMO_MODELS:
        return load_config(REPO_ROOT / "configs" / "demo" / f"{name}.yaml", common)
    yaml = folder / "config.yaml"
    yaml.write_text(
        "Global:\n"
        f"  arch: {name}\n"
        "  arch_kwargs: {num_classes: 10}\n"
        f"  data_dir: {REPO_ROOT / 'datasets' / 'digits'}\n"
        f"  batch_size: {min(32, args.images)}\n"
        f"  resize_size: {args.size}\n"
        f"  img_size: {args.size}\n"
        "  num_workers: 0\n"
        f"  max_samples: {args.images}\n"
        "  seed: 0\n"
        "SensitivityAnalysis:\n"
        "  metric: ce\n"
    )
    return load_config(yaml, common)


def describe_analysis(config: Config, inputs: Inputs) -> str:
    """The analysis settings, for the output."""
    s = config.SensitivityAnalysis
    return (
        f"engine {s.engine}, metric {s.metric}, ratios {s.pruned_ratios}, {inputs.loader.num_samples} images at "
        f"{config.Global.img_size} px, batch {config.Global.batch_size}, criterion {s.criterion}"
    )


def delete_tables(analysis_file: Path) -> None:
    """Remove the cached latency tables beside ``analysis_file``, so the next plan measures its table."""
    for path in analysis_file.parent.glob(f"{analysis_file.name}.latency-*.json"):
        path.unlink()


def macs_reduction(plan: Plan) -> float:
    """The exact MACs reduction of ``plan``."""
    return 1.0 - plan.pruned.macs / plan.dense.macs


def measure_plan(inputs: Inputs, runtime: Runtime, batch: int, plan: Plan) -> float:
    """Median latency in ms of ``plan``'s physically pruned model on ``runtime``."""
    pruned = jointly_pruned_copy(inputs.model, plan.removals(), inputs.example_input)
    return runtime.measure(pruned.eval(), tuple(inputs.example_input.shape[1:]), batch).median_ms


def macs_plan_at(
    inputs: Inputs,
    record: AnalysisRecord,
    runtime: Runtime,
    batch: int,
    reference: torch.nn.Module,
    start: float,
    tolerance: float,
    log: list[dict[str, float]],
) -> Plan:
    """The MACs plan with the smallest target reduction whose pruned model measures at most as long as ``reference``
    (the latency plan's model, measured again just before each candidate): from ``start`` up in steps of 0.1 until one
    is as fast, then bisection until the bracket is narrower than ``tolerance``.

    Raises:
        UserError: If no MACs plan the analysed ratios allow is as fast.
    """
    plans: dict[float, Plan] = {}
    shape = tuple(inputs.example_input.shape[1:])

    def fits(target: float) -> bool:
        plan = build_plan(inputs.model, inputs.example_input, record, target, "macs")
        limit = runtime.measure(reference, shape, batch).median_ms
        ms = measure_plan(inputs, runtime, batch, plan)
        plans[target] = plan
        log.append({"target": round(target, 6), "macs_reduction": macs_reduction(plan), "measured_ms": ms,
                    "latency_plan_ms": limit})  # fmt: skip
        return ms <= limit

    low, high = 0.0, min(0.95, max(0.01, start))
    while not fits(high):
        low = high
        if high >= 0.95:
            raise UserError("no MACs plan of the analysed ratios measures as fast as the latency plan")
        try:
            high = min(0.95, high + 0.1)
            build_plan(inputs.model, inputs.example_input, record, high, "macs")
        except UserError as error:
            message = f"no MACs plan measured as fast as the latency plan before the ratios ran out ({error})"
            raise UserError(message) from None
    while high - low > tolerance:
        middle = (low + high) / 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return plans[high]


def interleaved(
    inputs: Inputs, runtime: Runtime, batch: int, models: dict[str, torch.nn.Module], rounds: int
) -> dict[str, list[float]]:
    """Each model's latency ``rounds`` times, in turn and in alternating order, so a slow phase hits all alike."""
    shape = tuple(inputs.example_input.shape[1:])
    runs: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            runs[name].append(runtime.measure(models[name], shape, batch).median_ms)
    return runs


def top1(inputs: Inputs, plan: Plan) -> dict[str, float]:
    """Raw and BatchNorm re-estimated top1 of ``plan``'s physically pruned model on the evaluation images."""

    def score(candidate: torch.nn.Module) -> dict[str, float]:
        return evaluate(candidate, inputs.loader, progress=False).metrics()

    _, raw, recalibrated = measure_pruned(inputs.model, plan.removals(), score, inputs.example_input,
                                          inputs.calibration)  # fmt: skip
    assert recalibrated is not None
    return {"raw": raw["top1"], "bn": recalibrated.metrics["top1"]}


def bench_row(
    row: Row, inputs: Inputs, record: AnalysisRecord, analysis_file: Path, args: argparse.Namespace, trained: bool
) -> None:
    """Fill ``row``: both plans, their interleaved latencies, top1 (trained models) and the goals."""
    model, example = inputs.model, inputs.example_input
    runtime = make_runtime(row.runtime, torch.device("cpu"))
    delete_tables(analysis_file)
    keywords: dict[str, Any] = {"table": row.table} if TABLE_KEYWORD else {}
    start = time.perf_counter()
    try:
        plan = plan_for_latency(
            model, example, record, runtime, reduction=args.reduction, batch=row.batch, progress=False, **keywords
        )
    finally:  # also when the budget is unreachable: the time includes measuring the table
        row.latency_plan_seconds = time.perf_counter() - start
    outcome = plan.latency
    assert outcome is not None
    row.dense_ms, row.goal_ms, row.table_seconds = outcome.dense_ms, outcome.goal_ms, outcome.table_seconds
    row.attempts = list(outcome.attempts)
    row.latency_predicted_ms, row.latency_planned_ms = outcome.predicted_ms, outcome.measured_ms
    row.latency_macs_reduction = macs_reduction(plan)
    print(f"  latency plan: {row.latency_planned_ms:.3f} ms measured, {row.latency_predicted_ms:.3f} predicted, "
          f"goal {row.goal_ms:.3f}, {len(row.attempts)} attempt(s), table {row.table_seconds:.1f} s",
          flush=True)  # fmt: skip
    macs_plan: Plan | None = None
    latency_copy = jointly_pruned_copy(model, plan.removals(), example).eval()
    try:
        macs_plan = macs_plan_at(inputs, record, runtime, row.batch, latency_copy, row.latency_macs_reduction,
                                 args.tolerance, row.macs_search)  # fmt: skip
    except UserError as error:  # the latency plan is still measured and scored
        row.status, row.message = "MACs plan unreachable", str(error)
        print(f"  MACs plan unreachable: {error}", flush=True)
    copies = {"dense": model, "latency": latency_copy}
    if macs_plan is not None:
        row.macs_target, row.macs_macs_reduction = macs_plan.target, macs_reduction(macs_plan)
        print(f"  MACs plan: target {row.macs_target:.3f} after {len(row.macs_search)} measured candidates", flush=True)
        copies["macs"] = jointly_pruned_copy(model, macs_plan.removals(), example).eval()
    row.interleaved_runs = interleaved(inputs, runtime, row.batch, copies, args.rounds)
    row.interleaved_ms = {name: statistics.median(runs) for name, runs in row.interleaved_runs.items()}
    if trained:
        row.latency_top1 = top1(inputs, plan)
        row.macs_top1 = top1(inputs, macs_plan) if macs_plan is not None else {}
    error = row.prediction_error
    assert error is not None
    measured = row.interleaved_ms
    row.goals = {
        "prediction within 5%": error <= PREDICTION_TOLERANCE,
        "planning met it": outcome.met,  # its last attempt, against the dense model measured beside it
        "meets budget side by side": measured["latency"] <= (1.0 - args.reduction) * measured["dense"],
        "top1 >= MACs plan": row.latency_top1["bn"] >= row.macs_top1["bn"] if trained and row.macs_top1 else None,
        "table < analysis": row.table_seconds < (row.analysis_seconds or 0.0),
    }


def bench_model(name: str, args: argparse.Namespace, rows: list[Row], save: Callable[[], None]) -> dict[str, Any]:
    """Analyse ``name`` (timed), then one row per setting and table kind; returns the analysis' description."""
    config = model_config(name, args)
    trained = name in DEMO_MODELS
    inputs = build_inputs(config, progress=False, calibration=trained)
    _, seconds = timed(lambda: run_job(config, overwrite=True, progress=False, inputs=inputs))
    settings = describe_analysis(config, inputs)
    print(f"{name}: analysis {seconds:.1f} s ({settings})", flush=True)
    analysis_file = Path(str(config.SensitivityAnalysis.analysis_file))
    record = load_record(analysis_file)
    baseline = evaluate(inputs.model, inputs.loader, progress=False).top1 if trained else None
    for setting in args.settings:
        runtime_name, batch = setting.split(":")
        for table in args.table:
            row = Row(name, runtime_name, int(batch), table, analysis_seconds=seconds, baseline_top1=baseline)
            print(f"{name} {setting} table={table}", flush=True)
            try:
                bench_row(row, inputs, record, analysis_file, args, trained)
            except UserError as error:
                row.status, row.message = "unreachable", str(error)
                print(f"  unreachable: {error}", flush=True)
            rows.append(row)
            print(line(row), flush=True)
            save()
    return {"seconds": seconds, "settings": settings}


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _top1(values: dict[str, float]) -> str:
    return f"{values['raw']:.3f} / {values['bn']:.3f}" if values else "n/a"


def _goals(row: Row) -> str:
    marks = {True: "yes", False: "NO", None: "n/a"}
    return ", ".join(f"{name}: {marks[value]}" for name, value in row.goals.items())


HEADER = (
    "| model | runtime:batch | table | dense ms | goal ms | latency plan: predicted / measured ms (err, 1st err) | "
    "attempts | MACs plan ms | MACs cut: latency / MACs plan | top1 raw / BN: latency plan | top1 raw / BN: MACs "
    "plan | table s / analysis s | goals |\n" + "| --- " * 13 + "|"
)


def line(row: Row) -> str:
    """The row as a Markdown table line."""
    head = f"| {row.model} | {row.runtime}:{row.batch} | {row.table} | "
    if not row.interleaved_ms:  # the latency plan failed
        seconds = (
            f"{row.table_seconds:.1f}" if row.table_seconds is not None else f"(plan {row.latency_plan_seconds:.1f})"
        )
        return head + f"{row.status}: {row.message} |" + " |" * 7 + f" {seconds} / {row.analysis_seconds:.1f} | |"
    measured = row.interleaved_ms
    return (
        head + f"{_ms(measured['dense'])} | {_ms(row.goal_ms)} | {_ms(row.latency_predicted_ms)} / "
        f"{_ms(measured['latency'])} ({_pct(row.prediction_error)}, {_pct(row.first_prediction_error)}) | "
        f"{len(row.attempts)} | {_ms(measured.get('macs')) or 'unreachable'} | {_pct(row.latency_macs_reduction)} / "
        f"{_pct(row.macs_macs_reduction)} | {_top1(row.latency_top1)} | {_top1(row.macs_top1)} | "
        f"{row.table_seconds:.1f} / {row.analysis_seconds:.1f} | {_goals(row)}"
        + (f" ({row.status}: {row.message})" if row.status != "ok" else "")
        + " |"
    )


def parse_settings(values: Sequence[str]) -> list[str]:
    """``runtime:batch`` strings, checked."""
    for value in values:
        name, _, batch = value.partition(":")
        if name not in ("torch", "onnxruntime") or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"--settings takes runtime:batch with runtime torch or onnxruntime, got '{value}'")
    return list(values)


def main(argv: list[str] | None = None) -> int:
    """Run every model, setting and table kind; print one Markdown table and save the rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*DEMO_MODELS, *TORCHVISION_MODELS],
                        choices=[*DEMO_MODELS, *TORCHVISION_MODELS])  # fmt: skip
    parser.add_argument("--settings", nargs="+", default=["onnxruntime:1", "onnxruntime:32", "torch:1"],
                        help="runtime:batch to plan and measure on (runtime torch or onnxruntime)")  # fmt: skip
    parser.add_argument("--reduction", type=float, default=0.3, help="latency reduction asked of the latency plan")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                        help="pruned ratios of every analysis")  # fmt: skip
    parser.add_argument("--images", type=int, default=32, help="analysis images of the torchvision models")
    parser.add_argument("--size", type=int, default=224, help="input size of the torchvision models (px)")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="the MACs plan search stops when its bracket of MACs targets is this narrow")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the final latency comparison")
    parser.add_argument("--table", nargs="+", choices=TABLE_KINDS, default=list(TABLE_KINDS) if TABLE_KEYWORD else None,
                        help="latency table kinds (only where plan_for_latency takes table=)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "_data" / "latency")
    args = parser.parse_args(argv)
    if args.table is not None and not TABLE_KEYWORD:
        parser.error("--table: this plan_for_latency has no table= keyword (one kind of table, its default)")
    args.table = args.table or ["default"]
    args.settings = parse_settings(args.settings)
    torch.manual_seed(0)
    rows: list[Row] = []
    analyses: dict[str, Any] = {}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        data = [{**asdict(row), "prediction_error": row.prediction_error,
                 "first_prediction_error": row.first_prediction_error} for row in rows]  # fmt: skip
        (args.out / "results.json").write_text(json.dumps({"rows": data, "analyses": analyses}, indent=1))

    for name in args.models:
        analyses[name] = bench_model(name, args, rows, save)
        save()
    print(f"\nLatency reduction asked: {args.reduction:.0%}; ms are medians of {args.rounds} interleaved runs; "
          f"err = |measured - predicted| / measured, each as a fraction of its dense latency (1st err: the first "
          "attempt, "
          f"from the table alone); goal ms = {1 - args.reduction:g} x the dense latency the table measured; 'meets "
          f"budget side by side': the latency plan measures at most {1 - args.reduction:g} x the dense model in the "
          "interleaved runs; the MACs plan is the smallest MACs target measured as fast as the latency plan (each "
          "candidate timed right after it).\n")  # fmt: skip
    print(HEADER)
    for row in rows:
        print(line(row))
    print()
    for name, analysis in analyses.items():
        print(f"{name}: analysis {analysis['seconds']:.1f} s ({analysis['settings']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

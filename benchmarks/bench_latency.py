#!/usr/bin/env python
"""Latency budgets, each plan checked by an independent measurement in a fresh process.

For each model it runs the sensitivity analysis (timed; or reuses the last one with ``--reuse-analysis``), then for
every setting (``runtime:batch``), latency table kind and target reduction:

* the latency plan: ``plan_for_latency`` for ``--targets`` less latency than the dense model (the cached latency
  tables are deleted before the first target of each setting and table kind, so the table is really measured and its
  time is the table's cost; later targets reuse it). Its verdict is the planner's: met, missed, noisy, or not
  reachable (the planner raised its "not reachable within the analysed ratios" sentence after measuring the largest
  plan the analysed ratios allow);
* the MACs plan of equal latency: ``build_plan(..., "macs")`` for the smallest MACs target whose pruned model, timed
  between timings of the latency plan's model (``bracket``), is at least as fast (from the latency plan's own MACs
  reduction up in steps of 0.1, then bisection down to ``--macs-tolerance``; ``--no-macs`` skips it);
* for a not-reachable verdict, the largest plan: every group at its largest analysed count, built with the planner;
* the independent check of every such plan: the dense and the pruned model are exported to ONNX files with the same
  exporter the shipped file uses (``export_onnx(..., first=--exporter)``), and ``benchmarks/independent_latency.py``
  times the two files in a fresh Python process with its own ONNX Runtime sessions (dense, pruned, dense, ..., dense;
  ``--independent-rounds`` pruned timings, each the median of single calls for ``--independent-seconds``). For the
  ``torch`` rows it times the two PyTorch modules instead, eager, in the fresh process (both saved whole with
  ``torch.save`` to temporary files of this benchmark and loaded there with ``weights_only=False``). The machine is
  not loaded by ``--busy`` processes during these checks.

Confirmation rule (the independent measurement against the planner's verdict): ``met`` is confirmed when the
independent median reduction is at least the target; ``missed`` when it is below the target; ``not reachable`` when
the largest plan's independent median is below the target; ``noisy`` is not judged. With ``--busy N``, N processes
burning a CPU each run during planning only (the table, the plan's attempts and the MACs search), and the goal is
that no plan called met is not confirmed by the quiet independent measurement.

The torchvision models have random weights (nothing is downloaded; seed fixed) at ``--size`` px and are analysed on
``--images`` demo digits images resized to that size with ``metric: ce``; the demo models use their own config.
The prediction error compares latency fractions on the same baseline (the dense model measured beside the plan):
``|(1 - predicted reduction) - (1 - measured reduction)| / (1 - measured reduction)``.

    python benchmarks/bench_latency.py --models digits_resnet --settings onnxruntime:1
    python benchmarks/bench_latency.py --models resnet18 --settings onnxruntime:1 --targets 0.2 0.3 --images 32
    python benchmarks/bench_latency.py --models resnet18 --settings onnxruntime:1 --targets 0.3 --busy 1
    python benchmarks/bench_latency.py   # the full grid: three 224-px models, onnxruntime 1 and 32, torch 1: hours
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's package, even where an editable install points elsewhere

from analysis.config import Config, load_config  # noqa: E402
from analysis.errors import UserError  # noqa: E402
from analysis.inputs.build import Inputs, build_inputs  # noqa: E402
from analysis.io.record import AnalysisRecord, load_record  # noqa: E402
from analysis.planning.latency import LatencyGoalNotReached, LatencyOutcome  # noqa: E402
from analysis.planning.latency_plan import plan_for_latency  # noqa: E402
from analysis.planning.plan import Plan, build_plan, open_planner  # noqa: E402
from analysis.runtimes.compare import bracket  # noqa: E402
from analysis.runtimes.onnx_export import export_onnx  # noqa: E402
from analysis.runtimes.runtime import Prepared, Runtime, make_runtime  # noqa: E402
from analysis.runtimes.settings import RuntimeSettings  # noqa: E402
from analysis.structure.groups import eval_mode  # noqa: E402
from analysis.structure.physical import jointly_pruned_copy  # noqa: E402
from analysis.workflow.job import run_job  # noqa: E402

DEMO_MODELS = ("digits_resnet", "digits_mobilenet")
TORCHVISION_MODELS = ("resnet18", "mobilenet_v2", "efficientnet_b0")
TABLE_KINDS = ("model", "layers")
INDEPENDENT = Path(__file__).resolve().parent / "independent_latency.py"
NOT_REACHABLE = "not reachable within the analysed ratios"


@dataclass
class Check:
    """One plan and its independent measurement.

    Attributes:
        macs_reduction: The plan's exact MACs reduction.
        independent: ``independent_latency.py``'s JSON (None when it failed: see ``error``).
    """

    macs_reduction: float
    independent: dict[str, Any] | None = None
    error: str = ""

    @property
    def median(self) -> float | None:
        """The independent median reduction."""
        return None if self.independent is None else float(self.independent["median_reduction"])


@dataclass
class Row:
    """One model, runtime, batch, table kind and target: the planner's verdict and the independent checks."""

    model: str
    runtime: str
    batch: int
    table: str
    target: float
    busy: int
    analysis_seconds: float
    analysis_images: int
    verdict: str = ""  # met, missed, noisy, not reachable, or "error"
    message: str = ""
    table_seconds: float | None = None
    table_cached: bool = False
    plan_seconds: float | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    predicted_reduction: float | None = None
    measured: dict[str, Any] | None = None  # the chosen plan's (or the largest plan's) Bracketed, JSON form
    first_error: float | None = None
    macs_target: float | None = None
    macs_search: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)  # latency, macs, largest

    @property
    def prediction_error(self) -> float | None:
        """The chosen plan's prediction against its measurement, as latency fractions on the same baseline."""
        if self.predicted_reduction is None or self.measured is None or self.verdict == "not reachable":
            return None
        return _relative_error(self.predicted_reduction, self.measured["reduction"])

    @property
    def confirmed(self) -> bool | None:
        """Whether the quiet independent measurement confirms the verdict (the rule in the module docstring)."""
        if self.verdict in ("met", "missed"):
            median = self.checks["latency"].median if "latency" in self.checks else None
            if median is None:
                return None
            return median >= self.target if self.verdict == "met" else median < self.target
        if self.verdict == "not reachable":
            median = self.checks["largest"].median if "largest" in self.checks else None
            return None if median is None else median < self.target
        return None

    @property
    def false_met(self) -> bool:
        """A plan called met that the independent measurement does not confirm (the busy mode's goal: never)."""
        return self.verdict == "met" and self.confirmed is False

    def as_dict(self) -> dict[str, Any]:
        """JSON form, with the derived figures."""
        return {**asdict(self), "prediction_error": self.prediction_error, "confirmed": self.confirmed,
                "false_met": self.false_met}  # fmt: skip


def _relative_error(predicted: float, measured: float) -> float:
    return abs((1.0 - predicted) - (1.0 - measured)) / (1.0 - measured)


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


def analyse(name: str, args: argparse.Namespace) -> tuple[Inputs, AnalysisRecord, float, int, Path]:
    """``name``'s inputs, analysis record, analysis seconds, analysed images and analysis file (the analysis run and
    timed, or with ``--reuse-analysis`` the last one of the same settings, with its recorded seconds)."""
    config = model_config(name, args)
    inputs = build_inputs(config, progress=False)
    analysis_file = Path(str(config.SensitivityAnalysis.analysis_file))
    images = inputs.loader.num_samples
    stamp = analysis_file.with_name("bench-analysis.json")
    key = {"ratios": list(args.ratios), "images": images, "size": args.size}
    known = json.loads(stamp.read_text()) if stamp.exists() and analysis_file.exists() else None
    if args.reuse_analysis and known is not None and known.get("key") == key:
        seconds = float(known["seconds"])
        print(f"{name}: reusing the analysis of {images} images ({seconds:.1f} s when it ran)", flush=True)
    else:
        start = time.perf_counter()
        run_job(config, overwrite=True, progress=False, inputs=inputs)
        seconds = time.perf_counter() - start
        stamp.write_text(json.dumps({"key": key, "seconds": seconds}))
        print(f"{name}: analysis of {images} images took {seconds:.1f} s", flush=True)
    return inputs, load_record(analysis_file), seconds, images, analysis_file


def delete_tables(analysis_file: Path) -> None:
    """Remove the cached latency tables beside ``analysis_file``, so the next plan measures its table."""
    for path in analysis_file.parent.glob(f"{analysis_file.name}.latency-*.json"):
        path.unlink()


@contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes each burning a CPU for the block's duration (ended by their ids after it)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in burners:
            process.terminate()
        for process in burners:
            process.wait()


@dataclass(frozen=True)
class Candidate:
    """A pruned model to check independently, with its exact MACs reduction."""

    model: torch.nn.Module
    macs_reduction: float


def planned(inputs: Inputs, plan: Plan) -> Candidate:
    """``plan``'s pruned model."""
    return Candidate(pruned_model(inputs, plan), macs_reduction(plan))


def largest_plan(inputs: Inputs, record: AnalysisRecord, picks: dict[str, int]) -> Candidate:
    """The largest plan the planner measured before saying the goal is not reachable, rebuilt from its picks
    (``LatencyOutcome.largest_picks``: channels removed per group)."""
    with eval_mode(inputs.model):
        planner, _ = open_planner(inputs.model, inputs.example_input, record, "macs")
        removals = planner.removals(picks.items())
        macs = planner.picks_cost(picks.items()).macs / planner.costs.dense.macs
        return Candidate(jointly_pruned_copy(inputs.model, removals, inputs.example_input).eval(), 1.0 - macs)


def macs_reduction(plan: Plan) -> float:
    """The exact MACs reduction of ``plan``."""
    return 1.0 - plan.pruned.macs / plan.dense.macs


def pruned_model(inputs: Inputs, plan: Plan) -> torch.nn.Module:
    """``plan``'s physically pruned copy of the model (the model itself for an empty plan)."""
    if not plan.groups:
        return inputs.model
    return jointly_pruned_copy(inputs.model, plan.removals(), inputs.example_input).eval()


def macs_plan_of_equal_latency(
    inputs: Inputs, record: AnalysisRecord, runtime: Runtime, batch: int, reference: Prepared, start: float,
    tolerance: float, log: list[dict[str, Any]],
) -> Plan:  # fmt: skip
    """The MACs plan of the smallest target whose pruned model, timed between timings of ``reference`` (the latency
    plan's model), is at least as fast: from ``start`` up in steps of 0.1 until one is, then bisection until the
    bracket of targets is narrower than ``tolerance``.

    Raises:
        UserError: If no MACs plan the analysed ratios allow is as fast.
    """
    plans: dict[float, Plan] = {}
    shape = tuple(inputs.example_input.shape[1:])

    def fits(target: float) -> bool:
        plan = build_plan(inputs.model, inputs.example_input, record, target, "macs")
        with runtime.prepare(pruned_model(inputs, plan), shape) as candidate:
            measured = bracket(reference, candidate, batch)
        plans[target] = plan
        log.append({"target": round(target, 6), "macs_reduction": round(macs_reduction(plan), 6),
                    "against_latency_plan": measured.as_dict()})  # fmt: skip
        return measured.reduction >= 0.0

    low, high = 0.0, min(0.95, max(0.01, start))
    while not fits(high):
        low = high
        if high >= 0.95:
            raise UserError("no MACs plan of the analysed ratios measures as fast as the latency plan")
        high = min(0.95, high + 0.1)
        try:
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


def independent_check(
    inputs: Inputs, candidate: Candidate, runtime: str, batch: int, args: argparse.Namespace
) -> Check:
    """``candidate`` against the dense model in a fresh process (ONNX files, or for torch the saved modules)."""
    check = Check(candidate.macs_reduction)
    shape = tuple(inputs.example_input.shape[1:])
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as folder:
        paths = []
        for name, model in (("dense", inputs.model), ("pruned", candidate.model)):
            if runtime == "torch":
                path = Path(folder) / f"{name}.pt"
                torch.save(model, path)
            else:
                path = Path(folder) / f"{name}.onnx"
                export_onnx(model, inputs.example_input, path, first=args.exporter)
            paths.append(str(path))
        command = [sys.executable, str(INDEPENDENT), *paths, "--batch", str(batch), "--rounds",
                   str(args.independent_rounds), "--threads", str(args.threads), "--seconds",
                   str(args.independent_seconds), "--shape", "x".join(str(n) for n in shape)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        check.error = (done.stderr.strip().splitlines() or ["failed"])[-1][:300]
        return check
    check.independent = json.loads(done.stdout.strip().splitlines()[-1])
    return check


def bench_row(row: Row, inputs: Inputs, record: AnalysisRecord, args: argparse.Namespace) -> None:
    """Fill ``row``: plan (under ``--busy`` load), then check every plan quietly in a fresh process."""
    settings = RuntimeSettings(threads=args.threads, exporter=args.exporter)
    runtime = make_runtime(row.runtime, torch.device("cpu"), settings=settings)
    shape = tuple(inputs.example_input.shape[1:])
    plans: dict[str, Candidate] = {}
    with busy(row.busy):
        start = time.perf_counter()
        outcome: LatencyOutcome | None = None
        try:
            chosen = plan_for_latency(inputs.model, inputs.example_input, record, runtime, reduction=row.target,
                                      batch=row.batch, progress=False, table=row.table,
                                      tolerance=args.tolerance, round_to=args.round_to)  # fmt: skip
            plan: Plan | None = chosen
            outcome = chosen.latency
        except LatencyGoalNotReached as error:  # carries the attempts and the largest plan's measurement
            plan, row.message, outcome = None, str(error), error.outcome
        except UserError as error:
            plan, row.message = None, str(error)
        row.plan_seconds = time.perf_counter() - start
        if outcome is not None:
            row.table_seconds, row.table_cached = outcome.table_seconds, outcome.table_seconds < 0.5
            row.attempts = [attempt.as_dict() for attempt in outcome.attempts]
            if outcome.attempts:
                first = outcome.attempts[0]
                row.first_error = _relative_error(first.predicted_reduction, first.measured.reduction)
        if plan is not None:
            assert plan.latency is not None
            row.verdict = plan.latency.verdict
            row.predicted_reduction = plan.latency.predicted_reduction
            row.measured = plan.latency.last.measured.as_dict()
            plans["latency"] = planned(inputs, plan)
            if not args.no_macs:
                with runtime.prepare(pruned_model(inputs, plan), shape) as reference:
                    try:
                        macs_plan = macs_plan_of_equal_latency(inputs, record, runtime, row.batch, reference,
                                                               macs_reduction(plan), args.macs_tolerance,
                                                               row.macs_search)  # fmt: skip
                        plans["macs"], row.macs_target = planned(inputs, macs_plan), macs_plan.target
                    except UserError as error:
                        row.message = f"MACs plan: {error}"
        elif NOT_REACHABLE in row.message and outcome is not None and outcome.largest is not None:
            row.verdict = "not reachable"
            row.measured = outcome.largest.as_dict()
            plans["largest"] = largest_plan(inputs, record, outcome.largest_picks)
        elif outcome is not None and outcome.largest is not None and not outcome.largest.steady(args.tolerance):
            row.verdict, row.measured = "noisy", outcome.largest.as_dict()  # too noisy to judge the largest plan
        else:
            row.verdict = "error"
    print(f"  {row.verdict} after {row.plan_seconds:.1f} s of planning" + (f": {row.message}" if row.message else ""),
          flush=True)  # fmt: skip
    for name, candidate in plans.items():  # quiet: the busy processes have ended
        row.checks[name] = independent_check(inputs, candidate, row.runtime, row.batch, args)
        check = row.checks[name]
        said = check.error or f"median {check.median:.1%}, interval {check.independent['interval']}"  # type: ignore
        print(f"  independent check of the {name} plan: {said}", flush=True)


def machine() -> dict[str, Any]:
    """Date, CPU model, cores, git commit and versions, for the table's heading."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    import onnxruntime

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"), "cpu": model,
            "cores": __import__("os").cpu_count(), "platform": platform.platform(),
            "commit": commit + ("+dirty" if dirty else ""), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}  # fmt: skip


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _interval(measured: dict[str, Any] | None) -> str:
    if not measured:
        return ""
    low, high = measured["interval"]
    return f"{low:.1%} to {high:.1%}, drift {measured['drift']:.1%}"


def _check(check: Check | None) -> str:
    if check is None:
        return ""
    if check.independent is None:
        return f"failed: {check.error}"
    low, high = check.independent["interval"]
    return f"{check.median:.1%} ({low:.1%} to {high:.1%}, drift {check.independent['dense_drift']:.1%})"


HEADER = (
    "| model, runtime:batch, table | target | busy | verdict | table s / analysis s (ratio) | predicted / measured "
    "(error; 1st) | planner interval, drift | independent: median (interval, drift) | MACs cut: latency / MACs plan "
    "| independent: MACs plan | confirms |\n" + "| --- " * 11 + "|"
)


def line(row: Row) -> str:
    """The row as a Markdown table line."""
    marks = {True: "yes", False: "**NO**", None: "n/a"}
    if row.table_seconds is None:
        seconds = ""
    elif row.table_cached:
        seconds = "(cached)"
    else:
        ratio = row.table_seconds / row.analysis_seconds
        seconds = f"{row.table_seconds:.1f} / {row.analysis_seconds:.1f} ({ratio:.2f})"
    if row.verdict == "not reachable":
        reductions = f"largest plan: {_pct(row.measured['reduction'] if row.measured else None)}"
    elif row.predicted_reduction is not None and row.measured is not None:
        reductions = (f"{_pct(row.predicted_reduction)} / {_pct(row.measured['reduction'])} "
                      f"({_pct(row.prediction_error)}; {_pct(row.first_error)})")  # fmt: skip
    else:
        reductions = ""
    main = row.checks.get("latency") or row.checks.get("largest")
    latency, macs = row.checks.get("latency"), row.checks.get("macs")
    cuts = (
        ""
        if latency is None
        else f"{_pct(latency.macs_reduction)} / "
        + (_pct(macs.macs_reduction) if macs is not None else "none as fast" if row.macs_search else "not searched")
    )
    verdict = row.verdict + ("" if row.verdict != "error" else f": {row.message[:120]}")
    return (
        f"| {row.model}, {row.runtime}:{row.batch}, {row.table} | {row.target:.0%} | {row.busy} | {verdict} "
        f"| {seconds} | {reductions} | {_interval(row.measured)} | {_check(main)} | {cuts} | {_check(macs)} "
        f"| {marks[row.confirmed]} |"
    )


def parse_settings(values: list[str]) -> list[tuple[str, int]]:
    """``runtime:batch`` strings, checked."""
    parsed = []
    for value in values:
        name, _, batch = value.partition(":")
        if name not in ("torch", "onnxruntime") or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"--settings takes runtime:batch with runtime torch or onnxruntime, got '{value}'")
        parsed.append((name, int(batch)))
    return parsed


def main(argv: list[str] | None = None) -> int:
    """Run every model, setting, table kind and target; print one Markdown table and write JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(TORCHVISION_MODELS),
                        choices=[*DEMO_MODELS, *TORCHVISION_MODELS])  # fmt: skip
    parser.add_argument("--settings", nargs="+", default=["onnxruntime:1", "onnxruntime:32", "torch:1"],
                        help="runtime:batch to plan and measure on (runtime torch or onnxruntime, CPU)")  # fmt: skip
    parser.add_argument("--targets", type=float, nargs="+", default=[0.2, 0.3], help="latency reductions asked")
    parser.add_argument("--table", nargs="+", choices=TABLE_KINDS, default=["model"], help="latency table kinds")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                        help="pruned ratios of every analysis")  # fmt: skip
    parser.add_argument("--images", type=int, default=128, help="analysis images of the torchvision models")
    parser.add_argument("--size", type=int, default=224, help="input size of the torchvision models (px)")
    parser.add_argument("--threads", type=int, default=0, help="runtime threads (planner and check); 0: default")
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                        help="the ONNX exporter tried first, for the planner's files and the checked ones")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=0.05, help="the planner's latency_tolerance (drift)")
    parser.add_argument("--round-to", type=int, default=8, help="the planner's latency_round_to (1: any count)")
    parser.add_argument("--no-macs", action="store_true", help="skip the MACs plan of equal latency")
    parser.add_argument("--macs-tolerance", type=float, default=0.02,
                        help="the MACs plan search stops when its bracket of MACs targets is this narrow")  # fmt: skip
    parser.add_argument("--independent-rounds", type=int, default=7, help="pruned timings of an independent check")
    parser.add_argument("--independent-seconds", type=float, default=1.0, help="seconds per independent timing")
    parser.add_argument("--busy", type=int, default=0, help="CPU-burning processes during planning")
    parser.add_argument(
        "--reuse-analysis",
        action="store_true",
        help="reuse the last analysis of the same ratios, images and size (and its seconds)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "_data" / "latency")
    parser.add_argument("--jsonl", type=Path, default=None, help="JSON lines file (default: OUT/results.jsonl)")
    args = parser.parse_args(argv)
    settings = parse_settings(args.settings)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.jsonl or args.out / "results.jsonl"
    torch.manual_seed(0)
    about = machine()
    run = {"run": about, "argv": sys.argv[1:] if argv is None else argv}
    with jsonl.open("a") as stream:
        stream.write(json.dumps(run) + "\n")
    rows: list[Row] = []
    for name in args.models:
        inputs, record, seconds, images, analysis_file = analyse(name, args)
        for runtime, batch in settings:
            for table in args.table:
                delete_tables(analysis_file)
                for target in args.targets:
                    row = Row(name, runtime, batch, table, target, args.busy, seconds, images)
                    print(f"{name} {runtime}:{batch} table={table} target={target:.0%} busy={args.busy}", flush=True)
                    bench_row(row, inputs, record, args)
                    rows.append(row)
                    print(line(row), flush=True)
                    with jsonl.open("a") as stream:
                        stream.write(json.dumps({"date": about["date"], "commit": about["commit"],
                                                 **row.as_dict()}) + "\n")  # fmt: skip
    print(f"\n{about['date']}, {about['cpu']}, {about['cores']} cores, commit {about['commit']}, torch "
          f"{about['torch']}, ONNX Runtime {about['onnxruntime']}; analysis images: "
          + ", ".join(f"{row.model} {row.analysis_images}" for row in {r.model: r for r in rows}.values())
          + f"; ratios {args.ratios}; threads {args.threads or 'default'}; independent check: "
          f"{args.independent_rounds} rounds of {args.independent_seconds:g} s timings in a fresh process; "
          f"busy processes during planning: {args.busy}; latency_round_to {args.round_to}.\n")  # fmt: skip
    print(HEADER)
    for row in rows:
        print(line(row))
    false_met = [row for row in rows if row.false_met]
    print(f"\nPlans called met that the quiet independent measurement does not confirm: {len(false_met)}"
          + (" (" + "; ".join(f"{r.model} {r.runtime}:{r.batch} {r.target:.0%}" for r in false_met) + ")"
             if false_met else ""))  # fmt: skip
    print(f"JSON lines: {jsonl}")
    return 1 if false_met and args.busy else 0


if __name__ == "__main__":
    raise SystemExit(main())

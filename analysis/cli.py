"""Command line: ``run.py --config_path CFG [flags] [Section.key=value ...]``, plus the subcommands
``run.py report ANALYSIS_FILE`` (CSV, plots and HTML from an existing analysis file, nothing evaluated) and
``run.py deps --config_path CFG`` (the model's channel dependency sets).

Exit codes: 0 success, 1 internal error (with traceback), 2 bad input (one sentence, no traceback),
130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from analysis import __version__
from analysis.config import Config, describe, load_config
from analysis.data import apply_data_cache, build_eval_loader
from analysis.device import resolve_device
from analysis.engine import EngineSettings, format_metrics
from analysis.errors import AnalysisFileError, ConfigError, UserError
from analysis.evaluate import evaluate
from analysis.groups import dependency_csv, dependency_sets, not_safe_to_prune
from analysis.models import build_model, count_outputs
from analysis.ratios import explain_target_loss
from analysis.results import CSV_STYLES, atomic_write_text, csv_path, export_csv, sidecar_path
from analysis.sensitivity import AnalysisOutcome, run_analysis
from analysis.summary import format_table

logger = logging.getLogger("analysis")

EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 2, 130
EXAMPLE_BATCH = 32  # images used to trace the model and to check masking against physical pruning


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the main job."""
    parser = argparse.ArgumentParser(
        prog="run.py",
        description="Filter-pruning sensitivity analysis of a PyTorch CNN, configured by an ACT-style YAML file.",
        epilog="Overrides use dotted keys, e.g. Global.batch_size=64 SensitivityAnalysis.metric=top5. "
        "Precedence: flags > overrides > YAML > defaults.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config (Global + SensitivityAnalysis blocks)")
    parser.add_argument("--analysis_file", help="analysis pickle to write/resume (SensitivityAnalysis.analysis_file)")
    parser.add_argument(
        "--pruned_ratios", nargs="+", metavar="R", help="ratios to evaluate, e.g. 0.1 0.2 0.3 (or 0.1,0.2,0.3)"
    )
    parser.add_argument("--target_loss", type=float, help="derive per-layer ratios keeping each loss under this")
    parser.add_argument("--overwrite", action="store_true", help="replace the analysis file instead of resuming it")
    parser.add_argument("--no_report", action="store_true", help="skip the CSV, plots and HTML report")
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and the results")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("overrides", nargs="*", metavar="Section.key=value", help="dotted config overrides")
    return parser


def build_report_parser() -> argparse.ArgumentParser:
    """The parser of ``run.py report``."""
    parser = argparse.ArgumentParser(
        prog="run.py report",
        description="Write the CSV exports, plots and HTML report of an existing analysis file (and its .json "
        "sidecar) without evaluating anything.",
    )
    parser.add_argument("analysis_file", help="analysis pickle, e.g. outputs/demo/digits_resnet/sensitivity.pkl")
    parser.add_argument("--target_loss", type=float, help="mark the ratios derived for this loss")
    parser.add_argument("--ratio", type=float, help="ratio of the savings plot (default: the largest analysed)")
    parser.add_argument("--out_dir", help="where to write (default: next to the analysis file)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def build_deps_parser() -> argparse.ArgumentParser:
    """The parser of ``run.py deps``."""
    parser = argparse.ArgumentParser(
        prog="run.py deps",
        description="Print the model's channel dependency sets (convs whose filters must be removed together) and "
        "the convs that cannot be pruned, and write the sets as CSV in NNI's format.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config; only its model keys are used")
    parser.add_argument("--output", help="CSV to write (default: dependencies.csv next to the analysis file)")
    parser.add_argument("overrides", nargs="*", metavar="Section.key=value", help="dotted config overrides")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; dotted overrides may also follow ``--pruned_ratios`` values."""
    args = build_parser().parse_args(list(argv))
    if args.pruned_ratios:
        tokens = [t for item in args.pruned_ratios for t in item.split(",") if t]
        args.overrides += [t for t in tokens if "=" in t]
        args.pruned_ratios = [_parse_ratio(t) for t in tokens if "=" not in t]
    return args


def _parse_ratio(token: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise ConfigError(f"--pruned_ratios: '{token}' is not a number; pass ratios like 0.1 0.2 0.3.") from None


def setup_logging(quiet: bool = False, verbose: bool = False) -> None:
    """Log to stderr: plain messages, warnings and errors prefixed with their level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PlainFormatter())
    root = logging.getLogger("analysis")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    root.propagate = False


class _PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


def run_job(config: Config, overwrite: bool = False, progress: bool | None = None) -> AnalysisOutcome:
    """The main job: build model and data from ``config``, run the sensitivity analysis, derive ratios."""
    g, s = config.Global, config.SensitivityAnalysis
    device = resolve_device(g.device)
    torch.manual_seed(g.seed)
    loader = build_eval_loader(g, device)
    logger.info("data: %s, %d images", loader.layout, loader.num_samples)
    model = build_model(g).to(device)
    loader.check_labels(count_outputs(model, g.img_size, device))
    apply_data_cache(loader, g.data_cache, g.cache_max_gb, progress)
    example_input = next(iter(loader))[0][:EXAMPLE_BATCH]

    def evaluate_model(candidate: torch.nn.Module) -> dict[str, float]:
        return evaluate(candidate, loader, progress=progress, desc="eval").metrics()

    settings = EngineSettings(
        ratios=s.pruned_ratios,
        criterion=s.criterion,
        group_reduction=s.group_reduction,
        metric=s.metric,
        metric_mode=s.metric_mode,
        progress=progress,
        engine=s.engine,
        precision=s.precision,
        seed=g.seed,
    )
    assert s.analysis_file is not None
    return run_analysis(
        model,
        evaluate_model,
        example_input,
        s.analysis_file,
        settings,
        prune_params=s.prune_params_name,
        skip_params=s.skip_params,
        target_loss=s.target_loss,
        data_fingerprint=loader.fingerprint(),
        config=dataclasses.asdict(config),
        overwrite=overwrite,
        batches=loader,
    )


def print_outcome(outcome: AnalysisOutcome, config: Config) -> None:
    """Print the result table and where the files went."""
    s = config.SensitivityAnalysis
    baseline = outcome.report.baseline
    print(f"baseline: {format_metrics(baseline)} ({baseline.get('images', '?')} images)")
    print(format_table(outcome, s.pruned_ratios, s.metric))
    print(f"analysis file: {outcome.analysis_file} (+ {sidecar_path(outcome.analysis_file).name})")
    if outcome.ratios_file is not None and s.target_loss is not None:
        print(explain_target_loss(s.target_loss))
        print(f"ratios as an ACT ChannelPrune block: {outcome.ratios_file}")


def write_reports(
    analysis_file: str | Path,
    target_loss: float | None = None,
    ratio: float | None = None,
    out_dir: str | Path | None = None,
) -> list[Path]:
    """Write both CSV exports, the plots and the HTML report of ``analysis_file``; returns the paths written."""
    from analysis.report import write_report  # matplotlib is imported only when reports are written

    directory = Path(out_dir) if out_dir is not None else Path(analysis_file).parent
    written = [export_csv(analysis_file, csv_path(directory / Path(analysis_file).name, style), style)
               for style in CSV_STYLES]  # fmt: skip
    files = write_report(analysis_file, out_dir=directory, target_loss=target_loss, ratio=ratio)
    return [*written, files.curves, files.heatmap, files.savings, files.html]


def report_main(argv: Sequence[str]) -> int:
    """``run.py report``: regenerate the CSV, plots and HTML of an existing analysis file."""
    args = build_report_parser().parse_args(list(argv))
    setup_logging(args.quiet)
    if not Path(args.analysis_file).is_file():
        raise AnalysisFileError(f"Analysis file {args.analysis_file} does not exist; pass the .pkl a run wrote.")
    for path in write_reports(args.analysis_file, args.target_loss, args.ratio, args.out_dir):
        if not args.quiet:
            print(path)
    return EXIT_OK


def deps_main(argv: Sequence[str]) -> int:
    """``run.py deps``: print and export the channel dependency sets and the convs that cannot be pruned."""
    args = build_deps_parser().parse_args(list(argv))
    setup_logging()
    config = load_config(args.config_path, args.overrides)
    g = config.Global
    model = build_model(g)
    example_input = torch.zeros(1, 3, g.img_size, g.img_size)
    sets = dependency_sets(model, example_input)
    unsafe = not_safe_to_prune(model, example_input)
    assert config.SensitivityAnalysis.analysis_file is not None
    output = Path(args.output or Path(config.SensitivityAnalysis.analysis_file).with_name("dependencies.csv"))
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, dependency_csv(sets))
    for number, members in enumerate(sets, start=1):
        print(f"Set {number}: {', '.join(members)}")
    for name, reason in unsafe.items():
        print(f"not prunable: {name}: {reason}")
    print(f"{len(sets)} dependency set(s) over {sum(map(len, sets))} conv(s); CSV: {output}")
    return EXIT_OK


SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"report": report_main, "deps": deps_main}


def job_main(argv: Sequence[str]) -> int:
    """The main job: analysis, ratios, then (unless turned off) CSV, plots and HTML next to the analysis file."""
    args = parse_args(argv)
    setup_logging(args.quiet, args.verbose)
    flags = {
        "SensitivityAnalysis.analysis_file": args.analysis_file,
        "SensitivityAnalysis.pruned_ratios": args.pruned_ratios,
        "SensitivityAnalysis.target_loss": args.target_loss,
    }
    config = load_config(args.config_path, args.overrides, flags)
    logger.info(describe(config))
    outcome = run_job(config, overwrite=args.overwrite, progress=False if args.quiet else None)
    print_outcome(outcome, config)
    if config.SensitivityAnalysis.report and not args.no_report and outcome.sensitivities:
        written = write_reports(outcome.analysis_file, config.SensitivityAnalysis.target_loss)
        print(f"report: {written[-1]} (+ CSV and plots beside it)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = SUBCOMMANDS.get(argv[0]) if argv else None
    try:
        return command(argv[1:]) if command else job_main(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED

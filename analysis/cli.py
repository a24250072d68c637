"""Command line: ``run.py --config_path CFG [flags] [Section.key=value ...]``.

Exit codes: 0 success, 1 internal error (with traceback), 2 bad input (one sentence, no traceback),
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from analysis import __version__
from analysis.config import Config, describe, load_config
from analysis.data import build_eval_loader
from analysis.device import resolve_device
from analysis.errors import ConfigError, UserError
from analysis.evaluate import EvalResult, evaluate
from analysis.models import build_model, count_outputs

logger = logging.getLogger("analysis")

EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 2, 130


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
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and the results")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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


def run_baseline(config: Config, progress: bool | None = None) -> EvalResult:
    """Build model and data from ``config`` and evaluate the unpruned model."""
    g = config.Global
    device = resolve_device(g.device)
    torch.manual_seed(g.seed)
    loader = build_eval_loader(g, device)
    logger.info("data: %s, %d images", loader.layout, loader.num_samples)
    model = build_model(g).to(device)
    loader.check_labels(count_outputs(model, g.img_size, device))
    return evaluate(model, loader, progress=progress, desc="baseline")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        setup_logging(args.quiet, args.verbose)
        flags = {
            "SensitivityAnalysis.analysis_file": args.analysis_file,
            "SensitivityAnalysis.pruned_ratios": args.pruned_ratios,
            "SensitivityAnalysis.target_loss": args.target_loss,
        }
        config = load_config(args.config_path, args.overrides, flags)
        logger.info(describe(config))
        result = run_baseline(config, progress=False if args.quiet else None)
        print(f"baseline: {result.summary()}")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK

"""The main job: ``run.py --config_path CFG [flags] [Section.key=value ...]`` analyses, derives ratios, then writes
the CSV, plots and HTML report (and, under torchrun, splits the work across the ranks)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from analysis import __version__
from analysis.cli._exit import EXIT_OK
from analysis.cli._logs import setup_logging
from analysis.cli._parser import CommandParser
from analysis.config import Config, check_latency_settings_used, derive, describe, load_config
from analysis.engine.loss import format_metrics
from analysis.engine.run import AnalysisOutcome
from analysis.errors import ConfigError
from analysis.inputs.build import build_inputs, needs_calibration
from analysis.inputs.device import resolve_device
from analysis.io.lock import check_unlocked
from analysis.io.outputs import check_config_outputs
from analysis.io.results import sidecar_path
from analysis.reporting.plan_text import format_plan
from analysis.reporting.summary import format_table
from analysis.scale.distributed import (
    Rank,
    fold_local_shards,
    from_environment,
    process_group,
    rank_device,
    run_ranks,
)
from analysis.scale.shards import ShardSpec
from analysis.text import explain_target_loss
from analysis.workflow.analyse import derive_ratios
from analysis.workflow.job import run_job
from analysis.workflow.latency import check_runtime
from analysis.workflow.plan import run_plan_step, wants_plan_step
from analysis.workflow.report import write_report_files

logger = logging.getLogger("analysis")


def build_parser() -> CommandParser:
    """The argument parser of the main job."""
    parser = CommandParser(
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
    parser.add_argument("--shard", metavar="I/N", help="analyse only the I-th of N deterministic shares of the convs "
                        "into <analysis_file stem>.shardIofN.pkl (merge them with run.py merge)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and the results")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_trust()
    parser.add_overrides()
    return parser


def _split_ratios(args: argparse.Namespace) -> None:
    """Split ``--pruned_ratios`` values (``0.1 0.2,0.3``) into numbers; dotted overrides among them join the others."""
    if args.pruned_ratios:
        tokens = [t for item in args.pruned_ratios for t in item.split(",") if t]
        args.overrides += [t for t in tokens if "=" in t]
        args.pruned_ratios = [_parse_ratio(t) for t in tokens if "=" not in t]


def _parse_ratio(token: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise ConfigError(f"--pruned_ratios: '{token}' is not a number; pass ratios like 0.1 0.2 0.3.") from None


def print_outcome(outcome: AnalysisOutcome, config: Config) -> None:
    """Print the result table and where the files went."""
    s = config.SensitivityAnalysis
    baseline = outcome.report.baseline
    print(f"baseline: {format_metrics(baseline)} ({baseline.get('images', '?')} images)")
    print(format_table(outcome, s.pruned_ratios, s.metric, s.metric_mode))
    print(f"analysis file: {outcome.analysis_file} (+ {sidecar_path(outcome.analysis_file).name})")
    if outcome.ratios_file is not None and s.target_loss is not None:
        print(explain_target_loss(s.target_loss))
        block = "an ElementPrune block" if s.granularity == "element" else "an ACT ChannelPrune block"
        print(f"ratios as {block}: {outcome.ratios_file}")


def job_main(args: argparse.Namespace) -> int:
    """The main job: analysis, ratios, then (unless turned off) CSV, plots and HTML next to the analysis file."""
    _split_ratios(args)
    setup_logging(args.quiet, args.verbose)
    flags = {
        "SensitivityAnalysis.analysis_file": args.analysis_file,
        "SensitivityAnalysis.pruned_ratios": args.pruned_ratios,
        "SensitivityAnalysis.target_loss": args.target_loss,
    }
    shard = ShardSpec.parse(args.shard) if args.shard else None
    config = load_config(args.config_path, args.overrides, flags, trust_config=args.trust_config)
    check_latency_settings_used(config)
    check_runtime(config)
    check_config_outputs(config)  # before anything loads or is written
    rank = from_environment()
    if rank is not None:
        if shard is not None:
            raise ConfigError("--shard splits work by hand; under torchrun the ranks split it: drop --shard.")
        return torchrun_job(config, args, rank)
    logger.info(describe(config))
    analysis_file = config.SensitivityAnalysis.analysis_file
    assert analysis_file is not None
    check_unlocked(shard.path(analysis_file) if shard else analysis_file)  # before the model and data are loaded
    if shard is None:
        fold_local_shards(analysis_file, discard=args.overwrite)
    progress = False if args.quiet else None
    inputs = build_inputs(config, progress, calibration=needs_calibration(config))
    outcome = run_job(config, overwrite=args.overwrite, progress=progress, shard=shard, inputs=inputs)
    print_outcome(outcome, config)
    if shard is not None:
        assert config.SensitivityAnalysis.analysis_file is not None
        main_file = config.SensitivityAnalysis.analysis_file
        others = " ".join(str(ShardSpec(i, shard.count).path(main_file)) for i in range(1, shard.count + 1))
        print(f"shard {shard.index}/{shard.count}: {len(outcome.analysed)} conv(s) in {outcome.analysis_file}; once "
              f"every shard is done: python run.py merge {main_file} {others}")  # fmt: skip
        return EXIT_OK
    if wants_plan_step(config):
        print(format_plan(run_plan_step(config, inputs, progress)))
    finish(outcome, config, args)
    return EXIT_OK


def finish(outcome: AnalysisOutcome, config: Config, args: argparse.Namespace) -> None:
    """Write the CSV, plots and HTML report of a finished job (unless turned off)."""
    if config.SensitivityAnalysis.report and not args.no_report and outcome.sensitivities:
        written = write_report_files(outcome.analysis_file, config.SensitivityAnalysis.target_loss)
        print(f"report: {written[-1]} (+ CSV and plots beside it)")


def torchrun_job(config: Config, args: argparse.Namespace, rank: Rank) -> int:
    """The main job as one rank of a torchrun job (see :mod:`analysis.scale.distributed`); rank 0 prints and reports."""
    # this rank's device, derived (the inputs and the sidecar take it from Global.device)
    config = derive(config, {"Global.device": rank_device(config.Global.device, rank)}, command_line=False)
    g, s = config.Global, config.SensitivityAnalysis
    assert s.analysis_file is not None
    if not rank.leader and not args.verbose:
        setup_logging(quiet=True)
    if rank.leader:
        logger.info("%s\ntorchrun: %d ranks, this is rank 0 on %s", describe(config), rank.world_size, g.device)
    baseline: list[AnalysisOutcome] = []
    inputs = build_inputs(config, progress=False, calibration=needs_calibration(config))

    def analyse(analysis_file: Path, shard: ShardSpec | None, baseline_only: bool, progress: bool) -> int:
        outcome = run_job(config, progress=progress, shard=shard, analysis_file=analysis_file,
                          baseline_only=baseline_only, inputs=inputs)  # fmt: skip
        baseline.extend([outcome] if baseline_only else [])
        return len(outcome.analysed) * len(s.pruned_ratios)

    with process_group(resolve_device(g.device)):
        merged = run_ranks(s.analysis_file, rank, analyse, overwrite=args.overwrite)
    if merged is None:
        return EXIT_OK
    outcome = baseline[0]
    outcome.sensitivities = merged
    if s.target_loss is not None:
        derive_ratios(outcome, s.target_loss, s.criterion, s.granularity)
    print_outcome(outcome, config)
    if wants_plan_step(config):
        print(format_plan(run_plan_step(config, inputs, progress=False)))
    finish(outcome, config, args)
    return EXIT_OK

"""``run.py compress`` (registered in :mod:`analysis.cli.registry`): its parser, and the function that runs it on
the parsed arguments, under torchrun too; the work is :mod:`analysis.workflow.compress`."""

from __future__ import annotations

import argparse
import logging

from analysis.cli._exit import EXIT_OK
from analysis.cli._logs import setup_logging
from analysis.cli._parser import CommandParser
from analysis.config import Config, derive, load_config
from analysis.inputs.build import build_inputs
from analysis.inputs.device import resolve_device
from analysis.io.outputs import check_config_outputs, check_output_folder
from analysis.io.ratios_yaml import load_ratios_yaml
from analysis.scale.distributed import from_environment, process_group, rank_device
from analysis.workflow.compress import CompressResult, recovery_folder, run_compress
from analysis.workflow.recipe import read_recipe
from analysis.workflow.report import write_report_files

logger = logging.getLogger(__name__)


def build_compress_parser() -> CommandParser:
    """The parser of ``run.py compress``."""
    parser = CommandParser(
        prog="run.py compress",
        description="Analyse (or resume), plan, prune, recover and export: the pruned model is distilled from the "
        "dense one as the config's ACT TrainConfig and Distillation blocks say, resuming from its last checkpoint.",
        epilog="The plan is --ratios, else the config's budget, else ChannelPrune.pruned_ratio (when the config sets "
        "no target_loss), else the target_loss ratios. Under torchrun every process trains on its share of each "
        "batch.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config (Global, TrainConfig, Distillation...)")
    parser.add_argument("--ratios", help="YAML with a ChannelPrune block to apply (e.g. a *.plan.yaml)")
    parser.add_argument("--fresh", action="store_true", help="remove the checkpoints of an earlier recovery first")
    parser.add_argument("--no_report", action="store_true", help="do not rewrite the report")
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and the results")
    parser.add_trust()
    parser.add_overrides()
    return parser


def compress_main(args: argparse.Namespace) -> int:
    """``run.py compress``: the whole pipeline; prints the dense, one-shot and recovered metrics."""
    setup_logging(args.quiet)
    config = load_config(args.config_path, args.overrides, trust_config=args.trust_config)
    read_recipe(config, announce=False)  # the training blocks are checked before the model and the data load
    if args.ratios is not None:
        load_ratios_yaml(args.ratios)
    check_config_outputs(config, "SensitivityAnalysis.export_dir")
    check_output_folder(recovery_folder(config), "Recovery.output_dir")  # before hours of analysis, not after
    rank = from_environment()
    if rank is None:
        progress = False if args.quiet else None
        inputs = build_inputs(config, progress, calibration=True)
        print(format_result(run_compress(config, progress, args.ratios, args.fresh, inputs)))
        _report(config, args)
        return EXIT_OK
    config = derive(config, {"Global.device": rank_device(config.Global.device, rank)}, command_line=False)
    if not rank.leader:
        setup_logging(quiet=True)
    with process_group(resolve_device(config.Global.device)):
        result = _ranked(config, args, rank.leader)
    if rank.leader:
        print(format_result(result))
        _report(config, args)
    return EXIT_OK


def _report(config: Config, args: argparse.Namespace) -> None:
    """Rewrite the report, which shows the recovered plan (unless turned off)."""
    s = config.SensitivityAnalysis
    if s.report and not args.no_report and s.analysis_file is not None:
        written = write_report_files(s.analysis_file, s.target_loss)
        print(f"report: {written[-1]}")


def _ranked(config: Config, args: argparse.Namespace, leader: bool) -> CompressResult:
    inputs = build_inputs(config, progress=False, calibration=True)
    return run_compress(config, None if leader and not args.quiet else False, args.ratios, args.fresh, inputs)


def format_result(result: CompressResult) -> str:
    """The terminal summary: top1 at each stage, the recovery and where the files went."""
    reestimated = "-" if result.reestimated is None else f"{result.reestimated['top1']:.4f}"
    outcome = result.recovery
    lines = [
        f"top1: dense {result.dense['top1']:.4f}, pruned at once {result.one_shot['top1']:.4f}, BatchNorm "
        f"re-estimated {reestimated}, recovered {result.recovered['top1']:.4f}",
        f"recovery: {outcome.steps}/{outcome.total_steps} steps ({outcome.stopped}), best at step {outcome.best.step}, "
        f"{outcome.images_per_second:.0f} images/s; checkpoints and train.log in {result.folder}",
    ]
    if result.plan is not None:
        plan = result.plan
        cuts = f"{plan.reduction_of('macs'):.1%} fewer MACs, {plan.reduction_of('params'):.1%} fewer params"
        lines.insert(0, f"plan ({plan.source}): {len(plan.groups)} group(s) pruned, {cuts}")
    for kind, path in result.exported.items():
        lines.append(f"  {kind}: {path}")
    return "\n".join(lines)

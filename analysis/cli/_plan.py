"""``run.py plan`` and ``run.py verify`` (registered in :mod:`analysis.cli.registry`): their parsers, and the
functions that run them on the parsed arguments; the work is :mod:`analysis.workflow.plan`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from analysis.cli._exit import EXIT_OK
from analysis.cli._logs import setup_logging
from analysis.cli._parser import CommandParser
from analysis.config import (
    LATENCY_RUNTIMES,
    LATENCY_TABLES,
    PLAN_METHODS,
    Config,
    check_latency_settings_used,
    config_from_data,
    derive,
    load_config,
)
from analysis.errors import ConfigError
from analysis.inputs.build import Inputs, build_inputs, needs_calibration
from analysis.io.outputs import check_config_outputs, check_output_folder
from analysis.io.ratios_yaml import load_ratios_yaml
from analysis.io.record import AnalysisRecord, load_record
from analysis.io.results import sidecar_path
from analysis.io.sidecar import ConfigRecord
from analysis.reporting.plan_text import format_plan
from analysis.workflow.job import run_job
from analysis.workflow.latency import check_runtime
from analysis.workflow.plan import budgets, run_plan_step
from analysis.workflow.report import write_report_files

logger = logging.getLogger(__name__)


def build_plan_parser() -> CommandParser:
    """The parser of ``run.py plan``."""
    parser = CommandParser(
        prog="run.py plan",
        description="Allocate per-layer ratios reaching a MACs, params or measured latency reduction with the "
        "smallest predicted loss, "
        "from the analysis file the config names (the analysis runs first if that file is missing); optionally "
        "verify the jointly pruned model and export it.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config (Global + SensitivityAnalysis blocks)")
    parser.add_argument("--target_macs_reduction", type=float, help="e.g. 0.4 for 40%% fewer MACs (budgets given "
                        "together are all met; given here, they replace the config's)")  # fmt: skip
    parser.add_argument("--target_params_reduction", type=float, help="e.g. 0.4 for 40%% fewer params")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target_latency_reduction", type=float, help="e.g. 0.3 for 30%% lower measured latency")
    target.add_argument("--target_latency_ms", type=float, help="measured latency to reach, in ms")
    parser.add_argument("--runtime", choices=LATENCY_RUNTIMES, help="where latency is measured (default auto: "
                        "onnxruntime with the onnx extra, else torch)")  # fmt: skip
    parser.add_argument("--runtime_command", help="with --runtime command: a command given {onnx} (and {batch}, "
                        "{shape}) that prints the latency in ms")  # fmt: skip
    parser.add_argument("--latency_table", choices=LATENCY_TABLES, help="how the latency table is measured: "
                        "model (the whole model once per probe), layers (each changed conv/linear shape alone), "
                        "or auto (default: layers at --latency_batch 32 or more on a CPU, else model)")  # fmt: skip
    parser.add_argument("--latency_batch", type=int, help="images per call when measuring latency (default 1)")
    parser.add_argument("--latency_round_to", type=int, help="a latency plan keeps a multiple of this many channels "
                        "per pruned group (default 8; 1: any analysed count)")  # fmt: skip
    parser.add_argument("--method", choices=PLAN_METHODS, help="knapsack (from the sensitivity curves, default), "
                        "measured (improved with joint evaluations, BatchNorm re-estimated) or recovered (the measured "
                        "search's finalists each recovered for Recovery.probe_steps steps, the best kept)")  # fmt: skip
    parser.add_argument(
        "--eval_budget",
        type=int,
        help="joint evaluations of the measured method's search (default: 10 per group of coupled convs)",
    )
    _add_common(parser)
    return parser


def build_verify_parser() -> CommandParser:
    """The parser of ``run.py verify``."""
    parser = CommandParser(
        prog="run.py verify",
        description="Prune a ratios YAML (ChannelPrune block) into the model all at once, evaluate it on the "
        "analysis data, and measure MACs, params, checkpoint size and latency next to the prediction.",
    )
    parser.add_argument("analysis_file", help="the analysis pickle the ratios were derived from")
    parser.add_argument("--ratios", required=True, help="YAML with a ChannelPrune block (e.g. *.plan.yaml)")
    parser.add_argument("--config_path", help="YAML config (default: the one stored in the analysis file's sidecar)")
    _add_common(parser, verify_flag=False)
    return parser


def _add_common(parser: CommandParser, verify_flag: bool = True) -> None:
    if verify_flag:
        parser.add_argument("--verify", action="store_true", help="prune all groups at once and measure the model")
    parser.add_argument("--export_dir", help="write pruned_model.pt, pruned_state_dict.pt, pruned_channels.json")
    parser.add_argument("--no_report", action="store_true", help="do not rewrite the report")
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and results")
    parser.add_trust()
    parser.add_overrides()


BUDGET_KEYS = ("target_macs_reduction", "target_params_reduction", "target_latency_reduction", "target_latency_ms")


def plan_main(args: argparse.Namespace) -> int:
    """``run.py plan``: budget plan from the config's analysis file (analysing first if it is missing)."""
    setup_logging(args.quiet)
    flags = {
        "SensitivityAnalysis.target_macs_reduction": args.target_macs_reduction,
        "SensitivityAnalysis.target_params_reduction": args.target_params_reduction,
        "SensitivityAnalysis.target_latency_reduction": args.target_latency_reduction,
        "SensitivityAnalysis.target_latency_ms": args.target_latency_ms,
        "SensitivityAnalysis.latency_runtime": args.runtime,
        "SensitivityAnalysis.runtime_command": args.runtime_command,
        "SensitivityAnalysis.latency_batch": args.latency_batch,
        "SensitivityAnalysis.latency_table": args.latency_table,
        "SensitivityAnalysis.latency_round_to": args.latency_round_to,
        "SensitivityAnalysis.verify": True if args.verify else None,
        "SensitivityAnalysis.export_dir": args.export_dir,
        "SensitivityAnalysis.plan_method": args.method,
        "SensitivityAnalysis.eval_budget": args.eval_budget,
    }
    if args.export_dir is not None:
        check_output_folder(args.export_dir, "--export_dir")
    config = load_config(args.config_path, args.overrides, flags, trust_config=args.trust_config)
    given = [key for key in BUDGET_KEYS if flags[f"SensitivityAnalysis.{key}"] is not None]
    if given:  # budgets on the command line are the plan's: the config's others do not join them
        left_out = [
            key for key in BUDGET_KEYS if key not in given and getattr(config.SensitivityAnalysis, key) is not None
        ]
        for key in left_out:
            logger.info("SensitivityAnalysis.%s of the config is left out: the command line gives the budgets.", key)
        config = derive(config, {f"SensitivityAnalysis.{key}": None for key in left_out})  # the flags' doing
    if not budgets(config):
        raise ConfigError("run.py plan needs a budget: --target_macs_reduction, --target_params_reduction, "
                          "--target_latency_reduction or --target_latency_ms (or the same key in the config's "
                          "SensitivityAnalysis).")  # fmt: skip
    check_latency_settings_used(config)
    check_runtime(config)
    check_config_outputs(config, "--export_dir" if args.export_dir is not None else "SensitivityAnalysis.export_dir")
    progress = False if args.quiet else None
    inputs = build_inputs(config, progress, calibration=needs_calibration(config))
    analysis_file = config.SensitivityAnalysis.analysis_file
    assert analysis_file is not None
    if not Path(analysis_file).is_file():
        logger.info("%s does not exist yet: running the analysis first.", analysis_file)
        run_job(config, progress=progress, inputs=inputs)
    return _finish(config, inputs, args, progress)


def verify_main(args: argparse.Namespace) -> int:
    """``run.py verify``: apply a ratios YAML jointly and measure the pruned model."""
    setup_logging(args.quiet)
    if args.export_dir is not None:
        check_output_folder(args.export_dir, "--export_dir")
    record = load_record(args.analysis_file)  # read once: the config it records, then every step of the plan
    # --ratios gives the ratios, so verifying and exporting need no target in the config (ratios_from)
    flags = {
        "SensitivityAnalysis.analysis_file": args.analysis_file,
        "SensitivityAnalysis.verify": True,
        "SensitivityAnalysis.export_dir": args.export_dir,
    }
    if args.config_path:
        config = load_config(args.config_path, args.overrides, flags, trust_config=args.trust_config,
                             ratios_from=args.ratios)  # fmt: skip
    else:
        stored = record.config or ConfigRecord()
        raw = stored.cli_config(**dict.fromkeys(BUDGET_KEYS))
        if raw is None:
            raise ConfigError(f"{args.analysis_file} does not record the config that wrote it (Python API run); "
                              "pass --config_path.")  # fmt: skip
        recorded = f"the config {sidecar_path(args.analysis_file)} recorded"
        config = config_from_data(raw, stored.source or args.analysis_file, args.overrides, flags,
                                  trust_config=args.trust_config, described_as=recorded,
                                  ratios_from=args.ratios)  # fmt: skip
    check_latency_settings_used(config)
    check_runtime(config)
    check_config_outputs(config, "--export_dir" if args.export_dir is not None else "SensitivityAnalysis.export_dir")
    load_ratios_yaml(args.ratios)  # read before the model and the data load, so a bad file is refused at once
    progress = False if args.quiet else None
    inputs = build_inputs(config, progress, calibration=needs_calibration(config))
    return _finish(config, inputs, args, progress, ratios_file=args.ratios, record=record)


def _finish(config: Config, inputs: Inputs, args: argparse.Namespace, progress: bool | None,
            ratios_file: str | None = None, record: AnalysisRecord | None = None) -> int:  # fmt: skip
    result = run_plan_step(config, inputs, progress, ratios_file, record)
    print(format_plan(result))
    if config.SensitivityAnalysis.report and not args.no_report:
        written = write_report_files(
            config.SensitivityAnalysis.analysis_file or "", config.SensitivityAnalysis.target_loss
        )
        print(f"report: {written[-1]}")
    return EXIT_OK

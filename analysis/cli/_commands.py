"""The subcommands: ``run.py report`` (CSV, plots and HTML of an existing analysis file, nothing evaluated),
``run.py merge`` (merge analysis files of one analysis, e.g. shards) and ``run.py deps`` (channel dependency sets):
their parsers and the functions that run them on the parsed arguments (registered in :mod:`analysis.cli.registry`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from analysis.cli._exit import EXIT_OK
from analysis.cli._logs import setup_logging
from analysis.cli._parser import CommandParser
from analysis.compat.topology import dependency_csv, dependency_sets, not_safe_to_prune
from analysis.config import check_target_loss, load_config
from analysis.inputs.models import build_model
from analysis.io.atomic import atomic_write_text
from analysis.io.lock import exclusive
from analysis.io.outputs import (
    check_output_file,
    check_output_folder,
    check_overwrite,
    check_replaceable_analysis,
    config_inputs,
)
from analysis.io.record import load_record
from analysis.io.results import sidecar_path
from analysis.scale.shards import merge_records
from analysis.workflow.report import write_report_files

logger = logging.getLogger(__name__)


def build_report_parser() -> CommandParser:
    """The parser of ``run.py report``."""
    parser = CommandParser(
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


def build_merge_parser() -> CommandParser:
    """The parser of ``run.py merge``."""
    parser = CommandParser(
        prog="run.py merge",
        description="Merge analysis files (and their .json sidecars) of one analysis, e.g. shards, into OUTPUT: "
        "later inputs win for the same (param, ratio), as PaddleSlim's merge_sensitive; files of another model, "
        "other data or other settings are refused.",
    )
    parser.add_argument("output", help="analysis file to write: a new file, or an analysis file to replace (list it "
                        "among the inputs too to extend it); never a sidecar or another kind of file")  # fmt: skip
    parser.add_argument("inputs", nargs="+", help="analysis files to merge, in order")
    return parser


def build_deps_parser() -> CommandParser:
    """The parser of ``run.py deps``."""
    parser = CommandParser(
        prog="run.py deps",
        description="Print the model's channel dependency sets (convs whose filters must be removed together) and "
        "the convs that cannot be pruned, and write the sets as CSV in NNI's format.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config; only its model keys are used")
    parser.add_argument("--output", help="CSV to write (default: dependencies.csv next to the analysis file)")
    parser.add_trust()
    parser.add_overrides()
    return parser


def report_main(args: argparse.Namespace) -> int:
    """``run.py report``: regenerate the CSV, plots and HTML of an existing analysis file."""
    setup_logging(args.quiet)
    record = load_record(args.analysis_file)
    check_target_loss(args.target_loss, "--target_loss")
    if args.out_dir is not None:
        check_output_folder(args.out_dir, "--out_dir")
    for path in write_report_files(record, args.target_loss, args.ratio, args.out_dir):
        if not args.quiet:
            print(path)
    return EXIT_OK


def merge_main(args: argparse.Namespace) -> int:
    """``run.py merge``: merge analysis files of one analysis into one."""
    setup_logging()
    check_output_file(args.output, "OUTPUT")
    check_overwrite(args.output, "OUTPUT", analysis_file=True)  # never an input's sidecar
    check_replaceable_analysis(args.output, "OUTPUT")
    with exclusive(args.output):  # an input may be the output itself (extended): read under its lock
        merged = merge_records(args.output, [load_record(path) for path in args.inputs])
    variants = sum(len(curve) for curve in merged.values())
    print(f"merged {len(args.inputs)} file(s): {len(merged)} param(s), {variants} (param, ratio) pair(s) -> "
          f"{args.output} (+ {sidecar_path(args.output).name}); run.py report {args.output} draws it")  # fmt: skip
    return EXIT_OK


def deps_main(args: argparse.Namespace) -> int:
    """``run.py deps``: print and export the channel dependency sets and the units that cannot be pruned."""
    setup_logging()
    config = load_config(args.config_path, args.overrides, trust_config=args.trust_config)
    assert config.SensitivityAnalysis.analysis_file is not None
    output = Path(args.output or Path(config.SensitivityAnalysis.analysis_file).with_name("dependencies.csv"))
    check_output_file(output, "--output")
    check_overwrite(output, "--output", config_inputs(config))  # nor the analysis file, nor its sidecar
    g = config.Global
    model = build_model(g)
    example_input = torch.zeros(1, 3, g.img_size, g.img_size)
    sets = dependency_sets(model, example_input)
    unsafe = not_safe_to_prune(model, example_input)
    atomic_write_text(output, dependency_csv(sets))
    for number, members in enumerate(sets, start=1):
        print(f"Set {number}: {', '.join(members)}")
    for name, reason in unsafe.items():
        print(f"not prunable: {name}: {reason}")
    print(f"{len(sets)} dependency set(s) over {sum(map(len, sets))} conv(s); CSV: {output}")
    return EXIT_OK

"""Every command of ``run.py`` in one place: its name, one-line summary, parser, entry function and documentation
page. :func:`analysis.cli.main.main` dispatches through it, ``run.py --help`` lists it, and
:mod:`analysis.cli.reference` renders it into docs/reference/cli.md."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from analysis.cli._commands import (
    build_deps_parser,
    build_merge_parser,
    build_report_parser,
    deps_main,
    merge_main,
    report_main,
)
from analysis.cli._compress import build_compress_parser, compress_main
from analysis.cli._job import build_parser, job_main
from analysis.cli._parser import CommandParser
from analysis.cli._plan import build_plan_parser, build_verify_parser, plan_main, verify_main
from analysis.config import SECTIONS
from analysis.errors import ConfigError, did_you_mean, printable


@dataclass(frozen=True)
class Command:
    """One command: ``run.py`` itself (the main job, ``name == ""``) or ``run.py <name>``."""

    name: str
    summary: str  # one line, shown in ``run.py --help``
    build_parser: Callable[[], CommandParser]  # its arguments, description and notes (parser() adds the rest)
    main: Callable[[argparse.Namespace], int]  # runs the command on its parsed arguments, returns the exit code
    docs_page: str  # the page of the docs site that explains it, e.g. docs/plans.md

    def parser(self) -> CommandParser:
        """The parser its help comes from: :attr:`build_parser`'s, the main job's listing the subcommands, and each
        ending with :func:`docs_line`."""
        parser = self.build_parser()
        notes = [] if self.name else [commands_listing()]
        parser.epilog = "\n\n".join([*notes, *([parser.epilog] if parser.epilog else []), docs_line(self.docs_page)])
        return parser

    def run(self, argv: Sequence[str]) -> int:
        """Parse ``argv`` (the arguments after the command's name) and run the command."""
        return self.main(self.parser().parse(argv))


def docs_line(page: str) -> str:
    """The last line of a command's help: where its documentation is, as a file and as a page of ``mkdocs serve``."""
    return f"Documentation: {page} (mkdocs serve, then {site_path(page)})"


def site_path(page: str) -> str:
    """The address of a docs/ page on the MkDocs site (directory URLs): docs/plans.md -> /plans/."""
    return f"/{PurePosixPath(page).relative_to('docs').with_suffix('')}/"


JOB = Command(
    name="",
    summary="Measure the loss of each prunable conv at each pruning ratio, derive ratios, write the report",
    build_parser=build_parser,
    main=job_main,
    docs_page="docs/getting-started.md",
)

SUBCOMMANDS = (
    Command("plan", "Allocate per-layer ratios meeting a MACs, params or latency budget", build_plan_parser,
            plan_main, "docs/plans.md"),
    Command("verify", "Prune a ratios YAML into the model at once and measure the result", build_verify_parser,
            verify_main, "docs/plans.md"),
    Command("compress", "Plan, prune, fine-tune by distillation (TrainConfig) and export",
            build_compress_parser, compress_main, "docs/recovery.md"),
    Command("report", "Write the CSV, plots and HTML report of an existing analysis file", build_report_parser,
            report_main, "docs/outputs.md"),
    Command("merge", "Merge analysis files of one analysis (e.g. shards) into one", build_merge_parser, merge_main,
            "docs/scale-out.md"),
    Command("deps", "Print and export the model's channel dependency sets", build_deps_parser, deps_main,
            "docs/cli.md"),
)  # fmt: skip

COMMANDS = (JOB, *SUBCOMMANDS)
"""The main job first, then the subcommands in the order ``run.py --help`` lists them."""


def command_for(argv: Sequence[str]) -> tuple[Command, list[str]]:
    """The command ``argv`` names (a subcommand's name first, else the main job) and the arguments that are its own.

    Raises:
        ConfigError: If the first argument is neither a flag, an override (``Section.key=value``, or a dotted key
            the main job reports as a malformed override) nor a command: a mistyped command is named as one.
    """
    for command in SUBCOMMANDS:
        if argv and argv[0] == command.name:
            return command, list(argv[1:])
    if argv and _unknown_command(argv[0]):
        raise ConfigError(unknown_command_message(argv[0]))
    return JOB, list(argv)


def _unknown_command(first: str) -> bool:
    """Whether the first argument meant a command: not a flag, not an override, not a ``Section.key`` missing its
    value (which the main job reports as a malformed override)."""
    return not first.startswith("-") and "=" not in first and first.partition(".")[0] not in SECTIONS


def unknown_command_message(name: str) -> str:
    """The sentence for ``run.py NAME ...`` when NAME is no command: the closest command and every command, or for a
    YAML file how a config is passed (the likeliest mistake besides a typo)."""
    names = ", ".join(command.name for command in SUBCOMMANDS)
    shown = printable(name)
    if name.endswith((".yaml", ".yml")):
        return (f"unknown command '{shown}'; to analyse with that config run python run.py --config_path {shown} "
                f"(the commands are {names}; python run.py --help).")  # fmt: skip
    closest = did_you_mean(name, [command.name for command in SUBCOMMANDS])
    return (f"unknown command '{shown}'{closest}; the commands are {names}, and the analysis runs as python run.py "
            "--config_path CFG.yaml (python run.py --help lists them).")  # fmt: skip


def commands_listing() -> str:
    """The subcommands with their summaries, as ``run.py --help`` shows them."""
    width = max(len(command.name) for command in SUBCOMMANDS)
    lines = [f"  {command.name:<{width}}  {command.summary}" for command in SUBCOMMANDS]
    return "\n".join(["commands (python run.py <command> --help for details):", *lines])

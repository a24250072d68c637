"""The argument parser every command uses: argparse's errors become the one-sentence :class:`ConfigError` of exit
code 2, dotted overrides may stand anywhere among the flags, and a help text keeps the lines of its description and
epilog."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

from analysis.errors import ConfigError
from analysis.trust import TRUST_FLAG

OVERRIDES_METAVAR = "Section.key=value"


class LineHelpFormatter(argparse.HelpFormatter):
    """Wraps each line of a description or epilog on its own, keeping its indent: a list keeps its lines, and a long
    paragraph is still wrapped to the terminal (argparse's own formatter joins lines, its raw one wraps nothing)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            words = line.lstrip()
            lead = indent + line[: len(line) - len(words)]
            lines.append(textwrap.fill(words, width, initial_indent=lead, subsequent_indent=lead) if words else "")
        return "\n".join(lines)


class CommandParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are a :class:`ConfigError` (the usage is printed above it),
    so a bad argument ends like every other bad input: ``error: <one sentence>``, exit code 2."""

    def __init__(self, prog: str, description: str, epilog: str | None = None) -> None:
        super().__init__(prog=prog, description=description, epilog=epilog, formatter_class=LineHelpFormatter)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise ConfigError(f"{self.prog}: {message}; see {self.prog} --help.")

    def add_trust(self) -> None:
        """``--trust_config``: let the config file turn on the settings that run code (see analysis.trust)."""
        self.add_argument(
            TRUST_FLAG, action="store_true", help="let the config file run what it names: runtime_command, "
            "trust_model_file, trust_arch (without it only the command line may; docs/security.md)",
        )  # fmt: skip

    def add_overrides(self) -> None:
        """The optional dotted overrides (``Global.batch_size=64``), allowed before, between and after the flags."""
        self.add_argument("overrides", nargs="*", default=[], metavar=OVERRIDES_METAVAR, help="dotted config overrides")

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        """Parse ``argv``; dotted overrides may also follow a flag (argparse alone takes only the first run of them)."""
        args, extra = self.parse_known_args(list(argv))
        later = [token for token in extra if "=" in token and not token.startswith("-")]
        unknown = [token for token in extra if token not in later]
        if unknown or (later and not hasattr(args, "overrides")):
            self.error(f"unrecognized arguments: {' '.join(unknown or later)}")
        if later:
            args.overrides = [*args.overrides, *later]
        return args

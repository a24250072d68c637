"""The command-line reference of the docs site (docs/reference/cli.md), rendered from the parsers of
:mod:`analysis.cli.registry` while the docs site builds (the hook docs/hooks/generated.py), so that it lists every
argument the commands accept; ``python -m analysis.cli.reference`` prints it.
"""

from __future__ import annotations

import argparse
import posixpath
from collections.abc import Iterator

from analysis.cli._parser import LineHelpFormatter
from analysis.cli.registry import COMMANDS, Command

REFERENCE_PAGE = "docs/reference/cli.md"
USAGE_WIDTH = 100  # a fixed width, so the page does not depend on the terminal it was generated in

HEADER = """# Command-line reference

Every command of `run.py`, generated from its argument parser while this site builds (edit the parsers in
`analysis/cli`, not this page). `python run.py <command> --help` prints the same in a terminal."""


class _ReferenceFormatter(LineHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=USAGE_WIDTH)


def cli_reference_markdown() -> str:
    """The Markdown of docs/reference/cli.md: per command its summary, usage, description, arguments and options
    (with their defaults), notes, and a link to the page that explains it."""
    return "\n\n".join([HEADER, *(_section(command) for command in COMMANDS)]) + "\n"


def _section(command: Command) -> str:
    parser = command.build_parser()
    parser.formatter_class = _ReferenceFormatter
    formatter = _ReferenceFormatter(parser.prog)
    rows = ["| argument | meaning |", "| --- | --- |", *_rows(parser, formatter)]
    page = command.docs_page
    link = f"Documentation: [{posixpath.splitext(posixpath.basename(page))[0]}]({_relative(page)})"
    parts = [
        f"## {parser.prog}",
        _text(command.summary) + ".",
        f"```text\n{parser.format_usage().rstrip()}\n```",
        _text(parser.description or ""),
        "\n".join(rows),
        _text(parser.epilog or ""),
        link,
    ]
    return "\n\n".join(part for part in parts if part)


def _rows(parser: argparse.ArgumentParser, formatter: argparse.HelpFormatter) -> Iterator[str]:
    """One table row per argument or option: how it is written (option strings with their metavar) and its help."""
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        meaning = formatter._expand_help(action) if action.help else ""
        if action.required and action.option_strings:
            meaning = f"(required) {meaning}"
        default = action.default
        shown = default is not None and default is not False and default != argparse.SUPPRESS and default != []
        if shown:
            meaning += f" (default: {default})"
        yield f"| {_code(formatter._format_action_invocation(action))} | {_text(meaning.strip())} |"


def _relative(page: str) -> str:
    """``page`` (a path under docs/) as a link from the reference page: docs/plans.md -> ../plans.md."""
    return posixpath.relpath(page, posixpath.dirname(REFERENCE_PAGE))


def _text(text: str) -> str:
    """Plain text for Markdown (and a table cell): ``|`` escaped, ``<`` not taken for an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _code(text: str) -> str:
    """A code span for a table cell (GitHub's tables want ``|`` escaped even there)."""
    escaped = text.replace("|", "\\|")
    return f"`{escaped}`"


if __name__ == "__main__":
    print(cli_reference_markdown(), end="")

"""The command line's help: ``run.py --help`` lists every subcommand, every help ends with its documentation page,
the registry drives dispatch, and the generated reference page names every argument of every command."""

from __future__ import annotations

import argparse
import re

import pytest

from analysis.cli import main, reference, registry
from analysis.cli._parser import CommandParser
from analysis.cli.reference import cli_reference_markdown
from analysis.cli.registry import COMMANDS, JOB, SUBCOMMANDS, Command, docs_line

DOCS_PAGES = {
    "docs/getting-started.md",
    "docs/plans.md",
    "docs/outputs.md",
    "docs/scale-out.md",
    "docs/cli.md",
    "docs/recovery.md",
    "docs/reference/cli.md",
}


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse wraps to the terminal: a fixed width, so that no line of the help depends on where the tests run."""
    monkeypatch.setenv("COLUMNS", "120")


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``run.py <argv>`` prints for ``--help`` (it exits 0 and writes nothing on stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    captured = capsys.readouterr()
    assert exit_.value.code == 0, captured.err
    assert captured.err == ""
    return captured.out


def test_main_help_lists_every_subcommand_with_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of(["--help"], capsys)
    assert [command.name for command in SUBCOMMANDS] == ["plan", "verify", "compress", "report", "merge", "deps"]
    for command in SUBCOMMANDS:
        assert re.search(rf"^  {command.name} +{re.escape(command.summary)}$", out, re.MULTILINE), command.name
    assert "python run.py <command> --help" in out
    flat = " ".join(out.split())
    assert "Precedence: flags > overrides > YAML > defaults." in flat
    assert out.startswith("usage: run.py [-h] --config_path CONFIG_PATH")


def test_summaries_are_one_short_line_each() -> None:
    for command in COMMANDS:
        assert command.summary.strip() == command.summary and "\n" not in command.summary, command.name
    width = max(len(command.name) for command in SUBCOMMANDS)
    for command in SUBCOMMANDS:  # the listing fits an 80-column terminal unwrapped
        assert len(f"  {command.name:<{width}}  {command.summary}") <= 78, command.name


def test_every_command_has_its_documentation_page() -> None:
    pages = {command.name: command.docs_page for command in COMMANDS}
    assert pages == {
        "": "docs/getting-started.md",
        "plan": "docs/plans.md",
        "verify": "docs/plans.md",
        "compress": "docs/recovery.md",
        "report": "docs/outputs.md",
        "merge": "docs/scale-out.md",
        "deps": "docs/cli.md",
    }
    assert set(pages.values()) <= DOCS_PAGES
    assert docs_line("docs/scale-out.md") == "Documentation: docs/scale-out.md (mkdocs serve, then /scale-out/)"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name or "run.py")
def test_every_help_ends_with_its_documentation_line(command: Command, capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of([command.name, "--help"] if command.name else ["--help"], capsys)
    assert out.rstrip("\n").splitlines()[-1] == docs_line(command.docs_page)
    assert out.startswith(f"usage: {command.parser().prog} ")


def test_the_registry_drives_dispatch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    report = next(command for command in SUBCOMMANDS if command.name == "report")
    out = help_of(["report", "--help"], capsys)
    assert out == report.parser().format_help()
    assert "Write the CSV exports, plots and HTML report of an existing analysis file" in " ".join(out.split())

    seen: list[argparse.Namespace] = []

    def build() -> CommandParser:
        parser = CommandParser(prog="run.py echo", description="A command only this test registers.")
        parser.add_argument("word")
        parser.add_overrides()
        return parser

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    echo = Command("echo", "Echo a word", build, run, "docs/cli.md")
    monkeypatch.setattr(registry, "SUBCOMMANDS", (*SUBCOMMANDS, echo))
    assert main(["echo", "hello", "Global.batch_size=4"]) == 7
    assert [(args.word, args.overrides) for args in seen] == [("hello", ["Global.batch_size=4"])]


def test_a_bad_subcommand_argument_is_still_one_sentence_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: run.py report")
    assert err.strip().splitlines()[-1] == (
        "error: run.py report: the following arguments are required: analysis_file; see run.py report --help."
    )


def test_version_is_still_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert re.fullmatch(r"run\.py \S+\n", capsys.readouterr().out)


def test_reference_has_every_command_and_names_every_argument() -> None:
    markdown = cli_reference_markdown()
    assert markdown.startswith("# ")
    headings = re.findall(r"^## (.+)$", markdown, re.MULTILINE)
    assert headings == [
        "run.py",
        "run.py plan",
        "run.py verify",
        "run.py compress",
        "run.py report",
        "run.py merge",
        "run.py deps",
    ]
    sections = dict(zip(headings, re.split(r"^## .+$", markdown, flags=re.MULTILINE)[1:], strict=True))
    for command in COMMANDS:
        parser = command.parser()
        section = sections[parser.prog]
        assert command.summary in section
        assert "```text\nusage: " + parser.prog in section
        assert "| argument | meaning |" in section
        link = command.docs_page.removeprefix("docs/")
        assert section.rstrip().endswith(f"]({'../' + link})"), parser.prog
        for action in parser._actions:
            names = action.option_strings or [action.metavar or action.dest]
            for name in names:
                assert re.search(rf"^\| `[^`]*{re.escape(str(name))}\b", section, re.MULTILINE), (parser.prog, name)
    assert JOB.build_parser().epilog in markdown  # the overrides and precedence note


def test_reference_rows_escape_pipes_and_show_real_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> CommandParser:
        parser = CommandParser(prog="run.py demo", description="Pipes | here.")
        parser.add_argument("--mode", default="a|b", help="either a | b")
        parser.add_argument("--count", type=int, default=3, help="how many")
        parser.add_argument("--flag", action="store_true", help="a switch")
        parser.add_argument("--name", help="nothing by default, 40%% of the time")
        return parser

    demo = Command("demo", "A command only this test renders", build, lambda args: 0, "docs/cli.md")
    monkeypatch.setattr(reference, "COMMANDS", (demo,))
    markdown = cli_reference_markdown()
    assert "| `--mode MODE` | either a \\| b (default: a\\|b) |" in markdown
    assert "| `--count COUNT` | how many (default: 3) |" in markdown
    assert "| `--flag` | a switch |" in markdown
    assert "| `--name NAME` | nothing by default, 40% of the time |" in markdown
    assert "Pipes \\| here." in markdown
    assert markdown.rstrip().endswith("Documentation: [cli](../cli.md)")


def test_reference_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = cli_reference_markdown()
    monkeypatch.setenv("COLUMNS", "40")
    assert cli_reference_markdown() == wide

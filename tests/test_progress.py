"""Progress of long steps: a tqdm bar on a terminal, log lines with counts and ETA when the output is a file (nohup,
a cluster scheduler), nothing with ``--quiet``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from tqdm.auto import tqdm

import analysis.progress
from analysis.progress import LineProgress, progress_bar

from helpers import CliResult, tiny_global, write_config, write_train_list

LINE = re.compile(r"^sensitivity: (\d+)/4 variant \(\d+%\), \d\d:\d\d elapsed, about \d\d:\d\d left$")


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "analysis.progress"]


def test_off_a_terminal_a_step_logs_its_counts_and_eta(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(analysis.progress, "LINE_SECONDS", 0.0)  # a line at every refresh
    with (
        caplog.at_level(logging.INFO, logger="analysis"),
        progress_bar(None, total=4, desc="sensitivity", unit="variant") as bar,
    ):  # pytest captures stderr: not a terminal
        assert isinstance(bar, LineProgress)
        for _ in range(4):
            bar.update(1)
    lines = progress_lines(caplog)
    assert lines and all(LINE.match(line) for line in lines), lines
    assert [int(LINE.match(line).group(1)) for line in lines] == [1, 2, 3, 4]  # type: ignore[union-attr]


def test_without_a_total_the_line_gives_the_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(analysis.progress, "LINE_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="analysis"), progress_bar(None, desc="decode", unit="img") as bar:
        bar.update(8)
    assert len(progress_lines(caplog)) == 1
    assert re.fullmatch(r"decode: 8 img, \d\d:\d\d elapsed", progress_lines(caplog)[0])


def test_a_step_shorter_than_the_interval_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert analysis.progress.LINE_SECONDS >= 10  # lines are for steps long enough to be mistaken for a hang
    with caplog.at_level(logging.INFO, logger="analysis"), progress_bar(None, total=4, desc="sensitivity") as bar:
        bar.update(4)
    assert progress_lines(caplog) == []


def test_quiet_shows_nothing_and_a_requested_bar_is_tqdm(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(analysis.progress, "LINE_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="analysis"):
        with progress_bar(False, total=4, desc="sensitivity") as quiet:
            quiet.update(4)
        with progress_bar(True, total=4, desc="sensitivity") as shown:
            shown.update(4)
    assert quiet.disable and type(shown) is tqdm and not isinstance(shown, LineProgress)
    assert progress_lines(caplog) == []


def test_a_run_logged_to_a_file_reports_every_long_step(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(analysis.progress, "LINE_SECONDS", 0.0)
    write_train_list(list_data, 12)
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.25, 0.5],
                                "target_macs_reduction": 0.2, "verify": True},
    })  # fmt: skip
    result = cli("--config_path", config, "--no_report")
    assert result.code == 0, result.err
    steps = {line.split(": ")[0] for line in result.err.splitlines() if line.endswith(" left")}
    assert {"decode", "sensitivity", "BatchNorm re-estimation", "verify"} <= steps, result.err
    quiet = cli("--config_path", config, "--no_report", "--quiet", "--overwrite")
    assert quiet.code == 0 and "BatchNorm re-estimation:" not in quiet.err

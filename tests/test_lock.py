"""One writer per analysis file: a second run is refused, a dead run's lock is taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.errors import AnalysisFileError
from analysis.io.lock import exclusive, lock_path

from helpers import CliResult, analysis_config


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_lock(path: Path, **owner: object) -> Path:
    lock = lock_path(path)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": None, **owner}))
    return lock


def test_second_writer_is_refused_and_the_lock_is_removed_after(tmp_path: Path) -> None:
    target = tmp_path / "s.pkl"
    with exclusive(target) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        refusal = rf"being written by process {os.getpid()} on .*s.pkl.lock"
        with pytest.raises(AnalysisFileError, match=refusal), exclusive(target):
            pass
        assert lock.exists()  # the refused attempt did not remove the owner's lock
    assert not lock_path(target).exists()


def test_lock_is_released_on_errors(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), exclusive(tmp_path / "s.pkl"):
        raise RuntimeError("boom")
    assert not lock_path(tmp_path / "s.pkl").exists()


@pytest.mark.parametrize(
    "owner",
    [{"pid": "dead"}, {"started": -1}, {"pid": None, "host": None}],
    ids=["dead-process", "pid-reused", "unreadable"],
)
def test_stale_locks_are_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture, owner: dict) -> None:
    target = tmp_path / "s.pkl"
    lock = write_lock(target, **{**owner, "pid": dead_pid()} if owner.get("pid") == "dead" else owner)
    with caplog.at_level(logging.WARNING, logger="analysis"), exclusive(target):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "Removing the stale lock" in caplog.text
    assert not lock.exists()


def test_a_lock_from_another_host_is_respected(tmp_path: Path) -> None:
    lock = write_lock(tmp_path / "s.pkl", host="elsewhere", pid=1)
    with pytest.raises(AnalysisFileError, match="process 1 on elsewhere"), exclusive(tmp_path / "s.pkl"):
        pass
    assert lock.exists()


def test_cli_refuses_a_locked_analysis_file_with_exit_2(cli: object, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "depthwise_cnn", arch_kwargs={})
    target = tmp_path / "out" / "s.pkl"
    target.parent.mkdir()
    with exclusive(target):
        result: CliResult = cli("--config_path", path)  # type: ignore[operator]
    assert result.code == 2 and "error: Analysis file" in result.err and "is being written by process" in result.err
    assert not target.exists()  # nothing written by the refused run

"""Fixtures and hooks: a tiny image dataset, in-process CLI runs, one folder and seed per test, and no green run
without a passed test. Plain helpers are in ``helpers.py``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import CliResult, run_cli, write_images

_passed = 0

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker gets one thread (and so do the processes tests start), so that N workers on N
    # cores do not oversubscribe them.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count passed tests, so that a run in which nothing passed cannot look green."""
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when tests were collected but none passed (e.g. everything skipped)."""
    if exitstatus == 0 and _passed == 0 and not session.config.option.collectonly:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nerror: no test passed; a green run must have run tests")


@pytest.fixture
def list_data(tmp_path: Path) -> Path:
    """20 images, labels 0..9 twice, in the PaddleSlim layout."""
    root = tmp_path / "data"
    write_images(root, "list", [i % 10 for i in range(20)])
    return root


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``analysis.cli.main`` in-process with string arguments (see :func:`helpers.run_cli` for signals)."""

    def run(*argv: str | os.PathLike[str]) -> CliResult:
        code = run_cli(argv)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(autouse=True)
def _isolate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test in its own folder (so default output paths never land in the repository), seeded."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)

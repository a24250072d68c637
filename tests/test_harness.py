"""The test harness: a SIGINT or SIGTERM sent to pytest during an in-process CLI run stops pytest, instead of
becoming the run's exit code 130 or 143 that a test could take as a pass."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, default_signals

SIGNALLING_MODEL = """
import os
from torch import nn


class Signalling(nn.Module):
    '''Sends ``signum`` to its own process in every forward pass: a kill arriving while the CLI evaluates.'''

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        os.kill(os.getpid(), self.signum)
        return self.fc(self.conv(x).mean(dim=(2, 3)))


def signalling(signum: int) -> nn.Module:
    return Signalling(signum)
"""

# Each inner test would pass if the signal became an exit code: it only checks that the run did not succeed.
INNER_TESTS = """
import signal
from pathlib import Path

import pytest

from analysis import main
from helpers import run_cli, tiny_global, write_config, write_images

MODEL = Path(__file__).with_name("signalling.py")


def argv(tmp_path: Path, name: str) -> list[str]:
    write_images(tmp_path / "data", "list", [0, 1, 2, 3])
    signum = int(signal.Signals[name])
    block = tiny_global(tmp_path / "data", arch=f"{MODEL}:signalling", arch_kwargs={"signum": signum})
    analysis = {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5]}
    return ["--config_path", str(write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": analysis}))]


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_main_directly(tmp_path: Path, name: str) -> None:
    assert main(argv(tmp_path, name)) != 0


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_run_cli(tmp_path: Path, name: str) -> None:
    assert run_cli(argv(tmp_path, name)) != 0
"""


def run_inner(tmp_path: Path, selection: str) -> subprocess.CompletedProcess[str]:
    """Run the inner tests chosen by ``-k selection`` in a pytest of their own, with ``helpers`` importable."""
    inner = tmp_path / "inner"
    inner.mkdir(exist_ok=True)
    (inner / "pytest.ini").write_text("[pytest]\n")  # keep the repository's pytest settings out of the inner run
    (inner / "signalling.py").write_text(SIGNALLING_MODEL)
    (inner / "test_inner.py").write_text(INNER_TESTS)
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, "test_inner.py"]
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(command, cwd=inner, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=default_signals)  # fmt: skip


def test_without_the_harness_a_signal_becomes_a_passing_exit_code(tmp_path: Path) -> None:
    """The hazard the harness removes: ``main()`` absorbs both signals, and the inner tests pass."""
    result = run_inner(tmp_path, "test_main_directly")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_during_an_in_process_run_stops_pytest(tmp_path: Path, signum: signal.Signals) -> None:
    result = run_inner(tmp_path, f"test_run_cli and {signum.name}")
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    assert f"{signum.name} arrived during an in-process CLI run: it was meant for pytest" in result.stdout
    assert "passed" not in result.stdout

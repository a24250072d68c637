"""Resume: a run killed part-way and restarted writes the same file as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from analysis.results import load_sensitivities

from conftest import REPO, tiny_global, write_config

ENGINE_MODELS = Path(__file__).resolve().parent / "engine_models.py"
RATIOS = ["0.2", "0.4", "0.6", "0.8"]


def config(tmp_path: Path, data: Path, name: str) -> Path:
    block = tiny_global(data, arch=f"{ENGINE_MODELS}:slow_cnn", arch_kwargs={"num_classes": 10, "delay": 0.05})
    analysis = {
        "analysis_file": str(tmp_path / name / "s.pkl"),
        "pruned_ratios": [float(r) for r in RATIOS],
        "engine": "reference",  # one save per (param, ratio), and slow_cnn's sleep runs in every forward pass
    }
    return write_config(tmp_path / f"{name}.yaml", {"Global": block, "SensitivityAnalysis": analysis})


def command(path: Path) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--config_path", str(path)]


def units(path: Path) -> int:
    return sum(len(curve) for curve in load_sensitivities(path).values())


def test_killed_run_resumes_to_the_same_file(tmp_path: Path, list_data: Path) -> None:
    reference = config(tmp_path, list_data, "reference")
    subprocess.run(command(reference), check=True, capture_output=True, timeout=300)
    expected = (tmp_path / "reference" / "s.pkl").read_bytes()
    total = len(load_sensitivities(tmp_path / "reference" / "s.pkl")) * len(RATIOS)
    assert total == 3 * len(RATIOS)

    resumed = config(tmp_path, list_data, "resumed")
    target = tmp_path / "resumed" / "s.pkl"
    process = subprocess.Popen(command(resumed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if target.exists() and units(target) >= 2:  # always loadable: saves are atomic
            break
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    done = units(target)
    assert 2 <= done < total, f"the kill came too late to test resuming ({done}/{total} units done)"

    finished = subprocess.run(command(resumed), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert f"Evaluating {total - done} variant(s)" in finished.stderr
    assert target.read_bytes() == expected

    again = subprocess.run(command(resumed), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "Nothing to evaluate" in again.stderr and "Baseline (stored)" in again.stderr
    assert target.read_bytes() == expected

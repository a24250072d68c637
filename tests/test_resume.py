"""Resume: a run killed part-way and restarted writes the same file as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.io.results import load_sensitivities

from helpers import ENGINE_MODELS, REPO, default_signals, tiny_global, write_config

RATIOS = ["0.2", "0.4", "0.6", "0.8"]


def config(tmp_path: Path, data: Path, name: str, delay: float = 0.05) -> Path:
    block = tiny_global(data, arch=f"{ENGINE_MODELS}:slow_cnn", arch_kwargs={"num_classes": 10, "delay": delay})
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


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_interrupted_run_saves_says_how_to_resume_and_exits(
    tmp_path: Path, list_data: Path, sig: signal.Signals, code: int, word: str
) -> None:
    path = config(tmp_path, list_data, "stopped")
    target = tmp_path / "stopped" / "s.pkl"
    process = subprocess.Popen(command(path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signals)  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None and not (target.exists() and units(target) >= 1):
        time.sleep(0.005)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    assert f"{word}: every finished (param, ratio) is saved; run the same command again to resume." in err
    assert "Traceback" not in err
    done = units(target)  # valid and loadable
    assert 1 <= done < 3 * len(RATIOS)
    assert not (tmp_path / "stopped" / "s.pkl.lock").exists()  # released on the way out (resuming: tested above)


KILLING_RUNNER = """
import os, signal, sys
from analysis import main
kill_at, calls, replace = int(sys.argv[1]), [0], os.replace
def replace_or_die(source, target):
    calls[0] += 1
    if calls[0] == kill_at:  # the new file is written in full but not yet renamed over the old one
        os.kill(os.getpid(), signal.SIGKILL)
    replace(source, target)
os.replace = replace_or_die
sys.exit(main(sys.argv[2:]))
"""


def test_sigkill_at_any_save_leaves_a_loadable_file_and_resumes_to_the_same(tmp_path: Path, list_data: Path) -> None:
    reference = config(tmp_path, list_data, "reference", delay=0.0)
    subprocess.run([*command(reference), "--no_report"], check=True, capture_output=True, timeout=300)
    expected = (tmp_path / "reference" / "s.pkl").read_bytes()
    path = config(tmp_path, list_data, "killed", delay=0.0)
    target = tmp_path / "killed" / "s.pkl"
    history = []
    # replace() calls per unit: sidecar then pickle; kill at the 1st sidecar, then inside later saves
    for kill_at in (1, 2, 3, 4, 6):
        run = [sys.executable, "-c", KILLING_RUNNER, str(kill_at), "--config_path", str(path), "--no_report"]
        result = subprocess.run(run, capture_output=True, text=True, timeout=300)
        assert result.returncode == -signal.SIGKILL, result.stderr
        history.append(units(target) if target.exists() else 0)  # loadable after every kill
    assert history == sorted(history) and history[-1] >= 2  # progress survives every kill
    finished = subprocess.run([*command(path), "--no_report"], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert target.read_bytes() == expected
    assert sorted(p.name for p in target.parent.iterdir()) == ["s.pkl", "s.pkl.json"]  # no temporaries, no lock

"""Shared fixtures: tiny image datasets in both layouts, config writing, in-process CLI runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from analysis.cli.main import main

REPO = Path(__file__).resolve().parent.parent
TINY_MODELS = Path(__file__).resolve().parent / "tiny_models.py"

_passed = 0


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


def write_images(root: Path, layout: str, labels: list[int], size: tuple[int, int] = (20, 16), seed: int = 0) -> None:
    """Write random RGB PNGs for ``labels`` in the PaddleSlim list layout or the ImageFolder layout."""
    rng = np.random.default_rng(seed)
    lines = []
    for index, label in enumerate(labels):
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        if layout == "list":
            relative = Path("val") / f"img_{index:04d}.png"
            lines.append(f"{relative} {label}")
        else:
            relative = Path("val") / f"class_{label:02d}" / f"img_{index:04d}.png"
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / relative)
    if layout == "list":
        (root / "val_list.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def list_data(tmp_path: Path) -> Path:
    """20 images, labels 0..9 twice, in the PaddleSlim layout."""
    root = tmp_path / "data"
    write_images(root, "list", [i % 10 for i in range(20)])
    return root


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """Dump ``data`` as YAML to ``path`` and return the path."""
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tiny_global(data_dir: Path, **extra: Any) -> dict[str, Any]:
    """A Global block for the tiny CNN with random weights on 16x16 crops."""
    block = {
        "arch": f"{TINY_MODELS}:tiny_cnn",
        "arch_kwargs": {"num_classes": 10},
        "data_dir": str(data_dir),
        "batch_size": 8,
        "img_size": 16,
        "resize_size": 16,
        "num_workers": 0,
        "device": "cpu",
    }
    block.update(extra)
    return block


@dataclass
class CliResult:
    """Exit code and captured output of one in-process CLI run."""

    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``analysis.cli.main`` in-process with string arguments."""

    def run(*argv: str | os.PathLike[str]) -> CliResult:
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(autouse=True)
def _isolate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test in its own folder (so default output paths never land in the repository), seeded."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)

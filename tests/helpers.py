"""Helpers shared by the test modules: paths, data and config writers, the in-process CLI runner, random models and
batches, and the two-engine comparison. Test modules import these from here, never from each other."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch import nn

import analysis.compat.paddleslim
from analysis import analysis_prune, main
from analysis.engine.executors import Executor
from analysis.engine.run import AnalysisOutcome
from analysis.engine.sensitivity import EngineReport
from analysis.io.fingerprint import json_fingerprint
from analysis.io.results import load_sensitivities, load_sidecar

REPO = Path(__file__).resolve().parent.parent
TINY_MODELS = Path(__file__).resolve().parent / "tiny_models.py"
ENGINE_MODELS = Path(__file__).resolve().parent / "engine_models.py"

Batches = list[tuple[torch.Tensor, torch.Tensor]]

# ---- data and configs ----------------------------------------------------------------------------------------------


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


def write_train_list(root: Path, count: int) -> None:
    """Random training PNGs in ``root/train``, listed in ``root/train_list.txt`` (the default calibration set)."""
    rng = np.random.default_rng(5)
    lines = []
    for index in range(count):
        relative = Path("train") / f"train_{index:04d}.png"
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(root / relative)
        lines.append(f"{relative} {index % 10}")
    (root / "train_list.txt").write_text("\n".join(lines) + "\n")


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """Dump ``data`` as YAML to ``path`` and return the path."""
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# A ratios YAML (ChannelPrune block) as this tool writes it, pruning the tiny CNN's first conv at 0.5.
RATIOS_HEAD = "ChannelPrune:\n  criterion: l1_norm\n"
VALID_RATIOS = RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [0.5]\n"


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


def analysis_config(tmp_path: Path, data: Path, arch: str, analysis: dict | None = None, **extra: object) -> Path:
    """A config analysing ``engine_models.<arch>`` at ratio 0.5 into ``tmp_path/out/s.pkl``, written to a.yaml."""
    block = tiny_global(data, arch=f"{ENGINE_MODELS}:{arch}", **extra)
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5], **(analysis or {})}
    return write_config(tmp_path / "a.yaml", {"Global": block, "SensitivityAnalysis": section})


# ---- the measured plan's search log ---------------------------------------------------------------------------

SEARCH_DESCRIPTION: dict[str, Any] = {
    "model": "m",
    "data": "d",
    "calibration": None,
    "ranking": {},
    "physical": False,
    "measure": "macs",
}


SEARCH_KEY = json_fingerprint(SEARCH_DESCRIPTION)  # the search key of SearchLog(..., DESCRIPTION)


SEARCH_FIELDS = ("key", "setting", "picks", "metrics", "macs", "params", "seconds")


def search_record(key: str = SEARCH_KEY, **fields: Any) -> dict[str, Any]:
    """A valid search-log record of ``key``, with ``fields`` changed."""
    valid = {"key": key, "setting": "search", "picks": [["0.weight", "0.weight", 2]],
             "metrics": {"top1": 0.5, "top5": 1.0, "ce": 1.25, "images": 20}, "macs": 1000, "params": 100,
             "seconds": 0.5}  # fmt: skip
    return {**valid, **fields}


# ---- the CLI, in-process ---------------------------------------------------------------------------------------------


@dataclass
class CliResult:
    """Exit code and captured output of one in-process CLI run."""

    code: int
    out: str
    err: str


def default_signals() -> None:
    """A child process's ``preexec_fn``: SIGINT back to its default, so the child (Python) turns it into
    ``KeyboardInterrupt``. A test run started as a background job of a non-interactive shell (``pytest ... &``)
    ignores SIGINT, and an ignored signal stays ignored in every process it starts, so a test sending SIGINT to its
    child would see it ignored (measured: test_harness failed that way, and passed started under ``timeout``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# main() turns these signals into these exit codes (and restores the previous handlers before returning).
_SIGNAL_EXITS = {130: signal.SIGINT, 143: signal.SIGTERM}


def run_cli(argv: Sequence[str | os.PathLike[str]]) -> int:
    """Run ``analysis.cli.main`` in the test process and return its exit code.

    ``main()`` turns SIGINT and SIGTERM into the exit codes 130 and 143. In the test process such a signal was
    meant for pytest (a CI timeout, a Ctrl-C): no in-process test sends one (the signal tests run the CLI in a
    subprocess), so a run that ends with 130 or 143 stops the whole session with that exit code, instead of
    becoming a result that a test could take as a pass.
    """
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNAL_EXITS.values()}
    code = main([str(a) for a in argv])
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "main() left its signal handlers installed"
    if code in _SIGNAL_EXITS:
        name = _SIGNAL_EXITS[code].name
        pytest.exit(f"{name} arrived during an in-process CLI run: it was meant for pytest", returncode=code)
    return code


def assert_user_error(result: CliResult, pattern: str) -> None:
    """The run failed with exit code 2 and one ``error:`` line matching ``pattern``, no traceback, no output."""
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert lines[-1].startswith("error: "), result.err
    assert re.search(pattern, lines[-1]), lines[-1]
    assert "Traceback" not in result.err
    assert result.out == ""


# ---- models and batches ------------------------------------------------------------------------------------------


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights and BN statistics, so that no BN is an identity and every channel matters."""
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def batches(count: int = 3, size: int = 8, resolution: int = 16, classes: int = 10) -> Batches:
    """``count`` seeded batches of random images and random labels."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 3, resolution, resolution, generator=generator),
         torch.randint(0, classes, (size,), generator=generator))
        for _ in range(count)
    ]  # fmt: skip


def pseudo_labelled(model: nn.Module, data: Batches) -> Batches:
    """Label the data with the model's own predictions, so the baseline top1 is 1 and pruning visibly hurts."""
    with torch.inference_mode():
        return [(images, model(images).argmax(dim=1)) for images, _ in data]


def calibration_batches(count: int = 2, size: int = 8, resolution: int = 16) -> Batches:
    """Random images other than those of :func:`batches` (labels are unused by re-estimation)."""
    generator = torch.Generator().manual_seed(123)
    return [
        (torch.randn(size, 3, resolution, resolution, generator=generator), torch.zeros(size, dtype=torch.long))
        for _ in range(count)
    ]


# ---- the two engines ---------------------------------------------------------------------------------------------


def analyse_both(
    model: nn.Module, data: Any, tmp_path: Path, *, fast_path: bool = True, **kwargs: Any
) -> tuple[dict, dict]:
    """Run both engines on the same model and data; return their sidecars (which hold every variant's metrics).

    Besides the byte-identical files it asserts, from each run's record of what evaluated every variant, that two
    different paths were compared: the reference run evaluated nothing on the fast path and, with ``fast_path``, the
    fast run evaluated there every variant the reference run evaluated by masking (physical and unchanged variants
    are evaluated alike); without it (a model the fast engine must refuse) the fast run did what the reference did.
    """
    executors = {}
    for engine in ("reference", "fast"):
        report = analyse_recorded(model, data, tmp_path / f"{engine}.pkl", engine=engine, progress=False, **kwargs)
        executors[engine] = variant_executors(report)
    reference, fast = (load_sensitivities(tmp_path / f"{e}.pkl") for e in ("reference", "fast"))
    assert fast == reference  # exact float equality of every loss
    assert (tmp_path / "fast.pkl").read_bytes() == (tmp_path / "reference.pkl").read_bytes()
    by_reference = executors["reference"]
    assert by_reference and Executor.FX_SUFFIX not in by_reference.values()  # it evaluated, on the reference paths
    suffix = Executor.FX_SUFFIX if fast_path else Executor.EAGER
    assert executors["fast"] == {key: suffix if e is Executor.EAGER else e for key, e in by_reference.items()}
    assert (Executor.FX_SUFFIX in executors["fast"].values()) is fast_path  # the comparison is not vacuous
    return load_sidecar(tmp_path / "reference.pkl"), load_sidecar(tmp_path / "fast.pkl")


def analyse_recorded(model: nn.Module, data: Any, path: Path, **kwargs: Any) -> EngineReport:
    """Run :func:`analysis_prune` and return its engine's report (kept from the outcome of the run it makes)."""
    outcomes: list[AnalysisOutcome] = []
    run = analysis.compat.paddleslim.run_analysis

    def kept(*args: Any, **options: Any) -> AnalysisOutcome:
        outcomes.append(run(*args, **options))
        return outcomes[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(analysis.compat.paddleslim, "run_analysis", kept)
        analysis_prune(model, data, path, **kwargs)
    (outcome,) = outcomes
    return outcome.report


def variant_executors(report: EngineReport) -> dict[tuple[str, float], Executor]:
    """``(param, ratio) -> executor`` of every variant a run recorded."""
    return {(name, ratio): e for name, by_ratio in report.executors.items() for ratio, e in by_ratio.items()}


def variant_metrics(sidecar: dict) -> dict:
    """``(param, ratio) -> {top1, top5, ce, images}`` of every variant in a sidecar."""
    return {
        (name, ratio): {k: v[k] for k in ("top1", "top5", "ce", "images")}
        for name, info in sidecar["params"].items()
        for ratio, v in info.get("variants", {}).items()
    }


Removals = list[tuple[str, list[int]]]


class FakeProbe:
    """Scores plans by a rule of the test's choosing and records what it was asked."""

    def __init__(self, worst: Removals, setting: str = "probe fake") -> None:
        self.worst, self.setting, self.steps = worst, setting, 5
        self.calls: list[Removals] = []

    def top1(self, removals: Removals) -> float:
        """Any rule but the search's: the plan given as worst scores 0, others by the channels they remove."""
        return 0.0 if sorted(removals) == sorted(self.worst) else 0.5 + sum(len(c) for _, c in removals) / 1000

    def score(self, removals: Removals) -> dict[str, float]:
        self.calls.append(removals)
        return {"top1": self.top1(removals), "top5": 1.0, "ce": 1.0}

"""A model built from ``Global.arch`` with no weights is never silent: a warning before anything else runs, a mark
in the sidecar and a banner in the report (issue 17)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from analysis.config import GlobalConfig
from analysis.inputs.models import random_weights_warning

from helpers import TINY_MODELS, CliResult, tiny_global, write_config
from tiny_models import tiny_cnn

Cli = Callable[..., CliResult]


def run(cli: Cli, tmp_path: Path, data: Path, **extra: object) -> CliResult:
    block = tiny_global(data, **extra)
    config = write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": {
        "analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5]}})  # fmt: skip
    result = cli("--config_path", config)
    assert result.code == 0, result.err
    return result


def test_random_weights_are_announced_first_and_marked_in_sidecar_and_report(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    result = run(cli, tmp_path, list_data)
    warning = f"Global.arch {TINY_MODELS}:tiny_cnn gets no weights: unless it loads them itself, random weights"
    before_data = result.err.partition("\ndata: ")[0]  # the config summary, then the warning, then the data
    assert warning in before_data, result.err
    sidecar = json.loads((tmp_path / "out" / "s.pkl.json").read_text())
    assert sidecar["config"]["random_weights"] is True
    html = (tmp_path / "out" / "s.report.html").read_text()
    assert '<p class="warning">Random weights: the numbers describe an untrained network' in html


def test_a_checkpoint_means_no_warning_and_no_mark(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    torch.save(tiny_cnn(num_classes=10).state_dict(), tmp_path / "weights.pt")
    result = run(cli, tmp_path, list_data, model_dir=str(tmp_path), params_filename="weights.pt")
    assert "random weights" not in result.err
    assert "random_weights" not in json.loads((tmp_path / "out" / "s.pkl.json").read_text())["config"]
    assert 'class="warning"' not in (tmp_path / "out" / "s.report.html").read_text()


def test_the_warning_names_what_is_missing_for_each_kind_of_arch() -> None:
    torchvision_name = random_weights_warning(GlobalConfig(arch="resnet18"))
    assert torchvision_name == (
        "Global.arch resnet18 gets no weights, so it has random weights: the numbers describe an untrained network; "
        "set Global.model_dir + params_filename (a state_dict) or Global.weights."
    )
    assert random_weights_warning(GlobalConfig(arch="resnet18", weights="DEFAULT")) is None
    assert random_weights_warning(GlobalConfig(model_dir="m.pt", trust_model_file=True)) is None  # a pickled module

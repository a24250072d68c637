"""The shipped demo: data, models and configs work from a fresh clone, and the ACT config runs unchanged."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from analysis.config import load_config
from analysis.engine.evaluate import evaluate
from analysis.inputs.data import build_eval_loader, find_samples
from analysis.inputs.models import build_model

from helpers import REPO, CliResult

DEMO_CONFIGS = sorted((REPO / "configs" / "demo").glob("*.yaml"))
ACT_CONFIGS = sorted((REPO / "configs" / "act").glob("*.yaml"))
IMAGENET_CONFIGS = sorted((REPO / "configs" / "imagenet").glob("*.yaml"))
CHECKPOINTS = sorted((REPO / "datasets" / "digits" / "weights").glob("*.pth"))


def test_the_shipped_configs_and_checkpoints_are_all_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests below run once per file these globs find: a missing folder must fail here, not shrink them."""
    assert [p.name for p in DEMO_CONFIGS] == ["digits_mobilenet.yaml", "digits_resnet.yaml"]
    assert [p.name for p in ACT_CONFIGS] == ["digits_resnet_prune_dis.yaml"]
    assert [p.name for p in IMAGENET_CONFIGS] == ["mobilenet_v2.yaml", "resnet50.yaml"]
    monkeypatch.chdir(REPO)
    used = {load_config(path.relative_to(REPO)).Global.params_filename for path in DEMO_CONFIGS + ACT_CONFIGS}
    assert used == {p.name for p in CHECKPOINTS} == {"digits_mobilenet_v2.pth", "digits_resnet.pth"}


def test_demo_data_is_complete_and_balanced() -> None:
    samples, layout = find_samples(REPO / "datasets" / "digits")
    assert "PaddleSlim" in layout and len(samples) >= 400
    assert sorted({s.label for s in samples}) == list(range(10))


@pytest.mark.parametrize("weights", CHECKPOINTS, ids=lambda p: p.name)
def test_demo_checkpoints_are_small(weights: Path) -> None:
    assert weights.stat().st_size <= 5 * 1024 * 1024


@pytest.mark.parametrize("config_path", DEMO_CONFIGS + ACT_CONFIGS, ids=lambda p: p.name)
def test_demo_baseline_reaches_95_percent(config_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(config_path.relative_to(REPO)).Global
    model = build_model(config)
    result = evaluate(model, build_eval_loader(config, torch.device("cpu")), progress=False)
    assert result.num_samples == 450
    assert result.top1 >= 0.95


def test_act_config_runs_unchanged(
    cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    (config_path,) = ACT_CONFIGS
    config = load_config(config_path.relative_to(REPO))
    assert {"Distillation", "ChannelPrune", "TrainConfig"} <= set(config.ignored_blocks)
    wanted = config.SensitivityAnalysis.prune_params_name  # taken from ChannelPrune
    assert wanted
    output = tmp_path / "act.pkl"
    result = cli("--config_path", config_path.relative_to(REPO), "--analysis_file", output, "--pruned_ratios", "0.3")
    assert result.code == 0, result.err
    assert "ignored blocks: Distillation, ChannelPrune, TrainConfig" in result.err
    with output.open("rb") as handle:
        assert list(pickle.load(handle)) == wanted  # exactly ChannelPrune's params, in model order


def test_imagenet_configs_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    configs = [load_config(path.relative_to(REPO)) for path in IMAGENET_CONFIGS]
    assert [config.Global.arch for config in configs] == ["mobilenet_v2", "resnet50"]
    assert {(config.Global.img_size, config.Global.resize_size) for config in configs} == {(224, 232)}

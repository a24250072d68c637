"""The shipped demo: data, models and configs work from a fresh clone, and the ACT config runs unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from analysis.config import load_config
from analysis.data import find_samples

from conftest import REPO, CliResult

DEMO_CONFIGS = sorted((REPO / "configs" / "demo").glob("*.yaml"))
ACT_CONFIGS = sorted((REPO / "configs" / "act").glob("*.yaml"))


def test_demo_data_is_complete_and_balanced() -> None:
    samples, layout = find_samples(REPO / "datasets" / "digits")
    assert "PaddleSlim" in layout and len(samples) >= 400
    assert sorted({s.label for s in samples}) == list(range(10))


@pytest.mark.parametrize("weights", sorted((REPO / "datasets" / "digits" / "weights").glob("*.pth")), ids=str)
def test_demo_checkpoints_are_small(weights: Path) -> None:
    assert weights.stat().st_size <= 5 * 1024 * 1024


@pytest.mark.parametrize("config", DEMO_CONFIGS + ACT_CONFIGS, ids=lambda p: p.name)
def test_demo_baseline_reaches_95_percent(
    cli: Callable[..., CliResult], config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    result = cli("--config_path", config.relative_to(REPO), "--analysis_file", tmp_path / "s.pkl")
    assert result.code == 0, result.err
    top1 = float(result.out.split("top1=")[1].split()[0])
    assert top1 >= 0.95


def test_act_config_lists_ignored_blocks_and_lends_channel_prune_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    (config_path,) = ACT_CONFIGS
    config = load_config(config_path.relative_to(REPO))
    assert {"Distillation", "ChannelPrune", "TrainConfig"} <= set(config.ignored_blocks)
    assert config.SensitivityAnalysis.prune_params_name  # taken from ChannelPrune


def test_imagenet_configs_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    for path in sorted((REPO / "configs" / "imagenet").glob("*.yaml")):
        config = load_config(path.relative_to(REPO))
        assert (config.Global.img_size, config.Global.resize_size) == (224, 232)

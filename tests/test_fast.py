"""The fast engine gives exactly the reference engine's numbers, and falls back where it cannot split the graph."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import analysis.engine.partition
from analysis import analysis_prune
from analysis.config import load_config
from analysis.engine.executors import Executor
from analysis.inputs.data import apply_data_cache, build_eval_loader
from analysis.inputs.models import build_model
from analysis.structure.groups import find_prunable

import engine_models
from helpers import (
    REPO,
    analyse_both,
    analyse_recorded,
    batches,
    pseudo_labelled,
    randomize,
    variant_executors,
    variant_metrics,
)


@pytest.mark.parametrize("config_name", ["digits_resnet.yaml", "digits_mobilenet.yaml"])
def test_demo_models_fast_equals_reference(config_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(Path("configs/demo") / config_name, ["Global.max_samples=200"]).Global
    loader = build_eval_loader(config, torch.device("cpu"))
    assert apply_data_cache(loader, "ram", None, progress=False)
    reference, fast = analyse_both(build_model(config), loader, tmp_path, pruned_ratios=(0.2, 0.4))
    assert variant_metrics(fast) == variant_metrics(reference)
    assert len(variant_metrics(fast)) >= 2 * 15


@pytest.mark.parametrize(
    ("name", "prune_every"),
    [("resnet18", 1), ("mobilenet_v2", 1), ("densenet121", 10)],
)
def test_torchvision_fast_equals_reference(name: str, prune_every: int, tmp_path: Path) -> None:
    model = randomize(torchvision.models.get_model(name, num_classes=10))
    data = pseudo_labelled(model, batches(count=2, size=4, resolution=32))
    prunable = [p.name for p in find_prunable(model, data[0][0]) if p.prunable]
    chosen = prunable[::prune_every]  # densenet121: every 10th of its 120 convs, across all dense blocks
    reference, fast = analyse_both(model, data, tmp_path, pruned_ratios=(0.3, 0.6), metric="ce", prune_params=chosen)
    assert variant_metrics(fast) == variant_metrics(reference)


def test_untraceable_model_falls_back_to_the_reference_engine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = randomize(engine_models.data_dependent())
    data = pseudo_labelled(model, batches(count=1))
    with caplog.at_level(logging.INFO, logger="analysis"):
        analyse_both(model, data, tmp_path, pruned_ratios=(0.5,), metric="ce", fast_path=False)
    assert "torch.fx cannot trace this model" in caplog.text


def test_a_split_that_differs_from_eager_execution_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = analysis.engine.partition.GraphRunner.run_suffix

    def off_by_a_little(self, plan, frontier):  # a wrong graph split: logits off by one ulp-ish amount
        return original(self, plan, frontier) + 1e-6

    monkeypatch.setattr(analysis.engine.partition.GraphRunner, "run_suffix", off_by_a_little)
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=2))
    with caplog.at_level(logging.INFO, logger="analysis"):
        analyse_both(model, data, tmp_path, pruned_ratios=(0.25, 0.5), metric="ce", fast_path=False)
    assert caplog.text.count("the graph split differs from eager execution") == 3


def test_a_unit_the_suffix_cannot_run_is_evaluated_eagerly_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=2))
    first_conv = next(name for name, m in model.named_modules() if isinstance(m, nn.Conv2d))
    original = analysis.engine.partition.GraphRunner.plan

    def refuse_the_first_conv(self, modules, parameters):  # as for layers that do not reach the output
        modules = list(modules)
        return None if model.get_submodule(first_conv) in modules else original(self, modules, parameters)

    monkeypatch.setattr(analysis.engine.partition.GraphRunner, "plan", refuse_the_first_conv)
    with caplog.at_level(logging.INFO, logger="analysis"):
        report = analyse_recorded(model, data, tmp_path / "s.pkl", pruned_ratios=(0.25, 0.5), metric="ce")
    executors = variant_executors(report)
    eager = {key for key, executor in executors.items() if executor is Executor.EAGER}
    assert eager == {(f"{first_conv}.weight", 0.25), (f"{first_conv}.weight", 0.5)}
    assert Executor.FX_SUFFIX in executors.values()  # the other units ran on the suffix
    lines = [r.getMessage() for r in caplog.records if "evaluated with full forward passes" in r.getMessage()]
    assert lines == [
        f"{first_conv}.weight: evaluated with full forward passes (the fast engine's suffix cannot run it: the layers "
        "it changes do not reach the model's output in the traced graph); the numbers are the same, only slower."
    ]


def test_engine_is_validated(tmp_path: Path) -> None:
    from analysis.errors import ConfigError

    with pytest.raises(ConfigError, match=r"engine must be one of fast, reference, got 'turbo'"):
        analysis_prune(nn.Linear(1, 1), [], tmp_path / "s.pkl", engine="turbo")


class OptionalScale(nn.Module):
    """A CNN whose forward takes an optional argument and branches on it, as timm's ``forward(x, attn_mask=None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())  # fmt: skip
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = self.features(x)
        if scale is not None:
            x = x * scale
        return self.fc(x.mean(dim=(2, 3)))


def test_a_forward_with_optional_arguments_runs_on_the_fast_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = randomize(OptionalScale())
    data = pseudo_labelled(model, batches(count=2))
    with caplog.at_level(logging.INFO, logger="analysis"):
        analyse_both(model, data, tmp_path, pruned_ratios=(0.25, 0.5), metric="ce")  # every variant on the fast path
    assert "cannot trace" not in caplog.text and "differs from eager" not in caplog.text

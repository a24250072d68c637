"""The terminal table: its heading says what the numbers are, relative or absolute losses."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.engine.run import AnalysisOutcome
from analysis.engine.sensitivity import EngineReport
from analysis.reporting.summary import format_table
from analysis.structure.groups import PrunableUnit

TINY_MODELS = Path(__file__).resolve().parent / "tiny_models.py"


def outcome(path: Path) -> AnalysisOutcome:
    param = PrunableUnit("conv.weight", "conv", (8, 3, 3, 3), members=["conv (Conv2d, out)"])
    losses = {"conv.weight": {0.25: 0.125, 0.5: -0.25}}
    return AnalysisOutcome(path, losses, [param], [param], EngineReport(baseline={"top1": 0.8}))


def heading(table: str) -> str:
    return table.splitlines()[0]


def test_relative_losses_are_called_relative(tmp_path: Path) -> None:
    table = format_table(outcome(tmp_path / "s.pkl"), [0.25, 0.5], "top1", "relative")
    assert heading(table).startswith("relative top1 loss per pruned ratio")
    assert "+0.1250  -0.2500" in table


@pytest.mark.parametrize(
    ("metric", "difference"), [("top1", "baseline top1 - pruned top1"), ("ce", "pruned ce - baseline ce")]
)
def test_absolute_losses_are_called_absolute_with_their_difference(
    metric: str, difference: str, tmp_path: Path
) -> None:
    table = format_table(outcome(tmp_path / "s.pkl"), [0.25, 0.5], metric, "absolute")
    assert heading(table).startswith(f"absolute {metric} loss ({difference}) per pruned ratio")
    assert "relative" not in table


def test_a_run_with_metric_mode_absolute_prints_absolute(
    cli: Callable[..., Any], tmp_path: Path, list_data: Path
) -> None:
    config: dict[str, Any] = {
        "Global": {"arch": f"{TINY_MODELS}:tiny_cnn", "arch_kwargs": {"num_classes": 10}, "data_dir": str(list_data),
                   "batch_size": 8, "img_size": 16, "resize_size": 16, "num_workers": 0, "device": "cpu"},
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5],
                                "metric_mode": "absolute", "report": False},
    }  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli("--config_path", os.fspath(path), "--quiet")
    assert result.code == 0, result.err
    assert "absolute top1 loss (baseline top1 - pruned top1) per pruned ratio" in result.out
    assert "relative top1 loss" not in result.out

"""The metric descriptions: every step reads a metric's facts from :mod:`analysis.metrics`, so one entry changes all."""

from __future__ import annotations

import pytest
import torch

from analysis.config import SensitivityConfig, validate_section
from analysis.engine.loss import divides_by_baseline, relative_loss
from analysis.engine.samplers import PairedBaseline
from analysis.errors import ConfigError
from analysis.io.search_log import JointScore
from analysis.metrics import LABEL_FREE_METRICS, METRIC_NAMES, METRICS, Metric
from analysis.planning.measured import Scored
from analysis.reporting._format import LABEL_FREE_LOSSES, loss_difference


@pytest.mark.parametrize("name", list(METRICS))
def test_losses_follow_the_metric_direction_and_scaling(name: str) -> None:
    metric = METRICS[name]
    worse = 0.5 if metric.higher_is_better else 1.1
    loss = relative_loss(0.8, worse, name, "relative")
    assert loss > 0  # worse in the metric's own direction is a positive loss
    assert loss == pytest.approx(0.3 / 0.8 if metric.scaled else 0.3)
    assert relative_loss(0.8, worse, name, "absolute") == pytest.approx(0.3)
    assert divides_by_baseline(name, "relative") is metric.scaled
    assert loss_difference(name).startswith("baseline" if metric.higher_is_better else "pruned")


def test_the_yaml_offers_the_user_metrics_and_refuses_the_others() -> None:
    assert METRIC_NAMES == ("top1", "top5", "ce", "agreement", "kl")
    assert LABEL_FREE_METRICS == ("agreement", "kl")
    assert set(LABEL_FREE_LOSSES) == set(LABEL_FREE_METRICS)
    for name in METRIC_NAMES:
        validate_section(SensitivityConfig(metric=name, analysis_file="s.pkl"), "S.")
    with pytest.raises(ConfigError, match=r"S\.metric"):
        validate_section(
            SensitivityConfig(metric="score", analysis_file="s.pkl"), "S."
        )  # NNI's evaluator score: Python API only


def test_a_new_metric_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric added to the registry gets its direction and scaling in the loss and its ranking in the measured
    plan's final choice, with no other change."""
    added = Metric("top3", higher_is_better=True, bounded=True, ranked_by="top3")
    monkeypatch.setitem(METRICS, "top3", added)
    assert relative_loss(0.5, 0.25, "top3") == pytest.approx(0.5)
    assert relative_loss(0.5, 0.25, "top3", "absolute") == pytest.approx(0.25)
    scores = [JointScore({"top3": value, "ce": 1.0}, 0, 0, 0.0) for value in (0.2, 0.6)]
    ranked = [Scored(str(i), {}, score, added) for i, score in enumerate(scores)]
    assert max(ranked, key=lambda s: s.final_key).name == "1"


@pytest.mark.parametrize(("name", "best"), [("top1", "a"), ("top5", "b"), ("ce", "c")])
def test_the_measured_plan_ranks_finalists_by_the_analysis_metric(name: str, best: str) -> None:
    """Three finalists, each best on one metric: the one chosen is the best on the analysis's metric."""
    finalists = {
        "a": {"top1": 0.9, "top5": 0.95, "ce": 0.50},
        "b": {"top1": 0.8, "top5": 0.99, "ce": 0.45},
        "c": {"top1": 0.7, "top5": 0.90, "ce": 0.30},
    }
    metric = METRICS[METRICS[name].ranked_by]
    scored = [Scored(key, {}, JointScore(values, 0, 0, 0.0), metric) for key, values in finalists.items()]
    assert max(scored, key=lambda s: s.final_key).name == best


def test_paired_differences_are_positive_when_the_variant_is_worse() -> None:
    labels = torch.tensor([0, 1])
    logits = torch.tensor([[0.0, 5.0], [0.0, 5.0]])  # predicts class 1 for both: first image wrong, second right
    for name in ("top1", "ce"):
        paired = PairedBaseline(torch.arange(2), name)
        paired.per_image = {"top1": torch.tensor([1.0, 1.0], dtype=torch.float64),
                            "ce": torch.tensor([0.0, 0.0], dtype=torch.float64)}  # fmt: skip
        worse = paired.worse_by(logits, labels, torch.arange(2))
        assert float(worse[0]) > 0  # the variant is worse than the baseline on the first image
        assert float(worse[1]) >= 0 if name == "ce" else float(worse[1]) == 0

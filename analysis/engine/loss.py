"""From metrics to losses: the loss definition, and the checks that keep a meaningless number out of the file."""

from __future__ import annotations

import math
from collections.abc import Mapping

from analysis.errors import UserError
from analysis.metrics import metric_named


def divides_by_baseline(metric: str, mode: str) -> bool:
    """Whether the loss of ``metric`` in ``mode`` is divided by the baseline (relative mode, except for metrics
    whose baseline is 0 by definition, see :attr:`analysis.metrics.Metric.scaled`)."""
    return metric_named(metric).divides_by_baseline(mode)


def check_baseline(baseline: float, metric: str, mode: str = "relative") -> None:
    """Refuse a baseline from which relative losses cannot be computed.

    Raises:
        UserError: If the loss divides by the baseline (see :func:`divides_by_baseline`) and it is 0.
    """
    if divides_by_baseline(metric, mode) and baseline == 0:
        raise UserError(
            f"The baseline {metric} is 0, so a relative loss is undefined (the model looks untrained or the labels "
            "do not match it); check the model and data, or set SensitivityAnalysis.metric_mode: absolute."
        )


def relative_loss(baseline: float, value: float, metric: str, mode: str = "relative") -> float:
    """Loss of ``value`` against ``baseline``: positive when pruning made the metric worse.

    ``relative`` divides by the baseline (PaddleSlim's definition); ``absolute`` keeps the plain difference. For
    ``kl`` (baseline 0) both are the divergence itself, see :attr:`analysis.metrics.Metric.scaled`.
    """
    worse_by = metric_named(metric).worse_by(baseline, value)
    if not divides_by_baseline(metric, mode):
        return worse_by
    check_baseline(baseline, metric, mode)
    return worse_by / abs(baseline)


def check_finite(metrics: Mapping[str, float], what: str) -> None:
    """Refuse NaN/inf metrics, which would make every loss meaningless."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise UserError(
            f"The {what} produced non-finite {', '.join(bad)} (NaN/inf logits); check the model's weights and input "
            "preprocessing (Global.mean/std) before analysing it."
        )


def without_timing(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics of an unchanged model (a ratio that removes no channel): the baseline without its timing."""
    return {k: v for k, v in metrics.items() if k != "seconds"}


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``top1=0.9867 top5=1.0000 ce=0.0934 agreement=1.0000`` (the metrics present, in that order)."""
    names = ("top1", "top5", "ce", "agreement", "kl", "score")
    return " ".join(f"{k}={metrics[k]:.4f}" for k in names if k in metrics)

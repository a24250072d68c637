"""From metrics to losses: the loss definition, and the checks that keep a meaningless number out of the file."""

from __future__ import annotations

import math
from collections.abc import Mapping

from analysis.errors import UserError

LOWER_IS_BETTER = {"ce", "kl"}
# KL(p_dense || p_pruned) is 0 for the dense model by definition, so a loss relative to the baseline would divide by
# zero for every model, not only a broken one. Refusing the default metric_mode (relative) would make every kl run
# set metric_mode: absolute for nothing; instead both modes record the divergence itself, which already is measured
# from the dense model (in nats; 0 = the dense model's predictions exactly), as a relative loss is.
UNSCALED = {"kl"}


def divides_by_baseline(metric: str, mode: str) -> bool:
    """Whether the loss of ``metric`` in ``mode`` is divided by the baseline (relative mode, except for
    :data:`UNSCALED` metrics, whose baseline is 0 by definition)."""
    return mode == "relative" and metric not in UNSCALED


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
    ``kl`` (baseline 0) both are the divergence itself, see :data:`UNSCALED`.
    """
    worse_by = value - baseline if metric in LOWER_IS_BETTER else baseline - value
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

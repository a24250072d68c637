"""How a loss reads in the report and the terminal table (the number formats are :mod:`analysis.text`)."""

from __future__ import annotations

from analysis.metrics import METRICS


def loss_difference(metric: str) -> str:
    """What a loss subtracts, worse when positive: ``baseline top1 - pruned top1`` (``pruned ce - baseline ce``)."""
    if metric in METRICS and not METRICS[metric].higher_is_better:
        return f"pruned {metric} - baseline {metric}"
    return f"baseline {metric} - pruned {metric}"


LABEL_FREE_LOSSES = {name: metric.meaning for name, metric in METRICS.items() if metric.label_free}
"""The loss of each label-free metric, the same in both metric modes (the unpruned model's baseline is 1 and 0)."""

"""How a loss reads in the report and the terminal table (the number formats are :mod:`analysis.text`)."""

from __future__ import annotations

from analysis.engine.loss import LOWER_IS_BETTER


def loss_difference(metric: str) -> str:
    """What a loss subtracts, worse when positive: ``baseline top1 - pruned top1`` (``pruned ce - baseline ce``)."""
    if metric in LOWER_IS_BETTER:
        return f"pruned {metric} - baseline {metric}"
    return f"baseline {metric} - pruned {metric}"


LABEL_FREE_LOSSES = {
    "agreement": "1 - agreement: the share of images whose top-1 class differs from the unpruned model's",
    "kl": "mean KL(p_unpruned || p_pruned) in nats over the images",
}
"""The loss of each label-free metric, the same in both metric modes (the unpruned model's baseline is 1 and 0)."""

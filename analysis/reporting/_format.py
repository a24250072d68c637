"""Number and loss formatting shared by the report, the terminal table and the ratios YAML (``-`` for a missing
value)."""

from __future__ import annotations

from analysis.engine.loss import LOWER_IS_BETTER


def fixed(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec`` (``0.9867``)."""
    return "-" if value is None else format(value, spec)


def percent(fraction: float | None, spec: str = ".2f") -> str:
    """A fraction as a percentage: ``0.4`` -> ``40.00%``; with a ``g`` spec a whole number keeps one decimal
    (``0.02`` -> ``2.0%``)."""
    if fraction is None:
        return "-"
    text = format(100.0 * fraction, spec)
    return f"{text}.0%" if text.lstrip("-").isdigit() else f"{text}%"


def count(value: float | None) -> str:
    """A count with a unit and its exact value: ``1.8M (1,803,600)``, ``512``."""
    if value is None:
        return "-"
    number = float(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= limit:
            return f"{number / limit:.3g}{suffix} ({int(number):,})"
    return f"{int(number):,}"


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

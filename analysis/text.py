"""Number formats and the sentence that explains ``target_loss``: shared by every layer that writes text for a
user (the ratios YAML, logs, the terminal table, the report); ``-`` stands for a missing value."""

from __future__ import annotations


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


def explain_target_loss(loss: float) -> str:
    """Return one line saying what ``target_loss`` means, for logs and the ratios YAML header."""
    within = percent(loss, ".4g")
    return (
        f"target_loss {loss:g}: each layer gets the largest ratio whose own measured loss stays <= {within} "
        "when it alone is pruned; losses of several pruned layers are not additive, so verify the combined model."
    )

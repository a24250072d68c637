"""The plain-text table printed at the end of a run: losses per ratio, derived ratios, unprunable units."""

from __future__ import annotations

from collections.abc import Sequence

from analysis.engine.run import AnalysisOutcome
from analysis.reporting._format import LABEL_FREE_LOSSES, loss_difference


def format_table(outcome: AnalysisOutcome, ratios: Sequence[float], metric: str, metric_mode: str) -> str:
    """Render one row per analysed param (model order) and, below, the units that were not analysed.

    The heading says what the numbers are: the ``relative`` loss (the metric's drop over its baseline) or, with
    ``metric_mode: absolute``, the plain difference.
    """
    derived = outcome.ratios
    header = ["param", "shape", "group"] + [f"{r:g}" for r in ratios] + (["ratio"] if derived else [])
    rows = []
    for param in outcome.analysed:
        curve = outcome.sensitivities.get(param.name, {})
        stopped_at = outcome.early_stopped.get(param.name)
        estimated = outcome.estimated.get(param.name, set())
        cells = [param.name, "x".join(map(str, param.shape)), str(len(param.members))]
        cells += [
            ("~" if r in estimated else "") + f"{curve[r]:+.4f}" if r in curve
            else "stop" if stopped_at is not None and r > stopped_at else "-"
            for r in ratios
        ]  # fmt: skip
        if derived:
            cells.append(f"{derived[param.name]:.4f}" if param.name in derived else "-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    align = ["<", "<", ">"] + [">"] * (len(header) - 3)
    if metric in LABEL_FREE_LOSSES:
        loss = f"{metric} loss ({LABEL_FREE_LOSSES[metric]})"
    elif metric_mode == "absolute":
        loss = f"absolute {metric} loss ({loss_difference(metric)})"
    else:
        loss = f"relative {metric} loss"
    lines = [f"{loss} per pruned ratio ('group' = layers whose channels go with the unit's):"]
    if outcome.early_stopped:
        lines[0] += " ('stop' = skipped after an early stop, or above a ratio settled above target_loss)"
    if outcome.estimated:
        lines[0] += " ('~' = estimated on part of the images, see the sidecar's interval)"
    for row in [header, *rows]:
        lines.append("  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)))
    notice = outcome.numerics.notice() if outcome.numerics is not None else None
    if notice:
        lines.append(f"{notice[0].upper()}{notice[1:]}.")
    unprunable = outcome.unprunable
    if unprunable:
        lines.append(f"not analysed ({len(unprunable)}):")
        lines.extend(f"  {name}: {reason}" for name, reason in unprunable.items())
    return "\n".join(lines)

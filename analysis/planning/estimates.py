"""Whether a plan rests on estimated losses (adaptive precision, decision-driven sampling), and how to say so.

A budget plan reads every param's whole loss curve; an analysis made with ``precision`` holds losses known only to
within an interval, and one made with ``precision: decision`` holds losses known only to lie above or below its
``target_loss``, with the ratios above the first one settled above it not evaluated at all (a plan cannot choose
them). Such a plan's predicted loss is approximate, so the plan says so and recommends measuring it.
"""

from __future__ import annotations

from analysis.io.record import AnalysisSource, as_record


def estimate_notice(analysis: AnalysisSource) -> str | None:
    """One sentence on the estimated losses and skipped ratios of the analysis (a record, or a file to read; None:
    every loss is exact)."""
    record = as_record(analysis)
    if record.sidecar is None:
        return None
    variants = [variant for _, _, variant in record.variants()]
    estimated = sum(variant.estimated for variant in variants)
    decision = record.settings.decision
    skipped = sum(param.early_stop is not None for param in record.params.values())
    parts = []
    if estimated:
        how = (
            f"decision-driven sampling settled each only as above or below target_loss {decision[0]:g}"
            if decision
            else "adaptive precision knows each within its interval"
        )
        parts.append(f"{estimated} of {len(variants)} losses in {record.path.name} are estimates ({how})")
    if decision and skipped:
        parts.append(
            f"{skipped} param(s) lack the ratios above one settled above target_loss {decision[0]:g} (not evaluated "
            "by decision-driven sampling), which the plan cannot choose"
        )
    return "; ".join(parts) + ", so the plan's predicted loss is approximate" if parts else None

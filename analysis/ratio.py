"""The one rule for a pruning ratio: where it may lie and how it is stored (rounded to :data:`RATIO_DECIMALS`
decimals, so 0.3 and 0.30000000000000004 are one key). The config, the analysis file, ratios YAMLs and plans all
check and round ratios here."""

from __future__ import annotations

import math

RATIO_DECIMALS = 6
"""Decimals a ratio is stored with."""


def normalise_ratio(ratio: float) -> float:
    """``ratio`` rounded to :data:`RATIO_DECIMALS` decimals, the key it is stored under."""
    return round(float(ratio), RATIO_DECIMALS)


def ratio_problem(value: float, *, zero_allowed: bool) -> str | None:
    """Why ``value`` is not a usable ratio (None: it is): it must lie in (0, 1), or [0, 1) with ``zero_allowed``
    (a plan's unit left unpruned), and stay there once rounded to the stored decimals (1e-7 would become 0.0)."""
    low_ok = value >= 0.0 if zero_allowed else value > 0.0
    if not (low_ok and value < 1.0 and math.isfinite(value)):
        return f"{value} is outside {'[0, 1)' if zero_allowed else '(0, 1)'}"
    stored = normalise_ratio(value)
    if stored >= 1.0 or (not zero_allowed and stored <= 0.0):
        return f"{value} rounds to {stored} at the {RATIO_DECIMALS} decimals ratios are stored with"
    return None

"""Loss curves for planning: measured (channels removed, loss) points made non-decreasing, and read between points.

A sensitivity curve is measured, so it is noisy: removing more channels can measure a smaller loss than removing
fewer (a lucky evaluation), or a negative loss. A planner that believed such a dip would prune more to gain
accuracy. Planning therefore uses each curve's least-squares non-decreasing fit (isotonic regression by pooling
adjacent violators, every point weighted equally), floored at 0 because removing nothing loses nothing: the
bounded isotonic fit is the unbounded one clipped at the bound. The analysis file keeps the raw measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

Point = tuple[float, float]


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled block
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return fitted


def monotone_curve(points: Sequence[Point]) -> list[Point]:
    """The planning curve of measured ``(count, loss)`` points (any order; points at count 0 are dropped, equal
    counts averaged): ``(0, 0)`` followed by the points' isotonic fit, floored at 0, sorted by count."""
    by_count: dict[float, list[float]] = {}
    for count, loss in points:
        if count > 0:
            by_count.setdefault(float(count), []).append(float(loss))
    ordered = [(count, sum(losses) / len(losses)) for count, losses in sorted(by_count.items())]
    fitted = isotonic([loss for _, loss in ordered])
    return [(0.0, 0.0), *[(count, max(0.0, loss)) for (count, _), loss in zip(ordered, fitted, strict=True)]]


def interpolate(points: Sequence[Point], x: float) -> float:
    """Piecewise-linear value at ``x`` through ``points`` (sorted by x); never extrapolates past the last point.

    Raises:
        ValueError: If ``x`` lies outside the points' range.
    """
    if not points or x < points[0][0] or x > points[-1][0]:
        raise ValueError(f"{x} is outside the measured range")
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]

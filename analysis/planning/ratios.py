"""PaddleSlim's ``target_loss`` rule: per layer, the largest ratio whose measured loss stays under the target.

It follows PaddleSlim's ``get_ratios_by_loss`` exactly, so the same analysis file gives the same ratios in both
tools. A MACs or params budget is met by :func:`analysis.planning.allocate.allocate` instead; both results are
written as an ACT ``ChannelPrune`` block by :mod:`analysis.io.ratios_yaml`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetRatios:
    """A ``target_loss`` and the ratios PaddleSlim's rule derives from it: derived once, read by the loss table and
    the plots alike."""

    loss: float
    ratios: dict[str, float]

    @classmethod
    def derive(cls, sensitivities: Mapping[str, Mapping[float, float]], loss: float) -> TargetRatios:
        """Apply :func:`get_ratios_by_loss` to ``sensitivities``."""
        return cls(loss, get_ratios_by_loss(sensitivities, loss))


def get_ratios_by_loss(sensitivities: Mapping[str, Mapping[float, float]], loss: float) -> dict[str, float]:
    """Return, per parameter, the largest pruning ratio whose own measured loss stays within ``loss``.

    PaddleSlim's rule: sort a parameter's (ratio, loss) points by ratio and scan from the largest ratio down; the
    first point with loss <= ``loss`` wins. If it is the largest ratio, that ratio is the answer; otherwise the
    answer is interpolated linearly between it and the next larger ratio (whose loss exceeds the target, so the
    answer lies between the two). When no point qualifies the answer is 0.0 (do not prune).

    Args:
        sensitivities: ``{param: {ratio: relative loss}}`` as stored in an analysis file.
        loss: The target relative loss, e.g. 0.02 for 2%.

    Returns:
        ``{param: ratio}`` in the input's parameter order; parameters without any measured point are left out.

    Raises:
        ValueError: ``loss`` is not a finite number.
    """
    if not math.isfinite(loss):
        raise ValueError(f"target loss must be a finite number, got {loss!r}")
    ratios: dict[str, float] = {}
    for param, curve in sensitivities.items():
        points = sorted((float(ratio), float(value)) for ratio, value in curve.items())
        if not points:
            logger.debug("%s has no measured ratios; it gets no pruning ratio.", param)
            continue
        ratios[param] = _ratio_for(points, loss)
    return ratios


def _ratio_for(points: list[tuple[float, float]], target: float) -> float:
    """Apply the scan-down-and-interpolate rule to one parameter's points, sorted by ratio."""
    last = len(points) - 1
    for index in range(last, -1, -1):
        r0, l0 = points[index]
        if l0 <= target:
            if index == last:
                return r0
            # The next larger point failed (l1 > target >= l0), so l1 - l0 > 0 and the result lies in [r0, r1).
            r1, l1 = points[index + 1]
            return r0 + (target - l0) * (r1 - r0) / (l1 - l0)
    return 0.0

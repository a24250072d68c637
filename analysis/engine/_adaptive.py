"""Adaptive precision: stop evaluating a variant once its loss is known to within ``+-precision`` (95%).

Every variant sees the images in the same seeded random order as a baseline pass over the whole set, so the loss is
estimated from paired per-image differences (variant vs baseline on the same image), which vary far less than the
metric itself. The standard error includes the finite-population correction (the images are drawn without
replacement from a fixed set, so after the last image the interval has zero width and the loss is exact).

For accuracies the per-image difference is -1, 0 or +1; its variance is estimated with half a pseudo-count added
to the two non-zero outcomes (a Jeffreys-style prior), so that a variant that happens to agree with the baseline on
its first images does not get a zero-width interval and stop at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Z_95 = 1.959963984540054
MIN_SAMPLES = 200
PSEUDO_COUNT = 0.5


def per_sample(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-image top1/top5 correctness (0/1, float64) and cross-entropy (float64)."""
    k = min(5, logits.shape[1])
    hits = logits.topk(k, dim=1).indices.eq(labels.unsqueeze(1))
    ce = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    return {"top1": hits[:, 0].double().cpu(), "top5": hits.any(dim=1).double().cpu(), "ce": ce.double().cpu()}


@dataclass
class PairedEstimate:
    """Running paired differences ``worse_by = baseline - variant`` (``variant - baseline`` for ``ce``).

    Args:
        population: Number of images in the whole evaluation set.
        baseline: The baseline metric over the whole set (the loss's denominator in relative mode).
        relative: Relative loss (divide by the baseline) or absolute difference.
        discrete: The per-image metric is 0/1 (accuracies), which enables the pseudo-count variance.
        z: Normal quantile of the interval (95% two-sided by default; decision-driven sampling sets its own).
    """

    population: int
    baseline: float
    relative: bool = True
    discrete: bool = True
    z: float = Z_95
    count: int = 0
    total: float = 0.0
    total_squares: float = 0.0
    worse: int = 0
    better: int = 0

    def add(self, worse_by: torch.Tensor) -> None:
        """Add a batch of per-image differences."""
        values = worse_by.double()
        self.count += int(values.numel())
        self.total += float(values.sum())
        self.total_squares += float((values * values).sum())
        self.worse += int((values > 0).sum())
        self.better += int((values < 0).sum())

    @property
    def scale(self) -> float:
        """Divides differences into losses."""
        return abs(self.baseline) if self.relative else 1.0

    def loss(self) -> float:
        """Estimated loss: the mean difference so far, scaled."""
        return self.total / self.count / self.scale if self.count else math.nan

    def half_width(self, z: float | None = None) -> float:
        """Confidence half-width of :meth:`loss` (at ``z``, by default :attr:`z`: 95% unless set otherwise), with the
        finite-population correction."""
        n = self.count
        if n < 2:
            return math.inf
        if self.discrete:
            up = (self.worse + PSEUDO_COUNT) / (n + 2 * PSEUDO_COUNT)
            down = (self.better + PSEUDO_COUNT) / (n + 2 * PSEUDO_COUNT)
            variance = up + down - (up - down) ** 2
        else:
            mean = self.total / n
            variance = max(0.0, (self.total_squares - n * mean * mean) / (n - 1))
        correction = max(0.0, 1.0 - n / self.population)
        return (self.z if z is None else z) * math.sqrt(variance / n * correction) / self.scale

    def interval(self) -> tuple[float, float]:
        """The interval of the loss (see :meth:`half_width`)."""
        centre, width = self.loss(), self.half_width()
        return centre - width, centre + width

    def precise_enough(self, precision: float) -> bool:
        """True once enough images were seen and the 95% interval is within ``+-precision`` (or the set is done),
        whatever :attr:`z` the interval of a decision uses."""
        if self.count >= self.population:
            return True
        return self.count >= min(MIN_SAMPLES, self.population) and self.half_width(Z_95) <= precision

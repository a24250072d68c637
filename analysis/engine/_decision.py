"""Decision-driven sampling: evaluate a variant only until it is known on which side of ``target_loss`` it falls.

A variant sees the images in the same seeded random order as adaptive precision (paired with the baseline, see
:mod:`analysis.engine._adaptive`). At a few *looks* (after 200 images, then every time the count grew by half) its
interval is compared with the target: entirely above settles it ``above``, entirely below settles it ``below``.
After the last image the loss is exact (the interval has zero width), so an unsettled variant ends ``exact``.

**Error control.** A decision is wrong when the side it settles on differs from the side of the loss on the whole
set. The interval is one-sided at level ``error / (variants * looks)``: each look of each variant can settle it on
the wrong side with probability at most that, so by Bonferroni's inequality the chance that *any* decision of the
run is wrong is at most ``error`` (``variants``: every variant of the analysis, whichever rank or resume evaluates
it, so resumed and sharded runs decide alike). The interval is the normal approximation with the finite-population
correction; the simulation in ``tests/test_decision.py`` checks the rate.

**What is skipped and what is made exact.** PaddleSlim's rule reads, per param, the largest ratio whose loss is at
most the target and interpolates to the next ratio. Assuming the loss does not fall as the ratio grows (monotone),
the ratios above the smallest one settled ``above`` cannot change the rule's answer and are not evaluated. The two
variants the rule interpolates between (the largest ``below`` and the smallest ``above``) are completed on the whole
set, so the derived ratio equals the exact run's and the smallest ``above``, the ratio that decided the skip, is
checked on every image; if the whole set puts either on the other side, the scan goes on from there. With
``precision`` also set, a variant also stops once its loss is known within ``+-precision`` (``precise``), and the two
interpolated variants stop there too instead of running to the end.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from analysis.engine._adaptive import MIN_SAMPLES, PairedEstimate

LOOK_GROWTH = 1.5
"""Each look after the first comes once the images seen grew by this factor."""

LOG_TWO_PI = math.log(2.0 * math.pi)
"""``log(2 pi)``, of the normal density's constant."""

SETTLED = ("above", "below", "exact", "precise")
"""How a decision-driven variant ended: settled on one side, evaluated on every image, or within the precision."""


def look_schedule(population: int, first: int = MIN_SAMPLES, growth: float = LOOK_GROWTH) -> tuple[int, ...]:
    """Image counts at which a variant may settle: ``first``, then ``growth`` times the previous, below the
    ``population`` (after the last image the loss is exact, no look is needed)."""
    looks: list[int] = []
    count = first
    while count < population:
        looks.append(count)
        count = math.ceil(count * growth)
    return tuple(looks)


def upper_quantile(error: float, tests: int) -> float:
    """The ``z`` with ``P(Z > z) = error / tests`` for a standard normal ``Z``, accurate for every ``error`` in (0, 1).

    ``1 - error / tests`` loses the tail's digits and rounds to 1 below about 1e-16, so the quantile is taken of
    the tail itself: ``NormalDist.inv_cdf`` keeps full precision down to the smallest float there. Below the normal
    floats (about 1e-308) the quotient loses its digits or underflows to 0, so there the equation is solved in
    logarithms (Newton's method on the log tail, which the asymptotic expansion gives to full precision at such ``z``).
    """
    tail = error / tests
    if tail >= sys.float_info.min:
        return -NormalDist().inv_cdf(tail)
    log_tail = math.log(error) - math.log(tests)
    twice = -2.0 * log_tail
    z = math.sqrt(twice - math.log(twice) - LOG_TWO_PI)  # the expansion's leading terms: within 0.05 here
    for _ in range(20):
        series = _mills_series(z)
        log_upper = -0.5 * z * z - math.log(z) - 0.5 * LOG_TWO_PI + math.log(series)
        step = (log_upper - log_tail) * series / z  # d(log tail)/dz = -z / series
        z += step
        if abs(step) <= 1e-15 * z:
            break
    return z


def _mills_series(z: float) -> float:
    """``P(Z > z) * z / phi(z)`` for large ``z``: the asymptotic series ``1 - 1/z^2 + 3/z^4 - 15/z^6 + ...``, summed
    while its terms shrink (beyond ``z = 37``, where it is used, the first dozen give every digit of a float)."""
    total, term, k = 1.0, 1.0, 1
    while True:
        following = -term * (2 * k - 1) / (z * z)
        if abs(following) >= abs(term) or abs(following) < 1e-17 * total:
            return total
        total += following
        term, k = following, k + 1


@dataclass(frozen=True)
class DecisionRule:
    """When a variant settles: the target, the one-sided normal quantile every look uses, and the looks.

    Attributes:
        target: ``target_loss``.
        z: Quantile of the one-sided interval (from the error split over variants and looks).
        looks: Image counts at which a variant may settle.
        precision: Also stop a variant once its loss is known within +- this (None: only settle or run to the end).
    """

    target: float
    z: float
    looks: tuple[int, ...]
    precision: float | None = None

    @classmethod
    def build(
        cls, target: float, error: float, population: int, variants: int, precision: float | None = None
    ) -> DecisionRule:
        """The rule whose decisions are all right with probability at least ``1 - error`` (see the module doc).

        Args:
            target: ``target_loss``.
            error: Chance that any decision of the run lands on the wrong side.
            population: Images in the evaluation set.
            variants: Variants the error is split over (every variant of the analysis).
            precision: See :attr:`precision`.
        """
        looks = look_schedule(population)
        tests = max(1, variants) * max(1, len(looks))
        return cls(target, upper_quantile(error, tests), looks, precision)


@dataclass(eq=False)
class Candidate:
    """One variant under decision: its running paired estimate (built with the rule's ``z``), its side once settled,
    and the loss on the whole set once every image was seen (set by the engine from the variant's own metrics, so it
    is the exact run's number bit for bit)."""

    ratio: float
    estimate: PairedEstimate
    side: str | None = None
    exact_loss: float | None = None
    looks_taken: int = 0

    @property
    def count(self) -> int:
        """Images seen so far."""
        return self.estimate.count

    @property
    def exact(self) -> bool:
        """Whether every image was seen."""
        return self.estimate.count >= self.estimate.population

    def loss(self) -> float:
        """The exact loss once every image was seen, else the estimate."""
        if self.exact and self.exact_loss is not None:
            return self.exact_loss
        return self.estimate.loss()

    def look(self, rule: DecisionRule) -> None:
        """Settle the side if a look is due and the interval lies entirely on one side of the target."""
        due = False
        while self.looks_taken < len(rule.looks) and self.count >= rule.looks[self.looks_taken]:
            self.looks_taken += 1
            due = True
        if not due or self.side is not None or self.exact:
            return
        low, high = self.estimate.interval()
        if low > rule.target:
            self.side = "above"
        elif high < rule.target:
            self.side = "below"

    def precise(self, rule: DecisionRule) -> bool:
        """Whether the loss is known within the rule's precision (never without one)."""
        return rule.precision is not None and self.estimate.precise_enough(rule.precision)

    def settled(self) -> str:
        """``exact``, ``above``, ``below`` or ``precise``: what the sidecar records (ask once it stopped)."""
        if self.exact:
            return "exact"
        return self.side or "precise"

    def rule_side(self, rule: DecisionRule) -> str | None:
        """The side PaddleSlim's rule will read: exact, settled, or (stopped within the precision) the estimate's;
        None while undecided."""
        if self.exact:
            return "above" if self.loss() > rule.target else "below"
        if self.side is not None:
            return self.side
        if self.precise(rule):
            return "above" if self.loss() > rule.target else "below"
        return None


@dataclass
class ParamDecision:
    """The candidates of one param and which of them still need images.

    Args:
        rule: When variants settle.
        candidates: The param's variants being evaluated.
        recorded: Ratios of the param already in the analysis file, with the side of their recorded loss.
    """

    rule: DecisionRule
    candidates: list[Candidate]
    recorded: Mapping[float, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.candidates = sorted(self.candidates, key=lambda c: c.ratio)

    def look(self) -> None:
        """Let every candidate take a due look."""
        for candidate in self.candidates:
            candidate.look(self.rule)

    def smallest_above(self) -> float | None:
        """The smallest ratio decided above the target (recorded or evaluated); larger ratios are not needed."""
        sides = {**self.recorded, **{c.ratio: c.rule_side(self.rule) for c in self.candidates}}
        return min((r for r, side in sides.items() if side == "above"), default=None)

    def kept(self) -> list[Candidate]:
        """The candidates that end up in the file: none above the smallest ratio decided above."""
        bound = self.smallest_above()
        return [c for c in self.candidates if bound is None or c.ratio <= bound]

    def dropped(self) -> list[Candidate]:
        """The candidates skipped because a smaller ratio was decided above the target."""
        kept = self.kept()
        return [c for c in self.candidates if c not in kept]

    def needing(self) -> list[Candidate]:
        """The candidates that must see more images: undecided ones, and the two the rule interpolates between
        until they are exact (or within the precision)."""
        kept = self.kept()
        open_ = [c for c in kept if c.rule_side(self.rule) is None]
        if open_:
            return open_
        return [c for c in self._interpolated(kept) if not (c.exact or c.precise(self.rule))]

    def _interpolated(self, kept: Sequence[Candidate]) -> list[Candidate]:
        """The candidates among the pair PaddleSlim's rule interpolates between (the largest ratio on the
        ``below`` side and the next one), once every kept variant is decided."""
        by_ratio = {c.ratio: c for c in kept}
        sides = {**self.recorded, **{c.ratio: c.rule_side(self.rule) for c in kept}}
        ratios = sorted(sides)
        below = [i for i, r in enumerate(ratios) if sides[r] == "below"]
        if not below or below[-1] == len(ratios) - 1:
            return []  # the rule returns 0 or the largest ratio: no loss value enters it
        pair = ratios[below[-1]], ratios[below[-1] + 1]
        return [by_ratio[r] for r in pair if r in by_ratio]

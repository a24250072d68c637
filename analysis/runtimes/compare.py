"""Comparing a model with the dense model on a shared machine: every timing of the candidate sits between two
timings of the dense model (dense, candidate, dense, candidate, ..., dense), so each candidate timing has its own
reference taken just before and just after it. A machine that slows down or speeds up between them shows as dense
timings that disagree (the drift); the comparison is then taken again a bounded number of times, and a drift beyond
the tolerance in every try means the machine was too noisy to judge, which the caller must say rather than guess.

This is the one timing path of the latency table's probes, the latency plan's verdicts, ``verify`` and the
latency benchmark.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from analysis.runtimes.runtime import Prepared

ROUNDS = 3
"""Candidate timings of a verdict (each between two dense timings)."""
TRIES = 3
"""Comparisons taken at most while the dense timings drift beyond the tolerance."""
TOLERANCE = 0.05
"""Default largest drift of the dense timings (``max / min - 1``) of a steady comparison."""


@dataclass(frozen=True)
class Bracketed:
    """A candidate timed between timings of the dense model.

    Attributes:
        dense_ms: The dense model's timings, one more than the candidate's (before, between and after them).
        candidate_ms: The candidate's timings.
        tries: Comparisons taken to get this one (more than 1: earlier ones drifted).
    """

    dense_ms: tuple[float, ...]
    candidate_ms: tuple[float, ...]
    tries: int = 1

    def __post_init__(self) -> None:
        assert len(self.dense_ms) == len(self.candidate_ms) + 1 and self.candidate_ms, "dense timings bracket each"

    @property
    def references(self) -> tuple[float, ...]:
        """Per candidate timing, the mean of the dense timings just before and just after it."""
        return tuple((a + b) / 2 for a, b in zip(self.dense_ms, self.dense_ms[1:], strict=False))

    @property
    def reductions(self) -> tuple[float, ...]:
        """Per candidate timing, how much faster it ran than its reference (0.2 = 20% less time)."""
        return tuple(1.0 - c / r for c, r in zip(self.candidate_ms, self.references, strict=True))

    @property
    def reduction(self) -> float:
        """The median reduction."""
        return statistics.median(self.reductions)

    @property
    def interval(self) -> tuple[float, float]:
        """The smallest and the largest reduction of the candidate's timings (the worse end is the smallest), each
        candidate timing taken against the faster of the two dense timings around it for the worse end and the slower
        for the better end: a machine that drifted between them widens the interval instead of hiding in their mean
        (a plan called met at its worse end on the mean measured 0.04 points short independently)."""
        pairs = list(zip(self.candidate_ms, self.dense_ms, self.dense_ms[1:], strict=False))
        return min(1.0 - c / min(a, b) for c, a, b in pairs), max(1.0 - c / max(a, b) for c, a, b in pairs)

    @property
    def drift(self) -> float:
        """How far apart the dense timings are: ``max / min - 1`` (0 on a steady machine)."""
        return max(self.dense_ms) / min(self.dense_ms) - 1.0

    @property
    def dense_median(self) -> float:
        """The dense model's median timing (ms)."""
        return statistics.median(self.dense_ms)

    @property
    def candidate_median(self) -> float:
        """The candidate's median timing (ms)."""
        return statistics.median(self.candidate_ms)

    @property
    def candidate_worst(self) -> float:
        """The candidate's slowest timing (ms): the worse end for an absolute goal."""
        return max(self.candidate_ms)

    def steady(self, tolerance: float = TOLERANCE) -> bool:
        """Whether the dense timings agree within ``tolerance`` (a fraction)."""
        return self.drift <= tolerance

    def spread_ms(self) -> float:
        """The noise of one saving read from this comparison, in ms: how far apart the dense timings are."""
        return max(self.dense_ms) - min(self.dense_ms)

    def joined(self, other: Bracketed) -> Bracketed:
        """This comparison and ``other`` (taken right after it) as one, its last dense timing shared."""
        return Bracketed(self.dense_ms + other.dense_ms[1:], self.candidate_ms + other.candidate_ms,
                         self.tries + other.tries - 1)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """JSON form, with the derived figures a reader wants."""
        low, high = self.interval
        return {
            "dense_ms": list(self.dense_ms),
            "candidate_ms": list(self.candidate_ms),
            "reduction": round(self.reduction, 6),
            "interval": [round(low, 6), round(high, 6)],
            "drift": round(self.drift, 6),
            "tries": self.tries,
        }


def bracket(
    dense: Prepared,
    candidate: Prepared,
    batch: int,
    rounds: int = ROUNDS,
    tolerance: float = TOLERANCE,
    tries: int = TRIES,
    dense_before_ms: float | None = None,
) -> Bracketed:
    """``candidate`` timed ``rounds`` times, each between timings of ``dense``, at ``batch``; taken again (up to
    ``tries`` in all) while the dense timings drift beyond ``tolerance``. Returns the steady comparison, else the
    least drifting one (its :meth:`Bracketed.steady` is then False: the machine was too noisy).

    ``dense_before_ms`` is a dense timing just taken (the last one of the previous comparison in a series), used as
    the first try's first reference instead of timing the dense model again."""
    best: Bracketed | None = None
    for attempt in range(1, max(1, tries) + 1):
        reused = dense_before_ms if attempt == 1 and dense_before_ms is not None else None
        dense_ms = [reused if reused is not None else dense.time(batch).median_ms]
        candidate_ms = []
        for _ in range(max(1, rounds)):
            candidate_ms.append(candidate.time(batch).median_ms)
            dense_ms.append(dense.time(batch).median_ms)
        found = Bracketed(tuple(dense_ms), tuple(candidate_ms), attempt)
        if best is None or found.drift < best.drift:
            best = Bracketed(found.dense_ms, found.candidate_ms, attempt)
        if found.steady(tolerance):
            return found
    assert best is not None
    return Bracketed(best.dense_ms, best.candidate_ms, max(1, tries))

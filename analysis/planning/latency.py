"""Latency as a budget: a plan's latency predicted from the latency table (the dense model's latency minus what each
pruned group saves when pruned alone, measured on the deployment runtime), scaled by what end-to-end measurements of
earlier plans showed (the savings of groups pruned together are not exactly additive)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from torch import nn

from analysis.errors import UserError
from analysis.io.latency_table import LatencyTable
from analysis.runtimes.compare import TOLERANCE, Bracketed
from analysis.runtimes.runtime import Prepared
from analysis.runtimes.timing import Latency

OVERSHOOT = 0.03
"""A met plan whose measurement beats the goal by more than this fraction of the dense latency removed more than it
needed: the latency model is fitted to it and a smaller plan tried (kept only when it is met too)."""
SCALE_RANGE = (0.05, 2.0)
"""Bounds of the fitted scale: a measurement can shrink the predicted savings a lot, never erase or explode them."""


@dataclass(frozen=True)
class LatencyModel:
    """Predicts a plan's latency.

    Attributes:
        table: The measured table.
        scale: Multiplies every group's saving (1 until a plan was measured end to end).
    """

    table: LatencyTable
    scale: float = 1.0
    joint: Callable[[Mapping[str, int]], float] | None = None
    """What a whole plan saves unscaled, with the groups' interactions (a layer-level table's
    :class:`~analysis.planning.layer_table.JointLayerSavings`); None: the sum of the groups' savings alone."""

    @property
    def dense_ms(self) -> float:
        """The unpruned model's latency."""
        assert self.table.dense_ms is not None, "the table is measured before planning"
        return self.table.dense_ms

    def saved(self, group: str, count: int) -> float:
        """The predicted saving (ms) of ``group`` at ``count`` channels removed."""
        return self.scale * self.table.saving(group, count)

    def predicted_ms(self, picks: Mapping[str, int]) -> float:
        """The predicted latency with every ``{group: count}`` pruned at once."""
        return self.dense_ms - sum(self.saved(group, count) for group, count in picks.items())

    def plan_saving(self, picks: Mapping[str, int]) -> float:
        """The unscaled saving of a whole plan: :attr:`joint`'s when there is one, else the groups' savings summed."""
        if self.joint is not None:
            return self.joint(picks)
        return sum(self.table.saving(group, count) for group, count in picks.items())

    def plan_ms(self, picks: Mapping[str, int]) -> float:
        """The predicted latency of a chosen plan (with the groups' interactions when :attr:`joint` gives them; the
        knapsack plans on the summed :meth:`predicted_ms`)."""
        return self.dense_ms - self.scale * self.plan_saving(picks)

    def fitted(self, picks: Mapping[str, int], measured_ms: float) -> LatencyModel:
        """The model rescaled so that its :meth:`plan_ms` is ``measured_ms`` for ``picks`` (within
        :data:`SCALE_RANGE`)."""
        unscaled = self.plan_saving(picks)
        if unscaled <= 0:
            return self
        low, high = SCALE_RANGE
        return replace(self, scale=min(high, max(low, (self.dense_ms - measured_ms) / unscaled)))


class LatencyRuntime(Protocol):
    """What the latency planner needs of a runtime (:class:`analysis.runtimes.runtime.Runtime` implements it; tests
    pass fakes): a name, where it runs, its settings, and models prepared to be timed."""

    name: str
    device: str
    on_cpu: bool

    def prepare(self, model: nn.Module, sample_shape: Sequence[int]) -> Prepared:
        """``model`` ready to be timed on inputs of ``sample_shape``."""
        ...

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        """One latency of ``model``."""
        ...

    def settings(self) -> dict[str, object]:
        """What its latencies depend on (the table's key, the sidecar)."""
        ...


VERDICTS = ("met", "missed", "noisy")
"""A latency plan's verdict: its measured interval's worse end meets the goal; it does not; or the dense timings
around it disagreed beyond the tolerance in every try, so the machine was too noisy to judge it."""


@dataclass(frozen=True)
class LatencyAttempt:
    """One plan measured end to end against the dense model (:func:`~analysis.runtimes.compare.bracket`).

    Attributes:
        target_reduction: The reduction of the table's dense latency the plan was made for.
        predicted_reduction: How much faster the latency model predicted the plan.
        measured: The plan timed between timings of the dense model.
        scale: The latency model's scale when the plan was made.
    """

    target_reduction: float
    predicted_reduction: float
    measured: Bracketed
    scale: float

    @property
    def dense_ms(self) -> float:
        """The dense model measured beside the plan (median)."""
        return self.measured.dense_median

    @property
    def measured_ms(self) -> float:
        """The plan's measured latency (median)."""
        return self.measured.candidate_median

    @property
    def predicted_ms(self) -> float:
        """The predicted latency on the same baseline as the measurement: the dense model measured beside it."""
        return self.dense_ms * (1.0 - self.predicted_reduction)

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"target_reduction": round(self.target_reduction, 6),
                "predicted_reduction": round(self.predicted_reduction, 6), "predicted_ms": round(self.predicted_ms, 4),
                "measured_ms": self.measured_ms, "dense_ms": self.dense_ms, "scale": self.scale,
                "measured": self.measured.as_dict()}  # fmt: skip


@dataclass
class LatencyOutcome:
    """What a latency plan predicted and measured, per attempt (a missed budget corrects the model and plans again).

    Attributes:
        runtime: The runtime's name.
        device: Where it measured.
        batch: Images per call.
        dense_ms: The unpruned model's latency (the table's).
        goal_ms: The latency the plan must reach (from the table's dense latency, for a reduction).
        attempts: The plans measured, in order.
        chosen: The index in :attr:`attempts` of the chosen plan: the last, unless a plan made after a met one to
            remove less (its measurement beat the goal by more than :data:`OVERSHOOT`) missed, when the met one is kept.
        goal_reduction: The reduction asked for (None for an absolute goal): met when the plan's measured interval is
            at least that much below the dense model measured around it, so a machine that got slower or faster
            since the table was measured does not decide it.
        table_file: The cached latency table.
        table_seconds: Time spent measuring the table in this run.
        tolerance: Largest drift of the dense timings around a verdict (``latency_tolerance``).
        settings: The runtime's settings (threads, provider, exporter...), as the table's key holds them.
        table: The kind of latency table planned on (``model`` or ``layers``; ``auto`` resolved).
        largest: The largest plan the analysed ratios allow, measured when no plan reached the goal.
        largest_picks: That plan's channels removed per group (``{group key: count}``), to rebuild and check it.
    """

    runtime: str
    device: str
    batch: int
    dense_ms: float
    goal_ms: float
    attempts: list[LatencyAttempt] = field(default_factory=list)
    table_file: str = ""
    table_seconds: float = 0.0
    goal_reduction: float | None = None
    tolerance: float = TOLERANCE
    settings: dict[str, object] = field(default_factory=dict)
    table: str = "model"
    largest: Bracketed | None = None
    largest_picks: dict[str, int] = field(default_factory=dict)
    chosen: int = -1

    @property
    def last(self) -> LatencyAttempt:
        """The chosen plan's attempt (:attr:`chosen`)."""
        return self.attempts[self.chosen]

    def overshoot(self, attempt: LatencyAttempt) -> float:
        """How far ``attempt``'s worse end beat the goal, as a fraction of the dense latency (negative: short of it)."""
        measured = attempt.measured
        if self.goal_reduction is not None:
            return measured.interval[0] - self.goal_reduction
        return (self.goal_ms - measured.candidate_worst) / measured.dense_median

    @property
    def measured_ms(self) -> float:
        """The chosen plan's measured latency."""
        return self.last.measured_ms

    @property
    def predicted_ms(self) -> float:
        """The chosen plan's predicted latency, on the dense model measured beside it."""
        return self.last.predicted_ms

    @property
    def measured_reduction(self) -> float:
        """How much faster the chosen plan measured than the dense model measured around it (median)."""
        return self.last.measured.reduction

    @property
    def predicted_reduction(self) -> float:
        """How much faster the latency model predicted the chosen plan."""
        return self.last.predicted_reduction

    @property
    def verdict(self) -> str:
        """:data:`VERDICTS`: for a reduction, met when the worse end of the measured interval reaches it; for a goal
        in ms, when the slowest timing does; noisy when the dense timings around it drifted beyond the tolerance."""
        if not self.last.measured.steady(self.tolerance):
            return "noisy"
        return "met" if self.overshoot(self.last) >= 0.0 else "missed"

    @property
    def met(self) -> bool:
        """Whether the chosen plan reaches the goal as measured (:attr:`verdict`)."""
        return self.verdict == "met"

    def goal_text(self) -> str:
        """The goal in the form it was asked."""
        return f"{self.goal_ms:.3f} ms" if self.goal_reduction is None else f"{self.goal_reduction:.1%} faster"

    def noisy_sentence(self, measured: Bracketed | None = None, what: str = "the latency plan") -> str:
        """Why ``measured`` (the chosen plan's measurement by default) was not judged, with the figures."""
        measured = measured if measured is not None else self.last.measured
        chosen = bool(self.attempts) and measured is self.last.measured
        kept = "the plan is kept unjudged: " if chosen else ""
        return (
            f"The machine was too noisy to judge {what} on {self.device} (batch {self.batch}): the dense model "
            f"measured {min(measured.dense_ms):.3f} to {max(measured.dense_ms):.3f} ms around it ({measured.drift:.1%} "
            f"apart, more than SensitivityAnalysis.latency_tolerance {self.tolerance:g}) in {measured.tries} tries; "
            f"{kept}measure on a quieter machine, or raise the tolerance"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON form (the sidecar's ``plan.latency``)."""
        data = {**asdict(self), "attempts": [a.as_dict() for a in self.attempts], "verdict": self.verdict,
                "met": self.met}  # fmt: skip
        data["largest"] = None if self.largest is None else self.largest.as_dict()
        return data


class LatencyGoalNotReached(UserError):
    """No latency plan was found for the goal after the largest plan the analysed ratios allow was measured: the goal
    is not reachable within them, the machine was too noisy to tell, or the table stayed too far from the measurements.

    Attributes:
        outcome: Every attempt measured before, and :attr:`LatencyOutcome.largest`, the largest plan's measurement.
    """

    def __init__(self, message: str, outcome: LatencyOutcome) -> None:
        super().__init__(message)
        self.outcome = outcome

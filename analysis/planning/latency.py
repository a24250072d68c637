"""Latency as a budget: a plan's latency predicted from the latency table (the dense model's latency minus what each
pruned group saves when pruned alone, measured on the deployment runtime), scaled by what end-to-end measurements of
earlier plans showed (the savings of groups pruned together are not exactly additive)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from analysis.io.latency_table import LatencyTable

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
    :class:`~analysis.runtimes.layers.JointLayerSavings`); None: the sum of the groups' savings alone."""

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


@dataclass
class LatencyOutcome:
    """What a latency plan predicted and measured, per attempt (a missed budget corrects the model and plans again).

    Attributes:
        runtime: The runtime's name.
        device: Where it measured.
        batch: Images per call.
        dense_ms: The unpruned model's latency (the table's).
        goal_ms: The latency the plan must reach (from the table's dense latency, for a reduction).
        attempts: Per attempt: its target reduction, predicted and measured latency, the dense model measured
            beside it (``dense_ms``), and the model's scale.
        goal_reduction: The reduction asked for (None for an absolute goal): met when the plan measures that much
            below the dense model measured beside it, so a machine that got slower or faster since the table was
            measured does not decide it.
        table_file: The cached latency table.
        table_seconds: Time spent measuring the table in this run.
    """

    runtime: str
    device: str
    batch: int
    dense_ms: float
    goal_ms: float
    attempts: list[dict[str, float]] = field(default_factory=list)
    table_file: str = ""
    table_seconds: float = 0.0
    goal_reduction: float | None = None

    @property
    def measured_ms(self) -> float:
        """The chosen plan's measured latency (the last attempt's)."""
        return self.attempts[-1]["measured_ms"]

    @property
    def predicted_ms(self) -> float:
        """The chosen plan's predicted latency."""
        return self.attempts[-1]["predicted_ms"]

    @property
    def measured_reduction(self) -> float:
        """How much faster the chosen plan measured than the dense model measured beside it."""
        last = self.attempts[-1]
        return 1.0 - last["measured_ms"] / last["dense_ms"]

    @property
    def predicted_reduction(self) -> float:
        """How much faster the latency model predicted the chosen plan."""
        return 1.0 - self.predicted_ms / self.dense_ms

    @property
    def met(self) -> bool:
        """Whether the chosen plan reaches the goal as measured."""
        if self.goal_reduction is not None:
            return self.measured_reduction >= self.goal_reduction
        return self.measured_ms <= self.goal_ms

    def as_dict(self) -> dict[str, Any]:
        """JSON form (the sidecar's ``plan.latency``)."""
        return {**asdict(self), "met": self.met}

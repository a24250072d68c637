"""The early stops of an analysis in progress: which ratios of a param are still due, and where it stopped (the
rule itself, NNI's four modes, is :mod:`analysis.early_stop`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from analysis.early_stop import EarlyStop

if TYPE_CHECKING:
    from analysis.io.store import AnalysisStore


class StopLedger:
    """The early stops recorded in an analysis file: which ratios of a param are still due, and where it stopped.

    Two things stop a param: the early-stop rule (on a variant's metric) and, with decision-driven sampling, a
    variant decided above ``target_loss`` (settled above, or exact and above), after which the larger ratios are
    skipped (see :mod:`analysis.engine._decision`).

    Args:
        store: The analysis file in progress (its sidecar holds each param's stop and variant metrics).
        rule: The current early stop (None: no param stops on a metric).
        metric: The metric the rule reads.
        ratios: The ratios of the analysis.
        target: With decision-driven sampling, the ``target_loss`` variants are settled against.
    """

    def __init__(
        self,
        store: AnalysisStore,
        rule: EarlyStop | None,
        metric: str,
        ratios: Sequence[float],
        target: float | None = None,
    ) -> None:
        self.store, self.rule, self.metric, self.ratios, self.target = store, rule, metric, ratios, target

    def pending(self, name: str) -> list[float]:
        """The ratios of ``name`` still to evaluate: not in the file, and not beyond a recorded early stop (the
        sidecar's ``early_stop`` entry is brought in line with the current rule, which may have changed)."""
        stopped_at = self.refresh(name)
        return [r for r in self.ratios if not self.store.has(name, r) and (stopped_at is None or r <= stopped_at)]

    def refresh(self, name: str) -> float | None:
        """Bring the sidecar's ``early_stop`` entry of ``name`` in line with its recorded variants; return the ratio
        it stopped at (None: not stopped)."""
        stopped_at = self.stop_ratio(name)
        if stopped_at is None:
            self.store.clear_early_stop(name)
        else:
            self.store.mark_early_stop(name, stopped_at, self._condition(self._rule_trips(name, stopped_at)))
        return stopped_at

    def tripped(self, baseline: Mapping[str, float], metrics: Mapping[str, float]) -> bool:
        """Whether a variant scoring ``metrics`` stops its param."""
        return self.rule is not None and self.rule.tripped(float(baseline[self.metric]), float(metrics[self.metric]))

    def decided_above(self, loss: float, settled: str | None) -> bool:
        """Whether a variant with this loss and decision (``settled``) stops its param under decision-driven
        sampling: settled above the target, or exact (or within the precision) and above it."""
        if self.target is None or settled is None or settled == "below":
            return False
        return settled == "above" or loss > self.target

    def mark(self, names: Sequence[str], ratio: float, by_rule: bool = True) -> None:
        """Record in the sidecar that ``names`` stopped at ``ratio``: by the early-stop rule, or (``by_rule`` False)
        decided above the target."""
        for name in names:
            self.store.mark_early_stop(name, ratio, self._condition(by_rule))

    def stop_ratio(self, name: str) -> float | None:
        """The smallest recorded ratio of ``name`` whose metric trips the early stop or that was decided above the
        target (None: not stopped)."""
        return min((r for r in self.ratios if self._stops(name, r)), default=None)

    def _stops(self, name: str, ratio: float) -> bool:
        return self._decided_above(name, ratio) or self._rule_trips(name, ratio)

    def _decided_above(self, name: str, ratio: float) -> bool:
        variant = self.store.variant(name, ratio) if self.target is not None else None
        return variant is not None and variant.loss is not None and self.decided_above(variant.loss, variant.settled)

    def _condition(self, by_rule: bool) -> str:
        """How the stop reads in the sidecar and the report."""
        if by_rule and self.rule is not None:
            return self.rule.describe()
        assert self.target is not None, "a stop without a rule or a decision"
        return f"loss above target_loss {self.target:g} (decision-driven sampling; larger ratios assumed above too)"

    def _rule_trips(self, name: str, ratio: float) -> bool:
        baseline, value = self.store.baseline, self.store.variant_metric(name, ratio, self.metric)
        if baseline is None or self.metric not in baseline or value is None:
            return False
        return self.tripped(baseline, {self.metric: value})

"""Early stop per param: once a ratio's metric crosses a threshold, the param's larger ratios are not evaluated.

The four modes are NNI's (``SensitivityAnalysis.early_stop_mode``), applied to the raw metric value (top1, top5,
cross-entropy, or whatever an eval function returns), never to the loss:

- ``minimize``: stop when the metric falls below ``value``;
- ``maximize``: stop when the metric rises above ``value``;
- ``dropped``: stop when the metric falls below ``baseline - value``;
- ``raised``: stop when the metric rises above ``baseline + value``.

The variant that trips the check is recorded; the ratios after it (ratios are evaluated in increasing order) are
skipped. Because the check reads only recorded metrics, a resumed run skips exactly what an uninterrupted run skips.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from analysis.errors import ConfigError

if TYPE_CHECKING:
    from analysis.io._store import AnalysisStore

EARLY_STOP_MODES = ("minimize", "maximize", "dropped", "raised")


@dataclass(frozen=True)
class EarlyStop:
    """When to stop evaluating a param's larger ratios.

    Attributes:
        mode: One of :data:`EARLY_STOP_MODES`.
        value: The threshold (``minimize``/``maximize``) or the allowed change from the baseline (``dropped``/
            ``raised``), in the metric's own units.
    """

    mode: str
    value: float

    def tripped(self, baseline: float, metric: float) -> bool:
        """Whether a variant scoring ``metric`` (the unpruned model scores ``baseline``) stops its param."""
        if self.mode == "minimize":
            return metric < self.value
        if self.mode == "maximize":
            return metric > self.value
        if self.mode == "dropped":
            return metric < baseline - self.value
        return metric > baseline + self.value

    def describe(self) -> str:
        """``metric < 0.5``-style text of the condition, for logs and reports."""
        value = f"{self.value:g}"
        condition = {"minimize": f"< {value}", "maximize": f"> {value}", "dropped": f"< baseline - {value}"}
        return "metric " + condition.get(self.mode, f"> baseline + {value}")


def early_stop_from(mode: str | None, value: float | None, key: str = "early_stop_mode") -> EarlyStop | None:
    """Build an :class:`EarlyStop` from the two settings (None when ``mode`` is None).

    Raises:
        ConfigError: For an unknown mode, a mode without a finite value, or a value without a mode.
    """
    value_key = key.replace("early_stop_mode", "early_stop_value")
    if mode is None:
        if value is not None:
            modes = ", ".join(EARLY_STOP_MODES)
            raise ConfigError(f"{value_key} is set but {key} is not; set {key} to one of {modes}.")
        return None
    if mode not in EARLY_STOP_MODES:
        raise ConfigError(f"{key} must be one of {', '.join(EARLY_STOP_MODES)}, got '{mode}'.")
    if value is None or not math.isfinite(float(value)):
        raise ConfigError(f"{key} is '{mode}' but {value_key} is not a finite number; set it (e.g. 0.05).")
    return EarlyStop(mode, float(value))


class StopLedger:
    """The early stops recorded in an analysis file: which ratios of a param are still due, and where it stopped.

    Args:
        store: The analysis file in progress (its sidecar holds each param's stop and variant metrics).
        rule: The current early stop (None: no param stops).
        metric: The metric the rule reads.
        ratios: The ratios of the analysis.
    """

    def __init__(self, store: AnalysisStore, rule: EarlyStop | None, metric: str, ratios: Sequence[float]) -> None:
        self.store, self.rule, self.metric, self.ratios = store, rule, metric, ratios

    def pending(self, name: str) -> list[float]:
        """The ratios of ``name`` still to evaluate: not in the file, and not beyond a recorded early stop (the
        sidecar's ``early_stop`` entry is brought in line with the current rule, which may have changed)."""
        stopped_at = self.stop_ratio(name)
        if stopped_at is None:
            self.store.clear_early_stop(name)
        else:
            self.mark([name], stopped_at)
        return [r for r in self.ratios if not self.store.has(name, r) and (stopped_at is None or r <= stopped_at)]

    def tripped(self, baseline: Mapping[str, float], metrics: Mapping[str, float]) -> bool:
        """Whether a variant scoring ``metrics`` stops its param."""
        return self.rule is not None and self.rule.tripped(float(baseline[self.metric]), float(metrics[self.metric]))

    def mark(self, names: Sequence[str], ratio: float) -> None:
        """Record in the sidecar that ``names`` stopped at ``ratio`` (and under which condition)."""
        assert self.rule is not None
        for name in names:
            self.store.mark_early_stop(name, ratio, self.rule.describe())

    def stop_ratio(self, name: str) -> float | None:
        """The smallest recorded ratio of ``name`` whose metric trips the early stop (None: not stopped)."""
        baseline = self.store.baseline
        if self.rule is None or baseline is None or self.metric not in baseline:
            return None
        scores = {r: self.store.variant_metric(name, r, self.metric) for r in self.ratios}
        base = float(baseline[self.metric])
        return min((r for r, v in scores.items() if v is not None and self.rule.tripped(base, v)), default=None)

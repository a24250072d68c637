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
from dataclasses import dataclass

from analysis.errors import ConfigError

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

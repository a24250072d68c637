"""Numbers in ACT's training blocks, read once with the key they came from."""

from __future__ import annotations

import math
from typing import Any

from analysis.errors import ConfigError


def config_number(key: str, value: Any) -> float:
    """``value`` as a finite float (YAML 1.1 reads ``1e-4`` as a string), else a ConfigError naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be a number, not {value!r}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, not {value!r}.") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key} must be a finite number, not {value!r}.")
    return number

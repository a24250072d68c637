"""Values in ACT's training blocks, checked once with the key they came from: numbers (YAML 1.1 reads ``1e-4`` as a
string) and a Paddle type's arguments."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from analysis.errors import ConfigError, did_you_mean

WORDS = ("anneal_strategy", "name", "group_name")
"""Arguments whose value is a word, not a number (OneCycleLR's strategy, Paddle's names)."""


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


def check_arguments(
    key: str, kind: str, given: Mapping[str, Any], known: Iterable[str], ignored: Iterable[str] = ()
) -> None:
    """Refuse an argument the Paddle type ``kind`` does not take (``known``, or ``ignored``: accepted without effect),
    or a value that is not a number, flag, list of numbers, or a word for :data:`WORDS`.

    Raises:
        ConfigError: Naming the argument's key.
    """
    known = tuple(known)
    allowed = (*known, *ignored)
    for name, value in given.items():
        if name not in allowed:
            raise ConfigError(f"{key}.{name} is not an argument of {kind}{did_you_mean(name, allowed)}; it takes "
                              f"{', '.join(known) or 'none'}.")  # fmt: skip
        if isinstance(value, (list, tuple)):
            for item in value:
                config_number(f"{key}.{name}", item)
        elif name in WORDS:
            if not isinstance(value, str):
                raise ConfigError(f"{key}.{name} must be a word, not {value!r}.")
        elif not isinstance(value, bool):
            config_number(f"{key}.{name}", value)

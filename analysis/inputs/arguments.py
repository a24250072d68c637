"""Type checks of the Python API's arguments, made at its edge before any work starts.

Each check refuses a value of the wrong type with a :class:`~analysis.errors.UserError` carrying one sentence that
names the argument, and returns the value narrowed to its type. Values of the right type are checked where the YAML's
are (:func:`analysis.config.validate_section`), so that every entry refuses the same settings with the same sentence.
A ``bool`` is never taken for a number, nor a string for a list of names: both are a mistake more often than not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn

from analysis.errors import ConfigError, DataError, ModelError, UserError, printable
from analysis.io.record import AnalysisRecord, AnalysisSource

T = TypeVar("T")

SHOWN_CHARACTERS = 40
"""A quoted value is cut to about this many characters, so that a message stays one line."""


def described(value: object) -> str:
    """``value`` as a message names it: ``None``, ``the float 0.3``, ``a tensor of shape (8, 3)``, ``a dict``."""
    if value is None:
        return "None"
    kind = type(value).__name__
    if isinstance(value, (bool, int, float, complex, str, bytes)):
        text = printable(repr(value))
        text = text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."
        return f"the {kind} {text}"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def refuse(name: str, expected: str, value: object, hint: str = "", error: type[UserError] = ConfigError) -> UserError:
    """The error saying that argument ``name`` must be ``expected`` and what it got (``hint``: what to do)."""
    return error(f"{name} must be {expected}, got {described(value)}{hint}.")


def optional(check: Callable[[str, Any], T], name: str, value: object) -> T | None:
    """``None`` as given, or ``check(name, value)``."""
    return None if value is None else check(name, value)


def module(name: str, value: object) -> nn.Module:
    """A ``torch.nn.Module`` (the model); raises :class:`~analysis.errors.ModelError`."""
    if not isinstance(value, nn.Module):
        raise refuse(name, "a torch.nn.Module (the model)", value, error=ModelError)
    return value


def path(name: str, value: object) -> str | Path:
    """A file path: a ``str`` (kept as given, so that an empty one is refused where the YAML's is) or an
    ``os.PathLike`` of text."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        text = os.fspath(value)
    else:
        raise refuse(name, "a path (a str or pathlib.Path)", value)
    if "\0" in text:
        raise ConfigError(f"{name} must be a path, got '{printable(text)}', which holds a NUL character.")
    return value if isinstance(value, str) else Path(text)


def number(name: str, value: object) -> float:
    """A real number (an int, a float, a NumPy scalar); an int is returned as given, so messages quote it as given."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise refuse(name, "a number", value)
    return value if isinstance(value, (int, float)) else float(value)


def integer(name: str, value: object) -> int:
    """An integer (a Python or NumPy int)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise refuse(name, "an integer", value)
    return int(value)


def flag(name: str, value: object) -> bool:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        raise refuse(name, "True or False", value)
    return value


def text(name: str, value: object) -> str:
    """A string (a choice, checked against its options by the caller)."""
    if not isinstance(value, str):
        raise refuse(name, "a string", value)
    return value


def function(name: str, value: object) -> Callable[..., Any]:
    """Something callable."""
    if not callable(value):
        raise refuse(name, "a function", value)
    return value


def tensor(name: str, value: object) -> torch.Tensor:
    """A ``torch.Tensor``."""
    if not isinstance(value, torch.Tensor):
        raise refuse(name, "a torch.Tensor", value)
    return value


def mapping(name: str, value: object) -> Mapping[Any, Any]:
    """A mapping (a dict)."""
    if not isinstance(value, Mapping):
        raise refuse(name, "a dict", value)
    return value


def is_collection(value: object) -> bool:
    """Whether ``value`` is a list-like collection: iterable, but not a string, bytes, a mapping or a tensor."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping, torch.Tensor))


def items(name: str, value: object) -> list[Any]:
    """A list or tuple of anything (positional arguments); a string, a mapping or a tensor is refused."""
    if not is_collection(value):
        raise refuse(name, "a list or tuple", value)
    assert isinstance(value, Iterable)
    return list(value)


def numbers(name: str, value: object, example: str = "[0.1, 0.2, 0.3]") -> list[float]:
    """A list (or tuple, array) of real numbers; a bare number is refused with the list it was meant to be."""
    hint = f" (for one value pass [{value!r}])" if isinstance(value, Real) and not isinstance(value, bool) else ""
    if not is_collection(value):
        raise refuse(name, f"a list of numbers such as {example}", value, hint)
    assert isinstance(value, Iterable)
    values = list(value)
    for item in values:
        if isinstance(item, bool) or not isinstance(item, Real):
            raise refuse(name, f"a list of numbers such as {example}", value, f" holding {described(item)}")
    return [item if isinstance(item, (int, float)) else float(item) for item in values]


def names(name: str, value: object) -> list[str]:
    """A list (or tuple) of strings; a single string is refused (it would be read as its characters)."""
    hint = f" (for one name pass ['{printable(value)}'])" if isinstance(value, str) else ""
    if not is_collection(value):
        raise refuse(name, "a list of names", value, hint)
    assert isinstance(value, Iterable)
    values = list(value)
    for item in values:
        if not isinstance(item, str):
            raise refuse(name, "a list of names", value, f" holding {described(item)}")
    return values


def analysis_source(name: str, value: object) -> AnalysisSource:
    """An analysis record (:func:`~analysis.io.record.load_record`) or the path of an analysis file."""
    if isinstance(value, AnalysisRecord):
        return value
    if isinstance(value, (str, os.PathLike)):
        return path(name, value)
    raise refuse(name, "an analysis file's path or its record (load_record(path))", value)


def score(name: str, value: object) -> float:
    """What an evaluation function returned: a number, or a tensor or array holding one; raises
    :class:`~analysis.errors.DataError` naming the function."""
    count = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", None)
    if count == 1 and (isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"):
        value = cast(Any, value).item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise DataError(f"{name} returned {described(value)}; it must return a number (the metric, e.g. the accuracy).")
    return float(value)

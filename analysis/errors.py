"""Exceptions for problems the user can fix (bad config, data, model files).

The CLI prints a :class:`UserError` as one sentence and exits with code 2; every other exception is a bug
and keeps its traceback.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable


class UserError(Exception):
    """A problem with the user's input, described in one actionable sentence."""


class ConfigError(UserError):
    """The YAML config or a command-line override is invalid."""


class DataError(UserError):
    """The evaluation data cannot be found, parsed or decoded."""


class ModelError(UserError):
    """The model cannot be built or its weights cannot be loaded."""


class UserCodeError(ModelError):
    """The user's own code (a ``module:callable`` model) raised: their bug, so the CLI shows their traceback above
    the one-sentence message and exits with code 2.

    Attributes:
        user_traceback: The formatted traceback of the user's exception.
    """

    def __init__(self, message: str, user_traceback: str) -> None:
        super().__init__(message)
        self.user_traceback = user_traceback


class OutputError(UserError):
    """A result cannot be written: a path component that is a file, no permission, a full disk, a read-only folder."""


def output_error(path: object, error: OSError) -> OutputError:
    """The one-sentence :class:`OutputError` for an ``OSError`` raised while writing ``path``."""
    code = errno.errorcode.get(error.errno or 0, "")
    reason = f"{error.strerror or error}" + (f" [{code}]" if code else "")
    return OutputError(
        f"Cannot write {path}: {reason}; choose a writable location with free space (files written before are "
        "kept, a rerun resumes)."
    )


class AnalysisFileError(UserError):
    """An analysis file (pickle, sidecar, ratios) is unreadable, unsafe, or belongs to another model or data."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest candidate, or an empty string when none is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def first_line(message: object) -> str:
    """The first non-empty line of an error message (an exception without text gives its type name), for one-sentence
    reports of errors raised by other libraries."""
    text = str(message).strip()
    if text:
        return text.splitlines()[0]
    return type(message).__name__ if isinstance(message, BaseException) else text


def printable(text: object) -> str:
    """``text`` with every character that is not printable (line breaks, control and format characters) escaped as
    in a Python literal, so that a message quoting the user's input stays one line."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))

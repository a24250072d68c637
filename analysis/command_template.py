"""The command of ``latency_runtime: command``: a template checked when the config is read, and filled in safely.

The template is split like a shell command line first (no shell runs it), then the placeholders ``{onnx}`` (the
exported model), ``{batch}`` and ``{shape}`` (``1x3x224x224``) are filled in each argument on its own, so a value
never splits into two arguments and never adds one. Inside the script of a shell's ``-c`` (``sh -c '... {onnx}'``),
each value is quoted for that shell, so a path holding a space, a quote or ``$(...)`` stays one word and runs
nothing. Placeholders take no format spec, conversion, attribute or index (``{onnx!r}``, ``{onnx.x}``).
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

from analysis.errors import ConfigError, printable

PLACEHOLDERS = ("onnx", "batch", "shape")
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish"})
"""Programs whose ``-c`` argument is a script: values filled into it are quoted for the shell."""


@dataclass(frozen=True)
class Piece:
    """Literal text, then the placeholder filled in after it (None at the end of an argument)."""

    literal: str
    field: str | None


@dataclass(frozen=True)
class CommandTemplate:
    """A checked runtime command template.

    Attributes:
        text: The template as the user wrote it.
        arguments: Each argument of the split template, as pieces.
        script: The index of the argument that is a shell's ``-c`` script (values quoted there), or None.
    """

    text: str
    arguments: tuple[tuple[Piece, ...], ...]
    script: int | None

    @classmethod
    def parse(cls, text: str, key: str = "runtime_command") -> CommandTemplate:
        """Split and check ``text``.

        Raises:
            ConfigError: Naming ``key``, for unbalanced quotes or braces, a placeholder other than the three (or with
                a format spec or conversion), a template without ``{onnx}``, or a quoted placeholder in a shell
                script (the tool quotes it).
        """
        shown = printable(text)
        try:
            words = shlex.split(text)
        except ValueError as error:
            raise ConfigError(f"{key} '{shown}' cannot be split into arguments ({error}); close its quotes.") from None
        if not words:
            raise ConfigError(f"{key} is empty; give a command that uses {{onnx}}, e.g. 'trtexec --onnx={{onnx}}'.")
        arguments = tuple(_pieces(word, shown, key) for word in words)
        if not any(piece.field == "onnx" for argument in arguments for piece in argument):
            raise ConfigError(
                f"{key} must pass the model as {{onnx}} (and may use {{batch}} and {{shape}}); got '{shown}'."
            )
        script = _script_index(words)
        if script is not None:
            _refuse_quoted_placeholders(arguments[script], shown, key)
        return cls(text, arguments, script)

    def render(self, values: Mapping[str, str]) -> list[str]:
        """The command's arguments with ``values`` (one per placeholder) filled in."""
        command = []
        for index, argument in enumerate(self.arguments):
            quote = shlex.quote if index == self.script else str
            command.append(
                "".join(piece.literal + (quote(values[piece.field]) if piece.field else "") for piece in argument)
            )
        return command


def _pieces(word: str, text: str, key: str) -> tuple[Piece, ...]:
    """``word`` as literal pieces and checked placeholders."""
    try:
        parsed = list(string.Formatter().parse(word))
    except ValueError as error:
        raise ConfigError(
            f"{key} '{text}' is not a valid template ({error}); write the placeholders as {{onnx}}, {{batch}}, "
            "{shape}, and a literal brace as {{ or }}."
        ) from None
    pieces = []
    for literal, field, spec, conversion in parsed:
        if field is not None and field not in PLACEHOLDERS:
            raise ConfigError(
                f"{key} '{text}' has the placeholder {{{printable(field)}}}; only {{onnx}}, {{batch}} and {{shape}} "
                "are filled in (a literal brace is {{ or }})."
            )
        if spec or conversion:
            raise ConfigError(
                f"{key} '{text}' gives {{{field}}} a format spec or conversion; write it plainly as {{{field}}}."
            )
        pieces.append(Piece(literal, field))
    return tuple(pieces)


def _script_index(words: list[str]) -> int | None:
    """The index of the script argument when ``words`` runs a shell with ``-c`` (``sh -c SCRIPT``, ``bash -ec
    SCRIPT``), else None."""
    if PurePath(words[0]).name not in SHELLS:
        return None
    command_option = False
    for index, word in enumerate(words[1:], start=1):
        if word.startswith(("-", "+")) and word not in ("-", "--"):
            command_option = command_option or (word.startswith("-") and not word.startswith("--") and "c" in word)
            continue
        return index if command_option else None
    return None


def _refuse_quoted_placeholders(script: tuple[Piece, ...], text: str, key: str) -> None:
    """Refuse a placeholder written inside quotes in a shell script: its value is quoted already, and quotes around
    that quoting would become part of the value."""
    before = ""
    for piece in script:
        before += piece.literal
        if piece.field is not None and _open_quote(before):
            raise ConfigError(
                f"{key} '{text}' puts {{{piece.field}}} inside quotes in the shell script; write it without quotes: "
                "the tool quotes each value for the shell."
            )
        before += "X" if piece.field is not None else ""


def _open_quote(script: str) -> bool:
    """Whether ``script`` ends inside a single- or double-quoted string (POSIX shell quoting)."""
    quote: str | None = None
    index = 0
    while index < len(script):
        char = script[index]
        if quote == "'":
            quote = None if char == "'" else quote
        elif char == "\\":
            index += 1  # the next character is escaped (outside quotes and inside double quotes)
        elif quote == '"':
            quote = None if char == '"' else quote
        elif char in "'\"":
            quote = char
        index += 1
    return quote is not None


def compile_pattern(pattern: str, key: str = "runtime_pattern") -> re.Pattern[str]:
    """``pattern`` compiled: a regular expression with exactly one group, the latency in ms.

    Raises:
        ConfigError: Naming ``key``, for an invalid expression or another number of groups.
    """
    shown = printable(pattern)
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ConfigError(f"{key} '{shown}' is not a regular expression ({error}).") from None
    if compiled.groups != 1:
        raise ConfigError(f"{key} '{shown}' must have one group, the latency in ms; it has {compiled.groups}.")
    return compiled

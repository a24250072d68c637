"""Progress of every long step (the analysis, the measured search, BatchNorm re-estimation, evaluations): a tqdm bar
with ETA on a terminal, and, when the output is a file (nohup, a cluster scheduler), one log line with the counts
and ETA every :data:`LINE_SECONDS`, so a user can tell progress from a hang. ``--quiet`` shows neither."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

LINE_SECONDS = 30.0
"""When the output is not a terminal: the seconds between two progress lines of a step (a shorter step logs none)."""

KNOWN_TOTAL = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%), {elapsed} elapsed, about {remaining} left"
UNKNOWN_TOTAL = "{desc}: {n_fmt} {unit}, {elapsed} elapsed"


def progress_bar(progress: bool | None, **options: Any) -> tqdm:
    """A progress bar over a loop: tqdm's bar when ``progress`` is True (or None on a terminal), log lines every
    :data:`LINE_SECONDS` when it is None and stderr is not a terminal, nothing when it is False.

    Args:
        progress: As the ``progress`` settings everywhere: True, False, or None (decide by the terminal).
        options: tqdm's arguments (``total``, ``desc``, ``unit``, ``leave``, ...).
    """
    if progress is False:
        return tqdm(disable=True, **options)
    if progress or sys.stderr.isatty():
        return tqdm(**options)
    return LineProgress(**options)


class _Discard:
    """A file that drops what tqdm writes: the lines go to the log instead."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""


class LineProgress(tqdm):  # type: ignore[misc]  # tqdm ships no type information for subclassing
    """A tqdm bar that logs a line with the counts and ETA once :data:`LINE_SECONDS` have passed since the last one,
    and, if it logged any, a last line when it closes; a step shorter than that logs nothing.

    tqdm's documented way to draw elsewhere: :meth:`display` is overridden to read :attr:`format_dict`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._next_line = LINE_SECONDS
        self._shown = kwargs.get("initial", 0)  # the count the last line showed (at first: the count it starts at)
        self._lines = 0
        kwargs.update(file=_Discard(), mininterval=min(1.0, LINE_SECONDS), dynamic_ncols=False)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Log a line when it is due (``msg``, tqdm's clearing of a bar, has nothing to show)."""
        if msg is None:
            info = self.format_dict
            if info["n"] != self._shown and info["elapsed"] >= self._next_line:
                self._log(info)
                self._next_line = info["elapsed"] + LINE_SECONDS
        return True

    def close(self) -> None:
        """Log the final count if any line was logged and the count moved since."""
        if not self.disable and self._lines and self._shown != self.n:
            self._log(self.format_dict)
        super().close()

    def _log(self, info: dict[str, Any]) -> None:
        line_format = KNOWN_TOTAL if info["total"] else UNKNOWN_TOTAL
        logger.info(
            "%s", self.format_meter(**{**info, "bar_format": line_format, "prefix": info["prefix"] or "progress"})
        )
        self._shown = info["n"]
        self._lines += 1

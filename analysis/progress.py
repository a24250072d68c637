"""Whether a progress bar is shown: tqdm bars on every loop over data or work units, hidden when not a terminal."""

from __future__ import annotations

import sys


def progress_disabled(progress: bool | None) -> bool:
    """Whether to hide a progress bar: as asked, or (``None``) unless stderr is a terminal."""
    return not sys.stderr.isatty() if progress is None else not progress

"""What the command line logs on stderr: plain messages, levels only for warnings and errors."""

from __future__ import annotations

import logging
import sys


def setup_logging(quiet: bool = False, verbose: bool = False) -> None:
    """Log to stderr: plain messages, warnings and errors prefixed with their level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PlainFormatter())
    root = logging.getLogger("analysis")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    root.propagate = False


class _PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"

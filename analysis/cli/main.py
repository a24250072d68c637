"""Command line: ``run.py --config_path CFG [flags] [Section.key=value ...]`` (the main job), or ``run.py <command>
...`` for a subcommand of :mod:`analysis.cli.registry` (``plan``, ``verify``, ``report``, ``merge``, ``deps``).

Exit codes: 0 success, 1 internal error (with traceback), 2 bad input (one sentence, no traceback),
130 interrupted (SIGINT/Ctrl-C), 143 terminated (SIGTERM); finished results are saved either way.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from analysis.cli._exit import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USER_ERROR
from analysis.cli.registry import command_for
from analysis.errors import UserCodeError, UserError


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the run stops the way Ctrl-C stops it."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code.

    SIGINT and SIGTERM abandon the variant being evaluated: every finished one is already saved (atomically, after
    each), so rerunning the same command resumes where it stopped.
    """
    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    try:
        command, arguments = command_for(sys.argv[1:] if argv is None else argv)
        return command.run(arguments)
    except UserError as error:
        if isinstance(error, UserCodeError):
            print(error.user_traceback, end="", file=sys.stderr)
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        print(f"{'terminated' if terminated else 'interrupted'}: every finished (param, ratio) is saved; run the same "
              "command again to resume.", file=sys.stderr)  # fmt: skip
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()

"""One writer per analysis file: a lock file beside it names its owner; a dead owner's lock is taken over.

Two runs writing the same analysis file would each save their own view of it after every unit and lose the other's
results, so the second run refuses to start. The lock file ``<analysis_file>.lock`` is created atomically (written
under a temporary name, then hard-linked into place, which fails if it exists) and holds the owner's host, pid and
process start time; the start time tells a live owner from a new process that reused a dead owner's pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from analysis.errors import AnalysisFileError, output_error
from analysis.io.atomic import writable_folder

logger = logging.getLogger(__name__)


def lock_path(analysis_file: str | os.PathLike[str]) -> Path:
    """Return the lock file of an analysis file: ``s.pkl`` -> ``s.pkl.lock``."""
    path = Path(analysis_file)
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def exclusive(analysis_file: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold the lock of ``analysis_file`` for the block; removed on exit (also on errors and interrupts).

    Raises:
        AnalysisFileError: Another live process (or a process on another host) holds the lock.
    """
    lock = lock_path(analysis_file)
    writable_folder(lock.parent)
    owner = _owner_record()
    try:
        _acquire(lock, owner)
    except OSError as error:
        raise output_error(lock, error) from None
    try:
        yield lock
    finally:
        if _read(lock) == owner:  # never remove a lock somebody else took over
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def check_unlocked(analysis_file: str | os.PathLike[str]) -> None:
    """Refuse early, before loading a model and data, when a live process holds the lock of ``analysis_file`` (the
    lock itself is taken later, by :func:`exclusive`, which checks again).

    Raises:
        AnalysisFileError: Another live process (or a process on another host) holds the lock.
    """
    lock = lock_path(analysis_file)
    holder = _read(lock)
    if holder is not None and _alive(holder):
        _refuse(lock, holder)


def _refuse(lock: Path, holder: dict[str, Any]) -> None:
    raise AnalysisFileError(
        f"Analysis file {lock.with_suffix('')} is being written by process {holder.get('pid')} on "
        f"{holder.get('host')} (lock file {lock}); wait for it to finish, use another analysis_file, or "
        "delete the lock file if that process is gone."
    )


def _acquire(lock: Path, owner: dict[str, Any]) -> None:
    for _ in range(3):  # a stale lock removed concurrently by another starter is retried
        if _create(lock, owner):
            return
        holder = _read(lock)
        if holder is None:
            continue  # vanished (or was half-written by a crash) between our attempts: try again
        if _alive(holder):
            _refuse(lock, holder)
        logger.warning("Removing the stale lock %s of process %s, which is no longer running.", lock, holder.get("pid"))
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    raise AnalysisFileError(f"Could not take the lock file {lock}: other runs keep taking it; try again.")


def _create(lock: Path, owner: dict[str, Any]) -> bool:
    """Atomically create ``lock`` with ``owner`` as its content; False if it already exists."""
    temporary = lock.with_name(f".{lock.name}.{uuid.uuid4().hex}")
    temporary.write_text(json.dumps(owner) + "\n", encoding="utf-8")
    try:
        os.link(temporary, lock)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink()


def _read(lock: Path) -> dict[str, Any] | None:
    """The owner record in ``lock``; an unreadable lock counts as a dead owner's, None if there is no lock."""
    try:
        data = json.loads(lock.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"host": None, "pid": None}
    return data if isinstance(data, dict) else {"host": None, "pid": None}


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid)}


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the lock's owner still runs; an owner on another host is assumed to (it cannot be checked)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname():
        return holder.get("host") is not None
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    started = holder.get("started")
    return started is None or _start_time(pid) in (None, started)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to detect pid reuse; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])

"""Atomic file writes: a temporary file in the same folder, fsynced, renamed over the target, the folder fsynced;
a crash at any moment leaves the old file or the new one, never a mix."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import uuid
from pathlib import Path

from analysis.errors import output_error

logger = logging.getLogger(__name__)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see either the old or the new file, never a partial one.

    The bytes go to a uniquely named temporary file in the same directory, which is flushed and fsynced, renamed
    over the target with ``os.replace`` and made durable by fsyncing the directory. Parent directories are
    created. If anything fails the temporary file is removed and the previous file is left untouched.

    Raises:
        OutputError: If the file cannot be written (the path and the operating system's reason are named).
    """
    target = Path(path)
    writable_folder(target.parent)
    temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        # os.open applies the umask like a plain open() would; O_EXCL guarantees the name is ours alone.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as error:
        raise output_error(target, error) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(error, OSError):
            raise output_error(target, error) from None
        raise
    fsync_directory(target.parent)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files a killed :func:`atomic_write_bytes` of ``path`` left behind; returns them.

    Only safe while holding the file's lock (no live writer can own them)."""
    target = Path(path)
    stale = sorted(target.parent.glob(f".{glob.escape(target.name)}.*.tmp"))
    for temp in stale:
        with contextlib.suppress(OSError):
            temp.unlink()
    return stale


def writable_folder(folder: str | os.PathLike[str]) -> Path:
    """Create ``folder`` (and its parents) if needed and return it.

    Raises:
        OutputError: If it cannot be created (a path component is a file, no permission, read-only filesystem).
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise output_error(path, error) from None
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` as UTF-8 with :func:`atomic_write_bytes`; newlines are written exactly as given."""
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_directory(directory: Path) -> None:
    """Persist a rename; some platforms (Windows) and filesystems cannot fsync a directory, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        logger.debug("Could not fsync directory %s: %s", directory, error)
    finally:
        os.close(fd)

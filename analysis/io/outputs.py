"""Output paths checked before any work starts: every command names what it will write and checks it here first, so
a path it cannot write is refused before the model and the data load, and an error exit leaves no file changed.

The checks create nothing: a folder that does not exist yet is fine when its nearest existing ancestor is a folder
this process may write into (the writers create it later, see :mod:`analysis.io.atomic`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from analysis.config import Config
from analysis.errors import ConfigError, OutputError


def check_output_folder(folder: str | os.PathLike[str], key: str) -> Path:
    """Check that ``folder`` can hold new files: it is a writable folder, or can be created as one.

    Args:
        folder: The folder a command will write into.
        key: The config key or flag that named it, for the error message.

    Raises:
        ConfigError: If ``folder`` is empty (which would silently mean the current folder).
        OutputError: If it, or one of its parents, is a file, or the first existing one is not writable.
    """
    if not os.fspath(folder).strip():
        raise ConfigError(f"{key} is empty; name a folder (. for the current one).")
    return _check_creatable(Path(folder), Path(folder), key)


def check_output_file(path: str | os.PathLike[str], key: str) -> Path:
    """Check that ``path`` can be written (atomically, so its folder must be writable too) without writing it.

    Raises:
        ConfigError: If ``path`` is empty.
        OutputError: If it is a folder, or its folder cannot be written (see :func:`check_output_folder`).
    """
    if not os.fspath(path).strip():
        raise ConfigError(f"{key} is empty; name a file.")
    target = Path(path)
    if target.is_dir():
        raise _refusal(target, key, target, errno.EISDIR, "is a folder, not a file")
    return _check_creatable(target, target.parent, key)


def check_config_outputs(config: Config) -> None:
    """Check every path a run of ``config`` writes: the analysis file (its sidecar, ratios, plan and report go
    beside it) and the export folder."""
    s = config.SensitivityAnalysis
    if s.analysis_file is not None:
        check_output_file(s.analysis_file, "SensitivityAnalysis.analysis_file")
    if s.export_dir is not None:
        check_output_folder(s.export_dir, "SensitivityAnalysis.export_dir")


def _check_creatable(path: Path, folder: Path, key: str) -> Path:
    """``path`` once ``folder`` is a writable folder or its nearest existing ancestor is one that may hold it."""
    existing = folder
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise _refusal(path, key, existing, errno.ENOENT, "is a link to nothing")
    if not existing.is_dir():
        raise _refusal(path, key, existing, errno.ENOTDIR, "is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _refusal(path, key, existing, errno.EACCES, "is a folder this user cannot write into")
    return path


def _refusal(path: Path, key: str, culprit: Path, code: int, reason: str) -> OutputError:
    """Why ``path`` (named by ``key``) cannot be written: ``culprit``, itself or a parent, is in the way."""
    return OutputError(
        f"Cannot write {path} ({key}): {culprit} {reason} ({os.strerror(code)} [{errno.errorcode[code]}]); choose a "
        "writable location."
    )

"""Output paths checked before any work starts: every command names what it will write and checks it here first, so
a path it cannot write is refused before the model and the data load, and an error exit leaves no file changed.

The checks create nothing: a folder that does not exist yet is fine when its nearest existing ancestor is a folder
this process may write into (the writers create it later, see :mod:`analysis.io.atomic`)."""

from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

from analysis.config import Config
from analysis.errors import ConfigError, OutputError
from analysis.io.export_files import EXPORT_FILES
from analysis.io.results import sidecar_path


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


def check_config_outputs(config: Config, export_key: str = "SensitivityAnalysis.export_dir") -> None:
    """Check every path a run of ``config`` writes: the analysis file (its sidecar, ratios, plan and report go
    beside it; it is neither a file the run reads nor the sidecar of another analysis file) and the export folder,
    named by ``export_key`` (its files overwrite no input, analysis file or sidecar)."""
    s = config.SensitivityAnalysis
    inputs = config_inputs(config)
    if s.analysis_file is not None:
        check_output_file(s.analysis_file, "SensitivityAnalysis.analysis_file")
        check_overwrite(s.analysis_file, "SensitivityAnalysis.analysis_file", inputs, analysis_file=True)
        inputs["the analysis file"] = Path(s.analysis_file)
    if s.export_dir is not None:
        check_output_folder(s.export_dir, export_key)
        for name in EXPORT_FILES:
            check_overwrite(Path(s.export_dir) / name, export_key, inputs)


def config_inputs(config: Config) -> dict[str, Path]:
    """The files a run of ``config`` reads, by what they are (for messages): the config file, the model's code and
    weights, and the evaluation list. A relative path counts from the current folder, as everywhere."""
    g = config.Global
    inputs: dict[str, Path] = {}
    if config.source is not None:
        inputs["the config file"] = Path(config.source)
    code = (g.arch or "").rpartition(":")[0]
    if code.endswith(".py"):
        inputs["the model code of Global.arch"] = Path(code)
    folder = Path(g.model_dir) if g.model_dir else None
    for key in ("params_filename", "model_filename"):
        name = getattr(g, key)
        if name:
            inputs[f"the checkpoint of Global.{key}"] = folder / name if folder is not None else Path(name)
    if folder is not None:
        inputs["the checkpoint of Global.model_dir"] = folder
    if g.data_dir:
        inputs["the evaluation list of Global.val_list"] = Path(g.data_dir) / g.val_list
    return inputs


def check_overwrite(
    path: str | os.PathLike[str],
    key: str,
    inputs: Mapping[str, str | os.PathLike[str] | None] | None = None,
    *,
    analysis_file: bool = False,
) -> None:
    """Refuse an output path whose writing would destroy what the user still needs: a file the command reads (one
    of ``inputs``, by what it is), the sidecar of an analysis file, or an analysis file, unless the output is one
    itself (``analysis_file``: the main job resumes its own, ``merge`` may extend an input).

    Raises:
        OutputError: Naming the path, ``key`` (the flag or config key that named it) and what it is.
    """
    target = Path(path)
    for what, source in (inputs or {}).items():
        if source is not None and same_file(target, Path(source)):
            raise OutputError(f"Cannot write {path} ({key}): it is {what}, which this command reads; choose "
                              "another path.")  # fmt: skip
    owner = sidecar_owner(target)
    if owner is not None:
        raise OutputError(f"Cannot write {path} ({key}): it is the sidecar of the analysis file {owner} (its "
                          "metrics and settings); choose another path.")  # fmt: skip
    if not analysis_file and is_analysis_file(target):
        raise OutputError(f"Cannot write {path} ({key}): it is an analysis file, which this would overwrite; choose "
                          "another path.")  # fmt: skip


def check_replaceable_analysis(path: str | os.PathLike[str], key: str) -> None:
    """Refuse to replace an existing file that is not an analysis file with one (``run.py merge``'s OUTPUT).

    Raises:
        OutputError: If ``path`` exists and is no analysis file (a config, a CSV, ...).
    """
    target = Path(path)
    if target.exists() and not target.is_dir() and not is_analysis_file(target):
        raise OutputError(f"Cannot write {path} ({key}): it exists and is not an analysis file, which this would "
                          "replace; choose a new path (or an analysis file to replace).")  # fmt: skip


def is_analysis_file(path: Path) -> bool:
    """Whether ``path`` is an analysis file: a file with its sidecar beside it, or a pickle (protocol 2 or later, as
    this tool and PaddleSlim write them)."""
    if not path.is_file():
        return False
    if sidecar_path(path).is_file():
        return True
    try:
        with open(path, "rb") as handle:
            head = handle.read(2)
    except OSError:
        return False
    return len(head) == 2 and head[0] == PICKLE_MARK and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL


def sidecar_owner(path: Path) -> Path | None:
    """The analysis file whose sidecar ``path`` is (``s.pkl.json`` beside the analysis file ``s.pkl``), or None."""
    name = path.name.removesuffix(SIDECAR_SUFFIX)
    if name in (path.name, ""):
        return None
    owner = path.with_name(name)
    return owner if is_analysis_file(owner) else None


def same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file: the same file on disk (links included) when both exist, else the same
    absolute path."""
    try:
        if first.exists() and second.exists():
            return os.path.samefile(first, second)
        return first.resolve() == second.resolve()
    except (OSError, RuntimeError):  # a link loop
        return os.path.abspath(first) == os.path.abspath(second)


PICKLE_MARK = 0x80
"""The first byte of a pickle of protocol 2 or later (the second is the protocol)."""
SIDECAR_SUFFIX = ".json"


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

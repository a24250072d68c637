"""New versions of several files of one folder, written under temporary names and renamed into place together only
when every one of them is ready: an error (or a kill) before that leaves the folder as it was, and afterwards files
of an older set that the new one does not include are removed, so that no file of the old set stays beside the new.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from analysis.errors import output_error
from analysis.io.atomic import fsync_directory, writable_folder

logger = logging.getLogger(__name__)


class StagedFiles:
    """Files staged for one folder; :meth:`commit` puts them in place, leaving the context without it discards them.

    Use as a context manager::

        with StagedFiles(folder) as staged:
            staged.write_bytes("a.pt", data)
            exporter(staged.temporary("b.onnx"))  # a writer that creates its file itself
            staged.commit(replaces=("a.pt", "b.onnx", "c.json"))  # c.json of an older set is removed
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = writable_folder(folder)
        self._staged: dict[str, Path] = {}

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.discard()

    def temporary(self, name: str) -> Path:
        """A fresh temporary path in the folder for the new ``name`` (keeping its suffix, which some writers read);
        whatever is written there is ``name`` once committed."""
        path = Path(name)
        temp = self.folder / f".{path.stem}.{uuid.uuid4().hex}.tmp{path.suffix}"
        self._staged[name] = temp
        return temp

    def write_bytes(self, name: str, data: bytes) -> None:
        """Stage ``data`` as the new ``name``.

        Raises:
            OutputError: If it cannot be written (the folder is left as it was).
        """
        temp = self.temporary(name)
        try:
            with open(temp, "xb") as handle:
                handle.write(data)
        except OSError as error:
            raise output_error(self.folder / name, error) from None

    def write_text(self, name: str, text: str) -> None:
        """Stage ``text`` (UTF-8, newlines as given) as the new ``name``."""
        self.write_bytes(name, text.encode("utf-8"))

    def commit(self, replaces: Iterable[str] = ()) -> dict[str, Path]:
        """Put every staged file in place (each flushed to disk first), then remove the files named in ``replaces``
        (the whole set the folder may hold) that were not staged, with a log line each.

        Returns:
            The final path of every staged file, by name, in staging order.

        Raises:
            OutputError: If a staged file is missing or cannot be flushed (nothing was renamed yet).
        """
        for name, temp in self._staged.items():
            try:
                _flush(temp)
            except OSError as error:
                raise output_error(self.folder / name, error) from None
        placed = {}
        for name, temp in self._staged.items():
            placed[name] = self.folder / name
            os.replace(temp, placed[name])
        self._staged.clear()
        for name in replaces:
            stale = self.folder / name
            if name not in placed and (stale.is_file() or stale.is_symlink()):
                stale.unlink()
                logger.info("Removed %s: a file of an older export that this one does not write.", stale)
        fsync_directory(self.folder)
        return placed

    def discard(self) -> None:
        """Remove every staged file (none is left after :meth:`commit`)."""
        for temp in self._staged.values():
            with contextlib.suppress(OSError):
                temp.unlink()
        self._staged.clear()


def _flush(path: Path) -> None:
    """Make the content of ``path`` durable before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

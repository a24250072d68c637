"""The measured plan method's evaluations, kept so that a killed search resumes without measuring anything twice."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from analysis.errors import AnalysisFileError
from analysis.io import sidecar as schema
from analysis.io._fingerprint import json_fingerprint
from analysis.io.sidecar import Sidecar
from analysis.planning._joint import JointScore, Pick

logger = logging.getLogger(__name__)

Picks = dict[str, Pick]  # group key -> (ranking param, channels removed)


class SearchLog:
    """Every joint evaluation of measured searches, appended to ``<analysis_file>.search.jsonl`` (one JSON line,
    flushed and fsynced, per evaluation) and copied into the sidecar (``plan_search``) when a search ends.

    Evaluations are keyed by what determines their result (model, data, calibration images, channel ranking) and by
    the plan, not by the budget or the target, so searches for other targets reuse them too. A line a kill cut off
    is removed; the evaluation it held is simply made again.
    """

    def __init__(self, analysis_file: str | Path, key: Mapping[str, Any]) -> None:
        self.analysis_file = Path(analysis_file)
        self.path = search_log_path(analysis_file)
        self.description = dict(key)
        self.key = json_fingerprint(self.description)
        self.entries: list[dict[str, Any]] = [e for e in self._read() if e.get("key") == self.key]
        self._index = {self._id(e["setting"], e["picks"]): e for e in self.entries}
        self._earlier = set(self._index)  # measured by earlier runs (a killed one, or a search for another target)

    def _read(self) -> list[dict[str, Any]]:
        """The log's records; a last line without its newline (a write cut off by a kill) is cut from the file."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as error:
            raise AnalysisFileError(
                f"Search log {self.path} cannot be read ({error.strerror or error}); delete it to search afresh."
            ) from None
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) < len(raw):
            logger.info("%s: removing its last line, cut off by an interrupted write.", self.path)
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
        entries = []
        for number, line in enumerate(complete.splitlines(), start=1):
            try:
                entry = json.loads(line.decode("utf-8"))
                if not isinstance(entry, dict) or not {"key", "setting", "picks", "metrics"} <= entry.keys():
                    raise ValueError("not an evaluation record")
            except ValueError as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                raise AnalysisFileError(
                    f"Search log {self.path} line {number} is damaged ({error}); delete the file to search afresh."
                ) from None
            entries.append(entry)
        return entries

    @staticmethod
    def _id(setting: str, picks: Any) -> tuple[Any, ...]:
        return (setting, tuple(tuple(p) for p in sorted(picks)))

    @staticmethod
    def encode(picks: Picks) -> list[list[Any]]:
        """The JSON form of a plan: ``[group key, ranking param, count]`` of every pruned group, sorted."""
        return sorted([key, param, count] for key, (param, count) in picks.items() if count)

    def from_earlier_run(self, setting: str, picks: Picks) -> bool:
        """Whether an earlier run measured ``picks`` in ``setting``."""
        return self._id(setting, self.encode(picks)) in self._earlier

    def get(self, setting: str, picks: Picks) -> JointScore | None:
        """The stored measurement of ``picks`` in ``setting``, if any."""
        entry = self._index.get(self._id(setting, self.encode(picks)))
        if entry is None:
            return None
        return JointScore(dict(entry["metrics"]), entry["macs"], entry["params"], entry["seconds"])

    def add(self, setting: str, picks: Picks, score: JointScore) -> None:
        """Append a measurement to the log file (durably)."""
        entry = {"key": self.key, "setting": setting, "picks": self.encode(picks), "metrics": score.metrics,
                 "macs": score.macs, "params": score.params, "seconds": round(score.seconds, 3)}  # fmt: skip
        line = json.dumps(entry, allow_nan=False, ensure_ascii=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.entries.append(entry)
        self._index[self._id(setting, entry["picks"])] = entry

    def copy_to_sidecar(self) -> None:
        """Keep this key's evaluations in the sidecar too (``plan_search.<key>``: what they depend on, and each)."""
        sidecar = schema.load(self.analysis_file) or Sidecar()
        evaluations = [{k: v for k, v in entry.items() if k != "key"} for entry in self.entries]
        sidecar.keep_search_log(self.key, self.description, evaluations)
        schema.save(self.analysis_file, sidecar)


def search_log_path(analysis_file: str | Path) -> Path:
    """``<analysis_file>.search.jsonl``: the measured method's evaluations, one line each."""
    return Path(f"{analysis_file}.search.jsonl")

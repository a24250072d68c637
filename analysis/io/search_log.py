"""The measured plan method's evaluations, kept so that a killed search resumes without measuring anything twice.

Every line of the log is checked once, when the log is read, into an :class:`Evaluation` (records of other search
keys too: they stay in the file but are not used), so a hand-edited or damaged line stops the plan with one sentence
naming the line instead of a traceback halfway through the search.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.errors import AnalysisFileError
from analysis.io import sidecar as schema
from analysis.io.fingerprint import json_fingerprint
from analysis.io.sidecar import Sidecar

logger = logging.getLogger(__name__)

Pick = tuple[str, int]
"""How one group is pruned: the member whose criterion ranks the channels, and how many channels it removes."""
Picks = dict[str, Pick]  # group key -> (ranking param, channels removed)
Encoded = tuple[tuple[str, str, int], ...]  # a plan as the log stores it: (group key, ranking param, count), sorted
REQUIRED_METRICS = ("top1", "ce")  # what the search compares plans by


@dataclass(frozen=True)
class JointScore:
    """What one joint evaluation measured: the metrics of the jointly pruned model and its exact cost."""

    metrics: dict[str, float]
    macs: int
    params: int
    seconds: float


class DamagedRecord(ValueError):
    """A log line that is not an evaluation record; the message says what is wrong with it."""


@dataclass(frozen=True)
class Evaluation:
    """One line of the search log: a plan measured in one setting, and what it measured.

    Attributes:
        key: The search key (fingerprint of what the measurement depends on).
        setting: ``search`` (calibration subset) or ``full`` (every calibration image).
        picks: ``(group key, ranking param, channels removed)`` of every pruned group, sorted.
        metrics: The jointly pruned model's metrics (finite numbers; ``top1`` and ``ce`` at least).
        macs: Its exact MACs.
        params: Its exact parameter count.
        seconds: How long the evaluation took.
    """

    key: str
    setting: str
    picks: Encoded
    metrics: dict[str, float]
    macs: int
    params: int
    seconds: float

    @classmethod
    def from_json(cls, data: Any) -> Evaluation:
        """Check a parsed log line.

        Raises:
            DamagedRecord: Naming the field that is missing or wrong.
        """
        if not isinstance(data, dict):
            raise DamagedRecord(f"a JSON {_kind(data)}, not an evaluation record")
        missing = [name for name in ("key", "setting", "picks", "metrics", "macs", "params", "seconds")
                   if name not in data]  # fmt: skip
        if missing:
            raise DamagedRecord(f"no {', '.join(missing)}: not an evaluation record")
        return cls(
            key=_text(data["key"], "key"),
            setting=_text(data["setting"], "setting"),
            picks=_picks(data["picks"]),
            metrics=_metrics(data["metrics"]),
            macs=_count(data["macs"], "macs"),
            params=_count(data["params"], "params"),
            seconds=_number(data["seconds"], "seconds"),
        )

    def to_json(self) -> dict[str, Any]:
        """The record as the log writes it."""
        return {
            "key": self.key,
            "setting": self.setting,
            "picks": [list(pick) for pick in self.picks],
            "metrics": dict(self.metrics),
            "macs": self.macs,
            "params": self.params,
            "seconds": self.seconds,
        }

    def score(self) -> JointScore:
        """What the evaluation measured."""
        return JointScore(dict(self.metrics), self.macs, self.params, self.seconds)


def _kind(value: Any) -> str:
    """The JSON name of ``value``'s type, for messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """``value`` for a one-line message: JSON with every non-ASCII character escaped, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise DamagedRecord(f"{field} is {_shown(value)}, not a string")
    return value


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DamagedRecord(f"{field} is {_shown(value)}, not a whole number >= 0")
    return value


def _number(value: Any, field: str) -> float:
    """A finite JSON number (ints are kept as written: the log round-trips exactly)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DamagedRecord(f"{field} is {_shown(value)}, not a number")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        finite = False
    if not finite:
        raise DamagedRecord(f"{field} is {_shown(value)}, not a finite number")
    return value


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise DamagedRecord(f"metrics is {_shown(value)}, not an object")
    metrics = {name: _number(number, f"metrics[{_shown(name)}]") for name, number in value.items()}
    missing = [name for name in REQUIRED_METRICS if name not in metrics]
    if missing:
        raise DamagedRecord(f"metrics has no {', '.join(missing)}")
    return metrics


def _picks(value: Any) -> Encoded:
    if not isinstance(value, list):
        raise DamagedRecord(f"picks is {_shown(value)}, not a list of [group, param, count]")
    picks: list[tuple[str, str, int]] = []
    for index, pick in enumerate(value):
        field = f"picks[{index}]"
        if not (isinstance(pick, list) and len(pick) == 3 and isinstance(pick[0], str) and isinstance(pick[1], str)):
            raise DamagedRecord(f"{field} is {_shown(pick)}, not [group, param, count]")
        group, param, count = pick
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DamagedRecord(f"{field} removes {_shown(count)} channels, not a whole number >= 1")
        if any(group == earlier for earlier, _, _ in picks):
            raise DamagedRecord(f"picks names group {_shown(group)} twice")
        picks.append((group, param, count))
    return tuple(sorted(picks))


def _refuse_constant(name: str) -> Any:
    """``json.loads`` hook for the non-standard tokens Python would accept (``NaN``, ``Infinity``)."""
    raise DamagedRecord(f"{name} is not a JSON number")


def parse_line(line: bytes) -> Evaluation:
    """One log line (without its newline) as an :class:`Evaluation`.

    Raises:
        DamagedRecord: Not UTF-8, not JSON (or JSON with ``NaN``/``Infinity``), or not an evaluation record.
    """
    try:
        data = json.loads(line.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise DamagedRecord("JSON nested too deeply") from None
    except DamagedRecord:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedRecord(str(error)) from None
    except ValueError:  # Python's limit on the digits of an integer it converts
        raise DamagedRecord(f"an integer with more than {sys.get_int_max_str_digits()} digits") from None
    return Evaluation.from_json(data)


class SearchLog:
    """Every joint evaluation of measured searches, appended to ``<analysis_file>.search.jsonl`` (one JSON line,
    flushed and fsynced, per evaluation) and copied into the sidecar (``plan_search``) when a search ends.

    Evaluations are keyed by what determines their result (model, data, calibration images, channel ranking) and by
    the plan, not by the budget or the target, so searches for other targets reuse them too. A line a kill cut off
    is removed; the evaluation it held is simply made again.

    Raises:
        AnalysisFileError: The log cannot be read, or a line (of any search key) is not a valid evaluation record;
            the message names the file and the line. The file is left as it was.
    """

    def __init__(self, analysis_file: str | Path, key: Mapping[str, Any]) -> None:
        self.analysis_file = Path(analysis_file)
        self.path = search_log_path(analysis_file)
        self.description = dict(key)
        self.key = json_fingerprint(self.description)
        self.entries: list[Evaluation] = [e for e in self._read() if e.key == self.key]
        self._index = {(e.setting, e.picks): e for e in self.entries}
        self._earlier = set(self._index)  # measured by earlier runs (a killed one, or a search for another target)

    def _read(self) -> list[Evaluation]:
        """Every record of the log; a last line without its newline (a write cut off by a kill) is cut from the
        file once the complete lines are known to be sound."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as error:
            raise AnalysisFileError(
                f"Search log {self.path} cannot be read ({error.strerror or error}); delete it to search afresh."
            ) from None
        complete = raw[: raw.rfind(b"\n") + 1]
        entries = []
        for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
            try:
                entries.append(parse_line(line))
            except DamagedRecord as error:
                raise AnalysisFileError(
                    f"Search log {self.path} line {number} is damaged ({error}); delete the file to search afresh."
                ) from None
        if len(complete) < len(raw):
            logger.info("%s: removing its last line, cut off by an interrupted write.", self.path)
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
        return entries

    @staticmethod
    def plan(picks: Picks) -> Encoded:
        """A plan as the log stores it: ``(group key, ranking param, count)`` of every pruned group, sorted."""
        return tuple(sorted((key, param, count) for key, (param, count) in picks.items() if count))

    def from_earlier_run(self, setting: str, picks: Picks) -> bool:
        """Whether an earlier run measured ``picks`` in ``setting``."""
        return (setting, self.plan(picks)) in self._earlier

    def get(self, setting: str, picks: Picks) -> JointScore | None:
        """The stored measurement of ``picks`` in ``setting``, if any."""
        entry = self._index.get((setting, self.plan(picks)))
        return None if entry is None else entry.score()

    def add(self, setting: str, picks: Picks, score: JointScore) -> None:
        """Append a measurement to the log file (durably)."""
        entry = Evaluation(self.key, setting, self.plan(picks), dict(score.metrics), score.macs, score.params,
                           round(score.seconds, 3))  # fmt: skip
        line = json.dumps(entry.to_json(), allow_nan=False, ensure_ascii=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.entries.append(entry)
        self._index[(setting, entry.picks)] = entry

    def copy_to_sidecar(self) -> None:
        """Keep this key's evaluations in the sidecar too (``plan_search.<key>``: what they depend on, and each)."""
        sidecar = schema.load(self.analysis_file) or Sidecar()
        evaluations = [{k: v for k, v in entry.to_json().items() if k != "key"} for entry in self.entries]
        sidecar.keep_search_log(self.key, self.description, evaluations)
        schema.save(self.analysis_file, sidecar)


def search_log_path(analysis_file: str | Path) -> Path:
    """``<analysis_file>.search.jsonl``: the measured method's evaluations, one line each."""
    return Path(f"{analysis_file}.search.jsonl")

"""The latency table of a model on one runtime: the whole model's measured latency dense and with one group of coupled
units pruned at each probed channel count, cached in a JSON file so that a killed build resumes where it stopped
and a later plan on the same runtime, device, input and batch measures nothing again. A layer-level table also keeps
the latency of each conv/linear layer shape it measured (its probes are the dense latency minus the summed savings).

The file ``<analysis file>.latency-<key hash>.json`` holds one table; its ``key`` (everything the numbers depend on:
the runtime's settings, host, input shape, batch size, model fingerprint, and ``table: layers`` for a layer-level
table; see :func:`analysis.planning.probes.table_key`) must match, else the file belongs to another setting and is not
read. A file with the key is checked entry by entry when read (:func:`load_table`), so a damaged or hand-edited table
is refused by name instead of planned with.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.errors import AnalysisFileError
from analysis.io.atomic import atomic_write_text
from analysis.io.fingerprint import json_fingerprint


@dataclass
class LatencyTable:
    """Measured latencies of one model on one runtime setting.

    Attributes:
        key: What the numbers depend on (runtime, device, input shape, batch, model fingerprint).
        dense_ms: The unpruned model's latency (None until measured).
        probes: ``{group key: {channels removed: latency ms}}`` with only that group pruned.
        layers: ``{layer shape: latency ms}`` of single layers (a layer-level table only; empty otherwise).
        references: Per probe (``group@count``, :func:`probe_id`) or pruned layer shape, ``(what, ms)``: the unpruned
            model (``model``: the mean of its timings just before and just after the probe) or the layer shape
            measured just before it. Savings are taken relative to it, so a machine that slows down or speeds up
            during the build (other jobs) does not turn into savings.
        spreads: Per probe, the noise of its saving in ms: how far apart the dense timings around it were. A probe
            whose saving is within it (:meth:`within_noise`) was measured again, and is counted in the build's log.
    """

    key: dict[str, Any]
    dense_ms: float | None = None
    probes: dict[str, dict[int, float]] = field(default_factory=dict)
    layers: dict[str, float] = field(default_factory=dict)
    references: dict[str, tuple[str, float]] = field(default_factory=dict)
    spreads: dict[str, float] = field(default_factory=dict)

    def measured(self, group: str, count: int) -> bool:
        """Whether the probe of ``group`` at ``count`` is in the table."""
        return count in self.probes.get(group, {})

    def saving(self, group: str, count: int) -> float:
        """Latency saved (ms) with ``group`` alone at ``count`` channels removed: measured at the probed counts,
        linear in between (0 at 0; the largest probe beyond it)."""
        if count <= 0 or self.dense_ms is None:
            return 0.0
        points = [(0, 0.0), *sorted((c, self.probe_saving(group, c)) for c in self.probes.get(group, {}))]
        for (low, low_saving), (high, high_saving) in itertools.pairwise(points):
            if count <= high:
                return low_saving + (high_saving - low_saving) * (count - low) / (high - low)
        return points[-1][1]

    def probe_saving(self, group: str, count: int) -> float:
        """What the probe of ``group`` at ``count`` saved: the dense latency times the fraction the probe saved
        against the whole model measured just before it (the plain difference for probes without one)."""
        assert self.dense_ms is not None
        return relative_saving(self.dense_ms, self.probes[group][count], self.references.get(probe_id(group, count)),
                               "model")  # fmt: skip

    def spread(self, group: str, count: int) -> float | None:
        """The noise (ms, on the table's dense latency) of the saving of ``group`` at ``count``; None when the probe
        recorded none (a layer-level table's, or a probe of an older build)."""
        spread = self.spreads.get(probe_id(group, count))
        reference = self.references.get(probe_id(group, count))
        if spread is None or self.dense_ms is None or reference is None:
            return None
        return spread * self.dense_ms / reference[1]

    def within_noise(self, group: str, count: int) -> bool:
        """Whether the probe of ``group`` at ``count`` saved no more (or lost no more) than its noise."""
        spread = self.spread(group, count)
        return spread is not None and abs(self.probe_saving(group, count)) <= spread

    def unreadable(self, group: str, count: int) -> bool:
        """Whether ``count`` channels of ``group``, fewer than its largest probe, would save no more than that probe's
        noise if the saving is linear in the count: such a count is not probed (its saving could not be read one at a
        time) but estimated, linear in the count, and a plan may take it (:meth:`offers`)."""
        largest = max(self.probes.get(group) or [0])
        if count >= largest:
            return False
        spread = self.spread(group, largest)
        return spread is not None and abs(self.probe_saving(group, largest)) * count / largest <= spread

    def offers(self, group: str, count: int, between: bool = False) -> bool:
        """Whether a plan may remove ``count`` channels of ``group`` on this table: a probed count, a smaller one whose
        saving is below the noise (:meth:`unreadable`, interpolated), or, when ``between``, any count up to the largest
        probe (counts kept aligned, where latency runs smoothly in the count)."""
        found = self.probes.get(group)
        if not found:
            return False
        return count in found or ((between or self.unreadable(group, count)) and 0 < count <= max(found))

    def layer_saving(self, dense: str, pruned: str) -> float:
        """What pruning the layer of shape ``dense`` to shape ``pruned`` saves, relative to ``dense`` measured just
        before ``pruned`` when it was (else the plain difference)."""
        return relative_saving(self.layers[dense], self.layers[pruned], self.references.get(pruned), dense)

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        data: dict[str, Any] = {
            "key": self.key,
            "dense_ms": self.dense_ms,
            "probes": {group: {str(c): ms for c, ms in sorted(by.items())} for group, by in self.probes.items()},
        }
        if self.layers:
            data["layers"] = dict(self.layers)
        if self.references:
            data["references"] = {name: list(reference) for name, reference in self.references.items()}
        if self.spreads:
            data["spreads"] = dict(self.spreads)
        return data


def probe_id(group: str, count: int) -> str:
    """A probe's name in :attr:`LatencyTable.references`."""
    return f"{group}@{count}"


def relative_saving(dense_ms: float, pruned_ms: float, reference: tuple[str, float] | None, of: str) -> float:
    """``dense_ms`` minus ``pruned_ms``, with ``pruned_ms`` first rescaled by ``dense_ms / reference`` when
    ``reference`` is a measurement of ``of`` taken next to it (the machine's speed at that moment cancels)."""
    if reference is None or reference[0] != of or not reference[1] > 0:
        return dense_ms - pruned_ms
    return dense_ms * (1.0 - pruned_ms / reference[1])


def table_path(analysis_file: str | os.PathLike[str], key: dict[str, Any]) -> Path:
    """Where the table of ``key`` is cached, beside the analysis file."""
    path = Path(analysis_file)
    return path.with_name(f"{path.name}.latency-{json_fingerprint(key)[:12]}.json")


def load_table(path: Path, key: dict[str, Any], known: Mapping[str, range] | None = None) -> LatencyTable:
    """The cached table at ``path`` when it has ``key``, else an empty one.

    Every latency must be a finite positive number of ms (a layer-level table's probes, the dense latency minus
    summed layer savings, any finite number), every probe a group of ``known`` (``{group key: the channel counts a
    probe of it can remove}``; None: any) at one of its counts, and every reference a probe's or a layer's of the
    table.

    Raises:
        AnalysisFileError: If the file is not a latency table or holds an entry that is not one (damaged or written
            by something else), naming the file and the entry.
    """
    if not path.exists():
        return LatencyTable(dict(key))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise _damaged(path, f"it cannot be read as JSON ({error})") from None
    if not isinstance(data, dict):
        raise _damaged(path, "it is not a JSON object")
    if data.get("key") != json.loads(json.dumps(key)):
        return LatencyTable(dict(key))
    reader = _Reader(path, known)
    dense = data.get("dense_ms")
    layers = {name: reader.ms(ms, f"layers[{_quoted(name)}]") for name, ms in reader.section(data, "layers").items()}
    probes: dict[str, dict[int, float]] = {}
    derived = key.get("table") == LAYER_TABLE  # dense minus summed layer savings: any finite number
    for group in reader.section(data, "probes"):
        where = f"probes[{_quoted(group)}]"
        entries = reader.section(data["probes"], group, where)
        probes[reader.group(group, where)] = {
            reader.count(group, count, f"{where}[{_quoted(count)}]"): reader.ms(
                ms, f"{where}[{_quoted(count)}]", derived
            )
            for count, ms in entries.items()
        }
    stored = reader.section(data, "references")
    references = {name: reader.reference(name, reference, layers) for name, reference in stored.items()}
    spreads = {name: reader.spread(name, value, references) for name, value in reader.section(data, "spreads").items()}
    dense_ms = None if dense is None else reader.ms(dense, "dense_ms")
    return LatencyTable(dict(key), dense_ms, probes, layers, references, spreads)


LAYER_TABLE = "layers"
"""The ``table`` entry of a layer-level table's key."""

_COUNT = re.compile(r"[1-9][0-9]*")


class _Reader:
    """Checks the entries of one table file, raising :class:`AnalysisFileError` at the first that is wrong."""

    def __init__(self, path: Path, known: Mapping[str, range] | None) -> None:
        self.path, self.known = path, known

    def section(self, data: dict[str, Any], name: str, where: str | None = None) -> dict[str, Any]:
        """The object ``data[name]`` (empty when absent)."""
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise self.bad(where or name, f"is {_shown(value)}, not an object")
        return value

    def ms(self, value: Any, where: str, derived: bool = False) -> float:
        """A latency: a finite positive number (not a string, not a boolean); a ``derived`` one (a layer-level
        table's probe, the dense latency minus summed layer savings) may be 0 or less."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.bad(where, f"is {_shown(value)}, not a finite {'' if derived else 'positive '}number of ms")
        if value <= 0 and not derived:
            raise self.bad(where, f"is {_shown(value)}, not a finite positive number of ms")
        return float(value)

    def group(self, group: str, where: str) -> str:
        """A probed group: a prunable unit of the model (by its key)."""
        if self.known is not None and group not in self.known:
            raise self.bad(where, "names no prunable unit of this model")
        return group

    def count(self, group: str, count: str, where: str) -> int:
        """A probe's channel count: a whole number the group can lose."""
        allowed = self.known.get(group) if self.known is not None else None
        if not _COUNT.fullmatch(count) or (allowed is not None and int(count) not in allowed):
            limits = "" if allowed is None else f" ({_counts(allowed)})"
            raise self.bad(where, f"is not a channel count a probe of {group} can remove{limits}")
        return int(count)

    def reference(self, name: str, value: Any, layers: Mapping[str, float]) -> tuple[str, float]:
        """What a probe (``group@count``: the model, ``model``) or a pruned layer shape (its dense shape, in
        ``layers``) was measured beside, and its latency."""
        where = f"references[{_quoted(name)}]"
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
            raise self.bad(where, f"is {_shown(value)}, not [what, ms]")
        what, ms = value
        group, _, count = name.rpartition("@")
        if name in layers:
            if what not in layers:
                raise self.bad(where, f"names {_shown(what)}, which is no layer shape of this table")
        elif what != "model":
            raise self.bad(where, "names no layer shape of this table")
        else:
            self.count(self.group(group, where), count, where)
        return what, self.ms(ms, f"{where}[1]")

    def spread(self, name: str, value: Any, references: Mapping[str, tuple[str, float]]) -> float:
        """A probe's noise: a finite number of ms, 0 or more, of a probe with a reference."""
        where = f"spreads[{_quoted(name)}]"
        if name not in references:
            raise self.bad(where, "names no probe of this table")
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
            raise self.bad(where, f"is {_shown(value)}, not a finite number of ms, 0 or more")
        return float(value)

    def bad(self, where: str, problem: str) -> AnalysisFileError:
        return _damaged(self.path, f"{where} {problem}")


def _damaged(path: Path, problem: str) -> AnalysisFileError:
    return AnalysisFileError(f"Latency table {path} is damaged: {problem}; delete the file to measure the table again.")


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _shown(value: Any) -> str:
    """``value`` as JSON would write it (NaN, true, "3"), shortened."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _counts(allowed: range) -> str:
    """The counts of ``allowed`` in words."""
    if not allowed:
        return "it has no channel to spare"
    if allowed.step == 1:
        return f"1 to {allowed[-1]}"
    return f"multiples of {allowed.step} up to {allowed[-1]}"


def save_table(path: Path, table: LatencyTable) -> None:
    """Write the table atomically (a kill leaves the previous complete file)."""
    atomic_write_text(path, json.dumps(table.to_json(), indent=1) + "\n")

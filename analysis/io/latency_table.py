"""The latency table of a model on one runtime: the whole model's measured latency dense and with one group of coupled
units pruned at each probed channel count, cached in a JSON file so that a killed build resumes where it stopped
and a later plan on the same runtime, device, input and batch measures nothing again. A layer-level table also keeps
the latency of each conv/linear layer shape it measured (its probes are the dense latency minus the summed savings).

The file ``<analysis file>.latency-<key hash>.json`` holds one table; its ``key`` (runtime, device, input shape,
batch size, model fingerprint, and ``table: layers`` for a layer-level table) must match, else the file belongs to
another setting and is not read.
"""

from __future__ import annotations

import itertools
import json
import os
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
            model (``model``) or layer shape measured just before it. Savings are taken relative to it, so a machine
            that slows down or speeds up during the build (other jobs) does not turn into savings.
    """

    key: dict[str, Any]
    dense_ms: float | None = None
    probes: dict[str, dict[int, float]] = field(default_factory=dict)
    layers: dict[str, float] = field(default_factory=dict)
    references: dict[str, tuple[str, float]] = field(default_factory=dict)

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


def load_table(path: Path, key: dict[str, Any]) -> LatencyTable:
    """The cached table at ``path`` when it has ``key``, else an empty one.

    Raises:
        AnalysisFileError: If the file is not a latency table (damaged or written by something else).
    """
    if not path.exists():
        return LatencyTable(dict(key))
    try:
        data = json.loads(path.read_text())
        if data.get("key") != json.loads(json.dumps(key)):
            return LatencyTable(dict(key))
        dense = data.get("dense_ms")
        probes = {
            str(group): {int(count): float(ms) for count, ms in counts.items()}
            for group, counts in data.get("probes", {}).items()
        }
        layers = {str(shape): float(ms) for shape, ms in data.get("layers", {}).items()}
        references = {str(name): (str(what), float(ms)) for name, (what, ms) in data.get("references", {}).items()}
        return LatencyTable(dict(key), None if dense is None else float(dense), probes, layers, references)
    except (ValueError, TypeError, AttributeError) as error:
        raise AnalysisFileError(
            f"Latency table {path} is damaged ({error}); delete it to measure the table again."
        ) from None


def save_table(path: Path, table: LatencyTable) -> None:
    """Write the table atomically (a kill leaves the previous complete file)."""
    atomic_write_text(path, json.dumps(table.to_json(), indent=1) + "\n")

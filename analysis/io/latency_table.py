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
    """

    key: dict[str, Any]
    dense_ms: float | None = None
    probes: dict[str, dict[int, float]] = field(default_factory=dict)
    layers: dict[str, float] = field(default_factory=dict)

    def measured(self, group: str, count: int) -> bool:
        """Whether the probe of ``group`` at ``count`` is in the table."""
        return count in self.probes.get(group, {})

    def saving(self, group: str, count: int) -> float:
        """Latency saved (ms) with ``group`` alone at ``count`` channels removed: measured at the probed counts,
        linear in between (0 at 0; the largest probe beyond it)."""
        if count <= 0 or self.dense_ms is None:
            return 0.0
        points = [(0, 0.0), *sorted((c, self.dense_ms - ms) for c, ms in self.probes.get(group, {}).items())]
        for (low, low_saving), (high, high_saving) in itertools.pairwise(points):
            if count <= high:
                return low_saving + (high_saving - low_saving) * (count - low) / (high - low)
        return points[-1][1]

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        data: dict[str, Any] = {
            "key": self.key,
            "dense_ms": self.dense_ms,
            "probes": {group: {str(c): ms for c, ms in sorted(by.items())} for group, by in self.probes.items()},
        }
        if self.layers:
            data["layers"] = dict(self.layers)
        return data


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
        return LatencyTable(dict(key), None if dense is None else float(dense), probes, layers)
    except (ValueError, TypeError, AttributeError) as error:
        raise AnalysisFileError(
            f"Latency table {path} is damaged ({error}); delete it to measure the table again."
        ) from None


def save_table(path: Path, table: LatencyTable) -> None:
    """Write the table atomically (a kill leaves the previous complete file)."""
    atomic_write_text(path, json.dumps(table.to_json(), indent=1) + "\n")

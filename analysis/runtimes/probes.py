"""Measuring a latency table: the whole model on the runtime, dense and with each group of coupled units pruned alone
at each channel count the analysis measured (whole-model probes: they include whatever the runtime fuses, pads or
schedules around the pruned layers, which a per-layer table would miss). Every probe is saved to the table's file as
it finishes, so a killed build resumes without measuring again."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from analysis.io.fingerprint import json_fingerprint, model_fingerprint
from analysis.io.latency_table import LatencyTable, load_table, probe_id, save_table, table_path
from analysis.planning.plan import Planner
from analysis.progress import progress_bar
from analysis.runtimes.runtime import Runtime
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)


def table_key(runtime: Runtime, model: nn.Module, sample_shape: Sequence[int], batch: int) -> dict[str, object]:
    """What a table's numbers depend on: the runtime's settings (:meth:`Runtime.settings`: its version, device,
    threads, a command's template and pattern...), the machine (a table measured elsewhere does not hold here), the
    input, the batch, the model's weights and its layers' settings (strides, kernels, activations: ``repr``)."""
    return {
        **runtime.settings(),
        "host": platform.node(),
        "input": list(sample_shape),
        "batch": batch,
        "model": model_fingerprint(model),
        "architecture": json_fingerprint(repr(model)),
    }


def open_table(
    planner: Planner, runtime: Runtime, batch: int, analysis_file: str | Path, kind: str | None = None
) -> tuple[LatencyTable, Path]:
    """The cached table of ``planner``'s model on ``runtime`` at ``batch`` beside ``analysis_file`` (empty when
    there is none), and its file; ``kind`` (e.g. ``layers``) joins the key, so tables of other kinds never mix."""
    key = table_key(runtime, planner.model, tuple(planner.example_input.shape[1:]), batch)
    if kind is not None:
        key["table"] = kind
    path = table_path(analysis_file, key)
    return load_table(path, key, planner.probe_limits()), path


def measure_dense(table: LatencyTable, path: Path, planner: Planner, runtime: Runtime, batch: int) -> float:
    """The whole dense model's latency in ``table``, measured into it (and its file) unless it is there already."""
    if table.dense_ms is None:
        table.dense_ms = runtime.measure(planner.model, tuple(planner.example_input.shape[1:]), batch).median_ms
        save_table(path, table)
    return table.dense_ms


def measure_table(
    planner: Planner,
    counts: Mapping[str, Sequence[int]],
    runtime: Runtime,
    batch: int,
    analysis_file: str | Path,
    progress: bool | None = None,
) -> tuple[LatencyTable, Path, float]:
    """The latency table of ``planner``'s model: read from its cache file, with the probes it lacks measured now.

    Args:
        planner: The plan's planner (model, example input, which channels a count removes).
        counts: Per group key, the channel counts to probe (:meth:`Planner.probe_counts`).
        runtime: Where latency is measured.
        batch: Images per call.
        analysis_file: The analysis file the cache file sits beside.
        progress: A bar with ETA on a terminal, periodic lines in a log (None: decide by the output).

    Returns:
        The table, its file, and the seconds spent measuring in this call.
    """
    model, example = planner.model, planner.example_input
    sample_shape = tuple(example.shape[1:])
    table, path = open_table(planner, runtime, batch, analysis_file)
    todo = [(group, count) for group, found in counts.items() for count in found if not table.measured(group, count)]
    start = time.perf_counter()
    if table.dense_ms is None or todo:
        done = sum(len(found) for found in counts.values()) - len(todo)
        logger.info(
            "Latency table on %s (batch %d): %d probe(s) to measure%s.", runtime.device, batch, len(todo),
            f", {done} cached in {path.name}" if done else "",
        )  # fmt: skip
    measure_dense(table, path, planner, runtime, batch)
    with progress_bar(progress, total=len(todo), desc="latency table", unit="probe") as bar:
        reference, last_group = 0.0, None
        for group, count in todo:
            if group != last_group:  # the dense model again next to each group's probes: savings are relative to it
                reference, last_group = runtime.measure(model, sample_shape, batch).median_ms, group
            member = planner.by_name[group]
            removal = [(member.module_name, planner.removed(group, count))]
            copy = jointly_pruned_copy(model, removal, example)
            table.probes.setdefault(group, {})[count] = runtime.measure(copy.eval(), sample_shape, batch).median_ms
            table.references[probe_id(group, count)] = ("model", reference)
            save_table(path, table)  # a kill loses at most the probe in progress
            bar.update(1)
    return table, path, time.perf_counter() - start

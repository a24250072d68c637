"""Measuring a latency table: the whole model on the runtime, dense and with each group of coupled units pruned alone
at each channel count the analysis measured (whole-model probes: they include whatever the runtime fuses, pads or
schedules around the pruned layers, which a per-layer table would miss). Every probe is saved to the table's file as
it finishes, so a killed build resumes without measuring again.

The dense model is prepared once (exported, one session) for the whole table, and every probe is timed between two
timings of it (:func:`~analysis.runtimes.compare.bracket`, consecutive probes sharing the dense timing between
them): its saving is relative to their mean, their disagreement is its recorded noise, and a probe whose dense
timings drift beyond the tolerance, or whose saving is within its noise, is measured again (bounded).

Each group is probed at its largest count first. Most groups of a real model save too little to read one at a time:
a smaller count whose saving, scaled linearly from the largest probe's, is within that probe's noise is not probed
(it could not be read) but estimated, linear in the count, and a plan may take it
(:meth:`~analysis.io.latency_table.LatencyTable.unreadable`). On MobileNetV2 at onnxruntime batch 32 (2-core CPU,
2026-11-28) most groups saved 1-5% of the latency with a noise of 1-5% a probe: that table would have skipped 7 of its
20 half-count probes by this rule (the rule before skipped only groups whose largest probe was itself within the
noise)."""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from analysis.io.fingerprint import json_fingerprint, model_fingerprint
from analysis.io.latency_table import LatencyTable, load_table, probe_id, save_table, table_path
from analysis.planning.latency import LatencyRuntime
from analysis.planning.plan import Planner
from analysis.progress import progress_bar
from analysis.runtimes.compare import TOLERANCE, TRIES, Bracketed, bracket
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)


def table_key(runtime: LatencyRuntime, model: nn.Module, sample_shape: Sequence[int], batch: int) -> dict[str, object]:
    """What a table's numbers depend on: the runtime's settings (:meth:`LatencyRuntime.settings`: its version, device,
    threads, a command's template and pattern...), the machine (a table measured elsewhere does not hold here), the
    input, the batch, the model's weights and its layers' settings (strides, kernels, activations: ``repr``)."""
    return {
        **runtime.settings(),
        "probes": "bracketed",  # each probe between two dense timings, with its noise (tables before had neither)
        "host": platform.node(),
        "input": list(sample_shape),
        "batch": batch,
        "model": model_fingerprint(model),
        "architecture": json_fingerprint(repr(model)),
    }


def open_table(
    planner: Planner, runtime: LatencyRuntime, batch: int, analysis_file: str | Path, kind: str | None = None
) -> tuple[LatencyTable, Path]:
    """The cached table of ``planner``'s model on ``runtime`` at ``batch`` beside ``analysis_file`` (empty when
    there is none), and its file; ``kind`` (e.g. ``layers``) joins the key, so tables of other kinds never mix."""
    key = table_key(runtime, planner.model, tuple(planner.example_input.shape[1:]), batch)
    if kind is not None:
        key["table"] = kind
    path = table_path(analysis_file, key)
    return load_table(path, key, planner.probe_limits()), path


def measure_dense(table: LatencyTable, path: Path, planner: Planner, runtime: LatencyRuntime, batch: int) -> float:
    """The whole dense model's latency in ``table``, measured into it (and its file) unless it is there already."""
    if table.dense_ms is None:
        table.dense_ms = runtime.measure(planner.model, tuple(planner.example_input.shape[1:]), batch).median_ms
        save_table(path, table)
    return table.dense_ms


def measure_table(
    planner: Planner,
    counts: Mapping[str, Sequence[int]],
    runtime: LatencyRuntime,
    batch: int,
    analysis_file: str | Path,
    progress: bool | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[LatencyTable, Path, float]:
    """The latency table of ``planner``'s model: read from its cache file, with the probes it lacks measured now.

    Args:
        planner: The plan's planner (model, example input, which channels a count removes).
        counts: Per group key, the channel counts to probe (:meth:`Planner.probe_counts`).
        runtime: Where latency is measured.
        batch: Images per call.
        analysis_file: The analysis file the cache file sits beside.
        progress: A bar with ETA on a terminal, periodic lines in a log (None: decide by the output).
        tolerance: Largest drift of the dense timings around a probe (``SensitivityAnalysis.latency_tolerance``).

    Returns:
        The table, its file, and the seconds spent measuring in this call.
    """
    model, example = planner.model, planner.example_input
    sample_shape = tuple(example.shape[1:])
    table, path = open_table(planner, runtime, batch, analysis_file)
    # each group's largest count first: when its saving is below the noise, the smaller ones are estimated instead
    todo = [(group, count) for group, found in counts.items() for count in sorted(found, reverse=True)
            if not table.measured(group, count)]  # fmt: skip
    start = time.perf_counter()
    if table.dense_ms is None or todo:
        done = sum(len(found) for found in counts.values()) - len(todo)
        logger.info(
            "Latency table on %s (batch %d): %d probe(s) to measure%s.", runtime.device, batch, len(todo),
            f", {done} cached in {path.name}" if done else "",
        )  # fmt: skip
    noisy = drifted = skipped = 0
    with runtime.prepare(model, sample_shape) as dense:
        last_dense: float | None = None  # a cached dense latency is from another time: not a reference now
        if table.dense_ms is None:
            table.dense_ms = last_dense = dense.time(batch).median_ms
            save_table(path, table)
        with progress_bar(progress, total=len(todo), desc="latency table", unit="probe") as bar:
            for group, count in todo:
                if table.unreadable(group, count):
                    skipped += 1  # its saving, scaled from the largest probe's, is within that probe's noise
                    bar.update(1)
                    continue
                member = planner.by_name[group]
                copy = jointly_pruned_copy(model, [(member.module_name, planner.removed(group, count))], example)
                with runtime.prepare(copy, sample_shape) as probe:
                    found = bracket(dense, probe, batch, rounds=1, tolerance=tolerance, dense_before_ms=last_dense)
                    if found.steady(tolerance) and _within_noise(found):  # a saving too small to read: once more
                        found = found.joined(bracket(dense, probe, batch, rounds=1, tolerance=tolerance,
                                                     dense_before_ms=found.dense_ms[-1]))  # fmt: skip
                last_dense = found.dense_ms[-1]
                drifted += not found.steady(tolerance)
                noisy += _within_noise(found)
                table.probes.setdefault(group, {})[count] = found.candidate_median
                table.references[probe_id(group, count)] = ("model", statistics.mean(found.references))
                table.spreads[probe_id(group, count)] = round(found.spread_ms(), 6)
                save_table(path, table)  # a kill loses at most the probe in progress
                bar.update(1)
    if todo:
        logger.info(
            "Latency table: %d probe(s) measured in %.1f s; %d saved no more than their noise, %d on a machine that "
            "drifted beyond %.0f%% in %d tries; %d smaller count(s) whose saving, scaled from their group's largest "
            "probe, is within that probe's noise were estimated (linear in the count) instead of probed.",
            len(todo) - skipped, time.perf_counter() - start, noisy, drifted, 100 * tolerance, TRIES, skipped,
        )  # fmt: skip
    return table, path, time.perf_counter() - start


def _within_noise(found: Bracketed) -> bool:
    """Whether the probe's saving (against the mean of its dense timings) is no larger than their disagreement."""
    reference = statistics.mean(found.references)
    return abs(reference - found.candidate_median) <= found.spread_ms()

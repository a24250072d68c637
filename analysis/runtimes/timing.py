"""A robust latency from repeated calls: warm-up calls first, then timed calls until enough were made or the time
budget is spent; the median is the latency and the interquartile range its spread (both robust to the odd slow call
a shared machine produces).

Long calls (a large batch: MobileNetV2 at batch 32 takes about 350 ms a call on a 2-core CPU) are timed by time, not
by count: two warm-up calls and three timed ones are under 2 s of work, where the counts made for batch 1
(three warm-up calls, at least five timed, more while the machine is noisy) took over 3 s a timing and made a
batch-32 latency table cost more than the analysis it plans from."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

MIN_BLOCKS = 3
"""Timed blocks at least, however long they take (a median of fewer is one call's luck)."""


@dataclass(frozen=True)
class TimingPlan:
    """How a latency is measured.

    Attributes:
        warmup: Untimed calls first at most (allocations, kernel selection, caches).
        warmup_seconds: The warm-up ends early once it took this long: a fresh ONNX Runtime session of MobileNetV2
            at batch 32 ran its first calls 15% and 5% slower than the later ones, so two such calls suffice.
        repeats: Timed blocks at most.
        min_repeats: Timed blocks at least, unless they took ``enough_seconds``.
        budget_seconds: Time the timed blocks may take beyond ``min_repeats`` while they are not steady.
        enough_seconds: Timed blocks stop at three or more once they took this long: each is then a long average
            already, and more would make a large batch's timing cost seconds per call.
        block_seconds: Calls are timed in blocks of about this long, so a fast model's timing is not a single
            sub-millisecond call; a block's mean is one timing.
        steady: Stop after ``min_repeats`` blocks once their interquartile range is at most this fraction of their
            median (the latency is known well enough; a noisy machine keeps measuring up to the budget).
    """

    warmup: int = 3
    warmup_seconds: float = 0.5
    repeats: int = 20
    min_repeats: int = 5
    budget_seconds: float = 2.0
    enough_seconds: float = 1.0
    block_seconds: float = 0.02
    steady: float = 0.02


@dataclass(frozen=True)
class Latency:
    """One measured latency.

    Attributes:
        runtime: Which runtime measured it (``torch``, ``onnxruntime``, ``command``).
        device: Where it ran (``cpu``, ``cuda:0``, or the command's own target).
        batch: Images per call.
        median_ms: Median wall time of one call, in ms.
        spread_ms: Interquartile range of the timed calls, in ms (0 for a command, which reports one number).
        repeats: Timed calls.
    """

    runtime: str
    device: str
    batch: int
    median_ms: float
    spread_ms: float
    repeats: int

    def as_dict(self) -> dict[str, Any]:
        """The latency as JSON-ready data."""
        return asdict(self)


def time_calls(call: Callable[[], None], plan: TimingPlan = TimingPlan()) -> tuple[float, float, int]:
    """``(median ms, interquartile range ms, timed blocks)`` of ``call`` (which must wait for its own result, e.g.
    synchronise a GPU, so that the clock reads finished work); each timing is the mean call of a block."""
    single = warmed = 0.0
    for _ in range(max(1, plan.warmup)):
        start = time.perf_counter()
        call()
        single = time.perf_counter() - start
        warmed += single
        if warmed >= plan.warmup_seconds:
            break
    per_block = max(1, min(1000, math.ceil(plan.block_seconds / max(single, 1e-7))))
    times: list[float] = []
    spent = 0.0
    while len(times) < plan.repeats and (len(times) < plan.min_repeats or spent < plan.budget_seconds):
        if len(times) >= MIN_BLOCKS and spent >= plan.enough_seconds:
            break
        start = time.perf_counter()
        for _ in range(per_block):
            call()
        elapsed = time.perf_counter() - start
        times.append(elapsed / per_block * 1000.0)
        spent += elapsed
        if len(times) >= max(plan.min_repeats, 4) and _spread(times) <= plan.steady * statistics.median(times):
            break
    return round(statistics.median(times), 4), round(_spread(times), 4), len(times)


def _spread(times: list[float]) -> float:
    """The interquartile range (the range, for fewer than 4 timings)."""
    if len(times) >= 4:
        quartiles = statistics.quantiles(times, n=4)
        return quartiles[2] - quartiles[0]
    return max(times) - min(times)

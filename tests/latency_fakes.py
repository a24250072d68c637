"""Deterministic stand-ins for a latency runtime, shared by the latency tests."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from analysis import analysis_prune
from analysis.runtimes.runtime import Runtime
from analysis.runtimes.timing import Latency
from analysis.structure.flops import count_cost

from helpers import batches, pseudo_labelled


class MacsRuntime(Runtime):
    """A deterministic runtime: latency = a fixed overhead plus the model's MACs (in millions), optionally with an
    extra cost per conv whose channel count is not a multiple of ``multiple`` (as real kernels prefer aligned
    widths)."""

    name = "fake"
    device = "fake device"

    def __init__(
        self, example: torch.Tensor, misaligned_ms: float = 0.0, fail_after: int | None = None, power: float = 1.0,
        multiple: int = 4,
    ) -> None:  # fmt: skip
        self.example, self.misaligned_ms, self.fail_after, self.power = example, misaligned_ms, fail_after, power
        self.multiple = multiple
        self.calls = 0
        self._known: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...] | None, float]] = (
            weakref.WeakKeyDictionary()
        )

    def latency_of(self, model: nn.Module, sample_shape: Sequence[int] | None = None) -> float:
        key = None if sample_shape is None else tuple(sample_shape)
        known = self._known.setdefault(model, {})
        if key not in known:  # a model is timed many times (between the probes): count its MACs once
            known[key] = self._latency_of(model, sample_shape)
        return known[key]

    def _latency_of(self, model: nn.Module, sample_shape: Sequence[int] | None) -> float:
        sample = self.example[:1] if sample_shape is None else torch.zeros(1, *sample_shape)
        macs = count_cost(model, sample).macs
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        misaligned = sum(m.out_channels % self.multiple != 0 for m in convs)
        return 0.5 + (macs / 1e4) ** self.power + self.misaligned_ms * misaligned

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt  # the run is killed in the middle of the table
        return Latency(self.name, self.device, batch, self.latency_of(model, sample_shape), 0.0, 1)


def analysed(model: nn.Module, path: Path) -> Path:
    data = pseudo_labelled(model, batches(count=2))
    analysis_prune(model, data, path, pruned_ratios=(0.25, 0.5, 0.75), progress=False)
    return path


class DisturbedRuntime(MacsRuntime):
    """:class:`MacsRuntime` on a busy machine: each call's latency is the steady one times ``speed(call number)``
    (a drift, one slow call, random noise...), the call number counting from 1."""

    def __init__(self, example: torch.Tensor, speed: Callable[[int], float], power: float = 1.0) -> None:
        super().__init__(example, power=power)
        self.speed = speed

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        steady = super().measure(model, sample_shape, batch)
        return Latency(steady.runtime, steady.device, batch, steady.median_ms * self.speed(self.calls), 0.0, 1)

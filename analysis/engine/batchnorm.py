"""BatchNorm re-estimation of a pruned network (adaptive BN): fresh running statistics where pruning changed them.

Removing channels changes the values that reach every BatchNorm downstream of a layer that lost input channels, so
those layers' running statistics, estimated on the dense network, no longer fit: that, not the removed channels,
is what makes a jointly pruned BN network collapse. Here the affected layers (and only those) have their statistics
reset and re-estimated as cumulative averages over calibration batches, in train mode for those layers alone
(dropout, other BatchNorms and everything else stay in eval mode), under ``torch.no_grad()``; this is what
``torch.optim.swa_utils.update_bn`` does for every BN layer, restricted to the changed ones.

Which layers change is read from the Torch-Pruning dependency graph: the *sources* of a removal are the group's
members whose remaining outputs differ (consumers losing input slices, channel-normalising layers); every
BatchNorm reachable from a source is affected. Members that only lose channels (the pruned conv's own filters, its
BatchNorm, depthwise convs) keep the values of their remaining channels, so a BatchNorm that follows them directly
keeps its statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch_pruning as tp
from torch import nn

from analysis.progress import progress_bar
from analysis.structure.custom_layers import channel_pruner
from analysis.structure.groups import (
    PASS_THROUGH,
    build_dependency_graph,
    eval_mode,
    is_depthwise,
    is_out_channel_item,
    removal_group,
)
from analysis.structure.submodule_graphs import continuation

BatchNorm = nn.modules.batchnorm._BatchNorm
CalibrationBatch: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
"""A calibration batch: images, or ``(images, labels, ...)``."""

# Members whose remaining channels keep their values when some channels are removed.
_CHANNEL_PRESERVING = (BatchNorm, nn.PReLU, nn.Parameter)


def changed_sources(graph: tp.DependencyGraph, group: Iterable[Any]) -> list[nn.Module]:
    """The members of a removal group whose remaining outputs change: consumers that lose input channels,
    channel-normalising layers (LayerNorm/GroupNorm) and anything not known to preserve the remaining channels."""
    sources: list[nn.Module] = []
    for item in group:
        module = item.dep.target.module
        if not list(item.idxs) or isinstance(module, _CHANNEL_PRESERVING) or is_depthwise(module):
            continue
        if graph.module2node[module].type in PASS_THROUGH or channel_pruner(graph, module) is not None:
            continue  # op nodes, and customised layers (per-channel scales: remaining channels keep their values)
        if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)) and is_out_channel_item(graph, item):
            continue
        if module not in sources:
            sources.append(module)
    return sources


def downstream_batchnorms(graph: tp.DependencyGraph, sources: Iterable[nn.Module]) -> list[BatchNorm]:
    """Every BatchNorm (with running statistics) whose input depends on the output of one of ``sources``, in the
    graph's module order."""
    stack = [graph.module2node[module] for module in sources if module in graph.module2node]
    seen: set[tp.dependency.Node] = set()
    found: set[BatchNorm] = set()
    while stack:
        node = stack.pop()
        for user in (*node.outputs, *continuation(graph, node)):  # continuation: a model traced in parts
            if user in seen:
                continue
            seen.add(user)
            if isinstance(user.module, BatchNorm) and user.module.track_running_stats:
                found.add(user.module)
            stack.append(user)
    return [module for module in graph.model.modules() if module in found]


def affected_batchnorms(graph: tp.DependencyGraph, groups: Iterable[Iterable[Any]]) -> list[BatchNorm]:
    """The BatchNorm layers whose statistics the removal ``groups`` (applied together) change."""
    sources: list[nn.Module] = []
    for group in groups:
        sources.extend(m for m in changed_sources(graph, group) if m not in sources)
    return downstream_batchnorms(graph, sources)


def layers_in_copy(model: nn.Module, copy: nn.Module, layers: Iterable[BatchNorm]) -> list[BatchNorm]:
    """The layers of ``copy`` (a pruned deep copy of ``model``, same module names) that are ``layers`` in ``model``."""
    return batchnorms_named(copy, batchnorm_names(model, layers))


def batchnorm_names(model: nn.Module, layers: Iterable[nn.Module]) -> list[str]:
    """Module names of ``layers`` in ``model`` (model order), to find the same layers in a pruned copy."""
    wanted = set(layers)
    return [name for name, module in model.named_modules() if module in wanted]


def batchnorms_named(model: nn.Module, names: Iterable[str]) -> list[BatchNorm]:
    """The BatchNorm layers of ``model`` called ``names`` (names from :func:`batchnorm_names`, same order)."""
    layers: list[BatchNorm] = []
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, BatchNorm)
        layers.append(layer)
    return layers


@dataclass
class CalibrationStats:
    """What a re-estimation did: the layers reset and the calibration images seen."""

    layers: list[str]
    images: int


@contextmanager
def accumulating(layers: Sequence[BatchNorm]) -> Iterator[None]:
    """Within the block ``layers`` are in train mode with cumulative averaging (momentum None: every calibration
    batch weighs the same); each layer's own momentum and mode come back after it (also when the block raises)."""
    saved = [(layer, layer.momentum, layer.training) for layer in layers]
    try:
        for layer in layers:
            layer.momentum = None
            layer.train()
        yield
    finally:
        for layer, momentum, training in saved:
            layer.momentum = momentum
            layer.train(training)


@contextmanager
def statistics_kept(layers: Sequence[BatchNorm]) -> Iterator[None]:
    """The running statistics of ``layers`` are restored bit-exactly after the block (also when it raises)."""
    saved = [buffers_of(layer) for layer in layers]
    try:
        yield
    finally:
        for layer, state in zip(layers, saved, strict=True):
            load_buffers(layer, state)


def reestimate(
    model: nn.Module,
    layers: Sequence[BatchNorm],
    batches: Iterable[CalibrationBatch],
    max_batches: int | None = None,
    progress: bool | None = False,
) -> int:
    """Reset the running statistics of ``layers`` and re-estimate them as cumulative averages over ``batches``.

    Only ``layers`` run in train mode (each module keeps its own mode otherwise); nothing else changes, no gradient
    is computed. ``batches`` yields images or ``(images, labels)``. Returns the number of images seen. ``progress``:
    a bar (or log lines, :mod:`analysis.progress`) over the images; off by default, as inside an analysis.
    """
    if not layers:
        return 0
    images_seen = 0
    for layer in layers:
        layer.reset_running_stats()
    total = getattr(batches, "num_samples", None) if max_batches is None else None
    with (
        accumulating(layers),
        torch.no_grad(),
        progress_bar(progress, total=total, desc="BatchNorm re-estimation", unit="img", leave=False) as bar,
    ):
        for index, batch in enumerate(batches):
            if max_batches is not None and index >= max_batches:
                break
            images = batch_images(batch)
            model(images)
            images_seen += len(images)
            bar.update(len(images))
    return images_seen


@contextmanager
def reestimated(model: nn.Module, layers: Sequence[BatchNorm], batches: Iterable[CalibrationBatch]) -> Iterator[int]:
    """:func:`reestimate` for the duration of the block; the original statistics are restored bit-exactly after
    it (also when the block raises). Yields the number of calibration images seen."""
    with statistics_kept(layers):
        yield reestimate(model, layers, batches)


@contextmanager
def estimation_pass(layers: Sequence[BatchNorm]) -> Iterator[Callable[[], None]]:
    """For callers that run the calibration forward passes themselves (e.g. graph pieces): ``layers`` are reset and
    put in train mode with cumulative averaging; calling the yielded ``finish()`` puts them back in their own mode
    with the new statistics; after the block every statistic, momentum and mode is as before, bit-exactly."""
    with statistics_kept(layers), contextlib.ExitStack() as modes:
        for layer in layers:
            layer.reset_running_stats()
        modes.enter_context(accumulating(layers))
        yield modes.close


def batch_images(batch: CalibrationBatch) -> torch.Tensor:
    """The images of a calibration batch, given as ``images`` or ``(images, labels, ...)``."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def count_images(batches: Iterable[CalibrationBatch] | None) -> int:
    """Images per pass over ``batches`` (a loader's ``num_samples``, else counted by iterating once)."""
    if batches is None:
        return 0
    counted = getattr(batches, "num_samples", None)
    return int(counted) if counted is not None else sum(len(batch_images(batch)) for batch in batches)


class Estimation:
    """A re-estimation of ``layers`` that can be paused between batches, so that one pass over the calibration
    data can serve many variants (the fast engine): each :meth:`step` continues from where the previous one of this
    estimation stopped, exactly as :func:`reestimate` would have continued in place. Between uses the layers hold
    whatever they held before (another variant's statistics never leak into this one's)."""

    def __init__(self, layers: Sequence[BatchNorm]) -> None:
        self.layers = list(layers)
        self.state: list[tuple[torch.Tensor, ...]] | None = None  # None: freshly reset
        self.images = 0

    @contextmanager
    def step(self, images: int) -> Iterator[None]:
        """Within the block the layers hold this estimation's statistics in train mode with cumulative averaging, so
        a forward pass accumulates one batch of ``images`` images; the new state is kept after it."""
        with self.applied(), accumulating(self.layers):
            yield
            self.state = [buffers_of(layer) for layer in self.layers]
            self.images += images

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the layers hold this estimation's statistics (freshly reset before its first step)."""
        with statistics_kept(self.layers):
            for index, layer in enumerate(self.layers):
                if self.state is None:
                    layer.reset_running_stats()
                else:
                    load_buffers(layer, self.state[index])
            yield


def buffers_of(layer: BatchNorm) -> tuple[torch.Tensor, ...]:
    """Copies of a BatchNorm's running mean, running variance and batch counter."""
    assert layer.running_mean is not None and layer.running_var is not None and layer.num_batches_tracked is not None
    return layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone()


def load_buffers(layer: BatchNorm, state: tuple[torch.Tensor, ...]) -> None:
    """Write saved running statistics (from :func:`buffers_of`) back into ``layer`` in place."""
    assert layer.running_mean is not None and layer.running_var is not None and layer.num_batches_tracked is not None
    with torch.no_grad():
        layer.running_mean.copy_(state[0])
        layer.running_var.copy_(state[1])
        layer.num_batches_tracked.copy_(state[2])


def recalibrate_copy(
    model: nn.Module,
    pruned: nn.Module,
    removals: Sequence[tuple[str, Sequence[int]]],
    example_input: torch.Tensor,
    batches: Iterable[CalibrationBatch],
    progress: bool | None = False,
) -> CalibrationStats:
    """Re-estimate, in ``pruned`` (a physically pruned copy of ``model``), the BatchNorm statistics that the
    ``(conv name, channels)`` removals change; the other layers keep the dense model's statistics. ``pruned`` is
    left in eval mode with the new statistics."""
    with eval_mode(model):
        graph = build_dependency_graph(model, example_input)
        groups = [removal_group(graph, model.get_submodule(name), channels) for name, channels in removals if channels]
        names = batchnorm_names(model, affected_batchnorms(graph, groups))
    pruned.eval()  # every other BatchNorm keeps using its running statistics while the affected ones re-estimate
    images = reestimate(pruned, batchnorms_named(pruned, names), batches, progress=progress)
    return CalibrationStats(names, images)

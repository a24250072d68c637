"""Measuring a layer-level latency table: instead of the whole model once per probe, each conv/linear layer shape a
probe changes is timed alone (a standalone layer of that shape, random weights), once per distinct shape, and a
group's saving at a count is the sum over its changed layers of (dense layer - pruned layer). The whole dense model
is still measured once. Every layer timing is saved to the table's file as it finishes, so a killed build resumes
without measuring it again.

Each measurement is smaller than a whole-model probe but there are more of them (the build times of both kinds are
in docs/latency.md). It sees only the conv/linear layers: what the runtime saves around them
(activations, adds, pooling, fusion) is not in the savings, and the plan's end-to-end measurement rescales the model
for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.io.latency_table import LAYER_TABLE, LatencyTable, save_table
from analysis.planning.latency import LatencyRuntime
from analysis.planning.plan import Planner
from analysis.planning.probes import measure_dense, open_table
from analysis.progress import progress_bar

logger = logging.getLogger(__name__)

LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
"""The layers a layer-level table times (the ones whose cost follows the pruned channels)."""


@dataclass(frozen=True)
class LayerShape:
    """One conv or linear layer as the runtime sees it: its hyper-parameters and the shape of one input sample.

    Attributes:
        kind: The layer class name (``Conv1d``, ``Conv2d``, ``Conv3d``, ``Linear``).
        in_channels: Input channels (features of a linear layer).
        out_channels: Output channels (features).
        bias: Whether it adds a bias.
        sample: The shape of one input sample (channels first for a conv, features last for a linear layer).
        conv: A conv's ``(kernel, stride, padding, dilation, groups, padding_mode)`` (empty for a linear layer).
    """

    kind: str
    in_channels: int
    out_channels: int
    bias: bool
    sample: tuple[int, ...]
    conv: tuple[Any, ...] = ()

    @property
    def key(self) -> str:
        """The shape as the table's JSON key."""
        conv = ",".join(str(v) for v in self.conv)
        return f"{self.kind}({self.in_channels}->{self.out_channels},{conv},bias={self.bias}) @ {self.sample}"

    def build(self) -> nn.Module:
        """A standalone layer of this shape (random weights, eval mode; the caller's random state is untouched)."""
        with torch.random.fork_rng(devices=[]):
            if not self.conv:
                return nn.Linear(self.in_channels, self.out_channels, bias=self.bias).eval()
            kernel, stride, padding, dilation, groups, padding_mode = self.conv
            layer: type[nn.Conv1d | nn.Conv2d | nn.Conv3d] = getattr(nn, self.kind)
            return layer(self.in_channels, self.out_channels, kernel, stride, padding, dilation, groups, self.bias,
                         padding_mode).eval()  # fmt: skip

    def pruned(self, removed: Sequence[int]) -> LayerShape:
        """This layer with ``removed`` (a :class:`~analysis.structure.flops.ShapeDelta` entry of its weight: the
        elements each weight dimension loses) taken away; a depthwise conv keeps one group per channel."""
        out_channels = self.out_channels - removed[0]
        if self.conv:
            groups = self.conv[4]
            if groups == self.out_channels > 1:  # depthwise: input and output channels go together
                in_channels = self.in_channels // groups * out_channels
                conv = (*self.conv[:4], out_channels, self.conv[5])
            else:
                in_channels, conv = self.in_channels - removed[1] * groups, self.conv
            sample = (in_channels, *self.sample[1:])
        else:
            in_channels, conv = self.in_channels - removed[1], ()
            sample = (*self.sample[:-1], in_channels)
        return LayerShape(self.kind, in_channels, out_channels, self.bias, sample, conv)


def layer_shape(module: nn.Module, sample: Sequence[int]) -> LayerShape:
    """The :class:`LayerShape` of a :data:`LAYER_TYPES` ``module`` called on an input sample of shape ``sample``."""
    if isinstance(module, nn.Linear):
        return LayerShape("Linear", module.in_features, module.out_features, module.bias is not None, tuple(sample))
    assert isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)
    conv = (module.kernel_size, module.stride, module.padding, module.dilation, module.groups, module.padding_mode)
    kind = type(module).__name__ if type(module) in LAYER_TYPES else f"Conv{len(module.kernel_size)}d"
    return LayerShape(kind, module.in_channels, module.out_channels, module.bias is not None, tuple(sample), conv)


def layer_calls(model: nn.Module, example_input: torch.Tensor) -> dict[str, list[LayerShape]]:
    """Per conv/linear module of ``model`` (by name), the shape of each of its calls in one forward pass."""
    calls: dict[str, list[LayerShape]] = {}
    hooks = []

    def record(name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            calls.setdefault(name, []).append(layer_shape(module, tuple(inputs[0].shape[1:])))

        return hook

    for name, module in model.named_modules():
        if isinstance(module, LAYER_TYPES):
            hooks.append(module.register_forward_pre_hook(record(name)))
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def changed_layers(
    planner: Planner, calls: Mapping[str, list[LayerShape]], group: str, count: int
) -> list[tuple[LayerShape, LayerShape]]:
    """The ``(dense, pruned)`` shape of every layer call that ``group`` alone at ``count`` channels changes."""
    return jointly_changed_layers(planner, calls, {group: count})


def jointly_changed_layers(
    planner: Planner, calls: Mapping[str, list[LayerShape]], picks: Mapping[str, int]
) -> list[tuple[LayerShape, LayerShape]]:
    """The ``(dense, pruned)`` shape of every layer call that the ``{ranking param: count}`` picks pruned at once
    change (groups take disjoint channels, so a layer loses what each pick takes from it, added up per dimension)."""
    removed: dict[int, list[int]] = {}
    for param, count in picks.items():
        if count:
            for key, (_, per_dim) in planner.pick_delta((param, count)).removed.items():
                total = removed.setdefault(key, [0] * len(per_dim))
                removed[key] = [a + b for a, b in zip(total, per_dim, strict=True)]
    changed = []
    for name, shapes in calls.items():
        entry = removed.get(id(planner.model.get_submodule(name).weight))
        if entry is not None and any(entry):
            changed += [(shape, shape.pruned(entry)) for shape in shapes]
    return changed


def measure_layer_table(
    planner: Planner,
    counts: Mapping[str, Sequence[int]],
    runtime: LatencyRuntime,
    batch: int,
    analysis_file: str | Path,
    progress: bool | None = None,
) -> tuple[LatencyTable, Path, float]:
    """The layer-level latency table of ``planner``'s model: read from its cache file, with the layer shapes it lacks
    measured now; its probes are the dense latency minus each group's summed layer savings.

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
    table, path = open_table(planner, runtime, batch, analysis_file, kind=LAYER_TABLE)
    calls = layer_calls(planner.model, planner.example_input)
    changes = {(group, count): changed_layers(planner, calls, group, count) for group, found in counts.items()
               for count in found}  # fmt: skip
    pairs = [pair for found in changes.values() for pair in found]
    todo = _pending(table, pairs)
    start = time.perf_counter()
    if table.dense_ms is None or todo:
        cached = len(table.layers)
        measurements = sum(1 + len(pruned) for _, pruned in todo.values())
        logger.info(
            "Layer latency table on %s (batch %d): %d layer timing(s) to measure%s, for %d probe(s).", runtime.device,
            batch, measurements, f", {cached} shape(s) cached in {path.name}" if cached else "", len(changes),
        )  # fmt: skip
    dense_ms = measure_dense(table, path, planner, runtime, batch)
    _measure(table, todo, runtime, batch, path, progress)
    for (group, count), changed in changes.items():
        saving = sum(table.layer_saving(dense.key, pruned.key) for dense, pruned in changed)
        table.probes.setdefault(group, {})[count] = dense_ms - saving
    save_table(path, table)
    return table, path, time.perf_counter() - start


def _pending(table: LatencyTable, pairs: Sequence[tuple[LayerShape, LayerShape]]
             ) -> dict[str, tuple[LayerShape, dict[str, LayerShape]]]:  # fmt: skip
    """Per dense shape (by key), the pruned shapes of ``pairs`` the table lacks (each once, under its first dense
    shape); dense shapes the table lacks are included with none."""
    pending: dict[str, tuple[LayerShape, dict[str, LayerShape]]] = {}
    seen: set[str] = set()
    for dense, pruned in pairs:
        entry = pending.setdefault(dense.key, (dense, {}))
        if pruned.key not in table.layers and pruned.key not in seen:
            entry[1][pruned.key] = pruned
            seen.add(pruned.key)
    return {name: entry for name, entry in pending.items() if entry[1] or name not in table.layers}


def _measure(
    table: LatencyTable,
    todo: Mapping[str, tuple[LayerShape, Mapping[str, LayerShape]]],
    runtime: LatencyRuntime,
    batch: int,
    path: Path,
    progress: bool | None,
) -> None:
    """Time each dense shape of ``todo``, then its pruned shapes right after it (their reference), saving the table
    after each timing (a kill loses at most the one in progress)."""
    total = sum(1 + len(pruned) for _, pruned in todo.values())
    with progress_bar(progress, total=total, desc="layer latency table", unit="layer") as bar:
        for name, (dense, pruned_shapes) in todo.items():
            reference = runtime.measure(dense.build(), dense.sample, batch).median_ms  # next to its pruned shapes
            table.layers.setdefault(name, reference)
            save_table(path, table)
            bar.update(1)
            for pruned_name, pruned in pruned_shapes.items():
                table.layers[pruned_name] = runtime.measure(pruned.build(), pruned.sample, batch).median_ms
                table.references[pruned_name] = (name, reference)
                save_table(path, table)
                bar.update(1)


@dataclass
class JointLayerSavings:
    """What a whole plan saves by the layer-level table: every layer at the shape all its groups' removals leave it
    (a conv between two pruned groups loses input and output channels at once), timed on demand beside its dense
    shape and cached in the table's file; the sum of those layers' savings.

    Attributes:
        planner: The plan's planner.
        table: The layer-level table (extended with the joint shapes it measures).
        runtime: Where layers are timed.
        batch: Images per call.
        path: The table's file.
    """

    planner: Planner
    table: LatencyTable
    runtime: LatencyRuntime
    batch: int
    path: Path

    def __post_init__(self) -> None:
        self.calls = layer_calls(self.planner.model, self.planner.example_input)

    def __call__(self, picks: Mapping[str, int]) -> float:
        """The saving (ms, unscaled) with every ``{group key: count}`` pruned at once."""
        pairs = jointly_changed_layers(self.planner, self.calls, picks)
        _measure(self.table, _pending(self.table, pairs), self.runtime, self.batch, self.path, progress=False)
        return sum(self.table.layer_saving(dense.key, pruned.key) for dense, pruned in pairs)

"""Measuring a layer-level latency table: instead of the whole model once per probe, each conv/linear layer shape a
probe changes is timed alone (a standalone layer of that shape, random weights), once per distinct shape, and a
group's saving at a count is the sum over its changed layers of (dense layer - pruned layer). The whole dense model
is still measured once. Every layer timing is saved to the table's file as it finishes, so a killed build resumes
without measuring it again.

Each measurement is smaller than a whole-model probe but there are more of them (ResNet-18: 188 layer shapes for 96
probes, about the same build time; README "Planning for latency"). It sees only the conv/linear layers: what the
runtime saves around them (activations, adds, pooling, fusion) is not in the savings, and the plan's end-to-end
measurement rescales the model for it.
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

from analysis.io.latency_table import LatencyTable, load_table, save_table, table_path
from analysis.planning.plan import Planner
from analysis.progress import progress_bar
from analysis.runtimes.probes import table_key
from analysis.runtimes.runtime import Runtime

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
    delta = planner.pick_delta((group, count)).removed
    changed = []
    for name, shapes in calls.items():
        weight = planner.model.get_submodule(name).weight
        entry = delta.get(id(weight))
        if entry is not None and any(entry[1]):
            changed += [(shape, shape.pruned(entry[1])) for shape in shapes]
    return changed


def measure_layer_table(
    planner: Planner,
    counts: Mapping[str, Sequence[int]],
    runtime: Runtime,
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
    model, example = planner.model, planner.example_input
    sample_shape = tuple(example.shape[1:])
    key = {**table_key(runtime, model, sample_shape, batch), "table": "layers"}
    path = table_path(analysis_file, key)
    table = load_table(path, key)
    calls = layer_calls(model, example)
    changes = {(group, count): changed_layers(planner, calls, group, count) for group, found in counts.items()
               for count in found}  # fmt: skip
    pending: dict[str, tuple[LayerShape, dict[str, LayerShape]]] = {}  # dense shape -> pruned shapes to measure
    for pairs in changes.values():
        for dense, pruned in pairs:
            entry = pending.setdefault(dense.key, (dense, {}))
            if pruned.key not in table.layers:
                entry[1][pruned.key] = pruned
    seen: set[str] = set()
    for _, pruned_shapes in pending.values():  # a pruned shape shared by two layers is measured once
        for name in [name for name in pruned_shapes if name in seen]:
            del pruned_shapes[name]
        seen.update(pruned_shapes)
    work = {name: entry for name, entry in pending.items() if entry[1] or name not in table.layers}
    todo = sum(1 + len(pruned_shapes) for _, pruned_shapes in work.values())
    start = time.perf_counter()
    if table.dense_ms is None or todo:
        cached = len(table.layers)
        logger.info(
            "Layer latency table on %s (batch %d): %d layer timing(s) to measure%s, for %d probe(s).", runtime.device,
            batch, todo, f", {cached} shape(s) cached in {path.name}" if cached else "", len(changes),
        )  # fmt: skip
    if table.dense_ms is None:
        table.dense_ms = runtime.measure(model, sample_shape, batch).median_ms
        save_table(path, table)
    with progress_bar(progress, total=todo, desc="layer latency table", unit="layer") as bar:
        for name, (dense, pruned_shapes) in work.items():
            reference = runtime.measure(dense.build(), dense.sample, batch).median_ms  # next to its pruned shapes
            table.layers.setdefault(name, reference)
            save_table(path, table)
            bar.update(1)
            for pruned_name, pruned in pruned_shapes.items():
                table.layers[pruned_name] = runtime.measure(pruned.build(), pruned.sample, batch).median_ms
                table.references[pruned_name] = (name, reference)
                save_table(path, table)  # a kill loses at most the layer in progress
                bar.update(1)
    for (group, count), pairs in changes.items():
        saving = sum(table.layer_saving(dense.key, pruned.key) for dense, pruned in pairs)
        table.probes.setdefault(group, {})[count] = table.dense_ms - saving
    save_table(path, table)
    return table, path, time.perf_counter() - start

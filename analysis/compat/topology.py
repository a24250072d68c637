"""Channel dependency sets: the layers whose output channels must be removed together, partly under NNI 2.x names.

NNI 3.0 removed ``ChannelDependency`` and ``not_safe_to_prune`` (``nni.compression.pytorch.utils``); this module
offers the same calls on top of this package's Torch-Pruning based channel groups (:mod:`analysis.structure.groups`),
plus :func:`dependency_sets` and :func:`dependency_csv` (conv-only sets, ``run.py deps``). Its channel tracing also
serves :mod:`analysis.compat.mask_conflict`. Where the results differ from NNI 2.10, each docstring says how and why.
The main difference: depthwise convs and grouped convs whose output channels follow their input channels (ResNeXt)
are in the dependency set of the conv that produces their input channels, because removing those channels removes
their filters too; NNI lists them as sets of their own.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from analysis.errors import ModelError
from analysis.inputs.device import model_device
from analysis.structure.groups import (
    build_dependency_graph,
    eval_mode,
    execution_order,
    find_prunable,
    is_grouped_conv,
    is_out_channel_item,
)
from analysis.structure.submodule_graphs import PartGraphs

__all__ = ["ChannelDependency", "dependency_csv", "dependency_sets", "not_safe_to_prune"]

# The layer types NNI's ChannelDependency puts in sets for its "Filter" prune type.
SET_LAYER_TYPES = (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)

Channel = tuple[str, int]  # (layer name, output channel)
BlockKey = tuple[str, str]  # (grouped conv name, "in" or "out")
_Key = TypeVar("_Key")  # what a union-find forest joins: channels, or layer names


# ------------------------------------------------------------------------------------------------ channel tracing


@dataclass
class Component:
    """Output channels of one or more layers that can only be kept or removed together.

    Attributes:
        channels: ``(layer, output channel)`` pairs, in forward order of the layers.
        blocks: For each grouped conv the component reaches (by its input or output channels): how many of its
            channels fall in each conv group. Removal must be even across the conv groups of each such conv.
    """

    channels: list[Channel]
    blocks: dict[BlockKey, dict[int, int]] = field(default_factory=dict)


@dataclass
class Topology:
    """Dependency sets of a model (layer names, forward order) and, per set, its channel components.

    Attributes:
        layers: The traced conv, transposed conv and linear layers, in the order the forward pass first calls them.
        sets: The dependency sets, by the forward order of their first layer, members in forward order.
        components: Per set, its channel components.
    """

    layers: list[str]
    sets: list[list[str]]
    components: list[list[Component]]


def out_channels(module: nn.Module) -> int:
    """The number of output channels (filters) of a conv, transposed conv or linear layer."""
    if isinstance(module, nn.Linear):
        return module.out_features
    assert isinstance(module, nn.modules.conv._ConvNd)
    return module.out_channels


def layer_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a conv, transposed conv or linear layer."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def example_tensor(model: nn.Module, dummy_input: Any) -> torch.Tensor:
    """The one input tensor to trace with (a 1-tuple is unpacked, as NNI users often pass ``(x,)``)."""
    if isinstance(dummy_input, (tuple, list)) and len(dummy_input) == 1:
        dummy_input = dummy_input[0]
    if not isinstance(dummy_input, torch.Tensor):
        raise TypeError(
            f"dummy_input must be one batched input tensor, got {type(dummy_input).__name__}; "
            "models taking several inputs are not supported by the dependency tracing"
        )
    return dummy_input.to(model_device(model))


def _find(parent: dict[_Key, _Key], key: _Key) -> _Key:
    """The root of ``key`` in the union-find forest ``parent`` (paths are halved on the way)."""
    while parent[key] != key:
        parent[key] = parent[parent[key]]
        key = parent[key]
    return key


def trace_topology(model: nn.Module, example: torch.Tensor) -> Topology:
    """Trace ``model`` once and join output channels that Torch-Pruning couples, into sets and components.

    Every conv, transposed conv and linear layer the forward pass runs is in exactly one set. Two layers share a
    set when removing an output channel of one removes an output channel of the other (residual adds, depthwise
    and in==out grouped convs). :func:`dependency_sets` is the conv part of the sets.

    Raises:
        ModelError: When Torch-Pruning traces the model only in parts (:mod:`analysis.structure.submodule_graphs`).
    """
    with eval_mode(model):
        graph = build_dependency_graph(model, example)
        order = execution_order(model, example, SET_LAYER_TYPES)
    if isinstance(graph, PartGraphs):  # a layer whose channels leave its part would get a set that is too small
        raise ModelError(
            f"Torch-Pruning traces this {type(model).__name__} only in parts ({len(graph.parts)} submodules, each on "
            "its own), so the channel dependencies between the parts, and the dependency sets, are unknown."
        )
    modules = dict(model.named_modules())
    names = {module: name for name, module in modules.items()}
    position = {name: index for index, name in enumerate(order)}
    parent: dict[Channel, Channel] = {(n, c): (n, c) for n in order for c in range(out_channels(modules[n]))}
    tags: dict[Channel, set[tuple[str, str, int, int]]] = defaultdict(set)  # (conv, in/out, block, channel)
    for name in order:
        module = modules[name]
        pruner = graph.get_pruner_of_module(module) if module in graph.module2node else None
        if pruner is None:
            continue
        group = graph.get_pruning_group(module, pruner.prune_out_channels, list(range(out_channels(module))))
        for item in group:
            target = item.dep.target.module
            other = names.get(target) if isinstance(target, nn.Module) else None
            out_item = is_out_channel_item(graph, item)
            pairs = list(zip((int(i) for i in item.root_idxs), (int(i) for i in item.idxs), strict=True))
            if out_item and other in position:
                for root, local in pairs:
                    first, second = _find(parent, (name, root)), _find(parent, (other, local))
                    if first != second:
                        parent[second] = first
            if other is not None and is_grouped_conv(target):
                size = target.out_channels if out_item else target.in_channels
                role = "out" if out_item else "in"
                for root, local in pairs:
                    tags[(name, root)].add((other, role, local // (size // target.groups), local))
    by_root: dict[Channel, list[Channel]] = defaultdict(list)
    for channel in parent:
        by_root[_find(parent, channel)].append(channel)
    layer_parent = {name: name for name in order}
    for channels in by_root.values():
        first_layer = _find(layer_parent, channels[0][0])
        for layer, _ in channels[1:]:
            second_layer = _find(layer_parent, layer)
            if first_layer != second_layer:
                first_layer, second_layer = sorted((first_layer, second_layer), key=position.__getitem__)
                layer_parent[second_layer] = first_layer
    sets: dict[str, list[str]] = {}
    for name in order:
        sets.setdefault(_find(layer_parent, name), []).append(name)
    components: dict[str, list[Component]] = defaultdict(list)
    for channels in by_root.values():
        channels.sort(key=lambda channel: (position[channel[0]], channel[1]))
        component = Component(channels)
        seen = {tag for channel in channels for tag in tags.get(channel, ())}
        for conv, role, block, _ in seen:
            counts = component.blocks.setdefault((conv, role), {})
            counts[block] = counts.get(block, 0) + 1
        components[_find(layer_parent, channels[0][0])].append(component)
    ordered = [sorted(components[root], key=lambda c: (position[c.channels[0][0]], c.channels[0][1])) for root in sets]
    return Topology(order, list(sets.values()), ordered)


# ------------------------------------------------------------------------------------------ ChannelDependency


class ChannelDependency:
    """NNI's ``ChannelDependency``: the layers whose output channels (filters) must be pruned together.

    Like NNI's "Filter" prune type, the sets hold ``nn.Conv2d``, ``nn.ConvTranspose2d`` and ``nn.Linear`` layers,
    each in exactly one set (coupled layers share a set, the others are singletons), ordered by the forward pass.
    Unlike NNI (which couples layers through adds, multiplies and non-channel concats only), a depthwise conv, and
    a grouped conv whose output channels are its input channels (ResNeXt), is in the set of the conv producing its
    input channels: removing those channels removes its filters too. Layers the forward pass does not run are in
    no set (NNI's traced graph omits them as well).

    Args:
        model: The network; it is traced once in eval mode and every module's training flag is restored.
        dummy_input: One batched input tensor (or a 1-tuple of it); one sample is traced.
        traced_model: Accepted for NNI compatibility and ignored: the model is always traced with Torch-Pruning.
        prune_type: Only NNI's default ``"Filter"``; NNI's ``"Batchnorm"`` (sets of BatchNorm layers) is not
            supported.

    Attributes:
        sets_in_order: The sets as lists of module names: sets by the forward order of their first layer, members
            in forward order.

    Raises:
        ValueError: For a ``prune_type`` other than ``"Filter"``.
        TypeError: When ``dummy_input`` is not a tensor.
    """

    def __init__(
        self, model: nn.Module, dummy_input: Any, traced_model: Any = None, prune_type: str = "Filter"
    ) -> None:
        if prune_type != "Filter":
            raise ValueError(f"prune_type '{prune_type}' is not supported; the supported value is 'Filter'")
        self.model = model
        self.prune_type = prune_type
        self.sets_in_order: list[list[str]] = trace_topology(model, example_tensor(model, dummy_input)).sets

    @property
    def dependency_sets(self) -> list[set[str]]:
        """The dependency sets as NNI returns them: a list of sets of module names (sets in forward order)."""
        return [set(members) for members in self.sets_in_order]

    @property
    def dependency(self) -> dict[str, set[str]]:
        """NNI's ``dependency`` attribute: each layer's name mapped to its set (singletons included)."""
        return {name: set(members) for members in self.sets_in_order for name in members}

    def export(self, filepath: str | os.PathLike[str]) -> None:
        """Write the sets as NNI's CSV: a header row, then ``Set <n>,<layer>,<layer>...`` per set, in forward order.

        The text is :func:`dependency_csv`'s, with NNI 2.10's header ``Dependency Set,Layers``; NNI writes each
        set's members in arbitrary (Python set) order.
        """
        Path(filepath).write_text(dependency_csv(self.sets_in_order), encoding="utf-8")


# ------------------------------------------------------------------------------------------ conv dependency sets


def dependency_sets(model: nn.Module, example_input: torch.Tensor) -> list[list[str]]:
    """The channel dependency sets of the convs: convs whose output channels must be removed together (module names).

    The ``nn.Conv2d`` part of :class:`ChannelDependency`'s sets: each conv the forward pass runs is in exactly one
    set; sets follow the forward order of their first conv, members in forward order. Unlike NNI's
    ``ChannelDependency`` (residual adds only), depthwise and grouped convs join the set of the conv that produces
    their input channels, since removing those channels removes their filters too.
    """
    topology = trace_topology(model, example_input)
    modules = dict(model.named_modules())
    position = {name: index for index, name in enumerate(topology.layers)}
    convs = [[name for name in members if isinstance(modules[name], nn.Conv2d)] for members in topology.sets]
    return sorted((members for members in convs if members), key=lambda members: position[members[0]])


def dependency_csv(sets: Sequence[Sequence[str]]) -> str:
    """NNI's dependency CSV: the header ``Dependency Set,Layers`` then ``Set 1,conv_a,conv_b`` per set.

    The header is the one NNI 2.10's ``ChannelDependency.export`` writes; its docstring shows
    ``Dependency Set,Convolutional Layers`` instead.
    """
    lines = ["Dependency Set,Layers"]
    lines += [",".join([f"Set {number}", *members]) for number, members in enumerate(sets, start=1)]
    return "\n".join(lines) + "\n"


def not_safe_to_prune(model: nn.Module, example_input: torch.Tensor) -> dict[str, str]:
    """Convs (module names, forward order) that cannot be pruned as roots, each with the reason.

    NNI 2.10's ``not_safe_to_prune`` returns a list of names; iterating this dict gives names as well.
    """
    params = find_prunable(model, example_input)
    return {param.module_name: param.reason for param in params if param.reason and param.kind == "conv"}

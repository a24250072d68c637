"""Removal groups built from the channel flow (:mod:`channel_flow`) instead of Torch-Pruning's index mappings.

Torch-Pruning maps channel indices through splits, cats, slices and reshapes by guessing widths, and several of its
guesses are wrong in 1.6.1 (benchmarks/tp_failure_families.md); its group search also runs for minutes on a few
models. Wherever the flow follows every operator a unit's channels pass, the unit's group is built here from the
flow: one item per layer side, parameter or customised layer the flow couples to the removed channels, each with
the pruning function Torch-Pruning itself applies to that layer, so masking, physical removal and costs read it as
they read Torch-Pruning's groups. Where the flow is blocked (an operator it does not know), Torch-Pruning's own
group is used, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from analysis.structure.channel_flow import ChannelFlow, Coupling
from analysis.structure.custom_layers import channel_pruner, fixed_width_pruner

logger = logging.getLogger(__name__)

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class CoupledGraph(tp.DependencyGraph):  # type: ignore[misc]  # Torch-Pruning is unannotated
    """A Torch-Pruning dependency graph that also holds the model's channel flow (None when it could not be
    traced) and its module names."""

    flow: ChannelFlow | None = None
    names: dict[Any, str]

    def __init__(self) -> None:
        super().__init__()
        self.names = {}


@dataclass(frozen=True)
class _Entry:
    """One layer side or parameter the removal touches: its target, whether it loses outputs, local -> root index."""

    target: Any
    out: bool
    pairs: tuple[tuple[int, int], ...]


def flow_coupling(graph: CoupledGraph, root: nn.Module, channels: Sequence[int]) -> Coupling | None:
    """The flow's coupling of ``channels`` of ``root``'s outputs, or None without a flow or for a root it never saw
    produce channels."""
    if graph.flow is None or root not in graph.names or not graph.flow.has_output(graph.names[root]):
        return None
    return graph.flow.members(graph.names[root], channels)


def choose_group(
    graph: CoupledGraph,
    root: nn.Module,
    channels: Sequence[int],
    torch_pruning_group: Callable[[], tp.dependency.Group],
) -> tp.dependency.Group:
    """The group of ``channels`` of ``root`` built from the channel flow where the flow follows every operator the
    channels pass; Torch-Pruning's own group (``torch_pruning_group``) elsewhere."""
    coupling = flow_coupling(graph, root, channels)
    if coupling is None or coupling.blocked:
        return torch_pruning_group()
    return build_group(graph, root, channels, coupling)


def build_group(
    graph: CoupledGraph, root: nn.Module, channels: Sequence[int], coupling: Coupling
) -> tp.dependency.Group:
    """The removal group of ``channels`` of ``root`` built from the flow's ``coupling``."""
    return _as_group(graph, root, _entries(graph, root, channels, coupling))


# ------------------------------------------------------------------------------------------------------ entries


def _entries(graph: CoupledGraph, root: nn.Module, channels: Sequence[int], coupling: Coupling) -> list[_Entry]:
    """Root first, then every coupled layer side and parameter, each index paired with the root channel it follows."""
    flow = graph.flow
    assert flow is not None
    model = graph.model
    produced = flow.produced(graph.names[root])
    root_of: dict[int, int] = {}
    for channel in channels:
        root_of.setdefault(flow.group_of(produced[channel]), int(channel))
    entries = [_Entry(root, True, tuple((int(c), int(c)) for c in sorted(channels)))]  # first, as Torch-Pruning's
    for layer, side in coupling.layers:  # the root's own side too: its channels may be coupled to more of its own
        target = _owner(graph, model.get_submodule(layer))
        entries.append(_Entry(target, side.out, tuple((i, root_of[group]) for i, group in side.labels)))
    for name, flat in coupling.parameters.items():
        param = model.get_parameter(name)
        owner = _owner(graph, model.get_submodule(name.rpartition(".")[0]) if "." in name else model)
        located = _parameter_indices(param, flat)
        if located is None:
            raise ValueError(f"{name}: the channel flow couples elements that are not whole slices of one dimension")
        dim, indices = located
        pairs = tuple((index, root_of[group]) for index, group in indices)
        if owner is not model and owner in graph.module2node:  # a layer of its own (PReLU, a layer scale)
            entries.append(_Entry(owner, True, pairs))
        else:
            entries.append(_Entry(param, True, pairs))
            _node(graph, param).pruning_dim = dim
    return entries


def _owner(graph: CoupledGraph, module: nn.Module) -> nn.Module:
    """``module`` itself, or the customised layer above it that Torch-Pruning sees instead (a Swin attention)."""
    if module in graph.module2node:
        return module
    for name in _ancestors(graph.names.get(module, "")):
        above: nn.Module = graph.model.get_submodule(name)
        if channel_pruner(graph, above) is not None or fixed_width_pruner(graph, above) is not None:
            return above
    return module


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _parameter_indices(
    param: torch.Tensor, flat: Sequence[tuple[int, int]]
) -> tuple[int, list[tuple[int, int]]] | None:
    """The dimension whose whole slices are exactly the coupled elements ``flat`` (``(flat index, coupled set)``
    pairs) and each slice's index with its coupled set, or None when there is no such dimension. The dimension is
    the one along which the coupled set changes (a position embedding's channels, not its tokens)."""
    if not flat:
        return None
    coords = torch.stack(torch.unravel_index(torch.tensor([i for i, _ in flat]), param.shape), dim=1).tolist()
    for dim in range(param.dim()):
        if param.shape[dim] == 1 and param.numel() > 1:
            continue
        set_of: dict[int, int] = {}
        if any(set_of.setdefault(c[dim], group) != group for c, (_, group) in zip(coords, flat, strict=True)):
            continue
        if len(set_of) * (param.numel() // param.shape[dim]) == len(flat):
            return dim, sorted(set_of.items())
    return None


def _node(graph: CoupledGraph, target: Any) -> Any:
    """``target``'s node in ``graph``, added when Torch-Pruning made none (a parameter it did not see as unwrapped)."""
    node = graph.module2node.get(target)
    if node is None:
        node = tp.dependency.Node(target, None, graph.names.get(target))
        graph.module2node[target] = node
    return node


def _per_channel(target: Any, graph: CoupledGraph) -> bool:
    """True for layers whose input and output channels are the same channels (norms, depthwise convs, customised
    layers whose pruner removes both sides at once)."""
    if isinstance(target, _CONVS):
        return bool(target.groups == target.in_channels == target.out_channels and target.groups > 1)
    if (pruner := channel_pruner(graph, target)) is not None:
        return bool(pruner.prune_in_channels == pruner.prune_out_channels)
    return isinstance(target, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.PReLU))


# ------------------------------------------------------------------------------------------------------ the group


def _as_group(graph: CoupledGraph, root: nn.Module, entries: Sequence[_Entry]) -> tp.dependency.Group:
    """A Torch-Pruning group of ``entries``: each target's own pruning function, triggered by the root's."""
    trigger = _function(graph, root, out=True)
    root_node = graph.module2node[root]
    group = tp.dependency.Group()
    for entry in _merged(graph, entries):  # a per-channel layer's entry is already an output side
        handler = _function(graph, entry.target, out=entry.out)
        item = tp._helpers.GroupItem(
            tp.dependency.Dependency(trigger, handler, root_node, _node(graph, entry.target)),
            [i for i, _ in entry.pairs],
        )
        item.root_idxs = [r for _, r in entry.pairs]
        group._group.append(item)
    group._DG = graph
    return group


def _merged(graph: CoupledGraph, entries: Sequence[_Entry]) -> list[_Entry]:
    """One entry per target and side (a layer called twice appears once), in first-seen order."""
    merged: dict[tuple[int, bool], dict[int, int]] = {}
    targets: dict[tuple[int, bool], Any] = {}
    for entry in entries:
        key = (id(entry.target), entry.out or _per_channel(entry.target, graph))
        targets.setdefault(key, entry.target)
        pairs = merged.setdefault(key, {})
        for local, root in entry.pairs:
            pairs.setdefault(local, root)
    return [_Entry(targets[key], key[1], tuple(sorted(pairs.items()))) for key, pairs in merged.items()]


def _function(graph: CoupledGraph, target: Any, out: bool) -> Callable[..., Any]:
    """The pruning function Torch-Pruning applies to ``target``'s outputs (``out``) or inputs."""
    if isinstance(target, _CONVS) and _per_channel(target, graph):
        depthwise: Callable[..., Any] = (
            tp.prune_depthwise_conv_out_channels if out else tp.prune_depthwise_conv_in_channels
        )
        return depthwise
    pruner = graph.get_pruner_of_module(target)
    if pruner is None:
        raise ValueError(f"Torch-Pruning has no pruning function for {type(target).__name__}")
    function: Callable[..., Any] = pruner.prune_out_channels if out else pruner.prune_in_channels
    return function

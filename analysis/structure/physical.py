"""Physically remove channels from a copy of a model with Torch-Pruning (the ground truth masking must match).

Torch-Pruning's low-level handlers are used for every layer except grouped convs' input channels: its handler
keeps the same local positions in every conv group, which is only right when the removed positions coincide. Here
each conv group keeps its own surviving positions, which is what removing those input channels means. Layers with a
customised pruner (:mod:`analysis.structure.custom_layers`) are removed by it: the dependency graph holds it as their
handler. Attention heads are removed by :func:`analysis.structure.heads.remove_heads`.

:func:`pruned_copy` and :func:`jointly_pruned_copy` make an independent copy (for evaluation, re-estimation, export)
from the model's own dependency graph, traced once per model (:func:`model_graph`); :func:`checking_copy` makes the
cheap one the per-unit mask check needs (it shares untouched tensors and reuses the graph the caller holds).
"""

from __future__ import annotations

import copy
import copyreg
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from analysis.structure.attention_stream import sync_stored_widths
from analysis.structure.custom_layers import channel_pruner
from analysis.structure.cuts import follow_cuts, follow_joint_cuts
from analysis.structure.flow_groups import CoupledGraph
from analysis.structure.groups import (
    build_dependency_graph,
    is_grouped_conv,
    is_out_channel_item,
    per_channel_extras,
    removal_group,
    unit_kind,
)
from analysis.structure.heads import is_attention, remove_heads


def pruned_copy(model: nn.Module, root_name: str, channels: Sequence[int], example_input: torch.Tensor) -> nn.Module:
    """Return a deep copy of ``model`` with ``channels`` of ``root_name``'s output (or those heads of an attention
    module) removed along with its group."""
    return jointly_pruned_copy(model, [(root_name, channels)], example_input)


def jointly_pruned_copy(
    model: nn.Module, removals: Sequence[tuple[str, Sequence[int]]], example_input: torch.Tensor
) -> nn.Module:
    """Return a deep copy of ``model`` with every ``(root name, output channels or heads)`` removal applied, each
    with its group. Channel indices refer to the unpruned model.

    Every group is taken from ``model``'s own dependency graph (:func:`model_graph`: traced once per model), and each
    layer side the groups touch loses the union of the indices they give it, once, on the copy. That is what removing
    the groups one after another means (a consumer of a concatenation loses each group's slice at its offset in the
    unpruned tensor), without tracing each partly pruned copy anew. A plan of heads alone needs no graph. A plan that
    removes heads and channels falls back to the removal one group at a time on a graph of the partly pruned copy
    (:func:`rebuilt_pruned_copy`): heads are removed first, and the model's graph no longer describes the copy's
    attention modules after that.
    """
    roots = [(model.get_submodule(name), name, channels) for name, channels in removals]
    heads = [(name, channels) for root, name, channels in roots if is_attention(root)]
    if heads and len(heads) < len(roots):
        return rebuilt_pruned_copy(model, removals, example_input)
    clone: nn.Module = _deepcopy(model, {})
    for name, channels in heads:
        remove_heads(clone, name, channels)
    if heads or not roots:
        return clone.eval()
    graph = model_graph(model, example_input)
    module_names = {module: name for name, module in model.named_modules()}
    param_names = {param: name for name, param in model.named_parameters()}

    def counterpart(layer: Any) -> Any:
        """The clone's module or parameter at ``layer``'s place in ``model``; None for Torch-Pruning's op nodes."""
        if isinstance(layer, nn.Parameter):
            return clone.get_parameter(param_names[layer])
        return clone.get_submodule(module_names[layer]) if layer in module_names else None

    merged: dict[tuple[Any, Any, Any], tuple[Any, set[int]]] = {}
    for root, name, channels in roots:
        assert unit_kind(root) is not None, f"{name} is not a unit root"
        for item in removal_group(graph, root, channels):
            dependency = item.dep
            key = (dependency.target.module, dependency.handler, dependency.target.pruning_dim)
            merged.setdefault(key, (item, set()))[1].update(int(i) for i in item.idxs)
    _apply_items(clone, graph, [(item, sorted(idxs)) for item, idxs in merged.values()], counterpart, param_names)
    if isinstance(graph, CoupledGraph):
        follow_joint_cuts(graph, [(root, channels) for root, _, channels in roots], clone)
    return clone.eval()


def rebuilt_pruned_copy(
    model: nn.Module, removals: Sequence[tuple[str, Sequence[int]]], example_input: torch.Tensor
) -> nn.Module:
    """:func:`jointly_pruned_copy` made one removal at a time, each on a new dependency graph of the partly pruned
    copy (so that concatenations see the current channel offsets); heads are removed first, on the module they
    were named on. It traces the copy once per channel removal: the way for plans that mix heads and channels."""
    clone = copy.deepcopy(model)
    heads_first = sorted(removals, key=lambda removal: not is_attention(model.get_submodule(removal[0])))
    for root_name, channels in heads_first:
        _remove_channels(clone, root_name, channels, example_input)
    return clone.eval()


GRAPHS_KEPT = 2
"""How many models' dependency graphs :func:`model_graph` keeps (the most recently used)."""
_graphs: OrderedDict[int, tuple[nn.Module, tuple[Any, ...], tp.DependencyGraph]] = OrderedDict()


def model_graph(model: nn.Module, example_input: torch.Tensor) -> tp.DependencyGraph:
    """``model``'s dependency graph (:func:`build_dependency_graph`), traced once and kept while ``model``'s layout is
    unchanged: the same module and parameter objects at the same names with the same shapes, buffers of the same
    shapes, and an example of the same sample shape, dtype and device. Removal replaces parameters and modules, so a
    model pruned in place is traced again; new weight values in the same parameters keep the graph (it holds no
    values). The graphs of the :data:`GRAPHS_KEPT` models used last are kept, by model identity: a graph refers to
    its model, so a weak-keyed cache would never let go of a model either (its value keeps the key alive); the bound
    keeps at most that many models alive (:func:`forget_graphs` drops them).
    """
    layout = _layout(model, example_input)
    held = _graphs.get(id(model))
    if held is not None and held[0] is model and held[1] == layout:
        _graphs.move_to_end(id(model))
        return held[2]
    graph = build_dependency_graph(model, example_input)
    _graphs[id(model)] = (model, _layout(model, example_input), graph)  # the trace leaves the layout as it was
    _graphs.move_to_end(id(model))
    while len(_graphs) > GRAPHS_KEPT:
        _graphs.popitem(last=False)
    return graph


def forget_graphs() -> None:
    """Drop every graph :func:`model_graph` keeps (and with them the models they hold)."""
    _graphs.clear()


def _layout(model: nn.Module, example_input: torch.Tensor) -> tuple[Any, ...]:
    """What a dependency graph of ``model`` depends on besides weight values (see :func:`model_graph`)."""
    return (
        tuple(example_input.shape[1:]),
        example_input.dtype,
        example_input.device,
        tuple((name, id(module)) for name, module in model.named_modules()),
        tuple((name, id(param), param.shape) for name, param in model.named_parameters()),
        tuple((name, buffer.shape) for name, buffer in model.named_buffers()),
    )


def checking_copy(
    model: nn.Module, graph: tp.DependencyGraph, root_name: str, channels: Sequence[int], own: Iterable[nn.Module] = ()
) -> nn.Module:
    """A copy of ``model`` with ``channels`` of ``root_name``'s output removed with its group, computing what
    :func:`pruned_copy` computes, for forward passes that leave ``model`` untouched.

    It is made for the per-unit mask check, where a full deep copy and a new Torch-Pruning trace of the copy cost
    more than the check itself on small data: the group comes from ``graph`` (``model``'s own dependency graph; the
    copy of an unpruned model would trace to the same one), and every parameter and buffer of a module the removal
    does not change is shared with ``model`` rather than copied (removal replaces tensors, it never writes into
    them). ``own`` names further modules of ``model`` whose tensors the copy must not share because the caller
    changes them in place (BatchNorm statistics it re-estimates). Attention heads are removed on a full copy.
    """
    root = model.get_submodule(root_name)
    if is_attention(root):
        whole = copy.deepcopy(model)
        remove_heads(whole, root_name, channels)
        return whole.eval()
    assert unit_kind(root) is not None, f"{root_name} is not a unit root"
    group = removal_group(graph, root, channels)
    module_names = {module: name for name, module in model.named_modules()}
    param_names = {param: name for name, param in model.named_parameters()}
    changed = {*own}
    for item in group:
        target = item.dep.target.module
        if isinstance(target, nn.Parameter):
            owner_name = param_names[target].rpartition(".")[0]
            changed.add(model.get_submodule(owner_name) if owner_name else model)
        elif target in module_names:
            changed.add(target)
    memo: dict[int, Any] = {
        id(tensor): tensor
        for module in model.modules()
        if module not in changed
        for tensor in (*module._parameters.values(), *module._buffers.values())
        if tensor is not None
    }
    for module in changed:  # a tensor tied to an unchanged module is copied too (once, the tie kept in the copy)
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            memo.pop(id(tensor), None)
    clone: nn.Module = _deepcopy(model, memo)

    def counterpart(layer: Any) -> Any:
        """The clone's module or parameter at ``layer``'s place in ``model``; None for Torch-Pruning's op nodes."""
        if isinstance(layer, nn.Parameter):
            return clone.get_parameter(param_names[layer])
        return clone.get_submodule(module_names[layer]) if layer in module_names else None

    _apply_items(clone, graph, [(item, list(item.idxs)) for item in group], counterpart, param_names)
    if isinstance(graph, CoupledGraph):
        follow_cuts(graph, root, channels, clone)
    return clone.eval()


ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
"""Values ``copy.deepcopy`` returns as they are."""


def _deepcopy(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)``, the same copy made faster for the parts a model consists of.

    Modules that copy through their state (no ``__deepcopy__`` or ``__reduce__`` of their own) and plain dicts and
    sets are rebuilt as deepcopy rebuilds them (the new object enters the memo first, then its state is copied item by
    item and, for a module, handed to its ``__setstate__``); atomic values and tuples of them are kept, and anything
    else goes to ``copy.deepcopy`` with the same memo. This skips deepcopy's generic reconstruction of the dozen
    hook dicts every module holds, most of the time a copy took.
    """
    found = memo.get(id(value), memo)
    if found is not memo:
        return found
    kind: Any = type(value)
    if kind in ATOMIC or (kind is tuple and all(type(item) in ATOMIC for item in value)):
        return value
    if kind is dict or kind is OrderedDict:
        new_dict: dict[Any, Any] = kind()
        memo[id(value)] = new_dict
        for key, item in value.items():
            new_dict[_deepcopy(key, memo)] = _deepcopy(item, memo)
        return new_dict
    if kind is set and all(type(item) in ATOMIC for item in value):
        memo[id(value)] = new_set = set(value)
        return new_set
    if isinstance(value, nn.Module) and _copies_through_state(kind):
        state = kind.__getstate__(value)
        if type(state) is dict:
            module = kind.__new__(kind)
            memo[id(value)] = module
            module.__setstate__({key: _deepcopy(item, memo) for key, item in state.items()})
            return module
    return copy.deepcopy(value, memo)


def _copies_through_state(kind: Any) -> bool:
    """Whether ``copy.deepcopy`` copies a module of class ``kind`` as ``__new__`` plus ``__setstate__`` of its
    copied ``__getstate__`` (what :func:`_deepcopy` reproduces)."""
    return (
        getattr(kind, "__deepcopy__", None) is None
        and kind.__reduce_ex__ is object.__reduce_ex__
        and kind.__reduce__ is object.__reduce__
        and not copyreg._slotnames(kind)  # type: ignore[attr-defined]
    )


def _remove_channels(clone: nn.Module, root_name: str, channels: Sequence[int], example_input: torch.Tensor) -> None:
    """Remove ``channels`` of ``root_name``'s output (or those heads) and its group from ``clone``, in place."""
    root = clone.get_submodule(root_name)
    if is_attention(root):
        remove_heads(clone, root_name, channels)
        return
    assert unit_kind(root) is not None, f"{root_name} is not a unit root"
    graph = build_dependency_graph(clone, example_input)
    group = removal_group(graph, root, channels)
    param_names = {param: name for name, param in clone.named_parameters()}
    _apply_items(clone, graph, [(item, list(item.idxs)) for item in group], lambda layer: layer, param_names)
    if isinstance(graph, CoupledGraph):
        follow_cuts(graph, root, channels, clone)  # the sizes the model's own code cuts its channels with


def _apply_items(
    clone: nn.Module,
    graph: tp.DependencyGraph,
    items: Sequence[tuple[Any, list[int]]],
    counterpart: Any,
    param_names: dict[nn.Parameter, str],
) -> None:
    """Remove the given indices of each ``(group item of graph, indices)`` from ``clone``, in place, in that order.

    ``counterpart`` maps a layer or parameter of the traced model to the clone's (the identity when ``graph`` was
    traced on the clone itself; None for Torch-Pruning's op nodes, which hold no tensors of the model), and
    ``param_names`` names the traced model's parameters. Each item's own Torch-Pruning handler is applied to the
    clone's layer, exactly as the item itself would apply it to the traced one.
    """
    for item, idxs in items:
        target = item.dep.target.module
        module = counterpart(target)
        if not idxs or module is None:
            continue
        custom = channel_pruner(graph, target)
        replacement = custom.replacement(module) if custom is not None else None
        if replacement is not None:  # a layer that cannot shrink in place (nn.MultiheadAttention's stream)
            _replace_module(clone, module, replacement)
            module = replacement
        if is_grouped_conv(module) and not is_out_channel_item(graph, item):
            _remove_grouped_conv_inputs(module, idxs)
        elif isinstance(module, nn.Parameter):
            _replace_parameter(clone, param_names[target], _handle(item, module, idxs))
        else:
            extras = per_channel_extras(module) if is_out_channel_item(graph, item) else []
            _handle(item, module, idxs)
            gone = set(idxs)
            for name, extra in extras:
                kept = [i for i in range(extra.shape[0]) if i not in gone]
                setattr(module, name, nn.Parameter(extra.data[kept].clone(), requires_grad=extra.requires_grad))
    sync_stored_widths(clone)  # the ints a model reshapes with (torchvision ViT's hidden_dim), for the next trace too


def _handle(item: Any, layer: Any, idxs: list[int]) -> Any:
    """Apply ``item``'s Torch-Pruning handler to ``layer`` (what ``item.dep(idxs)`` does to the item's own layer:
    the handler's pruner takes the item's pruning dimension first)."""
    dependency = item.dep
    dependency.handler.__self__.pruning_dim = dependency.target.pruning_dim
    return dependency.handler(layer, idxs)


def _remove_grouped_conv_inputs(conv: nn.Conv2d, channels: Sequence[int]) -> None:
    """Remove input channels of a grouped conv; every conv group must lose the same number of them."""
    per_group_in = conv.in_channels // conv.groups
    per_group_out = conv.out_channels // conv.groups
    removed: list[set[int]] = [set() for _ in range(conv.groups)]
    for channel in channels:
        block, local = divmod(int(channel), per_group_in)
        removed[block].add(local)
    counts = {len(r) for r in removed}
    if len(counts) != 1:
        raise ValueError(f"uneven removal across the {conv.groups} conv groups of {conv}: {sorted(counts)}")
    weight = conv.weight.data
    kept_rows = []
    for block, gone in enumerate(removed):
        keep = [i for i in range(per_group_in) if i not in gone]
        rows = weight[block * per_group_out : (block + 1) * per_group_out]
        kept_rows.append(rows[:, keep])
    conv.weight = nn.Parameter(torch.cat(kept_rows, dim=0), requires_grad=conv.weight.requires_grad)
    conv.in_channels -= len(channels)


def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` in every place of ``model`` that holds ``old``."""
    places = [name for name, module in model.named_modules(remove_duplicate=False) if module is old]
    assert places, f"{type(old).__name__} is not a module of the model"
    for name in places:
        owner_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, new)


def _replace_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, value)

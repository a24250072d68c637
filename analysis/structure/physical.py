"""Physically remove channels from a copy of a model with Torch-Pruning (the ground truth masking must match).

Torch-Pruning's low-level handlers are used for every layer except grouped convs' input channels: its handler
keeps the same local positions in every conv group, which is only right when the removed positions coincide. Here
each conv group keeps its own surviving positions, which is what removing those input channels means. Attention
heads are removed by :func:`analysis.structure.heads.remove_heads`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

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
    with its group. Channel indices refer to the unpruned model: groups are disjoint in the channels they remove,
    and the dependency graph is rebuilt after each removal so that concatenations see the current channel offsets."""
    clone = copy.deepcopy(model)
    for root_name, channels in removals:
        _remove(clone, root_name, channels, example_input)
    return clone.eval()


def _remove(clone: nn.Module, root_name: str, channels: Sequence[int], example_input: torch.Tensor) -> None:
    """Remove ``channels`` of ``root_name``'s output (or those heads) and its group from ``clone``, in place."""
    root = clone.get_submodule(root_name)
    if is_attention(root):
        remove_heads(clone, root_name, channels)
        return
    assert unit_kind(root) is not None, f"{root_name} is not a unit root"
    graph = build_dependency_graph(clone, example_input)
    group = removal_group(graph, root, channels)
    param_names = {param: name for name, param in clone.named_parameters()}
    for item in group:
        module, idxs = item.dep.target.module, list(item.idxs)
        if not idxs:
            continue
        if is_grouped_conv(module) and not is_out_channel_item(graph, item):
            _remove_grouped_conv_inputs(module, idxs)
        elif isinstance(module, nn.Parameter):
            _replace_parameter(clone, param_names[module], item.dep(idxs))
        else:
            extras = per_channel_extras(module) if is_out_channel_item(graph, item) else []
            item.dep(idxs)
            gone = set(idxs)
            for name, extra in extras:
                kept = [i for i in range(extra.shape[0]) if i not in gone]
                setattr(module, name, nn.Parameter(extra.data[kept].clone(), requires_grad=extra.requires_grad))


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


def _replace_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, value)

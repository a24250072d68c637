"""Remove a group's channels in place by zeroing their slices, and restore them bit-exactly.

Zeroing a removed channel's filter, bias and BatchNorm scale/shift makes that channel exactly zero, and zeroing
every consumer's input slice makes the zero irrelevant downstream (a customised layer, see
:mod:`analysis.structure.custom_layers`, names its own slices), so for BatchNorm-based CNNs the masked network
computes what the physically smaller network computes. It does not for layers that normalise across channels
(LayerNorm/GroupNorm) or ops with f(0) != 0 before a consumer; the engine detects those per parameter by
comparing against a physically pruned copy (:mod:`analysis.structure.physical`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import EllipsisType
from typing import Any, TypeAlias

import torch
import torch_pruning as tp
from torch import nn

from analysis.structure.custom_layers import channel_pruner
from analysis.structure.groups import CONV_TYPES, is_depthwise, is_out_channel_item
from analysis.structure.heads import is_heads_item, mha_slices

Index: TypeAlias = torch.Tensor | tuple[slice | EllipsisType | torch.Tensor, ...]
"""Where a slice lies in its tensor, usable as ``tensor[index]``: channel indices, or one entry per dimension."""
Slice: TypeAlias = tuple[torch.Tensor, Index]
"""A ``(tensor, index)`` pair that a variant zeroes."""


def zeroed_slices(graph: tp.DependencyGraph, group: Iterable[Any]) -> list[Slice]:
    """List ``(tensor, index)`` pairs to zero for a removal group; ``index`` is usable as ``tensor[index]``."""
    slices: list[Slice] = []
    for item in group:
        module, idxs = item.dep.target.module, list(item.idxs)
        if not idxs:
            continue
        index = torch.tensor(idxs, dtype=torch.long)
        out = is_out_channel_item(graph, item)
        pruner = channel_pruner(graph, module)
        if is_heads_item(item):  # before the customised pruner a MultiheadAttention has for its stream channels
            slices.extend(mha_slices(module, idxs))  # type: ignore[arg-type]  # index objects of the same form
        elif pruner is not None:  # a customised layer (timm's PoolFormer layer scale): its pruner knows its slices
            slices.extend(pruner.mask_slices(module, idxs))
        elif isinstance(module, nn.Parameter):
            dim = graph.module2node[module].pruning_dim
            slices.append((module.data, (slice(None),) * (dim % module.dim()) + (index,)))
        elif isinstance(module, CONV_TYPES):
            slices.extend(_conv_slices(module, index, out))
        elif isinstance(module, nn.Linear):
            if out:
                slices.append((module.weight.data, index))
                if module.bias is not None:
                    slices.append((module.bias.data, index))
            else:
                slices.append((module.weight.data, (slice(None), index)))
        elif isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)):
            for tensor in (module.weight, module.bias):
                if tensor is not None:
                    slices.append((tensor.data, (..., index) if isinstance(module, nn.LayerNorm) else index))
        # PReLU (per channel or shared) needs nothing: PReLU(0) == 0 on a zeroed channel, whatever its slope
    return slices


def _conv_slices(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, index: torch.Tensor, out: bool) -> list[Slice]:
    weight = conv.weight.data
    if out or is_depthwise(conv):
        result: list[Slice] = [(weight, index)]
        if conv.bias is not None:
            result.append((conv.bias.data, index))
        return result
    if conv.groups == 1:
        return [(weight, (slice(None), index))]
    # grouped conv input channel c: output rows of its conv group, local column c % (in_channels // groups)
    per_group_in = conv.in_channels // conv.groups
    per_group_out = conv.out_channels // conv.groups
    rows: list[int] = []
    cols: list[int] = []
    for channel in index.tolist():
        block, local = divmod(channel, per_group_in)
        rows.extend(range(block * per_group_out, (block + 1) * per_group_out))
        cols.extend([local] * per_group_out)
    return [(weight, (torch.tensor(rows), torch.tensor(cols)))]


@contextmanager
def masked(graph: tp.DependencyGraph, group: Iterable[Any]) -> Iterator[None]:
    """Zero the group's slices for the duration of the block; restore the original values afterwards, also when
    the block raises. Restoring writes back saved copies, so the weights are bit-identical to before."""
    with zeroed(zeroed_slices(graph, group)):
        yield


@contextmanager
def zeroed(slices: list[Slice]) -> Iterator[None]:
    """Zero precomputed ``(tensor, index)`` slices (see :func:`zeroed_slices`) for the block, then restore them."""
    saved = []
    with torch.no_grad():
        try:
            for tensor, index in slices:
                saved.append((tensor, index, tensor[index].clone()))
                tensor[index] = 0
            yield
        finally:
            for tensor, index, values in reversed(saved):
                tensor[index] = values

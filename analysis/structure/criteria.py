"""Channel ranking criteria and the choice of which output channels to remove at a ratio.

Scores are "importance": the lowest-scored channels are removed first. By default a conv is ranked on its own
weight (PaddleSlim's behaviour); ``group_reduction: mean`` averages the scores of every conv (or BatchNorm, for
``bn_scale``) whose output channels are in the group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch_pruning as tp
from torch import nn

from analysis.config import CRITERIA as CRITERION_NAMES
from analysis.structure.groups import PrunableUnit, full_group, is_out_channel_item, unit_kind
from analysis.structure.heads import head_weights, is_attention

Criterion = Callable[[torch.Tensor], torch.Tensor]


def l1_norm(weight: torch.Tensor) -> torch.Tensor:
    """Sum of absolute values of each filter (PaddleSlim ``l1_norm``)."""
    return weight.detach().flatten(1).abs().sum(dim=1)


def l2_norm(weight: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of each filter."""
    norms: torch.Tensor = weight.detach().flatten(1).norm(p=2, dim=1)  # torch's Tensor.norm is unannotated
    return norms


def geometry_median(weight: torch.Tensor) -> torch.Tensor:
    """FPGM: sum of Euclidean distances from each filter to all others. Filters near the geometric median (small
    sums) are the most replaceable by the rest, so they are removed first."""
    flat = weight.detach().flatten(1).double()
    return torch.cdist(flat, flat, p=2).sum(dim=1).to(weight.dtype)


def bn_scale(gamma: torch.Tensor) -> torch.Tensor:
    """Absolute BatchNorm scale of each channel (network slimming); takes the BN weight, not the conv weight."""
    return gamma.detach().abs()


_SCORERS: dict[str, Criterion] = {scorer.__name__: scorer for scorer in (l1_norm, l2_norm, geometry_median, bn_scale)}

CRITERIA: dict[str, Criterion] = {name: _SCORERS[name] for name in CRITERION_NAMES}
"""The scoring function of each criterion the config offers (:data:`analysis.config.CRITERIA`, the one list of
names): a name without a function here fails at import, not in a user's run."""


def channels_to_remove(channels: int, ratio: float) -> int:
    """``min(C - 1, round(C * r))`` with Python's round (half to even): at least one channel always stays."""
    return min(channels - 1, round(channels * ratio))


def removal_count(channels: int, ratio: float, blocks: int = 0, round_to: int = 1) -> int:
    """How many of ``channels`` a removal at ``ratio`` takes, with the structural constraints of its group.

    The count starts as :func:`channels_to_remove`. With ``blocks`` conv groups (a grouped conv in the group) it is
    rounded down to a multiple of ``blocks`` (each conv group gives up the same number). With ``round_to`` N > 1
    the count becomes the allowed count (:func:`allowed_counts`: no removal, or keeping a positive multiple of
    ``lcm(N, blocks)`` channels) whose kept channels are nearest to the unrounded kept count; ties keep more.
    """
    count = channels_to_remove(channels, ratio)
    if round_to <= 1:
        step = blocks or 1
        return count // step * step
    kept = channels - count
    return min(allowed_counts(channels, blocks, round_to), key=lambda other: (abs(channels - other - kept), other))


def allowed_counts(channels: int, blocks: int = 0, round_to: int = 1) -> list[int]:
    """Every removal count the constraints of :func:`removal_count` allow, ascending (0 first: no removal)."""
    if round_to <= 1:
        step = blocks or 1
        return list(range(0, channels, step))
    step = math.lcm(round_to, blocks or 1)
    kept = list(range(channels // step * step, 0, -step))
    counts = [channels - k for k in kept]
    return counts if counts and counts[0] == 0 else [0, *counts]


def select_channels(
    scores: torch.Tensor, ratio: float, blocks: Sequence[Sequence[int]] = (), round_to: int = 1
) -> list[int]:
    """Pick the channels to remove at ``ratio``: the lowest-scored ones (ties: lower index first).

    With ``blocks`` (the conv groups of a grouped conv in the group), the count is rounded down to a multiple of
    the number of blocks and each block gives up the same number of its own lowest-scored channels; ``round_to``
    keeps a multiple of that many channels (see :func:`removal_count`).
    """
    return lowest_channels(scores, removal_count(len(scores), ratio, len(blocks), round_to), blocks)


def lowest_channels(scores: torch.Tensor, count: int, blocks: Sequence[Sequence[int]] = ()) -> list[int]:
    """The ``count`` lowest-scored channels (ties: lower index first), sorted; with ``blocks``, ``count`` is
    rounded down to a multiple of their number and each block gives up the same number of its own channels."""
    scores = scores.detach().float().cpu()
    if not blocks:
        order = torch.argsort(scores, stable=True)
        return sorted(order[:count].tolist())
    per_block = count // len(blocks)
    chosen: list[int] = []
    for block in blocks:
        block_scores = scores[list(block)]
        order = torch.argsort(block_scores, stable=True)[:per_block]
        chosen.extend(block[i] for i in order.tolist())
    return sorted(chosen)


def channel_scores(
    model: nn.Module, graph: tp.DependencyGraph, param: PrunableUnit, criterion: str, group_reduction: str = "self"
) -> torch.Tensor:
    """Importance of each output channel of ``param`` (low = removed first).

    ``group_reduction: self`` ranks on the conv's own weight (or its BatchNorm for ``bn_scale``); ``mean``
    averages over every conv (or BatchNorm) whose output channels are in the group, mapped to the root's channels.

    Raises:
        ValueError: If the criterion cannot score this param (no BatchNorm for ``bn_scale``, unscored channels).
    """
    conv = model.get_submodule(param.module_name)
    if is_attention(conv):
        if criterion == "bn_scale":
            raise ValueError(f"{param.name} is a set of attention heads, which have no BatchNorm")
        return CRITERIA[criterion](head_weights(conv))  # each head's q/k/v rows and output columns; no group to mean
    assert unit_kind(conv) is not None, f"{param.module_name} is not a unit root"
    if group_reduction == "self":
        if criterion == "bn_scale":
            if param.bn_name is None:
                raise ValueError(f"{param.name} has no BatchNorm after it")
            batchnorm = model.get_submodule(param.bn_name)
            assert isinstance(batchnorm, nn.modules.batchnorm._BatchNorm)  # bn_name is only ever set to a BatchNorm
            return bn_scale(batchnorm.weight)
        weight = conv.weight
        assert isinstance(weight, torch.Tensor)
        return CRITERIA[criterion](weight)
    total = torch.zeros(param.channels, dtype=torch.float64)
    count = torch.zeros(param.channels, dtype=torch.float64)
    for item in full_group(graph, conv):
        module = item.dep.target.module
        if not is_out_channel_item(graph, item):
            continue
        if criterion == "bn_scale":
            if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.weight is None:
                continue
            scores = bn_scale(module.weight)
        elif unit_kind(module) in ("conv", "linear"):
            scores = CRITERIA[criterion](module.weight)
        else:
            continue
        local = torch.tensor(list(item.idxs))
        root = torch.tensor(list(item.root_idxs))
        total.index_add_(0, root, scores.double().cpu()[local])
        count.index_add_(0, root, torch.ones(len(root), dtype=torch.float64))
    if not bool((count > 0).all()):
        raise ValueError(f"{param.name}: some channels have no {criterion} score in the group")
    return (total / count).float()

"""NNI 2.x's ``fix_mask_conflict``: make pruning masks agree within each channel dependency set, under NNI's name.

NNI 3.0 removed ``fix_mask_conflict`` (``nni.compression.pytorch.utils``); this module offers the same call on top of
the dependency sets of :mod:`analysis.compat.topology`. Where the results differ from NNI 2.10, the function's docstring
says how and why.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.compat.topology import BlockKey, Component, example_tensor, layer_weight, out_channels, trace_topology
from analysis.errors import ConfigError, UserError, did_you_mean
from analysis.structure.groups import is_depthwise, is_grouped_conv

__all__ = ["fix_mask_conflict"]

MASK_MODES = ("intersection", "union")

Masks = dict[str, dict[str, torch.Tensor]]


def fix_mask_conflict(
    masks: Mapping[str, Mapping[str, torch.Tensor]] | str | os.PathLike[str],
    model: nn.Module,
    dummy_input: Any,
    traced: Any = None,
    mode: str = "intersection",
) -> Masks:
    """Make filter masks agree within each dependency set, so the masked model can really be made smaller.

    Each layer's channel mask is taken from its weight mask: an output channel is kept when any weight element of
    its filter is non-zero. Then, per set of :class:`~analysis.compat.topology.ChannelDependency` (coupled channels,
    e.g. a residual stage):

    - ``mode="intersection"`` (NNI's rule): a channel is removed only if every member that has a mask removes it,
      i.e. it is kept if any member keeps it.
    - ``mode="union"``: a channel is removed if any member with a mask removes it.

    A member without a mask keeps all its channels, as in NNI: in ``"intersection"`` mode it therefore vetoes every
    removal in its set (a layer left out of pruning, such as an excluded stem conv, must keep its channels, so the
    channels coupled to it stay). The exception are depthwise and grouped convs, whose filters follow their input
    channels: without a mask they have no say (in NNI they are sets of their own, so their missing mask does not
    hold back the conv feeding them). When the result removes channels of a member without a mask, that member gets
    a mask, so all coupled layers agree.

    Grouped convs reached by a set's channels (as members, or through their input channels) need the same number of
    channels removed in each conv group. ``"intersection"`` mode revives removed channels in the conv groups that
    lose more than the fewest, ``"union"`` mode removes more channels in the conv groups that lose fewer than the
    most; either picks channels by the L1 norm of their filters (revive the largest, remove the smallest). NNI
    revives by position instead, and only before merging.

    Written masks follow NNI: kept channels get whole-filter ones, removed channels whole-filter zeros (so
    fine-grained masks of coupled layers become filter masks), and the bias mask likewise when the layer has a bias.
    Masks of layers in singleton sets that reach no grouped conv, and of modules in no set (BatchNorm, layers the
    forward pass does not run), are returned unchanged.

    Args:
        masks: NNI's masks ``{module name: {"weight": tensor, "bias": tensor (optional)}}``, or the path of a file
            saved with ``torch.save`` (loaded with ``weights_only=True``).
        model: The network the masks belong to.
        dummy_input: One batched input tensor (or a 1-tuple of it) to trace the model with.
        traced: Accepted for NNI compatibility and ignored: the model is always traced with Torch-Pruning.
        mode: ``"intersection"`` (default, NNI's rule) or ``"union"``.

    Returns:
        A new masks dict (the input is not modified): every input entry, fixed where needed, plus entries added
        for unmasked members that lose channels.

    Raises:
        ValueError: For an unknown ``mode``.
        ConfigError: For an unreadable mask file, a malformed masks dict, a name that is not a module of the model,
            a mask whose shape is not its layer's weight shape, or masks of a kind NNI handles otherwise
            (BatchNorm-only masks, input-channel masks).
        UserError: When the result would remove every output channel of a layer, or grouped convs cannot be given
            an even removal.
    """
    if mode not in MASK_MODES:
        raise ValueError(f"unknown mode '{mode}'; use one of {list(MASK_MODES)}")
    loaded = _load_masks(masks)
    modules = dict(model.named_modules())
    _check_masks(loaded, modules)
    topology = trace_topology(model, example_tensor(model, dummy_input))
    result: Masks = {name: {k: _copy(v) for k, v in entry.items()} for name, entry in loaded.items()}
    for members, components in zip(topology.sets, topology.components, strict=True):
        if not any(name in loaded for name in members):
            continue
        if len(members) == 1 and not any(component.blocks for component in components):
            continue
        for name in members:
            if name in loaded and loaded[name]["weight"].shape != modules[name].weight.shape:
                raise ConfigError(
                    f"masks: the weight mask of '{name}' has shape {tuple(loaded[name]['weight'].shape)} but the "
                    f"layer's weight has shape {tuple(modules[name].weight.shape)}; masks must match the weights."
                )
        kept = _resolve_set(members, components, loaded, modules, mode)
        _write_set_masks(result, members, kept, loaded, modules)
    return result


def _out_dim(module: nn.Module) -> int:
    """The weight dimension of output channels: 1 for transposed convs (``in x out/groups x k``), else 0."""
    return 1 if isinstance(module, nn.ConvTranspose2d) else 0


def _follows_input(module: nn.Module) -> bool:
    """True for convs whose filters are tied to their input channels (depthwise, grouped)."""
    return is_depthwise(module) or is_grouped_conv(module)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _load_masks(masks: Mapping[str, Mapping[str, torch.Tensor]] | str | os.PathLike[str]) -> Masks:
    """The masks dict, loaded from ``masks`` when it is a path, checked for NNI's layout."""
    if isinstance(masks, (str, os.PathLike)):
        path = Path(masks)
        if not path.is_file():
            raise ConfigError(f"mask file '{path}' does not exist; pass a masks dict or a file saved with torch.save.")
        try:
            masks = torch.load(path, weights_only=True)
        except Exception as error:  # unpickling errors have many types
            raise ConfigError(
                f"cannot load masks from '{path}' with weights_only=True ({type(error).__name__}); save a plain dict "
                "{module name: {'weight': tensor, 'bias': tensor}} with torch.save."
            ) from error
    if not isinstance(masks, Mapping) or not masks:
        raise ConfigError(
            "masks must be a non-empty dict {module name: {'weight': tensor, 'bias': tensor}} (NNI's mask format)."
        )
    for name, entry in masks.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("weight"), torch.Tensor):
            raise ConfigError(f"masks: the entry of '{name}' must be a dict with a 'weight' tensor (and 'bias').")
    return {str(name): dict(entry) for name, entry in masks.items()}


def _check_masks(masks: Masks, modules: dict[str, nn.Module]) -> None:
    """Refuse names that are not modules, and the mask kinds NNI fixes with other dependency types."""
    for name in masks:
        if name not in modules:
            raise ConfigError(
                f"masks: '{name}' is not a module of this model{did_you_mean(name, modules)}; keys are module "
                "names such as 'layer1.0.conv1'."
            )
    if all(isinstance(modules[name], nn.modules.batchnorm._BatchNorm) for name in masks):
        raise ConfigError(
            "masks: only BatchNorm layers are masked (NNI's 'Batchnorm' prune type), which is not supported; "
            "pass filter masks of the conv and linear layers."
        )
    filters = inputs = 0.0
    for name, entry in masks.items():
        if type(modules[name]) is nn.Conv2d and entry["weight"].dim() == 4:
            kept = entry["weight"].ne(0)
            filters += 1 - kept.flatten(1).any(1).float().mean().item()
            inputs += 1 - kept.transpose(0, 1).flatten(1).any(1).float().mean().item()
    if inputs > filters:  # NNI's test: more input channels than filters removed means input-channel pruning
        raise ConfigError(
            "masks: the conv masks remove input channels rather than filters (input-channel pruning, as NNI's "
            "AMC pruner does), which is not supported; pass filter (output channel) masks."
        )


def _kept_channels(module: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """Bool per output channel: True when any element of the channel's filter mask is non-zero."""
    return mask.ne(0).transpose(0, _out_dim(module)).flatten(1).any(1).cpu()


def _filter_l1(module: nn.Module) -> torch.Tensor:
    """L1 norm of each output channel's filter."""
    weight = layer_weight(module).detach().float().abs()
    return weight.transpose(0, _out_dim(module)).flatten(1).sum(1).cpu()


def _resolve_set(
    members: Sequence[str],
    components: Sequence[Component],
    masks: Masks,
    modules: dict[str, nn.Module],
    mode: str,
) -> dict[str, list[bool]]:
    """Which output channels each member of a set keeps, by ``mode``, with even removal across conv groups."""
    for name in members:
        module = modules[name]
        if isinstance(module, nn.ConvTranspose2d) and module.groups > 1:
            raise UserError(f"'{name}' is a grouped transposed conv, whose masks cannot be fixed; leave it unmasked.")
    masked = [name for name in members if name in masks]
    votes_of = {name: _kept_channels(modules[name], masks[name]["weight"]).tolist() for name in masked}
    vetoes = {name for name in members if name not in masks and not _follows_input(modules[name])}
    removed = []
    for component in components:
        votes = [votes_of[name][channel] for name, channel in component.channels if name in votes_of]
        if mode == "intersection":
            vetoed = any(name in vetoes for name, _ in component.channels)
            removed.append(bool(votes) and not any(votes) and not vetoed)
        else:
            removed.append(not all(votes))
    if any(component.blocks for component in components):
        l1 = {name: _filter_l1(modules[name]).tolist() for name in members}
        scores = [sum(l1[name][channel] for name, channel in c.channels) for c in components]
        _even_out(removed, components, scores, modules, mode)
    kept = {name: [True] * out_channels(modules[name]) for name in members}
    for component, gone in zip(components, removed, strict=True):
        if gone:
            for name, channel in component.channels:
                kept[name][channel] = False
    for name in members:
        if not any(kept[name]):
            raise UserError(
                f"fixing the masks in mode '{mode}' would remove every output channel of '{name}'; keep at least "
                "one channel of its dependency set in the masks (or use mode='intersection')."
            )
    return kept


def _even_out(
    removed: list[bool],
    components: Sequence[Component],
    scores: Sequence[float],
    modules: dict[str, nn.Module],
    mode: str,
) -> None:
    """Revive (intersection) or remove more (union) channels until each grouped conv loses the same number of
    channels in every conv group; ``removed`` is updated in place.

    Candidates are taken by the L1 norm of their filters: the strongest removed ones are revived first, the weakest
    kept ones removed first (ties: lowest channel). Each component changes at most once, so the loop ends.
    """
    reviving = mode == "intersection"
    keys = sorted({key for component in components for key in component.blocks})
    counts = {key: [0] * _conv_groups(modules[key[0]]) for key in keys}
    candidates: dict[tuple[BlockKey, int], list[int]] = defaultdict(list)
    for index, component in enumerate(components):
        for key, per_block in component.blocks.items():
            for block, count in per_block.items():
                candidates[(key, block)].append(index)
                counts[key][block] += count if removed[index] else 0
    for indexes in candidates.values():
        indexes.sort(key=(lambda i: (-scores[i], i)) if reviving else (lambda i: (scores[i], i)))

    def flip(index: int) -> None:
        removed[index] = not removed[index]
        sign = 1 if removed[index] else -1
        for key, per_block in components[index].blocks.items():
            for block, count in per_block.items():
                counts[key][block] += sign * count

    changed = True
    while changed:
        changed = False
        for key in keys:
            for block in range(len(counts[key])):
                for index in candidates.get((key, block), ()):
                    if counts[key][block] == (min(counts[key]) if reviving else max(counts[key])):
                        break
                    if removed[index] == reviving:
                        flip(index)
                        changed = True
    for key in keys:
        if len(set(counts[key])) > 1:
            raise UserError(
                f"cannot remove channels evenly across the {modules[key[0]].groups} conv groups of grouped conv "
                f"'{key[0]}' ({key[1]}put channels); change the masks of the layers feeding it."
            )


def _conv_groups(module: nn.Module) -> int:
    """The number of conv groups of a (grouped) conv."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    return module.groups


def _write_set_masks(
    result: Masks, members: Sequence[str], kept: Mapping[str, list[bool]], masks: Masks, modules: dict[str, nn.Module]
) -> None:
    """Write whole-filter masks for every masked member of a set, and for unmasked members that lose channels."""
    reference = next(masks[name]["weight"] for name in members if name in masks)
    for name in members:
        module = modules[name]
        if name not in masks and all(kept[name]):
            continue
        channels = torch.tensor(kept[name], dtype=torch.bool)
        entry = result.setdefault(name, {})
        weight_like = masks[name]["weight"] if name in masks else reference.new_empty(layer_weight(module).shape)
        entry["weight"] = _filter_mask(channels, weight_like, _out_dim(module))
        old_bias = entry.get("bias")
        if module.bias is not None or isinstance(old_bias, torch.Tensor):
            bias_like = old_bias if isinstance(old_bias, torch.Tensor) else weight_like
            entry["bias"] = channels.to(device=bias_like.device, dtype=bias_like.dtype)


def _filter_mask(kept: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """A mask shaped and typed like ``like``: ones on kept output channels along ``dim``, zeros elsewhere."""
    shape = [1] * like.dim()
    shape[dim] = -1
    return kept.to(device=like.device, dtype=like.dtype).view(shape).expand(like.shape).clone()

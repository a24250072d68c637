"""Torch-Pruning customised pruners for layers it has no pruner of its own for, and their registry (by class).

Torch-Pruning prunes the parameters of a module it does not know as *unwrapped parameters*: it slices the tensors
and leaves the module's Python state alone. A layer whose forward reshapes its per-channel parameter with a shape
stored at construction (timm's ``metaformer.Scale`` in PoolFormer: ``x * self.scale.view(self.shape)`` with
``self.shape = (dim, 1, 1)``) then breaks after removal. Passed to ``build_dependency`` as ``customized_pruners=``
(Torch-Pruning's public extension point), a pruner here makes such a module one node whose pruner slices the
parameter and rewrites the stored shape together.

Each pruner also says what masking zeroes (:meth:`ChannelPruner.mask_slices`) and which shapes removal leaves
(:meth:`ChannelPruner.pruned_shapes`), so that masking, physical removal and cost counting treat the module alike.

A layer whose channels cannot be removed at all gets a :class:`FixedWidthPruner`: it only reports its width, so
that Torch-Pruning traces the layer as one node (torchvision's ``ShiftedWindowAttention`` calls ``F.linear`` on its
own weights, which the tracing cannot follow), and every unit whose group holds it is left out with its reason;
removal raises rather than slicing.

The registry is keyed by class (Torch-Pruning looks customised pruners up by the exact class). Classes of optional
packages (timm) are named by module and class name and take part once their module is imported (a model holding
one has imported it): nothing here imports them, so ``import analysis`` stays free of timm.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch_pruning.pruner.function import BasePruningFunc


class ChannelPruner(BasePruningFunc):  # type: ignore[misc]  # Torch-Pruning is unannotated
    """A customised pruner for a layer whose input and output channels are the same channels (Torch-Pruning couples
    them because ``prune_in_channels`` is ``prune_out_channels``), and which keeps the values of the channels that
    remain, as a per-channel scale does."""

    def __init__(self) -> None:
        super().__init__(pruning_dim=0)

    def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        """Torch-Pruning's handler: :meth:`remove` channels ``idxs`` of ``layer`` in place; returns the layer."""
        self.remove(layer, sorted({int(i) for i in idxs}))
        return layer

    prune_in_channels = prune_out_channels  # the same bound method: Torch-Pruning couples input and output

    def get_out_channels(self, layer: nn.Module) -> int:
        return self.channels(layer)

    get_in_channels = get_out_channels

    @abstractmethod
    def remove(self, layer: nn.Module, idxs: list[int]) -> None:
        """Remove channels ``idxs`` (sorted, distinct) from ``layer`` in place, its stored sizes included."""

    @abstractmethod
    def channels(self, layer: nn.Module) -> int:
        """How many channels ``layer`` has."""

    @abstractmethod
    def mask_slices(self, layer: nn.Module, idxs: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor, index)`` pairs whose zeroing makes channels ``idxs`` of ``layer``'s output zero."""

    @abstractmethod
    def pruned_shapes(self, layer: nn.Module, count: int) -> list[tuple[torch.Tensor, list[int]]]:
        """``(parameter, shape after)`` for each parameter of ``layer`` that removing ``count`` channels shrinks."""

    def problem(self, layer: nn.Module) -> str | None:
        """Why no channel of ``layer`` can be removed (a unit whose group holds it is left out with it), or None."""
        return None

    def replacement(self, layer: nn.Module) -> nn.Module | None:
        """A module computing what ``layer`` computes that :meth:`remove` can shrink, for a layer that cannot be
        shrunk in place (physical removal puts it in ``layer``'s place first), or None."""
        return None


class LayerScalePruner(ChannelPruner):
    """For a layer whose only per-channel state is a 1-D parameter over its channels (attribute ``param``) and a
    stored broadcast shape whose first entry is the channel count (attribute ``shape``), used as
    ``x * param.view(shape)``: removal slices the parameter and sets ``shape = (kept, *shape[1:])``."""

    def __init__(self, param: str = "scale", shape: str = "shape") -> None:
        super().__init__()
        self.param, self.shape = param, shape

    def _vector(self, layer: nn.Module) -> nn.Parameter:
        vector = getattr(layer, self.param)
        assert isinstance(vector, nn.Parameter) and vector.dim() == 1, f"{type(layer).__name__}.{self.param}"
        return vector

    def remove(self, layer: nn.Module, idxs: list[int]) -> None:
        vector = self._vector(layer)
        gone = set(idxs)
        keep = [i for i in range(vector.shape[0]) if i not in gone]
        setattr(layer, self.param, nn.Parameter(vector.data[keep].clone(), requires_grad=vector.requires_grad))
        shape = tuple(getattr(layer, self.shape))
        setattr(layer, self.shape, (len(keep), *shape[1:]))

    def channels(self, layer: nn.Module) -> int:
        return int(self._vector(layer).shape[0])

    def mask_slices(self, layer: nn.Module, idxs: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self._vector(layer).data, torch.tensor([int(i) for i in idxs], dtype=torch.long))]

    def pruned_shapes(self, layer: nn.Module, count: int) -> list[tuple[torch.Tensor, list[int]]]:
        vector = self._vector(layer)
        return [(vector, [vector.shape[0] - count])] if count else []


class FixedWidthPruner(BasePruningFunc):  # type: ignore[misc]  # Torch-Pruning is unannotated
    """A customised pruner for a layer whose channels cannot be removed: it reports the layer's width (the input
    features of its Linear ``linear``, which are also its output channels) so that Torch-Pruning can trace through
    it, and refuses every removal. The package leaves each unit whose group holds such a layer out with ``reason``."""

    def __init__(self, reason: str, linear: str) -> None:
        super().__init__(pruning_dim=0)
        self.reason, self.linear = reason, linear

    def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        raise ValueError(f"cannot remove channels of {type(layer).__name__}: {self.reason}")

    prune_in_channels = prune_out_channels

    def get_out_channels(self, layer: nn.Module) -> int:
        linear = getattr(layer, self.linear)
        assert isinstance(linear, nn.Linear), f"{type(layer).__name__}.{self.linear}"
        return int(linear.in_features)

    get_in_channels = get_out_channels


SWIN_ATTENTION_REASON = (
    "the attention derives its head width from the residual stream's width (torchvision ShiftedWindowAttention)"
)
"""torchvision's ``ShiftedWindowAttention`` reshapes ``qkv`` to ``(..., 3, num_heads, C // num_heads)`` with ``C``
the width of its input (swin_transformer.py:180): neither stream channels nor heads can be removed alone."""

MAXVIT_ATTENTION_REASON = (
    "the attention reshapes its heads' output to the width of its input, the residual stream "
    "(torchvision MaxViT RelativePositionalMultiHeadAttention)"
)
"""torchvision's MaxViT attention computes ``out.reshape(B, G, P, D)`` with ``D`` the width of its input
(maxvit.py:206): the stream's channels cannot be removed without changing its heads."""

Pruner = ChannelPruner | FixedWidthPruner
"""A customised pruner of the registry."""

_SWIN = "torchvision.models.swin_transformer"
_REGISTERED: dict[type[nn.Module], Pruner] = {}
OPTIONAL: dict[tuple[str, str], Pruner] = {
    ("timm.models.metaformer", "Scale"): LayerScalePruner(),
    (_SWIN, "ShiftedWindowAttention"): FixedWidthPruner(SWIN_ATTENTION_REASON, "qkv"),
    (_SWIN, "ShiftedWindowAttentionV2"): FixedWidthPruner(SWIN_ATTENTION_REASON, "qkv"),
    ("torchvision.models.maxvit", "RelativePositionalMultiHeadAttention"): FixedWidthPruner(
        MAXVIT_ATTENTION_REASON, "to_qkv"
    ),
}
"""Classes of optional packages, by ``(module, class name)``: used once that module is imported."""


def register(layer_type: type[nn.Module], pruner: Pruner) -> None:
    """Make every module of exactly ``layer_type`` a customised layer removed and masked by ``pruner``."""
    _REGISTERED[layer_type] = pruner


def unregister(layer_type: type[nn.Module]) -> None:
    """Undo :func:`register` (nothing happens for a class not registered)."""
    _REGISTERED.pop(layer_type, None)


def customized_pruners() -> dict[type[nn.Module], Pruner]:
    """The pruners to pass to ``DependencyGraph.build_dependency(customized_pruners=...)``: the attention modules'
    stream pruner (:mod:`analysis.structure.attention_stream`), the registered classes and those of :data:`OPTIONAL`
    whose module is imported."""
    from analysis.structure.attention_stream import PRUNERS  # it imports heads, which imports this module

    found: dict[type[nn.Module], Pruner] = dict(PRUNERS)
    for (module_name, class_name), pruner in OPTIONAL.items():
        layer_type = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(layer_type, type) and issubclass(layer_type, nn.Module):
            found[layer_type] = pruner
    found.update(_REGISTERED)
    return found


def channel_pruner(graph: Any, module: object) -> ChannelPruner | None:
    """The customised pruner ``graph`` (a ``tp.DependencyGraph``) removes ``module`` with, or None."""
    if not isinstance(module, nn.Module):
        return None
    pruner = graph.get_pruner_of_module(module)
    return pruner if isinstance(pruner, ChannelPruner) else None


def fixed_width_pruner(graph: Any, module: object) -> FixedWidthPruner | None:
    """The customised pruner that keeps ``module``'s channels in ``graph`` (a ``tp.DependencyGraph``), or None."""
    if not isinstance(module, nn.Module):
        return None
    pruner = graph.get_pruner_of_module(module)
    return pruner if isinstance(pruner, FixedWidthPruner) else None

"""Residual-stream channels through ``nn.MultiheadAttention``: removed as channels, the attention left as it is.

In torchvision's ViT the attention reads the residual stream and adds its output back to it, so the stream's channels
are the attention's input columns (``in_proj_weight[:, c]``) and its output rows (``out_proj.weight[c]``,
``out_proj.bias[c]``). Torch-Pruning's own MultiheadAttention pruner removes the same indices from the q, k and v
rows too, which moves the head boundaries: that is not removing stream channels. :class:`StreamAttentionPruner`
(a customised pruner, see :mod:`analysis.structure.custom_layers`) removes only the stream's columns and rows, so
every head keeps its width and the attention computes the same function of the remaining channels.

``nn.MultiheadAttention`` cannot take a stream narrower than its inner width, so removal first replaces it with a
:class:`~analysis.structure.heads.PrunedMultiheadAttention` (the same call, any stream width, plain matrix products
that trace and export). Heads are removed into the same class; a joint removal takes heads first
(:func:`~analysis.structure.physical.jointly_pruned_copy`), then the stream pruner narrows that module in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from analysis.structure.custom_layers import ChannelPruner
from analysis.structure.heads import PrunedMultiheadAttention, layout_problem

Attention = nn.MultiheadAttention | PrunedMultiheadAttention
"""The modules whose stream channels :class:`StreamAttentionPruner` removes."""


class StreamAttentionPruner(ChannelPruner):
    """Removes residual-stream channels of an attention module (input columns of the q/k/v projection, output rows
    of the output projection), keeping its heads and inner width: the customised pruner of ``nn.MultiheadAttention``
    and :class:`~analysis.structure.heads.PrunedMultiheadAttention`."""

    def channels(self, layer: nn.Module) -> int:
        return int(_attention(layer).embed_dim)

    def problem(self, layer: nn.Module) -> str | None:
        """Why the stream through ``layer`` cannot be removed (separate key/value widths, bias_k, zero attention)."""
        return layout_problem(layer)

    def replacement(self, layer: nn.Module) -> nn.Module | None:
        """``nn.MultiheadAttention`` cannot narrow its stream in place: the equal module that can, else None."""
        if isinstance(layer, nn.MultiheadAttention):
            return PrunedMultiheadAttention.from_module(layer, [])
        return None

    def remove(self, layer: nn.Module, idxs: list[int]) -> None:
        if not isinstance(layer, PrunedMultiheadAttention):
            raise TypeError(f"replace the {type(layer).__name__} (StreamAttentionPruner.replacement) before removal")
        gone = set(idxs)
        keep = [i for i in range(layer.embed_dim) if i not in gone]
        layer.in_proj_weight = _kept(layer.in_proj_weight, (slice(None), keep))
        out = layer.out_proj
        out.weight = _kept(out.weight, keep)
        if out.bias is not None:
            out.bias = _kept(out.bias, keep)
        out.out_features = layer.embed_dim = len(keep)

    def mask_slices(self, layer: nn.Module, idxs: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        attention = _attention(layer)
        index = torch.tensor([int(i) for i in idxs], dtype=torch.long)
        assert attention.in_proj_weight is not None  # problem() refuses separate projections
        slices: list[tuple[torch.Tensor, object]] = [
            (attention.in_proj_weight.data, (slice(None), index)),
            (attention.out_proj.weight.data, index),
        ]
        if attention.out_proj.bias is not None:
            slices.append((attention.out_proj.bias.data, index))
        return slices  # type: ignore[return-value]  # index objects of the form masking accepts

    def pruned_shapes(self, layer: nn.Module, count: int) -> list[tuple[torch.Tensor, list[int]]]:
        if not count:
            return []
        attention = _attention(layer)
        assert attention.in_proj_weight is not None
        rows, stream = attention.in_proj_weight.shape
        inner = attention.out_proj.weight.shape[1]
        shapes: list[tuple[torch.Tensor, list[int]]] = [
            (attention.in_proj_weight, [rows, stream - count]),
            (attention.out_proj.weight, [stream - count, inner]),
        ]
        if attention.out_proj.bias is not None:
            shapes.append((attention.out_proj.bias, [stream - count]))
        return shapes


def _attention(layer: nn.Module) -> Attention:
    assert isinstance(layer, (nn.MultiheadAttention, PrunedMultiheadAttention)), type(layer).__name__
    return layer


def _kept(param: torch.Tensor, index: object) -> nn.Parameter:
    """A new parameter holding ``param[index]`` (a copy), with ``param``'s ``requires_grad``."""
    return nn.Parameter(param.data[index].clone(), requires_grad=param.requires_grad)  # type: ignore[index]


STREAM_PRUNER = StreamAttentionPruner()
PRUNERS: dict[type[nn.Module], ChannelPruner] = {
    nn.MultiheadAttention: STREAM_PRUNER,
    PrunedMultiheadAttention: STREAM_PRUNER,
}
"""The customised pruners of this module, by class (see :func:`analysis.structure.custom_layers.customized_pruners`)."""


def sync_stored_widths(model: nn.Module) -> None:
    """Set the stream width a model stores as an int to the width its tensors now have (torchvision's
    ``VisionTransformer.hidden_dim``, read by its forward to reshape the patches: the class token's width), so that
    a copy whose stream channels were removed runs; other models are left as they are."""
    for module in model.modules():
        kind = type(module)
        if (kind.__module__, kind.__name__) == ("torchvision.models.vision_transformer", "VisionTransformer"):
            token = module.class_token
            assert isinstance(token, torch.Tensor)
            setattr(module, "hidden_dim", int(token.shape[-1]))  # noqa: B010  # an int attribute torch does not know

"""Attention heads as prunable units: which modules have them, what removing a head takes, and the smaller module.

Two kinds of attention module qualify. timm-style modules hold ``qkv`` and ``proj`` Linear layers and read
``num_heads`` at run time (ViT, DeiT, Swin, ...); ``nn.MultiheadAttention`` holds one ``in_proj_weight``. In both
the q, k and v projections are three blocks of ``heads x head_dim`` rows, head-major. Removing head h takes its
rows of the three blocks (and their biases) and its ``head_dim`` input columns of the output projection.

A masked head contributes exactly nothing: its values are zero and so are the output columns that read them. The
module without the head computes the same, unless something mixes the heads before the output projection (a norm
over all heads); the engine's mask-versus-physical check finds that and evaluates such units on pruned copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch_pruning as tp
from torch import nn

from analysis.structure.custom_layers import SWIN_ATTENTION_REASON

HEADS_SUFFIX = ".heads"
"""Units of heads are named ``<attention module>.heads`` in the analysis file."""

# Attributes of timm-style attention modules that hold one entry per head on their last dimension.
_PER_HEAD_TABLES = ("relative_position_bias_table",)

HEAD_STRUCTURED: dict[tuple[str, str], tuple[str, ...]] = {
    ("timm.models.levit", "Attention"): ("qkv",),
    ("timm.models.levit", "AttentionDownsample"): ("kv", "q"),
}
"""Attention classes whose heads are not a unit, by ``(module, class name)``, and the children whose outputs they
view per head: ``qkv(x).view(B, N, heads, -1).split([key_dim, key_dim, val_dim], dim=3)`` (timm levit.py) reads
a stored per-head width, so removing single output features of these layers is not defined."""


@dataclass(frozen=True)
class HeadLayout:
    """How an attention module lays out its heads.

    Attributes:
        heads: Number of heads.
        head_dim: Channels per head.
    """

    heads: int
    head_dim: int

    @property
    def width(self) -> int:
        """Channels of each of the q, k and v blocks (``heads * head_dim``)."""
        return self.heads * self.head_dim

    def channels(self, heads: Sequence[int]) -> list[int]:
        """Channels of ``heads`` within one q/k/v block, which are also the output projection's input columns."""
        return [h * self.head_dim + j for h in sorted(heads) for j in range(self.head_dim)]

    def qkv_rows(self, heads: Sequence[int]) -> list[int]:
        """Rows of ``heads`` in the stacked q, k, v projection."""
        block = self.channels(heads)
        return [part * self.width + c for part in range(3) for c in block]


def head_layout(module: nn.Module) -> HeadLayout | None:
    """The head layout of an attention module whose heads can be counted, or None for any other module."""
    if isinstance(module, nn.MultiheadAttention):
        return HeadLayout(module.num_heads, module.head_dim)
    qkv, proj, heads = getattr(module, "qkv", None), getattr(module, "proj", None), getattr(module, "num_heads", None)
    if not (isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear) and isinstance(heads, int) and heads > 0):
        return None
    head_dim = getattr(module, "head_dim", qkv.out_features // (3 * heads))
    if (
        not isinstance(head_dim, int)
        or qkv.out_features != 3 * heads * head_dim
        or proj.in_features != heads * head_dim
    ):
        return None
    return HeadLayout(heads, head_dim)


def is_attention(module: nn.Module) -> bool:
    """True for a module whose heads are a unit (see :func:`head_layout`)."""
    return head_layout(module) is not None


def layout_problem(module: nn.Module) -> str | None:
    """Why the heads of an attention module cannot be removed, or None when they can."""
    if type(module).__module__ == "torchvision.models.swin_transformer":  # its head width is the stream's / heads
        return SWIN_ATTENTION_REASON
    if isinstance(module, nn.MultiheadAttention):
        if not module._qkv_same_embed_dim or module.in_proj_weight is None:
            return "MultiheadAttention with separate kdim/vdim projections is not supported"
        if module.bias_k is not None or module.add_zero_attn:
            return "MultiheadAttention with add_bias_kv or add_zero_attn is not supported"
    return None


def head_structured_layers(module: nn.Module) -> list[nn.Module]:
    """The conv and Linear layers whose outputs ``module`` (a class of :data:`HEAD_STRUCTURED`) views per head."""
    children = HEAD_STRUCTURED.get((type(module).__module__, type(module).__name__), ())
    return [
        layer
        for child in children
        for layer in getattr(module, child).modules()
        if isinstance(layer, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    ]


def head_structured_reason(module: nn.Module) -> str:
    """Why the layers of :func:`head_structured_layers` are not units."""
    return f"its outputs are viewed per attention head by {type(module).__name__}, which stores the width of a head"


def projections(module: nn.Module) -> list[nn.Module]:
    """The layers a head removal changes: the ``qkv`` and ``proj`` Linear layers, or the MultiheadAttention."""
    if isinstance(module, nn.MultiheadAttention):
        return [module]
    return [_linear(module, "qkv"), _linear(module, "proj")]


def _linear(module: nn.Module, name: str) -> nn.Linear:
    """The Linear layer ``name`` of a timm-style attention module (checked by :func:`head_layout`)."""
    layer = getattr(module, name)
    assert isinstance(layer, nn.Linear)
    return layer


def _set_heads(module: nn.Module, heads: int, head_dim: int) -> None:
    """Set ``num_heads`` (and ``attn_dim`` where the module keeps it) of a timm-style attention module."""
    setattr(module, "num_heads", heads)  # noqa: B010  # a plain attribute of a module class torch does not know
    if isinstance(getattr(module, "attn_dim", None), int):
        setattr(module, "attn_dim", heads * head_dim)  # noqa: B010


def prune_heads(module: nn.Module, channels: Sequence[int]) -> None:
    """Marks the group item of a MultiheadAttention's heads (its indices are the heads' channels of a q/k/v block);
    never called: :func:`remove_heads` removes heads. Torch-Pruning counts it neither as output nor input pruning."""
    raise AssertionError("heads are removed with remove_heads, not through their group item")


def is_heads_item(item: Any) -> bool:
    """True for the group item :func:`heads_group` makes for a MultiheadAttention's heads."""
    return bool(item.dep.handler is prune_heads)


def heads_group(graph: tp.DependencyGraph, module: nn.Module, heads: Sequence[int]) -> tp.dependency.Group:
    """The removal group of ``heads``, shaped like a Torch-Pruning group so masking and cost counting read it alike.

    For timm-style modules its items are the q/k/v rows of ``qkv`` (output side), the input columns of ``proj`` and
    per-head tables the graph knows (Swin's relative position bias); for ``nn.MultiheadAttention`` one item on the
    module (handler :func:`prune_heads`) whose indices are the heads' channels within a q/k/v block.
    """
    layout = head_layout(module)
    assert layout is not None, "heads_group needs an attention module"
    group = tp.dependency.Group()
    group._DG = graph
    channels = layout.channels(heads)
    if isinstance(module, nn.MultiheadAttention):
        node = graph.module2node[module]
        group.add_dep(tp.dependency.Dependency(None, prune_heads, node, node), channels)
        return group
    qkv, proj = (graph.module2node[layer] for layer in projections(module))
    group.add_dep(tp.dependency.Dependency(None, tp.prune_linear_out_channels, qkv, qkv), layout.qkv_rows(heads))
    group.add_dep(tp.dependency.Dependency(None, tp.prune_linear_in_channels, proj, proj), channels)
    for _, table in _per_head_tables(module, layout):
        node = graph.module2node.get(table)
        if node is not None and node.pruning_dim % table.dim() == table.dim() - 1:
            group.add_dep(tp.dependency.Dependency(None, tp.prune_parameter_out_channels, node, node), sorted(heads))
    return group


def mha_slices(module: nn.MultiheadAttention, channels: Sequence[int]) -> list[tuple[torch.Tensor, object]]:
    """``(tensor, index)`` slices that mask the heads owning ``channels`` (one q/k/v block's channel indices)."""
    index = torch.tensor(list(channels), dtype=torch.long)
    rows = torch.cat([index + part * module.embed_dim for part in range(3)])
    assert module.in_proj_weight is not None  # layout_problem refuses the other form
    slices: list[tuple[torch.Tensor, object]] = [(module.in_proj_weight.data, rows)]
    if module.in_proj_bias is not None:
        slices.append((module.in_proj_bias.data, rows))
    slices.append((module.out_proj.weight.data, (slice(None), index)))
    return slices


def mha_shapes(module: nn.MultiheadAttention, removed: int) -> list[tuple[torch.Tensor, list[int]]]:
    """``(parameter, shape after)`` for a MultiheadAttention losing ``removed`` channels of each q/k/v block."""
    assert module.in_proj_weight is not None
    shapes: list[tuple[torch.Tensor, list[int]]] = [
        (module.in_proj_weight, [3 * (module.embed_dim - removed), module.embed_dim])
    ]
    if module.in_proj_bias is not None:
        shapes.append((module.in_proj_bias, [3 * (module.embed_dim - removed)]))
    shapes.append((module.out_proj.weight, [module.embed_dim, module.embed_dim - removed]))
    return shapes


def head_weights(module: nn.Module) -> torch.Tensor:
    """One row per head: its q, k and v weight rows and its output-projection columns, flattened (for ranking)."""
    layout = head_layout(module)
    assert layout is not None
    if isinstance(module, nn.MultiheadAttention):
        assert module.in_proj_weight is not None
        stacked, out = module.in_proj_weight.detach(), module.out_proj.weight.detach()
    else:
        stacked, out = _linear(module, "qkv").weight.detach(), _linear(module, "proj").weight.detach()
    rows = stacked.reshape(3, layout.heads, layout.head_dim, -1).transpose(0, 1).reshape(layout.heads, -1)
    columns = out.reshape(out.shape[0], layout.heads, layout.head_dim).transpose(0, 1).reshape(layout.heads, -1)
    return torch.cat([rows, columns], dim=1)


def remove_heads(model: nn.Module, name: str, heads: Sequence[int]) -> None:
    """Remove ``heads`` of the attention module ``name`` from ``model``, in place (on a copy of the user's model).

    A timm-style module keeps its class with smaller layers and ``num_heads``; a MultiheadAttention is replaced by
    a :class:`PrunedMultiheadAttention` computing the same function with fewer heads.

    Raises:
        ValueError: When no head would remain, or the module has a per-head part this function cannot shrink.
    """
    module = model.get_submodule(name)
    layout = head_layout(module)
    assert layout is not None, f"{name} is not an attention module"
    gone = sorted(set(int(h) for h in heads))
    if len(gone) >= layout.heads:
        raise ValueError(f"removing {len(gone)} of the {layout.heads} heads of {name} leaves none")
    if isinstance(module, nn.MultiheadAttention):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, PrunedMultiheadAttention.from_module(module, gone))
        return
    channels = layout.channels(gone)
    _keep_rows(_linear(module, "qkv"), layout.qkv_rows(gone))
    _keep_columns(_linear(module, "proj"), channels)
    gate = getattr(module, "gate", None)
    if isinstance(gate, nn.Linear) and gate.out_features == layout.width:
        _keep_rows(gate, channels)
    norm = getattr(module, "norm", None)
    if isinstance(norm, nn.LayerNorm) and tuple(norm.normalized_shape) == (layout.width,):
        _keep_norm(norm, channels)
    kept = _kept(layout.heads, gone)
    for attr, table in _per_head_tables(module, layout):
        setattr(module, attr, nn.Parameter(table.data[..., kept].clone(), requires_grad=table.requires_grad))
    _set_heads(module, layout.heads - len(gone), layout.head_dim)


def with_heads(module: nn.Module, heads: int) -> nn.Module:
    """A timm-style attention module set to ``heads`` heads without touching its weights (uninitialised per-head
    tables of the new size; its Linear layers are resized by the caller): the skeleton a state_dict loads into."""
    layout = head_layout(module)
    assert layout is not None and not isinstance(module, nn.MultiheadAttention)
    for attr, table in _per_head_tables(module, layout):
        shape = (*table.shape[:-1], heads)
        setattr(module, attr, nn.Parameter(table.data.new_empty(shape), requires_grad=table.requires_grad))
    _set_heads(module, heads, layout.head_dim)
    return module


def _per_head_tables(module: nn.Module, layout: HeadLayout) -> list[tuple[str, nn.Parameter]]:
    """The module's per-head tables (one entry per head on the last dimension), by attribute name."""
    tables = [(attr, getattr(module, attr, None)) for attr in _PER_HEAD_TABLES]
    return [(attr, t) for attr, t in tables if isinstance(t, nn.Parameter) and t.shape[-1] == layout.heads]


def _kept(size: int, removed: Sequence[int]) -> list[int]:
    gone = set(removed)
    return [i for i in range(size) if i not in gone]


def _keep_rows(linear: nn.Linear, removed: Sequence[int]) -> None:
    kept = _kept(linear.out_features, removed)
    linear.weight = nn.Parameter(linear.weight.data[kept].clone(), requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[kept].clone(), requires_grad=linear.bias.requires_grad)
    linear.out_features = len(kept)


def _keep_columns(linear: nn.Linear, removed: Sequence[int]) -> None:
    kept = _kept(linear.in_features, removed)
    linear.weight = nn.Parameter(linear.weight.data[:, kept].clone(), requires_grad=linear.weight.requires_grad)
    linear.in_features = len(kept)


def _keep_norm(norm: nn.LayerNorm, removed: Sequence[int]) -> None:
    kept = _kept(norm.normalized_shape[0], removed)
    for attr in ("weight", "bias"):
        tensor = getattr(norm, attr)
        if tensor is not None:
            setattr(norm, attr, nn.Parameter(tensor.data[kept].clone(), requires_grad=tensor.requires_grad))
    norm.normalized_shape = (len(kept),)


class PrunedMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with some heads removed: q, k and v are ``num_heads * head_dim`` wide while the
    input and output stay ``embed_dim`` wide, which the torch module cannot express. Same call signature and
    results (dropout, masks, batch_first, returned weights averaged over the remaining heads)."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *, bias: bool, batch_first: bool,
                 dropout: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.batch_first, self.dropout = batch_first, dropout
        width = num_heads * head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width)) if bias else None
        self.out_proj = nn.Linear(width, embed_dim, bias=bias)  # MultiheadAttention's bias covers both projections

    def sizes(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this module (without its weights)."""
        bias = self.in_proj_bias is not None
        return {"embed_dim": self.embed_dim, "num_heads": self.num_heads, "head_dim": self.head_dim, "bias": bias,
                "batch_first": self.batch_first, "dropout": self.dropout}  # fmt: skip

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention, removed: Sequence[int]) -> PrunedMultiheadAttention:
        """The module without the heads ``removed`` (their weights dropped, every other weight copied)."""
        layout = HeadLayout(module.num_heads, module.head_dim)
        assert module.in_proj_weight is not None
        rows = _kept(3 * layout.width, layout.qkv_rows(removed))
        columns = _kept(layout.width, layout.channels(removed))
        bias = module.in_proj_bias is not None
        heads = layout.heads - len(removed)
        pruned = cls(module.embed_dim, heads, layout.head_dim, bias=bias, batch_first=module.batch_first,
                     dropout=module.dropout)  # fmt: skip
        with torch.no_grad():
            pruned.in_proj_weight.copy_(module.in_proj_weight[rows])
            if pruned.in_proj_bias is not None and module.in_proj_bias is not None:
                pruned.in_proj_bias.copy_(module.in_proj_bias[rows])
            pruned.out_proj.weight.copy_(module.out_proj.weight[:, columns])
            if pruned.out_proj.bias is not None and module.out_proj.bias is not None:
                pruned.out_proj.bias.copy_(module.out_proj.bias)
        return pruned.to(module.in_proj_weight.device, module.in_proj_weight.dtype).train(module.training)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` over ``key``/``value``, as :meth:`nn.MultiheadAttention.forward`."""
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        weights = self.in_proj_weight.chunk(3)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        q, k, v = (self._split(F.linear(x, w, b)) for x, w, b in zip((query, key, value), weights, biases, strict=True))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores + self._additive_mask(attn_mask, key_padding_mask, is_causal, scores)
        attention = scores.softmax(dim=-1)
        dropped = F.dropout(attention, self.dropout) if self.training and self.dropout > 0 else attention
        out = (dropped @ v).transpose(1, 2).flatten(2)  # batch, target, heads * head_dim
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        returned = None
        if need_weights:
            returned = attention.mean(dim=1) if average_attn_weights else attention
            returned = returned.squeeze(0) if unbatched else returned
        return (out.squeeze(0 if self.batch_first else 1) if unbatched else out), returned

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``batch, length, heads * head_dim`` -> ``batch, heads, length, head_dim``."""
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim).transpose(1, 2)

    def _additive_mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        is_causal: bool,
        scores: torch.Tensor,
    ) -> torch.Tensor:
        """The masks as one tensor added to the scores (boolean True = not allowed, float = added)."""
        target, source = scores.shape[-2:]
        total = torch.zeros((), dtype=scores.dtype, device=scores.device)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(target, source, dtype=torch.bool, device=scores.device).triu(1)
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                raise ValueError("a per-head attn_mask cannot be applied after heads were removed")
            total = total + _as_additive(attn_mask, scores.dtype)
        if key_padding_mask is not None:
            total = total + _as_additive(key_padding_mask, scores.dtype)[:, None, None, :]
        return total


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)

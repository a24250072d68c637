"""Compute cost (MACs) and parameter count of a model, and of each pruned variant without building it.

Two counting conventions, named by ``mode`` and spelled out in :data:`CONVENTIONS` so every output can state
which one it used:

- ``"macs"`` (default): multiply-accumulates of ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and
  ``nn.Linear`` modules and of the q/k/v and output projections of ``nn.MultiheadAttention`` only (grouped and
  depthwise convs included). A conv costs ``output_elements * (in_channels / groups) * prod(kernel_size)``, a
  linear layer ``output_elements * in_features``, a MultiheadAttention ``query_tokens * (in_proj_weight elements
  + out_proj weight elements)``; biases and every other op (the attention matrix products too) cost nothing.
  This is the number papers quote as "FLOPs" for ResNet-50 (4.09 G); ``torch.utils.flop_counter`` reports
  exactly twice this value.
- ``"full"``: every op the forward pass runs, counted per sample at the ATen level (so functional ops such as
  the residual ``+`` or the ``x * scale`` of squeeze-and-excitation are seen). Conv and matrix-multiply ops
  cost their MACs as above plus 1 per output element for a bias; batch norm (inference) 2 per element (a
  folded scale and shift); layer/group/instance norm 5 per element (mean, variance, normalisation) plus 1 per
  element each for an affine weight and bias; activations and element-wise math (add, sub, mul, div, relu,
  sigmoid, hardswish, ...) 1 per output element; softmax 3 per element; max/avg pooling ``prod(kernel)`` per
  output element; adaptive pooling and mean/sum reductions 1 per input element; shape and copy ops (view,
  flatten, cat, dropout in eval, ...) 0. Ops without a rule are decomposed into ATen ops that have one when
  possible; otherwise they cost 0 and are listed in :attr:`Cost.uncounted`.

Counts are per sample: only the first sample of the example input is run. Parameters are counted once even
when shared. :class:`CostModel` gives the ``"macs"`` cost of a pruned variant from one dense pass: channel
pruning does not change the spatial size of any layer's output, so a layer's MACs are its number of output
positions (recorded once) times the number of weight elements it keeps.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.structure.custom_layers import channel_pruner
from analysis.structure.groups import eval_mode, is_out_channel_item, per_channel_extras, removal_group
from analysis.structure.heads import PrunedMultiheadAttention, mha_shapes

CONVENTIONS: dict[str, str] = {
    "macs": (
        "multiply-accumulates of Conv1d/2d/3d, ConvTranspose and Linear layers and MultiheadAttention projections "
        "only, per sample (conv: output elements x in_channels/groups x kernel elements; bias and other ops, "
        "attention products included, not counted)"
    ),
    "full": (
        "all ops per sample: conv/matmul MACs + 1 per output element for bias; batch norm 2 per element; "
        "layer/group/instance norm 5 per element + 1 each for affine weight and bias; activations and "
        "element-wise add/sub/mul/div 1 per output element; softmax 3 per element; pooling kernel elements per "
        "output element; adaptive pooling and mean/sum 1 per input element; shape/copy ops 0"
    ),
}

LAYER_TYPES = (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention, PrunedMultiheadAttention)
_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


@dataclass(frozen=True)
class Cost:
    """The cost of running a model on one sample, and its size.

    Attributes:
        macs: Multiply-accumulates (``mode="macs"``) or all ops (``mode="full"``), see :data:`CONVENTIONS`.
        params: Number of parameter elements, shared parameters counted once.
        mode: The counting convention, a key of :data:`CONVENTIONS`.
        per_module: Cost by module name: each conv/linear layer (``"macs"``), or the innermost module running
            each op (``"full"``; ``""`` is the model itself).
        uncounted: ATen ops that ran but have no counting rule (``"full"`` only); empty when the count is complete.
    """

    macs: int
    params: int
    mode: str = "macs"
    per_module: dict[str, int] = field(default_factory=dict, hash=False)
    uncounted: tuple[str, ...] = ()

    @property
    def convention(self) -> str:
        """One sentence saying what :attr:`macs` counts."""
        return CONVENTIONS[self.mode]

    def as_dict(self) -> dict[str, str | int]:
        """A JSON-friendly summary: convention, mode, macs and params."""
        return {"convention": self.convention, "mode": self.mode, "macs": self.macs, "params": self.params}


def count_params(model: nn.Module) -> int:
    """Number of parameter elements of ``model``, each shared parameter counted once."""
    return sum(p.numel() for p in model.parameters())


def count_cost(model: nn.Module, example_input: torch.Tensor, mode: str = "macs") -> Cost:
    """Count the MACs (or all ops) and the parameters of ``model`` for one sample of ``example_input``.

    The model runs once in eval mode under ``torch.inference_mode()``; every module's training flag is restored.

    Args:
        model: The network.
        example_input: A batch whose first sample fixes the input size.
        mode: ``"macs"`` (conv and linear layers only) or ``"full"`` (every op); see :data:`CONVENTIONS`.

    Raises:
        ValueError: For an unknown ``mode``.
    """
    if mode not in CONVENTIONS:
        raise ValueError(f"unknown cost mode '{mode}'; use one of {sorted(CONVENTIONS)}")
    if mode == "macs":
        return _macs_cost(model, layer_positions(model, example_input))
    counter = _OpCounter()
    with _module_scopes(model, counter.scope), eval_mode(model), torch.inference_mode(), counter:
        model(_first_sample(model, example_input))
    per_module = dict(counter.per_module)
    return Cost(sum(per_module.values()), count_params(model), mode, per_module, tuple(sorted(counter.uncounted)))


def layer_positions(model: nn.Module, example_input: torch.Tensor) -> dict[str, int]:
    """For each conv/linear layer (and MultiheadAttention) the forward pass runs: how many positions its weight is
    applied at.

    A layer's MACs are these positions times its weight's element count: output elements per output channel
    for a conv, input elements per input channel for a transposed conv (its weight is ``in x out/groups x k``),
    rows for a linear layer, query tokens for a MultiheadAttention (whose weight, see :func:`_layer_weights`, is its
    in and out projections). Layers called more than once add up; layers never called are absent.
    """
    names = {module: name for name, module in model.named_modules()}
    positions: dict[str, int] = defaultdict(int)

    def record(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if isinstance(module, (nn.MultiheadAttention, PrunedMultiheadAttention)):
            count = output[0].numel() // module.embed_dim
        elif isinstance(module, nn.Linear):
            count = output.numel() // module.out_features
        elif module.transposed:
            count = inputs[0].numel() // module.in_channels
        else:
            count = output.numel() // module.out_channels
        positions[names[module]] += count

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, LAYER_TYPES)]
    try:
        with eval_mode(model), torch.inference_mode():
            model(_first_sample(model, example_input))
    finally:
        for hook in hooks:
            hook.remove()
    return dict(positions)


def _macs_cost(model: nn.Module, positions: dict[str, int]) -> Cost:
    """The ``"macs"`` cost from each layer's positions and its current weight size."""
    per_module = {
        name: count * sum(w.numel() for w in _layer_weights(model, name)) for name, count in positions.items()
    }
    return Cost(sum(per_module.values()), count_params(model), "macs", per_module)


def _layer_weights(model: nn.Module, name: str) -> list[torch.Tensor]:
    """The weights of the layer ``name`` (a layer :func:`layer_positions` found) applied once per position: the
    weight of a conv/linear layer, the in and out projections of a MultiheadAttention."""
    module = model.get_submodule(name)
    if isinstance(module, PrunedMultiheadAttention):  # its out_proj runs as a Linear layer and is counted as one
        return [module.in_proj_weight]
    if isinstance(module, nn.MultiheadAttention):
        weights = [module.in_proj_weight, module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
        return [w for w in weights if w is not None] + [module.out_proj.weight]
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return [weight]


def _first_sample(model: nn.Module, example_input: torch.Tensor) -> torch.Tensor:
    """The first sample of ``example_input`` on the model's device."""
    param = next(model.parameters(), None)
    sample = example_input[:1]
    return sample.to(param.device) if param is not None else sample


Member = nn.Module | nn.Parameter
"""What a Torch-Pruning group item acts on: a layer (or one of its op nodes), or a bare parameter."""
Removed = dict[tuple[Member, bool], frozenset[int]]
"""Channels a removal takes from each layer: ``(module, output side?) -> channel indices``."""


class CostModel:
    """MACs and params of pruned variants of one model (``"macs"`` convention), without copying the model.

    One dense forward pass records each conv/linear layer's output positions; a variant's cost then follows from
    the weight shapes its removal group leaves. ``CostModel(m, x).variant(graph, conv, channels)`` equals
    ``count_cost(pruned_copy(m, conv_name, channels, x), x)``.

    Attributes:
        dense: The unpruned model's cost.
    """

    def __init__(self, model: nn.Module, example_input: torch.Tensor) -> None:
        self.model = model
        self._owned = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}
        self._positions = layer_positions(model, example_input)
        self.dense = _macs_cost(model, self._positions)
        self._weights = {name: _layer_weights(model, name) for name in self.dense.per_module}
        self._weight_names = {id(w): name for name, weights in self._weights.items() for w in weights}

    def variant(self, graph: tp.DependencyGraph, root: nn.Module | str, channels: Sequence[int]) -> Cost:
        """The cost after removing ``channels`` of ``root``'s outputs (or heads) and everything coupled to them.

        Args:
            graph: The Torch-Pruning dependency graph of this model
            (``analysis.structure.groups.build_dependency_graph``).
            root: The unit's root (conv, linear or attention module), as module or module name.
            channels: Output channel (or head) indices to remove.
        """
        if isinstance(root, str):
            root = self.model.get_submodule(root)
        return self.group_cost(graph, removal_group(graph, root, channels))

    def group_cost(self, graph: tp.DependencyGraph, group: Iterable[Any]) -> Cost:
        """The cost after applying a Torch-Pruning removal ``group`` built on ``graph`` of this model.

        Raises:
            NotImplementedError: When the group changes parameters of a layer type this module cannot size.
            ValueError: When the group belongs to another model, or a grouped conv would lose input channels
                unevenly across its conv groups.
        """
        return self.removed_cost(graph, self.removed_channels(graph, group))

    def removed_channels(self, graph: tp.DependencyGraph, group: Iterable[Any]) -> Removed:
        """What a removal ``group`` takes from each layer: ``(module, output side?) -> channel indices``."""
        removed: dict[tuple[Member, bool], set[int]] = defaultdict(set)
        for item in group:
            module = item.dep.target.module
            if id(module) not in self._owned and _has_parameters(module):
                raise ValueError("the removal group was built on a different model than this CostModel's")
            removed[(module, is_out_channel_item(graph, item))].update(int(i) for i in item.idxs)
        return {key: frozenset(channels) for key, channels in removed.items()}

    def shape_delta(self, graph: tp.DependencyGraph, removed: Removed) -> ShapeDelta:
        """The per-dimension shape change of every parameter ``removed`` touches (see :class:`ShapeDelta`)."""
        empty: frozenset[int] = frozenset()
        delta: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        for module in dict.fromkeys(module for module, _ in removed):
            out_idxs, in_idxs = removed.get((module, True), empty), removed.get((module, False), empty)
            for tensor, shape in _pruned_shapes(graph, module, set(out_idxs), set(in_idxs)):
                delta[id(tensor)] = (tensor, tuple(a - b for a, b in zip(tensor.shape, shape, strict=True)))
        return ShapeDelta(delta)

    def delta_cost(self, deltas: Iterable[ShapeDelta]) -> Cost:
        """The exact cost with several disjoint removals applied together (their :class:`ShapeDelta` summed)."""
        total: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for delta in deltas:
            for key, (tensor, removed) in delta.removed.items():
                if key in total:
                    total[key] = (tensor, [a + b for a, b in zip(total[key][1], removed, strict=True)])
                else:
                    total[key] = (tensor, list(removed))
        shapes: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for key, (tensor, removed_per_dim) in total.items():
            shapes[key] = (tensor, [size - gone for size, gone in zip(tensor.shape, removed_per_dim, strict=True)])
        return self._shaped_cost(shapes)

    def removed_cost(self, graph: tp.DependencyGraph, removed: Removed) -> Cost:
        """The cost after removing ``removed`` (see :meth:`removed_channels`)."""
        shapes: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(parameter) -> (parameter, shape after)
        empty: frozenset[int] = frozenset()
        for module in dict.fromkeys(module for module, _ in removed):
            out_idxs, in_idxs = removed.get((module, True), empty), removed.get((module, False), empty)
            for tensor, shape in _pruned_shapes(graph, module, set(out_idxs), set(in_idxs)):
                shapes[id(tensor)] = (tensor, shape)
        return self._shaped_cost(shapes)

    def _shaped_cost(self, shapes: dict[int, tuple[torch.Tensor, list[int]]]) -> Cost:
        """The cost with the parameters in ``shapes`` (``id -> (parameter, shape after)``) at their new shapes."""
        params = self.dense.params - sum(t.numel() - math.prod(shape) for t, shape in shapes.values())
        per_module = dict(self.dense.per_module)
        for name in {self._weight_names[key] for key in shapes if key in self._weight_names}:
            elements = 0
            for weight in self._weights[name]:
                elements += math.prod(shapes[id(weight)][1]) if id(weight) in shapes else weight.numel()
            per_module[name] = self._positions[name] * elements
        return Cost(sum(per_module.values()), params, "macs", per_module)


@dataclass(frozen=True)
class ShapeDelta:
    """What one removal takes from each parameter, per dimension (``id(parameter) -> (parameter, removed per dim)``).

    Removals of different groups take disjoint channels, so pruned together their deltas add up dimension by
    dimension: :meth:`CostModel.delta_cost` then gives the exact joint cost without rebuilding any group.
    """

    removed: dict[int, tuple[torch.Tensor, tuple[int, ...]]]


def _pruned_shapes(
    graph: tp.DependencyGraph, module: Member, out_idxs: set[int], in_idxs: set[int]
) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Yield ``(parameter, shape after removal)`` for each parameter of a group member that loses elements."""

    def shrink(tensor: torch.Tensor | None, dim: int, count: int) -> Iterator[tuple[torch.Tensor, list[int]]]:
        if tensor is not None and count:
            shape = list(tensor.shape)
            shape[dim] -= count
            yield tensor, shape

    both = len(out_idxs | in_idxs)  # layers whose input and output channels are the same channels
    pruner = channel_pruner(graph, module)
    if isinstance(module, nn.MultiheadAttention) and not out_idxs:  # heads: the heads' channels of a q/k/v block
        yield from mha_shapes(module, len(in_idxs)) if in_idxs else ()
    elif pruner is not None and isinstance(module, nn.Module):  # a customised layer (a per-channel scale, a stream)
        yield from pruner.pruned_shapes(module, both)
    elif isinstance(module, nn.Parameter):
        yield from shrink(module, graph.module2node[module].pruning_dim, both)
    elif isinstance(module, nn.modules.conv._ConvNd):
        if module.groups == module.out_channels > 1:  # depthwise: one filter per channel, in and out coupled
            yield from shrink(module.weight, 0, both)
            yield from shrink(module.bias, 0, both)
            return
        if module.transposed and module.groups > 1:
            raise NotImplementedError(f"cannot size a grouped transposed conv after channel removal: {module}")
        weight = list(module.weight.shape)
        out_dim, in_dim = (1, 0) if module.transposed else (0, 1)
        weight[out_dim] -= len(out_idxs)
        weight[in_dim] -= _per_group_removal(module, in_idxs)
        if out_idxs or in_idxs:
            yield module.weight, weight
        yield from shrink(module.bias, 0, len(out_idxs))
        for _, extra in per_channel_extras(module):
            yield from shrink(extra, 0, len(out_idxs))
    elif isinstance(module, nn.Linear):
        if out_idxs or in_idxs:
            yield module.weight, [module.out_features - len(out_idxs), module.in_features - len(in_idxs)]
        yield from shrink(module.bias, 0, len(out_idxs))
    elif isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm)):
        yield from shrink(module.weight, 0, both)
        yield from shrink(module.bias, 0, both)
    elif isinstance(module, nn.LayerNorm):
        dim = graph.module2node[module].pruning_dim
        yield from shrink(module.weight, dim, both)
        yield from shrink(module.bias, dim, both)
    elif isinstance(module, nn.PReLU):
        if module.num_parameters > 1:  # a single shared slope stays
            yield from shrink(module.weight, 0, both)
    elif _has_parameters(module):
        raise NotImplementedError(f"cannot size a {type(module).__name__} after channel removal")


def _has_parameters(module: Member) -> bool:
    """True for a bare parameter or a module that owns parameters (Torch-Pruning's op nodes own none)."""
    return isinstance(module, nn.Parameter) or next(module.parameters(recurse=False), None) is not None


def _per_group_removal(conv: nn.modules.conv._ConvNd, in_idxs: set[int]) -> int:
    """How many weight columns each conv group of ``conv`` loses when ``in_idxs`` of its inputs are removed."""
    if conv.groups == 1:
        return len(in_idxs)
    per_group = conv.in_channels // conv.groups
    counts = [0] * conv.groups
    for channel in in_idxs:
        counts[channel // per_group] += 1
    if len(set(counts)) != 1:
        raise ValueError(f"uneven input-channel removal across the {conv.groups} conv groups of {conv}: {counts}")
    return counts[0]


@dataclass(frozen=True)
class CostSummary:
    """A variant's MACs and params, with the fraction of the dense model's values its pruning removes."""

    macs: int
    params: int
    macs_reduction: float
    params_reduction: float


def summarise(dense: Cost, variant: Cost) -> CostSummary:
    """The :class:`CostSummary` of ``variant`` against ``dense``."""
    return CostSummary(
        variant.macs, variant.params, _reduction(dense.macs, variant.macs), _reduction(dense.params, variant.params)
    )


def cost_summary(dense: Cost, variant: Cost) -> dict[str, int | float]:
    """:func:`summarise` as a JSON-friendly mapping."""
    return dataclasses.asdict(summarise(dense, variant))


def _reduction(dense: int, variant: int) -> float:
    return (dense - variant) / dense if dense else 0.0


def format_count(n: float) -> str:
    """Format a count with 4 significant digits and a unit: ``1.814 G``, ``11.69 M``, ``512``."""
    sign, value = ("-" if n < 0 else ""), abs(float(n))
    for index, (scale, unit) in enumerate(_UNITS):
        if value >= scale:
            scaled = float(f"{value / scale:.4g}")
            if scaled >= 1000 and index > 0:  # 999.96 K rounds up to 1000 K: show 1.000 M
                scale, unit = _UNITS[index - 1]
                scaled = float(f"{value / scale:.4g}")
            decimals = max(0, 3 - math.floor(math.log10(scaled)))
            return f"{sign}{scaled:.{decimals}f} {unit}"
    return f"{sign}{round(value)}"


# ---- full mode: counting ATen ops -------------------------------------------------------------------------------

OpRule = Callable[[tuple[Any, ...], dict[str, Any], Any], int]

# fmt: off
_FREE_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "permute", "transpose", "t",
    "expand", "expand_as", "contiguous", "clone", "copy", "_to_copy", "to", "detach", "alias", "lift_fresh", "cat",
    "stack", "split", "split_with_sizes", "chunk", "unbind", "select", "slice", "narrow", "squeeze", "unsqueeze",
    "as_strided", "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "empty",
    "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_empty", "new_zeros",
    "new_ones", "fill", "zero", "constant_pad_nd", "pad", "channel_shuffle", "native_channel_shuffle",
    "pixel_shuffle", "pixel_unshuffle", "repeat", "index_select", "gather", "roll", "flip", "arange", "scalar_tensor",
    "_local_scalar_dense", "device"
})
_ELEMENTWISE_OPS = frozenset({
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "maximum", "minimum", "where",
    "relu", "relu6", "hardtanh", "leaky_relu", "prelu", "_prelu_kernel", "elu", "selu", "celu", "gelu", "silu",
    "mish", "sigmoid", "hardsigmoid", "hardswish", "tanh", "softplus", "threshold", "clamp", "clamp_min", "clamp_max",
    "exp", "log", "sqrt", "rsqrt", "reciprocal", "neg", "abs", "erf", "sign", "pow", "square"
})
_REDUCTION_OPS = frozenset({
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "mean", "sum",
    "amax", "amin"
})
# fmt: on
# Norms that compute statistics at run time: positions of their (weight, bias) arguments.
_STAT_NORMS = {
    "layer_norm": (2, 3),
    "native_layer_norm": (2, 3),
    "group_norm": (2, 3),
    "native_group_norm": (1, 2),
    "instance_norm": (1, 2),
}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _out_numel(out: Any) -> int:
    tensors = _tensors(out)
    return tensors[0].numel() if tensors else 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _conv_ops(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> int:
    """aten.convolution / aten._convolution: MACs plus the bias adds."""
    x: torch.Tensor = args[0]
    weight: torch.Tensor = args[1]
    bias = _arg(args, kwargs, 2, "bias")
    transposed = bool(_arg(args, kwargs, 6, "transposed"))
    positions = x.numel() // x.shape[1] if transposed else out.numel() // out.shape[1]
    return positions * weight.numel() + (out.numel() if bias is not None else 0)


def _mm_ops(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> int:
    """mm/bmm/mv/dot: one MAC per output element per reduced element."""
    left: torch.Tensor = args[0]
    return out.numel() * left.shape[-1]


def _addmm_ops(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> int:
    """addmm/baddbmm/addmv: the product's MACs plus one add per output element."""
    left: torch.Tensor = args[1]
    return out.numel() * left.shape[-1] + out.numel()


def _pool_ops(spatial_dims: int) -> OpRule:
    def rule(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        kernel = _arg(args, kwargs, 1, "kernel_size")
        sizes = [kernel] * spatial_dims if isinstance(kernel, int) else list(kernel)
        if len(sizes) == 1:
            sizes *= spatial_dims
        return _out_numel(out) * math.prod(sizes)

    return rule


def _stat_norm_ops(weight_index: int, bias_index: int) -> OpRule:
    def rule(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        affine = (_arg(args, kwargs, weight_index, "weight") is not None) + (
            _arg(args, kwargs, bias_index, "bias") is not None
        )
        data: torch.Tensor = args[0]
        return data.numel() * (5 + affine)

    return rule


def _rule(name: str) -> OpRule | None:
    """The counting rule of an ATen op (packet name without a trailing in-place ``_``), or None."""
    if name in ("convolution", "_convolution"):
        return _conv_ops
    if name in ("mm", "bmm", "mv", "dot"):
        return _mm_ops
    if name in ("addmm", "baddbmm", "addmv"):
        return _addmm_ops
    if "batch_norm" in name:
        return lambda args, kwargs, out: 2 * args[0].numel()
    if name in _STAT_NORMS:
        return _stat_norm_ops(*_STAT_NORMS[name])
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        return lambda args, kwargs, out: 3 * _out_numel(out)
    if name in _ELEMENTWISE_OPS:
        return lambda args, kwargs, out: _out_numel(out)
    if name in _REDUCTION_OPS:
        return lambda args, kwargs, out: args[0].numel()
    for prefix in ("max_pool", "avg_pool"):
        if name.startswith(prefix) and name[len(prefix) : len(prefix) + 1] in ("1", "2", "3"):
            return _pool_ops(int(name[len(prefix)]))
    if name in _FREE_OPS:
        return lambda args, kwargs, out: 0
    return None


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ unannotated
    """Counts each ATen op by the ``"full"`` convention, attributed to the innermost running module."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves __init__ unannotated
        self.scope: list[str] = []
        self.per_module: dict[str, int] = defaultdict(int)
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # in-place variant: relu_, add_
        rule = _rule(name)
        if rule is None:
            with self:  # ops of a decomposition come back through this mode
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            self.uncounted.add(str(func.overloadpacket))
        out = func(*args, **kwargs)
        if rule is not None:
            self.per_module[self.scope[-1] if self.scope else ""] += int(rule(args, kwargs, out))
        return out


@contextmanager
def _module_scopes(model: nn.Module, scope: list[str]) -> Iterator[None]:
    """Keep ``scope`` equal to the names of the modules currently running, innermost last."""
    names = {module: name for name, module in model.named_modules()}

    def enter(module: nn.Module, *_: Any) -> None:
        scope.append(names[module])

    def leave(module: nn.Module, *_: Any) -> None:
        scope.pop()

    hooks = []
    for module in names:
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()

"""Where each channel of each layer goes: channel coupling read off one forward pass, independent of Torch-Pruning.

Torch-Pruning derives which channels are coupled from index mappings it guesses for every split, cat, slice and
reshape (benchmarks/tp_failure_families.md, R1-R8), and several guesses are wrong in 1.6.1. This module runs the
model once under a :class:`~torch.overrides.TorchFunctionMode` and carries, next to every tensor, a tensor of the
same shape holding a *label* per element: the id of the layer output channel it came from (-1 for none). Every
operator that only moves elements (view, reshape, permute, transpose, flatten, split, chunk, cat, slicing, ...) is
applied to the labels as it is to the data, so the labels follow any chain of them exactly, channel shuffles and
patch merges included. An element-wise operator on two labelled tensors couples the labels that meet at each
position (a residual add: both producers must lose the channel together). A layer (conv, Linear) reads the labels
of its input channels (its consumed channels) and gives its outputs new labels; a per-channel layer (BatchNorm,
LayerNorm, GroupNorm, depthwise conv) passes them through. Anything else that touches a labelled element (a reduction
over channels, a matmul contracting them, an operator this module does not know) *blocks* the labels it touched,
naming the operator: removing such a channel is not a pure removal, and the unit is left out for that reason.

The result is exact by construction for the operators it knows and says which operator it does not know; it never
guesses a width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

NO_LABEL = -1
"""The label of an element that carries no layer's channel (the input image, constants)."""
_CODE = 1 << 31
"""Labels stay below this, so a pair of them packs into one int64."""
PADDING = -2
"""The label of an element a constant pad added: it belongs to whichever channel it sits in."""

_CONVS = {"conv1d", "conv2d", "conv3d"}
_LAYERS = {*_CONVS, "linear", "multi_head_attention_forward"}
_NORM_WEIGHT_ARGUMENT = {"batch_norm": 3, "instance_norm": 3, "group_norm": 2, "layer_norm": 2}
"""Where the functional norms take their weight (``F.batch_norm(input, mean, var, weight, ...)``)."""
_LAYER_TYPES = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm, nn.MultiheadAttention,
)  # fmt: skip
"""Layers whose parameters the flow reads through the functional call of the layer (conv2d, batch_norm, ...)."""
_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm"}
_NORMS = {"batch_norm", "instance_norm", "group_norm", "layer_norm"}
_ELEMENTWISE_UNARY = {
    "relu", "relu_", "relu6", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "hardswish",
    "hardsigmoid", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "selu", "mish", "softplus",
    "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout2d", "dropout1d", "dropout3d",
    "contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "detach", "abs", "neg", "exp",
    "sqrt", "rsqrt", "square", "erf", "clamp", "clamp_", "clamp_min", "clamp_max", "__neg__", "pow", "__pow__",
    "log", "sign", "sin", "cos", "reciprocal", "gelu_", "requires_grad_", "cpu", "cuda", "masked_fill",
    "masked_fill_", "nan_to_num", "logit", "softsign", "tanhshrink", "hardshrink", "softshrink", "threshold", "celu",
    "rrelu", "exp_", "mul_scalar",
}  # fmt: skip
_ELEMENTWISE_BINARY = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "__add__", "__iadd__", "__radd__", "__sub__",
    "__rsub__", "__isub__", "__mul__", "__imul__", "__rmul__", "__truediv__", "__rtruediv__", "__itruediv__",
    "maximum", "minimum", "where", "addcmul", "lerp",
}  # fmt: skip
_MOVES = {
    "view", "reshape", "permute", "transpose", "transpose_", "t", "flatten", "unflatten", "squeeze", "squeeze_",
    "unsqueeze", "unsqueeze_", "expand", "expand_as", "repeat", "__getitem__", "narrow", "select", "split",
    "split_with_sizes", "chunk", "tensor_split", "unbind", "cat", "concat", "concatenate", "stack", "roll", "flip",
    "reshape_as", "view_as", "movedim", "moveaxis", "swapaxes", "swapdims", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "native_channel_shuffle", "index_select", "pad", "broadcast_to", "tile", "repeat_interleave",
}  # fmt: skip
_CUTS = {"split", "split_with_sizes", "chunk", "tensor_split", "narrow", "__getitem__", "unbind", "select",
         "index_select"}  # fmt: skip
_SPATIAL = {
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "interpolate", "upsample", "upsample_nearest2d", "upsample_bilinear2d", "max_pool2d_with_indices",
    "lp_pool2d", "fractional_max_pool2d",
}  # fmt: skip
_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod", "softmax",
               "log_softmax"}  # fmt: skip
_IGNORED = {
    "dim", "size", "numel", "__get__", "__len__", "__bool__", "__format__", "__repr__", "__hash__", "is_floating_point",
    "element_size", "stride", "is_contiguous", "data_ptr", "get_device", "__iter__", "__index__", "__int__",
    "__float__", "item", "tolist", "__setstate__", "_is_view", "is_complex", "ndimension", "nelement", "__eq__",
    "__ne__", "__lt__", "__gt__", "__le__", "__ge__", "any", "all", "isfinite", "isnan", "eq", "ne", "zeros_like",
    "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    "arange", "zeros", "ones", "empty", "full", "tensor", "as_tensor", "linspace", "meshgrid", "randn", "rand",
    "__contains__", "requires_grad", "grad_fn", "is_leaf", "storage_offset", "untyped_storage",
    "_version", "layout", "has_names", "names", "device", "dtype", "shape", "ndim", "data", "is_cuda", "T",
}  # fmt: skip


@dataclass
class _UnionFind:
    """Disjoint sets of labels: labels that meet in an element-wise operator end up in one set. Each label also keeps
    its owner: the layer whose output channel it is (>= 0), or ``NO_LABEL`` for a bare parameter's element."""

    parent: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)

    def new(self, count: int, owner: int = NO_LABEL) -> range:
        start = len(self.parent)
        self.parent.extend(range(start, start + count))
        self.owner.extend([owner] * count)
        return range(start, start + count)

    def find(self, label: int) -> int:
        root = label
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[label] != root:
            self.parent[label], label = root, self.parent[label]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass(frozen=True)
class LayerUse:
    """One call of a layer: the labels of the input channels it consumed and those it gave its outputs.

    Attributes:
        layer: The layer's module name.
        consumed: One label per input channel (per input feature of a Linear), ``NO_LABEL`` where none.
        produced: One label per output channel.
        passes: True for a per-channel layer (a norm, a depthwise conv): its outputs are its input channels.
    """

    layer: str
    consumed: tuple[int, ...]
    produced: tuple[int, ...]
    passes: bool = False


@dataclass(frozen=True)
class Side:
    """The indices one side of one layer loses, each with the coupled set it follows.

    Attributes:
        out: True for output channels (and for per-channel layers), False for input channels.
        labels: ``(index, coupled set)`` pairs, by index.
    """

    out: bool
    labels: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Cut:
    """An operator that cuts a tensor's channels into pieces (split, chunk, a channel slice): the model's own code
    cuts the narrower tensor of a pruned copy with the same arguments, which is right only for some removals.

    Attributes:
        where: The operator and the module it runs in, for reasons.
        module: That module's name ('' for the model itself).
        dim: The channel dimension of the cut tensor, or None when its channels lie along several dimensions.
        source: The labels of the cut tensor along ``dim``.
        pieces: The labels of each piece along its channel dimension.
        redo: The operator with its own arguments, applied to a tensor of labels.
        rank: The cut tensor's number of dimensions.
        op: The operator's name.
    """

    where: str
    module: str
    dim: int | None
    source: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    redo: Callable[[torch.Tensor], Any]
    rank: int
    op: str = ""


@dataclass
class Coupling:
    """What removing some channels of one layer takes (see :meth:`ChannelFlow.members`).

    Attributes:
        layers: ``(layer name, side)`` in forward order, one per layer side (several calls merged).
        parameters: Bare parameter name -> ``(flat element index, coupled set)`` pairs.
        blocked: The operators that make the removal not a pure removal (empty when it is one).
    """

    layers: list[tuple[str, Side]] = field(default_factory=list)
    parameters: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)


@dataclass
class ChannelFlow:
    """The coupling of every layer channel found in one forward pass (see the module docstring).

    Attributes:
        uses: Every layer call, in forward order.
        parameters: Bare parameters (not a layer's weight) that met labelled elements: name -> label per element.
        blocked: Label -> the operator that touched it without being a pure channel operator.
    """

    uses: list[LayerUse] = field(default_factory=list)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    blocked: dict[int, str] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)
    sets: _UnionFind = field(default_factory=_UnionFind)
    _by_set: _Index | None = None
    _couplings: dict[tuple[str, tuple[int, ...]], Coupling] = field(default_factory=dict)

    def group_of(self, label: int) -> int:
        """The representative of the coupled set ``label`` belongs to."""
        return self.sets.find(label)

    def has_output(self, layer: str) -> bool:
        """True when ``layer`` produced channels of its own in the traced forward pass."""
        return layer in self._index().producers

    def produced(self, layer: str) -> tuple[int, ...]:
        """The labels of ``layer``'s output channels (its first call)."""
        return self._index().produced[layer]

    def _sets(self, labels: Iterable[int]) -> set[int]:
        return {self.group_of(label) for label in labels if label >= 0}

    def _cuts_sets(self, cut: Cut) -> bool:
        """True when some piece of ``cut`` lacks coupled sets the cut tensor has (a cut between channels, not one
        between tokens that carry the same channels)."""
        entering = self._sets(cut.source)
        return any(self._sets(piece) != entering for piece in cut.pieces)

    def kept(self, labels: Sequence[int], removed: set[int]) -> list[int]:
        """``labels`` without those whose coupled set is in ``removed``."""
        return [label for label in labels if label < 0 or self.group_of(label) not in removed]

    def cuts_right(self, cut: Cut, removed: set[int]) -> bool:
        """True when ``cut``'s own operator, run on the tensor without the ``removed`` coupled sets, gives each piece
        exactly its own channels without them (what a pruned copy's forward pass will do)."""
        if cut.dim is None:
            return False
        kept = self.kept(cut.source, removed)
        shape = [1] * cut.rank
        shape[cut.dim] = len(kept)
        try:
            pieces = [_along(piece, cut.dim, cut.rank) for piece in _tensors(cut.redo(torch.tensor(kept).view(shape)))]
        except (RuntimeError, TypeError, ValueError, IndexError):
            return False
        return pieces == [tuple(self.kept(piece, removed)) for piece in cut.pieces]

    def members(self, layer: str, channels: Sequence[int]) -> Coupling:
        """Everything that removing ``channels`` of ``layer``'s outputs removes with them (kept: discovery, the
        reasons and every removal ask for the same units again)."""
        key = (layer, tuple(sorted(int(c) for c in channels)))
        if key not in self._couplings:
            self._couplings[key] = self._members(layer, key[1])
        return self._couplings[key]

    def _members(self, layer: str, channels: Sequence[int]) -> Coupling:
        index = self._index()
        produced = self.produced(layer)
        wanted = {self.group_of(produced[c]) for c in channels}
        found = sorted(entry for group in wanted for entry in index.layers.get(group, ()))
        sides: dict[tuple[str, bool], dict[int, int]] = {}
        for _, name, out, position, group in found:  # forward order: the order of the layer calls
            sides.setdefault((name, out), {}).setdefault(position, group)
        coupling = Coupling(
            [(name, Side(out, tuple(sorted(pairs.items())))) for (name, out), pairs in sides.items()],
            blocked=sorted({reason for group in wanted for reason in index.blocked.get(group, ())}),
            cuts=[cut for cut, sets in index.cuts if wanted & sets],
        )
        for group in wanted:
            for name, position in index.parameters.get(group, ()):
                coupling.parameters.setdefault(name, []).append((position, group))
        for pairs in coupling.parameters.values():
            pairs.sort()
        return coupling

    def _index(self) -> _Index:
        """Every layer side, parameter element, block and cut by coupled set (built once, after the trace)."""
        if self._by_set is not None:
            return self._by_set
        index = _Index()
        for use in self.uses:
            index.produced.setdefault(use.layer, use.produced)
            if not use.passes:
                index.producers.add(use.layer)
        for order, use in enumerate(self.uses):
            for out, labels in ((True, use.produced), (False, use.consumed)):
                if out or not use.passes:
                    for position, label in enumerate(labels):
                        if label >= 0:
                            group = self.group_of(label)
                            index.layers.setdefault(group, []).append((order, use.layer, out, position, group))
        for name, elements in self.parameters.items():
            for position, label in enumerate(elements.flatten().tolist()):
                index.parameters.setdefault(self.group_of(label), []).append((name, position))
        for label, reason in self.blocked.items():
            index.blocked.setdefault(self.group_of(label), set()).add(reason)
        index.cuts = [(cut, self._sets(cut.source)) for cut in self.cuts if self._cuts_sets(cut)]
        self._by_set = index
        return index


@dataclass
class _Index:
    """:class:`ChannelFlow`'s lookups: by coupled set, the layer sides ``(call order, layer, out, index, set)``,
    parameter elements ``(name, flat index)`` and blocking operators; by layer, its first output labels (and which
    layers produce channels of their own); and the cuts with the sets they cut."""

    layers: dict[int, list[tuple[int, str, bool, int, int]]] = field(default_factory=dict)
    produced: dict[str, tuple[int, ...]] = field(default_factory=dict)
    producers: set[str] = field(default_factory=set)
    parameters: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    blocked: dict[int, set[str]] = field(default_factory=dict)
    cuts: list[tuple[Cut, set[int]]] = field(default_factory=list)


class UntraceableModel(Exception):
    """The model computes somewhere the label tracer cannot see (a TorchScript submodule)."""


def trace_channel_flow(model: nn.Module, example_input: torch.Tensor) -> ChannelFlow:
    """Run ``model`` once on ``example_input`` (no gradients) and return its channel flow.

    Raises:
        UntraceableModel: For a model with a TorchScript submodule, whose operators never reach the tracer (its
            labels would silently stop there, and the groups would miss its layers).
    """
    scripted = [name for name, module in model.named_modules() if isinstance(module, torch.jit.ScriptModule)]
    if scripted:
        raise UntraceableModel(f"{scripted[0] or type(model).__name__} is a TorchScript module")
    flow = ChannelFlow()
    tracer = _LabelTracer(model, flow)
    names = {module: name for name, module in model.named_modules()}

    def enter(module: nn.Module, *_: object) -> None:
        tracer.modules.append(names.get(module, type(module).__name__))

    def leave(module: nn.Module, *_: object) -> None:
        tracer.modules.pop()

    with (
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave, always_call=True),
        torch.no_grad(),
        tracer,
    ):
        output = model(example_input)
    for tensor in _tensors(output):
        labels = tracer.labels.get(tensor)  # type: ignore[no-untyped-call]  # torch.utils.weak is unannotated
        if labels is not None:
            tracer.block(labels, "the model output")
    return flow


class _LabelTracer(TorchFunctionMode):
    """Carries a label tensor next to every tensor the forward pass makes (see the module docstring)."""

    def __init__(self, model: nn.Module, flow: ChannelFlow) -> None:
        super().__init__()
        self.flow = flow
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.first_output: dict[str, tuple[int, ...]] = {}
        self.modules: list[str] = []
        self.owners: dict[str, int] = {}
        self.layer_of: dict[int, str] = {}
        self.layer_parameters: set[int] = set()
        self.param_name: dict[int, str] = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
                weight = module.in_proj_weight
            elif not isinstance(module, _LAYER_TYPES) or not isinstance(weight, torch.Tensor):
                continue
            self.layer_of[id(weight)] = name
            self.layer_parameters.update(id(param) for param in module.parameters())
        for name, param in model.named_parameters():
            self.param_name.setdefault(id(param), name)

    # ---------------------------------------------------------------------------------------------- dispatch

    def __torch_function__(
        self, func: Callable[..., Any], types: object, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" and isinstance(result, torch.Tensor) and self._labelled(args, kwargs):
            self._attribute(getattr(getattr(func, "__self__", None), "__name__", ""), args[0], result)
            return result
        if name in _IGNORED or not (name in _LAYERS or self._labelled(args, kwargs)):
            return result
        try:
            self._follow(name, func, args, kwargs, result)
        except _Blocked as blocked:
            self._block_inputs(args, kwargs, blocked.reason)
        return result

    def _follow(
        self, name: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        if name in _LAYERS:
            self._layer(name, args, kwargs, out)
        elif name in _NORMS:
            self._norm(name, args, kwargs, out)
        elif name == "prelu":
            self._prelu(args, out)
        elif (
            name in _ELEMENTWISE_UNARY
            or name in _ELEMENTWISE_BINARY
            or (name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor))
        ):
            self._elementwise(args, kwargs, out)
        elif name in _MOVES:
            self._move(name, func, args, kwargs, out)
        elif name in _SPATIAL:
            self._spatial(name, args, out)
        elif name in _REDUCTIONS:
            self._reduce(name, args, kwargs, out)
        elif name in _MATMULS:
            self._matmul(name, args, out)
        elif name == "scaled_dot_product_attention":
            self._attention(args, kwargs, out)
        else:
            raise _Blocked(f"the operator {name}")

    def _attribute(self, name: str, tensor: torch.Tensor, result: torch.Tensor) -> None:
        """A tensor attribute of a labelled tensor (``x.T``, ``x.mT``, ``x.data``): the labels follow it, or are
        blocked for any other attribute (``x.grad``)."""
        moves: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "T": lambda labels: labels.permute(*reversed(range(labels.dim()))),
            "H": lambda labels: labels.permute(*reversed(range(labels.dim()))),
            "mT": lambda labels: labels.transpose(-2, -1),
            "mH": lambda labels: labels.transpose(-2, -1),
            "data": lambda labels: labels,
            "real": lambda labels: labels,
        }
        labels = self.label_of(tensor)
        if name in moves and moves[name](labels).shape == result.shape:
            self._set(result, moves[name](labels))
        else:
            self.block(labels, f"the attribute {name or '?'}")

    # ---------------------------------------------------------------------------------------------- labels

    def _labelled(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor arguments that carry labels: labelled tensors and bare parameters."""
        return [t for t in _tensors((args, kwargs)) if t in self.labels or self._is_bare(t)]

    def _is_bare(self, tensor: torch.Tensor) -> bool:
        """True for a parameter of the model that no layer the flow knows owns (a class token, a layer scale)."""
        return (
            isinstance(tensor, nn.Parameter)
            and id(tensor) in self.param_name
            and id(tensor) not in self.layer_parameters
        )

    def label_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The labels of ``tensor``: its own, a bare parameter's (made on first use), else ``NO_LABEL``."""
        found: torch.Tensor | None = self.labels.get(tensor)  # type: ignore[no-untyped-call]
        if found is not None:
            return found
        if self._is_bare(tensor):
            name = self.param_name[id(tensor)]
            labels = torch.tensor(self.flow.sets.new(tensor.numel()), dtype=torch.long).view(tensor.shape)
            self.flow.parameters[name] = labels
            self.labels[tensor] = labels
            return labels
        return torch.full(tensor.shape, NO_LABEL, dtype=torch.long)

    def block(self, labels: torch.Tensor, reason: str) -> None:
        for label in torch.unique(labels).tolist():
            if label >= 0:
                self.flow.blocked.setdefault(int(label), reason)

    def _block_inputs(self, args: Sequence[Any], kwargs: dict[str, Any], reason: str) -> None:
        for tensor in self._labelled(args, kwargs):
            self.block(self.label_of(tensor), reason)

    def _set(self, out: Any, labels: Any) -> None:
        for tensor, label in zip(_tensors(out), _tensors(labels), strict=True):
            if tensor.shape != label.shape:
                raise _Blocked("an operator whose labels do not match its output")
            if bool((label >= 0).any()):
                self.labels[tensor] = label

    def _per_index(self, labels: torch.Tensor, dim: int, reader: str) -> tuple[int, ...]:
        """One label per index of ``dim`` (see :meth:`_collapse`)."""
        return tuple(int(v) for v in self._collapse(labels, (dim,), reader).tolist())

    def _collapse(self, labels: torch.Tensor, kept: Sequence[int], reader: str) -> torch.Tensor:
        """``labels`` reduced to the dimensions ``kept``: one label per kept position, coupling the labels met
        along the other dimensions. A channel that different producers filled at different positions (a class
        token next to patch embeddings) is one channel to ``reader``, so they must go together. Two channels of
        one layer met that way are a sum over channels, and a labelled channel that also holds values no layer
        made (a constant) cannot be removed: both block."""
        others = [d for d in range(labels.dim()) if d not in kept]
        moved = labels.permute(*kept, *others)
        kept_shape = moved.shape[: len(kept)]
        rows = moved.reshape(-1, max(1, int(torch.tensor(moved.shape[len(kept) :]).prod().item())))
        result = rows[:, 0].clone()
        for index in torch.nonzero(~(rows == rows[:, :1]).all(dim=1)).flatten().tolist():
            met = set(torch.unique(rows[index]).tolist()) - {PADDING}
            if NO_LABEL in met:
                raise _Blocked(f"{reader}, which reads a channel that also holds values no layer made")
            owners = [self.flow.sets.owner[label] for label in met]
            layer_owners = [owner for owner in owners if owner != NO_LABEL]
            if len(layer_owners) != len(set(layer_owners)):
                raise _Blocked(f"{reader}, which sums over channels")
            first, *rest = sorted(met)
            for label in rest:
                self.flow.sets.union(first, label)
            result[index] = first
        return result.reshape(kept_shape)

    # ---------------------------------------------------------------------------------------------- operators

    def _layer(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        if name == "multi_head_attention_forward":  # in_proj columns read the query, out_proj rows produce
            x, weight = args[0], args[5] if len(args) > 5 else kwargs["in_proj_weight"]
        else:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        out = out[0] if isinstance(out, tuple) else out
        layer = self.layer_of.get(id(weight))
        if layer is None:
            raise _Blocked(f"{name} with a weight that is not a layer's own parameter")
        dim = 1 if name in _CONVS else -1
        labels = self.label_of(x)
        consumed = self._per_index(labels, dim % labels.dim(), layer)
        groups = int(args[6] if len(args) > 6 else kwargs.get("groups", 1)) if name in _CONVS else 1
        if groups > 1 and groups == x.shape[1] == out.shape[1]:  # depthwise: each channel passes through
            produced = consumed
        else:
            owner = self.owners.setdefault(layer, len(self.owners))
            produced = tuple(self.flow.sets.new(out.shape[dim], owner))
            earlier = self.first_output.setdefault(layer, produced)
            for a, b in zip(earlier, produced, strict=True):  # a layer called twice loses a filter in both calls
                self.flow.sets.union(a, b)
        self.flow.uses.append(LayerUse(layer, consumed, produced, passes=produced is consumed))
        self._set(out, _broadcast(produced, out, dim))

    def _norm(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        x = args[0]
        labels = self.label_of(x)
        position = _NORM_WEIGHT_ARGUMENT[name]
        weight = kwargs.get("weight", args[position] if len(args) > position else None)
        layer = self.layer_of.get(id(weight)) if weight is not None else None
        if name == "layer_norm":
            shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
            kept = tuple(range(labels.dim() - len(shape), labels.dim()))
            consumed = tuple(int(v) for v in self._collapse(labels, kept, layer or name).flatten().tolist())
        else:
            consumed = self._per_index(labels, 1, layer or name)
        if layer is not None:
            self.flow.uses.append(LayerUse(layer, consumed, consumed, passes=True))
        self._set(out, labels)

    def _elementwise(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            raise _Blocked("an element-wise operator without a tensor result")
        tensors = [t for t in _tensors((args, kwargs)) if t.dtype != torch.bool]
        tensors.sort(key=self._is_bare)  # a bare parameter's labels last: the result carries the layers' channels
        operands = [torch.broadcast_to(self.label_of(t), out.shape) for t in tensors]
        self._set(out, self._meet(operands, out.shape))

    def _meet(self, operands: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """Couple the labels that meet at each position and return one label per position."""
        result = torch.full(shape, NO_LABEL, dtype=torch.long)
        for labels in operands:
            both = (result >= 0) & (labels >= 0) & (result != labels)
            if bool(both.any()):
                codes = torch.unique(result[both] * _CODE + labels[both])  # one pair per code: fast on big tensors
                self._couple(torch.stack([codes // _CODE, codes % _CODE], dim=1).tolist())
            result = torch.where(result < 0, labels, result)
        return result

    def _prelu(self, args: Sequence[Any], out: torch.Tensor) -> None:
        """``F.prelu(x, weight)``: a weight of one slope per channel lies along dim 1 of ``x``."""
        labels, weight = self.label_of(args[0]), args[1]
        slopes = self.label_of(weight).reshape(-1)
        if slopes.numel() > 1:
            shape = [1] * labels.dim()
            shape[1] = slopes.numel()
            labels = self._meet([labels, slopes.view(shape).expand(labels.shape)], labels.shape)
        self._set(out, labels.clone())

    def _couple(self, pairs: Sequence[Sequence[int]]) -> None:
        """Couple each pair of labels that met, except a parameter element met by several channels: a parameter
        shared across channels (a scalar gate) is not part of any one of them."""
        partners: dict[int, set[int]] = {}
        for a, b in pairs:
            for mine, other in ((a, b), (b, a)):
                if self.flow.sets.owner[mine] == NO_LABEL:
                    partners.setdefault(mine, set()).add(self.flow.sets.find(other))
        shared = {label for label, found in partners.items() if len(found) > 1}
        for a, b in pairs:
            if a not in shared and b not in shared:
                self.flow.sets.union(a, b)

    def _move(self, name: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
                return self.label_of(value)
            if isinstance(value, (list, tuple)):
                return type(value)(swap(v) for v in value)
            return value

        moved_args, moved_kwargs = [swap(a) for a in args], {k: swap(v) for k, v in kwargs.items()}
        if name in ("expand_as", "view_as", "reshape_as") and len(args) > 1:
            moved_args[1] = args[1]  # the shape donor
        if name == "pad":
            if (moved_args[2] if len(moved_args) > 2 else moved_kwargs.get("mode", "constant")) != "constant":
                raise _Blocked(f"pad in mode {moved_args[2] if len(moved_args) > 2 else moved_kwargs['mode']}")
            moved_args, moved_kwargs = moved_args[:2], {"value": PADDING}
        try:
            labels = func(*moved_args, **moved_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as error:
            raise _Blocked(f"the operator {name}") from error
        if name in _CUTS:
            self._record_cut(name, func, moved_args, moved_kwargs, labels)
        if name in ("view", "reshape", "unflatten", "reshape_as", "view_as"):
            source = moved_args[0]
            assert isinstance(labels, torch.Tensor) and isinstance(source, torch.Tensor)
            if len(_varying_dims(labels)) > len(_varying_dims(source)):
                raise _Blocked(f"a {name} that spreads its channels over several dimensions (heads, channel shuffle)")
        self._set(out, labels)

    def _record_cut(
        self, name: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], pieces: Any
    ) -> None:
        source = args[0] if args else None
        if not isinstance(source, torch.Tensor) or source.dim() == 0:
            return
        varying = _varying_dims(source)
        dim = varying[0] if len(varying) == 1 else None
        along = _along(source, dim, source.dim()) if dim is not None else tuple(_distinct(source))
        parts = tuple(_along(piece, dim, source.dim()) if dim is not None else tuple(_distinct(piece))
                      for piece in _tensors(pieces))  # fmt: skip
        if all(set(part) == set(along) for part in parts):
            return
        rest, options = list(args[1:]), dict(kwargs)
        module = self.modules[-1] if self.modules else ""
        self.flow.cuts.append(Cut(
            f"{name} in {module}" if module else f"{name} in the model's own forward", module, dim, along, parts,
            lambda tensor: func(tensor, *rest, **options), source.dim(), name,
        ))  # fmt: skip

    def _spatial(self, name: str, args: Sequence[Any], out: Any) -> None:
        labels = self.label_of(args[0])
        per_channel = self._collapse(labels, (0, 1), name)
        tensor = out[0] if isinstance(out, tuple) else out
        shape = (*per_channel.shape, *([1] * (tensor.dim() - 2)))
        self._set(tensor, per_channel.reshape(shape).expand(tensor.shape).clone())

    def _reduce(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        labels = self.label_of(args[0])
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):
            dims = tuple(range(labels.dim()))
        reduced = {d % labels.dim() for d in ((dims,) if isinstance(dims, int) else dims)}
        kept = tuple(d for d in range(labels.dim()) if d not in reduced)
        collapsed = self._collapse(labels, kept, name)
        if name in ("softmax", "log_softmax"):
            self._set(out, _unsqueezed(collapsed, reduced).expand(labels.shape).clone())
            return
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
        self._set(out[0] if isinstance(out, tuple) else out, _unsqueezed(collapsed, reduced) if keep else collapsed)

    def _matmul(self, name: str, args: Sequence[Any], out: torch.Tensor) -> None:
        left, right = (args[1], args[2]) if name == "baddbmm" else (args[0], args[1])
        if name == "__rmatmul__":
            left, right = right, left
        rows = self._contracted(left, -1, out)
        cols = self._contracted(right, -2, out)
        self._set(out, self._meet([labels for labels in (rows, cols) if labels is not None], out.shape))

    def _contracted(self, operand: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor | None:
        """The labels a matmul operand gives its result, or None; labels summed over channels are blocked."""
        labels = self.label_of(operand)
        if labels.dim() < 2 or not bool((labels >= 0).any()):
            return None
        dim = dim % labels.dim()
        try:
            collapsed = self._collapse(labels, tuple(d for d in range(labels.dim()) if d != dim), "a matrix product")
        except _Blocked:
            self.block(labels, "a matrix product that sums over its channels (attention scores)")
            return None
        return torch.broadcast_to(collapsed.unsqueeze(dim), out.shape)

    def _attention(self, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        query, key, value = (list(args) + [kwargs.get(k) for k in ("query", "key", "value")])[:3]
        for scored in (query, key):
            labels = self.label_of(scored)
            if bool((labels >= 0).any()):
                self.block(labels, "a matrix product that sums over its channels (attention scores)")
        self._set(
            out,
            self._contracted(value, -2, out)
            if isinstance(value, torch.Tensor)
            else torch.full_like(out, NO_LABEL, dtype=torch.long),
        )


class _Blocked(Exception):
    """An operator the labels cannot follow: the labels it touched are blocked with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _along(labels: torch.Tensor, dim: int | None, rank: int) -> tuple[int, ...]:
    """The labels along ``dim`` (the first element of every other dimension); a piece that lost the dimension
    (``select``) gives its distinct labels."""
    if dim is None or labels.dim() != rank:
        return tuple(_distinct(labels))
    index = [0] * labels.dim()
    index[dim] = slice(None)  # type: ignore[call-overload]
    return tuple(int(v) for v in labels[tuple(index)].tolist())


def _distinct(labels: torch.Tensor) -> list[int]:
    return [int(v) for v in torch.unique(labels).tolist() if v >= 0]


def _unsqueezed(labels: torch.Tensor, dims: Iterable[int]) -> torch.Tensor:
    """``labels`` with size-1 dimensions put back at ``dims`` (ascending)."""
    for d in sorted(dims):
        labels = labels.unsqueeze(d)
    return labels


def _varying_dims(labels: torch.Tensor) -> list[int]:
    """The dimensions along which ``labels`` change (where the channels lie), padding and unlabelled elements aside."""
    found = []
    for dim in range(labels.dim()):
        if labels.shape[dim] < 2:
            continue
        reference = labels.amax(dim=dim, keepdim=True)  # the one label along ``dim`` where there is only one
        if bool(((labels >= 0) & (labels != reference)).any()):
            found.append(dim)
    return found


def _broadcast(per_channel: Sequence[int], like: torch.Tensor, dim: int) -> torch.Tensor:
    """A label tensor shaped like ``like`` holding ``per_channel[i]`` at every position of index i of ``dim``."""
    shape = [1] * like.dim()
    shape[dim] = len(per_channel)
    return torch.tensor(per_channel, dtype=torch.long).view(shape).expand(like.shape).clone()

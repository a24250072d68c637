"""Dependency graphs of the parts of a model that Torch-Pruning can trace, for a model it cannot trace as a whole.

Torch-Pruning 1.6.1 raises while tracing some architectures (torchvision's ShuffleNetV2: ``chunk`` and a channel
shuffle). Their units inside a branch never meet the pattern it fails on, so each largest submodule that does trace
is traced on its own, on the input it receives in the model's forward pass. A unit found there is kept only when its
group stays inside the submodule: the submodule is traced between two boundary layers, a 1x1 ``source`` producing its
input and a 1x1 ``sink`` consuming its output, and a group that holds either of them reaches beyond the submodule
(a residual add of its input, the output that a concat or shuffle carries on), so it is left out with a reason.

:class:`PartGraphs` holds the graphs and answers like one ``tp.DependencyGraph`` of the whole model (its modules'
nodes, their groups and pruners), so masking, physical removal, costs and planning read it as they read any graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

Trace = Callable[[nn.Module, torch.Tensor], "tp.DependencyGraph | None"]
"""Traces a module on an input into a graph, or gives None when Torch-Pruning cannot trace it."""
BOUNDARY_LAYERS: dict[int, Callable[[int], nn.Module]] = {
    2: lambda c: nn.Linear(c, c),
    3: lambda c: nn.Conv1d(c, c, 1),
    4: lambda c: nn.Conv2d(c, c, 1),
    5: lambda c: nn.Conv3d(c, c, 1),
}
"""A layer consuming and producing a tensor of that many dimensions with channels on dimension 1."""
SHUFFLE_CAUSE = "it cannot map this model's channel shuffle, a view and transpose"


@dataclass
class Part:
    """One traced submodule: its name in the model, its graph and the boundary layers it was traced between.

    Attributes:
        name: Module name in the model.
        module: The submodule (the model's own module object).
        graph: Its dependency graph, traced as ``sink(module(source(x)))``.
        source: The layer producing the submodule's input in ``graph`` (not part of the model).
        sink: The layer consuming the submodule's output in ``graph`` (not part of the model).
        order: When the forward pass calls it, among the parts.
        model_output: Whether the model's output is its output (or a view of it).
    """

    name: str
    module: nn.Module
    graph: tp.DependencyGraph
    source: nn.Module
    sink: nn.Module
    order: int
    model_output: bool


class PartGraphs(tp.DependencyGraph):  # type: ignore[misc]  # Torch-Pruning is unannotated
    """The dependency graphs of a model's traceable parts, read as one graph of the model.

    ``module2node`` holds every part's nodes; a group is built by the graph of the part its root lies in. Which of
    the roots it holds have a group inside their part, :meth:`left_out` says.

    Attributes:
        parts: The traced parts, in forward order.
        untraced: Names of the deepest submodules (holding units) that could not be traced.
        shuffle: Whether the model's forward pass runs a channel shuffle (a transpose of dims 1 and 2 of a 5-D view).
    """

    def __init__(self, model: nn.Module, parts: Sequence[Part], untraced: Sequence[str], shuffle: bool) -> None:
        super().__init__()
        self.model = model
        self.parts = list(parts)
        self.untraced = list(untraced)
        self.shuffle = shuffle
        self.module2node = {module: node for part in self.parts for module, node in part.graph.module2node.items()}
        self._owner = {module: part for part in self.parts for module in part.graph.module2node}
        self._reasons: dict[nn.Module, str | None] = {}

    def part_of(self, module: Any) -> Part | None:
        """The part whose graph holds ``module``, or None."""
        return self._owner.get(module)

    def get_pruning_group(self, module: nn.Module, pruning_fn: Callable[..., Any], idxs: Sequence[int]) -> Any:
        """The group of ``module``'s part graph (see ``tp.DependencyGraph.get_pruning_group``)."""
        part = self.part_of(module)
        if part is None:
            raise ValueError(f"{type(module).__name__} is in no traced part of the model")
        return part.graph.get_pruning_group(module, pruning_fn, idxs)

    def get_pruner_of_module(self, module: nn.Module) -> Any:
        """The pruner the part graphs remove ``module`` with (they are built with the same pruners)."""
        part = self.part_of(module)
        return (part.graph if part is not None else self.parts[0].graph).get_pruner_of_module(module)

    def is_out_channel_pruning_fn(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` removes output channels (the part graphs share their pruners)."""
        return bool(self.parts[0].graph.is_out_channel_pruning_fn(fn))

    def is_in_channel_pruning_fn(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` removes input channels (the part graphs share their pruners)."""
        return bool(self.parts[0].graph.is_in_channel_pruning_fn(fn))

    def left_out(self, root: nn.Module, root_name: str) -> str | None:
        """Why the unit rooted at ``root`` cannot be pruned on these graphs, or None when its group stays inside
        its part (then the part graph's group is the whole model's)."""
        if root not in self._reasons:
            self._reasons[root] = self._left_out(root, root_name)
        return self._reasons[root]

    def _left_out(self, root: nn.Module, root_name: str) -> str | None:
        part = self.part_of(root)
        if part is None:
            around = [name for name in self.untraced if root_name.startswith(f"{name}.")]
            where = f"{around[0]}, a part" if around else "a part"
            return f"it lies in {where} of the model whose channel dependencies Torch-Pruning cannot trace"
        pruner = part.graph.get_pruner_of_module(root)
        channels = range(int(part.graph.get_out_channels(root)))
        group = part.graph.get_pruning_group(root, pruner.prune_out_channels, list(channels))
        reached = {item.dep.target.module for item in group} & {part.source, part.sink}
        if not reached:
            return None
        if reached == {part.sink} and part.model_output:
            return f"coupled to the model output ({part.name})"
        cause = SHUFFLE_CAUSE if self.shuffle else "the model as a whole cannot be traced"
        return f"its channels leave {part.name}, the largest part around it that Torch-Pruning can trace ({cause})"

    def continuation(self, node: Any) -> list[Any]:
        """The nodes a part's output flows on to in the model, for walks downstream: when ``node`` is a part's sink,
        the source nodes of every part called after it (the parts' links are not traced, so every later part
        counts as downstream); else nothing."""
        for part in self.parts:
            if node is part.graph.module2node.get(part.sink):
                later = (p for p in self.parts if p.order > part.order)
                return [p.graph.module2node[p.source] for p in later if p.source in p.graph.module2node]
        return []


def left_out_reason(graph: tp.DependencyGraph, root: nn.Module, root_name: str) -> str | None:
    """Why ``root``'s unit cannot be pruned when ``graph`` is a :class:`PartGraphs` (its group leaves its part, or
    it lies in no traced part); None for a graph of the whole model."""
    return graph.left_out(root, root_name) if isinstance(graph, PartGraphs) else None


def continuation(graph: tp.DependencyGraph, node: Any) -> list[Any]:
    """Nodes downstream of ``node`` that ``node.outputs`` misses: those of later parts when ``node`` is a part's
    output in a :class:`PartGraphs` (see :meth:`PartGraphs.continuation`); else nothing."""
    return graph.continuation(node) if isinstance(graph, PartGraphs) else []


@dataclass
class _Call:
    """What one forward pass recorded of a submodule: its inputs, output, how often it ran and when it first did."""

    order: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None
    calls: int = 0


class _Bounded(nn.Module):
    """``sink(part(source(x)))``: a part traced between boundary layers, so groups that leave it hold them."""

    def __init__(self, part: nn.Module, source: nn.Module, sink: nn.Module) -> None:
        super().__init__()
        self.source, self.part, self.sink = source, part, sink

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.sink(self.part(self.source(x)))
        return out


class _ShuffleSpotter(TorchFunctionMode):
    """Notes whether a forward pass transposes dims 1 and 2 of a 5-D tensor (a channel shuffle's transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes):
            dims = [*args[1:], *kwargs.values()]
            tensor = args[0] if args else None
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 5 and len(dims) == 2:
                self.found |= sorted(int(d) % 5 for d in dims) == [1, 2]
        return func(*args, **kwargs)


def trace_parts(
    model: nn.Module, example: torch.Tensor, trace: Trace, is_root: Callable[[nn.Module], bool]
) -> PartGraphs | None:
    """Trace each largest submodule of ``model`` that holds unit roots (``is_root``) and that ``trace`` can trace,
    on the input it receives when ``model`` runs on ``example``; None when no part traces.

    A submodule is a candidate when the forward pass calls it once with one tensor and it returns one tensor, both
    with 2-5 dimensions (channels on dimension 1); any other is searched through its children.
    """
    calls, output, shuffle = _record_calls(model, example)
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    parts: list[Part] = []
    untraced: list[str] = []

    def search(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if not any(is_root(m) for m in child.modules()):
                continue
            call = calls.get(child)
            part = _traced_part(name, child, call, trace, outputs) if call is not None else None
            if part is not None:
                parts.append(part)
            elif next(child.children(), None) is None:
                untraced.append(name)
            else:
                search(child, f"{name}.")

    search(model, "")
    if not parts:
        return None
    parts.sort(key=lambda p: p.order)
    logger.info(
        "Torch-Pruning cannot trace %s as a whole; traced %d of its parts on their own", type(model).__name__,
        len(parts),
    )  # fmt: skip
    return PartGraphs(model, parts, untraced, shuffle)


def _record_calls(model: nn.Module, example: torch.Tensor) -> tuple[dict[nn.Module, _Call], Any, bool]:
    """One forward pass of ``model``: each submodule's first call (with how often it ran), the model's output, and
    whether it shuffled channels."""
    calls: dict[nn.Module, _Call] = {}

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = calls.setdefault(module, _Call(len(calls), args, kwargs))
        call.calls += 1

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if calls[module].calls == 1:
            calls[module].output = output

    modules = [m for m in model.modules() if m is not model]
    hooks = [m.register_forward_pre_hook(before, with_kwargs=True) for m in modules]
    hooks += [m.register_forward_hook(after) for m in modules]
    spotter = _ShuffleSpotter()
    try:
        with torch.no_grad(), spotter:
            output = model(example)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, output, spotter.found


def _traced_part(name: str, module: nn.Module, call: _Call, trace: Trace, outputs: Iterable[Any]) -> Part | None:
    """``module`` traced between boundary layers on its recorded input, or None when it is no candidate or does not
    trace."""
    inputs, output = call.args, call.output
    if call.calls != 1 or call.kwargs or len(inputs) != 1:
        return None
    (x,) = inputs
    if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    if x.dim() not in BOUNDARY_LAYERS or output.dim() not in BOUNDARY_LAYERS or not x.is_floating_point():
        return None
    source = BOUNDARY_LAYERS[x.dim()](x.shape[1]).to(x.device, x.dtype)
    sink = BOUNDARY_LAYERS[output.dim()](output.shape[1]).to(output.device, output.dtype)
    graph = trace(_Bounded(module, source, sink), x.detach().clone())
    if graph is None:
        return None
    model_output = any(_shares_data(output, out) for out in outputs)
    return Part(name, module, graph, source, sink, call.order, model_output)


def _shares_data(part_output: torch.Tensor, model_output: Any) -> bool:
    """Whether ``model_output`` is ``part_output`` or a view of it (timm's conv classifier, then ``flatten``)."""
    return isinstance(model_output, torch.Tensor) and (
        part_output.untyped_storage().data_ptr() == model_output.untyped_storage().data_ptr()
    )

"""Prunable units and their coupled channel groups, built on Torch-Pruning's ``DependencyGraph``.

A unit is one of three kinds. ``conv``: the filters of a conv weight (``nn.Conv1d/2d/3d`` with ``groups == 1``).
``linear``: the output features (neurons) of an ``nn.Linear``, e.g. an MLP's hidden layer. ``heads``: the heads of
an attention module (:mod:`analysis.structure.heads`), named ``<module>.heads``. A conv or linear unit is prunable
when removing its outputs does not change the model's outputs' shape. Its group is every tensor slice that must go
with those channels: its bias, the following BatchNorm, depthwise convs carrying the channel, consumers' input
slices, and every producer joined to it by a residual add or multiply. Depthwise and grouped convs are never roots
themselves; they are pruned as members of a root's group. Grouped convs in a group allow removing channels only
evenly across their conv groups.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from torch_pruning import ops

from analysis.config import UNIT_KINDS
from analysis.errors import ConfigError, ModelError, did_you_mean
from analysis.inputs.device import is_out_of_memory
from analysis.structure._time_limit import TimeLimitReached, time_limit
from analysis.structure.channel_flow import ChannelFlow, UntraceableModel, trace_channel_flow
from analysis.structure.custom_layers import FixedWidthPruner, channel_pruner, customized_pruners, fixed_width_pruner
from analysis.structure.cuts import cut_problem
from analysis.structure.flow_groups import CoupledGraph, choose_group
from analysis.structure.heads import (
    HEADS_SUFFIX,
    head_layout,
    head_structured_layers,
    head_structured_reason,
    heads_group,
    is_attention,
    layout_problem,
    projections,
)
from analysis.structure.submodule_graphs import left_out_reason, trace_parts

logger = logging.getLogger(__name__)

# Op types that carry channels through without parameters of their own.
PASS_THROUGH = {
    ops.OPTYPE.ELEMENTWISE,
    ops.OPTYPE.CONCAT,
    ops.OPTYPE.SPLIT,
    ops.OPTYPE.RESHAPE,
    ops.OPTYPE.UNBIND,
    ops.OPTYPE.EXPAND,
    ops.OPTYPE.SLICE,
    ops.OPTYPE.OUTPUT,
}
GROUP_SEARCH_SECONDS = 10.0
"""Most CPU time Torch-Pruning may spend searching one unit's group before the unit is left out with that reason
(groups of ordinary models take milliseconds; a few architectures make the search run away, see :mod:`._time_limit`)."""
RUNAWAY_BUDGET_SECONDS = 60.0
"""Time one description may lose to searches that ran out; past it every further search gets
:data:`LATE_SEARCH_SECONDS` (timm's EfficientViT-M0 has 45 runaway units: 7.5 minutes at 10 s each)."""
LATE_SEARCH_SECONDS = 1.0
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Conv layers whose filters are units (transposed convs are not)."""
# Layer types whose channel slices we know how to mask and to remove (besides those with a customised pruner).
SUPPORTED_MEMBERS = (*CONV_TYPES, nn.Linear, nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.PReLU)


@dataclass
class PrunableUnit:
    """One unit (a conv's filters, a Linear's neurons or an attention module's heads), whether it can be pruned
    (``reason`` is None) and what its removal takes with it.

    Attributes:
        name: Parameter name, e.g. ``layer1.0.conv1.weight``, or ``blocks.0.attn.heads`` for heads.
        module_name: Name of the conv, linear or attention module.
        shape: Weight shape; ``(heads, head_dim)`` for heads.
        reason: Why the unit cannot be a pruning root, or None.
        members: Human-readable group members (``module (role)``), root first.
        coupled_params: Other prunable conv or linear weights whose output channels are in the same group.
        conv_blocks: For groups with grouped convs: the root channels of each conv group (equal removal per
            block is required); empty otherwise.
        bn_name: The BatchNorm directly after the conv, if any (for the ``bn_scale`` criterion).
        kind: ``conv``, ``linear`` or ``heads`` (see :data:`UNIT_KINDS`).
    """

    name: str
    module_name: str
    shape: tuple[int, ...]
    reason: str | None = None
    members: list[str] = field(default_factory=list)
    coupled_params: list[str] = field(default_factory=list)
    conv_blocks: list[list[int]] = field(default_factory=list)
    bn_name: str | None = None
    kind: str = "conv"

    @property
    def channels(self) -> int:
        """Number of removable things: output channels (filters), output features (neurons) or heads."""
        return self.shape[0]

    @property
    def prunable(self) -> bool:
        """True when the unit can be pruned as a root."""
        return self.reason is None


def unit_kind(module: nn.Module) -> str | None:
    """The kind of unit ``module`` roots (``conv``, ``linear``, ``heads``), or None."""
    if is_attention(module):
        return "heads"
    if isinstance(module, CONV_TYPES):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    return None


def unit_shape(module: nn.Module) -> tuple[int, ...]:
    """The shape of the unit rooted at ``module``: its weight's, or ``(heads, head_dim)``; the first entry is how
    many channels, features or heads it has."""
    layout = head_layout(module)
    if layout is not None:
        return (layout.heads, layout.head_dim)
    assert unit_kind(module) is not None, f"not a unit root: {type(module).__name__}"
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return tuple(weight.shape)


@contextmanager
def all_parameters_require_grad(model: nn.Module) -> Iterator[None]:
    """Temporarily make every parameter require grad: Torch-Pruning traces the autograd graph, which only sees
    parameters that require grad. The original flags are restored afterwards, also on error."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for param, _ in flags:
            param.requires_grad_(True)
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


def build_dependency_graph(model: nn.Module, example_input: torch.Tensor) -> tp.DependencyGraph:
    """Trace ``model`` on ``example_input`` (one sample is enough) into a Torch-Pruning dependency graph, with the
    customised pruners of :mod:`analysis.structure.custom_layers` (every graph of the package is built here)."""
    example = example_input[:1].detach().clone()
    flags = [(module, module.training) for module in model.modules()]
    graph = CoupledGraph()
    graph.names = {module: name for name, module in model.named_modules()}
    graph.names.update({param: name for name, param in model.named_parameters()})
    graph.flow = _channel_flow(model, example)
    with all_parameters_require_grad(model), torch.enable_grad():
        try:
            return _trace(model, example, graph)
        except Exception as error:  # Torch-Pruning fails on some graphs (torchvision ShuffleNetV2, Swin-S/B)
            if not _raised_in_torch_pruning(error) or is_out_of_memory(error):
                raise  # the model's own forward, or the machine
            parts = trace_parts(model, example, _trace_or_none, lambda module: unit_kind(module) is not None)
            if parts is not None:
                return parts  # the submodules that trace, each on its own (:mod:`.submodule_graphs`)
            text = str(error).splitlines()[0][:160] if str(error) else ""
            raise ModelError(
                f"Torch-Pruning cannot trace the channel dependencies of this {type(model).__name__} "
                f"({type(error).__name__}: {text}), so none of its units can be analysed."
            ) from error
        finally:
            _restore_training_flags(flags)


def _channel_flow(model: nn.Module, example: torch.Tensor) -> ChannelFlow | None:
    """The model's channel flow, or None (logged) when a forward pass under the label tracer fails: Torch-Pruning's
    groups are then used as they are."""
    try:
        return trace_channel_flow(model, example)
    except UntraceableModel as error:
        logger.info("No channel flow for %s (%s); using Torch-Pruning's groups alone", type(model).__name__, error)
        return None
    except Exception as error:
        if is_out_of_memory(error):
            raise
        logger.warning("The channel flow of %s could not be traced (%s: %s); using Torch-Pruning's groups alone",
                       type(model).__name__, type(error).__name__, error)  # fmt: skip
        return None


def _trace(model: nn.Module, example: torch.Tensor, into: tp.DependencyGraph | None = None) -> tp.DependencyGraph:
    """Torch-Pruning's graph of ``model`` with the package's customised pruners, built into ``into`` or a new graph
    (it raises where it cannot trace)."""
    graph = into if into is not None else tp.DependencyGraph()
    built: tp.DependencyGraph = graph.build_dependency(
        model, example_inputs=example, verbose=False, customized_pruners=customized_pruners()
    )
    return built


def _trace_or_none(model: nn.Module, example: torch.Tensor) -> tp.DependencyGraph | None:
    """The graph of ``model``, or None when Torch-Pruning raises while tracing it."""
    try:
        return _trace(model, example)
    except Exception as error:
        if not _raised_in_torch_pruning(error) or is_out_of_memory(error):
            raise
        logger.debug("Torch-Pruning cannot trace %s", type(model).__name__, exc_info=True)
        return None


def _restore_training_flags(flags: Sequence[tuple[nn.Module, bool]]) -> None:
    """Give every module its ``training`` flag back, after letting the modules drop what they cached in eval mode.

    Tracing runs the model in eval mode with autograd on, and some modules cache tensors computed in eval mode (timm's
    LeViT attention biases): such a cache then holds a tensor of the trace's autograd graph, which no later copy of
    the model can deep-copy. Modules empty these caches in their own ``train()``, so every module is put in training
    mode through it once (setting flags only, nothing runs), then each flag is set back as it was."""
    if not flags:
        return
    flags[0][0].train()
    for module, flag in flags:
        module.training = flag


def _raised_in_torch_pruning(error: BaseException) -> bool:
    """True when the innermost frame of ``error`` is Torch-Pruning's code (not the model's forward, not torch)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}torch_pruning{os.sep}" in frames[-1].filename


def execution_order(
    model: nn.Module, example_input: torch.Tensor, layer_types: tuple[type[nn.Module], ...] | None = None
) -> list[str]:
    """Names of the ``layer_types`` modules (default: every unit root, see :func:`unit_kind`) in the order the
    forward pass first calls them."""
    names = {module: name for name, module in model.named_modules()}
    order: list[str] = []

    def record(module: nn.Module, *_: object) -> None:
        name = names[module]
        if name not in order:
            order.append(name)

    def wanted(module: nn.Module) -> bool:
        return isinstance(module, layer_types) if layer_types is not None else unit_kind(module) is not None

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if wanted(m)]
    try:
        with torch.inference_mode():
            model(example_input[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return order


def output_modules(graph: tp.DependencyGraph) -> set[nn.Module]:
    """The layers that produce the model's outputs (found by walking back from the graph's sinks through ops)."""
    found: set[nn.Module] = set()
    stack = [node for node in graph.module2node.values() if not node.outputs]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.type in PASS_THROUGH:
            stack.extend(node.inputs)
        else:
            found.add(node.module)
    return found


def full_group(graph: tp.DependencyGraph, root: nn.Module) -> tp.dependency.Group:
    """The group of every output channel (or head) of the unit rooted at ``root``, for inspection and ranking."""
    return removal_group(graph, root, range(unit_shape(root)[0]))


def removal_group(graph: tp.DependencyGraph, root: nn.Module, channels: Sequence[int]) -> tp.dependency.Group:
    """The group that removing ``channels`` of ``root``'s outputs (or those heads of an attention root) requires."""
    indices = sorted(int(c) for c in channels)
    if is_attention(root):
        return heads_group(graph, root, indices)

    def torch_pruning_group() -> tp.dependency.Group:
        return graph.get_pruning_group(root, graph.get_pruner_of_module(root).prune_out_channels, indices)

    if isinstance(graph, CoupledGraph):
        return choose_group(graph, root, indices, torch_pruning_group)
    return torch_pruning_group()


def is_supported_member(graph: tp.DependencyGraph, module: Any) -> bool:
    """True when the package can mask and remove ``module``'s slices as a group member: a layer of
    :data:`SUPPORTED_MEMBERS`, a bare parameter, an op node, or a layer with a customised pruner
    (:mod:`analysis.structure.custom_layers`)."""
    if isinstance(module, (*SUPPORTED_MEMBERS, nn.Parameter)) or channel_pruner(graph, module) is not None:
        return True
    return graph.module2node[module].type in PASS_THROUGH


def is_out_channel_item(graph: tp.DependencyGraph, item: Any) -> bool:
    """True when the group item removes output channels (rather than input slices) of its layer."""
    out_side: bool = graph.is_out_channel_pruning_fn(item.dep.handler)  # Torch-Pruning is unannotated
    return out_side


def per_channel_extras(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters a conv subclass holds beside weight and bias with one entry per output channel on their first
    dimension (timm's ``ScaledStdConv2d.gain`` in NFNets): Torch-Pruning leaves them, so removal slices them too."""
    if not isinstance(module, nn.modules.conv._ConvNd) or module.transposed:
        return []
    return [
        (name, param)
        for name, param in module.named_parameters(recurse=False)
        if name not in ("weight", "bias") and param.dim() >= 1 and param.shape[0] == module.out_channels
    ]


def is_grouped_conv(module: nn.Module) -> bool:
    """True for convs with 1 < groups < channels (ResNeXt/RegNet style), which need even removal per conv group."""
    return isinstance(module, CONV_TYPES) and module.groups > 1 and not is_depthwise(module)


def is_depthwise(module: nn.Module) -> bool:
    """True for depthwise convs: one filter per channel, so input and output channels correspond one to one.

    A depthwise conv with a channel multiplier (``Conv2d(8, 16, groups=8)``) is a grouped conv here."""
    return (
        isinstance(module, CONV_TYPES)
        and module.groups > 1
        and module.groups == module.in_channels == module.out_channels
    )


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every module in eval mode for the block (BatchNorm statistics stay untouched, dropout is off), then
    restore each module's own ``training`` flag; Torch-Pruning's tracing would otherwise leave the model in eval."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        _restore_training_flags(flags)


def find_prunable(model: nn.Module, example_input: torch.Tensor) -> list[PrunableUnit]:
    """List every unit (conv filters, Linear neurons, attention heads) in forward order, with its group, or the
    reason it is not prunable."""
    with eval_mode(model):
        graph = build_dependency_graph(model, example_input)
        return describe_units(model, graph, execution_order(model, example_input))


def describe_units(model: nn.Module, graph: tp.DependencyGraph, order: Sequence[str]) -> list[PrunableUnit]:
    """Build a :class:`PrunableUnit` for each unit root in ``order`` (plus roots never run, at the end)."""
    modules = dict(model.named_modules())
    names: dict[object, str] = {module: name for name, module in modules.items()}
    names.update({param: name for name, param in model.named_parameters()})
    owners = _projection_owners(modules)
    unused = [n for n, m in modules.items() if unit_kind(m) is not None and n not in order]
    outputs = output_modules(graph)
    budget = _SearchBudget()
    params = [_describe(name, modules[name], graph, names, outputs, owners, budget) for name in order]
    params += [_unused(name, modules[name], owners) for name in unused]
    prunable = {p.name for p in params if p.prunable}
    for param in params:  # _describe listed every root whose outputs are in the group; keep the prunable ones
        param.coupled_params = [name for name in param.coupled_params if name in prunable] if param.prunable else []
    return params


def unit_name(module_name: str, module: nn.Module) -> str:
    """The name a unit is recorded under: the weight's name, or ``<attention module>.heads``."""
    return f"{module_name}{HEADS_SUFFIX}" if is_attention(module) else f"{module_name}.weight"


def _projection_owners(modules: dict[str, nn.Module]) -> dict[nn.Module, str]:
    """Layers whose outputs are attention heads (``qkv``, MultiheadAttention's ``out_proj``, LeViT's ``qkv``) ->
    why they are not units themselves."""
    owners: dict[nn.Module, str] = {}
    for name, module in modules.items():
        if isinstance(module, nn.MultiheadAttention):
            owners[module.out_proj] = _projection_reason(name)
        elif is_attention(module):
            owners[projections(module)[0]] = _projection_reason(name)  # qkv
        else:
            owners.update(dict.fromkeys(head_structured_layers(module), head_structured_reason(module)))
    return owners


def _unused(name: str, module: nn.Module, owners: dict[nn.Module, str]) -> PrunableUnit:
    """A root the forward pass never calls: an attention's inner projection, or a layer the model does not use."""
    kind = unit_kind(module)
    assert kind is not None
    param = PrunableUnit(unit_name(name, module), name, unit_shape(module), "not used by the forward pass", kind=kind)
    if module in owners:
        param.reason = owners[module]
    return param


def _projection_reason(attention: str) -> str:
    return f"its outputs are attention heads: pruned as the unit {attention}{HEADS_SUFFIX}"


def _describe(
    name: str,
    root: nn.Module,
    graph: tp.DependencyGraph,
    names: dict[object, str],
    outputs: set[nn.Module],
    owners: dict[nn.Module, str],
    budget: _SearchBudget,
) -> PrunableUnit:
    kind = unit_kind(root)
    assert kind is not None
    param = PrunableUnit(unit_name(name, root), name, unit_shape(root), kind=kind)
    if kind == "heads":
        return _describe_heads(param, root, graph, names)
    if root in owners:
        param.reason = owners[root]
    elif is_depthwise(root):
        param.reason = "depthwise conv: pruned together with the conv that produces its input channels"
    elif isinstance(root, CONV_TYPES) and root.groups > 1:
        param.reason = f"grouped conv (groups={root.groups}): pruned only as a member of another conv's group"
    elif param.channels < 2:
        param.reason = f"has a single output {'feature' if kind == 'linear' else 'channel'}"
    elif (outside := left_out_reason(graph, root, name)) is not None:
        param.reason = outside  # a model traced in parts: the group leaves its part
    elif root not in graph.module2node:
        param.reason = "not reached by dependency tracing"
    if param.reason:
        return param
    group, problem = _search_group(graph, root, budget)
    if group is None:
        param.reason = problem
        return param
    for item in group:
        module = item.dep.target.module
        out_item = is_out_channel_item(graph, item)
        if out_item and module in outputs:
            param.reason = f"coupled to the model output ({names.get(module, type(module).__name__)})"
            return param
        fixed = fixed_width_pruner(graph, module)
        if fixed is not None:
            param.reason = fixed.reason
            return param
        if not is_supported_member(graph, module):
            param.reason = f"its group contains an unsupported layer ({type(module).__name__})"
            return param
        custom = channel_pruner(graph, module)
        if custom is not None and custom.problem(module) is not None:
            param.reason = custom.problem(module)
            return param
        if module in names and module is not root:
            role = "out" if out_item else "in"
            param.members.append(f"{names[module]} ({type(module).__name__}, {role})")
            if out_item and unit_kind(module) in ("conv", "linear"):
                param.coupled_params.append(f"{names[module]}.weight")
        if (
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and param.bn_name is None
            and graph.module2node[root] in graph.module2node[module].inputs
        ):
            param.bn_name = names[module]
    param.members.insert(0, f"{name} ({type(root).__name__}, out)")
    blocks, problem = _conv_blocks(graph, group, param.channels)
    if problem:
        param.reason = problem
    elif isinstance(graph, CoupledGraph) and (cut := cut_problem(graph, root, param.channels)) is not None:
        param.reason = cut
    param.conv_blocks = blocks
    return param


class _SearchBudget:
    """The CPU-time limit of the next group search: :data:`GROUP_SEARCH_SECONDS` until searches that ran out have
    used :data:`RUNAWAY_BUDGET_SECONDS`, then :data:`LATE_SEARCH_SECONDS`."""

    def __init__(self) -> None:
        self.lost = 0.0

    def limit(self) -> float:
        return GROUP_SEARCH_SECONDS if self.lost < RUNAWAY_BUDGET_SECONDS else LATE_SEARCH_SECONDS

    def ran_out(self, seconds: float) -> None:
        self.lost += seconds


def _search_group(
    graph: tp.DependencyGraph, root: nn.Module, budget: _SearchBudget
) -> tuple[tp.dependency.Group | None, str]:
    """The root's full group, or None and the reason Torch-Pruning could not build it (within the budget's limit,
    in memory, or at all): one unit left out, never the whole run."""
    seconds = budget.limit()
    try:
        with time_limit(seconds):
            return _fixed_width_probe(graph, root) or full_group(graph, root), ""
    except TimeLimitReached:
        budget.ran_out(seconds)
        return None, f"Torch-Pruning's group search did not finish in {seconds:g} s of CPU time"
    except MemoryError:
        return None, "Torch-Pruning's group search ran out of memory"
    except Exception as error:  # Torch-Pruning's index mapping fails on some graphs: report the unit, go on
        logger.debug("Torch-Pruning could not build a group", exc_info=True)
        text = str(error).splitlines()[0][:160] if str(error) else ""
        return None, f"Torch-Pruning could not build its group ({type(error).__name__}: {text})"


def _fixed_width_probe(graph: tp.DependencyGraph, root: nn.Module) -> tp.dependency.Group | None:
    """The group of ``root``'s first channel when it holds a layer of fixed width, else None.

    That group is part of the full group, so its fixed-width layer is the unit's reason (see :func:`_describe`)
    without the full search, which costs seconds per unit on a long residual stream (torchvision Swin-S/B). A
    graph with a channel flow needs no probe: its groups cost no search."""
    if isinstance(graph, CoupledGraph) and graph.flow is not None:
        return None
    if not any(isinstance(pruner, FixedWidthPruner) for pruner in graph.CUSTOMIZED_PRUNERS.values()):
        return None
    probe = removal_group(graph, root, [0])
    return probe if any(fixed_width_pruner(graph, item.dep.target.module) for item in probe) else None


def _describe_heads(
    param: PrunableUnit, attention: nn.Module, graph: tp.DependencyGraph, names: dict[object, str]
) -> PrunableUnit:
    """A heads unit: its members are the projections that lose rows and columns."""
    param.reason = layout_problem(attention)
    if param.reason is None and param.channels < 2:
        param.reason = "has a single head"
    if param.reason is None and not all(layer in graph.module2node for layer in projections(attention)):
        param.reason = "not reached by dependency tracing"
    if isinstance(attention, nn.MultiheadAttention):
        param.members = [f"{param.module_name} (MultiheadAttention, heads)"]
    else:
        qkv, proj = projections(attention)
        param.members = [f"{param.module_name} ({type(attention).__name__}, heads)", f"{names[qkv]} (Linear, out)",
                         f"{names[proj]} (Linear, in)"]  # fmt: skip
    return param


def _conv_blocks(graph: tp.DependencyGraph, group: tp.dependency.Group, channels: int) -> tuple[list[list[int]], str]:
    """Partition the root channels by the conv groups of grouped-conv members (they need equal removal per block).

    Returns the blocks (empty when no grouped conv is involved) and a reason string when the constraint cannot be
    expressed on the root's channels.
    """
    partition: tuple[int, ...] | None = None
    for item in group:
        module = item.dep.target.module
        if not is_grouped_conv(module):
            continue
        size = module.out_channels if is_out_channel_item(graph, item) else module.in_channels
        block = size // module.groups
        local, root = list(item.idxs), list(item.root_idxs)
        if len(set(local)) != size or sorted(root) != list(range(channels)):
            return [], f"its channels reach a grouped conv ({module.groups} groups) through a concat or split"
        key_of = dict(zip(root, (i // block for i in local), strict=True))
        key = tuple(key_of[r] for r in range(channels))
        if partition is not None and key != partition:
            return [], "it feeds grouped convs whose conv groups disagree"
        partition = key
    if partition is None:
        return [], ""
    blocks: dict[int, list[int]] = {}
    for channel, block_id in enumerate(partition):
        blocks.setdefault(block_id, []).append(channel)
    return [blocks[k] for k in sorted(blocks)], ""


def select_params(
    params: Sequence[PrunableUnit],
    names: Sequence[str] | None,
    skip: Sequence[str] = (),
    key: str = "SensitivityAnalysis.prune_params_name",
    skip_key: str = "SensitivityAnalysis.skip_params",
    units: Sequence[str] | None = None,
    units_key: str = "SensitivityAnalysis.units",
) -> list[PrunableUnit]:
    """The params to analyse, in model order: ``names`` (all prunable ones of the kinds in ``units``, every kind
    when None, when ``names`` is None) minus ``skip``.

    Names may be parameter names (``layer1.0.conv1.weight``) or module names (``layer1.0.conv1``).

    Raises:
        ConfigError: For a name that is not a unit of the model (with the closest match), that cannot be pruned
            (with the reason), or whose kind ``units`` leaves out.
    """
    kinds = set(UNIT_KINDS if units is None else units)
    by_name = {p.name: p for p in params}

    def resolve(name: str, which: str) -> PrunableUnit:
        found = by_name.get(name) or by_name.get(f"{name}.weight")
        if found is None:
            raise ConfigError(
                f"{which}: '{name}' is not a unit of this model{did_you_mean(name, by_name)}; "
                "names look like layer1.0.conv1.weight (or blocks.0.attn.heads for attention heads)."
            )
        return found

    skipped = {resolve(n, skip_key).name for n in skip}
    if names is None:
        by_kind = [p for p in params if p.prunable and p.kind in kinds and p.name not in skipped]
        if not by_kind:
            raise ConfigError(_nothing_left(params, kinds, units, units_key, skip_key, skipped))
        return by_kind
    chosen = {resolve(n, key).name for n in names}
    for name in chosen:
        if not by_name[name].prunable:
            raise ConfigError(f"{key}: '{name}' cannot be pruned: {by_name[name].reason}.")
        if by_name[name].kind not in kinds:
            raise ConfigError(
                f"{key}: '{name}' is a {by_name[name].kind} unit but {units_key} is {sorted(kinds)}; "
                f"add {by_name[name].kind} to units or remove the name."
            )
    selected = [p for p in params if p.name in chosen and p.name not in skipped]
    if not chosen:
        raise ConfigError(f"{key} is an empty list; name the units to analyse, or leave it out for every one.")
    if not selected:
        raise ConfigError(f"{skip_key} leaves out every unit {key} names; nothing is left to analyse.")
    return selected


def _nothing_left(
    params: Sequence[PrunableUnit],
    kinds: set[str],
    units: Sequence[str] | None,
    units_key: str,
    skip_key: str,
    skipped: set[str],
) -> str:
    """Why a selection by kind leaves no unit to analyse, naming the key to change and what the model has."""
    prunable = Counter(p.kind for p in params if p.prunable)
    has = ", ".join(f"{prunable[kind]} {kind}" for kind in UNIT_KINDS if prunable[kind])
    if not prunable:
        reasons = Counter(p.reason for p in params if p.reason)
        why = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common(3)) or "no conv, Linear or heads"
        return f"This model has no prunable unit ({len(params)} unit(s): {why}); there is nothing to analyse."
    if units is not None and not any(prunable[kind] for kind in kinds):
        which = "that kind" if len(kinds) == 1 else "those kinds"
        return (
            f"{units_key} is {list(units)}, but this model has no prunable unit of {which} (it has {has}); add one of "
            f"its kinds to {units_key} or leave it out."
        )
    return f"{skip_key} leaves out every prunable unit ({len(skipped)} listed; the model has {has}); nothing is left."

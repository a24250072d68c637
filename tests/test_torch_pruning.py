"""Pins the Torch-Pruning surface the package relies on, so that an upgrade that changes it fails here, in CI.

``analysis`` uses more of Torch-Pruning than its documented ``prune()`` API: it reads the dependency graph's
``module2node`` nodes (``type``, ``inputs``, ``outputs``, ``module``, ``pruning_dim``), the op types in
``torch_pruning.ops.OPTYPE``, the items of ``get_pruning_group`` groups (``dep.target.module``, ``dep.handler``,
``dep.target.pruning_dim``, ``idxs``, ``root_idxs``), ``is_out_channel_pruning_fn``, and it builds groups by hand
(``tp.dependency.Group``, ``add_dep``, ``tp.dependency.Dependency``) with the module-level handlers
``tp.prune_linear_out_channels``, ``tp.prune_linear_in_channels`` and ``tp.prune_parameter_out_channels``, which
it applies itself after setting ``handler.__self__.pruning_dim`` (:func:`analysis.structure.physical._handle`). It
passes its own ``BasePruningFunc`` subclasses as ``customized_pruners`` (:mod:`analysis.structure.custom_layers`).

Each test below names the internals it covers and asserts the behaviour the package depends on, on tiny models,
calling Torch-Pruning directly where the package does. The last test runs the package's own wrappers end to end.
The supported version range is in ``pyproject.toml``; run this file against a new Torch-Pruning before widening it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch_pruning as tp
from torch import nn
from torch_pruning import ops

from analysis.engine.batchnorm import affected_batchnorms
from analysis.structure.custom_layers import LayerScalePruner, customized_pruners
from analysis.structure.groups import (
    PASS_THROUGH,
    _raised_in_torch_pruning,
    build_dependency_graph,
    find_prunable,
    is_out_channel_item,
    output_modules,
    removal_group,
)
from analysis.structure.heads import head_layout, heads_group, is_heads_item, prune_heads, remove_heads
from analysis.structure.masking import masked, zeroed_slices
from analysis.structure.physical import _handle, pruned_copy

from tiny_models import tiny_flatten_head, tiny_grouped, tiny_inverted_residual, tiny_resnet

IMAGE = (1, 3, 8, 8)


class _Net(nn.Module):
    """stem conv-BN, a residual pair (``b`` joins the stem by an add), ``c`` concatenated after the stem's channels,
    a 1x1 ``merge`` conv over the concat times a bare per-channel ``scale``, pool, flatten, Linear-ReLU-Linear and a
    softmax (an output op after the last layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.c = nn.Conv2d(8, 4, 3, padding=1)
        self.merge = nn.Conv2d(12, 8, 1)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 8).reshape(1, 8, 1, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.hidden = nn.Linear(8, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(x + self.b(F.relu(self.a(x))))
        x = torch.cat([x, self.c(x)], dim=1)
        x = torch.sigmoid(self.merge(x) * self.scale)
        x = torch.flatten(self.pool(x), 1)
        return self.fc(F.relu(self.hidden(x))).softmax(dim=1)


class _Ops(nn.Module):
    """A conv whose output is split, re-concatenated, gated by an expanded SE-style conv, sliced, upsampled by a
    transposed conv and flattened: every channel-carrying op type but unbind."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gate = nn.Conv2d(8, 8, 1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.out = nn.Conv2d(4, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = torch.split(self.conv(x), 4, dim=1)
        y = torch.cat([second, first], dim=1)
        y = y * self.gate(y.mean((2, 3), keepdim=True)).expand_as(y)
        return self.out(self.up(y[:, :, 1:, 1:])).flatten(1).softmax(dim=1)


class _Attention(nn.Module):
    """timm-style attention: ``qkv`` and ``proj`` Linear layers, ``num_heads``, a per-head position bias table."""

    def __init__(self, dim: int = 8, heads: int = 2, tokens: int = 4) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn(tokens * tokens, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.relative_position_bias_table.view(tokens, tokens, -1).permute(2, 0, 1)
        attention = (q @ k.transpose(-2, -1) * (dim // self.num_heads) ** -0.5 + bias).softmax(dim=-1)
        return self.proj((attention @ v).transpose(1, 2).reshape(batch, tokens, dim))


class _Tokens(nn.Module):
    """Token embedding, a residual timm-style attention, a residual ``nn.MultiheadAttention``, mean, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.attn = _Attention()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attn(x)
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return self.head(x.mean(dim=1))


def _trace(model: nn.Module, example: torch.Tensor) -> tp.DependencyGraph:
    """Torch-Pruning's graph of ``model``, built exactly as :func:`build_dependency_graph` builds it."""
    with torch.enable_grad():
        return tp.DependencyGraph().build_dependency(
            model, example_inputs=example, verbose=False, customized_pruners=customized_pruners()
        )


def _item(group: Any, target: object) -> Any:
    """The one item of ``group`` on ``target`` (a module or a bare parameter)."""
    found = [item for item in group if item.dep.target.module is target]
    assert len(found) == 1, (target, len(found))
    return found[0]


def _counterparts(model: nn.Module, clone: nn.Module) -> dict[int, Any]:
    """``id`` of each module and parameter of ``model`` -> the same-named one of its deep copy ``clone``."""
    found: dict[int, Any] = {id(m): clone.get_submodule(n) for n, m in model.named_modules()}
    found.update({id(p): clone.get_parameter(n) for n, p in model.named_parameters()})
    return found


def test_build_dependency_maps_modules_to_nodes_with_their_types_and_edges() -> None:
    """``tp.DependencyGraph().build_dependency(model, example_inputs=, verbose=False)`` returns the graph itself;
    ``graph.model``; ``graph.module2node`` (a dict: module or bare parameter -> ``tp.dependency.Node``);
    ``Node.module``, ``.type`` (``ops.OPTYPE``), ``.inputs`` and ``.outputs``; ``tp.Group`` alias."""
    model = _Net().eval()
    graph = tp.DependencyGraph()
    assert graph.build_dependency(model, example_inputs=torch.randn(IMAGE), verbose=False) is graph
    assert graph.model is model and isinstance(graph.module2node, dict)
    assert tp.Group is tp.dependency.Group and tp.DependencyGraph is tp.dependency.DependencyGraph
    nodes = graph.module2node
    assert all(isinstance(node, tp.dependency.Node) and node.module is key for key, node in nodes.items())
    expected = {
        **{m: ops.OPTYPE.CONV for m in (model.stem, model.a, model.b, model.c, model.merge)},
        model.bn: ops.OPTYPE.BN,
        model.hidden: ops.OPTYPE.LINEAR,
        model.fc: ops.OPTYPE.LINEAR,
        model.scale: ops.OPTYPE.PARAMETER,
    }
    assert {key: nodes[key].type for key in expected} == expected
    assert nodes[model.stem].outputs == [nodes[model.bn]] and nodes[model.bn].inputs == [nodes[model.stem]]
    assert nodes[model.stem].inputs == []  # the graph input is no node
    assert nodes[model.a] in nodes[model.b].inputs[0].inputs  # a -> relu -> b: op nodes in between
    assert model.pool not in nodes  # a layer without a pruner is traced as an op node (its grad_fn), not itself
    depthwise = tiny_inverted_residual().eval()
    assert _trace(depthwise, torch.randn(IMAGE)).module2node[depthwise.block.depthwise[0]].type == (
        ops.OPTYPE.DEPTHWISE_CONV
    )


def test_op_nodes_have_the_pass_through_types_and_the_output_op_ends_the_graph() -> None:
    """``ops.OPTYPE.{ELEMENTWISE,CONCAT,SPLIT,RESHAPE,UNBIND,EXPAND,SLICE,OUTPUT}`` (``groups.PASS_THROUGH``) are
    exactly the types Torch-Pruning gives the op nodes it inserts for tensor operations; the model output is an
    ``OUTPUT`` node without outputs, which :func:`output_modules` walks back from."""
    seen: set[ops.OPTYPE] = set()
    for model, example in ((_Ops().eval(), torch.randn(IMAGE)), (_Tokens().eval(), torch.randn(1, 4, 6))):
        graph = _trace(model, example)
        own = {*model.modules(), *model.parameters()}
        seen |= {node.type for key, node in graph.module2node.items() if key not in own}
    assert seen == PASS_THROUGH
    model = _Ops().eval()
    graph = _trace(model, torch.randn(IMAGE))
    sinks = [node for node in graph.module2node.values() if not node.outputs]
    assert [node.type for node in sinks] == [ops.OPTYPE.OUTPUT]
    assert [node.type for node in sinks[0].inputs] == [ops.OPTYPE.RESHAPE]  # flatten
    assert output_modules(graph) == {model.out}


def test_pruning_dim_of_bare_parameters_is_their_last_non_singleton_dimension() -> None:
    """``Node.pruning_dim``: the masking, cost and head code slice a bare parameter on it (``pruning_dim % ndim``),
    and a LayerNorm's weight on it; modules keep the default -1."""
    model = _Net().eval()
    nodes = _trace(model, torch.randn(IMAGE)).module2node
    assert nodes[model.scale].pruning_dim == 1  # shape (1, 8, 1, 1): the channel dimension
    assert nodes[model.stem].pruning_dim == nodes[model.hidden].pruning_dim == -1
    tokens = _Tokens().eval()
    table = tokens.attn.relative_position_bias_table
    assert _trace(tokens, torch.randn(1, 4, 6)).module2node[table].pruning_dim == table.dim() - 1  # one per head
    norm_model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).eval()
    norm = _trace(norm_model, torch.randn(2, 6)).module2node[norm_model[1]]
    assert norm.type == ops.OPTYPE.LN and norm.pruning_dim % norm_model[1].weight.dim() == 0


def test_get_pruning_group_of_a_conv_with_a_residual_partner() -> None:
    """``graph.get_pruner_of_module(m).prune_out_channels``, ``graph.get_pruning_group(root, fn, idxs)`` returning a
    ``tp.dependency.Group`` (``_DG``, iteration) whose items have ``.dep.target.module``, ``.dep.handler``, plain
    int ``.idxs`` and ``.root_idxs``; ``graph.is_out_channel_pruning_fn`` sorts them into output and input sides."""
    model = _Net().eval()
    graph = _trace(model, torch.randn(IMAGE))
    handler = graph.get_pruner_of_module(model.stem).prune_out_channels
    assert handler == tp.prune_conv_out_channels
    group = graph.get_pruning_group(model.stem, handler, [1, 3])
    assert isinstance(group, tp.dependency.Group) and group._DG is graph and len(group) == len(list(group))
    assert group[0].dep.target.module is model.stem and group[0].dep.handler == handler
    outputs, inputs = (model.stem, model.bn, model.b), (model.a, model.c, model.merge)
    assert all(graph.is_out_channel_pruning_fn(_item(group, m).dep.handler) for m in outputs)
    assert not any(graph.is_out_channel_pruning_fn(_item(group, m).dep.handler) for m in inputs)
    assert _item(group, model.a).dep.handler == tp.prune_conv_in_channels
    for module in (*outputs, *inputs):
        item = _item(group, module)
        assert list(item.idxs) == list(item.root_idxs) == [1, 3]
        assert all(type(i) is int for i in (*item.idxs, *item.root_idxs))
    assert all(item.dep.target.module not in (model.hidden, model.fc) for item in group)  # past merge: not coupled
    ops_in_group = [item for item in group if item.dep.target.module not in set(model.modules())]
    assert ops_in_group and all(graph.module2node[item.dep.target.module].type in PASS_THROUGH for item in ops_in_group)
    with pytest.raises(ValueError) as error:
        graph.get_pruning_group(nn.Conv2d(3, 3, 1), handler, [0])  # a module the trace never saw
    assert _raised_in_torch_pruning(error.value)  # how build_dependency_graph tells Torch-Pruning's failures apart


def test_group_indices_follow_concatenation_offsets_and_flattening() -> None:
    """``.idxs`` are the member's own channel indices and ``.root_idxs`` the root's channel each one comes from."""
    model = _Net().eval()
    graph = _trace(model, torch.randn(IMAGE))
    group = graph.get_pruning_group(model.c, tp.prune_conv_out_channels, [1, 3])
    merge = _item(group, model.merge)
    assert (list(merge.idxs), list(merge.root_idxs)) == ([9, 11], [1, 3])  # after the stem's 8 channels
    assert not graph.is_out_channel_pruning_fn(merge.dep.handler)
    head = tiny_flatten_head().eval()
    graph = _trace(head, torch.randn(1, 3, 16, 16))
    fc = _item(graph.get_pruning_group(head.conv2, tp.prune_conv_out_channels, [2]), head.fc)
    assert (list(fc.idxs), list(fc.root_idxs)) == (list(range(32, 48)), [2] * 16)  # a 4x4 map per channel
    assert fc.dep.handler == tp.prune_linear_in_channels


def test_out_channel_handlers_of_each_layer_kind() -> None:
    """``is_out_channel_pruning_fn`` on every handler the package meets: BatchNorm, depthwise convs, LayerNorm and
    bare parameters count as output side (their in-channel handler is the same function); a function Torch-Pruning
    does not know (:func:`prune_heads`) is neither side; the module-level ``tp.prune_*`` handlers are the graph's."""
    graph = _trace(_Net().eval(), torch.randn(IMAGE))
    out_side = [tp.prune_conv_out_channels, tp.prune_linear_out_channels, tp.prune_parameter_out_channels]
    out_side += [tp.prune_batchnorm_out_channels, tp.prune_depthwise_conv_out_channels]
    out_side += [tp.prune_layernorm_out_channels, tp.prune_groupnorm_out_channels, tp.prune_prelu_out_channels]
    both = [tp.prune_batchnorm_in_channels, tp.prune_depthwise_conv_in_channels, tp.prune_parameter_in_channels]
    both += [tp.prune_layernorm_in_channels, tp.prune_groupnorm_in_channels, tp.prune_prelu_in_channels]
    assert all(graph.is_out_channel_pruning_fn(fn) for fn in out_side + both)
    in_side = (tp.prune_conv_in_channels, tp.prune_linear_in_channels)
    assert not any(graph.is_out_channel_pruning_fn(fn) for fn in in_side)
    assert not graph.is_out_channel_pruning_fn(prune_heads)
    linear, batchnorm = nn.Linear(2, 2), nn.BatchNorm2d(2)
    assert graph.get_pruner_of_module(linear).prune_out_channels == tp.prune_linear_out_channels
    assert graph.get_pruner_of_module(linear).prune_in_channels == tp.prune_linear_in_channels
    assert graph.get_pruner_of_module(batchnorm).prune_out_channels == tp.prune_batchnorm_out_channels
    transposed = graph.get_pruner_of_module(nn.ConvTranspose2d(4, 2, 2))
    assert transposed is not None and transposed.prune_out_channels == tp.prune_conv_out_channels


def test_handlers_applied_as_physical_does_prune_each_layer_kind() -> None:
    """``handler.__self__.pruning_dim = dep.target.pruning_dim`` then ``handler(layer, idxs)`` (what
    ``Dependency.__call__`` does and :func:`_handle` repeats on a copy's layer): modules are pruned in place, a bare
    parameter's handler returns the pruned ``nn.Parameter``; a depthwise member loses in, out channels and groups."""
    model = _Net().eval()
    graph = _trace(model, torch.randn(IMAGE))
    clone = copy.deepcopy(model)
    twin = _counterparts(model, clone)
    group = graph.get_pruning_group(model.merge, tp.prune_conv_out_channels, [1, 3])
    kept = [0, 2, 4, 5, 6, 7]
    scale = _item(group, model.scale)
    assert scale.dep.target.pruning_dim == 1 and scale.dep.handler == tp.prune_parameter_out_channels
    pruned = _handle(scale, twin[id(model.scale)], [1, 3])
    assert isinstance(pruned, nn.Parameter) and torch.equal(pruned, model.scale[:, kept])
    assert torch.equal(scale.dep([1, 3]), pruned)  # Torch-Pruning's own call gives the same
    _handle(_item(group, model.merge), twin[id(model.merge)], [1, 3])
    _handle(_item(group, model.hidden), twin[id(model.hidden)], [1, 3])
    assert clone.merge.out_channels == 6 and torch.equal(clone.merge.weight, model.merge.weight[kept])
    assert torch.equal(clone.merge.bias, model.merge.bias[kept])
    assert clone.hidden.in_features == 6 and torch.equal(clone.hidden.weight, model.hidden.weight[:, kept])
    group = graph.get_pruning_group(model.stem, tp.prune_conv_out_channels, [1, 3])
    _handle(_item(group, model.bn), twin[id(model.bn)], [1, 3])
    assert clone.bn.num_features == 6 and torch.equal(clone.bn.running_var, model.bn.running_var[kept])
    net = tiny_inverted_residual().eval()
    expand, depthwise = net.block.expand[0], net.block.depthwise[0]
    group = _trace(net, torch.randn(IMAGE)).get_pruning_group(expand, tp.prune_conv_out_channels, [0, 5])
    member, layer = _item(group, depthwise), copy.deepcopy(depthwise)
    _handle(member, layer, [0, 5])
    assert (layer.in_channels, layer.out_channels, layer.groups) == (30, 30, 30)
    assert torch.equal(layer.weight, depthwise.weight[[i for i in range(32) if i not in (0, 5)]])
    up = nn.ConvTranspose2d(8, 4, 2)
    weight = up.weight.detach().clone()
    tp.prune_conv_out_channels(up, [1])  # a transposed conv's output channels are its weight's second dimension
    assert up.out_channels == 3 and torch.equal(up.weight, weight[:, [0, 2, 3]])


def test_hand_built_group_of_linear_rows_masks_and_prunes_like_removal() -> None:
    """``tp.dependency.Group()``, ``group._DG``, ``group.add_dep(tp.dependency.Dependency(None, handler, node, node),
    idxs)`` with ``tp.prune_linear_out_channels``/``tp.prune_linear_in_channels``: the items read back as built, and
    the group masks and prunes (handlers applied as :mod:`analysis.structure.physical` applies them) alike."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    example = torch.randn(4, 6)
    graph = _trace(model, example)
    group = tp.dependency.Group()
    group._DG = graph
    first, second = graph.module2node[model[0]], graph.module2node[model[2]]
    group.add_dep(tp.dependency.Dependency(None, tp.prune_linear_out_channels, first, first), [1, 3])
    group.add_dep(tp.dependency.Dependency(None, tp.prune_linear_in_channels, second, second), [1, 3])
    assert [(item.dep.target.module, list(item.idxs)) for item in group] == [(model[0], [1, 3]), (model[2], [1, 3])]
    assert [is_out_channel_item(graph, item) for item in group] == [True, False]
    assert [item.dep.target.pruning_dim for item in group] == [-1, -1]
    clone = copy.deepcopy(model)
    for item, layer in zip(group, (clone[0], clone[2]), strict=True):
        _handle(item, layer, list(item.idxs))
    assert (clone[0].out_features, clone[2].in_features) == (6, 6)
    with torch.inference_mode():
        pruned = clone(example)
    with masked(graph, group), torch.inference_mode():
        assert torch.allclose(model(example), pruned, atol=1e-6)
    reference = graph.get_pruning_group(model[0], tp.prune_linear_out_channels, [1, 3])
    assert _item(reference, model[2]).dep.handler == tp.prune_linear_in_channels  # what the hand-built group mirrors


def test_heads_groups_are_built_from_graph_nodes_and_prune_like_remove_heads() -> None:
    """:func:`heads_group`'s hand-built items (``tp.prune_linear_out_channels`` on ``qkv``,
    ``tp.prune_linear_in_channels`` on ``proj``, ``tp.prune_parameter_out_channels`` on a per-head table at its
    node's ``pruning_dim``) cut what :func:`remove_heads` cuts; ``nn.MultiheadAttention`` is one customised node (its
    stream pruner, :mod:`analysis.structure.attention_stream`), not Torch-Pruning's ``MHA`` node."""
    model = _Tokens().eval()
    example = torch.randn(1, 4, 6)
    graph = build_dependency_graph(model, example)
    attention = model.attn
    layout = head_layout(attention)
    assert layout is not None
    group = heads_group(graph, attention, [1])
    table = attention.relative_position_bias_table
    assert [item.dep.target.module for item in group] == [attention.qkv, attention.proj, table]
    assert [is_out_channel_item(graph, item) for item in group] == [True, False, True]
    assert [list(item.idxs) for item in group] == [layout.qkv_rows([1]), layout.channels([1]), [1]]
    clone, removed = copy.deepcopy(model), copy.deepcopy(model)
    remove_heads(removed, "attn", [1])
    _handle(group[0], clone.attn.qkv, list(group[0].idxs))
    _handle(group[1], clone.attn.proj, list(group[1].idxs))
    new_table = _handle(group[2], clone.attn.relative_position_bias_table, list(group[2].idxs))
    assert torch.equal(clone.attn.qkv.weight, removed.attn.qkv.weight)
    assert torch.equal(clone.attn.qkv.bias, removed.attn.qkv.bias)
    assert torch.equal(clone.attn.proj.weight, removed.attn.proj.weight)
    assert torch.equal(new_table, removed.attn.relative_position_bias_table)
    assert graph.module2node[model.mha].type == ops.OPTYPE.CUSTOMIZED
    (item,) = heads_group(graph, model.mha, [0])
    assert is_heads_item(item) and item.dep.target.module is model.mha and not is_out_channel_item(graph, item)
    assert list(item.idxs) == [0, 1, 2, 3]
    assert len(zeroed_slices(graph, heads_group(graph, model.mha, [0]))) == 3  # q/k/v rows, their bias, out columns


def test_grouped_conv_members_give_local_and_root_indices() -> None:
    """A grouped conv consuming the root's channels is an input-side item whose ``.idxs`` and ``.root_idxs`` cover
    every channel (what :func:`analysis.structure.groups._conv_blocks` partitions into conv groups)."""
    model = tiny_grouped().eval()
    graph = _trace(model, torch.randn(IMAGE))
    group = graph.get_pruning_group(model.reduce, tp.prune_conv_out_channels, list(range(16)))
    item = _item(group, model.grouped[0])
    assert not graph.is_out_channel_pruning_fn(item.dep.handler)
    assert list(item.idxs) == list(item.root_idxs) == list(range(16))


class _StoredShapeScale(nn.Module):
    """timm's metaformer.Scale: a per-channel parameter reshaped with a shape stored at construction."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.shape = (dim, 1, 1)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(self.shape)


def test_customized_pruners_make_a_layer_one_node_with_coupled_inputs_and_outputs() -> None:
    """``build_dependency(customized_pruners={class: pruner})`` with a ``tp.pruner.function.BasePruningFunc``
    subclass (:mod:`analysis.structure.custom_layers`): the layer's node has type ``OPTYPE.CUSTOMIZED``, its
    parameter is no unwrapped parameter, ``get_pruner_of_module`` returns the pruner (by the exact class), the group
    holds the layer once because ``prune_in_channels`` is ``prune_out_channels`` (an out-channel handler), and the
    group's handler applied as physical does removes its channels."""
    pruner = LayerScalePruner()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _StoredShapeScale(8), nn.Conv2d(8, 4, 1)).eval()
    with torch.enable_grad():
        graph = tp.DependencyGraph().build_dependency(
            model, example_inputs=torch.randn(IMAGE), verbose=False, customized_pruners={_StoredShapeScale: pruner}
        )
    assert graph.module2node[model[1]].type == ops.OPTYPE.CUSTOMIZED and model[1].scale not in graph.module2node
    assert graph.get_pruner_of_module(model[1]) is pruner
    group = graph.get_pruning_group(model[0], tp.prune_conv_out_channels, [2, 5])
    item = _item(group, model[1])
    assert item.dep.handler == pruner.prune_out_channels and graph.is_out_channel_pruning_fn(item.dep.handler)
    assert list(item.idxs) == [2, 5] and _item(group, model[2]).dep.handler == tp.prune_conv_in_channels
    _handle(item, model[1], [2, 5])
    assert model[1].scale.shape == (6,) and model[1].shape == (6, 1, 1)


def test_package_wrappers_on_the_installed_torch_pruning() -> None:
    """End to end through the package: units and coupling, masking equals physical removal for every unit, and the
    BatchNorm layers whose statistics a removal changes, on a tiny ResNet."""
    model = tiny_resnet().eval()
    example = torch.randn(2, 3, 16, 16)
    params = {p.name: p for p in find_prunable(model, example)}
    assert params["conv1.weight"].coupled_params == ["layer1.conv2.weight"]
    assert params["layer2.conv2.weight"].coupled_params == ["layer2.downsample.0.weight"]
    assert params["conv1.weight"].bn_name == "bn1" and "layer1.bn2 (BatchNorm2d, out)" in params["conv1.weight"].members
    graph = build_dependency_graph(model, example)
    for param in params.values():
        if not param.prunable:
            continue
        channels = [0, param.channels - 1]
        smaller = pruned_copy(model, param.module_name, channels, example)
        with torch.inference_mode():
            pruned = smaller(example)
        group = removal_group(graph, model.get_submodule(param.module_name), channels)
        with masked(graph, group), torch.inference_mode():
            assert torch.allclose(model(example), pruned, atol=1e-5), param.name
    group = removal_group(graph, model.layer1.conv1, [2])  # layer1.conv2 loses an input: every BN after it changes
    later = [model.layer1.bn2, model.layer2.bn1, model.layer2.bn2, model.layer2.downsample[1]]
    assert affected_batchnorms(graph, [group]) == later and model.layer1.bn1 not in later

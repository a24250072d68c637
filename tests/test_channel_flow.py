"""The channel flow (analysis.structure.channel_flow): which channels a removal takes, read off one forward pass.

Each test builds a small model whose coupling is known by construction and checks the flow's answer exactly, so a
wrong mapping, a missed coupling or a missing block fails here before it reaches a group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from analysis.structure.channel_flow import ChannelFlow, UntraceableModel, trace_channel_flow
from analysis.structure.cuts import PieceSizes, register, unregister
from analysis.structure.flops import CostModel, count_cost
from analysis.structure.flow_groups import CoupledGraph, flow_coupling
from analysis.structure.groups import build_dependency_graph, find_prunable, removal_group
from analysis.structure.physical import pruned_copy

IMAGE = (2, 3, 16, 16)


def flow_of(model: nn.Module) -> ChannelFlow:
    return trace_channel_flow(model.eval(), torch.randn(IMAGE))


def sides(flow: ChannelFlow, layer: str, channels: list[int]) -> dict[tuple[str, bool], list[int]]:
    """``(layer, loses outputs) -> indices`` of the coupling of ``channels`` of ``layer``."""
    coupling = flow.members(layer, channels)
    return {(name, side.out): [i for i, _ in side.labels] for name, side in coupling.layers}


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 4, 1)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.a(x)))
        x = x + self.b(x)
        return self.head(self.c(x).mean(dim=(2, 3)))


def test_a_residual_add_couples_its_producers_and_passes_through_batchnorm() -> None:
    assert sides(flow_of(Residual()), "a", [2, 5]) == {
        ("a", True): [2, 5],
        ("bn", True): [2, 5],
        ("b", False): [2, 5],
        ("b", True): [2, 5],
        ("c", False): [2, 5],
    }


class SplitCat(nn.Module):
    """Split 12 channels as [4, 8], a conv per piece, concatenated, then a 1x1 (the MixNet pattern, whose pieces
    Torch-Pruning 1.6.1 hands to the convs in reverse)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 1)
        self.first = nn.Conv2d(4, 4, 1)
        self.second = nn.Conv2d(8, 6, 1)
        self.last = nn.Conv2d(10, 4, 1)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(self.stem(x), [4, 8], dim=1)
        x = torch.cat([self.first(a), self.second(b)], dim=1)
        return self.head(self.last(x).mean(dim=(2, 3)))


def test_split_pieces_and_concat_offsets_are_mapped_exactly() -> None:
    flow = flow_of(SplitCat())
    assert sides(flow, "stem", [1, 9]) == {("stem", True): [1, 9], ("first", False): [1], ("second", False): [5]}
    assert sides(flow, "first", [3]) == {("first", True): [3], ("last", False): [3]}
    assert sides(flow, "second", [0]) == {("second", True): [0], ("last", False): [4]}  # after the 4 of `first`


class Shuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.next = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        b, c, h, w = x.shape
        x = x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)
        return self.head(self.next(x).mean(dim=(2, 3)))


def test_a_channel_shuffle_blocks_the_channels_it_spreads() -> None:
    coupling = flow_of(Shuffle()).members("stem", [1])
    assert coupling.blocked == ["a view that spreads its channels over several dimensions (heads, channel shuffle)"]
    assert flow_of(Shuffle()).members("next", [1]).blocked == []


class Attention(nn.Module):
    """Single-head attention with separate q, k, v projections and an output projection, on tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.q, self.k, self.v = nn.Linear(8, 6), nn.Linear(8, 6), nn.Linear(8, 6)
        self.proj = nn.Linear(6, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        scores = (self.q(x) @ self.k(x).transpose(1, 2)).softmax(dim=-1)
        x = x + self.proj(scores @ self.v(x))
        return self.head(x.mean(dim=1))


def test_attention_scores_block_query_and_key_channels_but_values_flow_to_the_projection() -> None:
    flow = flow_of(Attention())
    assert flow.members("q", [0]).blocked == ["a matrix product that sums over its channels (attention scores)"]
    assert flow.members("k", [0]).blocked == ["a matrix product that sums over its channels (attention scores)"]
    assert sides(flow, "v", [4]) == {("v", True): [4], ("proj", False): [4]}
    stream = sides(flow, "embed", [3])
    assert stream[("proj", True)] == [3] and stream[("q", False)] == [3] and stream[("head", False)] == [3]


class Gated(nn.Module):
    """A scalar gate (one parameter for every channel) and a per-channel layer scale."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.gate = nn.Parameter(torch.tensor([0.7]))
        self.scale = nn.Parameter(torch.rand(8, 1, 1))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x) * self.gate.sigmoid() * self.scale
        return self.head(x.mean(dim=(2, 3)))


def test_a_shared_parameter_couples_nothing_and_a_per_channel_one_is_a_member() -> None:
    coupling = flow_of(Gated()).members("conv", [5])
    assert {name: [i for i, _ in pairs] for name, pairs in coupling.parameters.items()} == {"scale": [5]}
    assert [(name, [i for i, _ in side.labels]) for name, side in coupling.layers] == [("conv", [5]), ("head", [5])]


class Tokens(nn.Module):
    """A class token and a position embedding joined to patch embeddings (the ViT pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 6, 8, stride=8)
        self.token = nn.Parameter(torch.randn(1, 1, 6))
        self.position = nn.Parameter(torch.randn(1, 5, 6))
        self.mlp = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        x = x + self.mlp(x)
        return self.head(x[:, 0])


def test_class_token_and_position_embedding_follow_the_stream_channel() -> None:
    model = Tokens().eval()
    graph = build_dependency_graph(model, torch.randn(IMAGE))
    group = removal_group(graph, model.patch, [2])
    parameters = {graph.names[item.dep.target.module]: (graph.module2node[item.dep.target.module].pruning_dim,
                                                          list(item.idxs))
                  for item in group if isinstance(item.dep.target.module, nn.Parameter)}  # fmt: skip
    assert parameters == {"token": (2, [2]), "position": (2, [2])}


def test_the_model_output_is_blocked() -> None:
    assert flow_of(Residual()).members("head", [0]).blocked == ["the model output"]


class Cumulative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cumsum(self.conv(x), dim=1).mean(dim=(2, 3)))


def test_an_operator_the_flow_does_not_know_blocks_with_its_name() -> None:
    assert flow_of(Cumulative()).members("conv", [0]).blocked == ["the operator cumsum"]


class Halves(nn.Module):
    """CSP's split: ``x.split(self.half)`` with the half derived at build time, both halves used."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 8, 1)
        self.inner = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.expand(x).split(4, dim=1)
        return self.head(torch.cat([first, self.inner(second)], dim=1).mean(dim=(2, 3)))


def test_an_int_split_cuts_right_only_for_channels_of_its_last_piece() -> None:
    flow = flow_of(Halves())
    produced = flow.produced("expand")
    (cut,) = flow.members("expand", [1]).cuts
    assert flow.cuts_right(cut, {flow.group_of(produced[6])})  # split(4) of 7 channels: [4, 3], right
    assert not flow.cuts_right(cut, {flow.group_of(produced[1])})  # [4, 3] again, but the first piece lost one
    units = {u.module_name: u for u in find_prunable(Halves().eval(), torch.randn(IMAGE))}
    assert units["expand"].reason == (
        "its channels pass split in the model's own forward (Halves), which would cut the pruned, narrower tensor "
        "in the wrong place"
    )
    assert units["inner"].prunable


def test_the_flow_s_group_is_used_where_it_follows_every_operator_and_torch_pruning_s_elsewhere() -> None:
    """The split model: the group is built from the flow (no operator nodes) and holds exactly the coupled layers,
    where Torch-Pruning 1.6.1 swaps the pieces. The cumulative sum: the flow is blocked, Torch-Pruning's own group
    (with its operator nodes) comes back."""
    model = SplitCat().eval()
    graph = build_dependency_graph(model, torch.randn(IMAGE))
    coupling = flow_coupling(graph, model.stem, [1, 9])
    assert coupling is not None and not coupling.blocked
    group = removal_group(graph, model.stem, [1, 9])
    found = sorted((graph.names[item.dep.target.module], list(item.idxs), list(item.root_idxs)) for item in group)
    assert found == [("first", [1], [1]), ("second", [5], [9]), ("stem", [1, 9], [1, 9])]
    torch_pruning = graph.get_pruning_group(
        model.stem, graph.get_pruner_of_module(model.stem).prune_out_channels, [1, 9]
    )
    assert ("second", [1]) in [(graph.names.get(i.dep.target.module), list(i.idxs)) for i in torch_pruning]  # swapped

    model = Cumulative().eval()
    graph = build_dependency_graph(model, torch.randn(IMAGE))
    group = removal_group(graph, model.conv, [0])
    assert any(type(item.dep.target.module).__module__.startswith("torch_pruning") for item in group)


def test_padding_before_a_window_view_keeps_the_channels_in_one_dimension() -> None:
    """Swin pads its tokens to whole windows and views them per window: the padded positions carry no channel, so
    the view does not spread channels over several dimensions."""

    class Windows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Conv2d(3, 4, 3, stride=3)
            self.mix = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.pad(self.embed(x).permute(0, 2, 3, 1), (0, 0, 0, 1, 0, 1))  # 5 x 5 tokens padded to 6 x 6
            b, h, w, c = x.shape
            x = x.view(b, h // 2, 2, w // 2, 2, c)
            return self.head(self.mix(x).mean(dim=(1, 2, 3, 4)))

    coupling = flow_of(Windows()).members("embed", [1])
    assert coupling.blocked == [] and [name for name, _ in coupling.layers] == ["embed", "mix"]


class StoredSplit(SplitCat):
    """SplitCat with its split sizes stored on the module (as timm's MixedConv2d keeps ``splits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.splits = [4, 8]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(self.stem(x), self.splits, dim=1)
        x = torch.cat([self.first(a), self.second(b)], dim=1)
        return self.head(self.last(x).mean(dim=(2, 3)))


def test_costs_of_a_group_built_from_the_flow_equal_the_pruned_copy() -> None:
    """The cost model reads a flow-built group as it reads Torch-Pruning's: MACs and parameters of the variant equal
    those counted on the physically pruned copy (the split pieces, the class token and the position embedding), and
    the stored split sizes follow the removal."""
    register(StoredSplit, PieceSizes("splits"))
    try:
        for model, root, channels in ((StoredSplit(), "stem", [1, 9]), (Tokens(), "patch", [0, 4])):
            model.eval()
            x = torch.randn(IMAGE)
            graph = build_dependency_graph(model, x)
            group = removal_group(graph, model.get_submodule(root), channels)
            assert not any(type(i.dep.target.module).__module__.startswith("torch_pruning") for i in group)
            smaller = pruned_copy(model, root, channels, x)
            assert CostModel(model, x).variant(graph, root, channels) == count_cost(smaller, x)
        assert smaller is not None and pruned_copy(StoredSplit().eval(), "stem", [1, 9], x).splits == [3, 7]
    finally:
        unregister(StoredSplit)


class Ghost(nn.Module):
    """GhostNet's module on a residual: a cheap depthwise copy of the primary conv's output concatenated to it, so
    the stream's channel c and c + 4 both come from the primary conv's channel c."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.primary = nn.Conv2d(8, 4, 1)
        self.cheap = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.primary(x)
        x = x + torch.cat([y, self.cheap(y)], dim=1)
        return self.head(x.mean(dim=(2, 3)))


def test_a_root_coupled_to_more_of_its_own_channels_loses_them_all() -> None:
    model = Ghost().eval()
    x = torch.randn(IMAGE)
    graph = build_dependency_graph(model, x)
    group = removal_group(graph, model.stem, [1])
    found = {(graph.names[item.dep.target.module], tuple(item.idxs), tuple(item.root_idxs)) for item in group}
    assert ("stem", (1, 5), (1, 1)) in found and ("primary", (1,), (1,)) in found and ("cheap", (1,), (1,)) in found
    smaller = pruned_copy(model, "stem", [1], x)
    assert smaller.stem.out_channels == 6 and smaller.primary.out_channels == 3
    with torch.inference_mode():
        assert smaller(x).shape == (2, 10)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_model_with_a_torchscript_submodule_has_no_flow_and_keeps_torch_pruning_s_groups() -> None:
    """A scripted submodule's operators never reach the tracer: its layers would be missing from every group, so
    the model gets no flow at all, and Torch-Pruning (which sees them through autograd) builds the groups."""

    class Scripted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 1)
            self.inner = torch.jit.script(nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU()))
            self.head = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.inner(self.stem(x)).mean(dim=(2, 3)))

    model = Scripted().eval()
    with pytest.raises(UntraceableModel, match="inner is a TorchScript module"):
        trace_channel_flow(model, torch.randn(IMAGE))
    graph = build_dependency_graph(model, torch.randn(IMAGE))
    assert isinstance(graph, CoupledGraph) and graph.flow is None


def test_labels_follow_tensor_attributes_that_move_elements() -> None:
    """``x.mT`` moves channels like a transpose; ``x.data`` keeps them: a Linear reached through them still reads the
    conv's channels (were the labels dropped, the Linear would silently leave the group)."""

    class Attributes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 4, stride=4)
            self.mix = nn.Linear(6, 6)
            self.head = nn.Linear(6, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = self.conv(x).flatten(2).mT.data  # (batch, tokens, channels)
            return self.head(self.mix(tokens).mean(dim=1))

    assert sides(flow_of(Attributes()), "conv", [4]) == {("conv", True): [4], ("mix", False): [4]}


class Chunked(nn.Module):
    """``chunk(2)`` of 8 channels, the second half through its own conv: removing one channel of the second half
    cuts right (chunk sizes [4, 3]), removing two does not ([3, 3])."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 4, 1)
        self.second = nn.Conv2d(3, 4, 1)
        self.inner = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.cat([self.first(x), self.second(x)], dim=1).chunk(2, dim=1)
        return self.head(torch.cat([a, self.inner(b)], dim=1).mean(dim=(2, 3)))


def test_a_cut_right_for_one_channel_but_wrong_for_more_leaves_the_unit_out() -> None:
    flow = flow_of(Chunked())
    produced = flow.produced("second")
    (cut,) = flow.members("second", [1]).cuts
    assert flow.cuts_right(cut, {flow.group_of(produced[1])})
    assert not flow.cuts_right(cut, {flow.group_of(produced[1]), flow.group_of(produced[2])})
    units = {u.module_name: u for u in find_prunable(Chunked().eval(), torch.randn(IMAGE))}
    assert "its channels pass chunk in the model's own forward (Chunked)" in (units["second"].reason or "")


def test_a_shared_parameter_first_in_a_product_does_not_hide_the_channels() -> None:
    """``self.scale * x + self.bias`` with scalar parameters (timm HGNetV2's LearnableAffineBlock): the result keeps
    the conv's channels, so its consumer stays in the group (the 2026-11-26 sweep found hgnetv2_b0's stem units
    failing on physical copies, their consumers missing from the group)."""

    class Affine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.scale = nn.Parameter(torch.tensor([1.5]))
            self.bias = nn.Parameter(torch.tensor([0.1]))
            self.next = nn.Conv2d(8, 8, 1)
            self.head = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.scale * self.conv(x) + self.bias
            return self.head(self.next(x).mean(dim=(2, 3)))

    assert sides(flow_of(Affine()), "conv", [3]) == {("conv", True): [3], ("next", False): [3]}

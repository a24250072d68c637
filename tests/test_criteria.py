"""Channel-ranking criteria on hand-computed weights, and which channels a ratio removes (half-to-even rounding,
lowest scores first, ties to the lower index, equal removal per conv-group block)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from analysis.config import CRITERIA as ACCEPTED_CRITERIA
from analysis.structure.criteria import (
    CRITERIA,
    bn_scale,
    channel_scores,
    channels_to_remove,
    geometry_median,
    l1_norm,
    l2_norm,
    select_channels,
)
from analysis.structure.groups import PrunableUnit, build_dependency_graph, find_prunable


def pythagorean_filters() -> torch.Tensor:
    """Three 2x2 filters (shape 3x1x2x2), flattened: f0 = (0, 0, 0, 0), f1 = (-3, 4, 0, 0), f2 = (0, 0, 0, -12).

    l1:  f0 = 0, f1 = 3 + 4 = 7, f2 = 12.
    l2:  f0 = 0, f1 = sqrt(9 + 16) = 5, f2 = 12.
    Pairwise distances: d01 = 5, d02 = 12, d12 = sqrt(9 + 16 + 144) = 13.
    FPGM (sum of distances to the others): f0 = 5 + 12 = 17, f1 = 5 + 13 = 18, f2 = 12 + 13 = 25.
    """
    return torch.tensor(
        [
            [[[0.0, 0.0], [0.0, 0.0]]],
            [[[-3.0, 4.0], [0.0, 0.0]]],
            [[[0.0, 0.0], [0.0, -12.0]]],
        ]
    )


def test_l1_norm_sums_absolute_values_per_filter() -> None:
    assert torch.equal(l1_norm(pythagorean_filters()), torch.tensor([0.0, 7.0, 12.0]))


def test_l2_norm_is_the_euclidean_norm_per_filter() -> None:
    assert torch.equal(l2_norm(pythagorean_filters()), torch.tensor([0.0, 5.0, 12.0]))


def test_geometry_median_sums_distances_to_the_other_filters() -> None:
    scores = geometry_median(pythagorean_filters())
    assert scores.dtype == torch.float32
    assert torch.allclose(scores, torch.tensor([17.0, 18.0, 25.0]), rtol=0, atol=1e-6)


def test_geometry_median_ranks_the_central_filter_lowest_unlike_the_norms() -> None:
    # Four 1x1 filters with one input channel on a line: values 0, 1, 2, 10.
    # Distance sums: f0 = 1 + 2 + 10 = 13, f1 = 1 + 1 + 9 = 11, f2 = 2 + 1 + 8 = 11, f3 = 10 + 9 + 8 = 27.
    weight = torch.tensor([0.0, 1.0, 2.0, 10.0]).reshape(4, 1, 1, 1)
    scores = geometry_median(weight)
    assert torch.allclose(scores, torch.tensor([13.0, 11.0, 11.0, 27.0]), rtol=0, atol=1e-6)
    assert select_channels(scores, 0.25) == [1]  # tie 11 vs 11: lower index
    assert select_channels(l1_norm(weight), 0.25) == [0]


def test_criteria_handle_multi_channel_kernels() -> None:
    # Filter 0: all ones over 2 input channels x 3 x 3 -> l1 = 18, l2 = sqrt(18) = 3 * sqrt(2).
    # Filter 1: one entry 2, rest 0 -> l1 = 2, l2 = 2. FPGM: both sums are the one distance
    # sqrt(17 * 1 + (2 - 1)^2) = sqrt(18).
    weight = torch.zeros(2, 2, 3, 3)
    weight[0] = 1.0
    weight[1, 1, 2, 2] = 2.0
    assert torch.equal(l1_norm(weight), torch.tensor([18.0, 2.0]))
    assert torch.allclose(l2_norm(weight), torch.tensor([3 * math.sqrt(2), 2.0]))
    assert torch.allclose(geometry_median(weight), torch.full((2,), math.sqrt(18)))


def test_bn_scale_is_the_absolute_gamma() -> None:
    gamma = torch.tensor([-2.0, 0.5, 0.0, 3.0, -0.25])
    assert torch.equal(bn_scale(gamma), torch.tensor([2.0, 0.5, 0.0, 3.0, 0.25]))
    assert torch.equal(gamma, torch.tensor([-2.0, 0.5, 0.0, 3.0, -0.25]))  # input untouched


@pytest.mark.parametrize("name", sorted(CRITERIA))
def test_criteria_detach_from_autograd(name: str) -> None:
    weight = torch.randn(4, 3, 3, 3, requires_grad=True)
    tensor = weight[:, 0, 0, 0] if name == "bn_scale" else weight
    scores = CRITERIA[name](tensor)
    assert scores.shape == (4,)
    assert not scores.requires_grad


def ranked_conv() -> tuple[nn.Module, PrunableUnit]:
    """A 1x1 conv with four 2-value filters and its BatchNorm, built so that each criterion removes another channel.

    Filters f0 = (5, 0), f1 = (3, 3), f2 = (4, 5), f3 = (6, 8); BatchNorm gammas (1, 2, -1.5, 0.5).
    l1: 5, 6, 9, 14 (lowest f0). l2: 5, sqrt(18), sqrt(41), 10 (lowest f1).
    FPGM, with d01 = sqrt(13), d02 = sqrt(26), d03 = sqrt(65), d12 = sqrt(5), d13 = sqrt(34), d23 = sqrt(13):
    f0 = 16.77, f1 = 11.67, f2 = 10.94, f3 = 17.50 (lowest f2). bn_scale: 1, 2, 1.5, 0.5 (lowest f3).
    """
    model = nn.Sequential(nn.Conv2d(2, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 1)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[5.0, 0.0], [3.0, 3.0], [4.0, 5.0], [6.0, 8.0]]).view(4, 2, 1, 1))
        model[1].weight.copy_(torch.tensor([1.0, 2.0, -1.5, 0.5]))
    (param,) = [p for p in find_prunable(model, torch.randn(1, 2, 4, 4)) if p.prunable]
    return model, param


root = math.sqrt
RANKED_CONV = {  # criterion -> (scores of f0..f3, the channel a ratio of 0.25 removes)
    "l1_norm": ([5.0, 6.0, 9.0, 14.0], 0),
    "l2_norm": ([5.0, root(18), root(41), 10.0], 1),
    "geometry_median": ([root(13) + root(26) + root(65), root(13) + root(5) + root(34),
                         root(26) + root(5) + root(13), root(65) + root(34) + root(13)], 2),
    "bn_scale": ([1.0, 2.0, 1.5, 0.5], 3),
}  # fmt: skip


def test_every_criterion_the_config_accepts_is_registered() -> None:
    assert sorted(CRITERIA) == sorted(ACCEPTED_CRITERIA) == sorted(RANKED_CONV)


@pytest.mark.parametrize("name", sorted(RANKED_CONV))
def test_each_registered_criterion_ranks_channels_by_its_definition(name: str) -> None:
    """By name, as a config selects it: the conv's scores under the criterion, and the channel a quarter removes."""
    model, param = ranked_conv()
    graph = build_dependency_graph(model, torch.randn(1, 2, 4, 4))
    expected, lowest = RANKED_CONV[name]
    scores = channel_scores(model, graph, param, name)
    assert torch.allclose(scores, torch.tensor(expected), rtol=0, atol=1e-5), scores
    assert select_channels(scores, 0.25) == [lowest]


@pytest.mark.parametrize(
    ("channels", "ratio", "expected"),
    [
        (10, 0.25, 2),  # 2.5 -> 2 (half to even)
        (10, 0.35, 4),  # 3.5 -> 4 (half to even)
        (6, 0.25, 2),  # 1.5 -> 2
        (18, 0.25, 4),  # 4.5 -> 4
        (14, 0.25, 4),  # 3.5 -> 4
        (10, 0.05, 0),  # 0.5 -> 0
        (8, 0.3, 2),  # 2.4 -> 2
        (8, 0.4, 3),  # 3.2 -> 3
        (4, 0.99, 3),  # 3.96 -> 4, but one channel always stays: min(3, 4)
        (4, 1.0, 3),  # 4 -> min(3, 4)
        (2, 0.5, 1),  # 1.0 -> 1
        (1, 0.5, 0),  # 0.5 -> 0, and min(0, 0)
        (64, 0.0, 0),
    ],
)
def test_channels_to_remove_rounds_half_to_even_and_keeps_one(channels: int, ratio: float, expected: int) -> None:
    assert channels_to_remove(channels, ratio) == expected


def test_select_channels_takes_the_lowest_scores_with_ties_to_the_lower_index() -> None:
    scores = torch.tensor([5.0, 1.0, 3.0, 1.0, 0.0, 2.0])
    assert select_channels(scores, 0.5) == [1, 3, 4]  # n = 3: 0.0 (4), then the tie 1.0 (1, 3)
    assert select_channels(scores, 1 / 3) == [1, 4]  # n = 2: 0.0 (4), then 1.0 at 1 beats 1.0 at 3
    assert select_channels(scores, 0.1) == [4]  # n = round(0.6) = 1
    assert select_channels(scores, 0.05) == []  # n = round(0.3) = 0
    assert select_channels(torch.full((5,), 2.0), 0.4) == [0, 1]


def test_select_channels_returns_sorted_python_ints() -> None:
    chosen = select_channels(torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64), 0.5)
    assert chosen == [3, 4, 5]
    assert all(type(c) is int for c in chosen)


def test_select_channels_always_leaves_one_channel() -> None:
    assert select_channels(torch.tensor([3.0, 1.0, 2.0, 0.5]), 0.99) == [1, 2, 3]


def test_select_channels_with_blocks_removes_equally_from_each_block() -> None:
    # The four globally lowest scores are all in block 0, but each block must give up 8 * 0.5 / 2 = 2 channels:
    # block 0 its 0.0 and 1.0 (channels 0, 1); block 1 its 9.0 (channel 6) and 10.0 (channel 4).
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 9.0, 12.0])
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert select_channels(scores, 0.5) == [0, 1, 2, 3]
    assert select_channels(scores, 0.5, blocks) == [0, 1, 4, 6]


def test_select_channels_with_blocks_rounds_down_to_a_multiple_of_the_block_count() -> None:
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 9.0, 12.0])
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert select_channels(scores, 0.4, blocks) == [0, 6]  # round(3.2) = 3 -> 1 per block
    assert select_channels(scores, 0.1, blocks) == []  # round(0.8) = 1 -> 0 per block
    three = [[0, 1], [2, 3], [4, 5]]
    assert select_channels(torch.tensor([1.0, 0.0, 5.0, 5.0, 2.0, 3.0]), 0.5, three) == [1, 2, 4]  # 3 -> 1 each


def test_select_channels_with_interleaved_blocks_maps_back_to_channel_indices() -> None:
    # Block 0 = even channels with scores 4, 3, 2, 1 -> lowest is channel 6; block 1 = odd channels with scores
    # 0, 7, 7, 5 -> lowest is channel 1. Ratio 0.25 of 8 = 2 -> 1 per block.
    scores = torch.tensor([4.0, 0.0, 3.0, 7.0, 2.0, 7.0, 1.0, 5.0])
    assert select_channels(scores, 0.25, [[0, 2, 4, 6], [1, 3, 5, 7]]) == [1, 6]
    # Ratio 0.75 -> 6 -> 3 per block: block 0 gives 6, 4, 2; block 1 gives 1 (0.0), 7 (5.0) and then the tie 7.0
    # at channels 3 and 5 goes to the lower index, 3.
    assert select_channels(scores, 0.75, [[0, 2, 4, 6], [1, 3, 5, 7]]) == [1, 2, 3, 4, 6, 7]


class _AddedLinears(nn.Module):
    """Two Linear layers whose outputs are added: their neurons are one coupled group."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x) + self.fc2(x)))


def test_mean_group_reduction_averages_the_out_channel_members_of_the_group() -> None:
    from tiny_models import tiny_resnet

    torch.manual_seed(0)
    model = tiny_resnet().eval()
    with torch.no_grad():
        for layer in (model.bn1, model.layer1.bn2):
            layer.weight.copy_(torch.randn(8))
    example = torch.randn(1, 3, 16, 16)
    graph = build_dependency_graph(model, example)
    conv1 = next(p for p in find_prunable(model, example) if p.name == "conv1.weight")
    partner = model.layer1.conv2.weight  # joined to conv1 by the residual add; consumers' input slices do not count
    expected_l1 = (l1_norm(model.conv1.weight) + l1_norm(partner)) / 2
    assert torch.allclose(channel_scores(model, graph, conv1, "l1_norm", "mean"), expected_l1)
    expected_bn = (model.bn1.weight.abs() + model.layer1.bn2.weight.abs()) / 2
    assert torch.allclose(channel_scores(model, graph, conv1, "bn_scale", "mean"), expected_bn)
    assert torch.equal(channel_scores(model, graph, conv1, "l1_norm"), l1_norm(model.conv1.weight))  # default: self

    linears = _AddedLinears().eval()
    example = torch.randn(1, 4)
    graph = build_dependency_graph(linears, example)
    fc1 = next(p for p in find_prunable(linears, example) if p.name == "fc1.weight")
    expected = (l1_norm(linears.fc1.weight) + l1_norm(linears.fc2.weight)) / 2
    assert torch.allclose(channel_scores(linears, graph, fc1, "l1_norm", "mean"), expected)


def test_bn_scale_without_a_batchnorm_says_so() -> None:
    linears = _AddedLinears().eval()
    example = torch.randn(1, 4)
    graph = build_dependency_graph(linears, example)
    fc1 = next(p for p in find_prunable(linears, example) if p.name == "fc1.weight")
    with pytest.raises(ValueError, match=r"^fc1\.weight has no BatchNorm after it$"):
        channel_scores(linears, graph, fc1, "bn_scale")
    with pytest.raises(ValueError, match=r"^fc1\.weight: some channels have no bn_scale score in the group$"):
        channel_scores(linears, graph, fc1, "bn_scale", "mean")


def test_ties_go_to_the_lower_index_also_in_long_and_blocked_rankings() -> None:
    # argsort without stable=True reorders ties once there are about 100 of them
    scores = torch.zeros(300)
    scores[::3] = 1.0  # 200 tied zeros
    assert select_channels(scores, 0.3) == [i for i in range(300) if i % 3][:90]
    blocks = [list(range(0, 300, 2)), list(range(1, 300, 2))]  # interleaved, 150 channels each
    chosen = select_channels(scores, 0.3, blocks)
    assert chosen == sorted([c for c in blocks[0] if c % 3][:45] + [c for c in blocks[1] if c % 3][:45])

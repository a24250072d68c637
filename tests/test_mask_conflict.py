"""NNI 2.x's fix_mask_conflict: coupled masks merged by intersection or union, unmasked members, depthwise and
grouped convs, masks from a file and refused input."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis.compat.mask_conflict import fix_mask_conflict
from analysis.compat.topology import ChannelDependency
from analysis.errors import ConfigError, UserError

from tiny_models import ResidualNet, tiny_grouped, tiny_inverted_residual

TINY_IMAGE = (1, 3, 16, 16)


REMOVED = {"stem": {0, 1, 6}, "a": {7}, "b": {0, 1, 2}, "e": {3, 4, 5, 9}, "down": {4, 5, 9, 10}}
COUPLED = [("stem", "b"), ("e", "down")]


def filter_mask(module: nn.Module, removed: set[int]) -> torch.Tensor:
    keep = torch.tensor([c not in removed for c in range(module.weight.shape[0])], dtype=torch.float32)
    return keep.view(-1, *[1] * (module.weight.dim() - 1)).expand_as(module.weight).clone()


def make_masks(model: nn.Module, removed: dict[str, set[int]]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {"weight": filter_mask(model.get_submodule(name), channels)} for name, channels in removed.items()}


def removed_channels(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(~mask.flatten(1).ne(0).any(1)).flatten().tolist())


def assert_filter_mask(mask: torch.Tensor, removed: set[int]) -> None:
    """Whole filters: all zeros on removed channels, all ones elsewhere."""
    for channel in range(mask.shape[0]):
        assert bool((mask[channel] == (0 if channel in removed else 1)).all()), channel


@pytest.mark.parametrize("mode", ["intersection", "union"])
def test_fix_mask_conflict_merges_coupled_masks(mode: str) -> None:
    model = ResidualNet().eval()
    masks = make_masks(model, REMOVED)
    masks["b"]["weight"][3, 0, 0, 0] = 0  # fine-grained zero inside a kept filter
    masks["bn"] = {"weight": torch.tensor([1.0, 0, 1, 1, 1, 1, 1, 1])}  # a module in no set
    masks["e"]["bias"] = None  # NNI's "no bias mask", on a conv without bias
    fixed = fix_mask_conflict(masks, model, torch.randn(TINY_IMAGE), mode=mode)
    merge = set.intersection if mode == "intersection" else set.union
    for pair in COUPLED:
        expected = merge(*(REMOVED[name] for name in pair))
        for name in pair:
            assert_filter_mask(fixed[name]["weight"], expected)
    expected_stem = merge(REMOVED["stem"], REMOVED["b"])
    assert fixed["stem"]["bias"].tolist() == [float(c not in expected_stem) for c in range(8)]  # added: has a bias
    assert "bias" not in fixed["down"] and fixed["e"]["bias"] is None  # no bias, none written
    assert torch.equal(fixed["a"]["weight"], masks["a"]["weight"])  # singleton set: unchanged
    assert torch.equal(fixed["bn"]["weight"], masks["bn"]["weight"])
    assert set(fixed) == set(masks)


def test_unmasked_member_vetoes_in_intersection_and_follows_in_union() -> None:
    model = ResidualNet().eval()
    masks = make_masks(model, {"b": REMOVED["b"]})
    masks["b"]["bias"] = None  # NNI writes None for "no bias mask"
    x = torch.randn(TINY_IMAGE)
    kept = fix_mask_conflict(masks, model, x)
    assert "stem" not in kept  # the unmasked stem keeps all its channels, so b keeps them too
    assert_filter_mask(kept["b"]["weight"], set())
    assert kept["b"]["bias"].tolist() == [1.0] * 8
    merged = fix_mask_conflict(masks, model, x, mode="union")
    assert_filter_mask(merged["stem"]["weight"], REMOVED["b"])  # added, so the coupled layers agree
    assert merged["stem"]["bias"].tolist() == [float(c not in REMOVED["b"]) for c in range(8)]
    assert_filter_mask(merged["b"]["weight"], REMOVED["b"])


class ResidualMLP(nn.Module):
    """Linear layers only: the first and the third are coupled by the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.head = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.l1(x)
        return self.head(torch.relu(x + self.l3(torch.relu(self.l2(x)))))


@pytest.mark.parametrize("mode", ["intersection", "union"])
def test_linear_layers_are_coupled_like_convs(mode: str) -> None:
    model = ResidualMLP().eval()
    x = torch.randn(2, 6)
    assert ChannelDependency(model, x).sets_in_order == [["l1", "l3"], ["l2"], ["head"]]
    removed = {"l1": {1, 2}, "l3": {2, 5}}
    masks = {name: {"weight": filter_mask(model.get_submodule(name), channels)} for name, channels in removed.items()}
    fixed = fix_mask_conflict(masks, model, x, mode=mode)
    expected = removed["l1"] & removed["l3"] if mode == "intersection" else removed["l1"] | removed["l3"]
    for name in removed:
        assert_filter_mask(fixed[name]["weight"], expected)
        assert fixed[name]["bias"].tolist() == [float(c not in expected) for c in range(8)]


def test_depthwise_conv_follows_its_producer() -> None:
    model = tiny_inverted_residual().eval()
    x = torch.randn(TINY_IMAGE)
    expand, depthwise = "block.expand.0", "block.depthwise.0"
    fixed = fix_mask_conflict(make_masks(model, {expand: {2, 3, 30}}), model, x)
    assert_filter_mask(fixed[expand]["weight"], {2, 3, 30})
    assert fixed[depthwise]["weight"].shape == model.get_submodule(depthwise).weight.shape
    assert_filter_mask(fixed[depthwise]["weight"], {2, 3, 30})  # no mask, no veto: it gets the producer's
    both = fix_mask_conflict(make_masks(model, {expand: {2, 3, 30}, depthwise: {1, 2, 30}}), model, x)
    for name in (expand, depthwise):
        assert_filter_mask(both[name]["weight"], {2, 3, 30} & {1, 2, 30})


def test_grouped_conv_removal_is_evened_out_by_l1_norm() -> None:
    model = tiny_grouped().eval()
    with torch.no_grad():  # filter c of the 1x1 conv feeding the grouped conv gets L1 norm growing with c
        model.reduce.weight.copy_(torch.arange(1.0, 17.0).view(16, 1, 1, 1).expand_as(model.reduce.weight))
    grouped = model.grouped[0]
    per_block = grouped.in_channels // grouped.groups
    removed = {0, 1, 4, 5, 8, 12, 13}
    blocks = [{c for c in removed if c // per_block == b} for b in range(grouped.groups)]
    fewest, most = min(map(len, blocks)), max(map(len, blocks))
    assert fewest < most  # the masks are uneven across the conv groups
    # intersection revives the strongest removed channels, union removes the weakest kept ones
    revived = set().union(*(sorted(block)[:fewest] for block in blocks))
    extended = set().union(
        *(
            block | set(sorted(set(range(b * per_block, (b + 1) * per_block)) - block)[: most - len(block)])
            for b, block in enumerate(blocks)
        )
    )
    x = torch.randn(TINY_IMAGE)
    for mode, expected in (("intersection", revived), ("union", extended)):
        fixed = fix_mask_conflict(make_masks(model, {"reduce": removed}), model, x, mode=mode)
        assert removed_channels(fixed["reduce"]["weight"]) == expected, mode
        assert fixed["reduce"]["bias"].tolist() == [float(c not in expected) for c in range(16)]


def test_union_that_removes_every_channel_is_refused() -> None:
    model = ResidualNet().eval()
    masks = make_masks(model, {"stem": {0, 1, 2, 3}, "b": {4, 5, 6, 7}})
    with pytest.raises(UserError, match="every output channel of 'stem'"):
        fix_mask_conflict(masks, model, torch.randn(TINY_IMAGE), mode="union")


def test_fix_mask_conflict_reads_a_file_and_does_not_mutate(tmp_path: Path) -> None:
    model = ResidualNet().eval()
    masks = make_masks(model, REMOVED)
    before = copy.deepcopy(masks)
    x = torch.randn(TINY_IMAGE)
    fixed = fix_mask_conflict(masks, model, x)
    for name, entry in before.items():
        assert masks[name].keys() == entry.keys()
        assert all(torch.equal(masks[name][key], tensor) for key, tensor in entry.items())
        assert all(fixed[name][key] is not masks[name][key] for key in entry)
    path = tmp_path / "masks.pth"
    torch.save(masks, path)
    for source in (path, str(path)):
        from_file = fix_mask_conflict(source, model, x)
        assert from_file.keys() == fixed.keys()
        assert all(torch.equal(from_file[n][k], fixed[n][k]) for n in fixed for k in fixed[n])


def test_fix_mask_conflict_refuses_bad_input(tmp_path: Path) -> None:
    model = ResidualNet().eval()
    x = torch.randn(TINY_IMAGE)
    masks = make_masks(model, REMOVED)
    with pytest.raises(ConfigError, match=r"'stemm' is not a module.*did you mean 'stem'"):
        fix_mask_conflict({**masks, "stemm": masks["stem"]}, model, x)
    with pytest.raises(ConfigError, match="does not exist"):
        fix_mask_conflict(tmp_path / "missing.pth", model, x)
    with pytest.raises(ConfigError, match="shape"):
        fix_mask_conflict({**masks, "b": {"weight": torch.ones(8, 8, 1, 1)}}, model, x)
    with pytest.raises(ConfigError, match="BatchNorm"):
        fix_mask_conflict({"bn": {"weight": torch.ones(8)}}, model, x)
    input_masks = {"e": {"weight": torch.ones(16, 16, 3, 3)}}
    input_masks["e"]["weight"][:, :8] = 0  # input-channel pruning (NNI's AMC), not filters
    with pytest.raises(ConfigError, match="input channels"):
        fix_mask_conflict(input_masks, model, x)
    with pytest.raises(ValueError, match="intersection"):
        fix_mask_conflict(masks, model, x, mode="majority")

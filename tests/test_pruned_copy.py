"""Pruned copies reuse the model's own dependency graph: one trace per model, the same copy as removing the groups
one at a time on a graph traced anew after each removal, and the dense model left as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torchvision
from torch import nn

import analysis.structure.physical as physical
from analysis.structure.criteria import lowest_channels
from analysis.structure.cuts import PieceSizes, register, unregister
from analysis.structure.groups import PrunableUnit, find_prunable
from analysis.structure.physical import forget_graphs, jointly_pruned_copy, rebuilt_pruned_copy

from tiny_models import tiny_channel_scale, tiny_densenet, tiny_grouped, tiny_inverted_residual, tiny_resnet

Removals = list[tuple[str, list[int]]]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[nn.Module]]:
    """The models :mod:`analysis.structure.physical` traces, in order (starting with no graph kept)."""
    traced: list[nn.Module] = []
    trace = physical.build_dependency_graph

    def counted(model: nn.Module, example: torch.Tensor) -> object:
        traced.append(model)
        return trace(model, example)

    forget_graphs()
    monkeypatch.setattr(physical, "build_dependency_graph", counted)
    yield traced
    forget_graphs()


def plan(model: nn.Module, x: torch.Tensor, groups: int, ratio: float = 0.3, where: str = "") -> Removals:
    """Removals of the first ``groups`` prunable conv/linear units (whose name contains ``where``) that share no
    group, each losing ``ratio`` of its channels, picked from different places in the model (channel choice: seeded
    random scores, evenly across conv groups where the group has grouped convs)."""
    scores = torch.Generator().manual_seed(groups)
    taken: set[str] = set()
    removals: Removals = []
    for unit in find_prunable(model, x):
        if not unit.prunable or unit.kind == "heads" or unit.name in taken or where not in unit.name:
            continue
        taken.update([unit.name, *unit.coupled_params])
        removals.append((unit.module_name, lowest_channels(torch.rand(unit.channels, generator=scores),
                                                           _count(unit, ratio), unit.conv_blocks)))  # fmt: skip
        if len(removals) == groups:
            break
    assert len(removals) == groups, f"{type(model).__name__} has {len(removals)} separate groups"
    return removals


def _count(unit: PrunableUnit, ratio: float) -> int:
    blocks = max(1, len(unit.conv_blocks))
    return max(blocks, round(unit.channels * ratio) // blocks * blocks)


def assert_same_copy(new: nn.Module, old: nn.Module, x: torch.Tensor) -> None:
    """Same parameter names and shapes, same buffers' shapes, and the same logits."""
    assert [(n, p.shape) for n, p in new.named_parameters()] == [(n, p.shape) for n, p in old.named_parameters()]
    assert [(n, b.shape) for n, b in new.named_buffers()] == [(n, b.shape) for n, b in old.named_buffers()]
    with torch.inference_mode():
        torch.testing.assert_close(new(x), old(x), rtol=1e-6, atol=1e-6)


def random_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` in eval mode with random BatchNorm statistics (so that removed channels matter everywhere)."""
    torch.manual_seed(0)
    model = build()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def torchvision_model(name: str) -> Callable[[], nn.Module]:
    return lambda: torchvision.models.get_model(name, weights=None, num_classes=10)


def vit() -> nn.Module:
    """A small torchvision ViT: the stream's channels pass nn.MultiheadAttention (a replacement), the class token
    and the position embedding (bare parameters), and the stored ``hidden_dim``."""
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
                                                mlp_dim=32, num_classes=10)  # fmt: skip


class JointSplit(nn.Module):
    """Two convs concatenated, then split at stored sizes (as timm's MixedConv2d keeps ``splits``): both groups
    pass the one cut, whose sizes must follow what both remove."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(3, 6, 3, padding=1)
        self.splits = [4, 8]
        self.first, self.second = nn.Conv2d(4, 4, 1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = torch.split(torch.cat([self.a(x), self.b(x)], dim=1), self.splits, dim=1)
        return self.head(torch.cat([self.first(p), self.second(q)], dim=1).mean(dim=(2, 3)))


CASES = [
    pytest.param(tiny_resnet, 16, 3, "", id="tiny_resnet"),
    pytest.param(tiny_densenet, 16, 3, "", id="tiny_densenet"),
    pytest.param(tiny_grouped, 16, 2, "", id="tiny_grouped"),
    pytest.param(tiny_inverted_residual, 16, 2, "", id="tiny_inverted_residual"),
    pytest.param(tiny_channel_scale, 16, 1, "", id="tiny_channel_scale"),
    pytest.param(vit, 32, 3, "", id="vit_stream_and_mlp"),
    pytest.param(torchvision_model("resnet18"), 32, 4, "", id="resnet18"),
    pytest.param(torchvision_model("mobilenet_v2"), 32, 4, "", id="mobilenet_v2", marks=pytest.mark.slow),
    pytest.param(torchvision_model("densenet121"), 32, 2, "conv2", id="densenet121", marks=pytest.mark.slow),
    pytest.param(torchvision_model("regnet_x_400mf"), 32, 4, "", id="regnet_x_400mf", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("build", "size", "groups", "where"), CASES)
def test_copy_from_the_models_graph_equals_removal_one_group_at_a_time(
    build: Callable[[], nn.Module], size: int, groups: int, where: str, traces: list[nn.Module]
) -> None:
    """Every group taken from the dense model's graph, each layer side losing the union of its indices once, gives
    the copy that removing the groups one after another on a graph of the partly pruned copy gives: DenseNet's
    concatenations (a consumer touched by several groups), grouped convs' inputs, a bare parameter, the
    MultiheadAttention replacement and ViT's stored width. The model is traced once (the reference traces the
    copy once per group)."""
    model, x = random_model(build), torch.randn(2, 3, size, size)
    removals = plan(model, x, groups, where=where)
    new = jointly_pruned_copy(model, removals, x)
    assert traces == [model]
    assert_same_copy(new, rebuilt_pruned_copy(model, removals, x), x)
    assert sum(p.numel() for p in new.parameters()) < sum(p.numel() for p in model.parameters())


def test_groups_passing_one_cut_set_its_stored_sizes_for_everything_they_remove(traces: list[nn.Module]) -> None:
    """Two groups whose channels pass one split: its stored sizes lose both groups' channels (rewritten for each
    group on its own, the second would put the first's channel back)."""
    register(JointSplit, PieceSizes("splits"))
    try:
        model, x = random_model(JointSplit), torch.randn(2, 3, 8, 8)
        removals = [("a", [1, 5]), ("b", [3])]  # a's 1 in the first piece; a's 5 and b's 3 in the second
        new = jointly_pruned_copy(model, removals, x)
        assert new.splits == [3, 6] and model.splits == [4, 8]
        assert_same_copy(new, rebuilt_pruned_copy(model, removals, x), x)
    finally:
        unregister(JointSplit)


def test_one_trace_for_every_copy_of_a_model_until_its_layout_changes(traces: list[nn.Module]) -> None:
    """Copies with different plans, of several models taking turns, trace each model once; new weight values keep
    the graph (and reach the copy), a replaced layer or another input shape makes a new one."""
    model, other = random_model(tiny_resnet), random_model(tiny_densenet)
    x = torch.randn(2, 3, 16, 16)
    plans = [plan(model, x, 1), plan(model, x, 2), plan(model, x, 3, ratio=0.5)]
    other_plan = plan(other, x, 2)
    for removals in plans:
        jointly_pruned_copy(model, removals, x)
        jointly_pruned_copy(other, other_plan, x)
    assert traces == [model, other]
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    assert_same_copy(jointly_pruned_copy(model, plans[2], x), rebuilt_pruned_copy(model, plans[2], x), x)
    dense = [traced for traced in traces if traced is model or traced is other]  # not the reference's copies
    assert dense == [model, other]
    jointly_pruned_copy(model, plans[0], torch.randn(2, 3, 24, 24))
    model.fc = nn.Linear(model.fc.in_features, 10)
    jointly_pruned_copy(model, plans[0], x)
    assert traces[-2:] == [model, model]


def test_the_dense_model_is_untouched(traces: list[nn.Module]) -> None:
    """Copying leaves the dense model's parameters and buffers, their objects, values and shapes, as they were."""
    model, x = random_model(tiny_densenet), torch.randn(2, 3, 16, 16)
    before = {name: (tensor, tensor.detach().clone()) for name, tensor in model.state_dict(keep_vars=True).items()}
    with torch.inference_mode():
        logits = model(x)
    for groups in (1, 3):
        jointly_pruned_copy(model, plan(model, x, groups), x)
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for name, (tensor, values) in before.items():
        assert after[name] is tensor and torch.equal(tensor, values), name
    with torch.inference_mode():
        assert torch.equal(model(x), logits)


def test_heads_need_no_graph_and_heads_with_channels_remove_one_group_at_a_time(traces: list[nn.Module]) -> None:
    """A plan of heads alone (or of nothing) traces nothing; one that mixes heads and channels falls back to a trace
    of the partly pruned copy per channel removal (the model's graph no longer fits its attention modules once heads
    are gone)."""
    model, x = random_model(vit), torch.randn(2, 3, 32, 32)
    heads = [("encoder.layers.encoder_layer_0.self_attention", [1]), ("encoder.layers.encoder_layer_1.self_attention",
                                                                       [0])]  # fmt: skip
    pruned = jointly_pruned_copy(model, heads, x)
    assert traces == [] and pruned.encoder.layers[0].self_attention.num_heads == 1
    assert_same_copy(jointly_pruned_copy(model, [], x), model, x)
    assert traces == []
    mixed = [*heads, ("conv_proj", [1, 3, 6]), ("encoder.layers.encoder_layer_0.mlp.0", [0, 5])]
    pruned = jointly_pruned_copy(model, mixed, x)
    assert len(traces) == 2 and all(traced is not model for traced in traces)
    assert pruned.conv_proj.out_channels == 13 and pruned.encoder.layers[0].mlp[0].out_features == 30

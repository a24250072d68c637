"""The per-unit fixed work made cheap without changing a result: the mask check's physically pruned copy
(:func:`analysis.structure.physical.checking_copy`) is the copy :func:`pruned_copy` makes, built without a new
Torch-Pruning trace and without copying the tensors the removal leaves alone; the model is never changed by it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn

from analysis.engine._modes import MaskCheck
from analysis.engine.batchnorm import downstream_batchnorms
from analysis.structure import physical
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import build_dependency_graph, find_prunable, full_group
from analysis.structure.physical import _deepcopy, checking_copy, pruned_copy

from helpers import randomize
from tiny_models import (
    tiny_channel_scale,
    tiny_densenet,
    tiny_grouped,
    tiny_inverted_residual,
    tiny_layernorm,
    tiny_resnet,
    tiny_se,
)

RATIO = 0.4
TINY: dict[str, Callable[..., nn.Module]] = {
    "resnet": tiny_resnet,  # residual adds
    "inverted_residual": tiny_inverted_residual,  # depthwise convs
    "densenet": tiny_densenet,  # concatenations
    "squeeze_excitation": tiny_se,
    "grouped": tiny_grouped,  # grouped-conv inputs, removed by our own handler
    "channel_scale": tiny_channel_scale,  # a bare nn.Parameter in the group
    "layernorm": tiny_layernorm,  # LayerNorm over channels
}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def removals(model: nn.Module, x: torch.Tensor) -> list[tuple[str, list[int]]]:
    """Every prunable unit's root with the channels the l1 criterion removes at :data:`RATIO`."""
    found = []
    for param in (p for p in find_prunable(model, x) if p.prunable):
        weight = model.get_submodule(param.module_name).weight
        found.append((param.module_name, select_channels(l1_norm(weight), RATIO, param.conv_blocks)))
    return found


def assert_same_copy(expected: nn.Module, actual: nn.Module, x: torch.Tensor) -> None:
    """Same parameters and buffers bit for bit, same layer sizes, same logits bit for bit."""
    want, got = expected.state_dict(), actual.state_dict()
    assert list(want) == list(got)
    for name in want:
        assert want[name].shape == got[name].shape and torch.equal(want[name], got[name]), name
    for (name, layer), (_, other) in zip(expected.named_modules(), actual.named_modules(), strict=True):
        sizes = ("in_channels", "out_channels", "groups", "num_features", "normalized_shape", "in_features")
        assert [getattr(layer, s, None) for s in sizes] == [getattr(other, s, None) for s in sizes], name
    with torch.inference_mode():
        assert torch.equal(expected(x), actual(x))


@pytest.mark.parametrize("net", sorted(TINY))
def test_checking_copy_is_the_pruned_copy_and_leaves_the_model_alone(net: str) -> None:
    x = torch.randn(2, 3, 16, 16)
    model = randomize(TINY[net](num_classes=10))
    graph = build_dependency_graph(model, x)
    before = state(model)
    units = removals(model, x)
    assert units
    for root, channels in units:
        assert_same_copy(pruned_copy(model, root, channels, x), checking_copy(model, graph, root, channels), x)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("arch", ["mobilenet_v2", "regnet_y_400mf"])
def test_checking_copy_is_the_pruned_copy_on_torchvision_models(arch: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = randomize(torchvision.models.get_model(arch, weights=None, num_classes=10))
    graph = build_dependency_graph(model, x)
    units = removals(model, x)[::7]
    assert len(units) >= 5 and all(channels for _, channels in units)  # every 7th of 35 (69) units, each removes some
    for root, channels in units:
        assert_same_copy(pruned_copy(model, root, channels, x), checking_copy(model, graph, root, channels), x)


def test_checking_copy_reuses_the_graph_and_shares_only_what_removal_leaves_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(2, 3, 16, 16)
    model = randomize(tiny_layernorm(num_classes=10))
    graph = build_dependency_graph(model, x)

    def no_trace(*_: object) -> None:
        raise AssertionError("checking_copy traced the model again")

    monkeypatch.setattr(physical, "build_dependency_graph", no_trace)
    copied = checking_copy(model, graph, "conv1", [0, 3])
    members = {item.dep.target.module for item in full_group(graph, model.conv1)}
    assert {model.conv1, model.norm, model.conv2} <= members
    for name, module in model.named_modules():
        twin = copied.get_submodule(name)
        assert twin is not module  # every module is the copy's own: nothing set on the copy reaches the model
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                assert (getattr(twin, key) is tensor) == (module not in members), f"{name}.{key}"
    assert copied.fc.weight is model.fc.weight  # outside the group: shared
    assert copied.conv2.bias is not model.conv2.bias  # in the group though removal keeps it whole: copied
    assert torch.equal(copied.conv2.bias, model.conv2.bias)
    assert copied.conv1.out_channels == copied.conv2.in_channels == model.conv1.out_channels - 2


def test_modules_the_caller_owns_get_their_own_tensors() -> None:
    x = torch.randn(4, 3, 16, 16)
    model = randomize(tiny_resnet(num_classes=10))
    graph = build_dependency_graph(model, x)
    layers = downstream_batchnorms(graph, [model.conv1])
    assert layers
    before = state(model)
    copied = checking_copy(model, graph, "conv1", [0, 3], own=layers)
    names = {module: name for name, module in model.named_modules()}
    for layer in layers:
        twin = copied.get_submodule(names[layer])
        assert twin.running_mean is not layer.running_mean and twin.weight is not layer.weight
        twin.reset_running_stats()  # what re-estimating them does, in place
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_mask_check_still_falls_back_where_masking_differs_and_is_exact_elsewhere() -> None:
    x = torch.randn(4, 3, 16, 16)
    for factory, expected in ((tiny_layernorm, "physical"), (tiny_resnet, "mask"), (tiny_densenet, "mask")):
        model = randomize(factory(num_classes=10))
        check = MaskCheck(model, build_dependency_graph(model, x), x)
        before = state(model)
        params = [p for p in find_prunable(model, x) if p.prunable]
        assert len(params) >= 2
        if expected == "physical":  # the conv feeding the LayerNorm is among them
            assert "conv1.weight" in [p.name for p in params]
        for param in params:
            channels = select_channels(l1_norm(model.get_submodule(param.module_name).weight), RATIO)
            result = check.choose(param, channels, None)
            pruned = pruned_copy(model, param.module_name, channels, x)
            with torch.inference_mode():
                physical_logits = pruned(x[:4])
            masked_logits = result.masked_logits
            if expected == "mask":
                assert result.mode == "mask", param.name
                assert masked_logits is not None and torch.allclose(masked_logits, physical_logits, atol=1e-5)
            elif param.name == "conv1.weight":  # the conv feeding the LayerNorm
                assert result.mode == "physical" and result.difference > 1e-3
        after = model.state_dict()
        assert all(torch.equal(before[name], after[name]) for name in before)


def test_adaptive_bn_check_leaves_the_model_statistics_alone() -> None:
    x = torch.randn(8, 3, 16, 16)
    model = randomize(tiny_resnet(num_classes=10))
    graph = build_dependency_graph(model, x)
    check = MaskCheck(model, graph, x)
    layers = downstream_batchnorms(graph, [model.conv1])
    before = state(model)
    result = check.choose(next(p for p in find_prunable(model, x) if p.name == "conv1.weight"), [0, 3], layers)
    assert result.mode == "mask"
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


class _Tagged(nn.Module):
    """A module with the odd state deepcopy must copy: a hook, a list attribute, a layer referenced twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.again = self.conv
        self.sizes = [1, 2]
        self.seen: dict[str, int] = {}
        self.register_buffer("scale", torch.ones(4))
        self.conv.register_forward_hook(lambda *_: None)


def test_fast_deepcopy_copies_like_copy_deepcopy() -> None:
    model = nn.Sequential(_Tagged(), nn.BatchNorm2d(4))
    shared = model[1].weight
    fast, slow = _deepcopy(model, {id(shared): shared}), copy.deepcopy(model, {id(shared): shared})
    for made in (fast, slow):
        assert made[1].weight is shared  # the memo decides what is shared
        assert made[0].conv.weight is not model[0].conv.weight
        assert torch.equal(made[0].conv.weight, model[0].conv.weight)
        assert made[0].again is made[0].conv  # aliasing kept
        assert len(made[0].conv._forward_hooks) == 1 and made[0].conv._forward_hooks is not model[0].conv._forward_hooks
        made[0].sizes.append(3)
        made[0].seen["x"] = 1
    assert model[0].sizes == [1, 2] and model[0].seen == {}
    assert [type(m) for m in fast.modules()] == [type(m) for m in slow.modules()]
    assert list(fast.state_dict()) == list(slow.state_dict())

"""Masking a removal group computes exactly what the physically pruned network computes, for every prunable conv
of every architecture we support; it restores the weights bit for bit; and it does *not* match where it cannot
(LayerNorm over channels), which is why the engine falls back to physical pruning there.

BatchNorm is made non-trivial before every comparison: random gamma and beta, and running statistics measured on
the test batch (so BN is far from an identity, yet activations stay of order one through a deep random network).
The torchvision models are compared in float64: pruning a layer of a deep random net can scale the logits up a
hundredfold, and float32 rounding (a different summation order in the smaller convs) would then exceed 1e-5 for
reasons that have nothing to do with masking. In float64 the differences are ~1e-12, so 1e-5 is a sharp test.

Equal logits alone cannot show that the producers are zeroed: once every consumer's input slice is zeroed, the
removed channels' values no longer matter in a BN-ReLU network (and vice versa). So while masked, every
output-channel member of the group (the conv, its BN, residual partners, depthwise convs, BNs after a concat) must
also output exactly zero on the removed channels; and the tiny nets with a sigmoid between producer and consumer
(flatten head, grouped, channel scale) make the logits depend on the consumers' input slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torchvision
from torch import nn

from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import build_dependency_graph, find_prunable, removal_group
from analysis.structure.masking import masked
from analysis.structure.physical import pruned_copy

from tiny_models import (
    tiny_channel_scale,
    tiny_densenet,
    tiny_flatten_head,
    tiny_grouped,
    tiny_inverted_residual,
    tiny_layernorm,
    tiny_resnet,
    tiny_se,
)

ATOL = 1e-5
RATIO = 0.3
BatchNorm = nn.modules.batchnorm._BatchNorm


def make_nontrivial(model: nn.Module, x: torch.Tensor, seed: int = 1) -> nn.Module:
    """Random BN/LayerNorm affine parameters, BN running statistics measured on ``x``, default-initialised linears.

    Only the BN layers run in train mode for the measuring pass (dropout and stochastic depth stay off). Linear
    layers get PyTorch's default init so the logits are of order one whatever the architecture's own init.
    """
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, (BatchNorm, nn.LayerNorm))]
    with torch.no_grad():
        for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
            linear.reset_parameters()
        for norm in norms:
            shape = norm.weight.shape
            norm.weight.copy_(torch.rand(shape, generator=gen) + 0.5)
            norm.bias.copy_(0.2 * torch.randn(shape, generator=gen))
            if isinstance(norm, BatchNorm):
                norm.reset_running_stats()
                norm.momentum = None  # cumulative average: after one pass, exactly the batch statistics
                norm.train()
        model(x)
    for norm in norms:
        if isinstance(norm, BatchNorm):
            norm.momentum = 0.1
            norm.eval()
    return model


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit pattern (so -0.0 != 0.0 and NaN == NaN), for bit-exact comparisons."""
    if tensor.is_floating_point():
        return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    return tensor


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def changed_tensors(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Names of state tensors whose bits differ from ``before``."""
    now = model.state_dict()
    assert now.keys() == before.keys()
    return [name for name, old in before.items() if not torch.equal(bits(now[name]), bits(old))]


@contextmanager
def recorded_outputs(model: nn.Module, graph: Any, group: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Record, during the block, every output-channel member's (conv, Linear or BN) output at the removed channels."""
    names = {module: name for name, module in model.named_modules()}
    records: list[tuple[str, torch.Tensor]] = []
    hooks = []
    for item in group:
        module = item.dep.target.module
        if isinstance(module, (nn.Conv2d, nn.Linear, BatchNorm)) and graph.is_out_channel_pruning_fn(item.dep.handler):
            index = torch.tensor(list(item.idxs), dtype=torch.long)

            def hook(mod: nn.Module, _: object, out: torch.Tensor, index: torch.Tensor = index) -> None:
                records.append((names[mod], out[:, index].detach().clone()))

            hooks.append(module.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in hooks:
            handle.remove()


@dataclass
class Comparison:
    """Outcome of comparing masked and physically pruned logits for every prunable param of one model."""

    checked: list[str] = field(default_factory=list)
    with_blocks: list[str] = field(default_factory=list)
    no_effect: list[str] = field(default_factory=list)  # masking changed nothing visible: a vacuous comparison
    failures: list[str] = field(default_factory=list)


def compare_every_prunable_param(model: nn.Module, x: torch.Tensor, atol: float = ATOL, every: int = 1) -> Comparison:
    """For each prunable conv (or every ``every``-th, in forward order): masked logits == pruned_copy logits, every
    removed channel is exactly zero at its producers while masked, the weights are bit-identical afterwards, and the
    pruned copy really is smaller."""
    result = Comparison()
    graph = build_dependency_graph(model, x)
    before = snapshot(model)
    with torch.no_grad():
        base = model(x)
    base_size = sum(p.numel() for p in model.parameters())
    for param in [p for p in find_prunable(model, x) if p.prunable][::every]:
        name = param.name
        result.checked.append(name)
        if param.conv_blocks:
            result.with_blocks.append(name)
        conv = model.get_submodule(param.module_name)
        idx = select_channels(l1_norm(conv.weight), RATIO, param.conv_blocks)
        if not idx:
            result.failures.append(f"{name}: nothing selected at ratio {RATIO}")
            continue
        group = removal_group(graph, conv, idx)
        with recorded_outputs(model, graph, group) as records, torch.no_grad(), masked(graph, group):
            masked_logits = model(x)
        if not records:
            result.failures.append(f"{name}: no output-channel member ran")
        for member, values in records:
            if torch.count_nonzero(values):
                result.failures.append(f"{name}: group member {member} outputs non-zero removed channels")
        if changed := changed_tensors(model, before):
            result.failures.append(f"{name}: masking did not restore {changed[:3]}")
        pruned = pruned_copy(model, param.module_name, idx, x)
        with torch.no_grad():
            physical_logits = pruned(x)
        diff = (masked_logits - physical_logits).abs().max().item()
        if diff > atol:
            result.failures.append(f"{name}: masked and physically pruned logits differ by {diff:.3g}")
        if (masked_logits - base).abs().max().item() <= 10 * atol:
            result.no_effect.append(name)  # e.g. the removed units are dead ReLUs on this batch
        pruned_unit = pruned.get_submodule(param.module_name)
        width = pruned_unit.out_features if isinstance(pruned_unit, nn.Linear) else pruned_unit.out_channels
        if width != param.channels - len(idx) or len(pruned_unit.weight) != width:
            result.failures.append(f"{name}: pruned unit has {width} channels")
        if sum(p.numel() for p in pruned.parameters()) >= base_size:
            result.failures.append(f"{name}: the pruned copy is not smaller")
        if changed := changed_tensors(model, before):
            result.failures.append(f"{name}: pruned_copy modified the original model: {changed[:3]}")
    return result


class _BiasPReLU(nn.Module):
    """Convs and a hidden Linear with biases, each followed by a PReLU (per channel, or one shared slope): masking
    must zero the biases of removed channels, and leaves every PReLU as it is."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.PReLU(8, init=0.1)
        self.conv2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.PReLU(init=0.2)
        self.conv3, self.act3 = nn.Conv2d(8, 2, 3, padding=1), nn.PReLU(2, init=0.3)
        self.hidden, self.act4 = nn.Linear(2, 6), nn.PReLU(6, init=0.4)  # Linear neurons with a bias
        self.fc = nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act3(self.conv3(self.act2(self.conv2(self.act1(self.conv1(x))))))
        return self.fc(self.act4(self.hidden(x.mean(dim=(2, 3)))))


TINY_NETS: dict[str, tuple[Callable[..., nn.Module], int]] = {
    "resnet": (tiny_resnet, 6),
    "inverted_residual": (tiny_inverted_residual, 4),
    "densenet": (tiny_densenet, 4),
    "squeeze_excitation": (tiny_se, 4),
    "flatten_head": (tiny_flatten_head, 2),
    "grouped": (tiny_grouped, 3),
    "channel_scale": (tiny_channel_scale, 2),
    "bias_prelu": (_BiasPReLU, 4),
}


@pytest.mark.parametrize("net", sorted(TINY_NETS))
def test_masked_equals_physical_for_every_param_of_tiny_nets(net: str) -> None:
    factory, prunable = TINY_NETS[net]
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(factory(num_classes=10), x)
    result = compare_every_prunable_param(model, x)
    assert not result.failures, "\n".join(result.failures)
    assert len(result.checked) == prunable
    assert result.no_effect == []
    if net == "grouped":
        assert result.with_blocks == ["reduce.weight"]


TORCHVISION: dict[str, tuple[int, int, int]] = {  # params checked, of which with grouped-conv blocks; check every n-th
    "resnet18": (20, 0, 1),
    "mobilenet_v2": (35, 0, 1),
    "efficientnet_b0": (33, 0, 2),  # every other one of its 65 convs: time
    "regnet_y_400mf": (69, 32, 1),
    "densenet121": (60, 0, 2),  # every other one of its 120 convs (all dense blocks and transitions): time
}


@pytest.mark.parametrize(
    "arch",
    [
        "resnet18",
        "mobilenet_v2",
        "efficientnet_b0",
        "regnet_y_400mf",
        "densenet121",
    ],
)
def test_masked_equals_physical_for_every_param_of_torchvision_models(arch: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    model = torchvision.models.get_model(arch, weights=None, num_classes=10).double()
    make_nontrivial(model, x)
    checked, with_blocks, every = TORCHVISION[arch]
    result = compare_every_prunable_param(model, x, every=every)
    assert not result.failures, "\n".join(result.failures)
    assert len(result.checked) == checked
    assert len(result.with_blocks) == with_blocks
    assert len(result.no_effect) <= checked // 10, result.no_effect  # nearly every comparison is meaningful


def test_layernorm_over_channels_masking_differs_from_removal() -> None:
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(tiny_layernorm(num_classes=10), x)
    graph = build_dependency_graph(model, x)
    idx = select_channels(l1_norm(model.conv1.weight), RATIO)
    assert len(idx) == 2
    with torch.no_grad(), masked(graph, removal_group(graph, model.conv1, idx)):
        masked_logits = model(x)
    pruned = pruned_copy(model, "conv1", idx, x)
    with torch.no_grad():
        physical_logits = pruned(x)
    assert pruned.conv1.out_channels == 6
    assert pruned.norm.normalized_shape == (6,)
    assert pruned.conv2.in_channels == 6
    assert physical_logits.shape == (2, 10)
    assert torch.isfinite(physical_logits).all()
    # The zeroed channels still count in the LayerNorm's mean and variance: a real difference, not rounding.
    assert (masked_logits - physical_logits).abs().max().item() > 100 * ATOL


def stem_group_slices(idx: list[int]) -> dict[str, tuple[Any, ...]]:
    """By hand: what removing output channels ``idx`` of tiny_resnet's stem zeroes (state-dict name -> index)."""
    out, inp = (idx,), (slice(None), idx)
    return {
        "conv1.weight": out,
        "bn1.weight": out,
        "bn1.bias": out,
        "layer1.conv1.weight": inp,
        "layer1.conv2.weight": out,  # residual partner
        "layer1.bn2.weight": out,
        "layer1.bn2.bias": out,
        "layer2.conv1.weight": inp,
        "layer2.downsample.0.weight": inp,
    }


@pytest.mark.parametrize("body_raises", [False, True], ids=["normal-exit", "body-raises"])
def test_masked_zeroes_exactly_the_group_and_restores_bit_exactly(body_raises: bool) -> None:
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(tiny_resnet(), x)
    idx = [1, 6]
    with torch.no_grad():  # values that a restore by arithmetic (mask multiply, add back) would not reproduce
        model.conv1.weight[1, 0, 0, 0] = -0.0
        model.bn1.bias[6] = float("nan")
        model.layer1.bn2.weight[1] = float("inf")
        model.layer1.conv1.weight[0, 6, 0, 0] = 1e-45  # subnormal
        model.layer2.downsample[0].weight[3, 1, 0, 0] = -1e-40
    before = snapshot(model)
    params = {name: (p, p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()}
    graph = build_dependency_graph(model, x)
    zeroed = stem_group_slices(idx)

    def check_inside() -> None:
        state = model.state_dict()
        for name, old in before.items():
            expected = old.clone()
            if name in zeroed:
                expected[zeroed[name]] = 0
            assert torch.equal(bits(state[name]), bits(expected)), name

    group = removal_group(graph, model.conv1, idx)
    if body_raises:
        with pytest.raises(RuntimeError, match="evaluation failed"), masked(graph, group):
            check_inside()
            raise RuntimeError("evaluation failed")
    else:
        with masked(graph, group):
            check_inside()
    assert changed_tensors(model, before) == []
    for name, p in model.named_parameters():  # restored in place: same Parameter objects, storage and flags
        assert params[name] == (p, p.data_ptr(), p.requires_grad)


def test_nested_masks_sharing_tensors_restore_bit_exactly() -> None:
    # The stem's group zeroes input columns of layer1.conv1, layer1.conv1's own group zeroes rows of it.
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(tiny_resnet(), x)
    before = snapshot(model)
    graph = build_dependency_graph(model, x)
    with masked(graph, removal_group(graph, model.conv1, [0, 3])):
        with masked(graph, removal_group(graph, model.layer1.conv1, [3, 5])):
            weight = model.layer1.conv1.weight
            assert torch.count_nonzero(weight[[3, 5]]) == 0
            assert torch.count_nonzero(weight[:, [0, 3]]) == 0
        assert torch.count_nonzero(model.layer1.conv1.weight[5]) > 0
        assert torch.count_nonzero(model.layer1.conv1.weight[:, 3]) == 0
    assert changed_tensors(model, before) == []


def test_grouped_member_masked_equals_physical_for_every_even_removal() -> None:
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(tiny_grouped(), x)
    graph = build_dependency_graph(model, x)
    for idx in ([1, 4, 9, 12], [0, 3, 5, 6, 8, 9, 14, 15], [0, 1, 2, 4, 5, 7, 9, 10, 11, 12, 13, 15]):
        with torch.no_grad(), masked(graph, removal_group(graph, model.reduce, idx)):
            masked_logits = model(x)
        pruned = pruned_copy(model, "reduce", idx, x)
        with torch.no_grad():
            assert (pruned(x) - masked_logits).abs().max().item() <= ATOL, idx
        # each conv group keeps its own surviving input positions (4 inputs and 8 filters per conv group)
        per_block = len(idx) // 4
        weight = model.grouped[0].weight
        kept = []
        for block in range(4):
            local = [c - 4 * block for c in range(4 * block, 4 * block + 4) if c not in idx]
            assert len(local) == 4 - per_block
            kept.append(weight[8 * block : 8 * block + 8][:, local])
        assert pruned.grouped[0].in_channels == 16 - len(idx)
        assert torch.equal(pruned.grouped[0].weight, torch.cat(kept))
        assert pruned.grouped[0].groups == 4


@pytest.mark.parametrize("idx", [[0, 1], [0, 4], [0, 4, 8, 9]])
def test_uneven_removal_across_conv_groups_is_rejected(idx: list[int]) -> None:
    x = torch.randn(1, 3, 16, 16)
    model = tiny_grouped().eval()
    before = snapshot(model)
    with pytest.raises(ValueError, match="uneven removal across the 4 conv groups"):
        pruned_copy(model, "reduce", idx, x)
    assert changed_tensors(model, before) == []


def test_select_channels_with_the_grouped_convs_blocks() -> None:
    x = torch.randn(1, 3, 16, 16)
    model = tiny_grouped().eval()
    param = next(p for p in find_prunable(model, x) if p.name == "reduce.weight")
    scores = l1_norm(model.reduce.weight)
    idx = select_channels(scores, RATIO, param.conv_blocks)  # round(16 * 0.3) = 5 -> 1 per conv group
    assert len(idx) == 4
    for block in param.conv_blocks:
        chosen = [c for c in idx if c in block]
        assert chosen == [block[int(torch.argmin(scores[block]))]]
    pruned_copy(model, "reduce", idx, x)  # accepted


class DepthwiseMultiplier(nn.Module):
    """A depthwise conv with channel multiplier 2 (groups == in_channels, out_channels == 2 * in_channels); with
    fewer ``groups`` the same conv is a grouped conv with multiplier 2 (each group maps 8 / groups inputs to twice
    as many outputs)."""

    def __init__(self, groups: int = 8) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.depthwise = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, groups=groups), nn.BatchNorm2d(16), nn.ReLU())
        self.project = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.project(self.depthwise(self.expand(x))).mean(dim=(2, 3)))


def test_depthwise_with_channel_multiplier_removes_nothing_it_cannot_remove_evenly() -> None:
    """The multiplier makes the depthwise conv a grouped conv with one input channel per conv group: removal must be
    even across the 8 groups, so no ratio selects a channel of the conv feeding it, and a hand-picked one is refused."""
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(DepthwiseMultiplier(), x)
    param = next(p for p in find_prunable(model, x) if p.name == "expand.0.weight")
    assert param.prunable and param.conv_blocks == [[channel] for channel in range(8)]
    scores = l1_norm(model.expand[0].weight)
    assert [select_channels(scores, ratio, param.conv_blocks) for ratio in (RATIO, 0.5, 0.9)] == [[], [], []]
    before = snapshot(model)
    with pytest.raises(ValueError, match="uneven removal across the 8 conv groups"):
        pruned_copy(model, "expand.0", [0], x)
    assert changed_tensors(model, before) == []


@pytest.mark.parametrize(("groups", "ratio", "removed"), [(4, 0.5, 4), (2, RATIO, 2)])
def test_grouped_conv_with_channel_multiplier_masks_exactly(groups: int, ratio: float, removed: int) -> None:
    x = torch.randn(2, 3, 16, 16)
    model = make_nontrivial(DepthwiseMultiplier(groups), x)
    param = next(p for p in find_prunable(model, x) if p.name == "expand.0.weight")
    idx = select_channels(l1_norm(model.expand[0].weight), ratio, param.conv_blocks)
    assert len(idx) == removed and all(len(set(idx) & set(block)) == removed // groups for block in param.conv_blocks)
    graph = build_dependency_graph(model, x)
    with torch.no_grad(), masked(graph, removal_group(graph, model.expand[0], idx)):
        masked_logits = model(x)
    pruned = pruned_copy(model, "expand.0", idx, x)
    assert pruned.depthwise[0].in_channels == 8 - removed and pruned.depthwise[0].out_channels == 16
    with torch.no_grad():
        assert (pruned(x) - masked_logits).abs().max().item() <= ATOL

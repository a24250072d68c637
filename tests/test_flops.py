"""MACs and params of dense models and of pruned variants: reference values, FlopCounterMode, physical pruning."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from analysis.structure.flops import (
    CONVENTIONS,
    Cost,
    CostModel,
    cost_summary,
    count_cost,
    format_count,
    layer_positions,
)
from analysis.structure.groups import PrunableUnit, build_dependency_graph, describe_units, execution_order
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

SMALL = (1, 3, 64, 64)
TINY = (1, 3, 16, 16)


def torchvision_model(name: str) -> nn.Module:
    return torchvision.models.get_model(name, weights=None, num_classes=10).eval()


def flop_counter_total(model: nn.Module, x: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


def some_channels(param: PrunableUnit, ratio: float) -> list[int]:
    """The first ``ratio`` of the output channels; evenly per conv block when grouped convs are involved."""
    if param.conv_blocks:
        per_block = min(len(b) - 1 for b in param.conv_blocks)
        take = max(1, min(per_block, round(len(param.conv_blocks[0]) * ratio)))
        return sorted(c for block in param.conv_blocks for c in block[:take])
    return list(range(max(1, min(param.channels - 1, round(param.channels * ratio)))))


def pick(params: list[PrunableUnit]) -> list[PrunableUnit]:
    """A handful of prunable params: the first two, one in the middle, the last two, and up to three that reach
    grouped convs."""
    prunable = [p for p in params if p.prunable]
    chosen = prunable[:2] + prunable[len(prunable) // 2 : len(prunable) // 2 + 1] + prunable[-2:]
    chosen += [p for p in prunable if p.conv_blocks][:3]
    return list({p.name: p for p in chosen}.values())


def check_variants(
    model: nn.Module, x: torch.Tensor, params_of: Callable[[list[PrunableUnit]], list], ratios: tuple[float, ...]
) -> None:
    """Assert variant cost == cost of the physically pruned copy for the chosen params and ratios."""
    graph = build_dependency_graph(model, x)
    params = params_of(describe_units(model, graph, execution_order(model, x)))
    costs = CostModel(model, x)
    assert params
    for param in params:
        for ratio in ratios:
            channels = some_channels(param, ratio)
            variant = costs.variant(graph, param.module_name, channels)
            physical = count_cost(pruned_copy(model, param.module_name, channels, x), x)
            assert (variant.macs, variant.params) == (physical.macs, physical.params), (param.name, ratio)
            assert variant.per_module == physical.per_module, (param.name, ratio)
            assert variant.macs < costs.dense.macs and variant.params < costs.dense.params, param.name


# ---- reference values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gmacs", "digits", "mparams"), [("resnet18", 1.814, 3, 11.69), ("resnet50", 4.09, 2, 25.56)]
)
def test_imagenet_reference_values(name: str, gmacs: float, digits: int, mparams: float) -> None:
    model = torchvision.models.get_model(name, weights=None).eval()
    cost = count_cost(model, torch.randn(1, 3, 224, 224))
    assert round(cost.macs / 1e9, digits) == gmacs
    assert round(cost.params / 1e6, 2) == mparams
    assert cost.mode == "macs" and cost.convention == CONVENTIONS["macs"]
    assert sum(cost.per_module.values()) == cost.macs
    assert set(cost.per_module) == {n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


def test_counts_per_sample() -> None:
    model = torchvision_model("resnet18")
    assert count_cost(model, torch.randn(4, *SMALL[1:])) == count_cost(model, torch.randn(SMALL))


# ---- against torch.utils.flop_counter ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "regnet_y_400mf"])
def test_macs_match_flop_counter_dense_and_pruned(name: str) -> None:
    model = torchvision_model(name)
    x = torch.randn(SMALL)
    assert 2 * count_cost(model, x).macs == flop_counter_total(model, x)
    params = describe_units(model, build_dependency_graph(model, x), execution_order(model, x))
    param = next(p for p in params if p.prunable and (p.conv_blocks or name != "regnet_y_400mf"))
    pruned = pruned_copy(model, param.module_name, some_channels(param, 0.5), x)
    pruned_cost = count_cost(pruned, x)
    assert pruned_cost.macs < count_cost(model, x).macs
    assert 2 * pruned_cost.macs == flop_counter_total(pruned, x)


# ---- variants without copying --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_b0", "regnet_y_400mf"])
def test_variant_equals_physically_pruned_torchvision(name: str) -> None:
    check_variants(torchvision_model(name), torch.randn(SMALL), pick, (0.3, 0.7))


@pytest.mark.parametrize(
    "factory",
    [
        tiny_resnet,
        tiny_inverted_residual,
        tiny_densenet,
        tiny_se,
        tiny_flatten_head,
        tiny_layernorm,
        tiny_grouped,
        tiny_channel_scale,
    ],
)
def test_variant_equals_physically_pruned_tiny(factory: Callable[[], nn.Module]) -> None:
    """Every prunable param of models coupling channels through concat, SE, flatten, LayerNorm, grouped convs and a
    bare ``nn.Parameter``."""
    check_variants(factory().eval(), torch.randn(TINY), lambda ps: [p for p in ps if p.prunable], (0.25, 0.5))


def test_variant_rejects_uneven_grouped_removal() -> None:
    model = tiny_grouped().eval()
    x = torch.randn(TINY)
    graph = build_dependency_graph(model, x)
    with pytest.raises(ValueError, match="uneven"):
        CostModel(model, x).variant(graph, "reduce", [0, 1])  # both in the first conv group of `grouped`


def test_variant_rejects_a_group_of_another_model() -> None:
    model = tiny_resnet().eval()
    x = torch.randn(TINY)
    other = copy.deepcopy(model)
    graph = build_dependency_graph(other, x)
    conv = next(m for m in other.modules() if isinstance(m, nn.Conv2d))
    with pytest.raises(ValueError, match="different model"):
        CostModel(model, x).variant(graph, conv, [0])


def test_cost_model_dense_and_summary() -> None:
    model = torchvision_model("resnet18")
    x = torch.randn(SMALL)
    costs = CostModel(model, x)
    assert costs.dense == count_cost(model, x)
    graph = build_dependency_graph(model, x)
    variant = costs.variant(graph, model.layer1[0].conv1, range(32))
    summary = cost_summary(costs.dense, variant)
    assert summary["macs"] == variant.macs and summary["params"] == variant.params
    assert summary["macs_reduction"] == pytest.approx(1 - variant.macs / costs.dense.macs)
    assert summary["params_reduction"] == pytest.approx(1 - variant.params / costs.dense.params)
    # layer1.0.conv1 loses half its filters, conv2 half its input channels: 2 x 32 x 64 x 9 weights, 16x16 outputs
    removed = 2 * 32 * 64 * 9
    assert costs.dense.params - variant.params == removed + 2 * 32  # plus bn1's weight and bias
    assert costs.dense.macs - variant.macs == removed * 16 * 16
    assert json.loads(json.dumps(summary)) == summary
    assert json.loads(json.dumps(costs.dense.as_dict())) == {
        "convention": CONVENTIONS["macs"],
        "mode": "macs",
        "macs": costs.dense.macs,
        "params": costs.dense.params,
    }
    assert cost_summary(costs.dense, costs.dense)["macs_reduction"] == 0.0


# ---- full mode -------------------------------------------------------------------------------------------------------


class HandBuilt(nn.Module):
    """conv-BN-ReLU, a 1x1 conv with a residual add, max pool, SE-style gate (pool, sigmoid, mul), linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv1(x)))
        y = self.pool(y + self.conv2(y))
        y = y * torch.sigmoid(self.gap(y))
        return self.fc(torch.flatten(self.gap(y), 1))


def test_full_mode_exact_on_hand_built_model() -> None:
    model = HandBuilt()
    x = torch.randn(1, 3, 8, 8)
    maps, pooled = 4 * 8 * 8, 4 * 4 * 4  # elements of the 4x8x8 feature maps and of the 4x4x4 pooled maps
    conv1, conv2, fc = maps * 3 * 9, maps * 4, 5 * 4
    default = count_cost(model, x)
    assert default.macs == conv1 + conv2 + fc
    assert default.per_module == {"conv1": conv1, "conv2": conv2, "fc": fc}
    assert default.params == (4 * 3 * 9 + 4) + 2 * 4 + 4 * 4 + (5 * 4 + 5)
    expected = {
        "conv1": conv1 + maps,  # + bias
        "bn": 2 * maps,
        "relu": maps,
        "conv2": conv2,
        "": maps + 4 + pooled,  # residual add, sigmoid of the 4 pooled values, gating multiply
        "pool": pooled * 2 * 2,
        "gap": 2 * pooled,  # called twice, on 4x4x4 maps: 1 op per input element
        "fc": fc + 5,  # + bias
    }
    full = count_cost(model, x, mode="full")
    assert full.per_module == expected
    assert full.macs == sum(expected.values()) and full.params == default.params
    assert full.uncounted == () and full.convention == CONVENTIONS["full"]


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "densenet121", "regnet_y_400mf"])
def test_full_mode_counts_every_op_of_torchvision_models(name: str) -> None:
    model = torchvision_model(name)
    x = torch.randn(SMALL)
    default, full = count_cost(model, x), count_cost(model, x, mode="full")
    assert full.uncounted == ()
    assert full.macs > default.macs
    positions = layer_positions(model, x)
    for layer, macs in default.per_module.items():  # layers' own ops: their MACs plus one add per output element
        module = model.get_submodule(layer)
        bias = 0 if module.bias is None else positions[layer] * module.weight.shape[0]
        assert full.per_module[layer] == macs + bias, layer


def test_full_mode_reports_uncounted_ops() -> None:
    class CumSum(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cumsum(x, dim=1)

    cost = count_cost(CumSum(), torch.randn(1, 3, 4, 4), mode="full")
    assert cost.uncounted == ("aten.cumsum",) and cost.macs == 0


# ---- bookkeeping ------------------------------------------------------------------------------------------------


def test_shared_layers_and_parameters() -> None:
    """A layer called twice costs twice; a parameter tied between two layers is counted once."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(self.a(x)))

    cost = count_cost(Tied(), torch.randn(2, 6))
    assert cost.per_module == {"a": 2 * 36, "b": 36}
    assert cost.macs == 3 * 36 and cost.params == 36


def test_state_untouched_and_mode_checked() -> None:
    model = tiny_resnet().train()
    next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d)).eval()  # mixed flags must come back as they were
    flags = {name: m.training for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for mode in CONVENTIONS:
        count_cost(model, torch.randn(TINY), mode=mode)
    CostModel(model, torch.randn(TINY))
    assert {name: m.training for name, m in model.named_modules()} == flags
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BN statistics not updated
    with pytest.raises(ValueError, match="unknown cost mode"):
        count_cost(model, torch.randn(TINY), mode="flops")


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (1_814_073_344, "1.814 G"),
        (11_689_512, "11.69 M"),
        (25_557_032, "25.56 M"),
        (999_960, "1.000 M"),
        (123_456, "123.5 K"),
        (1000, "1.000 K"),
        (512, "512"),
        (0, "0"),
    ],
)
def test_format_count(count: int, text: str) -> None:
    assert format_count(count) == text


def test_cost_is_a_frozen_value() -> None:
    cost = Cost(macs=10, params=2)
    with pytest.raises(AttributeError):
        cost.macs = 5  # type: ignore[misc]
    assert math.isclose(cost_summary(Cost(0, 0), cost)["macs_reduction"], 0.0)

"""NNI 2.x's count_flops_params: NNI's ResNet-50 figures, per-sample counts, several inputs, reused layers,
custom ops, full mode and the printed table."""

from __future__ import annotations

import math

import pytest
import torch
import torchvision
from torch import nn

from analysis.compat.counter import count_flops_params
from analysis.structure.flops import count_cost

from tiny_models import ResidualNet, tiny_resnet

TINY_IMAGE = (1, 3, 16, 16)
NNI_KEYS = {"name", "module_type", "weight_shape", "flops", "params", "input_size", "output_size"}


def conv_macs(conv: nn.Conv2d, out_side: int) -> int:
    """Per-sample MACs of a square-output conv from its definition (no bias)."""
    kernel = math.prod(conv.kernel_size)
    return conv.out_channels * out_side * out_side * kernel * conv.in_channels // conv.groups


def test_resnet50_matches_nni_figures() -> None:
    model = torchvision.models.resnet50(weights=None)
    model.train()
    state = torch.get_rng_state()
    flops, params, results = count_flops_params(model, (1, 3, 224, 224), verbose=False)
    assert (flops, params) == (4_089_184_256, 25_503_912)  # NNI's own expected values for ResNet-50
    assert torch.equal(torch.get_rng_state(), state)  # the random input did not touch the global generator
    assert model.training and all(m.training for m in model.modules())
    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert [entry["name"] for entry in results] == layers
    assert all(set(entry) == NNI_KEYS for entry in results)
    assert results[0] == {
        "name": "conv1",
        "module_type": "Conv2d",
        "weight_shape": (64, 3, 7, 7),
        "flops": conv_macs(model.conv1, 112),
        "params": 64 * 3 * 7 * 7,
        "input_size": (1, 3, 224, 224),
        "output_size": (1, 64, 112, 112),
    }
    assert results[-1]["flops"] == 2048 * 1000 and results[-1]["params"] == 2048 * 1000 + 1000


def test_default_mode_is_per_sample_and_takes_tensors() -> None:
    model = ResidualNet().eval()
    x = torch.randn(3, 3, 16, 16)
    flops, params, results = count_flops_params(model, x, verbose=False)
    assert flops == count_cost(model, x).macs
    expected = conv_macs(model.stem, 16) + conv_macs(model.a, 16) + conv_macs(model.b, 16)
    expected += conv_macs(model.d, 8) + conv_macs(model.e, 8) + conv_macs(model.down, 8) + 16 * 10
    assert flops == expected
    assert params == sum(p.numel() for n, m in model.named_modules() if n and n != "bn" for p in m.parameters())
    assert results[0]["input_size"] == (3, 3, 16, 16)
    assert count_flops_params(model, [1, 3, 16, 16], verbose=False)[:2] == (flops, params)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Conv2d(3, 4, 3, padding=1)
        self.right = nn.Conv2d(2, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head((self.left(a) + self.right(b)).mean(dim=(2, 3)))


def test_several_inputs_and_sequence_linear() -> None:
    model = TwoInputs()
    flops, _, results = count_flops_params(model, (torch.randn(1, 3, 8, 8), torch.randn(1, 2, 8, 8)), verbose=False)
    assert flops == conv_macs(model.left, 8) + conv_macs(model.right, 8) + 4 * 3
    assert [entry["input_size"] for entry in results] == [(1, 3, 8, 8), (1, 2, 8, 8), (1, 4)]
    sequence = nn.Sequential(nn.Linear(4, 3))
    assert count_flops_params(sequence, (1, 5, 4), verbose=False)[0] == 5 * 4 * 3  # every row counts
    with pytest.raises(TypeError, match="input size"):
        count_flops_params(sequence, "1x5x4", verbose=False)
    with pytest.raises(ValueError, match="default"):
        count_flops_params(sequence, (1, 5, 4), mode="everything", verbose=False)


class Reused(nn.Module):
    """One conv applied twice: its FLOPs count per call, its parameters once."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.conv(x)))


def test_reused_layer_counts_flops_per_call_and_params_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = Reused()
    flops, params, results = count_flops_params(model, (1, 4, 6, 6))
    assert [entry["name"] for entry in results] == ["conv", "conv"]
    assert flops == 2 * conv_macs(model.conv, 6)
    assert params == 4 * 4 * 9 + 4
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == "#Call"


def test_custom_ops_replace_and_add_types() -> None:
    model = ResidualNet().eval()
    x = torch.randn(TINY_IMAGE)
    flops, params, _ = count_flops_params(model, x, verbose=False)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    conv_total = sum(entry["flops"] for entry in count_flops_params(model, x, verbose=False)[2][:-1])

    replaced, _, results = count_flops_params(model, x, custom_ops={nn.Conv2d: lambda m, i, o: 7}, verbose=False)
    assert replaced == flops - conv_total + 7 * len(convs)
    assert [entry["flops"] for entry in results[:-1]] == [7] * len(convs)

    def batch_norm(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> dict[str, int]:
        return {"flops": 2 * inputs[0][0].numel(), "params": 16}  # NNI's dict-returning style

    added, with_bn, results = count_flops_params(model, x, custom_ops={nn.BatchNorm2d: batch_norm}, verbose=False)
    assert added == flops + 2 * 8 * 16 * 16
    assert with_bn == params + 16
    assert [entry["module_type"] for entry in results].count("BatchNorm2d") == 1


def test_full_mode_is_count_cost_full() -> None:
    model = tiny_resnet().eval()
    x = torch.randn(TINY_IMAGE)
    cost = count_cost(model, x, mode="full")
    flops, params, results = count_flops_params(model, x, verbose=False, mode="full")
    assert (flops, params) == (cost.macs, sum(p.numel() for p in model.parameters()))
    assert flops > count_flops_params(model, x, verbose=False)[0]
    assert sum(entry["flops"] for entry in results) == flops
    assert all(set(entry) == NNI_KEYS for entry in results)
    block = type(model.layer1)
    inside = sum(value for name, value in cost.per_module.items() if name.startswith("layer"))
    custom, _, results = count_flops_params(model, x, custom_ops={block: lambda m, i, o: 5}, verbose=False, mode="full")
    assert custom == flops - inside + 2 * 5  # both blocks replaced, with everything inside them
    assert {entry["name"] for entry in results if entry["name"].startswith("layer")} == {"layer1", "layer2"}


def test_verbose_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    model = ResidualNet().eval()
    flops, params, _ = count_flops_params(model, TINY_IMAGE)
    out = capsys.readouterr().out
    assert f"FLOPs total: {flops}" in out and f"#Params total: {params}" in out
    rows = out.splitlines()
    header = ["Index", "Name", "Type", "Weight", "Shape", "Input", "Size", "Output", "Size", "FLOPs", "#Params"]
    assert rows[0].split() == header
    for name in ("stem", "a", "b", "d", "e", "down", "fc"):
        assert any(row.split()[1] == name for row in rows[2:-2])

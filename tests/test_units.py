"""Units beyond conv filters: Linear neurons, attention heads (timm and nn.MultiheadAttention), Conv1d/Conv3d filters.

Each is checked the way conv filters are: masking equals physical removal, the cost model equals counting the pruned
copy, the fast engine gives the reference engine's bytes, and plans verify and export."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from analysis import analysis_prune
from analysis.config import load_config
from analysis.engine._modes import MaskCheck
from analysis.errors import ConfigError
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.planning.export import export_pruned, layer_shapes, load_pruned
from analysis.planning.plan import plan_from_ratios
from analysis.planning.verify import verify_plan
from analysis.structure.criteria import channel_scores, select_channels
from analysis.structure.flops import CostModel, count_cost
from analysis.structure.groups import PrunableUnit, build_dependency_graph, find_prunable, select_params
from analysis.structure.heads import PrunedMultiheadAttention, head_layout
from analysis.structure.physical import pruned_copy

from helpers import analyse_both, batches, pseudo_labelled, variant_metrics, write_config

timm = pytest.importorskip("timm")

Factory = Callable[[], tuple[nn.Module, torch.Tensor]]


def torchvision_vit(**sizes: int) -> Factory:
    """torchvision's ``vit_b_16`` at 32 px (2 x 2 patches), or its ``VisionTransformer`` class at smaller ``sizes``."""

    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        if sizes:
            model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_classes=10, **sizes)
        else:
            model = torchvision.models.vit_b_16(image_size=32, num_classes=10)
        nn.init.normal_(model.heads.head.weight)  # torchvision starts the classifier at zero: every logit would be 0
        return model.eval(), torch.randn(4, 3, 32, 32)

    return build


def timm_model(name: str, size: int, **kwargs: object) -> Factory:
    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, img_size=size, **kwargs)
        return model.eval(), torch.randn(4, 3, size, size)

    return build


VIT_TINY = timm_model("vit_tiny_patch16_224", 32)
SMALL_VIT = torchvision_vit(num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128)
# timm's Swin-T class with narrower stages (Swin-T itself has 28 M parameters): the same code paths, 4 times faster
SWIN = timm_model("swin_tiny_patch4_window7_224", 56, window_size=7, embed_dim=32, num_heads=(2, 2, 4, 4))
MODELS = {
    "torchvision_vit_b_16": torchvision_vit(),
    "timm_vit_tiny": VIT_TINY,
    "timm_deit_tiny": timm_model("deit_tiny_patch16_224", 32),
    "timm_swin": SWIN,
}


def is_mlp_hidden(param: PrunableUnit) -> bool:
    """The first layer of a transformer MLP (timm ``mlp.fc1``, torchvision ``mlp.0``)."""
    return param.kind == "linear" and param.module_name.endswith(("mlp.fc1", "mlp.0"))


@pytest.mark.parametrize("name", MODELS)
def test_neurons_and_heads_masked_equal_physical(name: str) -> None:
    model, example = MODELS[name]()
    params = find_prunable(model, example)
    heads = [p for p in params if p.kind == "heads"]
    neurons = [p for p in params if is_mlp_hidden(p)]
    attention = [n for n, m in model.named_modules() if head_layout(m) is not None]
    assert [p.module_name for p in heads] == attention and len(heads) == len(neurons) >= 4  # one of each per block
    assert all(p.prunable for p in heads + neurons), [(p.name, p.reason) for p in heads + neurons if p.reason]
    assert all(p.name == f"{p.module_name}.heads" and p.channels == p.shape[0] >= 2 for p in heads)
    graph = build_dependency_graph(model, example)
    check = MaskCheck(model, graph, example)
    with torch.inference_mode():
        dense = model(example)
    chosen = [heads[0], neurons[-1]] if name == "torchvision_vit_b_16" else [heads[0], heads[-1], neurons[0]]
    for param in chosen:
        channels = select_channels(channel_scores(model, graph, param, "l1_norm"), 0.5)
        result = check.choose(param, channels, None)
        assert result.mode == "mask", (param.name, result.difference)  # masking equals the smaller network
        copy = pruned_copy(model, param.module_name, channels, example)
        with torch.inference_mode():
            assert (copy(example) - dense).abs().max() > 1e-3  # and the removal matters
        module = copy.get_submodule(param.module_name)
        if param.kind == "heads":
            assert module.num_heads == param.channels - len(channels) == param.channels // 2
        else:
            assert module.out_features == param.channels - len(channels)


@pytest.mark.parametrize("factory", [SMALL_VIT, SWIN], ids=["torchvision_vit", "timm_swin"])
def test_cost_model_equals_counting_the_pruned_copy(factory: Factory) -> None:
    model, example = factory()
    params = [p for p in find_prunable(model, example) if p.prunable and (p.kind == "heads" or is_mlp_hidden(p))]
    graph = build_dependency_graph(model, example)
    costs = CostModel(model, example)
    assert [p.kind for p in params[:2]] == ["heads", "linear"]  # the loop checks one unit of each kind
    for param in params[:2]:
        channels = list(range(param.channels // 2))
        predicted = costs.variant(graph, param.module_name, channels)
        measured = count_cost(pruned_copy(model, param.module_name, channels, example), example)
        assert (predicted.macs, predicted.params) == (measured.macs, measured.params), param.name
        assert predicted.macs < costs.dense.macs and predicted.params < costs.dense.params


def test_swin_heads_shrink_the_relative_position_table() -> None:
    model, example = SWIN()
    copy = pruned_copy(model, "layers.2.blocks.0.attn", [1], example)
    attention = copy.get_submodule("layers.2.blocks.0.attn")
    original = model.get_submodule("layers.2.blocks.0.attn").relative_position_bias_table
    assert torch.equal(attention.relative_position_bias_table, original[:, [0, 2, 3]])


def test_heads_are_ranked_by_their_weights() -> None:
    model, example = VIT_TINY()
    attention = model.get_submodule("blocks.2.attn")
    with torch.no_grad():
        attention.qkv.weight.view(3, 3, 64, -1)[:, 1] *= 0.01  # head 1 of 3: q, k and v rows nearly zero
    param = next(p for p in find_prunable(model, example) if p.name == "blocks.2.attn.heads")
    scores = channel_scores(model, build_dependency_graph(model, example), param, "l1_norm")
    assert scores.shape == (3,) and int(scores.argmin()) == 1
    assert select_channels(scores, 0.3) == [1]  # round(3 * 0.3) = 1 head
    assert select_channels(scores, 0.99) == [0, 1]  # at least one head stays
    with pytest.raises(ValueError, match="no BatchNorm"):
        channel_scores(model, build_dependency_graph(model, example), param, "bn_scale")


def test_fast_engine_equals_reference_on_a_vit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, example = VIT_TINY()
    data = pseudo_labelled(model, [(example, torch.zeros(4, dtype=torch.long)), (torch.randn(4, 3, 32, 32), None)])
    chosen = ["blocks.0.attn.heads", "blocks.5.mlp.fc1.weight", "blocks.11.attn.heads", "blocks.3.attn.proj.weight"]
    with caplog.at_level(logging.INFO, logger="analysis"):
        reference, fast = analyse_both(model, data, tmp_path, pruned_ratios=(0.3, 0.6), metric="ce",
                                       prune_params=chosen, units=("linear", "heads"))  # fmt: skip
    assert "cannot trace" not in caplog.text  # timm's forward has optional arguments
    assert "blocks.0.attn.heads @ 0.3: removed 1/3 heads" in caplog.text
    assert variant_metrics(fast) == variant_metrics(reference)
    assert set(load_sensitivities(tmp_path / "fast.pkl")) == set(chosen)
    modes = {name: info["mode"] for name, info in fast["params"].items() if name in chosen}
    assert modes["blocks.0.attn.heads"] == modes["blocks.5.mlp.fc1.weight"] == "mask"
    assert modes["blocks.3.attn.proj.weight"] == "physical"  # the residual stream feeds LayerNorms
    assert fast["params"]["blocks.0.attn.heads"]["variants"]["0.3"]["channels_removed"] == 1  # round(3 * 0.3) heads


def test_plan_verify_and_export_on_a_vit(tmp_path: Path) -> None:
    model, example = SMALL_VIT()
    data = pseudo_labelled(model, [(example, None)])
    heads = "encoder.layers.encoder_layer_1.self_attention.heads"
    neurons = "encoder.layers.encoder_layer_3.mlp.0.weight"
    path = tmp_path / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=(0.25, 0.5), prune_params=[heads, neurons],
                   units=("linear", "heads"), progress=False)  # fmt: skip
    plan = plan_from_ratios(model, example, path, {heads: 0.5, neurons: 0.25})
    assert [(g.ranking_param, len(g.removed)) for g in plan.groups] == [(heads, 2), (neurons, 32)]

    def top1(network: nn.Module) -> dict[str, float]:
        with torch.inference_mode():
            return {"top1": float((network(example).argmax(1) == data[0][1]).float().mean())}

    pruned, verification = verify_plan(model, plan, top1, example, top1(model), latency_batches=(1,))
    assert (verification.pruned_cost["macs"], verification.pruned_cost["params"]) == (plan.pruned.macs,
                                                                                        plan.pruned.params)  # fmt: skip
    assert isinstance(pruned.get_submodule(heads.removesuffix(".heads")), PrunedMultiheadAttention)
    export = tmp_path / "export"
    export_pruned(pruned, model, export)
    rebuilt = load_pruned(SMALL_VIT()[0], export)  # from the JSON and the state_dict
    pickled = torch.load(export / "pruned_model.pt", weights_only=False)
    with torch.inference_mode():
        expected = pruned(example)
        assert torch.equal(rebuilt(example), expected) and torch.equal(pickled(example), expected)
    changed = json.loads((export / "pruned_channels.json").read_text())["changed_layers"]
    assert changed[heads.removesuffix(".heads")]["num_heads"] == 2


def test_timm_heads_export_rebuilds_from_the_state_dict(tmp_path: Path) -> None:
    model, example = SWIN()
    pruned = pruned_copy(model, "layers.2.blocks.0.attn", [0, 3], example)
    export_pruned(pruned, model, tmp_path)
    rebuilt = load_pruned(SWIN()[0], tmp_path)
    assert rebuilt.get_submodule("layers.2.blocks.0.attn").num_heads == 2
    with torch.inference_mode():
        assert torch.equal(rebuilt(example), pruned(example))


@pytest.mark.parametrize("batch_first", [False, True])
def test_pruned_multihead_attention_computes_what_torch_does(batch_first: bool) -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    query = torch.randn(5, 3, 16)
    key = torch.randn(7, 3, 16)
    if batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, -2:] = True
    causal = torch.randn(5, 7)
    same = PrunedMultiheadAttention.from_module(module, [])  # no head removed: the same function
    for kwargs in ({}, {"key_padding_mask": padding}, {"attn_mask": causal, "average_attn_weights": False}):
        out, weights = module(query, key, key, **kwargs)
        ours, our_weights = same(query, key, key, **kwargs)
        torch.testing.assert_close(ours, out)
        torch.testing.assert_close(our_weights, weights)
    unbatched = query[0] if batch_first else query[:, 0]
    torch.testing.assert_close(same(unbatched, unbatched, unbatched)[0], module(unbatched, unbatched, unbatched)[0])
    pruned = PrunedMultiheadAttention.from_module(module, [2])
    assert pruned.num_heads == 3 and pruned.in_proj_weight.shape == (36, 16) and pruned.out_proj.in_features == 12


class SequenceAndVolume(nn.Module):
    """A Conv1d stage over a sequence and a Conv3d stage over a volume, each with BatchNorm, then an MLP head."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 6, 3))
        self.vol = nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 6, 1))
        self.hidden = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = self.seq(x.flatten(2)).mean(dim=2)  # (N, 3, H*W) as a sequence
        vol = self.vol(x.unsqueeze(1)).mean(dim=(2, 3, 4))  # (N, 1, 3, H, W) as a volume
        return self.head(torch.relu(self.hidden(torch.cat([seq, vol], dim=1))))


def test_conv1d_conv3d_and_linear_units(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SequenceAndVolume().eval()
    for batchnorm in (model.seq[1], model.vol[1]):
        batchnorm.running_mean.uniform_(-0.5, 0.5)
        batchnorm.running_var.uniform_(0.5, 2.0)
    data = pseudo_labelled(model, batches(count=2, size=4, resolution=6))
    params = {p.name: p for p in find_prunable(model, data[0][0])}
    assert {n: p.kind for n, p in params.items() if p.prunable} == {
        "seq.0.weight": "conv", "seq.3.weight": "conv", "vol.0.weight": "conv", "vol.3.weight": "conv",
        "hidden.weight": "linear",
    }  # fmt: skip
    assert params["head.weight"].reason == "coupled to the model output (head)"
    _, fast = analyse_both(model, data, tmp_path, pruned_ratios=(0.25, 0.5), metric="ce",
                                   units=("conv", "linear"))  # fmt: skip
    assert {info["mode"] for info in fast["params"].values() if "mode" in info} == {"mask"}
    assert len(variant_metrics(fast)) == 2 * 5


def test_units_select_kinds(tmp_path: Path) -> None:
    model, example = VIT_TINY()
    params = find_prunable(model, example)
    assert {p.kind for p in select_params(params, None, units=["heads"])} == {"heads"}
    assert {p.kind for p in select_params(params, None)} == {"conv", "linear", "heads"}  # default: every kind
    with pytest.raises(ConfigError, match=r"'blocks\.0\.attn\.heads' is a heads unit but units is \['conv'\]"):
        select_params(params, ["blocks.0.attn.heads"], units=["conv"], units_key="units")
    qkv = next(p for p in params if p.name == "blocks.0.attn.qkv.weight")
    assert qkv.reason == "its outputs are attention heads: pruned as the unit blocks.0.attn.heads"
    data = tmp_path / "d"
    for value, message in (([], "must list at least one of conv, linear, heads"),
                           (["conv", "neurons"], "units must be one of conv, linear, heads, got 'neurons'"),
                           (["conv", "conv"], "lists a kind twice")):  # fmt: skip
        config = write_config(tmp_path / "c.yaml", {"Global": {"data_dir": str(data), "arch": "resnet18"},
                                                    "SensitivityAnalysis": {"units": value}})  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(config)


def test_sidecar_records_the_kind_of_each_unit(tmp_path: Path) -> None:
    model, example = VIT_TINY()
    data = pseudo_labelled(model, [(example, None)])
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), prune_params=["blocks.1.attn.heads"],
                   units=("heads",), progress=False)  # fmt: skip
    info = load_sidecar(tmp_path / "s.pkl")["params"]["blocks.1.attn.heads"]
    assert info["kind"] == "heads" and info["shape"] == [3, 64]


def test_budget_plan_and_report_over_every_unit_of_a_vit(tmp_path: Path) -> None:
    from analysis.planning.plan import build_plan
    from analysis.reporting.report import write_report
    from analysis.structure.physical import jointly_pruned_copy

    model, example = SMALL_VIT()
    data = pseudo_labelled(model, [(example, None)])
    path = tmp_path / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=(0.25, 0.5), units=("conv", "linear", "heads"), progress=False)
    analysed = load_sensitivities(path)
    assert {n.rpartition(".")[2] for n in analysed} == {"weight", "heads"}
    assert len(analysed) == 13  # 4 MLP hidden layers, 4 heads, the residual stream's conv_proj and 4 MLP outputs
    plan = build_plan(model, example, path, 0.2)
    assert plan.groups and {g.ranking_param for g in plan.groups} <= set(analysed)
    pruned = count_cost(jointly_pruned_copy(model, plan.removals(), example), example)
    assert (pruned.macs, pruned.params) == (plan.pruned.macs, plan.pruned.params)  # the joint cost is exact
    assert 1 - pruned.macs / plan.dense.macs >= 0.2
    files = write_report(path, tmp_path / "report")
    assert "encoder.layers.encoder_layer_0.self_attention.heads" in Path(files.html).read_text()


class GainConv(nn.Conv2d):
    """A conv with a per-filter gain parameter, like timm's ScaledStdConv2d in NFNets."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.gain, self.bias)


def test_per_filter_parameters_of_a_conv_subclass_are_removed_with_the_filters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(GainConv(3, 8, 3, padding=1), nn.ReLU(), GainConv(8, 6, 3), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(6, 4)).eval()  # fmt: skip
    example = torch.randn(2, 3, 8, 8)
    param = next(p for p in find_prunable(model, example) if p.name == "0.weight")
    channels = [1, 4, 6]
    result = MaskCheck(model, build_dependency_graph(model, example), example).choose(param, channels, None)
    assert result.mode == "mask", result.difference  # it used to fail: the gain kept 8 entries for 5 filters
    copy = pruned_copy(model, "0", channels, example)
    assert torch.equal(copy[0].gain, model[0].gain[[0, 2, 3, 5, 7]])
    predicted = CostModel(model, example).variant(build_dependency_graph(model, example), "0", channels)
    measured = count_cost(copy, example)
    assert (predicted.macs, predicted.params) == (measured.macs, measured.params)


def test_export_lists_attention_modules_with_a_customised_pruner_by_heads() -> None:
    """torchvision Swin's attention has a width-only customised pruner (no channel count of its own) and
    nn.MultiheadAttention the stream pruner: the export lists both as attention modules (it raised AttributeError on
    Swin when customised pruners came first)."""
    shapes = layer_shapes(torchvision.models.swin_t(num_classes=10))
    assert shapes["features.1.0.attn"] == {"type": "ShiftedWindowAttention", "num_heads": 3}
    vit, _ = SMALL_VIT()
    assert layer_shapes(vit)["encoder.layers.encoder_layer_0.self_attention"] == {
        "type": "MultiheadAttention",
        "num_heads": 4,
    }

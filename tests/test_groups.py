"""Which conv weights are prunable, in what order, with which coupled channels, and why the others are not."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from analysis.structure.groups import (
    PrunableUnit,
    build_dependency_graph,
    execution_order,
    find_prunable,
    full_group,
    is_depthwise,
    is_grouped_conv,
    output_modules,
    per_channel_extras,
    removal_group,
)

from tiny_models import (
    tiny_densenet,
    tiny_flatten_head,
    tiny_grouped,
    tiny_inverted_residual,
    tiny_resnet,
    tiny_se,
)

IMAGE = (1, 3, 64, 64)
TINY_IMAGE = (1, 3, 16, 16)


def torchvision_model(name: str) -> nn.Module:
    return torchvision.models.get_model(name, weights=None, num_classes=10).eval()


def by_name(params: list[PrunableUnit]) -> dict[str, PrunableUnit]:
    return {p.name: p for p in params}


def item_idxs(graph: object, group: object, module: nn.Module) -> list[list[int]]:
    """The index lists of every group item on ``module`` (a module may appear with an out and an in role)."""
    return [list(item.idxs) for item in group if item.dep.target.module is module]


class FullyConvClassifier(nn.Module):
    """conv-BN-ReLU, then a 1x1 conv producing the 10 class maps, global pool and flatten: the logits layer is a
    conv, so its output channels are the model's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Conv2d(8, 10, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.head(self.body(x))), 1)


class ResidualIntoOutput(nn.Module):
    """The output is ``head(y) + skip(y)``: the skip conv is coupled to the output through the add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.skip = nn.Conv2d(8, 10, 1)
        self.head = nn.Conv2d(8, 10, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        return (self.head(y) + self.skip(y)).mean(dim=(2, 3))


class WithUnusedConv(nn.Module):
    """A conv that is registered (first, even) but never called."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Conv2d(3, 8, 3)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


class SingleChannelConv(nn.Module):
    """A conv with one output channel (a saliency-like map) feeding a flatten-linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.squeeze = nn.Conv2d(8, 1, 1)
        self.fc = nn.Linear(16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.squeeze(torch.relu(self.conv(x))), 1))


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("forward failed")


def resnet18_forward_order() -> list[str]:
    names = ["conv1.weight"]
    for layer in range(1, 5):
        for block in range(2):
            prefix = f"layer{layer}.{block}"
            names += [f"{prefix}.conv1.weight", f"{prefix}.conv2.weight"]
            if layer > 1 and block == 0:
                names.append(f"{prefix}.downsample.0.weight")  # BasicBlock calls downsample after conv2
    return names


def test_resnet18_has_20_prunable_convs_in_forward_order() -> None:
    units = find_prunable(torchvision_model("resnet18"), torch.randn(IMAGE))
    params = [p for p in units if p.kind == "conv"]
    assert [p.name for p in params] == resnet18_forward_order()
    assert len(params) == 20
    assert all(p.prunable for p in params)
    assert units[-1].name == "fc.weight" and units[-1].kind == "linear"  # the classifier is listed, with its reason
    assert units[-1].reason == "coupled to the model output (fc)"
    assert len(units) == 21
    assert params[0].name == "conv1.weight"
    assert params[0].module_name == "conv1"
    assert params[0].shape == (64, 3, 7, 7)
    assert params[0].channels == 64


def test_resnet18_coupled_params_are_the_residual_partners() -> None:
    params = by_name(find_prunable(torchvision_model("resnet18"), torch.randn(IMAGE)))
    assert set(params["conv1.weight"].coupled_params) == {"layer1.0.conv2.weight", "layer1.1.conv2.weight"}
    assert len(params["conv1.weight"].coupled_params) == 2
    assert set(params["layer2.0.conv2.weight"].coupled_params) == {
        "layer2.0.downsample.0.weight",
        "layer2.1.conv2.weight",
    }
    assert params["layer1.0.conv1.weight"].coupled_params == []  # inside a block: nothing joined by an add
    members = params["conv1.weight"].members
    assert members[0] == "conv1 (Conv2d, out)"
    for expected in [
        "bn1 (BatchNorm2d, out)",
        "layer1.0.conv2 (Conv2d, out)",
        "layer1.1.bn2 (BatchNorm2d, out)",
        "layer1.0.conv1 (Conv2d, in)",
        "layer2.0.downsample.0 (Conv2d, in)",
    ]:
        assert expected in members


def test_resnet18_bn_name_is_the_batchnorm_after_each_conv() -> None:
    params = [p for p in find_prunable(torchvision_model("resnet18"), torch.randn(IMAGE)) if p.kind == "conv"]
    assert len(params) == 20  # the stem, 16 convs in the basic blocks, 3 downsample convs
    for param in params:
        module = param.module_name
        if module == "conv1":
            expected = "bn1"
        elif module.endswith("downsample.0"):
            expected = module[: -len("0")] + "1"
        else:
            expected = module.replace(".conv", ".bn")
        assert param.bn_name == expected, param.name


def test_output_layer_of_resnet18_is_the_classifier() -> None:
    model = torchvision_model("resnet18")
    assert output_modules(build_dependency_graph(model, torch.randn(IMAGE))) == {model.fc}


def test_mobilenet_v2_depthwise_convs_are_unprunable() -> None:
    model = torchvision_model("mobilenet_v2")
    params = find_prunable(model, torch.randn(IMAGE))
    depthwise = {
        f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(m, nn.Conv2d) and m.groups == m.in_channels == m.out_channels > 1
    }
    assert len(depthwise) == 17
    unprunable = {p.name: p.reason for p in params if not p.prunable and p.kind == "conv"}
    assert set(unprunable) == depthwise
    assert all("depthwise" in reason for reason in unprunable.values())
    assert len(params) == 53  # 52 convs and the classifier
    assert by_name(params)["classifier.1.weight"].reason == "coupled to the model output (classifier.1)"
    first_block = by_name(params)["features.0.0.weight"]  # the stem feeds the first depthwise conv
    assert "features.1.conv.0.0 (Conv2d, out)" in first_block.members
    assert "features.1.conv.0.1 (BatchNorm2d, out)" in first_block.members


def test_conv_producing_the_model_output_is_unprunable() -> None:
    params = by_name(find_prunable(FullyConvClassifier().eval(), torch.randn(TINY_IMAGE)))
    assert params["head.weight"].reason == "coupled to the model output (head)"
    assert params["body.0.weight"].prunable
    assert params["body.0.weight"].members[0] == "body.0 (Conv2d, out)"
    assert "head (Conv2d, in)" in params["body.0.weight"].members


def test_conv_joined_to_the_output_by_an_add_is_unprunable() -> None:
    params = by_name(find_prunable(ResidualIntoOutput().eval(), torch.randn(TINY_IMAGE)))
    for name in ("skip.weight", "head.weight"):
        reason = params[name].reason
        assert reason is not None
        assert reason.startswith("coupled to the model output (")
    assert params["stem.weight"].prunable


def test_conv_never_called_is_unprunable_and_listed_last() -> None:
    model = WithUnusedConv().eval()
    params = find_prunable(model, torch.randn(TINY_IMAGE))
    assert [p.name for p in params] == ["conv.weight", "fc.weight", "spare.weight"]
    assert params[0].prunable
    assert params[2].reason == "not used by the forward pass"
    assert params[2].shape == (8, 3, 3, 3)
    assert execution_order(model, torch.randn(TINY_IMAGE)) == ["conv", "fc"]
    assert execution_order(model, torch.randn(TINY_IMAGE), (nn.Conv2d,)) == ["conv"]


def test_conv_with_one_output_channel_is_unprunable() -> None:
    params = by_name(find_prunable(SingleChannelConv().eval(), torch.randn(TINY_IMAGE)))
    assert params["squeeze.weight"].reason == "has a single output channel"
    assert params["conv.weight"].prunable


def test_regnet_grouped_convs_are_unprunable_and_their_producers_get_conv_blocks() -> None:
    model = torchvision_model("regnet_y_400mf")
    params = by_name(find_prunable(model, torch.randn(IMAGE)))
    modules = dict(model.named_modules())
    grouped = {n for n, m in modules.items() if isinstance(m, nn.Conv2d) and 1 < m.groups < m.in_channels}
    assert len(grouped) == 16
    feeders = 0
    for name in grouped:
        conv = modules[name]
        reason = params[f"{name}.weight"].reason
        assert reason is not None
        assert f"grouped conv (groups={conv.groups})" in reason
        assert is_grouped_conv(conv)
        assert not is_depthwise(conv)
        feeder = params[f"{name.replace('f.b.0', 'f.a.0')}.weight"]  # the 1x1 conv before it
        assert feeder.prunable
        size = feeder.channels // conv.groups
        assert feeder.conv_blocks == [list(range(k * size, (k + 1) * size)) for k in range(conv.groups)]
        feeders += 1
    assert feeders == 16
    for param in params.values():  # every block list (also the SE expand convs') partitions the channels evenly
        if param.conv_blocks:
            flat = sorted(c for block in param.conv_blocks for c in block)
            assert flat == list(range(param.channels))
            assert len({len(block) for block in param.conv_blocks}) == 1
    assert params["trunk_output.block1.block1-0.f.c.0.weight"].conv_blocks == []


def test_efficientnet_se_convs_have_no_batchnorm() -> None:
    params = find_prunable(torchvision_model("efficientnet_b0"), torch.randn(IMAGE))
    se = [p for p in params if p.prunable and (".fc1." in p.name or ".fc2." in p.name)]
    assert len(se) == 32
    assert all(p.bn_name is None for p in se)
    others = [p for p in params if p.prunable and p not in se]
    assert others
    for param in others:  # Conv2dNormActivation: conv at index 0, BatchNorm at index 1
        assert param.module_name.endswith(".0")
        assert param.bn_name == param.module_name[:-1] + "1", param.name
    by = by_name(params)
    assert by["features.0.0.weight"].coupled_params == ["features.1.0.block.1.fc2.weight"]  # joined by the multiply


def test_find_prunable_restores_requires_grad_flags() -> None:
    model = torchvision_model("resnet18")
    for name, param in model.named_parameters():
        if name.startswith("layer1.") or name == "fc.bias":
            param.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    assert not all(flags.values())
    assert any(flags.values())
    params = find_prunable(model, torch.randn(IMAGE))
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert len([p for p in params if p.prunable]) == 20


def summary(params: list[PrunableUnit]) -> list[tuple[object, ...]]:
    return [(p.name, p.reason, sorted(p.coupled_params), sorted(p.members), p.conv_blocks, p.bn_name) for p in params]


def test_frozen_model_gives_the_same_groups_as_a_trainable_one() -> None:
    # Torch-Pruning only traces parameters that require grad: a fully frozen model must still be traced in full.
    model = torchvision_model("resnet18")
    example = torch.randn(IMAGE)
    trainable = summary(find_prunable(model, example))
    model.requires_grad_(False)
    assert summary(find_prunable(model, example)) == trainable
    assert not any(p.requires_grad for p in model.parameters())


def test_requires_grad_flags_are_restored_when_tracing_fails() -> None:
    model = Raises()
    model.conv.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="forward failed"):
        find_prunable(model, torch.randn(TINY_IMAGE))
    assert model.conv.weight.requires_grad
    assert not model.conv.bias.requires_grad


def test_tiny_nets_coupling() -> None:
    example = torch.randn(TINY_IMAGE)
    resnet = by_name(find_prunable(tiny_resnet().eval(), example))
    assert [p.name for p in resnet.values()] == [  # forward order: the shortcut conv runs before the block's convs
        "conv1.weight",
        "layer1.conv1.weight",
        "layer1.conv2.weight",
        "layer2.downsample.0.weight",
        "layer2.conv1.weight",
        "layer2.conv2.weight",
        "fc.weight",
    ]
    assert resnet["conv1.weight"].coupled_params == ["layer1.conv2.weight"]
    assert resnet["layer2.conv2.weight"].coupled_params == ["layer2.downsample.0.weight"]
    assert resnet["layer2.downsample.0.weight"].bn_name == "layer2.downsample.1"

    inverted = by_name(find_prunable(tiny_inverted_residual().eval(), example))
    assert inverted["stem.0.weight"].coupled_params == ["block.project.0.weight"]
    assert "depthwise" in (inverted["block.depthwise.0.weight"].reason or "")
    assert "block.depthwise.0 (Conv2d, out)" in inverted["block.expand.0.weight"].members

    se = by_name(find_prunable(tiny_se().eval(), example))
    assert se["stem.0.weight"].coupled_params == ["se.expand.weight"]
    assert se["se.reduce.weight"].bn_name is None
    assert "se.reduce (Conv2d, in)" in se["stem.0.weight"].members

    dense = by_name(find_prunable(tiny_densenet().eval(), example))
    assert all(p.prunable and not p.coupled_params for p in dense.values() if p.kind == "conv")  # concat couples none
    assert dense["fc.weight"].reason == "coupled to the model output (fc)"

    grouped = by_name(find_prunable(tiny_grouped().eval(), example))
    assert grouped["reduce.weight"].conv_blocks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    reason = grouped["grouped.0.weight"].reason
    assert reason == "grouped conv (groups=4): pruned only as a member of another conv's group"
    assert grouped["project.0.weight"].conv_blocks == []


def test_flatten_linear_input_slices_are_channel_blocks() -> None:
    model = tiny_flatten_head().eval()
    graph = build_dependency_graph(model, torch.randn(TINY_IMAGE))
    group = removal_group(graph, model.conv2, [4, 1])  # unsorted on purpose
    # conv2's map is 4x4 at the flatten, so channel c owns linear inputs c*16 .. c*16+15
    assert item_idxs(graph, group, model.fc) == [list(range(16, 32)) + list(range(64, 80))]
    assert item_idxs(graph, group, model.conv2) == [[1, 4]]


def test_concat_maps_channels_to_their_offset_in_the_consumer() -> None:
    model = tiny_densenet().eval()
    graph = build_dependency_graph(model, torch.randn(TINY_IMAGE))
    # layer1's 4 new channels follow the stem's 8 in both concatenations: its channel 1 is input 9 downstream.
    group = removal_group(graph, model.layer1[2], [1])
    assert item_idxs(graph, group, model.layer2[2]) == [[9]]
    assert item_idxs(graph, group, model.transition[2]) == [[9]]
    # layer2's channel 2 is input 8 + 4 + 2 = 14 of the transition conv; layer1 and the stem do not see it.
    group = removal_group(graph, model.layer2[2], [2])
    assert item_idxs(graph, group, model.transition[2]) == [[14]]
    assert item_idxs(graph, group, model.layer1[2]) == []
    # The stem's channels keep their index everywhere.
    group = removal_group(graph, model.stem, [0, 5])
    for consumer in (model.layer1[2], model.layer2[2], model.transition[2]):
        assert item_idxs(graph, group, consumer) == [[0, 5]]


def test_full_group_covers_every_channel() -> None:
    model = tiny_resnet().eval()
    graph = build_dependency_graph(model, torch.randn(TINY_IMAGE))
    group = full_group(graph, model.conv1)
    assert item_idxs(graph, group, model.layer1.conv2) == [list(range(8))]


def test_depthwise_and_grouped_predicates() -> None:
    assert is_depthwise(nn.Conv2d(8, 8, 3, groups=8))
    assert not is_depthwise(nn.Conv2d(8, 8, 3))
    assert not is_depthwise(nn.Conv2d(8, 8, 3, groups=4))
    assert not is_depthwise(nn.Linear(8, 8))
    assert is_grouped_conv(nn.Conv2d(8, 16, 3, groups=4))
    assert not is_grouped_conv(nn.Conv2d(8, 8, 3, groups=8))
    assert not is_grouped_conv(nn.Conv2d(8, 8, 3))


def test_find_prunable_leaves_train_mode_and_batchnorm_statistics_alone() -> None:
    model = tiny_resnet().train()
    model.layer1.eval()  # a mixed state must come back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    before = {name: t.clone() for name, t in model.state_dict().items()}
    find_prunable(model, torch.randn(2, 3, 16, 16))
    # no tracing or order-recording pass may update BN running statistics on the way
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_a_group_search_that_runs_away_is_bounded_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """timm's ReXNet, EfficientViT-M and CoAtNet make Torch-Pruning's search run for minutes or fill the memory."""
    import time

    import analysis.structure.groups as groups

    real = groups.full_group

    def endless_for_layer1(graph, root):
        if root is model.layer1.conv1:
            while True:  # busy, as Torch-Pruning's search is: the limit counts CPU time
                pass
        return real(graph, root)

    model = tiny_resnet().eval()
    monkeypatch.setattr(groups, "GROUP_SEARCH_SECONDS", 0.3)
    monkeypatch.setattr(groups, "full_group", endless_for_layer1)
    started = time.monotonic()
    params = by_name(find_prunable(model, torch.randn(TINY_IMAGE)))
    assert time.monotonic() - started < 20
    assert params["layer1.conv1.weight"].reason == "Torch-Pruning's group search did not finish in 0.3 s of CPU time"
    assert params["layer1.conv2.weight"].prunable  # the other units are described as before

    def endless(graph, root):
        while True:
            pass

    monkeypatch.setattr(groups, "RUNAWAY_BUDGET_SECONDS", 0.5)
    monkeypatch.setattr(groups, "LATE_SEARCH_SECONDS", 0.1)
    monkeypatch.setattr(groups, "full_group", endless)
    reasons = [p.reason for p in find_prunable(model, torch.randn(TINY_IMAGE)) if p.kind == "conv"]
    limits = [reason.removeprefix("Torch-Pruning's group search did not finish in ") for reason in reasons]
    assert limits == ["0.3 s of CPU time"] * 2 + ["0.1 s of CPU time"] * (
        len(reasons) - 2
    )  # past the budget, searches get less time

    def failing(graph, root):
        raise IndexError("index 7 is out of bounds for dimension 0 with size 4")

    monkeypatch.setattr(groups, "full_group", failing)
    params = by_name(find_prunable(model, torch.randn(TINY_IMAGE)))
    assert params["conv1.weight"].reason == (
        "Torch-Pruning could not build its group (IndexError: index 7 is out of bounds for dimension 0 with size 4)"
    )


def test_time_limit_restores_the_previous_alarm_handler() -> None:
    import signal
    import time

    from analysis.structure._time_limit import TimeLimitReached, time_limit

    def busy(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    before = signal.getsignal(signal.SIGVTALRM)
    with pytest.raises(TimeLimitReached, match=r"did not finish in 0\.1 s of CPU time"), time_limit(0.1) as limited:
        assert limited
        busy(5.0)
    assert signal.getsignal(signal.SIGVTALRM) == before and signal.getitimer(signal.ITIMER_VIRTUAL)[0] == 0.0
    with time_limit(5.0):
        time.sleep(0.5)  # sleeping costs no CPU time: not interrupted
        busy(0.01)
    busy(0.05)  # and a block that finished is not interrupted later


def test_a_model_torch_pruning_cannot_trace_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision's ShuffleNetV2 and Swin-S/B make Torch-Pruning's graph building raise deep inside its index
    mapping; that is a ModelError naming the model (exit code 2 on the command line), not a traceback."""
    import torch_pruning as tp

    from analysis.errors import ModelError

    real = tp.DependencyGraph.build_dependency

    def broken(self, model, example_inputs, **kwargs):  # the failure torchvision's shufflenet_v2 gives
        real(self, model, example_inputs=example_inputs, **kwargs)
        tp.dependency.index_mapping._FlattenIndexMapping(stride=0, reverse=True)([tp._helpers._HybridIndex(1, 1)])

    monkeypatch.setattr(tp.DependencyGraph, "build_dependency", broken)
    expected = r"^Torch-Pruning cannot trace the channel dependencies of this TinyResNet \(ZeroDivisionError: integer"
    with pytest.raises(ModelError, match=expected):
        find_prunable(tiny_resnet().eval(), torch.randn(TINY_IMAGE))


class _GainConv(nn.Conv2d):
    """A conv with a learnable per-output-channel gain beside weight and bias (timm's ScaledStdConv2d style)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gain = nn.Parameter(torch.ones(self.out_channels))
        self.per_filter = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.other = nn.Parameter(torch.ones(3))


def test_per_channel_extras_are_every_parameter_indexed_by_output_channel() -> None:
    conv = _GainConv(3, 8, 3)
    assert [name for name, _ in per_channel_extras(conv)] == ["gain", "per_filter"]
    assert per_channel_extras(nn.Linear(3, 8)) == [] and per_channel_extras(nn.Conv2d(3, 8, 3)) == []


class _WideningBranch(nn.Module):
    """A grouped conv that widens (8 -> 16 channels in 4 groups), added to a plain conv's output: it is an output-side
    member of that conv's group, with other input than output channels."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Conv2d(3, 8, 3, padding=1)
        self.plain = nn.Conv2d(3, 16, 3, padding=1)
        self.widen = nn.Conv2d(8, 16, 3, padding=1, groups=4)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.plain(x) + self.widen(self.narrow(x))).mean(dim=(2, 3)))


def test_grouped_conv_blocks_come_from_the_side_of_the_group_it_is_on() -> None:
    model = _WideningBranch().eval()
    params = {p.name: p for p in find_prunable(model, torch.randn(1, 3, 8, 8))}
    assert params["plain.weight"].prunable  # its group holds the grouped conv's 16 outputs: 4 per conv group
    assert params["plain.weight"].conv_blocks == [list(range(k, k + 4)) for k in range(0, 16, 4)]
    assert params["narrow.weight"].prunable  # its group holds the grouped conv's 8 inputs: 2 per conv group
    assert params["narrow.weight"].conv_blocks == [[0, 1], [2, 3], [4, 5], [6, 7]]


class _ConcatIntoGrouped(nn.Module):
    """Two convs concatenated (4 + 4 channels) into a grouped conv (8 channels, 4 groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.grouped(torch.cat([self.left(x), self.right(x)], dim=1)).mean(dim=(2, 3)))


def test_channels_reaching_a_grouped_conv_through_a_concat_are_not_pruned() -> None:
    params = {p.name: p for p in find_prunable(_ConcatIntoGrouped().eval(), torch.randn(1, 3, 8, 8))}
    for name in ("left.weight", "right.weight"):
        assert params[name].reason == "its channels reach a grouped conv (4 groups) through a concat or split"


class _TwoChannelDepthwise(nn.Module):
    """A 2-channel conv, a 2-channel depthwise conv on it, and a conv feeding two grouped convs of 2 and 4 groups."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 2, 3, padding=1)
        self.depthwise = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, groups=2), nn.BatchNorm2d(2), nn.ReLU())
        self.wide = nn.Conv2d(2, 8, 1)
        self.halves, self.quarters = nn.Conv2d(8, 8, 1, groups=2), nn.Conv2d(8, 8, 1, groups=4)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.wide(self.depthwise(self.first(x)))
        return self.head((self.halves(x) + self.quarters(x)).mean(dim=(2, 3)))


def test_a_two_channel_depthwise_conv_passes_channels_and_disagreeing_conv_groups_are_refused() -> None:
    params = {p.name: p for p in find_prunable(_TwoChannelDepthwise().eval(), torch.randn(1, 3, 8, 8))}
    assert params["first.weight"].prunable and params["first.weight"].conv_blocks == []  # 1 of 2 through the dw
    assert params["wide.weight"].reason == "it feeds grouped convs whose conv groups disagree"


class _SingleChannel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.single, self.wide, self.head = (
            nn.Conv2d(1, 1, 3, padding=1),
            nn.Conv2d(1, 4, 3, padding=1),
            nn.Linear(4, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wide(self.single(x)).mean(dim=(2, 3)))


def test_a_single_channel_conv_is_unprunable_for_that_reason() -> None:
    params = {p.name: p for p in find_prunable(_SingleChannel().eval(), torch.randn(1, 1, 8, 8))}
    assert params["single.weight"].reason == "has a single output channel"  # not a depthwise conv (1 group)
    assert params["wide.weight"].prunable

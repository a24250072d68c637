"""BatchNorm re-estimation after pruning: which layers are affected, how they are re-estimated, exact restoration."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn

from analysis.engine.batchnorm import (
    Estimation,
    affected_batchnorms,
    batchnorm_names,
    changed_sources,
    downstream_batchnorms,
    recalibrate_copy,
    reestimate,
    reestimated,
)
from analysis.engine.partition import GraphRunner
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import build_dependency_graph, find_prunable, full_group, removal_group
from analysis.structure.masking import masked, zeroed, zeroed_slices
from analysis.structure.physical import pruned_copy

import bn_models
import engine_models
import tiny_models
from helpers import batches

BatchNorm = nn.modules.batchnorm._BatchNorm
Stats = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BN affine parameters and running statistics (only where the layer tracks them), eval mode."""
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, BatchNorm):
            if module.track_running_stats:
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def statistics(model: nn.Module) -> Stats:
    """Copies of the running statistics of every BatchNorm that tracks them, by module name."""
    return {
        name: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
        for name, m in model.named_modules()
        if isinstance(m, BatchNorm) and m.track_running_stats
    }


def identical(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def half_group(model: nn.Module, graph, conv_name: str) -> tuple[list[int], object]:
    """The lowest-L1 half of ``conv_name``'s filters and the removal group they need."""
    conv = model.get_submodule(conv_name)
    channels = select_channels(l1_norm(conv.weight), 0.5)
    return channels, removal_group(graph, conv, channels)


CALIBRATION = batches(count=3, size=8)  # 24 random 16x16 images
EXAMPLE = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(
    ("build", "conv_name", "expected"),
    [
        (bn_models.conv_bn_chain, "conv1", ["bn2", "bn3"]),
        (bn_models.conv_bn_chain, "conv0", ["bn1", "bn2", "bn3"]),
        # residual chain (stem + layer1.conv2 + the shortcut): the consumer layer1.conv1 changes, so the BN inside the
        # residual branch after it (layer1.bn1) is affected; the stem's own bn1 only loses channels
        (
            tiny_models.tiny_resnet,
            "conv1",
            ["layer1.bn1", "layer1.bn2", "layer2.bn1", "layer2.bn2", "layer2.downsample.1"],
        ),
        (tiny_models.tiny_resnet, "layer2.conv1", ["layer2.bn2"]),
    ],
)
def test_reestimation_changes_only_the_affected_layers_and_restores_all_bit_exactly(
    build: Callable[[], nn.Module], conv_name: str, expected: list[str]
) -> None:
    model = randomize_bn(build())
    graph = build_dependency_graph(model, EXAMPLE)
    _, group = half_group(model, graph, conv_name)
    layers = affected_batchnorms(graph, [group])
    assert batchnorm_names(model, layers) == expected
    before = statistics(model)
    with masked(graph, group), reestimated(model, layers, CALIBRATION) as images:
        inside = statistics(model)
        assert images == 24
    for name, stats in before.items():
        if name in expected:
            assert not torch.equal(inside[name][0], stats[0]) and not torch.equal(inside[name][1], stats[1]), name
            assert int(inside[name][2]) == len(CALIBRATION), name
        else:
            assert identical(inside[name], stats), f"{name} is not affected but its statistics changed"
    after = statistics(model)
    assert all(identical(after[name], before[name]) for name in before)  # bit-exact restoration


def removed_per_batchnorm(group) -> dict[nn.Module, list[int]]:
    return {item.dep.target.module: list(item.idxs) for item in group if isinstance(item.dep.target.module, BatchNorm)}


@pytest.mark.parametrize(
    "build",
    [bn_models.conv_bn_chain, tiny_models.tiny_resnet, tiny_models.tiny_inverted_residual, tiny_models.tiny_densenet],
)
def test_affected_layers_are_those_whose_statistics_the_pruned_network_changes(build: Callable[[], nn.Module]) -> None:
    """Ground truth: re-estimate every BatchNorm of the dense model and of the physically pruned copy; a layer's
    statistics on its remaining channels differ exactly when it is in the affected set."""
    model = randomize_bn(build())
    graph = build_dependency_graph(model, EXAMPLE)
    dense = copy.deepcopy(model)
    reestimate(dense, [m for m in dense.modules() if isinstance(m, BatchNorm)], CALIBRATION)
    dense_stats = statistics(dense)
    prunable = [param for param in find_prunable(model, EXAMPLE) if param.prunable]
    assert len(prunable) >= 4
    somewhere_changed = False
    for param in prunable:
        channels, group = half_group(model, graph, param.module_name)
        affected = set(batchnorm_names(model, affected_batchnorms(graph, [group])))
        removed = {name: removed_per_batchnorm(group).get(model.get_submodule(name), [])
                   for name in dense_stats}  # fmt: skip
        smaller = pruned_copy(model, param.module_name, channels, EXAMPLE)
        reestimate(smaller, [m for m in smaller.modules() if isinstance(m, BatchNorm)], CALIBRATION)
        changed = set()
        for name, (mean, var, _) in statistics(smaller).items():
            keep = [c for c in range(len(dense_stats[name][0])) if c not in removed[name]]
            assert len(keep) == len(mean), name
            if not (torch.allclose(mean, dense_stats[name][0][keep], atol=1e-5)
                    and torch.allclose(var, dense_stats[name][1][keep], atol=1e-5)):  # fmt: skip
                changed.add(name)
        assert affected == changed, param.name
        somewhere_changed |= bool(changed)
    assert somewhere_changed  # some removals change later statistics: the comparison is not between empty sets


def test_in_a_plain_chain_the_pruned_conv_s_own_batchnorm_and_earlier_ones_are_not_affected() -> None:
    model = randomize_bn(bn_models.conv_bn_chain())
    graph = build_dependency_graph(model, EXAMPLE)
    group = full_group(graph, model.conv1)
    assert changed_sources(graph, group) == [model.conv2]  # conv1 itself and bn1 keep their remaining channels
    assert downstream_batchnorms(graph, [model.conv2]) == [model.bn2, model.bn3]
    assert downstream_batchnorms(graph, [model.conv1]) == [model.bn1, model.bn2, model.bn3]  # model order


@pytest.mark.parametrize(
    ("build", "conv_name", "normaliser"),
    [(engine_models.layernorm_cnn, "0", "1.norm"), (bn_models.groupnorm_net, "0", "1")],
)
def test_channel_normalising_layers_are_sources(
    build: Callable[[], nn.Module], conv_name: str, normaliser: str
) -> None:
    model = randomize_bn(build())
    graph = build_dependency_graph(model, EXAMPLE)
    sources = changed_sources(graph, full_group(graph, model.get_submodule(conv_name)))
    assert model.get_submodule(normaliser) in sources  # zeroing a channel changes the others after a Layer/GroupNorm
    assert model.get_submodule(conv_name) not in sources
    assert batchnorm_names(model, downstream_batchnorms(graph, sources)) == ["4"]


def test_reestimation_is_a_deterministic_cumulative_average_in_train_mode_for_the_layers_alone() -> None:
    model = randomize_bn(bn_models.conv_bn_chain())
    model.bn1.momentum = 0.3
    model.bn3.train()  # a layer left in train mode by the caller stays so
    layers = [model.bn1, model.bn3]
    seen: list[tuple[str, bool, bool]] = []
    inputs: list[torch.Tensor] = []
    names = {m: n for n, m in model.named_modules()}

    def record(module: nn.Module, args: tuple) -> None:
        seen.append((names[module], module.training, torch.is_grad_enabled()))
        if module is model.bn1:
            inputs.append(args[0].detach().clone())

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if m is not model]
    try:
        assert reestimate(model, layers, CALIBRATION) == 24
    finally:
        for hook in hooks:
            hook.remove()
    expected_modes = {(name, name in ("bn1", "bn3")) for name in names.values() if name}
    assert {(name, training) for name, training, _ in seen} == expected_modes  # dropout and other BNs stay in eval
    assert not any(grad for _, _, grad in seen)
    first = statistics(model)
    # cumulative average (momentum None): every batch weighs the same, whatever the layer's momentum was
    assert torch.allclose(model.bn1.running_mean, torch.stack([x.mean(dim=(0, 2, 3)) for x in inputs]).mean(0),
                          atol=1e-6)  # fmt: skip
    assert torch.allclose(model.bn1.running_var, torch.stack([x.var(dim=(0, 2, 3)) for x in inputs]).mean(0),
                          atol=1e-5)  # fmt: skip
    assert int(model.bn1.num_batches_tracked) == 3
    assert (model.bn1.momentum, model.bn1.training, model.bn3.momentum, model.bn3.training) == (0.3, False, 0.1, True)
    reestimate(model, layers, CALIBRATION)
    second = statistics(model)
    assert all(identical(first[name], second[name]) for name in first)  # bit-identical when repeated
    assert reestimate(model, layers, CALIBRATION, max_batches=2) == 16 and int(model.bn1.num_batches_tracked) == 2


def test_flags_and_statistics_are_restored_when_something_raises() -> None:
    model = randomize_bn(bn_models.conv_bn_chain())
    model.bn2.momentum = 0.25
    before = statistics(model)

    def failing():
        yield CALIBRATION[0]
        raise RuntimeError("broken loader")

    with pytest.raises(RuntimeError, match="broken loader"):
        reestimate(model, [model.bn2], failing())
    assert model.bn2.momentum == 0.25 and not model.bn2.training
    with pytest.raises(KeyError), reestimated(model, [model.bn2, model.bn3], CALIBRATION):
        raise KeyError("inside the block")
    after = statistics(model)
    assert identical(after["bn3"], before["bn3"])  # restored although the block raised
    assert model.bn2.momentum == 0.25 and not any(m.training for m in model.modules())


def test_estimation_steps_equal_reestimation_in_place_and_hold_the_original_statistics_between_steps() -> None:
    model = randomize_bn(bn_models.conv_bn_chain())
    graph = build_dependency_graph(model, EXAMPLE)
    group_a = removal_group(graph, model.conv1, [0, 1, 2])
    group_b = removal_group(graph, model.conv1, [4, 5, 6, 7])
    layers = affected_batchnorms(graph, [group_a])
    assert layers == affected_batchnorms(graph, [group_b]) == [model.bn2, model.bn3]
    slices_a, slices_b = zeroed_slices(graph, group_a), zeroed_slices(graph, group_b)
    original = statistics(model)
    first, second = Estimation(layers), Estimation(layers)
    with first.applied():  # before its first step an estimation holds freshly reset statistics
        assert torch.equal(model.bn2.running_mean, torch.zeros(10)) and int(model.bn2.num_batches_tracked) == 0
    for images, _ in CALIBRATION:  # interleaved: the two estimations never see each other's statistics
        with torch.no_grad():
            with zeroed(slices_a), first.step(len(images)):
                model(images)
            assert all(identical(statistics(model)[n], original[n]) for n in original)
            with zeroed(slices_b), second.step(len(images)):
                model(images)
            assert all(identical(statistics(model)[n], original[n]) for n in original)
    assert first.images == second.images == 24
    assert not any(m.training for m in model.modules()) and model.bn2.momentum == 0.1
    for slices, estimation in ((slices_a, first), (slices_b, second)):
        with zeroed(slices), reestimated(model, layers, CALIBRATION):
            expected = statistics(model)
            with torch.inference_mode():
                expected_logits = model(EXAMPLE)
        with zeroed(slices), estimation.applied():
            got = statistics(model)
            with torch.inference_mode():
                logits = model(EXAMPLE)
        assert all(identical(got[n], expected[n]) for n in ("bn2", "bn3"))
        assert torch.equal(logits, expected_logits)
    assert not identical(statistics(model)["bn2"], expected["bn2"])
    assert all(identical(statistics(model)[n], original[n]) for n in original)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_affected_layers_are_the_batchnorms_of_the_sources_fx_suffix(name: str) -> None:
    """The fast engine re-estimates on graph suffixes: every affected layer must be in the suffix of the sources,
    and every BatchNorm there is affected."""
    torch.manual_seed(0)
    model = randomize_bn(torchvision.models.get_model(name, num_classes=10))
    example = torch.randn(1, 3, 32, 32)
    graph = build_dependency_graph(model, example)
    runner = GraphRunner(model)
    sizes = []
    for param in find_prunable(model, example):
        if not param.prunable:
            continue
        sources = changed_sources(graph, full_group(graph, model.get_submodule(param.module_name)))
        plan = runner.plan(sources, [])
        assert plan is not None
        in_suffix = {runner.module.get_submodule(str(node.target)) for node in plan.nodes if node.op == "call_module"}
        affected = downstream_batchnorms(graph, sources)
        assert set(affected) == {m for m in in_suffix if isinstance(m, BatchNorm)}, param.name
        sizes.append(len(affected))
    batchnorms = sum(isinstance(m, BatchNorm) for m in model.modules())
    assert len(sizes) >= 20 and len(set(sizes)) > 5 and max(sizes) < batchnorms  # varied, never every layer


@pytest.mark.parametrize(
    "build", [tiny_models.tiny_resnet, tiny_models.tiny_inverted_residual, bn_models.untracked_bn_net]
)
def test_masked_reestimation_equals_the_recalibrated_physically_pruned_copy(build: Callable[[], nn.Module]) -> None:
    model = randomize_bn(build())
    graph = build_dependency_graph(model, EXAMPLE)
    dense_before = statistics(model)
    calibrated = 0
    for param in find_prunable(model, EXAMPLE):
        if not param.prunable:
            continue
        channels, group = half_group(model, graph, param.module_name)
        layers = affected_batchnorms(graph, [group])
        assert all(layer.track_running_stats for layer in layers)
        with masked(graph, group), reestimated(model, layers, CALIBRATION), torch.inference_mode():
            masked_logits = model(EXAMPLE)
        with masked(graph, group), torch.inference_mode():
            raw_logits = model(EXAMPLE)
        smaller = pruned_copy(model, param.module_name, channels, EXAMPLE)
        stats = recalibrate_copy(model, smaller, [(param.module_name, channels)], EXAMPLE, CALIBRATION)
        assert stats.layers == batchnorm_names(model, layers)
        assert stats.images == (24 if layers else 0)
        assert not any(m.training for m in smaller.modules())
        with torch.inference_mode():
            physical_logits = smaller(EXAMPLE)
        assert (masked_logits - physical_logits).abs().max() <= 1e-5, param.name
        if layers:
            calibrated += 1
            assert (masked_logits - raw_logits).abs().max() > 1e-3  # the re-estimation mattered
    assert calibrated >= 2
    after = statistics(model)
    assert all(identical(after[name], dense_before[name]) for name in dense_before)  # the dense model is untouched
    assert not any(m.training for m in model.modules())


def test_batchnorms_without_running_statistics_are_never_reset() -> None:
    model = randomize_bn(bn_models.untracked_bn_net())
    graph = build_dependency_graph(model, EXAMPLE)
    group = full_group(graph, model[0])
    assert changed_sources(graph, group) == [model[3]]
    assert downstream_batchnorms(graph, [model[3]]) == [model[7]]  # model[4] normalises with batch statistics only
    assert model[4].running_mean is None

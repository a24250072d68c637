"""Channel dependency sets under NNI 2.x names: ChannelDependency on torchvision models, the conv-only sets and
their CSV, and the convs that cannot be pruned."""

from __future__ import annotations

import csv
import functools
import io
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from analysis.compat.topology import ChannelDependency, dependency_csv, dependency_sets, not_safe_to_prune

from tiny_models import tiny_inverted_residual, tiny_resnet

IMAGE = (1, 3, 64, 64)
TINY_IMAGE = (1, 3, 16, 16)


def torchvision_model(name: str) -> nn.Module:
    return torchvision.models.get_model(name, weights=None, num_classes=10).eval()


@functools.cache
def traced(name: str) -> tuple[nn.Module, ChannelDependency]:
    """A torchvision model with random weights and its ChannelDependency (built once per test session)."""
    model = torchvision_model(name)
    return model, ChannelDependency(model, torch.randn(IMAGE))


def layer_names(model: nn.Module) -> list[str]:
    """Conv and linear layers in registration order (the forward order of these torchvision models)."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def as_partition(sets: list[list[str]] | list[set[str]]) -> set[frozenset[str]]:
    return {frozenset(members) for members in sets}


def with_singletons(model: nn.Module, coupled: list[set[str]]) -> set[frozenset[str]]:
    """The full partition: the coupled sets plus every other conv/linear layer on its own."""
    taken = set().union(*coupled)
    return as_partition(coupled) | {frozenset([name]) for name in layer_names(model) if name not in taken}


def expected_resnet_sets(model: nn.Module) -> set[frozenset[str]]:
    """Each residual chain: every block's last conv plus the downsample conv that starts it (or the stem conv when
    the first stage keeps the stem's channels); all other layers are singletons."""
    coupled: list[set[str]] = []
    chain = {"conv1"}
    for stage_name in ("layer1", "layer2", "layer3", "layer4"):
        stage = getattr(model, stage_name)
        last = "conv3" if hasattr(stage[0], "conv3") else "conv2"
        lasts = {f"{stage_name}.{index}.{last}" for index in range(len(stage))}
        if stage[0].downsample is None:
            chain |= lasts
        else:
            coupled.append(chain)
            chain = lasts | {f"{stage_name}.0.downsample.0"}
    coupled.append(chain)
    return with_singletons(model, [members for members in coupled if len(members) > 1])


def expected_mobilenet_v2_sets(model: nn.Module) -> set[frozenset[str]]:
    """Depthwise convs join the conv producing their input; residual blocks couple their projection with the
    previous block's output producer."""
    parent: dict[str, str] = {name: name for name in layer_names(model)}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    def join(a: str, b: str) -> None:
        parent[root(b)] = root(a)

    producer = "features.0.0"  # the stem conv (Conv2dNormActivation)
    for index in range(1, len(model.features) - 1):
        block = model.features[index]
        prefix = f"features.{index}.conv"
        has_expand = len(block.conv) == 4  # expand, depthwise, project conv, project BN
        depthwise = f"{prefix}.1.0" if has_expand else f"{prefix}.0.0"
        projection = f"{prefix}.2" if has_expand else f"{prefix}.1"
        join(f"{prefix}.0.0" if has_expand else producer, depthwise)
        if block.use_res_connect:
            join(producer, projection)
        producer = projection
    members: dict[str, set[str]] = {}
    for name in parent:
        members.setdefault(root(name), set()).add(name)
    return as_partition(list(members.values()))


@pytest.mark.parametrize("name", ["resnet18", "resnet34", "wide_resnet50_2"])
def test_resnet_dependency_sets(name: str) -> None:
    model, dependency = traced(name)
    assert as_partition(dependency.dependency_sets) == expected_resnet_sets(model)
    assert {"fc"} in dependency.dependency_sets  # NNI puts linear layers in sets too


def test_mobilenet_v2_dependency_sets() -> None:
    model, dependency = traced("mobilenet_v2")
    expected = expected_mobilenet_v2_sets(model)
    assert as_partition(dependency.dependency_sets) == expected
    assert frozenset({"features.2.conv.2", "features.3.conv.2"}) in expected  # the derivation covers residuals
    assert frozenset({"features.0.0", "features.1.conv.0.0"}) in expected  # and depthwise convs


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_sets_are_in_forward_order_and_match_dependency_sets(name: str) -> None:
    model, dependency = traced(name)
    position = {layer: index for index, layer in enumerate(layer_names(model))}
    sets = dependency.sets_in_order
    assert [position[members[0]] for members in sets] == sorted(position[members[0]] for members in sets)
    assert all(members == sorted(members, key=position.__getitem__) for members in sets)
    assert [set(members) for members in sets] == dependency.dependency_sets
    assert all(dependency.dependency[layer] == set(members) for members in sets for layer in members)
    convs_only = [[n for n in members if isinstance(model.get_submodule(n), nn.Conv2d)] for members in sets]
    assert [members for members in convs_only if members] == dependency_sets(model, torch.randn(IMAGE))


def test_export_writes_nni_csv(tmp_path: Path) -> None:
    model, dependency = traced("resnet18")
    path = tmp_path / "dependency.csv"
    dependency.export(path)
    text = path.read_text()
    assert text == dependency_csv(dependency.sets_in_order)
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["Dependency Set", "Layers"]  # the header NNI 2.10 writes
    assert [row[0] for row in rows[1:]] == [f"Set {n}" for n in range(1, len(dependency.sets_in_order) + 1)]
    assert as_partition([row[1:] for row in rows[1:]]) == expected_resnet_sets(model)
    stem_row = next(row for row in rows[1:] if "conv1" in row[1:])
    assert stem_row[1:] == ["conv1", "layer1.0.conv2", "layer1.1.conv2"]


def test_channel_dependency_arguments() -> None:
    model = tiny_resnet().train()
    x = torch.randn(TINY_IMAGE)
    with pytest.raises(ValueError, match="'Filter'"):
        ChannelDependency(model, x, prune_type="Batchnorm")
    with pytest.raises(TypeError, match="dummy_input"):
        ChannelDependency(model, {"x": x})
    from_tuple = ChannelDependency(model, (x,), traced_model=object())  # NNI's extra argument is ignored
    assert from_tuple.sets_in_order == ChannelDependency(model, x).sets_in_order
    assert ["conv1", "layer1.conv2"] in from_tuple.sets_in_order
    assert all(m.training for m in model.modules())  # traced in eval mode, training flags restored


def test_not_safe_to_prune_lists_names_like_nni() -> None:
    unsafe = not_safe_to_prune(tiny_inverted_residual().eval(), torch.randn(TINY_IMAGE))
    assert list(unsafe) == ["block.depthwise.0"]  # iterates like NNI's list of names


RESNET18_DEPENDENCY_SETS = [
    {"layer1.1.conv2", "layer1.0.conv2", "conv1"}, {"layer1.0.conv1"}, {"layer1.1.conv1"}, {"layer2.0.conv1"},
    {"layer2.1.conv2", "layer2.0.conv2", "layer2.0.downsample.0"}, {"layer2.1.conv1"}, {"layer3.0.conv1"},
    {"layer3.0.downsample.0", "layer3.1.conv2", "layer3.0.conv2"}, {"layer3.1.conv1"}, {"layer4.0.conv1"},
    {"layer4.0.downsample.0", "layer4.1.conv2", "layer4.0.conv2"}, {"layer4.1.conv1"},
]  # fmt: skip


def test_resnet18_dependency_sets_are_the_residual_stages() -> None:
    sets = dependency_sets(torchvision_model("resnet18"), torch.randn(IMAGE))
    assert sorted(map(sorted, sets)) == sorted(map(sorted, RESNET18_DEPENDENCY_SETS))
    assert sets[0][0] == "conv1"  # sets in forward order, members too


def test_dependency_csv_is_nni_format() -> None:
    text = dependency_csv([["conv1", "layer1.0.conv2"], ["layer1.0.conv1"]])
    assert text == "Dependency Set,Layers\nSet 1,conv1,layer1.0.conv2\nSet 2,layer1.0.conv1\n"


def test_depthwise_convs_join_the_set_of_their_producer() -> None:
    model = torchvision_model("mobilenet_v2")
    sets = dependency_sets(model, torch.randn(IMAGE))
    set_of = {name: tuple(members) for members in sets for name in members}
    convs = [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert sorted(set_of) == sorted(convs)  # every conv in exactly one set
    assert set_of["features.2.conv.1.0"] == ("features.2.conv.0.0", "features.2.conv.1.0")
    assert set_of["features.2.conv.2"] == ("features.2.conv.2", "features.3.conv.2")  # inverted residual add
    unsafe = not_safe_to_prune(model, torch.randn(IMAGE))
    assert "features.2.conv.1.0" in unsafe and unsafe["features.2.conv.1.0"].startswith("depthwise conv")
    assert "features.2.conv.0.0" not in unsafe


def test_not_safe_to_prune_names_the_output_coupling() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    assert not_safe_to_prune(model, torch.randn(TINY_IMAGE)) == {"2": "coupled to the model output (2)"}

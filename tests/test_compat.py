"""NNI-compatible SensitivityAnalysis: exact (dependency-aware) vs NNI's naive masking, early stop, export."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis import SensitivityAnalysis
from analysis.compat.nni import standing_in
from analysis.errors import ConfigError
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.physical import pruned_copy

import engine_models
from helpers import randomize
from tiny_models import tiny_resnet

INPUT = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))


def logit_energy(model: nn.Module) -> float:
    """A metric that changes with every logit, so any difference in what pruning does shows."""
    with torch.inference_mode():
        return float(model(INPUT).double().square().sum())


def exact_reference(model: nn.Module, layer: str, sparsity: float) -> float:
    """The metric of a physically pruned copy with the exact rule's filters removed."""
    channels = select_channels(l1_norm(model.get_submodule(layer).weight), sparsity)
    return logit_energy(pruned_copy(model, layer, channels, INPUT))


def test_exact_mode_equals_physical_pruning_and_nni_naive_mode_does_not() -> None:
    model = randomize(tiny_resnet())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sparsities = [0.25, 0.5]
    exact = SensitivityAnalysis(model, logit_energy, sparsities=sparsities).analysis(val_args=[model])
    naive = SensitivityAnalysis(model, logit_energy, sparsities=sparsities, dependency_aware=False).analysis(
        val_args=[model]
    )
    assert list(exact) == ["conv1", "layer1.conv1", "layer1.conv2", "layer2.conv1", "layer2.conv2",
                           "layer2.downsample.0"]  # fmt: skip
    for layer, curve in exact.items():
        for sparsity, value in curve.items():
            assert value == pytest.approx(exact_reference(model, layer, sparsity), rel=1e-5)
    # NNI zeroes conv1's filters only: bn1's shift keeps the "removed" channels alive, so its numbers are different
    assert abs(naive["conv1"][0.5] - exact["conv1"][0.5]) > 1e-3 * abs(exact["conv1"][0.5])
    channels = select_channels(l1_norm(model.conv1.weight), 0.5)
    with torch.no_grad():
        model.conv1.weight[channels] = 0
    assert naive["conv1"][0.5] == logit_energy(model)  # the naive number is exactly "zero the weight's filters"
    model.load_state_dict(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_weights_restored_after_analysis() -> None:
    model = randomize(tiny_resnet())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    SensitivityAnalysis(model, logit_energy, sparsities=[0.5]).analysis(val_args=[model])
    SensitivityAnalysis(model, logit_energy, sparsities=[0.5], dependency_aware=False).analysis(val_args=[model])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def removed_fraction(model: nn.Module) -> float:
    """Fraction of layer1.conv1's filters that are all zero: 0 for the baseline, the sparsity when it is pruned."""
    filters = model.layer1.conv1.weight.detach().flatten(1).abs().sum(dim=1)
    return float((filters == 0).float().mean())


@pytest.mark.parametrize("dependency_aware", [True, False])
@pytest.mark.parametrize(
    ("mode", "value", "metric"),
    [
        ("maximize", 0.3, removed_fraction),  # stops when > 0.3
        ("raised", 0.3, removed_fraction),  # baseline 0: stops when > 0 + 0.3
        ("minimize", 0.7, lambda m: 1.0 - removed_fraction(m)),  # stops when < 0.7
        ("dropped", 0.3, lambda m: 1.0 - removed_fraction(m)),  # baseline 1: stops when < 1 - 0.3
    ],
)
def test_early_stop_records_the_tripping_sparsity_and_skips_the_rest(mode, value, metric, dependency_aware) -> None:
    model = randomize(tiny_resnet())  # layer1.conv1 has 8 filters: sparsity s removes exactly 8 s of them
    analysis = SensitivityAnalysis(
        model, metric, sparsities=[0.125, 0.25, 0.375, 0.5, 0.625], early_stop_mode=mode, early_stop_value=value,
        dependency_aware=dependency_aware, dummy_input=INPUT,
    )  # fmt: skip
    result = analysis.analysis(val_args=[model], specified_layers=["layer1.conv1", "layer2.conv1"])
    assert list(result["layer1.conv1"]) == [0.125, 0.25, 0.375]  # 0.375 trips the check, 0.5 and 0.625 skipped
    assert list(result["layer2.conv1"]) == [0.125, 0.25, 0.375, 0.5, 0.625]  # the metric never moves for it
    assert analysis.ori_metric == (0.0 if mode in ("maximize", "raised") else 1.0)


def test_specified_layers_unknown_name_is_an_error() -> None:
    model = randomize(tiny_resnet())
    analysis = SensitivityAnalysis(model, logit_energy, sparsities=[0.5])
    with pytest.raises(ConfigError, match=r"specified_layers: 'layer1.conv3'.*did you mean 'layer1.conv[12]'"):
        analysis.analysis(val_args=[model], specified_layers=["layer1.conv3"])


def test_unprunable_layers_listed_and_refused_when_specified() -> None:
    model = randomize(engine_models.depthwise_cnn())
    analysis = SensitivityAnalysis(model, logit_energy, sparsities=[0.5])
    result = analysis.analysis(val_args=[model])
    assert list(result) == ["0", "6"]
    assert "depthwise" in analysis.unprunable["3"]
    with pytest.raises(ConfigError, match="cannot be pruned: depthwise"):
        analysis.analysis(val_args=[model], specified_layers=["3"])
    naive = SensitivityAnalysis(model, logit_energy, sparsities=[0.5], dependency_aware=False)
    assert list(naive.analysis(val_args=[model])) == ["0", "3", "6"]  # NNI masks every conv, depthwise too


def test_physical_fallback_evaluates_the_pruned_copy_through_the_model_object() -> None:
    model = randomize(engine_models.layernorm_cnn())
    modules_before = dict(model.named_modules())
    result = SensitivityAnalysis(model, logit_energy, sparsities=[0.25, 0.5]).analysis(val_args=[model])
    for sparsity in (0.25, 0.5):
        assert result["0"][sparsity] == pytest.approx(exact_reference(model, "0", sparsity), rel=1e-5)
    assert dict(model.named_modules()) == modules_before  # the copy stood in only while val_func ran


def test_standing_in_restores_the_model_when_val_func_raises() -> None:
    model, other = randomize(tiny_resnet()), randomize(tiny_resnet(), seed=1)
    with pytest.raises(RuntimeError), standing_in(model, other):
        assert logit_energy(model) == logit_energy(other)
        raise RuntimeError("val_func failed")
    assert model.conv1 is not other.conv1 and logit_energy(model) != logit_energy(other)


def zero_count(model: nn.Module) -> float:
    return float((model.fc.weight == 0).sum())


@pytest.mark.parametrize(("dependency_aware", "expected"), [(True, [round(0.25 * 160), round(0.55 * 160)]),
                                                            (False, [int(0.25 * 160), int(0.55 * 160)])])  # fmt: skip
def test_level_prune_type_zeroes_individual_weights_of_linear_layers_too(dependency_aware, expected) -> None:
    model = randomize(tiny_resnet())  # fc: 10 x 16 = 160 weights
    analysis = SensitivityAnalysis(model, zero_count, sparsities=[0.25, 0.55], prune_type="level",
                                   dependency_aware=dependency_aware, dummy_input=INPUT)  # fmt: skip
    result = analysis.analysis(val_args=[model], specified_layers=["fc", "conv1"])
    assert list(result) == ["conv1", "fc"]
    assert list(result["fc"].values()) == expected
    assert result["conv1"] == {0.25: 0.0, 0.55: 0.0}  # other layers untouched


def test_export_writes_nni_csv(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    analysis = SensitivityAnalysis(model, removed_fraction, sparsities=[0.125, 0.25, 0.5], early_stop_mode="maximize",
                                   early_stop_value=0.2, dummy_input=INPUT)  # fmt: skip
    result = analysis.analysis(val_args=[model], specified_layers=["layer1.conv1", "conv1"])
    analysis.export(tmp_path / "sens.csv")
    rows = list(csv.reader((tmp_path / "sens.csv").open()))
    assert rows[0] == ["layername", "0.125", "0.25", "0.5"]
    assert rows[1] == ["conv1", *[str(v) for v in result["conv1"].values()]]
    assert rows[2] == ["layer1.conv1", "0.125", "0.25"]  # stopped at 0.25 (> 0.2): a shorter row, as in NNI


def test_default_sparsities_and_bad_arguments() -> None:
    model = randomize(tiny_resnet())
    assert SensitivityAnalysis(model, logit_energy).sparsities == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    with pytest.raises(ConfigError, match="prune_type must be one of"):
        SensitivityAnalysis(model, logit_energy, prune_type="l3")
    with pytest.raises(ConfigError, match="early_stop_mode must be one of"):
        SensitivityAnalysis(model, logit_energy, early_stop_mode="lower", early_stop_value=1.0)
    with pytest.raises(ConfigError, match="early_stop_value is not a finite number"):
        SensitivityAnalysis(model, logit_energy, early_stop_mode="dropped")
    with pytest.raises(ConfigError, match="pass dummy_input"):
        SensitivityAnalysis(model, lambda: 1.0).analysis()


def test_analysis_file_keeps_results_and_resumes(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    calls = []

    def counted(m: nn.Module) -> float:
        calls.append(1)
        return logit_energy(m)

    path = tmp_path / "nni.pkl"
    first = SensitivityAnalysis(model, counted, sparsities=[0.5], analysis_file=path).analysis(val_args=[model])
    calls.clear()
    second = SensitivityAnalysis(model, counted, sparsities=[0.5], analysis_file=path).analysis(val_args=[model])
    assert second == first and len(calls) == 1  # only the baseline: every variant came from the file

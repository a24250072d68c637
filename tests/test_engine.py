"""The sensitivity engine: exact losses, masking vs physical fallback, shared evaluations, the Python API."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torchvision
import yaml
from torch import nn

from analysis import analysis_prune
from analysis.engine.evaluate import evaluate
from analysis.engine.executors import Executor
from analysis.engine.loss import relative_loss
from analysis.errors import ConfigError, UserError
from analysis.io.results import load_sensitivities, load_sidecar, ratios_path
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import find_prunable
from analysis.structure.physical import pruned_copy

import engine_models
from helpers import analyse_recorded, batches, pseudo_labelled, randomize


@pytest.mark.parametrize(
    ("metric", "baseline", "value", "mode", "expected"),
    [
        ("top1", 0.8, 0.6, "relative", 0.25),  # (0.8 - 0.6) / 0.8
        ("top1", 0.8, 0.9, "relative", -0.125),  # pruning helped: negative loss is kept
        ("ce", 0.5, 0.75, "relative", 0.5),  # lower is better: (0.75 - 0.5) / 0.5
        ("top5", 0.8, 0.6, "absolute", 0.2),
        ("ce", 0.5, 0.75, "absolute", 0.25),
    ],
)
def test_relative_loss(metric: str, baseline: float, value: float, mode: str, expected: float) -> None:
    assert relative_loss(baseline, value, metric, mode) == pytest.approx(expected)


def test_zero_baseline_is_a_user_error_unless_absolute() -> None:
    with pytest.raises(UserError, match=r"baseline top1 is 0.*metric_mode: absolute"):
        relative_loss(0.0, 0.0, "top1")
    assert relative_loss(0.0, 0.0, "top1", "absolute") == 0.0


def test_recorded_losses_are_those_of_the_physically_pruned_network(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches())
    ratios = (0.25, 0.5)
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=ratios, progress=False)
    stored = load_sensitivities(tmp_path / "s.pkl")
    params = [p for p in find_prunable(model, data[0][0]) if p.prunable]
    assert list(stored) == [p.name for p in params]  # model order
    baseline = evaluate(model, data).top1
    for param in params:
        conv = model.get_submodule(param.module_name)
        for ratio in ratios:
            channels = select_channels(l1_norm(conv.weight), ratio)
            smaller = pruned_copy(model, param.module_name, channels, data[0][0])
            assert smaller.get_submodule(param.module_name).out_channels == param.channels - len(channels)
            expected = (baseline - evaluate(smaller, data).top1) / baseline
            assert stored[param.name][ratio] == pytest.approx(expected, abs=1e-12)
    sidecar = load_sidecar(tmp_path / "s.pkl")
    assert sidecar["baseline"]["top1"] == 1.0
    variant = sidecar["params"]["features.0.weight"]["variants"]["0.5"]
    assert variant["channels_removed"] == 4 and variant["mode"] == "mask"
    assert set(variant) >= {"top1", "top5", "ce", "loss", "seconds"}
    assert sidecar["fingerprint"]["model"] and sidecar["fingerprint"]["settings"]["criterion"] == "l1_norm"


def test_layernorm_over_channels_takes_the_physical_path_and_matches_it(tmp_path: Path) -> None:
    model = randomize(engine_models.layernorm_cnn())
    data = pseudo_labelled(model, batches())
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), metric="ce", progress=False)
    sidecar = load_sidecar(tmp_path / "s.pkl")
    first = sidecar["params"]["0.weight"]
    assert first["mode"] == "physical" and first["mask_vs_physical_max_abs_diff"] > 1e-3
    assert sidecar["params"]["3.weight"]["mode"] == "mask"
    channels = select_channels(l1_norm(model[0].weight), 0.5)
    expected_ce = evaluate(pruned_copy(model, "0", channels, data[0][0]), data).ce
    assert first["variants"]["0.5"]["ce"] == pytest.approx(expected_ce, rel=1e-9)


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_the_report_records_what_evaluated_each_variant(engine: str, tmp_path: Path) -> None:
    model = randomize(engine_models.layernorm_cnn())
    data = pseudo_labelled(model, batches())
    kwargs = dict(pruned_ratios=(0.01, 0.5), metric="ce", engine=engine, progress=False)
    report = analyse_recorded(model, data, tmp_path / "s.pkl", **kwargs)
    masked = Executor.FX_SUFFIX if engine == "fast" else Executor.EAGER
    assert report.executors == {
        "0.weight": {0.01: Executor.BASELINE, 0.5: Executor.PHYSICAL},  # 0.01 removes no channel; LayerNorm follows
        "3.weight": {0.01: Executor.BASELINE, 0.5: masked},
    }
    assert analyse_recorded(model, data, tmp_path / "s.pkl", **kwargs).executors == {}  # resumed: nothing evaluated


def test_group_reduction_mean_evaluates_a_coupled_group_once(tmp_path: Path) -> None:
    model = randomize(torchvision.models.resnet18(num_classes=10))
    data = pseudo_labelled(model, batches(count=1, resolution=32))
    calls = []

    def score(candidate: nn.Module) -> float:
        calls.append(1)
        return float(evaluate(candidate, data).top1)

    coupled = ["conv1.weight", "layer1.0.conv2.weight", "layer1.1.conv2.weight"]
    analysis_prune(model, score, tmp_path / "s.pkl", pruned_ratios=(0.5,), prune_params=[*coupled, "layer1.0.conv1"],
                   group_reduction="mean", example_input=data[0][0], progress=False)  # fmt: skip
    stored = load_sensitivities(tmp_path / "s.pkl")
    assert len(calls) == 1 + 2  # baseline, the coupled group once, layer1.0.conv1
    assert len({stored[name][0.5] for name in coupled}) == 1
    assert list(stored) == [*coupled[:1], "layer1.0.conv1.weight", *coupled[1:]]  # model order


def test_self_reduction_ranks_each_coupled_conv_on_its_own_weights(tmp_path: Path) -> None:
    model = randomize(torchvision.models.resnet18(num_classes=10))
    data = pseudo_labelled(model, batches(count=1, resolution=32))
    coupled = ["conv1.weight", "layer1.0.conv2.weight", "layer1.1.conv2.weight"]
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), prune_params=coupled, metric="ce",
                   progress=False)  # fmt: skip
    stored = load_sensitivities(tmp_path / "s.pkl")
    assert len({stored[name][0.5] for name in coupled}) == 3  # three different channel sets were removed


def test_bn_scale_without_batchnorm_is_reported_not_recorded(tmp_path: Path) -> None:
    model = randomize(torchvision.models.efficientnet_b0(num_classes=10))
    data = pseudo_labelled(model, batches(count=1, size=4, resolution=32))
    se_conv = "features.1.0.block.1.fc1.weight"
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), criterion="bn_scale",
                   prune_params=["features.0.0.weight", se_conv], progress=False)  # fmt: skip
    assert list(load_sensitivities(tmp_path / "s.pkl")) == ["features.0.0.weight"]
    assert "bn_scale not applicable" in load_sidecar(tmp_path / "s.pkl")["unprunable"][se_conv]


def test_api_with_eval_function_returns_ratios_and_writes_the_cli_files(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches())
    ratios = analysis_prune(
        model,
        lambda candidate: evaluate(candidate, data).top1,
        tmp_path / "s.pkl",
        pruned_ratios=(0.2, 0.4, 0.6),
        target_loss=0.1,
        example_input=data[0][0],
        progress=False,
    )
    stored = load_sensitivities(tmp_path / "s.pkl")
    assert set(ratios) == set(stored)
    document = yaml.safe_load(ratios_path(tmp_path / "s.pkl").read_text())["ChannelPrune"]
    expected = [name for name in stored if ratios[name] > 0]
    assert document["prune_params_name"] == expected
    assert document["pruned_ratio"] == [round(ratios[name], 6) for name in expected]
    assert load_sidecar(tmp_path / "s.pkl")["baseline"]["score"] == 1.0


def test_api_rejects_bad_arguments(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = batches(count=1)
    with pytest.raises(ConfigError, match=r"pruned_ratios must hold ratios strictly between 0 and 1"):
        analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5, 1.0))
    with pytest.raises(ConfigError, match=r"criterion must be one of .*did you mean 'l2_norm'"):
        analysis_prune(model, data, tmp_path / "s.pkl", criterion="l2norm")
    with pytest.raises(ConfigError, match=r"example_input is required"):
        analysis_prune(model, lambda m: 1.0, tmp_path / "s.pkl")
    with pytest.raises(
        ConfigError, match=r"prune_params: 'features.3.weigth' is not a unit of this model .*'features.3.weight'"
    ):
        analysis_prune(model, data, tmp_path / "s.pkl", prune_params=["features.3.weigth"])
    assert not (tmp_path / "s.pkl").exists()


def test_module_names_are_accepted_for_prune_params(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=1))
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), prune_params=["features.3"], progress=False)
    with (tmp_path / "s.pkl").open("rb") as handle:
        assert list(pickle.load(handle)) == ["features.3.weight"]


def test_resume_normalises_ratio_keys_and_keeps_names_the_model_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=1))
    path = tmp_path / "s.pkl"
    with path.open("wb") as handle:  # as PaddleSlim would write it: float noise in the key, no sidecar
        pickle.dump({"ghost.weight": {0.3: 0.5}, "features.0.weight": {0.30000000000000004: 0.125}}, handle)
    calls = []

    def score(candidate: nn.Module) -> float:
        calls.append(1)
        return float(evaluate(candidate, data).top1)

    with caplog.at_level("WARNING", logger="analysis"):
        analysis_prune(model, score, path, pruned_ratios=(0.3,), example_input=data[0][0], progress=False)
    assert "has no sidecar" in caplog.text and "ghost.weight" in caplog.text
    assert len(calls) == 1 + 2  # baseline + features.3 and features.6; features.0 at 0.3 was already done
    stored = load_sensitivities(path)
    assert list(stored) == ["features.0.weight", "features.3.weight", "features.6.weight", "ghost.weight"]
    assert stored["features.0.weight"] == {0.3: 0.125} and stored["ghost.weight"] == {0.3: 0.5}


def test_ratios_that_remove_nothing(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=1))
    # round(8 * 0.03) = round(12 * 0.03) = round(16 * 0.03) = 0: no ratio removes a filter, so nothing is recorded
    analysis_prune(model, data, tmp_path / "a.pkl", pruned_ratios=(0.03,), progress=False)
    assert load_sensitivities(tmp_path / "a.pkl") == {}
    assert (
        "no ratio removes a channel (8 channels)" in load_sidecar(tmp_path / "a.pkl")["unprunable"]["features.0.weight"]
    )
    # with a ratio that does remove filters, the empty ratio is a real measurement of the unchanged model: loss 0
    analysis_prune(model, data, tmp_path / "b.pkl", pruned_ratios=(0.03, 0.5), prune_params=["features.0"],
                   progress=False)  # fmt: skip
    assert load_sensitivities(tmp_path / "b.pkl")["features.0.weight"][0.03] == 0.0
    variant = load_sidecar(tmp_path / "b.pkl")["params"]["features.0.weight"]["variants"]["0.03"]
    assert variant["channels_removed"] == 0


def test_a_unit_physical_pruning_cannot_remove_is_left_out_but_running_out_of_memory_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import analysis.engine._modes as modes

    from tiny_models import tiny_resnet

    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches(count=1))
    real = modes.checking_copy

    def failing_for(message: str):
        def copy(model: nn.Module, graph, name: str, channels, own=()):
            if name == "layer2.conv1":
                raise RuntimeError(message)
            return real(model, graph, name, channels, own)

        return copy

    monkeypatch.setattr(modes, "checking_copy", failing_for("shape '[64, 1, 1]' is invalid for input of size 32"))
    analysis_prune(model, data, tmp_path / "a.pkl", pruned_ratios=(0.5,), engine="reference", progress=False)
    assert "layer2.conv1.weight" not in load_sensitivities(tmp_path / "a.pkl")
    reason = load_sidecar(tmp_path / "a.pkl")["unprunable"]["layer2.conv1.weight"]
    assert reason == "physical pruning failed (RuntimeError: shape '[64, 1, 1]' is invalid for input of size 32)"

    oom = (
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 9437184"
    )
    monkeypatch.setattr(modes, "checking_copy", failing_for(oom))
    with pytest.raises(RuntimeError, match="can't allocate memory"):  # the machine's limit, not the unit's
        analysis_prune(model, data, tmp_path / "b.pkl", pruned_ratios=(0.5,), engine="reference", progress=False)

"""Adaptive BN: every variant is evaluated after re-estimating the BatchNorm statistics its removal changes."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from analysis import analysis_prune
from analysis.config import load_config
from analysis.engine.batchnorm import affected_batchnorms, recalibrate_copy, reestimated
from analysis.engine.evaluate import evaluate
from analysis.engine.loss import relative_loss
from analysis.errors import AnalysisFileError, ConfigError
from analysis.inputs.calibration import build_calibration_set
from analysis.inputs.data import apply_data_cache, build_eval_loader
from analysis.inputs.models import build_model
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.io.tables import export_csv
from analysis.reporting.report import write_report
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import build_dependency_graph, find_prunable, removal_group
from analysis.structure.masking import masked
from analysis.structure.physical import pruned_copy

import engine_models
import tiny_models
from helpers import (
    REPO,
    CliResult,
    analyse_both,
    batches,
    calibration_batches,
    pseudo_labelled,
    randomize,
    tiny_global,
    variant_metrics,
    write_config,
    write_images,
    write_train_list,
)

Cli = Callable[..., CliResult]


@pytest.mark.parametrize("config_name", ["digits_resnet.yaml", "digits_mobilenet.yaml"])
def test_demo_models_adaptive_bn_fast_equals_reference(
    config_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(Path("configs/demo") / config_name, ["Global.max_samples=100", "Global.calib_samples=128"])
    loader = build_eval_loader(config.Global, torch.device("cpu"))
    assert apply_data_cache(loader, "ram", None, progress=False)
    calibration = build_calibration_set(config.Global, torch.device("cpu"), loader)
    assert calibration is not None and calibration.num_samples == 128
    model = build_model(config.Global)
    reference, fast = analyse_both(
        model, loader, tmp_path, pruned_ratios=(0.3, 0.6), adaptive_bn=True, calibration=calibration.loader
    )
    assert variant_metrics(fast) == variant_metrics(reference)
    assert len(variant_metrics(fast)) >= 2 * 15
    settings = fast["fingerprint"]["settings"]
    assert settings["adaptive_bn"] is True and isinstance(settings["calibration"], str) and settings["calibration"]
    assert {info["mode"] for info in fast["params"].values()} == {"mask"}


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_adaptive_bn_loss_is_the_loss_after_reestimating_the_affected_layers(engine: str, tmp_path: Path) -> None:
    model = randomize(tiny_models.tiny_resnet())
    data = pseudo_labelled(model, batches(count=2))
    calibration = calibration_batches()
    ratios = (0.3, 0.6)
    analysis_prune(model, data, tmp_path / "bn.pkl", pruned_ratios=ratios, metric="ce", engine=engine,
                   adaptive_bn=True, calibration=calibration, progress=False)  # fmt: skip
    analysis_prune(model, data, tmp_path / "plain.pkl", pruned_ratios=ratios, metric="ce", engine=engine,
                   progress=False)  # fmt: skip
    adaptive, plain = load_sensitivities(tmp_path / "bn.pkl"), load_sensitivities(tmp_path / "plain.pkl")
    sidecar = load_sidecar(tmp_path / "bn.pkl")
    example = data[0][0]
    graph = build_dependency_graph(model, example)
    baseline = evaluate(model, data).ce
    differing = 0
    for param in find_prunable(model, example):
        if not param.prunable:
            continue
        assert sidecar["params"][param.name]["mode"] == "mask"
        conv = model.get_submodule(param.module_name)
        for ratio in ratios:
            group = removal_group(graph, conv, select_channels(l1_norm(conv.weight), ratio))
            with masked(graph, group), reestimated(model, affected_batchnorms(graph, [group]), calibration):
                expected = evaluate(model, data)
            assert sidecar["params"][param.name]["variants"][f"{ratio:g}"]["ce"] == pytest.approx(expected.ce, rel=1e-9)
            assert adaptive[param.name][ratio] == pytest.approx(relative_loss(baseline, expected.ce, "ce"), rel=1e-9)
            differing += abs(adaptive[param.name][ratio] - plain[param.name][ratio]) > 1e-3
    assert differing >= 3  # re-estimation changes the numbers of the params whose removal reaches a BatchNorm


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_physical_mode_param_is_evaluated_on_the_recalibrated_pruned_copy(engine: str, tmp_path: Path) -> None:
    model = randomize(engine_models.layernorm_cnn())
    data = pseudo_labelled(model, batches(count=2))
    calibration = calibration_batches()
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), metric="ce", engine=engine,
                   adaptive_bn=True, calibration=calibration, progress=False)  # fmt: skip
    info = load_sidecar(tmp_path / "s.pkl")["params"]["0.weight"]
    assert info["mode"] == "physical"
    channels = select_channels(l1_norm(model[0].weight), 0.5)
    smaller = pruned_copy(model, "0", channels, data[0][0])
    stale = evaluate(smaller, data).ce
    stats = recalibrate_copy(model, smaller, [("0", channels)], data[0][0], calibration)
    assert stats.layers == ["4"] and stats.images == 16  # the BatchNorm after the conv consuming the LayerNorm
    expected = evaluate(smaller, data).ce
    assert info["variants"]["0.5"]["ce"] == pytest.approx(expected, rel=1e-9)
    assert abs(expected - stale) > 1e-3 * abs(stale)  # the re-estimation mattered


def tiny_analysis(path: Path, adaptive_bn: bool, calibration=None, **kwargs) -> None:
    torch.manual_seed(0)
    model = randomize(tiny_models.tiny_cnn())
    data = pseudo_labelled(model, batches(count=1))
    analysis_prune(model, data, path, pruned_ratios=(0.5,), adaptive_bn=adaptive_bn, calibration=calibration,
                   progress=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize(("first", "second"), [(False, True), (True, False)])
def test_resuming_with_the_other_adaptive_bn_setting_is_refused(first: bool, second: bool, tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    tiny_analysis(path, first, calibration_batches() if first else None)
    content = path.read_bytes()
    with pytest.raises(AnalysisFileError, match=rf"adaptive_bn {first!r} \(this run uses {second!r}\)"):
        tiny_analysis(path, second, calibration_batches() if second else None)
    assert path.read_bytes() == content


def test_resuming_adaptive_bn_needs_the_same_calibration_images(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    tiny_analysis(path, True, calibration_batches())
    stored = load_sidecar(path)["fingerprint"]["settings"]
    assert stored["adaptive_bn"] is True and isinstance(stored["calibration"], str)
    tiny_analysis(path, True, calibration_batches())  # same images: resumes
    with pytest.raises(AnalysisFileError, match="calibration"):
        tiny_analysis(path, True, calibration_batches(count=1, size=4))


def read_header(path: Path) -> list[str]:
    with path.open(newline="") as handle:
        return next(csv.reader(handle))


def test_csv_metric_columns_are_suffixed_with_adaptive_bn(tmp_path: Path) -> None:
    tiny_analysis(tmp_path / "bn.pkl", True, calibration_batches())
    tiny_analysis(tmp_path / "plain.pkl", False)
    long_bn, wide_bn = (read_header(export_csv(tmp_path / "bn.pkl", style=s)) for s in ("long", "wide"))
    long_plain, wide_plain = (read_header(export_csv(tmp_path / "plain.pkl", style=s)) for s in ("long", "wide"))
    assert long_bn[:6] == ["parameter", "sparsity", "top1_adaptive_bn", "top5_adaptive_bn", "loss_adaptive_bn",
                           "relative_loss_adaptive_bn"]  # fmt: skip
    assert long_plain[:6] == ["parameter", "sparsity", "top1", "top5", "loss", "relative_loss"]
    assert long_bn[6:] == long_plain[6:] and "_adaptive_bn" not in ",".join(long_bn[6:])  # costs are not measured
    assert wide_bn == ["layername_adaptive_bn", "0.5"] and wide_plain == ["layername", "0.5"]


def test_report_states_adaptive_bn(tmp_path: Path) -> None:
    tiny_analysis(tmp_path / "bn.pkl", True, calibration_batches())
    tiny_analysis(tmp_path / "plain.pkl", False)
    with_bn = write_report(tmp_path / "bn.pkl", tmp_path / "bn_report").html.read_text()
    without = write_report(tmp_path / "plain.pkl", tmp_path / "plain_report").html.read_text()
    assert "adaptive BN" in with_bn and "re-estimated on the calibration images" in with_bn
    assert "adaptive BN" not in without


def test_adaptive_bn_without_calibration_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="adaptive_bn=True needs calibration"):
        tiny_analysis(tmp_path / "s.pkl", True, None)
    assert not (tmp_path / "s.pkl").exists()


def yaml_config(tmp_path: Path, data: Path, **global_extra) -> Path:
    analysis = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "adaptive_bn": True, "pruned_ratios": [0.5]}
    return write_config(
        tmp_path / "cfg.yaml", {"Global": tiny_global(data, **global_extra), "SensitivityAnalysis": analysis}
    )


def test_yaml_adaptive_bn_runs_through_the_cli_and_is_recorded(cli: Cli, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_images(data, "list", [i % 10 for i in range(20)])
    write_train_list(data, 10)
    result = cli("--config_path", yaml_config(tmp_path, data), "--quiet")
    assert result.code == 0, result.err
    sidecar = load_sidecar(tmp_path / "out" / "s.pkl")
    settings = sidecar["fingerprint"]["settings"]
    assert settings["adaptive_bn"] is True and isinstance(settings["calibration"], str) and settings["calibration"]
    assert sidecar["config"]["SensitivityAnalysis"]["adaptive_bn"] is True
    assert load_sensitivities(tmp_path / "out" / "s.pkl")  # losses were recorded


def test_yaml_adaptive_bn_with_calib_samples_zero_exits_2_naming_both_keys(cli: Cli, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_images(data, "list", [i % 10 for i in range(20)])
    result = cli("--config_path", yaml_config(tmp_path, data, calib_samples=0))
    assert result.code == 2
    last = result.err.strip().splitlines()[-1]
    assert "SensitivityAnalysis.adaptive_bn" in last and "Global.calib_samples" in last
    assert "Traceback" not in result.err and not (tmp_path / "out" / "s.pkl").exists()


def test_adaptive_bn_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = randomize(tiny_models.tiny_resnet())
    model.layer1.bn1.momentum = 0.3
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = pseudo_labelled(model, batches(count=1))
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), adaptive_bn=True,
                   calibration=calibration_batches(), progress=False)  # fmt: skip
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # statistics restored bit-exactly
    assert model.layer1.bn1.momentum == 0.3
    assert not any(m.training for m in model.modules())

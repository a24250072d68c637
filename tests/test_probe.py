"""The recovered plan method: the measured search's finalists each recovered briefly (the same steps and batches), the
best after that kept; probe scores stored in the search log so a rerun trains nothing again; from the command line with
the config's TrainConfig."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from analysis import analysis_prune
from analysis.config import load_config
from analysis.errors import ConfigError
from analysis.inputs.build import build_inputs
from analysis.io.results import load_sidecar
from analysis.io.search_log import search_log_path
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.structure.groups import eval_mode
from analysis.workflow.probe import build_probe

import tiny_models
from helpers import (
    TINY_MODELS,
    CliResult,
    FakeProbe,
    batches,
    calibration_batches,
    pseudo_labelled,
    randomize,
    tiny_global,
    write_config,
    write_train_list,
)

SETTINGS = SearchSettings(evaluations=10, calibration_images=8)


def test_the_probe_decides_among_the_finalists_and_its_scores_are_reused(tmp_path: Path) -> None:
    model = randomize(tiny_models.tiny_resnet())
    data = pseudo_labelled(model, batches(count=3))
    calibration = calibration_batches(count=2)
    path = tmp_path / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=(0.25, 0.5, 0.75), progress=False)
    example = data[0][0]

    def plan(analysis: Path, probe: FakeProbe | None):  # type: ignore[no-untyped-def]
        scoring = PlanScoring(data, "data", calibration, calibration[:1], "calibration", probe)
        return build_measured_plan(model, example, analysis, 0.4, scoring, settings=SETTINGS, progress=False)

    measured = plan(path, None)  # its joint evaluations are in the search log: the recovered method reuses them
    probe = FakeProbe(measured.removals())  # the measured method's choice scores worst after "recovery"
    recovered = plan(path, probe)
    search = recovered.search
    assert search is not None and recovered.method == "recovered"
    assert [f["name"] for f in search["probed"]] == [f["name"] for f in search["finalists"]]
    assert len(probe.calls) == len(search["finalists"]) >= 2  # each finalist once, nothing else
    best = max(range(len(probe.calls)), key=lambda i: probe.top1(probe.calls[i]))
    assert sorted(recovered.removals()) == sorted(probe.calls[best])
    assert sorted(recovered.removals()) != sorted(measured.removals())
    assert search["chosen"] == search["probed"][best]["name"] and search["probe_steps"] == probe.steps
    assert "finalists each recovered briefly" in recovered.describe_method()

    again = FakeProbe(measured.removals())
    assert plan(path, again).removals() == recovered.removals() and again.calls == []  # taken from the search log
    other = FakeProbe(measured.removals(), setting="probe another recipe")
    plan(path, other)
    assert len(other.calls) == len(search["finalists"])  # another probe's scores are not reused


def _config(tmp_path: Path, data_root: Path, steps: int) -> Path:
    return write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(data_root, arch=f"{TINY_MODELS}:tiny_resnet"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.25, 0.5, 0.75]},
        "Recovery": {"probe_steps": steps, "batch_size": 8},
        "TrainConfig": {"epochs": 50, "learning_rate": 0.05, "optimizer_builder": {"optimizer": {"type": "Momentum"}}},
    })  # fmt: skip


def test_recovered_method_from_the_command_line(cli: Callable[..., CliResult], tmp_path: Path, list_data: Path) -> None:
    write_train_list(list_data, 24)
    config = _config(tmp_path, list_data, steps=3)
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.3", "--method", "recovered",
                 "--eval_budget", "6", "--no_report")  # fmt: skip
    assert result.code == 0, result.err
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    search = plan["search"]
    assert plan["method"] == "recovered" and len(search["probed"]) == len(search["finalists"])
    assert search["probe"].startswith("probe 3 steps ") and search["probe_steps"] == 3
    assert "after 3 recovery steps each (top1)" in result.out
    log = search_log_path(tmp_path / "s.pkl").read_text().splitlines()
    assert len([line for line in log if '"probe 3 steps' in line]) == len(search["finalists"])

    # compress reaches the same plan through the same step (its probes answered from the search log), then recovers it
    compressed = cli("compress", "--config_path", config, "SensitivityAnalysis.target_macs_reduction=0.3",
                     "SensitivityAnalysis.plan_method=recovered", "SensitivityAnalysis.eval_budget=6",
                     "TrainConfig.train_iter=2", "TrainConfig.eval_iter=2", "--no_report")  # fmt: skip
    assert compressed.code == 0, compressed.err
    kept = load_sidecar(tmp_path / "s.pkl")["plan"]
    assert kept["method"] == "recovered" and kept["groups"] == plan["groups"] and kept["recovery"]["steps"] == 2
    assert search_log_path(tmp_path / "s.pkl").read_text().splitlines() == log

    # the probe trains: the same plan scored twice gives the same metrics (same seed, same batches), and a shorter
    # probe gives others
    loaded = load_config(config)
    inputs = build_inputs(loaded, progress=False, calibration=True)
    probe = build_probe(loaded, inputs)
    removals = [("conv1", [0, 1])]
    with eval_mode(inputs.model):
        first, second = probe.score(removals), probe.score(removals)
        shorter = build_probe(load_config(_config(tmp_path, list_data, steps=1)), inputs).score(removals)
    assert first == second
    assert first["ce"] != pytest.approx(shorter["ce"], rel=1e-6)
    assert torch.is_grad_enabled()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["Recovery.probe_steps=0"], r"Recovery\.probe_steps must be 1 or more"),
        (["Global.labels=none", "SensitivityAnalysis.metric=agreement", "SensitivityAnalysis.plan_method=recovered",
          "SensitivityAnalysis.target_macs_reduction=0.3"], r"plan_method: recovered scores plans on top1"),
    ],
)  # fmt: skip
def test_bad_probe_settings_are_one_sentence(
    tmp_path: Path, list_data: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, list_data, steps=3), overrides)

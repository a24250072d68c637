"""``run.py compress`` on the shipped ACT config: it analyses, prunes ChannelPrune's ratios, recovers the model by
distillation (better than the pruned model at once), records every stage, exports files that load and match their
ONNX, resumes to the same result, refuses bad training blocks with one sentence, and gives the one-process result
under torchrun with two CPU processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from analysis.config import load_config
from analysis.engine.evaluate import evaluate
from analysis.inputs.build import Inputs, build_inputs
from analysis.io import sidecar as schema
from analysis.workflow.compress import CompressResult, _Run, run_compress
from analysis.workflow.report import write_report_files

from helpers import REPO, CliResult, assert_user_error

ACT = REPO / "configs" / "act" / "digits_resnet_prune_dis.yaml"
# a quick slice: one analysed ratio; BatchNorm re-estimated on 256 images; 12 steps of 64 images, evaluated every 6 on
# 200 of the validation images
SETTINGS = ["SensitivityAnalysis.pruned_ratios=[0.3]", "SensitivityAnalysis.report=false", "Recovery.batch_size=64",
            "TrainConfig.train_iter=12", "TrainConfig.eval_iter=6", "TrainConfig.origin_metric=null",
            "Global.calib_samples=256", "Global.max_samples=200"]  # fmt: skip


def act_config(folder: Path) -> Path:
    """The shipped ACT config with absolute paths, its outputs in ``folder``."""
    raw = yaml.safe_load(ACT.read_text())
    raw["Global"].update(arch=str(REPO / raw["Global"]["arch"]), model_dir=str(REPO / raw["Global"]["model_dir"]),
                         data_dir=str(REPO / raw["Global"]["data_dir"]))  # fmt: skip
    raw["SensitivityAnalysis"] = {"analysis_file": str(folder / "sensitivity.pkl")}
    path = folder / "act.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CompressResult]:
    folder = tmp_path_factory.mktemp("compress")
    config = load_config(act_config(folder), SETTINGS)
    return folder, run_compress(config, progress=False)


def test_compress_recovers_what_pruning_at_once_lost(compressed: tuple[Path, CompressResult]) -> None:
    folder, result = compressed
    assert result.plan is not None and result.plan.source == "ChannelPrune"
    listed = {"stem.0.weight", "layer1.0.conv1.weight", "layer2.0.conv1.weight", "layer3.0.conv1.weight"}
    assert listed <= set(result.plan.ratios)  # with the params coupled to them
    assert {result.plan.ratios[name] for name in listed} == {0.25}
    assert result.one_shot["top1"] < result.dense["top1"] - 0.2  # pruning at once costs a lot on this model
    assert result.recovered["top1"] > result.one_shot["top1"] + 0.2
    assert result.recovered["top1"] >= result.dense["top1"] - 0.02
    assert [e.step for e in result.recovery.history] == [6, 12] and result.recovery.steps == 12
    assert (folder / "compress" / "last.pt").is_file() and (folder / "compress" / "best.pt").is_file()
    assert "step 12/12" in (folder / "compress" / "train.log").read_text()


def test_every_stage_is_recorded_with_the_plan(compressed: tuple[Path, CompressResult]) -> None:
    folder, result = compressed
    sidecar = schema.load(folder / "sensitivity.pkl")
    assert sidecar is not None and sidecar.plan is not None and sidecar.plan.recovery is not None
    recovery = sidecar.plan.recovery
    assert recovery.dense == result.dense and recovery.one_shot == result.one_shot
    assert recovery.recovered == result.recovered and recovery.reestimated == result.reestimated
    assert (recovery.steps, recovery.total_steps, recovery.best_step) == (12, 12, result.recovery.best.step)
    assert recovery.recipe is not None and recovery.recipe["optimizer"]["type"] == "Momentum"
    assert recovery.distillation == {"pairs": [{"loss": "l2", "teacher": "fc", "student": "fc", "alpha": 1.0}]}
    assert recovery.exported is not None and set(recovery.exported) >= {"model", "state_dict", "onnx"}


def test_the_report_shows_each_stage_of_the_recovered_plan(compressed: tuple[Path, CompressResult]) -> None:
    folder, result = compressed
    page = Path(write_report_files(folder / "sensitivity.pkl", None)[-1]).read_text()
    stages = (f"dense {result.dense['top1']:.4f} -&gt; pruned at once {result.one_shot['top1']:.4f} -&gt; BatchNorm "
              f"re-estimated")  # fmt: skip
    assert "top1 (run.py compress)" in page and stages in page
    assert f"recovered {result.recovered['top1']:.4f}" in page and "12/12 steps" in page


def test_the_exported_model_is_the_recovered_one_and_matches_its_onnx(compressed: tuple[Path, CompressResult]) -> None:
    ort = pytest.importorskip("onnxruntime")
    folder, result = compressed
    model = torch.load(result.exported["model"], weights_only=False).eval()  # our own file
    best = torch.load(folder / "compress" / "best.pt", weights_only=True)
    assert all(torch.equal(value, best[name]) for name, value in model.state_dict().items())
    images = torch.randn(8, 3, 28, 28)
    with torch.no_grad():
        expected = model(images).numpy()
    session = ort.InferenceSession(str(result.exported["onnx"]), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
    assert np.abs(output - expected).max() < 1e-4
    channels = json.loads(Path(result.exported["channels"]).read_text())
    assert channels["recovery"]["steps"] == 12


def test_a_rerun_resumes_from_the_last_checkpoint_to_the_same_result(compressed: tuple[Path, CompressResult]) -> None:
    folder, first = compressed
    again = run_compress(load_config(folder / "act.yaml", SETTINGS), progress=False)
    assert again.recovery.resumed_from == 12 and again.recovered == first.recovered
    assert (
        again.recovered
        == evaluate(
            torch.load(first.exported["model"], weights_only=False).eval(),
            build_inputs(load_config(folder / "act.yaml", SETTINGS)).loader,
        ).metrics()
    )


def test_a_checkpoint_of_another_recipe_is_refused(compressed: tuple[Path, CompressResult], cli: Any) -> None:
    folder, _ = compressed
    result: CliResult = cli("compress", "--config_path", folder / "act.yaml", *SETTINGS, "TrainConfig.train_iter=6")
    assert_user_error(result, r"last\.pt is the checkpoint of another run .*start over with --fresh")


def test_an_unknown_optimizer_is_exit_2_before_anything_loads(tmp_path: Path, cli: Any) -> None:
    path = act_config(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["TrainConfig"]["optimizer_builder"]["optimizer"]["type"] = "Lamb"
    path.write_text(yaml.safe_dump(raw))
    result = cli("compress", "--config_path", path)
    assert_user_error(result, r"TrainConfig\.optimizer_builder\.optimizer\.type 'Lamb' has no PyTorch counterpart")
    assert not (tmp_path / "sensitivity.pkl").exists() and not (tmp_path / "compress").exists()


@pytest.mark.slow
def test_two_cpu_processes_under_torchrun_give_the_one_process_result(
    compressed: tuple[Path, CompressResult], tmp_path: Path
) -> None:
    folder, single = compressed
    shutil.copy(folder / "sensitivity.pkl", tmp_path / "sensitivity.pkl")  # the analysis is done: compress resumes it
    shutil.copy(folder / "sensitivity.pkl.json", tmp_path / "sensitivity.pkl.json")
    config = act_config(tmp_path)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(REPO / "run.py"), "compress", "--config_path", str(config), "--quiet",
                           *SETTINGS, "SensitivityAnalysis.export_onnx=false"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top1: dense") == 1  # the first process prints
    sidecar = schema.load(tmp_path / "sensitivity.pkl")
    assert sidecar is not None and sidecar.plan is not None and sidecar.plan.recovery is not None
    recovery = sidecar.plan.recovery
    assert recovery.processes == 2 and recovery.steps == 12
    assert recovery.one_shot == single.one_shot  # the same pruned model on every process
    # each process normalises its half of every batch with its own BatchNorm statistics: the same recipe, not the
    # same arithmetic, so the results agree within a tolerance
    assert recovery.recovered is not None and abs(recovery.recovered["top1"] - single.recovered["top1"]) <= 0.02
    two = torch.load(tmp_path / "compress" / "best.pt", weights_only=True)
    one = torch.load(folder / "compress" / "best.pt", weights_only=True)
    assert (two["fc.weight"] - one["fc.weight"]).norm() <= 0.05 * one["fc.weight"].norm()


def test_an_unwritable_output_dir_is_refused_before_anything_loads(tmp_path: Path, cli: Any) -> None:
    path = act_config(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder")
    result = cli("compress", "--config_path", path, f"Recovery.output_dir={tmp_path / 'taken' / 'compress'}")
    assert_user_error(result, r"Recovery\.output_dir")
    assert not (tmp_path / "sensitivity.pkl").exists()


def test_evaluations_run_under_the_configs_numerics(tmp_path: Path) -> None:
    """The dense, one-shot, re-estimated and recovery evaluations use Global.numerics, as the analysis does."""
    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_autocast_enabled("cpu"))
            return torch.zeros(images.shape[0], 10).index_fill(1, torch.tensor([0]), 1.0)

    batches = [(torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long))]
    for mode, autocast in (("bf16", True), ("exact", False)):
        config = load_config(act_config(tmp_path), [f"Global.numerics={mode}"])
        inputs = Inputs(Probe(), batches, torch.zeros(1, 3, 4, 4))  # type: ignore[arg-type]  # any batches evaluate
        assert _Run(config, inputs, False).measure(Probe(), "probe")["top1"] == 1.0
        assert seen.pop() is autocast

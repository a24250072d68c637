"""torchrun on the CPU (gloo): two ranks write exactly the file one process writes, and resume leftover shards."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from analysis.cli import _job as cli_job
from analysis.config import Config, load_config
from analysis.inputs.build import Inputs
from analysis.io.results import load_sensitivities, load_sidecar, save_sensitivities, save_sidecar
from analysis.scale.distributed import Rank

from helpers import REPO

DEMO = REPO / "configs" / "demo" / "digits_resnet.yaml"
# a quick slice of the demo analysis: 200 images, two ratios, 6 of the 15 convs
SETTINGS = ["--pruned_ratios", "0.2", "0.4", "--no_report", "--quiet", "Global.max_samples=200",
            "SensitivityAnalysis.prune_params_name=[stem.0.weight,layer1.0.conv1.weight,layer1.1.conv1.weight,"
            "layer2.0.conv1.weight,layer2.0.conv2.weight,layer3.1.conv1.weight]"]  # fmt: skip


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same numerics in every process; no oversubscription
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def single(target: Path) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--config_path", str(DEMO), "--analysis_file", str(target), *SETTINGS]


def torchrun(target: Path, ranks: int = 2) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, str(REPO / "run.py"), "--config_path", str(DEMO), "--analysis_file", str(target), *SETTINGS]


def test_two_ranks_write_the_single_process_file_and_resume_leftover_shards(tmp_path: Path) -> None:
    reference = tmp_path / "single" / "s.pkl"
    done = run(single(reference), REPO)
    assert done.returncode == 0, done.stderr
    expected = reference.read_bytes()

    target = tmp_path / "ranks" / "s.pkl"
    result = run(torchrun(target), REPO)
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() == expected
    assert sorted(p.name for p in target.parent.iterdir()) == ["s.pkl", "s.pkl.json", "s.pkl.ratios.yaml"]  # no shards
    assert result.stdout.count("baseline: top1=") == 1  # one rank prints
    ranks, one = ({k: v for k, v in load_sidecar(p)["baseline"].items() if k != "seconds"} for p in (target, reference))
    assert ranks == one  # measured once, by rank 0, with the same numbers

    # a crashed job left a shard holding one (deliberately marked) result: a rerun keeps it and evaluates the rest
    resumed = tmp_path / "resumed" / "s.pkl"
    marked = {"layer2.0.conv2.weight": {0.2: 0.123456}}
    save_sensitivities(resumed.with_name("s.rank1.pkl"), marked)
    save_sidecar(resumed.with_name("s.rank1.pkl"), {**load_sidecar(reference), "params": {}})
    result = run(torchrun(resumed), REPO)
    assert result.returncode == 0, result.stderr
    final = load_sensitivities(resumed)
    assert final["layer2.0.conv2.weight"][0.2] == 0.123456  # not evaluated again
    assert {n: c for n, c in final.items() if n != "layer2.0.conv2.weight"} == {
        n: c for n, c in load_sensitivities(reference).items() if n != "layer2.0.conv2.weight"
    }
    assert not resumed.with_name("s.rank1.pkl").exists()


def test_a_rank_runs_on_its_local_gpu_and_leaves_the_loaded_config_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(DEMO, ["Global.device=auto"])
    built: list[Config] = []

    class Built(Exception):
        """Stops the rank once its inputs would be built from the config it derived."""

    def build_inputs(derived: Config, progress: bool | None = None, calibration: bool = False) -> Inputs:
        built.append(derived)
        raise Built

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli_job, "build_inputs", build_inputs)
    with pytest.raises(Built):
        cli_job.torchrun_job(config, argparse.Namespace(verbose=True, overwrite=False), Rank(0, 4, local_rank=3))
    assert built[0].Global.device == "cuda:1"  # local rank 3 on the node's 2 GPUs
    assert built[0].command_line_keys == config.command_line_keys  # worked out, not the user's choice
    assert config.Global.device == "auto"

"""torchrun on the CPU (gloo): two ranks write exactly the file one process writes, and resume leftover shards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from analysis.io.results import load_sensitivities, load_sidecar, save_sensitivities, save_sidecar

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

"""The exactness promises on a CUDA GPU, under ``Global.numerics: exact`` (float32, TF32 off, deterministic cuDNN).

Each test repeats on the GPU a promise the CPU suite holds: masked evaluation equals physical removal on every
analysed unit, the fast engine writes the reference engine's bytes (plain and with adaptive BN), a killed run resumes
to an uninterrupted run's bytes, a speed mode is recorded and never resumed by another; and two that exist only on a
GPU: exact convolutions agree with float64 (TF32 would not), and a GPU analysis agrees with a CPU analysis of the same
model and data within :data:`CPU_GPU_TOLERANCE`. Without a GPU every test here is skipped with the reason.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from analysis.compat.paddleslim import analysis_prune
from analysis.errors import AnalysisFileError
from analysis.inputs.numerics import numerics
from analysis.io.results import load_sensitivities, load_sidecar

from helpers import (
    ENGINE_MODELS,
    REPO,
    analyse_both,
    batches,
    calibration_batches,
    pseudo_labelled,
    randomize,
    tiny_global,
    variant_metrics,
    write_config,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible to torch)"),
]

CUDA = torch.device("cuda")
CPU_GPU_TOLERANCE = 1e-4
"""Largest difference between a CPU and a GPU analysis's relative ce losses (exact float32 on both: their kernels
sum in other orders, about 1e-6 relative per logit on these models)."""
UNITS = ("conv", "linear", "heads")


def small_vit() -> nn.Module:
    """A two-layer ViT at 32 px: attention heads and MLP neurons are its units."""
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )


def model_named(arch: str) -> nn.Module:
    torch.manual_seed(0)
    model = small_vit() if arch == "vit" else torchvision.models.get_model(arch, weights=None, num_classes=10)
    return randomize(model)


def on_gpu(data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.to(CUDA), labels.to(CUDA)) for images, labels in data]


def test_exact_convolutions_agree_with_float64_where_tf32_would_not() -> None:
    generator = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    images = torch.randn(8, 64, 32, 32, generator=generator)
    with torch.inference_mode():
        reference = conv.double()(images.double())
    gpu_conv = conv.float().to(CUDA)
    with numerics("exact", CUDA), torch.inference_mode():
        exact = gpu_conv(images.to(CUDA)).double().cpu()
    scale = float(reference.abs().max())
    assert float((exact - reference).abs().max()) / scale < 1e-5
    if torch.cuda.get_device_capability()[0] >= 8:  # TF32 exists from Ampere on: there it is visibly coarser
        with numerics("tf32", CUDA), torch.inference_mode():
            tf32 = gpu_conv(images.to(CUDA)).double().cpu()
        assert float((tf32 - reference).abs().max()) / scale > 1e-5


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v2", "efficientnet_b0", "vit"])
def test_masked_equals_physical_on_every_unit(arch: str, tmp_path: Path) -> None:
    """Every unit the CPU evaluates by masking is masked on the GPU too (each checked against a physically pruned
    copy within the exact tolerance); none moves to the physical path because of the GPU's arithmetic."""
    model = model_named(arch)
    data = pseudo_labelled(model, batches(count=2, size=4, resolution=32))
    modes = {}
    for device in ("cpu", "cuda"):
        placed = copy.deepcopy(model).to(device)
        path = tmp_path / f"{device}.pkl"
        analysis_prune(placed, on_gpu(data) if device == "cuda" else data, path, pruned_ratios=[0.3], metric="ce",
                       units=UNITS, progress=False)  # fmt: skip
        params = load_sidecar(path)["params"]
        modes[device] = {name: param.get("mode") for name, param in params.items()}
    assert modes["cuda"] == modes["cpu"]
    assert "mask" in modes["cuda"].values()


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v2"])
def test_fast_equals_reference_byte_for_byte(arch: str, tmp_path: Path) -> None:
    model = model_named(arch).to(CUDA)
    data = pseudo_labelled(model, on_gpu(batches(count=2, size=4, resolution=32)))
    reference, fast = analyse_both(model, data, tmp_path, pruned_ratios=(0.3, 0.6), metric="ce")
    assert variant_metrics(fast) == variant_metrics(reference)


def test_adaptive_bn_fast_equals_reference(tmp_path: Path) -> None:
    model = model_named("resnet18").to(CUDA)
    data = pseudo_labelled(model, on_gpu(batches(count=2, size=4, resolution=32)))
    calibration = on_gpu(calibration_batches(count=2, size=4, resolution=32))
    reference, fast = analyse_both(
        model, data, tmp_path, pruned_ratios=(0.3,), metric="ce", adaptive_bn=True, calibration=calibration
    )
    assert variant_metrics(fast) == variant_metrics(reference)


def test_a_gpu_analysis_agrees_with_a_cpu_analysis(tmp_path: Path) -> None:
    model = model_named("resnet18")
    data = pseudo_labelled(model, batches(count=2, size=4, resolution=32))
    analysis_prune(model, data, tmp_path / "cpu.pkl", pruned_ratios=[0.3, 0.6], metric="ce", progress=False)
    gpu_model = copy.deepcopy(model).to(CUDA)
    analysis_prune(gpu_model, on_gpu(data), tmp_path / "gpu.pkl", pruned_ratios=[0.3, 0.6], metric="ce",
                   progress=False)  # fmt: skip
    cpu, gpu = load_sensitivities(tmp_path / "cpu.pkl"), load_sensitivities(tmp_path / "gpu.pkl")
    assert cpu.keys() == gpu.keys() and len(cpu) == 20
    worst = max(abs(cpu[name][ratio] - gpu[name][ratio]) for name in cpu for ratio in cpu[name])
    assert worst <= CPU_GPU_TOLERANCE
    assert load_sidecar(tmp_path / "gpu.pkl")["numerics"]["machines"][0]["device"] == "cuda"


def test_the_mode_and_the_gpu_are_recorded_and_another_mode_does_not_resume(tmp_path: Path) -> None:
    model = model_named("resnet18").to(CUDA)
    data = pseudo_labelled(model, on_gpu(batches(count=2, size=4, resolution=32)))
    path = tmp_path / "a.pkl"
    analysis_prune(model, data, path, pruned_ratios=[0.3], metric="ce", progress=False, numerics="bf16")
    record = load_sidecar(path)["numerics"]
    assert record["mode"] == "bf16" and record["logit_noise"] > 0
    machine = record["machines"][0]
    assert machine["device"] == "cuda" and machine["name"] == torch.cuda.get_device_name(CUDA)
    assert machine["cuda"] == torch.version.cuda and machine["cudnn"] == str(torch.backends.cudnn.version())
    before = path.read_bytes()
    with pytest.raises(AnalysisFileError, match="numerics 'bf16'"):
        analysis_prune(model, data, path, pruned_ratios=[0.3], metric="ce", progress=False)
    assert path.read_bytes() == before


def test_a_killed_gpu_run_resumes_to_the_same_file(tmp_path: Path, list_data: Path) -> None:
    def config(name: str) -> Path:
        block = tiny_global(list_data, arch=f"{ENGINE_MODELS}:slow_cnn", device="cuda",
                            arch_kwargs={"num_classes": 10, "delay": 0.05})  # fmt: skip
        section = {"analysis_file": str(tmp_path / name / "s.pkl"), "pruned_ratios": [0.2, 0.4, 0.6, 0.8],
                   "engine": "reference"}  # fmt: skip
        return write_config(tmp_path / f"{name}.yaml", {"Global": block, "SensitivityAnalysis": section})

    def command(path: Path) -> list[str]:
        return [sys.executable, str(REPO / "run.py"), "--config_path", str(path)]

    def done(path: Path) -> int:
        return sum(len(curve) for curve in load_sensitivities(path).values())

    subprocess.run(command(config("whole")), check=True, capture_output=True, timeout=300)
    expected = (tmp_path / "whole" / "s.pkl").read_bytes()
    resumed, target = config("resumed"), tmp_path / "resumed" / "s.pkl"
    process = subprocess.Popen(command(resumed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if target.exists() and done(target) >= 2:
            break
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert 2 <= done(target) < 12, "the kill came too late to test resuming"
    finished = subprocess.run(command(resumed), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert target.read_bytes() == expected

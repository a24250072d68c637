#!/usr/bin/env python
"""Speed of recovery (``run.py compress``'s training loop) against a plain PyTorch loop doing the same work.

Two measurements, side by side in one run:

* **Against a plain loop** (the issue's GPU goal: at least 0.8x): a torchvision model (``--arch``, random weights,
  nothing downloaded) is the teacher and a copy pruned by Torch-Pruning's magnitude pruner (``--ratio`` of every
  prunable group, classifier kept) the student. Both loops distil the student from the teacher for ``--steps`` steps
  of ``--batch-size`` images: the teacher's forward without gradients, the student's forward, the l2 distillation
  loss of the logits, backward, a momentum SGD step and a learning-rate step, under bf16 autocast on a GPU (float32
  on a CPU). They read the same synthetic ImageNet-style JPEG folder (``bench_data.py``'s generator, cached under
  ``benchmarks/_data/``) with the same training augmentation (random resized crop to ``--size``, flip) and
  ``--workers`` loader processes. **ours** is :func:`analysis.recovery.train.recover` with the project's training
  batches (the checkpoint and evaluation at the end excluded); **plain** is a loop over torchvision's ImageFolder and
  DataLoader (shuffled, pinned memory) as a user would write it. Each is timed from the loader's start to the last
  step's end (synchronised), interleaved plain/ours ``--repeats`` times with fresh copies of the student; the ratio
  of images/s is printed per pair. A GPU-only loop over one batch kept on the device shows whether the data bound
  both.
* **Demo epoch** (the issue's CPU goal: under 2 minutes): one epoch of the demo MobileNetV2's recovery
  (``configs/demo/digits_mobilenet.yaml``, 50% fewer MACs by the knapsack plan, batch 64) through ``run.py compress``'s
  own function, timed per epoch.

Run from the repo root: ``python benchmarks/bench_recovery_speed.py`` (``--help`` lists the options); numbers go to
``--out`` as JSON too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch_pruning as tp
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2 as T

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_data import ensure_dataset  # noqa: E402

from analysis.config import config_from_data, load_config  # noqa: E402
from analysis.inputs.build import build_inputs  # noqa: E402
from analysis.inputs.data import Preprocess, normalize_batch  # noqa: E402
from analysis.inputs.device import resolve_device  # noqa: E402
from analysis.recovery.act import read_distillation, read_train_config  # noqa: E402
from analysis.recovery.data import Sharding, build_train_batches  # noqa: E402
from analysis.recovery.train import RecoveryJob, recover  # noqa: E402
from analysis.workflow.compress import run_compress  # noqa: E402

RANDOM_BUT_STABLE = {"resnet": {"zero_init_residual": True}}
"""Random ResNets start with identity residual branches (torchvision's option): without it a random ResNet-152's
distillation loss was NaN within 9 steps on the H200 even at learning rate 1e-5; with it, 20 steps at 0.01 stayed
finite."""
LEARNING_RATE = 0.01  # --lr sets it


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pruned_student(teacher: nn.Module, example: torch.Tensor, ratio: float) -> nn.Module:
    """A copy of ``teacher`` with ``ratio`` of every prunable group removed by L1 magnitude (classifier kept)."""
    student = copy.deepcopy(teacher)
    classifiers = [module for module in student.modules() if isinstance(module, nn.Linear)][-1:]
    pruner = tp.pruner.MagnitudePruner(student, example, importance=tp.importance.MagnitudeImportance(p=1),
                                       pruning_ratio=ratio, ignored_layers=classifiers)  # fmt: skip
    pruner.step()
    return student


def bench_config(root: Path, arch: str, size: int, batch: int, workers: int, steps: int, device: str) -> Any:
    """The config of the comparison: the JPEG folder trains and (a 256-image subset) evaluates."""
    raw = {
        "Global": {"arch": arch, "arch_kwargs": RANDOM_BUT_STABLE.get(arch.rstrip("0123456789"), {}),
                   "data_dir": str(root), "batch_size": batch, "img_size": size,
                   "resize_size": size * 8 // 7, "num_workers": workers, "device": device, "max_samples": 256,
                   "calib_samples": 0},
        "Recovery": {"train_list": "val", "precision": "auto"},
        "TrainConfig": {"train_iter": steps, "eval_iter": steps, "learning_rate": LEARNING_RATE,
                        "optimizer_builder": {"optimizer": {"type": "Momentum"}}},
        "Distillation": {"loss": "l2"},
    }  # fmt: skip
    return config_from_data(raw, root / "bench.yaml")


def ours(config: Any, teacher: nn.Module, student: nn.Module, preprocess: Preprocess, folder: Path) -> float:
    """Images/s of the project's recovery loop (its own timing: loader start to the last step, synchronised)."""
    device = next(student.parameters()).device
    batches = build_train_batches(config, preprocess, labelled=False, sharding=Sharding(),
                                  pin_memory=device.type == "cuda")  # fmt: skip
    job = RecoveryJob(read_train_config(config.act_blocks["TrainConfig"]), read_distillation(None),
                      "bf16" if device.type == "cuda" else "fp32", 0.0, folder, "bench", preprocess, resume=False,
                      progress=False)  # fmt: skip
    outcome = recover(student, teacher, batches, lambda model: {"top1": 0.0}, job, {"top1": 0.0})
    return outcome.images_per_second


def plain_step(teacher: nn.Module, student: nn.Module, images: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One distillation step as a plain loop writes it: l2 on the logits, under bf16 autocast on a GPU."""
    autocast = torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=images.device.type == "cuda")
    with autocast:
        with torch.no_grad():
            target = teacher(images)
        loss = F.mse_loss(student(images).float(), target.float())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def plain(
    root: Path, teacher: nn.Module, student: nn.Module, preprocess: Preprocess, batch: int, workers: int, steps: int
) -> float:
    """Images/s of a plain loop doing the same work over torchvision's ImageFolder and DataLoader."""
    device = next(student.parameters()).device
    augment = T.Compose([T.RandomResizedCrop(preprocess.img_size, antialias=True), T.RandomHorizontalFlip(),
                         T.PILToTensor()])  # fmt: skip
    loader = DataLoader(datasets.ImageFolder(str(root / "val"), transform=augment), batch_size=batch, shuffle=True,
                        num_workers=workers, pin_memory=device.type == "cuda", drop_last=True)  # fmt: skip
    optimizer = torch.optim.SGD(student.parameters(), lr=LEARNING_RATE, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    teacher.eval()
    student.train()
    done = 0
    start = time.perf_counter()
    while done < steps:
        for uint8, _ in loader:
            plain_step(teacher, student, normalize_batch(uint8.to(device, non_blocking=True), preprocess), optimizer)
            schedule.step()
            done += 1
            if done == steps:
                break
    synchronise(device)
    return steps * batch / (time.perf_counter() - start)


def device_bound(teacher: nn.Module, student: nn.Module, images: torch.Tensor, steps: int) -> float:
    """Images/s of the same steps on one batch kept on the device: what the model alone allows."""
    device = images.device
    optimizer = torch.optim.SGD(student.parameters(), lr=LEARNING_RATE, momentum=0.9)
    student.train()
    start = None
    for step in range(steps + 2):
        if step == 2:  # two warm-up steps
            synchronise(device)
            start = time.perf_counter()
        plain_step(teacher, student, images, optimizer)
    synchronise(device)
    assert start is not None
    return steps * images.shape[0] / (time.perf_counter() - start)


def compare(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The interleaved comparison of the two loops."""
    root = Path(args.root)
    print(f"data: {root} ({ensure_dataset(root, args.images, 10, 0)})", flush=True)
    config = bench_config(root, args.arch, args.size, args.batch_size, args.workers, args.steps, args.device)
    inputs = build_inputs(config, progress=False)
    teacher = inputs.model.eval()
    preprocess = inputs.loader.preprocess
    student = pruned_student(teacher, inputs.example_input[:1], args.ratio)
    dense_params = sum(p.numel() for p in teacher.parameters())
    pruned_params = sum(p.numel() for p in student.parameters())
    print(f"{args.arch}: {dense_params / 1e6:.1f}M params, student {pruned_params / 1e6:.1f}M; batch "
          f"{args.batch_size}, {args.steps} steps, {args.workers} workers, {device}", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            plain_rate = plain(root, teacher, copy.deepcopy(student), preprocess, args.batch_size, args.workers,
                               args.steps)  # fmt: skip
            ours_rate = ours(config, teacher, copy.deepcopy(student), preprocess, Path(folder) / str(repeat))
            rows.append({"plain": plain_rate, "ours": ours_rate, "ratio": ours_rate / plain_rate})
            print(f"  pair {repeat + 1}: plain {plain_rate:.1f} img/s, ours {ours_rate:.1f} img/s, ours/plain "
                  f"{ours_rate / plain_rate:.3f}", flush=True)  # fmt: skip
    batch = next(iter(inputs.loader))[0][: args.batch_size].to(device)
    bound = device_bound(teacher, copy.deepcopy(student), batch, args.steps)
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"  median ours/plain {ratio:.3f} (goal >= 0.8: {'yes' if ratio >= 0.8 else 'NO'}); one batch kept on "
          f"the device: {bound:.1f} img/s", flush=True)  # fmt: skip
    return {"pairs": rows, "median_ratio": ratio, "device_bound": bound, "arch": args.arch,
            "batch_size": args.batch_size, "steps": args.steps, "workers": args.workers}  # fmt: skip


def demo_epoch(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per epoch of the demo MobileNetV2's recovery through run.py compress's function."""
    with tempfile.TemporaryDirectory() as folder:
        overrides = [f"Recovery.output_dir={folder}/compress", "Recovery.hflip=0", "Recovery.crop_scale=[0.6,1.0]",
                     "Recovery.batch_size=64", "SensitivityAnalysis.target_macs_reduction=0.5",
                     f"TrainConfig.epochs={args.demo_epochs}", "TrainConfig.learning_rate=0.005",
                     "TrainConfig.optimizer_builder.optimizer.type=Momentum", "TrainConfig.eval_iter=1000000",
                     f"Global.device={args.device}"]  # fmt: skip
        config = load_config(REPO_ROOT / "configs/demo/digits_mobilenet.yaml", overrides)
        result = run_compress(config, progress=False)
    outcome = result.recovery
    per_epoch = outcome.seconds / args.demo_epochs
    print(f"demo MobileNetV2, 50% fewer MACs: {per_epoch:.1f} s per epoch ({outcome.images_per_second:.0f} img/s; "
          f"goal under 120 s on the 2-core CPU: {'yes' if per_epoch < 120 else 'NO'}); top1 dense "
          f"{result.dense['top1']:.4f}, one-shot {result.one_shot['top1']:.4f}, after {args.demo_epochs} epoch(s) "
          f"{result.recovered['top1']:.4f}", flush=True)  # fmt: skip
    return {"seconds_per_epoch": per_epoch, "images_per_second": outcome.images_per_second,
            "top1": {"dense": result.dense["top1"], "one_shot": result.one_shot["top1"],
                     "recovered": result.recovered["top1"]}}  # fmt: skip


def main() -> None:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--ratio", type=float, default=0.3, help="share of each group the student loses")
    parser.add_argument("--images", type=int, default=1024 if gpu else 32)
    parser.add_argument("--size", type=int, default=224 if gpu else 64)
    parser.add_argument("--batch-size", type=int, default=128 if gpu else 8)
    parser.add_argument("--steps", type=int, default=30 if gpu else 3)
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--demo-epochs", type=int, default=1)
    parser.add_argument("--skip", choices=("compare", "demo"), action="append", default=[])
    parser.add_argument("--root", default=str(REPO_ROOT / "benchmarks" / "_data" / "recovery"))
    parser.add_argument("--out", default="bench_recovery_speed.json")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    args = parser.parse_args()
    globals()["LEARNING_RATE"] = args.lr
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"machine: {name}, {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    results: dict[str, Any] = {"device": name}
    if "compare" not in args.skip:
        results["compare"] = compare(args, device)
    if "demo" not in args.skip:
        results["demo"] = demo_epoch(args)
    Path(args.out).write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()

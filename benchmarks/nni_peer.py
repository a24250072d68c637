"""Run NNI 2.10's ``SensitivityAnalysis`` as an external peer for ``bench_engine.py``.

Runs in a separate Python that has NNI 2.10, torch and torchvision installed (not this project's ``analysis``
package, which it never imports). It does what a typical NNI user does: a torchvision model with random weights
(seeded), an ``ImageFolder(DATA/val)`` with the usual ImageNet preprocessing in a plain ``DataLoader`` that decodes
the images again for every evaluation, a ``val_func(model)`` returning top-1 accuracy, and
``SensitivityAnalysis(model, val_func, sparsities=ratios, prune_type="l1").analysis(...)`` over the Conv2d layers.

It prints (or writes to ``--out``) one JSON object::

    {"tool": "nni", "nni_version": ..., "torch_version": ..., "arch": ..., "seconds": ..., "val_seconds": ...,
     "evaluations": ..., "layers": ..., "peak_rss_mb": ..., "baseline": ..., "ratios": [...],
     "sensitivities": {layer: {ratio: top1}}}

``seconds`` is the wall time of building the ``SensitivityAnalysis`` and running its ``analysis`` (baseline
evaluation included); ``val_seconds`` the median wall time of one ``val_func`` call; ``evaluations`` the number of
``val_func`` calls NNI made; ``peak_rss_mb`` this process's VmHWM (DataLoader workers not included). Layer keys
are NNI's module names (``layer1.0.conv1``, not ``layer1.0.conv1.weight``); ratio keys are the sparsities as NNI
used them (sorted, rounded to two decimals), as strings.

The NNI Python (kept outside the repository; NNI 2.10 imports ``torch.utils.tensorboard``, hence tensorboard)::

    python3 -m venv /work/nni-venv
    /work/nni-venv/bin/pip install "nni==2.10" torch torchvision pillow tensorboard

Example::

    /work/nni-venv/bin/python benchmarks/nni_peer.py --data DIR --arch resnet18 --img-size 224 \\
        --resize-size 256 --batch-size 32 --ratios 0.1 0.2 0.3 0.4 --workers 2 --seed 0 --out nni.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nni
import torch
import torchvision
from nni.compression.pytorch.utils.sensitivity_analysis import SensitivityAnalysis
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_model(arch: str, seed: int) -> nn.Module:
    """Build torchvision ``arch`` with random weights drawn after ``torch.manual_seed(seed)``, in eval mode on CPU."""
    torch.manual_seed(seed)
    model = torchvision.models.get_model(arch, weights=None)
    return model.eval().to("cpu")


def build_loader(data: Path, img_size: int, resize_size: int, batch_size: int, workers: int) -> DataLoader:
    """The evaluation loader over ``data/val`` (ImageFolder layout) with the standard ImageNet preprocessing."""
    transform = transforms.Compose(
        [
            transforms.Resize(resize_size),
            transforms.CenterCrop(img_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(data / "val"), transform=transform)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers)


def top1_accuracy(model: nn.Module, loader: DataLoader) -> float:
    """Top-1 accuracy of ``model`` over one full pass of ``loader`` (the images are decoded again every time)."""
    model.eval()
    correct = 0
    total = 0
    with torch.no_grad():
        for images, labels in loader:
            predictions = model(images).argmax(dim=1)
            correct += int((predictions == labels).sum())
            total += int(labels.numel())
    if total == 0:
        raise ValueError("the evaluation loader yielded no images")
    return correct / total


class CountingValFunc:
    """Wraps ``val_func(model)`` to count its calls and record the wall time of each."""

    def __init__(self, val_func: Callable[[nn.Module], float]) -> None:
        """Wrap ``val_func``."""
        self.val_func = val_func
        self.seconds: list[float] = []

    @property
    def calls(self) -> int:
        """Number of calls so far."""
        return len(self.seconds)

    def __call__(self, model: nn.Module) -> float:
        """Evaluate ``model`` and record how long it took."""
        start = time.perf_counter()
        metric = self.val_func(model)
        self.seconds.append(time.perf_counter() - start)
        return metric


def conv_layer_names(model: nn.Module, limit: int | None, chosen: Sequence[str] | None = None) -> list[str]:
    """Names of the ``nn.Conv2d`` modules in module order: ``chosen`` ones only, or the first ``limit``, or all."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)]
    if chosen:
        missing = sorted(set(chosen) - set(names))
        if missing:
            raise SystemExit(f"--layer-names: not Conv2d modules of {type(model).__name__}: {', '.join(missing)}")
        return [name for name in names if name in set(chosen)]
    return names if limit is None else names[:limit]


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM from ``/proc/self/status``) in MiB; -1 if unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return -1.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run NNI's sensitivity analysis as described by ``args`` and return the result object."""
    model = build_model(args.arch, args.seed)
    loader = build_loader(args.data, args.img_size, args.resize_size, args.batch_size, args.workers)
    val_func = CountingValFunc(lambda m: top1_accuracy(m, loader))
    layers = conv_layer_names(model, args.layers, args.layer_names)
    start = time.perf_counter()
    analyser = SensitivityAnalysis(model, val_func, sparsities=args.ratios, prune_type="l1")
    sensitivities = analyser.analysis(val_args=[model], specified_layers=layers)
    seconds = time.perf_counter() - start
    return {
        "tool": "nni",
        "nni_version": nni.__version__,
        "torch_version": torch.__version__,
        "arch": args.arch,
        "seconds": seconds,
        "val_seconds": statistics.median(val_func.seconds),
        "evaluations": val_func.calls,
        "layers": len(sensitivities),
        "peak_rss_mb": peak_rss_mb(),
        "baseline": float(analyser.ori_metric),
        "ratios": [float(r) for r in analyser.sparsities],
        "sensitivities": {
            layer: {str(float(ratio)): float(metric) for ratio, metric in by_ratio.items()}
            for layer, by_ratio in sensitivities.items()
        },
    }


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Run NNI 2.10's SensitivityAnalysis (L1 filter pruning, top-1 accuracy) as a benchmark peer.",
    )
    parser.add_argument("--data", type=Path, required=True, help="dataset root; images are read from DATA/val")
    parser.add_argument("--arch", required=True, help="torchvision model name, e.g. resnet18")
    parser.add_argument("--img-size", type=int, default=224, help="center-crop size (default 224)")
    parser.add_argument("--resize-size", type=int, default=256, help="short-side resize before the crop (default 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="evaluation batch size (default 32)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4], help="pruning ratios")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model")
    parser.add_argument("--layers", type=int, default=None, help="analyse only the first N Conv2d layers")
    parser.add_argument("--layer-names", nargs="+", help="analyse exactly these Conv2d modules (e.g. layer1.0.conv1)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here (default: stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    if not all(0 < r < 1 for r in args.ratios):
        raise SystemExit("--ratios must lie strictly between 0 and 1 (NNI's pruner config requires it)")
    if args.layers is not None and args.layers < 1:
        raise SystemExit("--layers must be at least 1")
    text = json.dumps(run(args), indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

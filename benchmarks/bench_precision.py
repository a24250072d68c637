#!/usr/bin/env python
"""Adaptive precision and decision-driven sampling vs exact evaluation: image-forwards, run time, agreement.

Builds (once, under ``benchmarks/_data/``) a deterministic 5,000-image evaluation set from the shipped digits: each
image is one of the 1,797 digits (train and val splits), shifted by up to 2 pixels and with its colour channels
permuted, so the demo models classify it well but not perfectly. Then analyses a demo model with the fast engine
exactly, with adaptive precision and with decision-driven sampling at each ``--targets`` (one process, one run after
the other), and reports how many image-forwards each needed, the wall times, how many of the adaptive 95% intervals
contain the exact loss and, for each target, how many params' derived ratios equal the exact run's. The bound column
counts the params whose exact derived ratio interpolates between two ratios: decision-driven sampling evaluates
those two variants on every image, so ``2 x params x images`` image-forwards is the least any run reproducing the
exact ratios can spend.

    python benchmarks/bench_precision.py                       # demo MobileNetV2, 5,000 images, both modes
    python benchmarks/bench_precision.py --modes decision --targets 0.02
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("analysis") is None:
    sys.path.insert(0, str(REPO_ROOT))

from analysis import analysis_prune  # noqa: E402
from analysis.config import load_config  # noqa: E402
from analysis.inputs.data import apply_data_cache, build_eval_loader  # noqa: E402
from analysis.inputs.models import build_model  # noqa: E402
from analysis.io.results import load_sensitivities, load_sidecar  # noqa: E402
from analysis.planning.ratios import get_ratios_by_loss  # noqa: E402

DIGITS = REPO_ROOT / "datasets" / "digits"
BUCKETS = ((0.0, 0.01), (0.01, 0.05), (0.05, 0.2), (0.2, float("inf")))


def build_set(root: Path, images: int, seed: int) -> Path:
    """Write ``images`` shifted, channel-permuted digits with a val_list.txt (skipped when already there)."""
    listing = root / "val_list.txt"
    if listing.is_file() and sum(1 for _ in listing.open()) == images:
        return root
    sources = []
    for name in ("train_list.txt", "val_list.txt"):
        for line in (DIGITS / name).read_text().splitlines():
            path, label = line.rsplit(maxsplit=1)
            sources.append((DIGITS / path, int(label)))
    rng = np.random.default_rng(seed)
    permutations = list(itertools.permutations(range(3)))
    (root / "val").mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(images):
        path, label = sources[index % len(sources)]
        pixels = np.asarray(Image.open(path).convert("RGB"))
        dy, dx = rng.integers(-2, 3, size=2)
        shifted = np.roll(pixels, (int(dy), int(dx)), axis=(0, 1))[:, :, list(permutations[rng.integers(6)])]
        relative = f"val/{index:05d}.png"
        Image.fromarray(np.ascontiguousarray(shifted)).save(root / relative)
        lines.append(f"{relative} {label}")
    listing.write_text("\n".join(lines) + "\n")
    return root


def image_forwards(path: Path, images: int) -> tuple[int, int]:
    """Image-forwards a sampled analysis used (each variant's ``samples``) and its number of variants."""
    variants = [v for info in load_sidecar(path)["params"].values() for v in (info.get("variants") or {}).values()]
    return sum(v.get("samples", images) for v in variants), len(variants)


def report_adaptive(out: Path, exact: dict, images: int, precision: float, seconds: dict[str, float]) -> None:
    """Adaptive precision against the exact run: image-forwards, time, interval coverage, images by loss size."""
    sidecar = load_sidecar(out / "adaptive.pkl")
    variants = [(name, float(r), v) for name, info in sidecar["params"].items() for r, v in info["variants"].items()]
    used = sum(v["samples"] for _, _, v in variants)
    full = len(variants) * images
    covered = sum(v["interval"][0] - 1e-9 <= exact[n][r] <= v["interval"][1] + 1e-9 for n, r, v in variants)
    print(f"\nadaptive precision +-{precision} (95%), {len(variants)} variants")
    print(f"image-forwards: exact {full}, adaptive {used} -> {full / used:.2f}x fewer")
    print(f"wall time: exact {seconds['exact']:.1f} s, adaptive {seconds['adaptive']:.1f} s "
          f"-> {seconds['exact'] / seconds['adaptive']:.2f}x")  # fmt: skip
    print(f"intervals containing the exact loss: {covered}/{len(variants)} ({covered / len(variants):.1%})")
    worst = max(abs(sidecar["params"][n]["variants"][f"{r:g}"]["loss"] - exact[n][r]) for n, r, _ in variants)
    print(f"largest |adaptive - exact| loss: {worst:.4f}")
    print("images used per variant, by the size of its exact loss (large losses need most of the set):")
    for low, high in BUCKETS:
        used_here = [v["samples"] for n, r, v in variants if low <= abs(exact[n][r]) < high]
        if used_here:
            print(f"  |loss| in [{low:g}, {high:g}): {len(used_here):3d} variants, "
                  f"mean {sum(used_here) / len(used_here):6.0f} of {images} images")  # fmt: skip


def interpolates(curve: dict[float, float], target: float) -> bool:
    """Whether PaddleSlim's rule interpolates between two of ``curve``'s ratios (so both losses enter the ratio)."""
    ratios = sorted(curve)
    below = [i for i, r in enumerate(ratios) if curve[r] <= target]
    return bool(below) and below[-1] < len(ratios) - 1


def decision_name(target: float, precision: float | None) -> str:
    """The file stem of a decision-driven run."""
    return f"decision_{target:g}" + ("" if precision is None else f"_pm{precision:g}")


def decision_row(
    out: Path, exact: dict, images: int, target: float, precision: float | None, seconds: float, exact_seconds: float
) -> str:
    """One Markdown row: decision-driven sampling at ``target`` (and ``decision_precision``) against the exact run."""
    path = out / f"{decision_name(target, precision)}.pkl"
    used, evaluated = image_forwards(path, images)
    full = sum(len(curve) for curve in exact.values()) * images
    derived, reference = get_ratios_by_loss(load_sensitivities(path), target), get_ratios_by_loss(exact, target)
    same = sum(derived.get(name, 0.0) == reference.get(name, 0.0) for name in exact)
    worst = max(abs(derived.get(name, 0.0) - reference.get(name, 0.0)) for name in exact)
    label = f"{target:g}" if precision is None else f"{target:g}, +-{precision:g}"
    sidecar = load_sidecar(path)
    settled = Counter(v["settled"] for info in sidecar["params"].values() for v in info["variants"].values())
    interpolated = sum(interpolates(curve, target) for curve in exact.values())
    floor = 2 * interpolated * images
    return (
        f"| {label} | {full:,} | {used:,} ({full / used:.2f}x fewer) | {evaluated} of {full // images} "
        f"| {', '.join(f'{k} {settled[k]}' for k in ('above', 'below', 'exact', 'precise') if settled[k])} "
        f"| {interpolated} ({floor:,}: {full / floor:.2f}x) | {exact_seconds:.1f} s | {seconds:.1f} s "
        f"({exact_seconds / seconds:.2f}x) | {same}/{len(exact)} | {worst:.4f} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the exact analysis and the sampled ones, and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo/digits_mobilenet.yaml", help="demo config (model)")
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--modes", nargs="+", choices=("adaptive", "decision"), default=["adaptive", "decision"])
    parser.add_argument("--precision", type=float, default=0.005, help="adaptive precision")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.01, 0.02, 0.05], help="decision target_loss")
    parser.add_argument("--decision-precision", type=float, nargs="*", default=[],
                        help="also run decision-driven sampling with these decision_precision values")  # fmt: skip
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=REPO_ROOT / "benchmarks" / "_data" / "digits_shifted")
    args = parser.parse_args(argv)
    root = build_set(Path(args.root) / str(args.images), args.images, args.seed)
    config = load_config(REPO_ROOT / args.config).Global
    config.data_dir, config.num_workers = str(root), 0
    loader = build_eval_loader(config, torch.device("cpu"))
    apply_data_cache(loader, "ram", None, progress=False)
    model = build_model(config)
    out = Path(args.root) / "results"
    runs: list[tuple[str, dict]] = [("exact", {})]
    if "adaptive" in args.modes:
        runs.append(("adaptive", {"precision": args.precision}))
    if "decision" in args.modes:
        for target in args.targets:
            for extra in [None, *args.decision_precision]:
                kwargs = {"precision": "decision", "target_loss": target, "decision_precision": extra}
                runs.append((decision_name(target, extra), kwargs))
    seconds = {}
    for name, extra in runs:  # one after the other in one process, so all runs see the same machine
        start = time.perf_counter()
        analysis_prune(model, loader, out / f"{name}.pkl", pruned_ratios=args.ratios, seed=args.seed, overwrite=True,
                       progress=False, **extra)  # fmt: skip
        seconds[name] = time.perf_counter() - start
    exact = load_sensitivities(out / "exact.pkl")
    baseline = load_sidecar(out / "exact.pkl")["baseline"]
    print(f"model {config.arch} on {loader.num_samples} shifted digits; baseline top1 {baseline['top1']:.4f}; "
          f"{len(exact)} convs x {len(args.ratios)} ratios")  # fmt: skip
    if "adaptive" in args.modes:
        report_adaptive(out, exact, loader.num_samples, args.precision, seconds)
    if "decision" in args.modes:
        print("\ndecision-driven sampling (precision: decision, decision_error 0.05) against the exact run:\n")
        print(
            "| target_loss | image-forwards, exact | decision | variants evaluated | settled | params interpolated "
            "(their pairs on every image: bound) | time, exact | decision | derived ratios = exact | largest "
            "\\|ratio - exact\\| |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for target in args.targets:
            for extra in [None, *args.decision_precision]:
                seconds_here = seconds[decision_name(target, extra)]
                print(decision_row(out, exact, loader.num_samples, target, extra, seconds_here, seconds["exact"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

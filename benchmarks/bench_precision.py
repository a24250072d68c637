#!/usr/bin/env python
"""Adaptive precision vs exact evaluation: image-forwards used, run time, and interval coverage, side by side.

Builds (once, under ``benchmarks/_data/``) a deterministic 5,000-image evaluation set from the shipped digits: each
image is one of the 1,797 digits (train and val splits), shifted by up to 2 pixels and with its colour channels
permuted, so the demo models classify it well but not perfectly. Then analyses a demo model with the fast engine
twice, exactly and with ``precision``, and reports how many image-forwards each needed, the wall times, and how
many of the adaptive 95% intervals contain the exact loss.

    python benchmarks/bench_precision.py                       # demo MobileNetV2, precision 0.005, 5,000 images
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    """Run the exact and the adaptive analysis and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo/digits_mobilenet.yaml", help="demo config (model)")
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--precision", type=float, default=0.005)
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
    timings = {}
    for name, precision in (("exact", None), ("adaptive", args.precision)):
        start = time.perf_counter()
        analysis_prune(model, loader, out / f"{name}.pkl", pruned_ratios=args.ratios, precision=precision,
                       seed=args.seed, overwrite=True, progress=False)  # fmt: skip
        timings[name] = time.perf_counter() - start
    exact = load_sensitivities(out / "exact.pkl")
    sidecar = load_sidecar(out / "adaptive.pkl")
    baseline = sidecar["baseline"]
    variants = [(name, float(r), v) for name, info in sidecar["params"].items() for r, v in info["variants"].items()]
    used = sum(v["samples"] for _, _, v in variants)
    full = len(variants) * loader.num_samples
    covered = sum(v["interval"][0] - 1e-9 <= exact[n][r] <= v["interval"][1] + 1e-9 for n, r, v in variants)
    print(f"model {config.arch} on {loader.num_samples} shifted digits; baseline top1 {baseline['top1']:.4f}; "
          f"{len(variants)} variants; precision +-{args.precision} (95%)")  # fmt: skip
    print(f"image-forwards: exact {full}, adaptive {used} -> {full / used:.2f}x fewer")
    print(f"wall time: exact {timings['exact']:.1f} s, adaptive {timings['adaptive']:.1f} s "
          f"-> {timings['exact'] / timings['adaptive']:.2f}x")  # fmt: skip
    print(f"intervals containing the exact loss: {covered}/{len(variants)} ({covered / len(variants):.1%})")
    worst = max(abs(sidecar["params"][n]["variants"][f"{r:g}"]["loss"] - exact[n][r]) for n, r, _ in variants)
    print(f"largest |adaptive - exact| loss: {worst:.4f}")
    print("images used per variant, by the size of its exact loss (large losses need most of the set):")
    for low, high in BUCKETS:
        used_here = [v["samples"] for n, r, v in variants if low <= abs(exact[n][r]) < high]
        if used_here:
            print(f"  |loss| in [{low:g}, {high:g}): {len(used_here):3d} variants, "
                  f"mean {sum(used_here) / len(used_here):6.0f} of {loader.num_samples} images")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

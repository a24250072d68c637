#!/usr/bin/env python
"""Eval-data decode throughput: our ``EvalLoader`` vs torchvision's reference eval pipeline, side by side.

Builds (once, cached under ``benchmarks/_data/``) a seeded synthetic ImageNet-style JPEG folder
``<root>/val/<class>/<image>.JPEG`` and measures images/s for resize 256 -> center crop 224 (bilinear):

* ``analysis.inputs.data.EvalLoader`` (Pillow decode, uint8 batches, ``normalize_batch`` on the CPU);
* torchvision's canonical reference: ``ImageFolder`` + v1 ``Resize/CenterCrop/ToTensor/Normalize`` in a DataLoader;
* decode-only, one image at a time in the main process: Pillow (``analysis.inputs.data.load_image``) vs
  ``torchvision.io.decode_jpeg`` + v2 tensor resize, with the pixel difference between the two.

Run from the repo root: ``python benchmarks/bench_data.py`` (``--help`` lists the options).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import PIL
import PIL.features
import torch
import torchvision
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("analysis") is None:  # not installed: use the source tree this script lives in
    sys.path.insert(0, str(REPO_ROOT))

from analysis.config import IMAGENET_MEAN, IMAGENET_STD, GlobalConfig  # noqa: E402
from analysis.inputs.data import EvalLoader, Preprocess, build_eval_loader, find_samples, load_image  # noqa: E402

IMG_SIZE = 224
RESIZE_SIZE = 256
JPEG_QUALITY = 90
GENERATOR = "benchmarks/bench_data.py"
GENERATOR_VERSION = 1
DEFAULT_DATA = REPO_ROOT / "benchmarks" / "_data"
# (width, height) and how often each occurs: mostly 500x375 landscape, some portrait and other aspect ratios.
SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (500, 500), (400, 500), (500, 281))
SIZE_WEIGHTS = (0.50, 0.15, 0.12, 0.05, 0.06, 0.05, 0.04, 0.03)

OURS = "EvalLoader (ours: Pillow, uint8, normalize_batch)"
REFERENCE = "torchvision reference (ImageFolder, v1 transforms)"
DECODE_PILLOW = "decode-only: Pillow (analysis.inputs.data.load_image)"
DECODE_TORCHVISION = "decode-only: torchvision.io.decode_jpeg + v2 resize"

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------------------
# Synthetic data set
# ---------------------------------------------------------------------------------------------------------------


def smooth_noise(rng: np.random.Generator, height: int, width: int, cell: int, amplitude: float) -> np.ndarray:
    """Return (H, W, 3) float32 noise that varies smoothly over ``cell`` pixels (a bicubic-upsampled random grid)."""
    grid_h, grid_w = height // cell + 3, width // cell + 3
    grid = rng.normal(0.0, amplitude, size=(3, grid_h, grid_w)).astype(np.float32)
    channels = [
        np.asarray(Image.fromarray(plane).resize((grid_w * cell, grid_h * cell), Image.Resampling.BICUBIC))
        for plane in grid
    ]
    return np.stack(channels, axis=-1)[cell : cell + height, cell : cell + width]


def synthetic_photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Draw a photo-like RGB image: colour gradient, cloudy texture, blurred shapes, fine grain."""
    corners = rng.uniform(20, 235, size=(2, 2, 3)).astype(np.float32)
    ys = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    xs = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    top = corners[0, 0] * (1 - xs) + corners[0, 1] * xs
    bottom = corners[1, 0] * (1 - xs) + corners[1, 1] * xs
    base = top * (1 - ys) + bottom * ys
    base = base + smooth_noise(rng, height, width, 48, 25.0) + smooth_noise(rng, height, width, 8, 10.0)
    image = Image.fromarray(np.clip(base + 0.5, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.uniform(-0.2, 1.0, 2) * (width, height)
        w, h = rng.uniform(0.08, 0.5, 2) * (width, height)
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            draw.ellipse((x0, y0, x0 + w, y0 + h), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x0 + w, y0 + h), fill=colour)
        else:
            points = rng.uniform(0, 1, (5, 2)) * (w, h) + (x0, y0)
            draw.polygon([(float(x), float(y)) for x, y in points], fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.4, 1.2))))
    detail = float(rng.uniform(8.0, 24.0))  # per-image texture strength, so file sizes vary like photos do
    grain = float(rng.uniform(3.0, 7.0))
    pixels = np.asarray(image, dtype=np.float32)
    pixels = pixels + smooth_noise(rng, height, width, 2, detail) + rng.normal(0.0, grain, size=pixels.shape)
    return Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8))


def dataset_spec(images: int, classes: int, seed: int) -> dict[str, object]:
    """Everything that determines the generated files; a cached folder is reused only if this matches."""
    return {
        "generator": GENERATOR,
        "version": GENERATOR_VERSION,
        "images": images,
        "classes": classes,
        "seed": seed,
        "quality": JPEG_QUALITY,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
    }


def write_dataset(root: Path, images: int, classes: int, seed: int) -> str:
    """Write the JPEG folder under ``root`` and return the SHA-256 over all files (in sorted path order)."""
    rng = np.random.default_rng(seed)
    size_index = rng.choice(len(SIZES), size=images, p=SIZE_WEIGHTS)
    for label in range(classes):
        (root / "val" / f"n{label:08d}").mkdir(parents=True, exist_ok=True)
    for index in range(images):
        width, height = SIZES[size_index[index]]
        photo = synthetic_photo(np.random.default_rng([seed, index]), width, height)
        path = root / "val" / f"n{index % classes:08d}" / f"ILSVRC2012_val_{index + 1:08d}.JPEG"
        photo.save(path, "JPEG", quality=JPEG_QUALITY)
    return tree_digest(root / "val")


def tree_digest(folder: Path) -> str:
    """SHA-256 over relative paths and contents of every file below ``folder``."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_dataset(root: Path, images: int, classes: int, seed: int) -> str:
    """Make sure ``root/val`` holds the synthetic data set; return a one-line description of what was done.

    A folder this script generated is reused when its manifest matches and rebuilt otherwise. A folder with a
    ``val/`` subfolder but no manifest (e.g. real ImageNet) is benchmarked as it is and never modified.
    """
    manifest = root / "manifest.json"
    spec = dataset_spec(images, classes, seed)
    if manifest.is_file():
        saved = json.loads(manifest.read_text(encoding="utf-8"))
        if saved.get("spec") == spec:
            return f"cached, sha256 {saved['sha256'][:16]}"
        if saved.get("spec", {}).get("generator") != GENERATOR:
            raise SystemExit(f"{root} has a manifest.json not written by {GENERATOR}; refusing to overwrite it.")
    elif (root / "val").is_dir():
        return "existing folder without manifest, used as it is (--images/--classes ignored)"
    elif root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} is not empty and has no val/ folder; pick another --root.")
    start = time.perf_counter()
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    digest = write_dataset(partial, images, classes, seed)
    (partial / "manifest.json").write_text(json.dumps({"spec": spec, "sha256": digest}, indent=2), encoding="utf-8")
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    return f"built in {time.perf_counter() - start:.1f} s, sha256 {digest[:16]}"


# ---------------------------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------------------------


def ours_loader(root: Path, batch_size: int, workers: int) -> EvalLoader:
    """Our eval loader, built exactly as the CLI builds it."""
    cfg = GlobalConfig(
        data_dir=str(root),
        batch_size=batch_size,
        img_size=IMG_SIZE,
        resize_size=RESIZE_SIZE,
        interpolation="bilinear",
        num_workers=workers,
        device="cpu",
    )
    return build_eval_loader(cfg, torch.device("cpu"))


def reference_loader(root: Path, batch_size: int, workers: int) -> DataLoader:
    """torchvision's canonical eval pipeline (PIL + v1 transforms), with persistent workers like ours."""
    transform = transforms.Compose(
        [
            transforms.Resize(RESIZE_SIZE, interpolation=InterpolationMode.BILINEAR, antialias=True),
            transforms.CenterCrop(IMG_SIZE),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(root / "val"), transform=transform)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=workers, persistent_workers=workers > 0
    )


def drain(batches: Batches) -> int:
    """Iterate every batch and return the number of images seen."""
    return sum(int(labels.numel()) for _, labels in batches)


def compare_loaders(ours: Batches, reference: Batches) -> tuple[int, float]:
    """Iterate both loaders in lockstep (doubles as their warm-up); return images and max |difference|."""
    count, worst = 0, 0.0
    for (a, labels_a), (b, labels_b) in zip(ours, reference, strict=True):
        if not torch.equal(labels_a, labels_b):
            raise SystemExit("ours and the torchvision reference list the images in different orders")
        worst = max(worst, float((a - b).abs().max()))
        count += int(labels_a.numel())
    return count, worst


def decode_torchvision(path: str, preprocess: Preprocess) -> torch.Tensor:
    """``torchvision.io`` decode + v2 resize of the uint8 tensor + center crop (uint8 CHW)."""
    image = decode_jpeg(read_file(path), mode=ImageReadMode.RGB)
    resized = TF.resize(image, [preprocess.resize_size], interpolation=InterpolationMode.BILINEAR, antialias=True)
    return TF.center_crop(resized, [preprocess.img_size])


def decode_all(decode: Callable[[str, Preprocess], torch.Tensor], paths: Sequence[str], preprocess: Preprocess) -> int:
    """Decode every path one by one in this process; return the count."""
    for path in paths:
        decode(path, preprocess)
    return len(paths)


def pixel_difference(paths: Sequence[str], preprocess: Preprocess) -> tuple[int, float, float]:
    """Decode every image both ways (doubles as warm-up); return max and mean |difference| and share that differ."""
    worst, total, differing, values = 0, 0, 0, 0
    for path in paths:
        pillow = load_image(path, preprocess).to(torch.int16)
        tensor = decode_torchvision(path, preprocess).to(torch.int16)
        if pillow.shape != tensor.shape:
            raise SystemExit(f"{path}: Pillow gives {tuple(pillow.shape)}, torchvision.io {tuple(tensor.shape)}")
        diff = (pillow - tensor).abs()
        worst = max(worst, int(diff.max()))
        total += int(diff.sum())
        differing += int((diff > 0).sum())
        values += diff.numel()
    return worst, total / values, differing / values


# ---------------------------------------------------------------------------------------------------------------
# Timing and report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One timed configuration: how to run a pass, and its throughput over the timed runs."""

    name: str
    workers: str
    baseline: str | None  # key of the reference row this one is compared with
    run: Callable[[], int]
    threads: int | None = None  # torch intra-op threads during the pass (None: leave as is)
    rates: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median images/s."""
        return statistics.median(self.rates)

    def time_once(self, expected: int) -> None:
        """Run one pass, check that it saw every image and record its images/s."""
        previous = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            start = time.perf_counter()
            count = self.run()
            elapsed = time.perf_counter() - start
        finally:
            torch.set_num_threads(previous)
        if count != expected:
            raise SystemExit(f"{self.name}: expected {expected} images per pass, got {count}")
        self.rates.append(count / elapsed)


def loader_configs(root: Path, workers: int, batch_size: int, expected: int) -> tuple[list[Config], float]:
    """Ours and the reference at one worker count, warmed up by one lockstep pass; also their max difference.

    Both keep their worker processes between passes (persistent workers) until the configs are dropped.
    """
    ours = ours_loader(root, batch_size, workers)
    reference = reference_loader(root, batch_size, workers)
    count, worst = compare_loaders(ours, reference)
    if count != expected:
        raise SystemExit(f"expected {expected} images per pass, got {count}")
    key = f"ref{workers}"
    configs = [
        Config(OURS, str(workers), key, functools.partial(drain, ours)),
        Config(REFERENCE, str(workers), key, functools.partial(drain, reference)),
    ]
    return configs, worst


def decode_only_configs(
    paths: Sequence[str], preprocess: Preprocess, baseline: str | None
) -> tuple[list[Config], tuple[int, float, float]]:
    """Pillow vs torchvision.io per image on one torch thread (as in a DataLoader worker), warmed up by the diff."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        difference = pixel_difference(paths, preprocess)
    finally:
        torch.set_num_threads(previous)
    pillow = functools.partial(decode_all, load_image, paths, preprocess)
    tensor = functools.partial(decode_all, decode_torchvision, paths, preprocess)
    configs = [
        Config(DECODE_PILLOW, "main", baseline, pillow, threads=1),
        Config(DECODE_TORCHVISION, "main", baseline, tensor, threads=1),
    ]
    return configs, difference


def machine_description() -> str:
    """CPU model, cores and library versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return (
        f"machine: {model}, {os.cpu_count()} cores ({usable} usable), torch threads {torch.get_num_threads()}\n"
        f"versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, "
        f"Pillow {PIL.__version__} (libjpeg-turbo {PIL.features.version('jpg')}), numpy {np.__version__}"
    )


def format_table(configs: Sequence[Config]) -> str:
    """Render the results as a fixed-width table with each row's ratio to its reference row."""
    references = {c.baseline: c.median for c in configs if c.name == REFERENCE}
    header = f"{'configuration':<52} {'workers':>7} {'images/s':>9} {'runs min-max':>14} {'vs torchvision ref':>19}"
    lines = [header, "-" * len(header)]
    for config in configs:
        ratio = f"{config.median / references[config.baseline]:.2f}x" if config.baseline in references else "-"
        spread = f"{min(config.rates):.0f}-{max(config.rates):.0f}"
        lines.append(f"{config.name:<52} {config.workers:>7} {config.median:>9.1f} {spread:>14} {ratio:>19}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Compare eval-data decode throughput: our EvalLoader vs torchvision's reference pipeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--images", type=int, default=512, help="number of synthetic JPEGs to generate")
    parser.add_argument("--classes", type=int, default=8, help="number of synthetic class folders")
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="data folder holding val/<class>/<img>.JPEG (default: benchmarks/_data/synthetic_<images>); an "
        "existing folder without this script's manifest.json (e.g. real ImageNet) is used read-only",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts to test")
    parser.add_argument("--batch-size", type=int, default=64, help="DataLoader batch size")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data set")
    args = parser.parse_args(argv)
    for name in ("images", "classes", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.workers = list(dict.fromkeys(args.workers))
    if any(w < 0 for w in args.workers):
        parser.error("--workers must be 0 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Build or reuse the data set, warm up and time every configuration, print the table."""
    started = time.perf_counter()
    args = parse_args(argv)
    root = (args.root or DEFAULT_DATA / f"synthetic_{args.images}").resolve()
    data_note = ensure_dataset(root, args.images, args.classes, args.seed)
    samples, _ = find_samples(root)
    paths = [s.path for s in samples]
    megabytes = sum(os.path.getsize(p) for p in paths) / 1e6
    preprocess = Preprocess(img_size=IMG_SIZE, resize_size=RESIZE_SIZE, interpolation="bilinear")
    print(f"data: {root} ({len(paths)} images, {megabytes:.1f} MB; {data_note})")
    print(machine_description())
    print(
        f"pipeline: resize short side {RESIZE_SIZE} -> center crop {IMG_SIZE}, bilinear; batch {args.batch_size}; "
        f"1 warm-up pass each, then {args.repeats} round(s) timing every configuration in turn (median shown)\n",
        flush=True,
    )

    configs: list[Config] = []
    loader_diffs: dict[int, float] = {}
    for workers in args.workers:
        pair, loader_diffs[workers] = loader_configs(root, workers, args.batch_size, len(paths))
        configs += pair
    decode_only, (worst, mean, share) = decode_only_configs(paths, preprocess, "ref0" if 0 in args.workers else None)
    configs += decode_only
    for _ in range(args.repeats):
        for config in configs:
            config.time_once(len(paths))

    print(format_table(configs))
    print(
        "(decode-only rows are compared with the reference at 0 workers, also in the main process; they skip the "
        "DataLoader, batching and float normalisation)\n"
    )
    diffs = ", ".join(f"{w} workers {d:.2g}" for w, d in loader_diffs.items())
    print(f"output check, ours vs torchvision reference, max |difference| of normalised pixels: {diffs}")
    pillow, tensor = decode_only
    print(
        f"decode-only (1 torch thread): torchvision.io is {tensor.median / pillow.median:.2f}x Pillow's speed; "
        f"|pixel difference| max {worst}, mean {mean:.3f} (uint8), {share:.1%} of values differ"
    )
    top = max(args.workers)
    ours = next(c for c in configs if c.name == OURS and c.workers == str(top))
    reference = next(c for c in configs if c.name == REFERENCE and c.workers == str(top))
    plural = "s" if top != 1 else ""
    print(f"ours vs torchvision reference ({top} worker{plural}): {ours.median / reference.median:.2f}x")
    print(f"total run time: {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

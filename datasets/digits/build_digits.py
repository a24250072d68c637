"""Build the shipped demo image set from scikit-learn's bundled UCI hand-written digits.

Writes 32x32 RGB PNGs plus ``train_list.txt`` / ``val_list.txt`` in PaddleSlim's ImageNet layout::

    python datasets/digits/build_digits.py [--out DIR]

Each 8x8 digit (values 0..16) is upscaled bicubically to 24x24, centred on a 32x32 canvas with 4 px of
padding and drawn as a tinted "ink" colour on a dark background; the tint is seeded per image, so the
output is byte-identical on every run. scikit-learn is needed only to rebuild.
"""

from __future__ import annotations

import argparse
import colorsys
from pathlib import Path

import numpy as np
from PIL import Image

SEED = 20240607
VAL_FRACTION = 0.25
CANVAS = 32
DIGIT = 24
PAD = (CANVAS - DIGIT) // 2


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Return the (1797, 8, 8) float images in 0..16 and their (1797,) integer labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def stratified_split(labels: np.ndarray, val_fraction: float = VAL_FRACTION, seed: int = SEED) -> np.ndarray:
    """Return a boolean mask, True for validation samples, stratified by label and seeded."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    _, val_idx = train_test_split(indices, test_size=val_fraction, stratify=labels, random_state=seed)
    mask = np.zeros(len(labels), dtype=bool)
    mask[val_idx] = True
    return mask


def tint_colours(index: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Return the (ink, background) RGB colours in 0..255 for image ``index``; seeded per image."""
    rng = np.random.default_rng([seed, index])
    hue = rng.uniform(0.0, 1.0)
    ink = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.35, 0.75), rng.uniform(0.85, 1.0))) * 255.0
    bg_hue = (hue + rng.uniform(0.3, 0.7)) % 1.0
    background = np.array(colorsys.hsv_to_rgb(bg_hue, rng.uniform(0.3, 0.8), rng.uniform(0.05, 0.2))) * 255.0
    return ink, background


def render_digit(image: np.ndarray, index: int, seed: int = SEED) -> Image.Image:
    """Render one 8x8 digit (values 0..16) as a tinted 32x32 RGB image with 4 px padding."""
    alpha8 = Image.fromarray((image / 16.0).astype(np.float32), mode="F")
    alpha = np.clip(np.asarray(alpha8.resize((DIGIT, DIGIT), Image.Resampling.BICUBIC), dtype=np.float64), 0.0, 1.0)
    canvas = np.zeros((CANVAS, CANVAS), dtype=np.float64)
    canvas[PAD : PAD + DIGIT, PAD : PAD + DIGIT] = alpha
    ink, background = tint_colours(index, seed)
    rgb = background[None, None, :] + canvas[:, :, None] * (ink - background)[None, None, :]
    return Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8), mode="RGB")


def build(out_dir: Path, seed: int = SEED) -> tuple[int, int]:
    """Write the PNGs and list files under ``out_dir``; return the (train, val) sample counts."""
    images, labels = load_digits_arrays()
    is_val = stratified_split(labels, seed=seed)
    lines: dict[str, list[str]] = {"train": [], "val": []}
    for split in lines:
        (out_dir / split).mkdir(parents=True, exist_ok=True)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        split = "val" if is_val[index] else "train"
        rel = f"{split}/{index:05d}.png"
        render_digit(image, index, seed).save(out_dir / rel, format="PNG", optimize=True)
        lines[split].append(f"{rel} {int(label)}\n")
    for split, split_lines in lines.items():
        (out_dir / f"{split}_list.txt").write_text("".join(split_lines), encoding="utf-8", newline="\n")
    return len(lines["train"]), len(lines["val"])


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output directory")
    args = parser.parse_args(argv)
    n_train, n_val = build(args.out)
    print(f"wrote {n_train} train and {n_val} val images to {args.out}")


if __name__ == "__main__":
    main()

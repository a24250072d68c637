"""ImageNet-style evaluation data: both common layouts, torchvision's eval preprocessing, a device-side loader.

Layouts (detected in this order):

* PaddleSlim: ``data_dir/val_list.txt`` with lines ``relative/path.JPEG <label>`` (paths relative to data_dir).
* torchvision ImageFolder: ``data_dir/val/<class>/<image>``, classes sorted by name (torchvision's own rules).

With ``Global.labels: none`` a list line may be a path alone, and every label (listed, or an ImageFolder class) is
dropped: each sample's label is then :data:`UNLABELLED` and only the label-free metrics can be measured.

Each image is decoded with Pillow, its short side resized to ``resize_size``, center-cropped to ``img_size`` and
kept as uint8 CHW; batches are normalised on the target device. This is exactly the eval preset torchvision's
reference scripts use for its pretrained weights, and uint8 batches keep host-to-device copies four times smaller.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes
from torchvision.transforms import InterpolationMode
from torchvision.transforms.functional import convert_image_dtype
from torchvision.transforms.v2 import functional as TF

from analysis.config import DEFAULT_MAX_IMAGE_PIXELS, GlobalConfig
from analysis.errors import ConfigError, DataError, printable
from analysis.inputs.placement import Placement, Stager, cache_placement, describe_placement, free_device_bytes, placed
from analysis.io.fingerprint import json_fingerprint
from analysis.progress import progress_bar

logger = logging.getLogger(__name__)

INTERPOLATION_MODES = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "lanczos": InterpolationMode.LANCZOS,
}


UNLABELLED = -1
"""The label of an image whose label is unknown (``Global.labels: none``, or a calibration line without one)."""


@dataclass(frozen=True)
class Sample:
    """One evaluation image: its file, its label (:data:`UNLABELLED` when unknown), and where it was listed (for
    error messages)."""

    path: str
    label: int
    source: str


@dataclass(frozen=True)
class ReadFailure:
    """An image that could not be decoded; travels from a loader worker to the main process as a value."""

    source: str
    path: str
    reason: str


@dataclass(frozen=True)
class Preprocess:
    """Eval preprocessing settings (resize short side, center crop, normalise)."""

    img_size: int = 224
    resize_size: int = 256
    interpolation: str = "bilinear"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    max_image_pixels: int | None = dataclasses.field(default=DEFAULT_MAX_IMAGE_PIXELS, compare=False)
    """Larger images are refused (a decompression-bomb guard; None: no limit). It changes no pixel, so it is not
    part of :meth:`identity`."""

    @classmethod
    def from_config(cls, cfg: GlobalConfig) -> Preprocess:
        """Build from the ``Global`` block."""
        return cls(
            cfg.img_size, cfg.resize_size, cfg.interpolation, _rgb(cfg.mean), _rgb(cfg.std), cfg.max_image_pixels
        )

    def identity(self) -> dict[str, Any]:
        """The settings that decide the pixels a model sees: what fingerprints and sidecars record."""
        settings = dataclasses.asdict(self)
        del settings["max_image_pixels"]
        return settings


def _rgb(values: Sequence[float]) -> tuple[float, float, float]:
    """One value per channel (the config check makes sure there are three)."""
    red, green, blue = values
    return red, green, blue


def find_samples(
    data_dir: str | Path, val_list: str = "val_list.txt", labelled: bool = True
) -> tuple[list[Sample], str]:
    """List the evaluation samples of ``data_dir`` in a deterministic order; without ``labelled`` list lines may be
    paths alone and every sample's label is :data:`UNLABELLED`.

    Returns:
        The samples and a short description of the layout that was found.

    Raises:
        DataError: If the folder is missing, neither layout is present, a list line is malformed, or a listed
            image does not exist.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"Global.data_dir {printable(root)} does not exist or is not a folder.")
    list_path = Path(val_list) if Path(val_list).is_absolute() else root / val_list
    if list_path.is_file():
        samples = read_sample_list(root, list_path, require_labels=labelled)
        layout = f"PaddleSlim list {list_path}"
    elif (root / "val").is_dir() and has_subfolders(root / "val"):
        samples = scan_image_folder(root / "val")
        layout = f"ImageFolder {root / 'val'}"
    else:
        hint = " (it contains class folders: set data_dir to its parent)" if _looks_like_class_root(root) else ""
        raise DataError(
            f"Global.data_dir {printable(root)} has neither {printable(list_path.name)} (PaddleSlim layout) nor "
            f"val/<class>/ folders (ImageFolder layout){hint}."
        )
    if not samples:
        raise DataError(f"No images found in {printable(layout)}; check Global.data_dir and Global.val_list.")
    check_files_exist(samples)
    if not labelled:
        samples = [dataclasses.replace(sample, label=UNLABELLED) for sample in samples]
        layout += " (labels ignored: Global.labels is none)"
    return samples, layout


def read_sample_list(
    root: Path, list_path: Path, key: str = "Global.val_list", require_labels: bool = True
) -> list[Sample]:
    """Parse a PaddleSlim list file (``relative/path label`` lines, paths relative to ``root``) in file order.

    Blank lines and ``#`` comments are skipped; ``key`` names the list in the message when it cannot be read. Messages
    and each sample's ``source`` show the file's name and the list's text with line breaks and control characters
    escaped, so that they stay one line. Without ``require_labels`` a line may also be a path alone (its label is
    :data:`UNLABELLED`); a last word that is not an integer is then part of the path.

    Raises:
        DataError: If the file cannot be read as UTF-8 text or a line is malformed (naming the file and line).
    """
    shown = printable(list_path)
    try:
        raw = list_path.read_bytes()
    except OSError as error:
        raise DataError(f"{key} {shown} cannot be read ({error.strerror or error}); check the file.") from None
    body = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark some editors write is not part of the first path
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = body[: error.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1  # as below
        raise DataError(
            f"{key} {shown} line {line_number} is not UTF-8 text (byte {body[error.start]:#04x}); save it as UTF-8 "
            "with '<relative/path> <integer label>' lines."
        ) from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # universal newlines, as read_text
    samples = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.rsplit(maxsplit=1)
        where = f"{shown} line {number}"
        if not require_labels:
            samples.append(_optionally_labelled(root, text, where))
            continue
        if len(parts) != 2:
            raise DataError(
                f"{where}: '{printable(text)}' has no label; each line must be '<relative/path> <integer label>'."
            )
        try:
            label = int(parts[1])
        except ValueError:
            raise DataError(
                f"{where}: label '{printable(parts[1])}' is not an integer; each line must be '<relative/path> "
                "<integer label>'."
            ) from None
        samples.append(Sample(str(root / parts[0]), label, where))
    return samples


def _optionally_labelled(root: Path, text: str, where: str) -> Sample:
    """A list line that is ``<path> <integer label>`` or a path alone (which may contain spaces)."""
    parts = text.rsplit(maxsplit=1)
    if len(parts) == 2:
        try:
            return Sample(str(root / parts[0]), int(parts[1]), where)
        except ValueError:
            pass
    return Sample(str(root / text), UNLABELLED, where)


def scan_image_folder(folder: Path) -> list[Sample]:
    """List the images of an ImageFolder root (``folder/<class>/<image>``): torchvision's classes, order and
    extensions, with symbolic links followed, but nothing reached twice: torchvision would list the images behind a
    link that points back up again, under another class's label.

    Raises:
        DataError: If a folder (a link loop, a folder linked twice) or an image file is reached through two paths.
    """
    classes, class_to_idx = find_classes(str(folder))
    seen_folders = {os.path.realpath(folder): str(folder)}  # a link back to the root is a loop too
    seen_images: dict[str, str] = {}
    samples = []
    for name in classes:
        for path in _class_images(folder / name, seen_folders):
            _reach_once(seen_images, path, lambda image, first, real: (
                f"ImageFolder {folder}: {image} and {first} are the same image file ({real}); an image must appear "
                "once (check symbolic links under the class folders)."
            ))  # fmt: skip
            samples.append(Sample(path, class_to_idx[name], f"{folder} (class '{name}')"))
    logger.debug("ImageFolder %s: %d classes", folder, len(classes))
    return samples


def _class_images(class_folder: Path, seen_folders: dict[str, str]) -> list[str]:
    """The image files below one class folder in torchvision's order (sorted walk, sorted names), following
    symbolic links; ``seen_folders`` maps the real path of every folder entered so far to the path it was entered by.

    Raises:
        DataError: If a folder is reached a second time.
    """
    walked = []
    for root, _, files in os.walk(class_folder, followlinks=True):
        _reach_once(seen_folders, root, lambda entered, first, _: (
            f"ImageFolder {class_folder.parent}: {entered} leads to {first}, which is listed already (a symbolic link "
            "loop or a folder linked twice); remove the link so that every image appears once."
        ))  # fmt: skip
        walked.append((root, files))
    return [
        os.path.join(root, name) for root, files in sorted(walked) for name in sorted(files)
        if name.lower().endswith(IMG_EXTENSIONS)
    ]  # fmt: skip


def _reach_once(seen: dict[str, str], path: str, refusal: Callable[[str, str, str], str]) -> None:
    """Record ``path`` in ``seen`` (real path -> the path it was first reached by), so that no file or folder is
    listed twice under two names (symbolic links).

    Raises:
        DataError: ``refusal(path, first path, real path)`` when ``path``'s real path was reached before.
    """
    real = os.path.realpath(path)
    if real in seen:
        raise DataError(refusal(path, seen[real], real))
    seen[real] = path


def has_subfolders(folder: Path) -> bool:
    """Whether ``folder`` holds at least one folder (e.g. the class folders of an ImageFolder root)."""
    return any(entry.is_dir() for entry in os.scandir(folder))


def _looks_like_class_root(folder: Path) -> bool:
    return has_subfolders(folder) and not (folder / "val").exists()


def check_files_exist(samples: Sequence[Sample]) -> None:
    """Raise a :class:`DataError` naming the first listed image that does not exist (and how many are missing)."""
    missing = [s for s in samples if not os.path.isfile(s.path)]
    if missing:
        first = missing[0]
        more = f" ({len(missing)} listed images are missing in total)" if len(missing) > 1 else ""
        raise DataError(f"{first.source}: image {printable(first.path)} does not exist{more}.")


def select_subset(samples: Sequence[Sample], max_samples: int | None, seed: int) -> list[Sample]:
    """Pick a fixed, seeded, class-balanced subset of at most ``max_samples``, kept in the original order.

    Classes take turns (each in its own seeded random order) until the budget is spent, so every class gets
    ``max_samples // classes`` images or all it has.
    """
    return [samples[i] for i in subset_indices(samples, max_samples, seed)]


def subset_indices(samples: Sequence[Sample], max_samples: int | None, seed: int) -> list[int]:
    """The positions of :func:`select_subset`'s choice in ``samples``, ascending."""
    if max_samples is None or max_samples >= len(samples):
        return list(range(len(samples)))
    by_class: dict[int, list[int]] = defaultdict(list)
    for index, sample in enumerate(samples):
        by_class[sample.label].append(index)
    generator = torch.Generator().manual_seed(seed)
    queues = []
    for label in sorted(by_class):
        indices = by_class[label]
        order = torch.randperm(len(indices), generator=generator).tolist()
        queues.append([indices[i] for i in order])
    chosen: list[int] = []
    depth = 0
    while len(chosen) < max_samples:
        for queue in queues:
            if depth < len(queue) and len(chosen) < max_samples:
                chosen.append(queue[depth])
        depth += 1
    return sorted(chosen)


SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def rgb_image(image: Image.Image) -> Image.Image:
    """The 8-bit RGB image every model sees, from any Pillow mode.

    16-bit pixels are scaled to 8 bits by keeping their high byte (``v >> 8``, as ``torchvision.io.decode_png`` with
    ``convert_image_dtype`` and OpenCV do): Pillow's own ``convert("RGB")`` clips them to 255 instead, which turns a
    16-bit image white. Pillow opens 16-bit PNGs as ``I;16`` (older versions as ``I``, which from a PNG is 16-bit
    too). Alpha is dropped; palette, 1-bit, grayscale, CMYK, YCbCr and LAB images are converted by Pillow, as
    torchvision's ImageFolder loader does.

    Raises:
        ValueError: For 32-bit integer (``I``, other than from a PNG) and floating-point (``F``) pixels, which have
            no defined 8-bit scale.
    """
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES or (mode == "I" and image.format == "PNG"):
        high_byte = (np.asarray(image).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        return Image.fromarray(high_byte, "L").convert("RGB")
    if mode in ("I", "F"):
        kind = "32-bit integer" if mode == "I" else "floating-point"
        raise ValueError(f"its {kind} pixels (Pillow mode {mode}) have no defined 8-bit scale; save it as 8 or 16 bits")
    return image.convert("RGB")


def load_image(path: str, preprocess: Preprocess) -> torch.Tensor:
    """Decode one image to a uint8 CHW tensor: RGB (see :func:`rgb_image`), short side resized, center-cropped.

    Raises:
        ValueError: For an image with more than ``preprocess.max_image_pixels`` pixels (checked from the header,
            before decoding), or one :func:`rgb_image` refuses.
    """
    with _pillow_pixel_guard_off(), Image.open(path) as image:
        limit = preprocess.max_image_pixels
        if limit is not None and image.width * image.height > limit:
            raise ValueError(
                f"it has {image.width} x {image.height} = {image.width * image.height:,} pixels, more than the "
                f"{limit:,} Global.max_image_pixels allows (a decompression-bomb guard); raise that key if the image "
                "is genuine"
            )
        rgb = rgb_image(image)
    resized = TF.resize(rgb, [preprocess.resize_size], interpolation=INTERPOLATION_MODES[preprocess.interpolation])
    image_tensor: torch.Tensor = TF.pil_to_tensor(TF.center_crop(resized, [preprocess.img_size]))
    return image_tensor


@contextlib.contextmanager
def _pillow_pixel_guard_off() -> Iterator[None]:
    """Switch off Pillow's process-wide decompression-bomb check (``Image.MAX_IMAGE_PIXELS``) while opening one image,
    so that ``Global.max_image_pixels`` alone decides, at its exact value, in every loader process."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def normalize_batch(images: torch.Tensor, preprocess: Preprocess) -> torch.Tensor:
    """Convert uint8 (N, 3, H, W) images to normalised float32, bit-identical to torchvision's weights.transforms()."""
    floats = convert_image_dtype(images, torch.float32)
    normalized: torch.Tensor = TF.normalize(floats, list(preprocess.mean), list(preprocess.std))
    return normalized


Item = tuple[torch.Tensor | ReadFailure, int]
"""One dataset item: a decoded image (or why it could not be decoded) and its label."""


class ImageListDataset(Dataset[Item]):
    """Decodes the listed images; a decode failure is returned as a :class:`ReadFailure`, not raised.

    Returning failures as values lets the main process raise one clean :class:`DataError` that names the file,
    instead of the multi-line worker traceback DataLoader would otherwise re-raise.
    """

    def __init__(self, samples: Sequence[Sample], preprocess: Preprocess) -> None:
        self.samples = list(samples)
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Item:
        sample = self.samples[index]
        try:
            return load_image(sample.path, self.preprocess), sample.label
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as error:
            return ReadFailure(sample.source, sample.path, str(error) or type(error).__name__), sample.label


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CollateImages:
    """Stack uint8 images and labels (normalising them when ``preprocess`` is given), or pass on a read failure.

    On a CPU-only run with loader workers, normalising here overlaps it with the forward pass in the main process;
    with a GPU the uint8 batch is copied (four times smaller) and normalised on the device instead.
    """

    preprocess: Preprocess | None = None

    def __call__(self, items: list[Item]) -> Batch | ReadFailure:
        decoded: list[torch.Tensor] = []
        for image, _ in items:
            if isinstance(image, ReadFailure):
                return image
            decoded.append(image)
        images = torch.stack(decoded)
        labels = torch.tensor([label for _, label in items], dtype=torch.long)
        if self.preprocess is not None:
            images = normalize_batch(images, self.preprocess)
        return images, labels


class EvalLoader:
    """Iterates normalised float batches and labels on ``device``; reusable for many passes.

    Attributes:
        samples: The evaluated samples, in order.
        layout: Human-readable description of where they came from.
        num_classes: ``max(label) + 1`` over the samples.
        labelled: Whether the labels are real (False: every label is :data:`UNLABELLED`, ``Global.labels: none``).
        cached: The decoded images and their labels once :meth:`cache_in_memory` ran (None: every pass decodes).
        cache_placement: Where ``cached`` lives (:mod:`analysis.inputs.placement`): ``host`` once decoded, then what
            :meth:`place_cache` chose; None without a cache.
        staging: Makes the batches of ``cached`` on the device, and times it (:attr:`staging_seconds`).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        layout: str,
        preprocess: Preprocess,
        batch_size: int,
        num_workers: int,
        device: torch.device,
        labelled: bool = True,
    ) -> None:
        self.samples = list(samples)
        self.layout = layout
        self.labelled = labelled
        self.preprocess = preprocess
        self.device = device
        self.num_classes = max(s.label for s in self.samples) + 1
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cached: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cache_placement: Placement | None = None
        # normalising needs only the preprocessing: a bound method here would make a reference cycle, so that a
        # dropped loader (with its persistent decoding workers) waited for the cyclic garbage collector
        self.staging = Stager(device, functools.partial(normalize_batch, preprocess=preprocess))
        self.loader = self._data_loader(normalise_in_workers=device.type == "cpu" and num_workers > 0)

    def _data_loader(self, normalise_in_workers: bool, persistent: bool = True) -> DataLoader[Item]:
        return DataLoader(
            ImageListDataset(self.samples, self.preprocess),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=CollateImages(self.preprocess if normalise_in_workers else None),
            pin_memory=self.device.type == "cuda",
            persistent_workers=persistent and self.num_workers > 0,
        )

    @property
    def staging_seconds(self) -> float:
        """Seconds spent making batches from the decoded cache, cumulative over passes: host time to select the
        images, issue their copies to the device and normalise them (the device may still be working on them), or
        their real time with :attr:`measure_staging`."""
        return self.staging.seconds

    @property
    def measure_staging(self) -> bool:
        """Whether every staging step is synchronised with the device, so that :attr:`staging_seconds` is real time
        (for benchmarks: it stops copies from overlapping with compute)."""
        return self.staging.measure

    @measure_staging.setter
    def measure_staging(self, value: bool) -> None:
        self.staging.measure = value

    @property
    def num_samples(self) -> int:
        """Number of images per pass."""
        return len(self.samples)

    @property
    def cache_bytes(self) -> int:
        """RAM the decoded uint8 images take when cached."""
        return self.num_samples * 3 * self.preprocess.img_size**2

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.cached is not None:
            yield from self._iter_cached()
            return
        for images, labels in self._raw_batches(self.loader):
            images = images.to(self.device, non_blocking=True)
            if images.dtype == torch.uint8:
                images = normalize_batch(images, self.preprocess)
            yield images, labels.to(self.device, non_blocking=True)

    def _raw_batches(self, loader: DataLoader[Item]) -> Iterator[Batch]:
        for batch in loader:
            if isinstance(batch, ReadFailure):
                raise DataError(
                    f"{batch.source}: image {printable(batch.path)} cannot be decoded ({printable(batch.reason)})."
                )
            yield batch

    def _iter_cached(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cached is not None
        images, labels = self.cached
        yield from self.staging.batches(images, labels, self.batch_size)

    def in_order(self, order: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Batches of the samples at ``order`` (a permutation, for adaptive precision), with their indices."""
        order_tensor = torch.as_tensor(list(order), dtype=torch.long)
        starts = range(0, len(order_tensor), self.batch_size)
        if self.cached is not None:
            images, labels = self.cached
            batches = self.staging.batches(images, labels, self.batch_size, order_tensor)
            for start, (batch, batch_labels) in zip(starts, batches, strict=True):
                yield batch, batch_labels, order_tensor[start : start + self.batch_size]
            return
        subset = ImageListDataset([self.samples[i] for i in order_tensor.tolist()], self.preprocess)
        loader = DataLoader(subset, self.batch_size, num_workers=self.num_workers, collate_fn=CollateImages())
        for start, (images, labels) in zip(starts, self._raw_batches(loader), strict=True):
            batch = normalize_batch(images.to(self.device, non_blocking=True), self.preprocess)
            yield batch, labels.to(self.device), order_tensor[start : start + self.batch_size]

    def cache_in_memory(self, progress: bool | None = None) -> None:
        """Decode every image once into one uint8 tensor in RAM; every later pass reads the same batches from it.

        Batches are bit-identical to streamed ones (same order, same boundaries, same normalisation).
        """
        size = self.preprocess.img_size
        images = torch.empty((self.num_samples, 3, size, size), dtype=torch.uint8)
        labels = torch.empty(self.num_samples, dtype=torch.long)
        position = 0
        with progress_bar(progress, total=self.num_samples, desc="decode", unit="img", leave=False) as bar:
            for batch_images, batch_labels in self._raw_batches(self._data_loader(False, persistent=False)):
                count = len(batch_labels)
                images[position : position + count] = batch_images
                labels[position : position + count] = batch_labels
                position += count
                bar.update(count)
        self.cached = (images, labels)
        self.cache_placement = "host"

    def place_cache(self, share: float, name: str = "decoded images") -> Placement:
        """Keep the decoded images where this device makes batches fastest (see :mod:`analysis.inputs.placement`):
        on a CUDA device in GPU memory when they take at most ``share`` of the free GPU memory, else in pinned host
        memory; elsewhere in RAM, unchanged. Batches stay bit-identical. Logs where and why (``name``: what the images
        are) and returns the placement, also kept in :attr:`cache_placement`."""
        assert self.cached is not None, "place_cache needs the images decoded (cache_in_memory)"
        free = free_device_bytes(self.device)
        host = available_memory_bytes() if self.device.type == "cuda" else None
        placement = cache_placement(self.device, self.cache_bytes, free, share, host)
        if self._place(placement) != placement:  # pinning failed, and said so
            return "host"
        why = describe_placement(placement, self.cache_bytes, free, share, host)
        logger.log(logging.INFO if self.device.type == "cuda" else logging.DEBUG, "The %s are kept %s.", name, why)
        return placement

    def _place(self, placement: Placement) -> Placement:
        """Move :attr:`cached` to ``placement``; when pinned memory cannot be had, it stays where it is (``host``)."""
        assert self.cached is not None
        images, labels = self.cached
        try:
            self.cached = (placed(images, placement, self.device), placed(labels, placement, self.device))
        except RuntimeError as error:
            if placement != "pinned":
                raise
            logger.warning("Pinning the decoded images failed (%s); they stay in ordinary host memory.", error)
            placement = "host"
        self.cache_placement = placement
        return placement

    def subset(self, max_samples: int, seed: int) -> EvalLoader:
        """A seeded, class-balanced subset of at most ``max_samples`` of these images (read from the cache when these
        are cached, without decoding again, and kept in the same placement)."""
        indices = subset_indices(self.samples, max_samples, seed)
        chosen = [self.samples[i] for i in indices]
        layout = f"{self.layout} (class-balanced subset of {len(chosen)}, seed {seed})"
        subset = EvalLoader(
            chosen, layout, self.preprocess, self.batch_size, self.num_workers, self.device, self.labelled
        )
        if self.cached is not None:
            images, labels = self.cached
            index = torch.as_tensor(indices, dtype=torch.long, device=images.device)  # a GPU cache stays on the GPU
            subset.cached = (images[index], labels[index])
            subset._place(self.cache_placement or "host")  # a gather from pinned memory is pinned again
        return subset

    def fingerprint(self) -> str:
        """Identifies the evaluated images (paths relative to their list or folder, labels, order) and the
        preprocessing, so that an analysis file is never resumed on other data."""
        samples = [(s.path, s.label) for s in self.samples]
        root = os.path.commonpath([s.path for s in self.samples]) if self.samples else ""
        relative = [(os.path.relpath(path, root), label) for path, label in samples]
        return json_fingerprint({"samples": relative, "preprocess": self.preprocess.identity()})

    def check_labels(self, num_outputs: int) -> None:
        """Raise a :class:`DataError` naming the first label that the model's outputs cannot represent (nothing to
        check without labels)."""
        if not self.labelled:
            return
        for sample in self.samples:
            if not 0 <= sample.label < num_outputs:
                raise DataError(
                    f"{sample.source}: label {sample.label} is outside the model's {num_outputs} classes "
                    f"(valid labels are 0..{num_outputs - 1}, the data has labels up to {self.num_classes - 1}); "
                    "check the labels or the model's num_classes."
                )


def default_num_workers() -> int:
    """Loader processes to use when ``Global.num_workers`` is unset: one per available core, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(8, cores)


def build_eval_loader(cfg: GlobalConfig, device: torch.device) -> EvalLoader:
    """Build the evaluation loader described by the ``Global`` block."""
    assert cfg.data_dir is not None
    labelled = cfg.labels != "none"
    samples, layout = find_samples(cfg.data_dir, cfg.val_list, labelled)
    total = len(samples)
    samples = select_subset(samples, cfg.max_samples, cfg.seed)
    if len(samples) < total:
        kind = "class-balanced subset" if labelled else "random subset"
        layout += f" ({kind} of {len(samples)}/{total}, seed {cfg.seed})"
    workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    preprocess = Preprocess.from_config(cfg)
    check_image_memory(preprocess, min(cfg.batch_size, len(samples)), device)  # before the model runs on one image
    return EvalLoader(samples, layout, preprocess, cfg.batch_size, workers, device, labelled)


def available_memory_bytes() -> int:
    """Memory the system can give without swapping (Linux MemAvailable; elsewhere free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


PILLOW_BYTES_PER_PIXEL = 4
"""Pillow holds an RGB image with 4 bytes a pixel (the resized image exists whole before the center crop)."""


@dataclass(frozen=True)
class SizeKeys:
    """How messages name the sizes of a :class:`Preprocess`: the keys that set them (``{}`` is the value) and the keys
    that make them smaller (the calibration images' sizes default to the evaluation's)."""

    img_size: str = "Global.img_size {}"
    resize_size: str = "Global.resize_size {}"
    smaller_img_size: str = "Global.img_size (or Global.batch_size)"
    smaller_resize_size: str = "Global.resize_size"
    images: str = "image"


EVAL_SIZE_KEYS = SizeKeys()


def check_image_memory(
    preprocess: Preprocess,
    batch_size: int,
    device: torch.device,
    cached: int = 0,
    keys: SizeKeys = EVAL_SIZE_KEYS,
    available: int | None = None,
) -> None:
    """Refuse image sizes for which not even one batch fits in the available memory, before anything is allocated
    (else the allocator fails with a traceback, or the system kills the run).

    What is counted is the least any pass holds: a decoded uint8 batch, its float32 normalised copy when batches are
    normalised on the CPU, the ``cached`` images decoded once into RAM, and Pillow's resized image (short side
    ``resize_size``, the long side at least as long). Usual sizes need far less (1024 px at batch 256: 4 GB).

    Args:
        preprocess: The sizes.
        batch_size: Images per batch (at most the set's size).
        device: Where batches are normalised (host memory holds the float copy only on the CPU).
        cached: Images decoded once into RAM besides the batch.
        keys: How to name the sizes.
        available: Memory to compare with (default: :func:`available_memory_bytes`).

    Raises:
        ConfigError: Naming the key of the size at fault and what it needs.
    """
    crop, resize = preprocess.img_size, preprocess.resize_size
    image = 3 * crop * crop
    batch = batch_size * image * (5 if device.type == "cpu" else 1)
    resized = PILLOW_BYTES_PER_PIXEL * resize * resize
    free = available_memory_bytes() if available is None else available
    held = batch + cached * image
    needed = held + resized
    if needed <= free:
        return
    than = f"more than the {_bytes(free)} of memory this machine has available"
    if held >= resized:
        normalised = " with its float32 normalised copy" if device.type == "cpu" else ""
        one_batch = f"a batch of {batch_size}{normalised}"
        what = f"{one_batch} needs"
        if cached:
            what = f"the {cached} {keys.images}s decoded once into RAM and {one_batch} need"
        total = f" ({_bytes(needed)} with the image being resized)" if held <= free else ""
        raise ConfigError(
            f"{keys.img_size.format(crop)} makes one decoded {keys.images} {_bytes(image)} (3 x {crop} x {crop} "
            f"bytes), and {what} {_bytes(held)}{total}, {than}; use a smaller {keys.smaller_img_size}."
        )
    total = f" ({_bytes(needed)} with the decoded images)" if resized <= free else ""
    raise ConfigError(
        f"{keys.resize_size.format(resize)} makes each {keys.images} at least {_bytes(resized)} while it is resized "
        f"({PILLOW_BYTES_PER_PIXEL} x {resize} x {resize} bytes, before the center crop){total}, {than}; use a smaller "
        f"{keys.smaller_resize_size}."
    )


def _bytes(count: float) -> str:
    """``count`` bytes in decimal units, for messages: ``512 bytes``, ``30.0 GB``, ``1.2 TB``."""
    if count < 1000:
        return f"{count:.0f} bytes"
    power = min(5, int(math.log10(count)) // 3)
    return f"{count / 1000**power:.1f} {('', 'kB', 'MB', 'GB', 'TB', 'PB')[power]}"


def apply_data_cache(loader: EvalLoader, mode: str, max_gb: float | None, progress: bool | None = None) -> bool:
    """Decode the images once into RAM when ``mode`` asks for it (``ram``) or they fit the budget (``auto``).

    The budget is ``max_gb``, or half of the currently available memory when unset. Returns whether the loader now
    reads from RAM; with ``auto`` and too little memory it keeps streaming and says so.

    Raises:
        ConfigError: With ``ram``, for images that do not fit in the available memory (checked before allocating).
    """
    if mode == "off":
        return False
    budget = max_gb * 1024**3 if max_gb is not None else available_memory_bytes() / 2
    needed = loader.cache_bytes
    if mode == "auto" and needed > budget:
        logger.info(
            "Data cache off: the decoded images need %.2f GB, more than the %.2f GB budget (Global.cache_max_gb); "
            "every pass decodes the images again.", needed / 1024**3, budget / 1024**3,
        )  # fmt: skip
        return False
    free = available_memory_bytes()
    if needed > free and mode == "auto":  # a cache_max_gb above the memory there is
        logger.info(
            "Data cache off: the decoded images need %.2f GB, more than the %.2f GB of memory available; every pass "
            "decodes the images again.", needed / 1024**3, free / 1024**3,
        )  # fmt: skip
        return False
    if needed > free:  # allocating it would fail with a traceback, or get the run killed
        size = loader.preprocess.img_size
        raise ConfigError(
            f"Global.data_cache is ram but the {loader.num_samples} decoded images need {_bytes(needed)} (3 x {size} x "
            f"{size} bytes each), more than the {_bytes(free)} of memory this machine has available; use data_cache: "
            "auto (it streams what does not fit) or a smaller Global.img_size."
        )
    if needed > budget:
        logger.warning(
            "Global.data_cache is ram: caching %.2f GB, above the %.2f GB budget.", needed / 1e9, budget / 1e9
        )
    start = time.perf_counter()
    loader.cache_in_memory(progress)
    logger.info(
        "Decoded %d images once into RAM (%.2f GB) in %.1f s; later passes read them from there.",
        loader.num_samples, needed / 1024**3, time.perf_counter() - start,
    )  # fmt: skip
    return True

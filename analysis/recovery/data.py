"""Training images for recovery: where they are, their augmentation, and the order they are seen in.

The training set is ``Recovery.train_list`` (a PaddleSlim list file or a folder of class folders, relative to
``Global.data_dir``), else ``train_list.txt`` beside the evaluation list, else ``train/<class>/``: the places the
calibration images are looked for too. Every image gets the standard training augmentation (a random resized crop to
``img_size``, then a horizontal flip) and the model's own normalisation, applied on the device.

Every random choice is a function of (seed, epoch, image): the order of an epoch comes from a generator seeded with
(seed, epoch), each image's crop and flip from one seeded with (seed, epoch, index). The batch of any step is
therefore known without replaying the steps before it, whichever process draws it and however many loader
workers decode, so a resumed run sees exactly the images an uninterrupted one would have seen. Under torchrun the
global batch is split evenly over the processes (the same images, so the same result up to BatchNorm's per-process
statistics).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from analysis.config import Config
from analysis.errors import DataError, printable
from analysis.inputs.calibration import default_training_paths, find_default_training_images
from analysis.inputs.data import (
    INTERPOLATION_MODES,
    CollateImages,
    Item,
    Preprocess,
    ReadFailure,
    Sample,
    check_files_exist,
    default_num_workers,
    read_sample_list,
    rgb_image,
    scan_image_folder,
)

CROP_ATTEMPTS = 10


@dataclass(frozen=True)
class Augmentation:
    """The training augmentation: a random resized crop (area share and aspect ratio ranges) and a flip."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (0.75, 4 / 3)
    hflip: float = 0.5


@dataclass(frozen=True)
class TrainSource:
    """The training images: the samples in a fixed order and the layout they were found in (for messages)."""

    samples: tuple[Sample, ...]
    layout: str


def find_train_source(config: Config, labelled: bool) -> TrainSource:
    """The training images of ``config`` (see the module docstring); labels are required only when ``labelled``.

    Raises:
        DataError: When ``Recovery.train_list`` does not exist, no default training set is found, a list line is
            malformed, or a listed image is missing.
    """
    g = config.Global
    assert g.data_dir is not None
    root = Path(g.data_dir)
    named = config.Recovery.train_list
    if named is not None:
        path = Path(named) if Path(named).is_absolute() else root / named
        if not path.exists():
            raise DataError(f"Recovery.train_list {printable(path)} does not exist; name a list file or a folder of "
                            "class folders holding the training images (relative to Global.data_dir).")  # fmt: skip
    else:
        found = find_default_training_images(root, g.val_list)
        if found is None:
            listed, folder = (printable(candidate) for candidate in default_training_paths(root, g.val_list))
            raise DataError(f"No training images for run.py compress: neither {listed} nor {folder}/<class>/ exists; "
                            "name them in Recovery.train_list.")  # fmt: skip
        path = found[0]
    if path.is_dir():
        samples, layout = scan_image_folder(path), f"ImageFolder {path}"
    else:
        samples, layout = read_sample_list(root, path, "Recovery.train_list", require_labels=labelled), f"list {path}"
    if not samples:
        raise DataError(f"Recovery.train_list {printable(path)} holds no images.")
    check_files_exist(samples)
    return TrainSource(tuple(samples), layout)


def seeded(*parts: int) -> torch.Generator:
    """A generator whose stream depends on every part (seed, epoch, image index...)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def crop_box(width: int, height: int, augmentation: Augmentation, generator: torch.Generator) -> tuple[int, ...]:
    """A random resized crop's (top, left, height, width): an area share and a log-uniform aspect ratio drawn until
    the box fits (up to 10 tries), else the centred crop of the clamped aspect ratio (torchvision's rule)."""
    area = width * height
    low, high = math.log(augmentation.ratio[0]), math.log(augmentation.ratio[1])
    for _ in range(CROP_ATTEMPTS):
        draws = torch.rand(4, generator=generator).tolist()
        target = area * (augmentation.scale[0] + draws[0] * (augmentation.scale[1] - augmentation.scale[0]))
        aspect = math.exp(low + draws[1] * (high - low))
        box_w, box_h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < box_w <= width and 0 < box_h <= height:
            return int(draws[2] * (height - box_h + 1)), int(draws[3] * (width - box_w + 1)), box_h, box_w
    aspect = width / height
    if aspect < augmentation.ratio[0]:
        box_w, box_h = width, round(width / augmentation.ratio[0])
    elif aspect > augmentation.ratio[1]:
        box_h, box_w = height, round(height * augmentation.ratio[1])
    else:
        box_w, box_h = width, height
    return (height - box_h) // 2, (width - box_w) // 2, box_h, box_w


class TrainImages(Dataset[Item]):
    """Augmented uint8 images of one epoch; the dataset is told the epoch so its draws depend on it. An image that
    cannot be decoded is returned as a :class:`ReadFailure` (raised as one clean error by the main process)."""

    def __init__(self, source: TrainSource, preprocess: Preprocess, augmentation: Augmentation, seed: int) -> None:
        self.source = source
        self.samples = source.samples
        self.preprocess = preprocess
        self.augmentation = augmentation
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Item:
        sample = self.samples[index]
        generator = seeded(self.seed, self.epoch, index)
        try:
            with Image.open(sample.path) as image:
                rgb = rgb_image(image)
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as error:
            return ReadFailure(sample.source, sample.path, str(error) or type(error).__name__), sample.label
        top, left, height, width = crop_box(rgb.width, rgb.height, self.augmentation, generator)
        size = self.preprocess.img_size
        mode = INTERPOLATION_MODES[self.preprocess.interpolation]
        crop = TF.resized_crop(rgb, top, left, height, width, [size, size], interpolation=mode, antialias=True)
        cropped = TF.pil_to_tensor(crop)  # cropped and resized by Pillow first: the full image is never a tensor
        if torch.rand(1, generator=generator).item() < self.augmentation.hflip:
            cropped = TF.horizontal_flip(cropped)
        return cropped, sample.label


@dataclass(frozen=True)
class Sharding:
    """This process's share of every global batch: processes split each batch evenly, in rank order."""

    rank: int = 0
    world_size: int = 1


class TrainBatches:
    """The batches of every step, from any step on: ``steps_per_epoch`` full global batches an epoch (the images left
    over are in the next epoch's order instead), this process's share of each."""

    def __init__(
        self, images: TrainImages, batch_size: int, num_workers: int, sharding: Sharding, pin_memory: bool = False
    ) -> None:
        count = len(images)
        if batch_size > count:
            raise DataError(f"Recovery.batch_size {batch_size} is larger than the {count} training images; lower it "
                            "(it defaults to Global.batch_size).")  # fmt: skip
        if batch_size % sharding.world_size:
            raise DataError(f"Recovery.batch_size {batch_size} does not split evenly over {sharding.world_size} "
                            "processes; make it a multiple of the process count.")  # fmt: skip
        self.images = images
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.sharding = sharding
        self.pin_memory = pin_memory
        self.steps_per_epoch = count // batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """Every image index of ``epoch`` in the order it is seen."""
        return torch.randperm(len(self.images), generator=seeded(self.images.seed, epoch, -1)).tolist()

    def from_step(self, step: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(step, images, labels)`` from ``step`` on (this epoch's rest, then the next epochs'), uint8 images."""
        while True:
            epoch, position = divmod(step, self.steps_per_epoch)
            self.images.epoch = epoch
            share = self.batch_size // self.sharding.world_size
            order = self.epoch_order(epoch)
            starts = range(position * self.batch_size, self.steps_per_epoch * self.batch_size, self.batch_size)
            batches = [order[start : start + self.batch_size] for start in starts]
            mine = [batch[self.sharding.rank * share : (self.sharding.rank + 1) * share] for batch in batches]
            # its own generator: a loader drawing its workers' seeds from the global one would shift the dropout
            # masks of a resumed run, which starts a loader where an uninterrupted run did not
            loader = DataLoader(self.images, batch_sampler=mine, num_workers=self.num_workers,
                                collate_fn=CollateImages(), pin_memory=self.pin_memory,
                                generator=seeded(self.images.seed, epoch, -2))  # fmt: skip
            for batch in loader:
                if isinstance(batch, ReadFailure):
                    raise DataError(f"Training image {printable(batch.path)} ({printable(batch.source)}) cannot be "
                                    f"read: {printable(batch.reason)}; fix or remove it from the list.")  # fmt: skip
                yield step, batch[0], batch[1]
                step += 1


def build_train_batches(
    config: Config, preprocess: Preprocess, labelled: bool, sharding: Sharding, pin_memory: bool = False
) -> TrainBatches:
    """The training batches ``config`` describes, augmented for ``preprocess`` (the model's own resolution); with
    ``pin_memory`` (training on a GPU) in page-locked memory, so the copy to the device overlaps the step."""
    r, g = config.Recovery, config.Global
    source = find_train_source(config, labelled)
    augmentation = Augmentation((r.crop_scale[0], r.crop_scale[1]), (r.crop_ratio[0], r.crop_ratio[1]), r.hflip)
    seed = g.seed if r.seed is None else r.seed
    images = TrainImages(source, preprocess, augmentation, seed)
    workers = r.num_workers if r.num_workers is not None else g.num_workers
    workers = default_num_workers() if workers is None else workers
    return TrainBatches(images, r.batch_size or g.batch_size, workers, sharding, pin_memory)

"""Calibration images (the ``Global.calib_*`` keys) for BatchNorm re-estimation of pruned networks.

Calibration images are training images on which the running statistics of BatchNorm layers are re-estimated after
pruning; their labels only serve class-balanced subsetting, so a list line may be a path alone (whatever
``Global.labels`` says: unlabelled images are subset as one group). They come from ``Global.calib_list`` (a
PaddleSlim list file or an ImageFolder root; relative paths are read from ``Global.data_dir``, like
``Global.val_list``) or, when it is unset, from ``train_list.txt`` beside the evaluation list (PaddleSlim's ImageNet
reader) or from ``data_dir/train/<class>/`` (torchvision's ImageFolder). A seeded, class-balanced subset of
``Global.calib_samples`` images is decoded once into RAM, so that a broken image fails before any analysis output is
written and the many re-estimation passes (one per evaluated variant) never decode again.

Calibrating on evaluation images makes re-estimated numbers optimistic: a set found by default that shares images
with the evaluation set is refused, a set named in ``Global.calib_list`` is used with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from analysis.config import GlobalConfig
from analysis.errors import DataError
from analysis.inputs.data import (
    EvalLoader,
    Preprocess,
    Sample,
    SizeKeys,
    check_files_exist,
    check_image_memory,
    has_subfolders,
    read_sample_list,
    scan_image_folder,
    select_subset,
)

logger = logging.getLogger(__name__)

DEFAULT_TRAIN_LIST = "train_list.txt"
DEFAULT_TRAIN_FOLDER = "train"


@dataclass(frozen=True)
class CalibrationSource:
    """Where the calibration images are listed: a PaddleSlim list file or an ImageFolder root.

    Attributes:
        path: The list file or folder (absolute).
        kind: ``list`` or ``folder``.
        explicit: Whether ``Global.calib_list`` named it (otherwise it was found by default).
    """

    path: Path
    kind: str
    explicit: bool

    @property
    def layout(self) -> str:
        """Human-readable layout and origin, e.g. ``PaddleSlim list /data/train_list.txt (found by default)``."""
        name = "PaddleSlim list" if self.kind == "list" else "ImageFolder"
        origin = "Global.calib_list" if self.explicit else "found by default"
        return f"{name} {self.path} ({origin})"


@dataclass
class CalibrationSet:
    """The calibration images of a job, decoded into RAM once and iterated once per re-estimation.

    Attributes:
        loader: Batches of normalised images (and their labels) on the job's device; re-iterable, decoded once (in
            RAM, or on a GPU where ``loader.cache_placement`` says).
        source: Which list file or folder, how many of its images, and the subset's seed (for logs and reports).
        path: The list file or folder the images came from.
        explicit: Whether ``Global.calib_list`` named it (otherwise it was found by default).
    """

    loader: EvalLoader
    source: str
    path: str
    explicit: bool

    @property
    def num_samples(self) -> int:
        """Number of calibration images per re-estimation pass."""
        return self.loader.num_samples

    def fingerprint(self) -> str:
        """Identifies the calibration images and their preprocessing, so that results re-estimated on other
        images are never mixed with these."""
        return self.loader.fingerprint()

    def describe(self) -> str:
        """One line for logs: the source and the preprocessing."""
        pre = self.loader.preprocess
        return f"{self.source}; resize {pre.resize_size}, crop {pre.img_size}, {pre.interpolation}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly description for the sidecar: source, path, image count, origin, preprocessing, fingerprint."""
        preprocess = {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in self.loader.preprocess.identity().items()
        }
        return {
            "source": self.source,
            "path": self.path,
            "images": self.num_samples,
            "explicit": self.explicit,
            "preprocess": preprocess,
            "fingerprint": self.fingerprint(),
        }


def resolve_calibration(cfg: GlobalConfig) -> CalibrationSource | None:
    """Locate the calibration images: ``Global.calib_list`` when set, else the training set beside the evaluation data.

    Returns:
        The list file or ImageFolder root, or None when calibration is off (``Global.calib_samples`` is 0) or no
        training images were found by default (logged at INFO level with how to name them).

    Raises:
        DataError: If ``Global.calib_list`` names a path that does not exist.
    """
    if cfg.calib_samples == 0:
        return None
    assert cfg.data_dir is not None
    if cfg.calib_list is not None:
        path = _under_data_dir(cfg.data_dir, cfg.calib_list)
        if path.is_file():
            return CalibrationSource(path, "list", explicit=True)
        if path.is_dir():
            return CalibrationSource(path, "folder", explicit=True)
        raise DataError(
            f"Global.calib_list {path} does not exist; name a list file or a folder of class folders holding "
            "training images (relative paths are read from Global.data_dir)."
        )
    found = find_default_training_images(cfg.data_dir, cfg.val_list)
    if found is not None:
        return CalibrationSource(*found, explicit=False)
    train_list, train_folder = default_training_paths(cfg.data_dir, cfg.val_list)
    logger.info(
        "No calibration images found (neither %s nor %s/<class>/ exists); to re-estimate BatchNorm statistics, "
        "name a list file or a folder of training images in Global.calib_list.", train_list, train_folder,
    )  # fmt: skip
    return None


def default_training_paths(data_dir: str | Path, val_list: str) -> tuple[Path, Path]:
    """Where training images are looked for when none are named: ``train_list.txt`` beside the evaluation list
    (PaddleSlim's ImageNet reader), then ``data_dir/train/<class>/`` (torchvision's ImageFolder)."""
    return _under_data_dir(data_dir, val_list).parent / DEFAULT_TRAIN_LIST, _under_data_dir(
        data_dir, DEFAULT_TRAIN_FOLDER
    )


def find_default_training_images(data_dir: str | Path, val_list: str) -> tuple[Path, str] | None:
    """The first of :func:`default_training_paths` that exists, with its layout (``list`` or ``folder``); None for
    neither. Calibration and recovery's training images share this rule."""
    train_list, train_folder = default_training_paths(data_dir, val_list)
    if train_list.is_file():
        return train_list, "list"
    if train_folder.is_dir() and has_subfolders(train_folder):
        return train_folder, "folder"
    return None


def read_calibration_samples(source: CalibrationSource, data_dir: str | Path) -> list[Sample]:
    """Every image of ``source`` in a deterministic order (list order, or sorted classes and files).

    List paths are relative to ``data_dir`` (the PaddleSlim convention, as for ``Global.val_list``); labels are
    optional, since re-estimation never reads them. Each sample's
    ``source`` says it is a calibration image, so that later messages (missing or undecodable image) say so too.

    Raises:
        DataError: If the list cannot be read, is malformed or lists no images, or the folder has no class folders
            or no images.
    """
    where = "Global.calib_list" if source.explicit else f"The default calibration {source.kind}"
    instead = "" if source.explicit else ", or name other training images in Global.calib_list"
    if source.kind == "list":
        samples = read_sample_list(Path(data_dir), source.path, key=where, require_labels=False)
        if not samples:
            raise DataError(
                f"{where} {source.path} lists no images; add '<relative/path>' lines (a label after the path is "
                f"optional){instead}."
            )
        prefix = "calibration list"
    else:
        if not has_subfolders(source.path):
            raise DataError(
                f"{where} {source.path} has no class folders; the ImageFolder layout is "
                f"{source.path}/<class>/<image>{instead}."
            )
        samples = scan_image_folder(source.path)
        if not samples:
            raise DataError(f"{where} {source.path} has no images in its class folders; add training images{instead}.")
        prefix = "calibration folder"
    return [dataclasses.replace(sample, source=f"{prefix} {sample.source}") for sample in samples]


def calibration_preprocess(cfg: GlobalConfig) -> Preprocess:
    """The evaluation preprocessing, with ``Global.calib_resize_size``/``calib_img_size`` replacing their fields."""
    preprocess = Preprocess.from_config(cfg)
    resize_size = preprocess.resize_size if cfg.calib_resize_size is None else cfg.calib_resize_size
    img_size = preprocess.img_size if cfg.calib_img_size is None else cfg.calib_img_size
    return dataclasses.replace(preprocess, resize_size=resize_size, img_size=img_size)


def calibration_size_keys(cfg: GlobalConfig) -> SizeKeys:
    """How messages name the calibration images' sizes: their own keys, or the evaluation's they default to."""

    def subject(key: str, own: str) -> str:
        if getattr(cfg, own) is not None:
            return f"Global.{own} {{}}"
        return f"Global.{key} {{}}, which the calibration images use while Global.{own} is unset,"

    return SizeKeys(
        subject("img_size", "calib_img_size"),
        subject("resize_size", "calib_resize_size"),
        "Global.calib_img_size (or fewer Global.calib_samples)",
        "Global.calib_resize_size",
        "calibration image",
    )


def build_calibration_set(
    cfg: GlobalConfig, device: torch.device, eval_loader: EvalLoader, progress: bool | None = None
) -> CalibrationSet | None:
    """Build the calibration images of the ``Global`` block, decoded into RAM (see :func:`resolve_calibration`).

    A seeded (``Global.seed``), class-balanced subset of ``Global.calib_samples`` images is used (all when there
    are fewer), batched by ``Global.batch_size`` with the evaluation loader's workers. On a GPU the decoded images
    are then kept in GPU memory or pinned host memory, as ``Global.device_cache_share`` says.

    Returns:
        The calibration set, or None when calibration is off or no calibration images were found.

    Raises:
        DataError: For a missing, unreadable or empty list or folder, a missing or undecodable image, or a set
            found by default that shares images with the evaluation set.
        ConfigError: For calibration image sizes whose images do not fit in the available memory (checked before
            allocating them).
    """
    source = resolve_calibration(cfg)
    if source is None:
        return None
    assert cfg.data_dir is not None
    found = read_calibration_samples(source, cfg.data_dir)
    samples = select_subset(found, cfg.calib_samples, cfg.seed)
    check_files_exist(samples)
    check_overlap(source, samples, eval_loader.samples)
    if len(samples) < len(found):
        count = f"class-balanced subset of {len(samples)} of {len(found)} images, seed {cfg.seed}"
    else:
        count = f"all {len(found)} images"
    description = f"{source.layout}, {count}"
    preprocess = calibration_preprocess(cfg)
    batch = min(cfg.batch_size, len(samples))
    check_image_memory(preprocess, batch, device, cached=len(samples), keys=calibration_size_keys(cfg))
    loader = EvalLoader(samples, description, preprocess, cfg.batch_size, eval_loader.num_workers, device)
    loader.cache_in_memory(progress)
    loader.place_cache(cfg.device_cache_share, "decoded calibration images")  # on a GPU: GPU or pinned memory
    return CalibrationSet(loader, description, str(source.path), source.explicit)


def check_overlap(source: CalibrationSource, calibration: Sequence[Sample], evaluation: Sequence[Sample]) -> int:
    """Count the calibration images that are also evaluation images (same real path); warn about them when the
    set was named in ``Global.calib_list``.

    Raises:
        DataError: If the set was found by default and shares images with the evaluation set.
    """
    evaluated = {os.path.realpath(sample.path) for sample in evaluation}
    shared = sum(os.path.realpath(sample.path) in evaluated for sample in calibration)
    if not shared:
        return 0
    if source.explicit:
        logger.warning(
            "%d of the %d calibration images (Global.calib_list %s) are evaluation images, so numbers with "
            "re-estimated BatchNorm statistics are optimistic.", shared, len(calibration), source.path,
        )  # fmt: skip
        return shared
    raise DataError(
        f"The calibration images found by default in {source.path} share {shared} of {len(calibration)} images with "
        "the evaluation set; point Global.calib_list at training images, or name this set in Global.calib_list to "
        "calibrate on evaluation images anyway (re-estimated numbers are then optimistic)."
    )


def _under_data_dir(data_dir: str | Path, name: str | Path) -> Path:
    """``name`` as given when absolute, else inside ``data_dir`` (as absolute path, for messages and sidecars)."""
    path = Path(name) if Path(name).is_absolute() else Path(data_dir) / name
    return Path(os.path.abspath(path))

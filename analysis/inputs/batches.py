"""Checks and normalises the in-memory batches a Python caller passes (``analysis_prune``'s ``data`` and
``calibration``), so that a wrong batch is one sentence naming the argument, said before any work starts, instead of
a torch error from deep inside an analysis.

The rules:

* Evaluation batches are ``(images, labels)`` pairs: a tuple or a list of two tensors (what a DataLoader yields).
  Images have a batch dimension first, e.g. ``(batch, 3, height, width)``; labels are integer class indices of shape
  ``(batch,)`` within the model's classes (other integer types become int64). A bare image tensor is a batch only
  where no labels are needed (the label-free metrics ``agreement`` and ``kl``); dicts and longer tuples are refused.
* Calibration batches are images, or a tuple or list whose first item is the images (labels are not used).
* uint8 images are divided by 255 into floats in [0, 1], without any normalisation (the model sees
  ``images.float() / 255``); floating images of another dtype than the model's parameters (float16, float64) are
  converted to it, as the model's layers need. Each conversion is said once per call, as a logging warning.
* A one-pass iterator (a generator) is read once and its batches kept in memory, since every variant is evaluated on
  another pass. Lists and tuples, in memory anyway, are checked whole up front; any other iterable (a DataLoader) is
  checked batch by batch as it is read, its first batch before any work starts, so a large data set is never read
  twice for checking.
* The package's own :class:`~analysis.inputs.data.EvalLoader` is passed through: it checks its own data.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from analysis.errors import DataError
from analysis.inputs.arguments import described, is_collection
from analysis.inputs.data import UNLABELLED, EvalLoader

logger = logging.getLogger(__name__)

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Label dtypes taken as class indices (converted to int64, exactly)."""

UINT8_CONVERSION = (
    "divided by 255 into floats in [0, 1] without normalisation (no mean and std are applied; pass float images "
    "normalised as in training if the model needs that)"
)
"""What happens to uint8 images, as the warning says it."""


class Labels(enum.Enum):
    """What the batches of an argument carry besides the images."""

    REQUIRED = "required"
    """``(images, labels)`` pairs, the labels checked (top1, top5 and ce need them)."""
    OPTIONAL = "optional"
    """Pairs, or bare image tensors throughout (the label-free metrics need no labels)."""
    UNUSED = "unused"
    """Images, or tuples starting with them; the rest is not looked at (calibration)."""


def floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter or buffer (float32 for a model without one)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


@dataclass
class ImageConversion:
    """Brings image tensors to the model's floating dtype, saying once per kind what it converted.

    Attributes:
        name: The argument the images come from, named in messages.
        dtype: The model's floating dtype (:func:`floating_dtype`).
    """

    name: str
    dtype: torch.dtype
    _said: set[torch.dtype] = field(default_factory=set)

    def __call__(self, images: object, where: str | None = None) -> torch.Tensor:
        """``images`` as the model takes them; ``where`` says which batch of the argument they are, for messages."""
        subject = f"{self.name}: the images of {where}" if where else self.name
        if not isinstance(images, torch.Tensor):
            raise DataError(f"{subject} must be a tensor, got {described(images)}.")
        if images.dim() < 2 or len(images) == 0:
            raise DataError(
                f"{subject} must be a tensor with a non-empty batch dimension first, e.g. (batch, 3, height, width), "
                f"got shape {tuple(images.shape)}."
            )
        if images.dtype == torch.uint8:
            self._say(images.dtype, UINT8_CONVERSION)
            return images.to(torch.float32).div(255).to(self.dtype)
        if not images.is_floating_point():
            raise DataError(f"{subject} must be floating-point or uint8, got a {images.dtype} tensor.")
        if images.dtype != self.dtype:
            self._say(images.dtype, f"converted to {self.dtype}, the dtype of the model's parameters")
            return images.to(self.dtype)
        return images

    def _say(self, dtype: torch.dtype, what: str) -> None:
        if dtype not in self._said:
            self._said.add(dtype)
            logger.warning("%s: %s images are %s.", self.name, dtype, what)


@dataclass
class BatchCheck:
    """Checks and normalises the batches of one argument, one batch at a time.

    Attributes:
        images: Brings the images to the model's dtype (and names the argument).
        labels: What the batches carry besides the images.
        count_classes: The number of classes the model predicts, from a few of its images (run once, on the first
            labelled batch); None checks labels for their type and shape only.
    """

    images: ImageConversion
    labels: Labels
    count_classes: Callable[[torch.Tensor], int] | None = None
    bare: bool | None = None
    """Whether the batches are bare image tensors (set by the first batch; every later one must be alike)."""
    _classes: int | None = None

    @property
    def name(self) -> str:
        """The argument checked."""
        return self.images.name

    def batch(self, batch: object, index: int, data: object = None) -> Any:
        """Batch ``index`` normalised: ``(images, labels)`` for evaluation (labels :data:`UNLABELLED` for bare images),
        the calibration batch's own form with converted images; ``data`` (the whole argument) improves a message."""
        where = f"batch {index}"
        if self.labels is Labels.UNUSED:
            if isinstance(batch, torch.Tensor):
                return self.images(batch, where)
            if isinstance(batch, (tuple, list)) and batch:
                return (self.images(batch[0], where), *batch[1:])
            raise DataError(f"{self.name}: {where} must be images or an (images, labels) pair, got {described(batch)}.")
        bare = isinstance(batch, torch.Tensor)
        if self.bare is None:
            self.bare = bare
        if bare and self.labels is Labels.REQUIRED:
            raise self._shape_error(
                where, batch, data, " (bare images serve only the label-free metrics agreement and kl)"
            )
        if bare != self.bare:
            kinds = {True: "bare images", False: "a pair"}
            raise DataError(
                f"{self.name}: {where} is {kinds[bare]} while batch 0 was {kinds[self.bare]}; give every batch labels, "
                "or none."
            )
        if isinstance(batch, torch.Tensor):
            images = self.images(batch, where)
            return images, torch.full((len(images),), UNLABELLED, dtype=torch.long, device=images.device)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise self._shape_error(where, batch, data)
        images = self.images(batch[0], where)
        return images, self._labels(batch[1], images, where)

    def _shape_error(self, where: str, batch: object, data: object, why: str = "") -> DataError:
        if isinstance(batch, Mapping):
            keys = ", ".join(map(repr, list(batch)[:4]))
            found = f"a dict with keys {keys}; map it to pairs, e.g. [(b['image'], b['label']) for b in batches]"
        elif isinstance(batch, (tuple, list)):
            found = f"a {type(batch).__name__} of {len(batch)} items; keep two, e.g. [(b[0], b[1]) for b in batches]"
        else:
            found = described(batch) + why
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(d, torch.Tensor) for d in data):
            found += "; for a single batch pass a list holding it, [(images, labels)]"
        return DataError(
            f"{self.name}: every batch must be an (images, labels) pair (a tuple or list of two tensors), {where} is "
            f"{found}."
        )

    def _labels(self, labels: object, images: torch.Tensor, where: str) -> torch.Tensor:
        if not isinstance(labels, torch.Tensor):
            raise DataError(f"{self.name}: the labels of {where} must be a tensor of class indices, got "
                            f"{described(labels)}.")  # fmt: skip
        if labels.dtype not in INTEGER_DTYPES:
            raise DataError(
                f"{self.name}: the labels of {where} must be integer class indices, got a {labels.dtype} tensor; pass "
                "labels.long() (or labels.argmax(1) for one-hot rows)."
            )
        if labels.shape != (len(images),):
            raise DataError(f"{self.name}: the labels of {where} must have shape ({len(images)},), one class index per "
                            f"image, got shape {tuple(labels.shape)}.")  # fmt: skip
        classes = self._class_count(images)
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or (classes is not None and high >= classes):
            bad = low if low < 0 else high
            allowed = f"the model's {classes} classes (0 to {classes - 1})" if classes is not None else "0 and above"
            raise DataError(f"{self.name}: {where} holds the label {bad}, outside {allowed}.")
        return labels if labels.dtype == torch.int64 else labels.long()

    def _class_count(self, images: torch.Tensor) -> int | None:
        if self._classes is None and self.count_classes is not None:
            self._classes = self.count_classes(images)
        return self._classes


class CheckedIterable:
    """Any re-iterable source of batches (a DataLoader), checked and normalised batch by batch as it is read.

    Attributes:
        labelled: False for bare image batches (read by the engine, as :class:`~analysis.inputs.data.EvalLoader`'s).
    """

    def __init__(self, source: Iterable[Any], check: BatchCheck) -> None:
        self.source, self.check = source, check
        self.labelled = True

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.source):
            yield self.check.batch(batch, index)


class UnlabelledBatches(list[Any]):
    """A list of bare image batches as ``(images, UNLABELLED labels)`` pairs; the engine reads :attr:`labelled`."""

    labelled = False


@dataclass(frozen=True)
class CheckedBatches:
    """An argument's batches as the engine takes them, and its first batch (for tracing and the fingerprint).

    Attributes:
        batches: The normalised batches: a list, a :class:`CheckedIterable`, or the package's own loader.
        images: The first batch's images.
        labels: The first batch's labels (None for bare images, or calibration batches without them).
    """

    batches: Iterable[Any]
    images: torch.Tensor
    labels: torch.Tensor | None


def checked_batches(data: object, check: BatchCheck) -> CheckedBatches:
    """``data`` checked (wholly when in memory, else its first batch now and every batch as it is read) and
    normalised by ``check``; a one-pass iterator is read into a list first (see the module's rules).

    Raises:
        DataError: For data that is no iterable of batches, yields none, or whose checked batches break a rule.
    """
    name = check.name
    if not is_collection(data):
        raise DataError(
            f"{name} must be batches of (images, labels), e.g. a DataLoader or a list of (images, labels) pairs, got "
            f"{described(data)}."
        )
    if isinstance(data, EvalLoader):
        first = next(iter(data), None)
        if first is None:
            raise DataError(f"{name} yields no batches; pass a non-empty iterable of (images, labels).")
        return CheckedBatches(data, first[0], first[1])
    if isinstance(data, Iterator):
        data = list(data)  # one pass only: kept for the many passes of an analysis
    assert isinstance(data, Iterable)
    batches: Iterable[Any]
    if isinstance(data, Sequence):
        batches = [check.batch(batch, index, data) for index, batch in enumerate(data)]
        if check.bare and check.labels is Labels.OPTIONAL:
            batches = UnlabelledBatches(batches)
        first = batches[0] if batches else None
    else:
        batches = CheckedIterable(data, check)
        first = next(iter(batches), None)
        batches.labelled = not check.bare or check.labels is not Labels.OPTIONAL
    if first is None:
        raise DataError(f"{name} yields no batches; pass a non-empty iterable of (images, labels).")
    if isinstance(first, torch.Tensor):
        return CheckedBatches(batches, first, None)
    labels = first[1] if len(first) > 1 and isinstance(first[1], torch.Tensor) and not check.bare else None
    return CheckedBatches(batches, first[0], labels)

"""Label-free metrics: how closely a pruned model follows the unpruned (dense) model's own predictions.

``agreement`` is the fraction of images whose top-1 class (argmax of the logits) is the dense model's; ``kl`` is the
mean over images of KL(p_dense || p_pruned) in nats, from the two softmax distributions. Neither reads a label, so
data without labels can be analysed; both measure fidelity to the dense model, not accuracy. The dense model scores
agreement 1 and kl 0 by definition.

The dense model's outputs are computed once per run, in the baseline pass, and kept by sample index (an image's
position in the evaluation set), so that a pass in another order (adaptive precision) or a subset of it compares each
image with its own reference. A pass over the data is summed up by :class:`Scores`: the labelled metrics (top1, top5,
ce) when the data has labels, and the label-free ones when the run's metric is one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from analysis.engine.evaluate import MetricSums
from analysis.metrics import LABEL_FREE_METRICS

IndexedBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Images, labels and each image's sample index."""


@dataclass(frozen=True)
class DenseOutputs:
    """The dense model's prediction for every evaluation image, row ``i`` for sample index ``i``.

    Attributes:
        argmax: ``(images,)`` int64, the dense model's top-1 class (8 bytes per image).
        log_probs: ``(images, classes)`` float32 log-softmax, kept only for ``kl`` (None otherwise), on the evaluation
            device: 4 bytes per image and class, 200 MB for ImageNet's 50,000 validation images and 1,000 classes.
    """

    argmax: torch.Tensor
    log_probs: torch.Tensor | None


@dataclass(frozen=True)
class Fidelity:
    """Per-image fidelity of a batch to the dense model: top-1 agreement (bool) and, with ``kl``, the divergence."""

    agree: torch.Tensor
    kl: torch.Tensor | None


def fidelity(logits: torch.Tensor, dense: DenseOutputs, index: torch.Tensor) -> Fidelity:
    """Compare a batch's logits with the dense outputs of the same images (``index``: their sample indices)."""
    rows = index.to(dense.argmax.device)
    agree = logits.argmax(dim=1).eq(dense.argmax[rows])
    if dense.log_probs is None:
        return Fidelity(agree, None)
    log_pruned = torch.log_softmax(logits.float(), dim=1)
    # kl_div(input, target, log_target=True) is exp(target) * (target - input): KL(target || input) per class
    kl = F.kl_div(log_pruned, dense.log_probs[rows], reduction="none", log_target=True).sum(dim=1)
    return Fidelity(agree, kl)


class DenseRecorder:
    """Collects the dense outputs during the baseline pass, batch by batch in any order of the images.

    Args:
        images: Images in the evaluation set, when known: the outputs are then written into tensors allocated once
            (no second copy); otherwise batches are kept and assembled at the end.
        log_probs: Keep the log-probabilities (needed by ``kl``), not only the argmax.
    """

    def __init__(self, images: int | None, log_probs: bool) -> None:
        self.images, self.keep_log_probs = images, log_probs
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.outputs: DenseOutputs | None = None
        self.filled = 0

    def add(self, logits: torch.Tensor, index: torch.Tensor) -> None:
        """Keep the dense model's outputs for the images at ``index``."""
        argmax = logits.argmax(dim=1)
        log_probs = torch.log_softmax(logits.float(), dim=1) if self.keep_log_probs else None
        self.filled += len(index)
        if self.images is None:
            self.parts.append((index, argmax, log_probs))
            return
        if self.outputs is None:
            self.outputs = self._allocate(self.images, logits.shape[1], logits.device)
        self._write(self.outputs, index, argmax, log_probs)

    def result(self) -> DenseOutputs:
        """The outputs of every image of the pass.

        Raises:
            ValueError: If the pass did not cover every image once (a bug in the caller).
        """
        if self.outputs is None and self.parts:
            _, argmax, log_probs = self.parts[0]
            classes = 0 if log_probs is None else log_probs.shape[1]
            self.outputs = self._allocate(self.filled, classes, argmax.device)
            while self.parts:
                self._write(self.outputs, *self.parts.pop())
        expected = self.filled if self.images is None else self.images
        if self.outputs is None or self.filled != expected:
            raise ValueError(f"the dense pass saw {self.filled} images, not {expected}")
        return self.outputs

    def _allocate(self, images: int, classes: int, device: torch.device) -> DenseOutputs:
        log_probs = None
        if self.keep_log_probs:
            log_probs = torch.empty((images, classes), dtype=torch.float32, device=device)
        return DenseOutputs(torch.empty(images, dtype=torch.long, device=device), log_probs)

    @staticmethod
    def _write(
        outputs: DenseOutputs, index: torch.Tensor, argmax: torch.Tensor, log_probs: torch.Tensor | None
    ) -> None:
        rows = index.to(outputs.argmax.device)
        outputs.argmax[rows] = argmax
        if outputs.log_probs is not None and log_probs is not None:
            outputs.log_probs[rows] = log_probs


@dataclass(frozen=True)
class PassMetrics:
    """What a pass over the data measures in one run.

    Attributes:
        metric: The run's metric; a label-free one makes every pass also compare with the dense outputs (``kl``
            records ``agreement`` too, from the argmax kept alongside).
        labelled: Whether the data has labels (top1, top5 and ce are measured only then).
    """

    metric: str
    labelled: bool

    @property
    def label_free(self) -> bool:
        """Whether the metric compares with the dense model's outputs (which the baseline pass must keep)."""
        return self.metric in LABEL_FREE_METRICS

    def recorder(self, images: int | None) -> DenseRecorder:
        """A recorder of the dense outputs this run's metric needs."""
        return DenseRecorder(images, log_probs=self.metric == "kl")

    def sums(self, dense: DenseOutputs | None) -> Scores:
        """Empty sums for one pass of one model (``dense``: the reference of the label-free metrics)."""
        return Scores(MetricSums() if self.labelled else None, dense if self.label_free else None)

    def baseline(self, dense: DenseOutputs | None, labelled: MetricSums | None, images: int) -> dict[str, float]:
        """The dense model's metrics: its labelled ones, and agreement 1 and kl 0 (itself, by definition)."""
        metrics = labelled.result().metrics() if labelled is not None else {}
        metrics.pop("images", None)
        if self.label_free:
            assert dense is not None  # the baseline pass of a label-free metric keeps the dense outputs
            metrics["agreement"] = 1.0
            if dense.log_probs is not None:
                metrics["kl"] = 0.0
        metrics["images"] = images
        return metrics

    def dense_per_image(self, images: int) -> torch.Tensor:
        """The dense model's own per-image value of the label-free metric: 1 (agreement) or 0 (kl), float64."""
        return torch.full((images,), 0.0 if self.metric == "kl" else 1.0, dtype=torch.float64)


@dataclass
class Scores:
    """Running sums of one pass over the data: the labelled metrics (when the data has labels) and the fidelity to
    the dense outputs (when the run's metric is label-free). Adding batches in any order gives the same totals."""

    labelled: MetricSums | None
    dense: DenseOutputs | None
    agreed: int = 0
    kl_sum: float = 0.0
    count: int = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> None:
        """Accumulate one batch: ``(N, classes)`` logits, ``(N,)`` labels and the images' sample indices."""
        if self.labelled is not None:
            self.labelled.add(logits, labels)
        if self.dense is not None:
            compared = fidelity(logits, self.dense, index)
            self.agreed += int(compared.agree.sum())
            if compared.kl is not None:
                self.kl_sum += float(compared.kl.double().sum())
        self.count += len(index)

    def metrics(self) -> dict[str, float]:
        """``top1``, ``top5``, ``ce`` (with labels), ``agreement``, ``kl`` (label-free metric) and ``images``."""
        if self.count == 0:
            raise ValueError("no samples were evaluated")
        metrics = self.labelled.result().metrics() if self.labelled is not None else {}
        metrics.pop("images", None)
        if self.dense is not None:
            metrics["agreement"] = self.agreed / self.count
            if self.dense.log_probs is not None:
                metrics["kl"] = self.kl_sum / self.count
        metrics["images"] = self.count
        return metrics


def per_image_fidelity(logits: torch.Tensor, dense: DenseOutputs, index: torch.Tensor, metric: str) -> torch.Tensor:
    """Each image's ``agreement`` (0/1) or ``kl``, float64 on the CPU (for adaptive precision's paired differences)."""
    compared = fidelity(logits, dense, index)
    values = compared.kl if metric == "kl" else compared.agree
    assert values is not None  # kl is computed whenever the metric is kl
    return values.double().cpu()


def indexed_batches(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> Iterator[IndexedBatch]:
    """``batches`` of ``(images, labels)`` in their own order on ``device``, with each image's sample index."""
    start = 0
    for images, labels in batches:
        count = len(images)
        yield (images.to(device, non_blocking=True), labels.to(device, non_blocking=True),
               torch.arange(start, start + count))  # fmt: skip
        start += count


def image_count(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
    """Images per pass when known without a pass over the data (a loader's ``num_samples``, a list's batches)."""
    counted = getattr(batches, "num_samples", None)
    if counted is not None:
        return int(counted)
    if isinstance(batches, Sequence):
        return sum(len(batch[0]) for batch in batches)
    return None


def fidelity_evaluator(
    scoring: PassMetrics, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[dict[str, float], Callable[[nn.Module], dict[str, float]]]:
    """The dense ``model``'s metrics on ``batches`` and an evaluator scoring other models against its outputs there
    (a plan from a label-free analysis is verified on the analysis's own metric, with or without labels)."""
    recorder = scoring.recorder(None)
    labelled = MetricSums() if scoring.labelled else None
    images = 0
    with torch.inference_mode():
        for batch, labels, index in indexed_batches(batches, device):
            logits = model(batch)
            recorder.add(logits, index)
            if labelled is not None:
                labelled.add(logits, labels)
            images += len(index)
    dense = recorder.result()

    def evaluate(other: nn.Module) -> dict[str, float]:
        sums = scoring.sums(dense)
        with torch.inference_mode():
            for batch, labels, index in indexed_batches(batches, device):
                sums.add(other(batch), labels, index)
        return sums.metrics()

    return scoring.baseline(dense, labelled, images), evaluate

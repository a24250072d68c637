"""Classification metrics over an evaluation loader: top1, top5 and mean cross-entropy, sample-weighted."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from analysis.errors import UserError
from analysis.progress import progress_bar


@dataclass(frozen=True)
class EvalResult:
    """Metrics of one pass over the data. Accuracies are fractions in [0, 1]; ``ce`` is the mean per image."""

    top1: float
    top5: float
    ce: float
    num_samples: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The values recorded per variant: ``top1``, ``top5``, ``ce`` and the number of ``images``."""
        return {"top1": self.top1, "top5": self.top5, "ce": self.ce, "images": self.num_samples}

    def summary(self) -> str:
        """One line for logs: ``top1=0.9756 top5=0.9978 ce=0.0834 (450 images, 1.2 s)``."""
        return (
            f"top1={self.top1:.4f} top5={self.top5:.4f} ce={self.ce:.4f} "
            f"({self.num_samples} images, {self.seconds:.1f} s)"
        )


@dataclass
class MetricSums:
    """Running sums from which :class:`EvalResult` is derived; adding batches in any split gives the same totals."""

    top1_correct: int = 0
    top5_correct: int = 0
    ce_sum: float = 0.0
    count: int = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Accumulate one batch of ``(N, classes)`` logits against ``(N,)`` integer labels."""
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels.unsqueeze(1))
        self.top1_correct += int(hits[:, 0].sum())
        self.top5_correct += int(hits.any(dim=1).sum())
        self.ce_sum += float(F.cross_entropy(logits.float(), labels, reduction="sum").double())
        self.count += int(labels.numel())

    def result(self, seconds: float = 0.0) -> EvalResult:
        """Turn the sums into sample-weighted averages."""
        if self.count == 0:
            raise ValueError("no samples were evaluated")
        return EvalResult(
            top1=self.top1_correct / self.count,
            top5=self.top5_correct / self.count,
            ce=self.ce_sum / self.count,
            num_samples=self.count,
            seconds=seconds,
        )


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str | None = None,
    progress: bool | None = None,
    desc: str = "eval",
) -> EvalResult:
    """Evaluate ``model`` on ``batches`` of ``(images, labels)`` under ``torch.inference_mode()``.

    Args:
        model: The classifier, already in eval mode on ``device``.
        batches: An iterable of image/label batches (e.g. :class:`analysis.inputs.data.EvalLoader`).
        device: Where to move each batch; ``None`` keeps batches where they are.
        progress: Show a tqdm bar in images/s; ``None`` shows it only on a terminal.
        desc: Label of the progress bar.

    Raises:
        UserError: If ``batches`` say they have no labels (an ``EvalLoader`` under ``Global.labels: none``).
    """
    if not getattr(batches, "labelled", True):
        raise UserError(
            "top1, top5 and ce need labels and the evaluation data has none (Global.labels: none); measure "
            "SensitivityAnalysis.metric: agreement or kl instead."
        )
    sums = MetricSums()
    total = getattr(batches, "num_samples", None)
    start = time.perf_counter()
    with torch.inference_mode(), progress_bar(progress, total=total, desc=desc, unit="img", leave=False) as bar:
        for images, labels in batches:
            if device is not None:
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            sums.add(model(images), labels)
            bar.update(int(labels.numel()))
    return sums.result(time.perf_counter() - start)

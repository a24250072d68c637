"""Metric maths on crafted logits: top1, top5 and cross-entropy, sample-weighted over batches."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from analysis.engine.evaluate import MetricSums, evaluate


def crafted() -> tuple[torch.Tensor, torch.Tensor]:
    """Six samples over seven classes with known ranks of the true class: 1, 1, 2, 5, 6, 7."""
    logits = torch.tensor(
        [
            [9.0, 1, 2, 3, 4, 5, 6],  # label 0, rank 1
            [0.0, 9, 1, 2, 3, 4, 5],  # label 1, rank 1
            [8.0, 1, 9, 2, 3, 4, 5],  # label 0, rank 2
            [5.0, 1, 6, 7, 8, 9, 2],  # label 0, rank 5 (after 9, 8, 7, 6)
            [1.0, 2, 3, 4, 5, 6, 7],  # label 1, rank 6
            [1.0, 2, 3, 4, 5, 6, 7],  # label 0, rank 7
        ]
    )
    labels = torch.tensor([0, 1, 0, 0, 1, 0])
    return logits, labels


def hand_ce(logits: torch.Tensor, labels: torch.Tensor) -> float:
    total = 0.0
    for row, label in zip(logits.tolist(), labels.tolist(), strict=True):
        total += math.log(sum(math.exp(v) for v in row)) - row[label]
    return total / len(labels)


def test_crafted_logits() -> None:
    logits, labels = crafted()
    sums = MetricSums()
    sums.add(logits, labels)
    result = sums.result()
    assert result.top1 == pytest.approx(2 / 6)
    assert result.top5 == pytest.approx(4 / 6)
    assert result.ce == pytest.approx(hand_ce(logits, labels), rel=1e-6)
    assert result.num_samples == 6


def test_batches_are_weighted_by_samples_not_averaged_per_batch() -> None:
    logits, labels = crafted()
    whole, split = MetricSums(), MetricSums()
    whole.add(logits, labels)
    split.add(logits[:1], labels[:1])  # a batch of 1 that is right, then 5 of which 1 is right
    split.add(logits[1:], labels[1:])
    assert split.result().top1 == pytest.approx(whole.result().top1)
    assert split.result().ce == pytest.approx(whole.result().ce, rel=1e-6)


def test_top5_with_fewer_than_five_classes_counts_every_sample() -> None:
    sums = MetricSums()
    sums.add(torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]]), torch.tensor([0, 2]))
    assert sums.result().top1 == 0.0 and sums.result().top5 == 1.0


def test_empty_sums_refuse() -> None:
    with pytest.raises(ValueError, match="no samples"):
        MetricSums().result()


class SlowIdentity(nn.Module):
    """The identity, taking at least ``delay`` seconds per batch."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return x


def test_evaluate_runs_a_model_over_batches() -> None:
    logits, labels = crafted()
    batches = [(logits[:4], labels[:4]), (logits[4:], labels[4:])]
    start = time.perf_counter()
    result = evaluate(SlowIdentity(0.02), batches, progress=False)
    wall = time.perf_counter() - start
    assert (result.top1, result.top5, result.num_samples) == (pytest.approx(2 / 6), pytest.approx(4 / 6), 6)
    assert result.seconds >= 0
    assert 2 * 0.02 <= result.seconds <= wall  # the two forward passes are timed, and nothing outside the call
    assert "top1=0.3333 top5=0.6667" in result.summary()

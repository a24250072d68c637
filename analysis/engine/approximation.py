"""How far a speed mode (``Global.numerics: tf32|bf16``) moves this model's own numbers, measured before analysing.

Two measurements, both against exact float32 on the same model:

* the **logit noise**: the largest difference of the dense model's logits on the check images, as a fraction of
  the largest exact logit. It sets the tolerance of the masked-versus-physical check (:func:`mask_tolerance`): in a
  speed mode the masked and the physically pruned model round differently, so the exact tolerance would move
  every unit to the slow physical path for reasons unrelated to the unit;
* the **loss shift**: the loss the mode alone gives the dense model on the evaluation data (exact baseline against
  the mode's baseline), which the sidecar, the terminal, the CSV headers and the report give as how far the
  arithmetic moves a loss on this model.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from analysis.engine.loss import format_metrics, relative_loss
from analysis.engine.settings import AnalysisData, Metrics
from analysis.inputs.numerics import numerics
from analysis.io.sidecar import NumericsRecord
from analysis.metrics import LABEL_FREE_METRICS

logger = logging.getLogger(__name__)

EXACT_TOLERANCE = 1e-4
"""Masking equals removal when the logits agree within this fraction of the largest logit (at least 1): float32
rounding of two different computations of the same function stays far below it."""
NOISE_MARGIN = 4.0
"""In a speed mode the check's tolerance is this many times the measured logit noise (when above the exact one)."""


def logit_noise(model: nn.Module, images: torch.Tensor, mode: str) -> float:
    """The largest difference between ``model``'s logits on ``images`` under ``mode`` and in exact float32, as a
    fraction of the largest exact logit (at least 1, as the check's tolerance scales)."""
    with torch.inference_mode():
        with numerics(mode, images.device):
            approximate = model(images).float()
        with numerics("exact", images.device):
            exact = model(images).float()
    return float((approximate - exact).abs().max()) / max(1.0, float(exact.abs().max()))


def mask_tolerance(noise: float | None) -> float:
    """The masked-versus-physical tolerance, as a fraction of the largest logit (at least 1): the exact one, or in a
    speed mode :data:`NOISE_MARGIN` times its measured ``noise`` when that is larger."""
    return EXACT_TOLERANCE if noise is None else max(EXACT_TOLERANCE, NOISE_MARGIN * noise)


def measure_approximation(
    model: nn.Module, data: AnalysisData, images: torch.Tensor, mode: str, metric: str, record: NumericsRecord
) -> None:
    """Fill in ``record`` (the file's, under the same mode, model and data) what it lacks: the logit noise of ``mode``
    on ``images`` (the check images) and, unless the metric is label-free, the dense model's exact metrics."""
    if record.logit_noise is None:
        record.logit_noise = logit_noise(model, images, mode)
    if record.exact_baseline is None and metric not in LABEL_FREE_METRICS:  # a label-free baseline is fixed
        with numerics("exact", data.example_input.device):
            record.exact_baseline = dict(data.evaluate(model))
        logger.info(
            "Baseline in exact float32 (to measure how far %s moves a loss): %s",
            mode,
            format_metrics(record.exact_baseline),
        )


def loss_shift(exact: Metrics, approximate: Metrics, metric: str, metric_mode: str) -> float:
    """The loss the speed mode alone gives the dense model: ``approximate`` (its baseline under the mode) against
    ``exact`` (in float32), as every loss of the file is computed."""
    return relative_loss(exact[metric], approximate[metric], metric, metric_mode)

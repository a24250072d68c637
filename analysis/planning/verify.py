"""Joint verification of a plan: prune every planned group at once (physically), then measure what users pay for.

Single-layer losses do not add up exactly, so the predicted loss of a plan is only a guide. Here the plan is
applied to a copy of the model with Torch-Pruning, the copy is evaluated on the same data twice: raw (the dense
model's BatchNorm statistics, which no longer fit the layers downstream of the removed channels) and after
re-estimating those statistics on calibration images (:mod:`analysis.engine.batchnorm`), which is the model to fine-tune
or deploy. Its MACs, params, checkpoint size and latency (batch 1 and 32, median of repeated runs, on the device
used) are measured next to the dense model's.

Re-estimated figures are only as good as the calibration images: :func:`check_calibration` re-estimates the same
layers of the *dense* model on them once, and when that alone moves the dense model's metric by more than
:data:`CALIBRATION_TOLERANCE`, every re-estimated figure is marked unreliable.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from analysis.engine.batchnorm import batchnorms_named, recalibrate_copy, reestimate
from analysis.engine.loss import relative_loss
from analysis.inputs.calibration import CalibrationSet
from analysis.inputs.numerics import numerics
from analysis.io.sidecar import (
    CalibrationCheckRecord,
    DensePrunedRecord,
    ReestimatedRecord,
    RuntimeLatencyRecord,
    VerificationRecord,
)
from analysis.metrics import LABEL_FREE_METRICS
from analysis.planning.export import saved_bytes
from analysis.planning.plan import Plan, known_loss
from analysis.runtimes.compare import TOLERANCE, Bracketed, bracket
from analysis.runtimes.runtime import TorchRuntime
from analysis.structure.flops import count_cost
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)

MEASURED = ("top1", "top5", "ce", *LABEL_FREE_METRICS)
"""Metrics a verification compares with the dense model (the label-free ones after a label-free analysis)."""

LATENCY_BATCHES = (1, 32)

CALIBRATION_TOLERANCE = 0.02
"""Largest relative change of the dense model's top1 (agreement after a label-free analysis) that re-estimating its
BatchNorm statistics on the calibration images may cause before re-estimated figures are called unreliable. Images
that represent the data leave the dense model nearly unchanged: on the demo (450 evaluation images, the layers a
40%-MACs plan re-estimates) its own 1,024 training images moved top1 by +0.000 (ResNet) and -0.002 (MobileNetV2, a
gain); 16 copies of one training image moved it by +0.098 and +0.899, and the photo crops reported in issue 27 by
+0.784. At a baseline of 1, 0.02 is 2 images in 100 turned wrong. A change in either direction is flagged: either
mixes the calibration's own effect into the pruning's."""


@dataclass
class Recalibrated:
    """The pruned model after BatchNorm re-estimation: its metrics, and which layers were re-estimated on what."""

    metrics: dict[str, float]
    layers: list[str]
    images: int
    calibration: dict[str, Any]


@dataclass
class CalibrationCheck:
    """The dense model with the pruned model's re-estimated BatchNorm layers re-estimated on the same calibration
    images: how far that alone moves its metric from the baseline."""

    metric: str
    baseline: float
    reestimated: dict[str, float]
    loss: float
    layers: int
    images: int

    @property
    def reliable(self) -> bool:
        """Whether the re-estimation left the dense model within :data:`CALIBRATION_TOLERANCE` of its baseline."""
        return abs(self.loss) <= CALIBRATION_TOLERANCE

    def describe(self) -> str:
        """One sentence with the numbers: what the re-estimation did to the dense model."""
        verdict = "within" if self.reliable else "more than"
        return (
            f"re-estimating the same {self.layers} BatchNorm layers of the dense model on the {self.images} "
            f"calibration images changes its {self.metric} from {self.baseline:.4f} to "
            f"{self.reestimated[self.metric]:.4f} (relative loss {self.loss:+.4f}, {verdict} the tolerance "
            f"{CALIBRATION_TOLERANCE:g})"
        )

    def warning(self) -> str | None:
        """What to tell the user when the check fails (None when it passes)."""
        if self.reliable:
            return None
        return (
            f"Calibration check failed: {self.describe()}. The statistics these images give do not fit the model even "
            "unpruned, so every BatchNorm re-estimated figure is unreliable (it mixes this change with the "
            "pruning's), and so are exported statistics re-estimated on them; name calibration images drawn like the "
            "evaluation data in Global.calib_list."
        )

    def record(self) -> CalibrationCheckRecord:
        """The sidecar's record (``plan.verification.calibration_check``)."""
        return CalibrationCheckRecord(
            metric=self.metric,
            dense_reestimated=self.reestimated,
            loss=self.loss,
            tolerance=CALIBRATION_TOLERANCE,
            reliable=self.reliable,
        )


def check_calibration(
    model: nn.Module,
    layers: Sequence[str],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    baseline: Mapping[str, float],
    calibration: CalibrationSet,
    progress: bool | None = False,
) -> CalibrationCheck | None:
    """Re-estimate the BatchNorm ``layers`` (module names) of a copy of the dense ``model`` on ``calibration`` and
    evaluate it: one re-estimation and one evaluation, ``model`` unchanged.

    Returns:
        The check, or None when there is nothing to check (no layer, or a baseline of 0 for the checked metric).
    """
    metric = "agreement" if "agreement" in baseline else "top1"
    if not layers or not baseline.get(metric):
        return None
    dense = copy.deepcopy(model).eval()
    images = reestimate(dense, batchnorms_named(dense, layers), calibration.loader, progress=progress)
    metrics = _numbers(evaluate(dense))
    loss = relative_loss(float(baseline[metric]), metrics[metric], metric)
    check = CalibrationCheck(metric, float(baseline[metric]), metrics, loss, len(layers), images)
    warning = check.warning()
    if warning is not None:
        logger.warning("%s", warning)
    return check


@dataclass(frozen=True)
class RuntimeLatency:
    """The pruned model timed between timings of the dense model on a deployment runtime (``analysis.runtimes``),
    next to what the latency plan predicted there (None: the plan was not made for this runtime and batch).

    Attributes:
        runtime: The runtime's name.
        device: Where it ran.
        batch: Images per call.
        measured: The timings (:class:`~analysis.runtimes.compare.Bracketed`).
        predicted_reduction: The latency plan's predicted reduction.
        tolerance: Largest drift of the dense timings for the measurement to count (``latency_tolerance``).
        settings: The runtime's settings.
    """

    runtime: str
    device: str
    batch: int
    measured: Bracketed
    predicted_reduction: float | None = None
    tolerance: float = TOLERANCE
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def dense_ms(self) -> float:
        """The dense model's median latency."""
        return self.measured.dense_median

    @property
    def pruned_ms(self) -> float:
        """The pruned model's median latency."""
        return self.measured.candidate_median

    @property
    def predicted_ms(self) -> float | None:
        """The predicted latency on the dense model measured now."""
        return None if self.predicted_reduction is None else self.dense_ms * (1.0 - self.predicted_reduction)

    @property
    def speedup(self) -> float:
        """How many times faster the pruned model ran."""
        return self.dense_ms / self.pruned_ms

    @property
    def steady(self) -> bool:
        """Whether the dense timings around the pruned model agreed within the tolerance."""
        return self.measured.steady(self.tolerance)

    def record(self) -> RuntimeLatencyRecord:
        """The sidecar's record (``plan.verification.runtime_latency``)."""
        low, high = self.measured.interval
        return RuntimeLatencyRecord(runtime=self.runtime, device=self.device, batch=self.batch, dense_ms=self.dense_ms,
                                    pruned_ms=self.pruned_ms, predicted_ms=self.predicted_ms,
                                    reduction=self.measured.reduction, interval=[low, high], drift=self.measured.drift,
                                    steady=self.steady, settings=dict(self.settings))  # fmt: skip


@dataclass
class Verification:
    """What the jointly pruned model measures, raw and with re-estimated BatchNorm statistics (when calibration
    images exist), next to the dense model and the plan's prediction."""

    baseline: dict[str, float]
    pruned: dict[str, float]
    predicted_loss: float
    dense_cost: dict[str, int]
    pruned_cost: dict[str, int]
    checkpoint_bytes: dict[str, int]
    latency_ms: dict[str, dict[str, float]]
    device: str
    recalibrated: Recalibrated | None = None
    calibration_check: CalibrationCheck | None = None
    runtime_latency: RuntimeLatency | None = None

    def losses(self, reestimated: bool = False) -> dict[str, float]:
        """Measured relative loss of top1 and top5 (and ce, where lower is better; agreement and kl for a label-free
        analysis) against the baseline: of the raw pruned model, or with ``reestimated`` of the model with
        re-estimated BatchNorm statistics."""
        if reestimated and self.recalibrated is None:
            return {}
        pruned = self.recalibrated.metrics if reestimated and self.recalibrated is not None else self.pruned
        return {
            metric: relative_loss(self.baseline[metric], pruned[metric], metric)
            for metric in MEASURED
            if metric in self.baseline and metric in pruned and (self.baseline[metric] or metric in LABEL_FREE_METRICS)
        }

    @property
    def final(self) -> dict[str, float]:
        """The metrics of the model the export holds: re-estimated when calibration images exist, else raw."""
        return self.recalibrated.metrics if self.recalibrated is not None else self.pruned

    def record(self) -> VerificationRecord:
        """The sidecar's record of this verification (``plan.verification``)."""
        recalibrated = self.recalibrated
        reestimated = None
        if recalibrated is not None:
            reestimated = ReestimatedRecord(
                metrics=recalibrated.metrics,
                measured_loss=self.losses(reestimated=True),
                batchnorm_layers=recalibrated.layers,
                calibration_images=recalibrated.images,
                calibration=recalibrated.calibration,
                reliable=None if self.calibration_check is None else self.calibration_check.reliable,
            )
        return VerificationRecord(
            baseline=self.baseline,
            pruned=self.pruned,
            predicted_loss=known_loss(self.predicted_loss),
            measured_loss=self.losses(),
            reestimated=reestimated,
            macs=DensePrunedRecord(dense=self.dense_cost["macs"], pruned=self.pruned_cost["macs"]),
            params=DensePrunedRecord(dense=self.dense_cost["params"], pruned=self.pruned_cost["params"]),
            checkpoint_bytes=_pair(self.checkpoint_bytes),
            latency_ms={batch: _pair(times) for batch, times in self.latency_ms.items()},
            device=self.device,
            calibration_check=None if self.calibration_check is None else self.calibration_check.record(),
            runtime_latency=None if self.runtime_latency is None else self.runtime_latency.record(),
        )


def _pair(values: Mapping[str, float]) -> DensePrunedRecord:
    return DensePrunedRecord(dense=values["dense"], pruned=values["pruned"])


def verify_plan(
    model: nn.Module,
    plan: Plan,
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    example_input: torch.Tensor,
    baseline: Mapping[str, float],
    latency_batches: tuple[int, ...] = LATENCY_BATCHES,
    calibration: CalibrationSet | None = None,
    progress: bool | None = False,
) -> tuple[nn.Module, Verification]:
    """Prune ``plan`` into a copy of ``model``, evaluate it raw and (with ``calibration``) after re-estimating the
    BatchNorm statistics the pruning changed, check the calibration images on the dense model
    (:func:`check_calibration`), and measure cost, size and latency.

    Args:
        model: The dense model (unchanged).
        plan: The plan to apply.
        evaluate: Metrics of a model on the analysis data (the same evaluation that produced ``baseline``).
        example_input: A batch for tracing and costs; its sample shape is used for the latency inputs.
        baseline: The dense model's metrics on that data.
        latency_batches: Batch sizes to time.
        calibration: Calibration images; without them only the raw pruned model is measured.
        progress: Progress of the BatchNorm re-estimations (:mod:`analysis.progress`; ``evaluate`` shows its own).

    Returns:
        The pruned copy (eval mode, on the model's device; with re-estimated statistics when calibrated) and the
        measurements.
    """
    pruned, metrics, recalibrated = measure_pruned(
        model, plan.removals(), evaluate, example_input, calibration, progress
    )
    check = None
    if recalibrated is not None and calibration is not None:
        check = check_calibration(model, recalibrated.layers, evaluate, baseline, calibration, progress)
    dense_cost, pruned_cost = count_cost(model, example_input), count_cost(pruned, example_input)
    if pruned_cost.macs != plan.pruned.macs or pruned_cost.params != plan.pruned.params:
        logger.warning(
            "The physically pruned model costs %d MACs / %d params, the plan computed %d / %d; trust the measurement.",
            pruned_cost.macs, pruned_cost.params, plan.pruned.macs, plan.pruned.params,
        )  # fmt: skip
    device = example_input.device
    with numerics("exact", device):  # the float32 model is what gets deployed, whatever the analysis's arithmetic
        latency = {f"batch_{size}": eager_latency(model, pruned, example_input, size) for size in latency_batches}
    verification = Verification(
        baseline={
            k: float(v) for k, v in baseline.items() if k in ("top1", "top5", "ce", *LABEL_FREE_METRICS, "images")
        },
        pruned=metrics,
        predicted_loss=plan.predicted_loss,
        dense_cost={"macs": dense_cost.macs, "params": dense_cost.params},
        pruned_cost={"macs": pruned_cost.macs, "params": pruned_cost.params},
        checkpoint_bytes={"dense": checkpoint_bytes(model), "pruned": checkpoint_bytes(pruned)},
        latency_ms=latency,
        device=str(device),
        recalibrated=recalibrated,
        calibration_check=check,
    )
    return pruned, verification


def measure_pruned(
    model: nn.Module,
    removals: Sequence[tuple[str, Sequence[int]]],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    example_input: torch.Tensor,
    calibration: CalibrationSet | None,
    progress: bool | None = False,
) -> tuple[nn.Module, dict[str, float], Recalibrated | None]:
    """Physically prune every ``(conv name, channels)`` removal into a copy of ``model`` and evaluate it raw and,
    with ``calibration``, after re-estimating the BatchNorm statistics the removals change.

    Returns:
        The pruned copy (re-estimated when calibrated), its raw metrics, and the re-estimated measurement.
    """
    pruned = jointly_pruned_copy(model, removals, example_input)
    metrics = _numbers(evaluate(pruned))
    if calibration is None:
        return pruned, metrics, None
    stats = recalibrate_copy(model, pruned, removals, example_input, calibration.loader, progress)
    return pruned, metrics, Recalibrated(_numbers(evaluate(pruned)), stats.layers, stats.images, calibration.as_dict())


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def checkpoint_bytes(model: nn.Module) -> int:
    """Size of ``torch.save(model.state_dict())``: what a checkpoint of the weights takes on disk."""
    return len(saved_bytes(model.state_dict()))


def eager_latency(
    model: nn.Module, pruned: nn.Module, example_input: torch.Tensor, batch_size: int
) -> dict[str, float]:
    """``{"dense": ms, "pruned": ms}``: one forward pass of each on the example's device at ``batch_size``, the pruned
    model timed between two timings of the dense model (:func:`~analysis.runtimes.compare.bracket`, the latency
    plan's timing path; the dense figure is their median)."""
    runtime = TorchRuntime(example_input.device)
    shape = tuple(example_input.shape[1:])
    with runtime.prepare(model, shape) as dense, runtime.prepare(pruned, shape) as candidate:
        measured = bracket(dense, candidate, batch_size, rounds=1)
    return {"dense": round(measured.dense_median, 4), "pruned": round(measured.candidate_median, 4)}

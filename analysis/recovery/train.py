"""The recovery loop: distil the dense model into the pruned one as ACT's ``TrainConfig`` says, evaluating, keeping
the best weights and writing a checkpoint every ``eval_iter`` steps, resumable from any checkpoint.

Plain PyTorch: the step is a forward of both models, the distillation loss, backward, the gradient clip (and an L1
term) ACT configures, an optimizer step and a schedule step (every iteration, as ACT steps Paddle's). Under torchrun
the pruned model is wrapped in ``DistributedDataParallel`` and every process takes its share of each global batch;
every process evaluates (the same images, so the same decisions) and the first writes the files.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from analysis.errors import DataError, UserError
from analysis.inputs.data import Preprocess, normalize_batch
from analysis.inputs.device import is_out_of_memory
from analysis.progress import progress_bar
from analysis.recovery.act import EARLY_STOP_SHARE, ORIGIN_METRIC_TOLERANCE, DistillSettings, TrainSettings
from analysis.recovery.checkpoint import (
    LAST_FILE,
    CheckpointError,
    Evaluation,
    TrainingState,
    read_best,
    read_checkpoint,
    restore,
    save_best,
    save_checkpoint,
)
from analysis.recovery.data import TrainBatches
from analysis.recovery.distill import OUTPUT, captured, check_nodes, distillation_loss
from analysis.recovery.optim import build_optimizer, build_schedule

logger = logging.getLogger(__name__)

LOG_FILE = "train.log"
METRIC = "top1"
"""The evaluation metric the best checkpoint is chosen by (higher is better), as ACT's eval callback."""

Evaluate = Callable[[nn.Module], dict[str, float]]
Outputs = dict[str, torch.Tensor]


class TrainingError(UserError):
    """Training cannot go on (the loss is not finite); the sentence says what to change."""


@dataclass(frozen=True)
class RecoveryJob:
    """What one recovery run needs besides the models and the data.

    Attributes:
        train: ``TrainConfig``.
        distill: ``Distillation``.
        precision: ``fp32`` or ``bf16`` (autocast; resolved from ``Recovery.precision``).
        label_loss_weight: Weight of the cross-entropy on the labels (ACT: 0).
        folder: Where ``last.pt``, ``best.pt`` and ``train.log`` go.
        identity: Fingerprint of the plan, recipe and data; a checkpoint with another one is not continued.
        preprocess: The model's normalisation (applied to the uint8 batches on the device).
        resume: Continue from ``folder``'s checkpoint when there is one.
        progress: Progress bar (None: on a terminal; log lines otherwise).
    """

    train: TrainSettings
    distill: DistillSettings
    precision: str
    label_loss_weight: float
    folder: Path
    identity: str
    preprocess: Preprocess
    resume: bool = True
    progress: bool | None = None


@dataclass
class RecoveryOutcome:
    """What recovery did: the best weights loaded into the model, every evaluation, why it stopped, its speed.

    Attributes:
        best: The evaluation whose weights the model now holds.
        history: Every evaluation, in step order.
        steps: Steps trained in all (across resumes).
        total_steps: Steps the recipe asks for.
        stopped: Why training ended (``finished``, ``target_metric``, ``within 0.5% of origin``).
        resumed_from: The step a checkpoint was continued from (None: started afresh).
        seconds: Wall-clock seconds of this run's training steps (evaluations excluded).
        images_per_second: Training images per second over this run's steps (all processes).
        train_images: Images in the training set.
    """

    best: Evaluation
    history: list[Evaluation]
    steps: int
    total_steps: int
    stopped: str
    resumed_from: int | None
    seconds: float
    images_per_second: float
    train_images: int = 0

    def as_dict(self) -> dict[str, Any]:
        """As the sidecar records it."""
        return {
            "best": self.best.as_dict(),
            "history": [evaluation.as_dict() for evaluation in self.history],
            "steps": self.steps,
            "total_steps": self.total_steps,
            "stopped": self.stopped,
            "resumed_from": self.resumed_from,
            "seconds": round(self.seconds, 3),
            "images_per_second": round(self.images_per_second, 1),
        }


def check_origin_metric(train: TrainSettings, dense: dict[str, float]) -> None:
    """ACT's data check: the dense model's metric must be within 0.05 of ``TrainConfig.origin_metric``.

    Raises:
        DataError: Naming both numbers, when they differ by more.
    """
    if train.origin_metric is None:
        return
    measured = dense[METRIC]
    if abs(measured - train.origin_metric) > ORIGIN_METRIC_TOLERANCE:
        raise DataError(f"The dense model's {METRIC} is {measured:.4f} on the evaluation data but "
                        f"TrainConfig.origin_metric says {train.origin_metric:.4f}; check Global.data_dir and the "
                        "preprocessing (img_size, resize_size, mean, std), or correct origin_metric.")  # fmt: skip


def recover(
    student: nn.Module,
    teacher: nn.Module,
    batches: TrainBatches,
    evaluate: Evaluate,
    job: RecoveryJob,
    dense: dict[str, float],
) -> RecoveryOutcome:
    """Train ``student`` (the pruned model) from ``teacher`` (the dense model) and leave the best weights in it.

    Args:
        student: The pruned model, on the device it trains on.
        teacher: The dense model, on the same device; frozen, in eval mode.
        batches: The training batches (this process's share).
        evaluate: Metrics of a model in eval mode on the evaluation images (``top1`` at least).
        job: The recipe and where the files go.
        dense: The dense model's metrics (``origin_metric``'s check and early stop).

    Raises:
        CheckpointError: For a checkpoint of another run.
        TrainingError: When the loss stops being finite.
    """
    check_nodes(student, job.distill)
    device = next(student.parameters()).device
    total = job.train.total_steps(batches.steps_per_epoch)
    optimizer = build_optimizer(student.parameters(), job.train.optimizer, job.train.schedule.initial_lr)
    schedule = build_schedule(optimizer, job.train.schedule, total)
    state, resumed_from = _start(student, optimizer, schedule, job)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    with _log_file(job.folder / LOG_FILE if leader else None):
        if resumed_from is not None:
            logger.info("Recovery resumes at step %d of %d from %s.", resumed_from, total, job.folder / LAST_FILE)
        loop = _Loop(student, teacher, optimizer, schedule, job, device, leader)
        stopped, seconds, images = loop.run(batches, state, total, evaluate, dense)
    if state.best is None:
        raise AssertionError("recovery ended without an evaluation")
    if state.history[-1].step != state.best.step:
        weights = read_best(job.folder) if leader or not dist.is_initialized() else None
        if dist.is_initialized():
            shared = [weights]
            dist.broadcast_object_list(shared, src=0)
            weights = shared[0]
        assert weights is not None
        student.load_state_dict(weights)
    return RecoveryOutcome(state.best, state.history, state.step, total, stopped, resumed_from, seconds,
                           images / seconds if seconds > 0 else 0.0, len(batches.images))  # fmt: skip


def _start(
    student: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    job: RecoveryJob,
) -> tuple[TrainingState, int | None]:
    """The state to start from: a checkpoint's (read by the first process and sent to the others), or a fresh one."""
    payload = None
    if job.resume and not dist.is_initialized():
        payload = read_checkpoint(job.folder, job.identity)
    elif job.resume:  # the first process reads; a checkpoint it refuses stops every process with its sentence
        refusal = None
        if dist.get_rank() == 0:
            try:
                payload = read_checkpoint(job.folder, job.identity)
            except CheckpointError as error:
                refusal = str(error)
        shared = [(payload, refusal)]
        dist.broadcast_object_list(shared, src=0)
        payload, refusal = shared[0]
        if refusal is not None:
            raise CheckpointError(refusal)
    if payload is None:
        return TrainingState(), None
    state = restore(payload, student, optimizer, schedule)
    return state, state.step


class _Loop:
    """The steps of one run, with what they share (models, optimizer, schedule, device, the files' writer)."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        job: RecoveryJob,
        device: torch.device,
        leader: bool,
    ) -> None:
        self.student = student
        self.trained: nn.Module = student
        if dist.is_initialized() and dist.get_world_size() > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.trained = nn.parallel.DistributedDataParallel(student, device_ids=ids)
        self.teacher = teacher
        self.optimizer = optimizer
        self.schedule = schedule
        self.job = job
        self.device = device
        self.leader = leader

    def run(
        self, batches: TrainBatches, state: TrainingState, total: int, evaluate: Evaluate, dense: dict[str, float]
    ) -> tuple[str, float, int]:
        """Train from ``state.step`` to ``total``; (why it stopped, seconds of training, images trained on)."""
        job, train = self.job, self.job.train
        names = job.distill.modules
        seconds, images, stopped = 0.0, 0, "finished"
        self.teacher.eval()
        self.student.train()
        bar = progress_bar(job.progress, total=total, initial=state.step, desc="recover", unit="step")
        world = dist.get_world_size() if dist.is_initialized() else 1
        with bar, captured(self.teacher, names) as taught, captured(self.student, names) as learnt:
            if state.step >= total:
                return "finished", 0.0, 0
            started = time.perf_counter()
            for step, uint8, labels in batches.from_step(state.step):
                try:
                    loss = self._step(uint8, labels, taught, learnt)
                except (RuntimeError, MemoryError) as error:
                    if not is_out_of_memory(error):
                        raise
                    raise TrainingError(
                        f"A training batch of {uint8.shape[0]} images does not fit in the memory of {self.device} "
                        f"(Recovery.batch_size {batches.batch_size} over {world} process(es)); lower "
                        "Recovery.batch_size or train on more processes. The last checkpoint is kept."
                    ) from None
                state.step = step + 1
                images += uint8.shape[0] * world
                bar.update(1)
                if step % batches.steps_per_epoch % train.logging_iter == 0:  # ACT counts batches of the epoch
                    logger.info("step %d/%d (epoch %d): loss %.5g, learning rate %.4g", state.step, total,
                                step // batches.steps_per_epoch + 1, self._finite(loss, state.step),
                                self.schedule.get_last_lr()[0])  # fmt: skip
                if state.step % train.eval_iter and state.step < total:
                    continue
                self._finite(loss, state.step)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds += time.perf_counter() - started
                stopped = self._evaluate(state, evaluate, dense, total)
                started = time.perf_counter()
                if stopped != "" or state.step >= total:
                    break
        return stopped or "finished", seconds, images

    def _step(self, uint8: torch.Tensor, labels: torch.Tensor, taught: Outputs, learnt: Outputs) -> torch.Tensor:
        """One optimizer step on one batch; the loss, left on the device (reading it would wait for the GPU at every
        step)."""
        images = normalize_batch(uint8.to(self.device, non_blocking=True), self.job.preprocess)
        with self._autocast():
            with torch.no_grad():
                taught[OUTPUT] = self.teacher(images)
            learnt[OUTPUT] = self.trained(images)
            loss = distillation_loss(self.job.distill, taught, learnt)
            if self.job.label_loss_weight > 0:
                targets = labels.to(self.device, non_blocking=True)
                loss = loss + self.job.label_loss_weight * F.cross_entropy(learnt[OUTPUT].float(), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
        self.job.train.optimizer.gradients.apply(self.student.parameters())  # grad_clip, an L1 regularizer
        self.optimizer.step()
        self.schedule.step()
        return loss.detach()

    @staticmethod
    def _finite(loss: torch.Tensor, step: int) -> float:
        """The loss as a number, read where it is logged or evaluated.

        Raises:
            TrainingError: When it is not finite (training cannot recover from that).
        """
        value = float(loss)
        if not math.isfinite(value):
            raise TrainingError(f"The recovery loss became {value} by step {step}; lower TrainConfig.learning_rate "
                                "(or the Distillation.alpha weights).")  # fmt: skip
        return value

    def _autocast(self) -> Any:
        if self.job.precision != "bf16":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _evaluate(self, state: TrainingState, evaluate: Evaluate, dense: dict[str, float], total: int) -> str:
        """Evaluate, keep the best weights, write the checkpoint; why training stops now ("" to go on)."""
        self.student.eval()
        metrics = evaluate(self.student)
        self.student.train()
        evaluation = Evaluation(state.step, {key: float(value) for key, value in metrics.items()})
        state.history.append(evaluation)
        improved = state.best is None or evaluation.metrics[METRIC] > state.best.metrics[METRIC]
        if improved:
            state.best = evaluation
        if self.leader:
            if improved:
                save_best(self.job.folder, self.student)
            save_checkpoint(self.job.folder, self.job.identity, self.student, self.optimizer, self.schedule, state)
        if dist.is_initialized():
            dist.barrier()
        best = state.best
        assert best is not None
        shown = (evaluation.metrics[METRIC], best.metrics[METRIC], best.step, self.job.folder / LAST_FILE)
        logger.info("step %d/%d: %s %.4f (best %.4f at step %d); checkpoint %s", state.step, total, METRIC, *shown)
        target = self.job.train.target_metric
        if target is not None and evaluation.metrics[METRIC] > target:
            return "target_metric"
        if self.job.train.origin_metric is not None:
            before = dense[METRIC]
            if before > 0 and abs(best.metrics[METRIC] - before) / before <= EARLY_STOP_SHARE:
                return "within 0.5% of the dense model"
        return ""


@contextmanager
def _log_file(path: Path | None) -> Iterator[None]:
    """Copy the package's log lines into ``path`` (appended: a resumed run continues the same log)."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    package = logging.getLogger("analysis")
    level, effective = package.level, package.getEffectiveLevel()
    others = {other: other.level for other in package.handlers}
    for other in others:  # the terminal keeps what it showed (--quiet: warnings) while the file gets the progress
        other.setLevel(max(other.level, effective))
    package.setLevel(min(effective, logging.INFO))
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        handler.close()
        package.setLevel(level)
        for other, other_level in others.items():
            other.setLevel(other_level)

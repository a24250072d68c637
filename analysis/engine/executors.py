"""Executors: how the forward pass of a variant runs, whatever images it gets (that is the sampler's choice).

Three executors compute the same logits in different ways:

* :class:`EagerExecutor` runs the whole model with the variant's slices zeroed in place (masking, or element-wise
  pruning, where that equals removing the weights).
* :class:`PhysicalExecutor` runs a physically pruned copy of the model (where masking is not exact for the group).
* :class:`SuffixExecutor` runs the model as a torch.fx graph: per batch, the unpruned prefix once for every variant
  of a chunk, then each variant's suffix only (see :mod:`analysis.engine.partition`).

Each takes a *chunk* of :class:`Job` s (a unit with its pending :class:`Variant` s) and, per batch of images, calls
``visit(variant, logits)`` for every variant the sampler still wants; with adaptive BN, :meth:`calibrate` first
re-estimates each variant's affected BatchNorm statistics on the calibration batches.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch
from torch import nn

from analysis.engine._adaptive import PairedEstimate
from analysis.engine._decision import Candidate
from analysis.engine._variants import Prepared
from analysis.engine.batchnorm import CalibrationBatch, Estimation, batch_images, layers_in_copy, reestimate
from analysis.engine.fidelity import Scores
from analysis.engine.partition import GraphRunner, NodeValues, Schedule, SuffixPlan
from analysis.progress import progress_bar
from analysis.structure.masking import Slice, zeroed
from analysis.structure.physical import pruned_copy

logger = logging.getLogger(__name__)

CHUNK_SECONDS = 300.0
"""Estimated work of one pass of the suffix executor over the data; results are saved after each pass."""


class Executor(Enum):
    """What computed a variant's metrics in a run (kept in the engine's report), so that a caller (and a test
    comparing the engines) knows which path really evaluated it rather than which engine was asked for."""

    FX_SUFFIX = "fx suffix"
    """The variant's graph suffix, run from the unpruned prefix shared by every variant of a chunk."""
    EAGER = "eager"
    """One full forward pass of the model with the variant's slices zeroed."""
    PHYSICAL = "physical"
    """One full forward pass of a physically pruned copy (masking is not exact for the group)."""
    BASELINE = "baseline"
    """Nothing evaluated: the variant removes nothing, its metrics are the baseline's."""


@dataclass(eq=False)
class Variant:
    """One (unit, ratio) in flight: the slices it zeroes (none for a physical copy), the metric sums gathered over
    batches and, when sampled, the running paired estimate of its loss (and its decision); with adaptive BN, its
    re-estimated BatchNorm statistics; on the physical executor, its pruned copy while the chunk runs."""

    ratio: float
    slices: list[Slice]
    sums: Scores
    estimate: PairedEstimate | None = None
    done: bool = False
    batchnorm: Estimation | None = None
    candidate: Candidate | None = None
    copy: nn.Module | None = None

    def statistics(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the affected BatchNorm layers hold this variant's re-estimated statistics (adaptive BN)."""
        return self.batchnorm.applied() if self.batchnorm is not None else contextlib.nullcontext()


@dataclass(eq=False)
class Job:
    """A prepared unit with its pending variants (increasing ratio) and, on the suffix executor, its suffix plan;
    ``stopped`` is set once a recorded variant stopped the unit (early stop, or decided above the target)."""

    prepared: Prepared
    variants: list[Variant]
    plan: SuffixPlan | None = None
    stopped: bool = False

    def only(self, variant: Variant) -> Job:
        """This job restricted to one of its variants (one stage of an early-stop run)."""
        return Job(self.prepared, [variant], self.plan)


Visit = Callable[[Variant, torch.Tensor], None]
"""Receives a variant's logits on the current batch."""

Wanted = Callable[[Variant], bool]
"""Whether a variant runs on the current batch (the sampler's choice)."""


class VariantExecutor(ABC):
    """How variants' forward passes run. Subclasses say what they are (:attr:`kind`) and implement :meth:`forward`
    and :meth:`calibrate`; :meth:`chunks` groups jobs into passes over the data, :meth:`applied` gives one variant's
    model for a whole-model evaluation (an eval function instead of batches) and :meth:`release` frees what a chunk
    held."""

    kind: ClassVar[Executor]

    def chunks(self, jobs: Sequence[Job], baseline_seconds: float) -> list[list[Job]]:
        """The jobs grouped into passes over the data (results are saved after each): one unit a pass, since a full
        forward pass per variant shares nothing between units but the data loading."""
        del baseline_seconds  # a unit's pass costs what its variants cost, whatever the grouping
        return [[job] for job in jobs]

    @abstractmethod
    def forward(self, chunk: Sequence[Job], images: torch.Tensor, wanted: Wanted, visit: Visit) -> None:
        """Call ``visit(variant, logits)`` for every variant of ``chunk`` that is ``wanted`` on ``images`` (the caller
        holds inference mode)."""

    @abstractmethod
    def calibrate(self, chunk: Sequence[Job], batches: Iterable[CalibrationBatch], progress: bool | None) -> None:
        """Adaptive BN: re-estimate the affected BatchNorm statistics of every variant of ``chunk`` on ``batches``."""

    @contextmanager
    def applied(self, job: Job, variant: Variant) -> Iterator[nn.Module]:
        """The model that computes ``variant`` (for evaluation by an eval function), valid within the block."""
        raise NotImplementedError(f"the {self.kind.value} executor evaluates batches only")
        yield  # pragma: no cover

    def release(self, chunk: Sequence[Job]) -> None:
        """Free what the variants of ``chunk`` held while it ran (nothing, unless said otherwise)."""
        del chunk  # nothing held


class EagerExecutor(VariantExecutor):
    """The whole model, with each variant's slices zeroed in place for its forward pass and restored after it.

    Args:
        model: The model, in eval mode on ``device``.
        device: Where calibration images go.
    """

    kind = Executor.EAGER

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def forward(self, chunk: Sequence[Job], images: torch.Tensor, wanted: Wanted, visit: Visit) -> None:
        for job in chunk:
            for variant in job.variants:
                if wanted(variant):
                    with zeroed(variant.slices), variant.statistics():
                        visit(variant, self.model(images))

    def calibrate(self, chunk: Sequence[Job], batches: Iterable[CalibrationBatch], progress: bool | None) -> None:
        with progress_bar(progress, total=getattr(batches, "num_samples", None), desc="calibrate", unit="img",
                          leave=False) as bar, torch.no_grad():  # fmt: skip
            for batch in batches:
                images = batch_images(batch).to(self.device, non_blocking=True)
                for job in chunk:
                    for variant in job.variants:
                        assert variant.batchnorm is not None  # made for every variant with adaptive BN
                        with zeroed(variant.slices), variant.batchnorm.step(len(images)):
                            self.model(images)
                bar.update(len(images))

    @contextmanager
    def applied(self, job: Job, variant: Variant) -> Iterator[nn.Module]:
        with zeroed(variant.slices), variant.statistics():
            yield self.model


class PhysicalExecutor(VariantExecutor):
    """A physically pruned copy of the model per variant, made when the variant first runs (with adaptive BN,
    :meth:`calibrate` makes it and re-estimates its affected statistics) and dropped by :meth:`release`.

    Args:
        model: The model, in eval mode on ``device``.
        example_input: The batch physical pruning traces.
        device: Where the copies run.
    """

    kind = Executor.PHYSICAL

    def __init__(self, model: nn.Module, example_input: torch.Tensor, device: torch.device) -> None:
        self.model, self.example_input, self.device = model, example_input, device

    def forward(self, chunk: Sequence[Job], images: torch.Tensor, wanted: Wanted, visit: Visit) -> None:
        for job in chunk:
            for variant in job.variants:
                if wanted(variant):
                    visit(variant, self._copy(job, variant)(images))

    def calibrate(self, chunk: Sequence[Job], batches: Iterable[CalibrationBatch], progress: bool | None) -> None:
        for job in chunk:
            for variant in job.variants:
                copy = self._copy(job, variant)
                reestimate(copy, layers_in_copy(self.model, copy, job.prepared.batchnorms), batches, progress=progress)

    @contextmanager
    def applied(self, job: Job, variant: Variant) -> Iterator[nn.Module]:
        try:
            yield self._copy(job, variant)
        finally:
            variant.copy = None

    def release(self, chunk: Sequence[Job]) -> None:
        for job in chunk:
            for variant in job.variants:
                variant.copy = None

    def _copy(self, job: Job, variant: Variant) -> nn.Module:
        """The variant's pruned copy, made on first use (also inside a pass: tracing needs autograd back on)."""
        if variant.copy is None:
            channels = job.prepared.removal[variant.ratio]
            with torch.inference_mode(False), torch.enable_grad():
                copy = pruned_copy(self.model, job.prepared.param.module_name, channels, self.example_input)
            variant.copy = copy.to(self.device)
        return variant.copy


class SuffixExecutor(VariantExecutor):
    """The model as a torch.fx graph: per batch the unpruned prefix runs once for the chunk, then each wanted
    variant's suffix from the prefix's values (jobs need a :attr:`Job.plan`, see :meth:`plan`).

    Args:
        runner: The traced model.
        device: Where calibration images go.
    """

    kind = Executor.FX_SUFFIX

    def __init__(self, runner: GraphRunner, device: torch.device) -> None:
        self.runner, self.device = runner, device
        self._schedule_of: tuple[tuple[SuffixPlan, ...], Schedule] | None = None  # the last one made

    def plan(
        self, prepared: Prepared, modules: Sequence[nn.Module], parameters: Sequence[torch.Tensor]
    ) -> SuffixPlan | str:
        """The suffix a variant of ``prepared`` runs (``modules`` and ``parameters``: what its variants change), or
        why this executor cannot run it."""
        plan = self.runner.plan(modules, parameters)
        if plan is None:
            return "the layers it changes do not reach the model's output in the traced graph"
        if not self.runner.runs_all(plan, prepared.batchnorms):
            return "a BatchNorm layer whose statistics it re-estimates runs outside the traced suffix"
        return plan

    def chunks(self, jobs: Sequence[Job], baseline_seconds: float) -> list[list[Job]]:
        """Jobs in model order, grouped so that each pass over the data is about :data:`CHUNK_SECONDS` of work."""
        total = sum(self.runner.node_cost.values()) or 1.0
        chunks: list[list[Job]] = [[]]
        estimate = 0.0
        for job in jobs:
            assert job.plan is not None
            cost = baseline_seconds * len(job.variants) * job.plan.cost / total
            if chunks[-1] and estimate + cost > CHUNK_SECONDS:
                chunks.append([])
                estimate = 0.0
            chunks[-1].append(job)
            estimate += cost
        return [chunk for chunk in chunks if chunk]

    def forward(self, chunk: Sequence[Job], images: torch.Tensor, wanted: Wanted, visit: Visit) -> None:
        active = [job for job in chunk if any(wanted(variant) for variant in job.variants)]
        if not active:
            return
        runner, by_plan = self.runner, {id(job.plan): job for job in active}

        def run(plan: SuffixPlan, frontier: NodeValues) -> None:
            for variant in by_plan[id(plan)].variants:
                if wanted(variant):
                    with zeroed(variant.slices), variant.statistics():
                        visit(variant, runner.run_suffix(plan, frontier))

        runner.walk(images, self._schedule(active), run)

    def calibrate(self, chunk: Sequence[Job], batches: Iterable[CalibrationBatch], progress: bool | None) -> None:
        """Per calibration batch the prefix runs once and each variant's suffix once, in train mode for its affected
        layers only (they all lie in its suffix), from where its previous batch left them."""
        runner, by_plan, schedule = self.runner, {id(job.plan): job for job in chunk}, self._schedule(chunk)
        with progress_bar(progress, total=getattr(batches, "num_samples", None), desc="calibrate", unit="img",
                          leave=False) as bar, torch.no_grad():  # fmt: skip
            for batch in batches:
                images = batch_images(batch).to(self.device, non_blocking=True)

                def run(plan: SuffixPlan, frontier: NodeValues, count: int = len(images)) -> None:
                    for variant in by_plan[id(plan)].variants:
                        assert variant.batchnorm is not None  # made for every variant with adaptive BN
                        with zeroed(variant.slices), variant.batchnorm.step(count):
                            runner.run_suffix(plan, frontier)

                runner.walk(images, schedule, run)
                bar.update(len(images))

    def matches(self, chunk: Sequence[tuple[Job, Variant]], images: torch.Tensor) -> dict[int, bool]:
        """Whether each job's suffix run of the given variant gives bit-identical logits to the full masked forward
        pass of its mode check (``id(job)`` -> match); one walk of ``images`` serves every job."""
        runner, by_plan = self.runner, {id(job.plan): (job, variant) for job, variant in chunk}
        matches: dict[int, bool] = {}

        def run(plan: SuffixPlan, frontier: NodeValues) -> None:
            job, variant = by_plan[id(plan)]
            assert job.prepared.check.masked_logits is not None
            with zeroed(variant.slices):
                logits = runner.run_suffix(plan, frontier)
            matches[id(job)] = torch.equal(logits, job.prepared.check.masked_logits)

        if chunk:
            with torch.inference_mode():
                runner.walk(images, self._schedule([job for job, _ in chunk]), run)
        return matches

    def _schedule(self, jobs: Sequence[Job]) -> Schedule:
        """The walk for ``jobs``' plans (the last one is kept: a pass asks for the same set batch after batch)."""
        plans = tuple(job.plan for job in jobs if job.plan is not None)
        last = self._schedule_of
        if last is None or len(last[0]) != len(plans) or any(a is not b for a, b in zip(last[0], plans, strict=True)):
            last = self._schedule_of = plans, self.runner.schedule(plans)
        return last[1]

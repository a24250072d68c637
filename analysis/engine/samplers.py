"""Samplers: which images each variant of a chunk gets, when it stops, and what is recorded of it.

A sampler drives passes over the data for a chunk of :class:`~analysis.engine.executors.Job` s; an executor runs the
variants' forward passes on each batch (:mod:`analysis.engine.executors`). Any sampler works with any executor:

* :class:`ExactSampler`: every variant sees every image, in the data's order (with no batches, only an eval
  function, each variant's model is handed to the function instead).
* :class:`AdaptiveSampler`: the images in a seeded random order; a variant stops once its loss is known within
  ``+-precision`` (:mod:`analysis.engine._adaptive`).
* :class:`DecisionSampler`: a variant stops once its side of ``target_loss`` is known
  (:mod:`analysis.engine._decision`).
* :class:`StagedSampler`: early stop around any of them; stage ``k`` evaluates every unit's ``k``-th ratio, so a unit
  that stops is not evaluated at its larger ratios.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from analysis.engine._adaptive import Z_95, PairedEstimate, per_sample
from analysis.engine._decision import Candidate, DecisionRule, ParamDecision
from analysis.engine.batchnorm import count_images
from analysis.engine.executors import Executor, Job, Variant, VariantExecutor
from analysis.engine.fidelity import DenseOutputs, IndexedBatch, image_count, indexed_batches, per_image_fidelity
from analysis.engine.loss import divides_by_baseline
from analysis.engine.settings import Batches, EngineSettings, Evaluator, Metrics
from analysis.metrics import metric_named
from analysis.progress import progress_bar


class Recorder(Protocol):
    """What a sampler reports to (the engine, for one run)."""

    def record(
        self, job: Job, variant: Variant, metrics: Metrics, seconds: float, executor: Executor, settled: str | None
    ) -> bool:
        """Save a variant's result; return whether it stops its unit (early stop, or decided above the target)."""

    def skipped(self, count: int) -> None:
        """``count`` variants will not be evaluated (stopped units)."""

    def stopped(self, job: Job) -> bool:
        """Whether the unit of ``job`` stopped (the analysis file says so)."""

    def recorded_losses(self, job: Job) -> Mapping[float, float]:
        """The losses of ``job``'s unit already in the analysis file."""

    def loss(self, metrics: Metrics) -> float:
        """The loss of a variant scoring ``metrics`` on every image, as an exact run computes it."""


@dataclass(frozen=True)
class Passes:
    """Where a sampler's passes get their images.

    Attributes:
        batches: The evaluation data as re-iterable ``(images, labels)`` batches; None when there is only ``evaluate``.
        evaluate: The data's evaluator of a whole model (used without batches).
        device: Where batches go.
        calibration: With adaptive BN, the batches each variant's BatchNorm statistics are re-estimated on.
        progress: Progress bars (None: only on a terminal).
    """

    batches: Batches | None
    evaluate: Evaluator
    device: torch.device
    calibration: Batches | None
    progress: bool | None


@dataclass
class PairedBaseline:
    """The baseline side of paired differences: the seeded random order of the images, every image's baseline value
    per metric (filled by the engine's baseline pass) and, for a label-free metric, the dense outputs."""

    order: torch.Tensor
    metric: str
    per_image: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: DenseOutputs | None = None

    @property
    def population(self) -> int:
        """Images in the evaluation set."""
        return len(self.order)

    def worse_by(self, logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Per-image difference of a variant to the baseline on the same images, positive when the variant is worse."""
        metric = metric_named(self.metric)
        if metric.label_free:
            assert self.dense is not None  # kept by the baseline pass
            variant = per_image_fidelity(logits, self.dense, index, metric.name)
        else:
            variant = per_sample(logits, labels)[metric.name]
        reference = self.per_image[metric.name][index]
        return reference - variant if metric.higher_is_better else variant - reference


class Sampler(ABC):
    """Chooses the images of each variant of a chunk and records the results (see the module doc)."""

    paired: PairedBaseline | None = None
    """The baseline a sampled run's estimates are paired with (None: every variant sees every image)."""

    def track(self, variant: Variant, baseline: Metrics) -> None:
        """Attach what the sampler follows of a new variant (nothing, for an exact run)."""
        del variant, baseline  # an exact run follows nothing

    def note(self) -> str:
        """What the baseline's log line says of the sampling (empty for an exact run)."""
        return ""

    @abstractmethod
    def run(self, chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder) -> None:
        """Evaluate the chunk's variants with ``executor`` and record them."""


def _accumulate(
    chunk: Sequence[Job],
    executor: VariantExecutor,
    batches: Iterable[IndexedBatch],
    wanted: Callable[[Variant], bool],
    paired: PairedBaseline | None,
    bar_total: int | None,
    progress: bool | None,
    after_batch: Callable[[], bool] = lambda: False,
) -> None:
    """Run the ``wanted`` variants of ``chunk`` on ``batches``, adding each batch to their sums (and estimates); stop
    early when ``after_batch`` says so."""
    with progress_bar(progress, total=bar_total, desc=f"{len(chunk)} unit(s)", unit="img", leave=False) as bar:
        for batch in batches:
            _run_batch(chunk, executor, batch, wanted, paired)
            bar.update(int(batch[1].numel()))
            if after_batch():
                return


def _run_batch(
    chunk: Sequence[Job],
    executor: VariantExecutor,
    batch: IndexedBatch,
    wanted: Callable[[Variant], bool],
    paired: PairedBaseline | None,
) -> None:
    """Run the ``wanted`` variants of ``chunk`` on one batch and add it to their sums (and paired estimates)."""
    _, labels, index = batch

    def add(variant: Variant, logits: torch.Tensor) -> None:
        variant.sums.add(logits, labels, index)
        if variant.estimate is not None:
            assert paired is not None  # estimates are made by the sampled samplers only
            variant.estimate.add(paired.worse_by(logits, labels, index))

    with torch.inference_mode():
        executor.forward(chunk, batch[0], wanted, add)


def _record_in_order(chunk: Sequence[Job], executor: VariantExecutor, recorder: Recorder, seconds: float) -> None:
    """Record each job's variants in increasing ratio order from their sums, until one stops its unit."""
    each = seconds / max(1, sum(len(job.variants) for job in chunk))
    for job in chunk:
        for position, variant in enumerate(job.variants):
            if recorder.record(job, variant, variant.sums.metrics(), each, executor.kind, None):
                recorder.skipped(len(job.variants) - position - 1)
                break


class ExactSampler(Sampler):
    """Every variant on every image, in the data's order: one pass per chunk."""

    def run(self, chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder) -> None:
        start = time.perf_counter()
        if passes.calibration is not None:
            executor.calibrate(chunk, passes.calibration, passes.progress)
        if passes.batches is None:
            self._evaluate_models(chunk, executor, passes, recorder, time.perf_counter() - start)
            return
        total = image_count(passes.batches)
        batches = indexed_batches(passes.batches, passes.device)
        _accumulate(chunk, executor, batches, lambda _: True, None, total, passes.progress)
        _record_in_order(chunk, executor, recorder, time.perf_counter() - start)

    @staticmethod
    def _evaluate_models(
        chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder, calibration: float
    ) -> None:
        """Without batches: hand each variant's model to the eval function, in increasing ratio order, until one stops
        its unit (each is saved before the next is evaluated)."""
        share = calibration / max(1, sum(len(job.variants) for job in chunk))
        for job in chunk:
            for position, variant in enumerate(job.variants):
                start = time.perf_counter()
                with executor.applied(job, variant) as model:
                    metrics = passes.evaluate(model)
                seconds = share + time.perf_counter() - start
                if recorder.record(job, variant, metrics, seconds, executor.kind, None):
                    recorder.skipped(len(job.variants) - position - 1)
                    break


class AdaptiveSampler(Sampler):
    """The images in the paired baseline's random order; a variant stops once its loss is known within
    ``+-precision`` (95%), the pass once every variant of the chunk stopped."""

    paired: PairedBaseline

    def __init__(self, paired: PairedBaseline, precision: float, relative: bool) -> None:
        self.paired, self.precision, self.relative = paired, precision, relative

    def track(self, variant: Variant, baseline: Metrics) -> None:
        variant.estimate = _estimate(self.paired, baseline, self.relative, Z_95)

    def note(self) -> str:
        return f" (adaptive precision +-{self.precision:g})"

    def run(self, chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder) -> None:
        assert passes.batches is not None  # a sampled run needs batches (see make_sampler)
        start = time.perf_counter()
        if passes.calibration is not None:
            executor.calibrate(chunk, passes.calibration, passes.progress)

        def all_done() -> bool:
            for job in chunk:
                for variant in job.variants:
                    assert variant.estimate is not None  # tracked
                    variant.done = variant.done or variant.estimate.precise_enough(self.precision)
            return all(variant.done for job in chunk for variant in job.variants)

        batches = ordered_batches(passes.batches, self.paired.order)
        _accumulate(chunk, executor, batches, lambda v: not v.done, self.paired, self.paired.population,
                    passes.progress, all_done)  # fmt: skip
        _record_in_order(chunk, executor, recorder, time.perf_counter() - start)


class DecisionSampler(Sampler):
    """Passes over the paired baseline's random order until no variant needs more images (see
    :mod:`analysis.engine._decision`); then the variants kept are recorded in increasing ratio order."""

    paired: PairedBaseline

    def __init__(self, paired: PairedBaseline, rule: DecisionRule, relative: bool, error: float, variants: int) -> None:
        self.paired, self.rule, self.relative, self.error, self.variants = paired, rule, relative, error, variants

    def track(self, variant: Variant, baseline: Metrics) -> None:
        variant.estimate = _estimate(self.paired, baseline, self.relative, self.rule.z)
        variant.candidate = Candidate(variant.ratio, variant.estimate)

    def note(self) -> str:
        return (
            f" (decision-driven sampling: each variant settled above or below target_loss {self.rule.target:g}; "
            f"chance of any wrong decision <= {self.error:g} over {self.variants} variant(s), z = {self.rule.z:.2f})"
        )

    def run(self, chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder) -> None:
        start = time.perf_counter()
        if passes.calibration is not None:
            executor.calibrate(chunk, passes.calibration, passes.progress)
        decisions = {id(job): self._decision(job, recorder) for job in chunk}
        while True:
            needing = [c for decision in decisions.values() for c in decision.needing()]
            if not needing:
                break
            self._pass(chunk, executor, passes, recorder, decisions, min(c.count for c in needing))
        seconds_each = (time.perf_counter() - start) / max(1, sum(len(job.variants) for job in chunk))
        for job in chunk:
            kept = decisions[id(job)].kept()
            for variant in job.variants:
                if variant.candidate in kept:
                    assert variant.candidate is not None
                    recorder.record(job, variant, variant.sums.metrics(), seconds_each, executor.kind,
                                    variant.candidate.settled())  # fmt: skip
            recorder.skipped(len(job.variants) - len(kept))  # skipped: above a ratio decided above the target

    def _decision(self, job: Job, recorder: Recorder) -> ParamDecision:
        """The decision over ``job``'s variants, with the sides of the unit's ratios already in the file."""
        candidates = [v.candidate for v in job.variants if v.candidate is not None]
        recorded = recorder.recorded_losses(job)
        sides = {r: "above" if loss > self.rule.target else "below" for r, loss in recorded.items()}
        return ParamDecision(self.rule, candidates, sides)

    def _pass(
        self,
        chunk: Sequence[Job],
        executor: VariantExecutor,
        passes: Passes,
        recorder: Recorder,
        decisions: Mapping[int, ParamDecision],
        start: int,
    ) -> None:
        """One walk over the random order from image ``start``: each candidate that needs images runs on the batches
        from its own count on; the walk ends once every candidate that still needs images is behind it (it waited
        for an answer a settled variant gave later; the next walk starts from there)."""
        assert passes.batches is not None  # a sampled run needs batches (see make_sampler)

        def ahead(job: Job, position: int) -> list[Candidate]:
            return [c for c in decisions[id(job)].needing() if c.count >= position]

        active = [job for job in chunk if ahead(job, start)]
        position = start
        with progress_bar(passes.progress, total=self.paired.population - start, desc=f"{len(active)} unit(s)",
                          unit="img", leave=False) as bar:  # fmt: skip
            for batch in ordered_batches(passes.batches, self.paired.order[start:]):
                running = {id(c) for job in active for c in ahead(job, position) if c.count == position}
                if running:

                    def wanted(variant: Variant, running: set[int] = running) -> bool:
                        return id(variant.candidate) in running

                    _run_batch(active, executor, batch, wanted, self.paired)
                position += int(batch[1].numel())
                bar.update(int(batch[1].numel()))
                for job in active:
                    for variant in job.variants:
                        candidate = variant.candidate
                        if candidate is not None and id(candidate) in running and candidate.exact:
                            candidate.exact_loss = recorder.loss(variant.sums.metrics())
                for job in active:
                    decisions[id(job)].look()
                active = [job for job in active if ahead(job, position)]
                if not active:
                    break


class StagedSampler(Sampler):
    """Early stop around another sampler: pass ``k`` evaluates every unit's ``k``-th ratio, so a unit that stops is
    not evaluated at its larger ratios (one walk of the data per stage instead of one in all)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.paired = inner.paired

    def track(self, variant: Variant, baseline: Metrics) -> None:
        self.inner.track(variant, baseline)

    def note(self) -> str:
        return self.inner.note()

    def run(self, chunk: Sequence[Job], executor: VariantExecutor, passes: Passes, recorder: Recorder) -> None:
        active = [job for job in chunk if job.variants]
        stage = 0
        while active:
            self.inner.run([job.only(job.variants[stage]) for job in active], executor, passes, recorder)
            executor.release(active)
            stage += 1
            still = []
            for job in active:
                remaining = len(job.variants) - stage
                if remaining and recorder.stopped(job):
                    recorder.skipped(remaining)  # skipped by the early stop
                elif remaining:
                    still.append(job)
            active = still


def make_sampler(settings: EngineSettings, batches: Batches | None) -> Sampler:
    """The sampler ``settings`` ask for: exact, adaptive precision or decision-driven (which need the data as batches;
    without them every variant is evaluated on every image), inside early-stop stages when an early stop is set."""
    sampler: Sampler = ExactSampler()
    if settings.sampled and batches is not None:
        population = count_images(batches)
        order = torch.randperm(population, generator=torch.Generator().manual_seed(settings.seed))
        paired = PairedBaseline(order, settings.metric)
        relative = divides_by_baseline(settings.metric, settings.metric_mode)
        decision = settings.decision
        if decision is None:
            assert settings.precision is not None  # sampled
            sampler = AdaptiveSampler(paired, settings.precision, relative)
        else:
            variants = decision.variants or 1
            rule = DecisionRule.build(decision.target, decision.error, population, variants, settings.precision)
            sampler = DecisionSampler(paired, rule, relative, decision.error, variants)
    return StagedSampler(sampler) if settings.early_stop is not None else sampler


def _estimate(paired: PairedBaseline, baseline: Metrics, relative: bool, z: float) -> PairedEstimate:
    """A new paired estimate of a variant's loss against ``baseline``."""
    return PairedEstimate(
        population=paired.population,
        baseline=float(baseline[paired.metric]),
        relative=relative,
        discrete=not metric_named(paired.metric).continuous,
        z=z,
    )


def ordered_batches(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], order: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches of the images at ``order`` with their indices: from an :class:`~analysis.inputs.data.EvalLoader`
    directly, from any other iterable of batches by collecting them in memory first (same batch size as its first
    batch)."""
    in_order = getattr(batches, "in_order", None)
    if in_order is not None:
        yield from in_order(order.tolist())
        return
    pairs = list(batches)
    images = torch.cat([images for images, _ in pairs])
    labels = torch.cat([labels for _, labels in pairs])
    size = len(pairs[0][1])
    for start in range(0, len(order), size):
        index = order[start : start + size]
        yield images[index], labels[index], index

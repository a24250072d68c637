"""The fast engine: same variants and numbers as the reference engine, far fewer computations.

Per batch, the unmodified model runs once (as a torch.fx graph) just far enough to produce every analysed param's
frontier; each (param, ratio) variant then runs only the part of the graph its removal can change (see
:mod:`analysis.engine.partition`). Params are processed in chunks of a few minutes of work, each chunk one pass
over the (cached) data, and every chunk's results are saved before the next starts. Before that, every param's split
is run on a few images and compared with a full masked forward pass; a param whose logits are not bit-identical
(the graph split would not reproduce eager execution) is evaluated by the reference path instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from analysis.engine._adaptive import CONTINUOUS_METRICS, Z_95, PairedEstimate, per_sample
from analysis.engine._decision import Candidate, DecisionRule, ParamDecision
from analysis.engine._variants import Prepared
from analysis.engine.batchnorm import Estimation, batch_images, count_images
from analysis.engine.fidelity import IndexedBatch, Scores, indexed_batches, per_image_fidelity
from analysis.engine.loss import LOWER_IS_BETTER, divides_by_baseline, relative_loss, without_timing
from analysis.engine.partition import GraphRunner, NodeValues, Schedule, SuffixPlan, UntraceableModel
from analysis.engine.reference import EngineReport, Executor, RunState, SensitivityEngine
from analysis.engine.settings import Metrics
from analysis.progress import progress_bar
from analysis.structure.groups import PrunableParam
from analysis.structure.masking import Slice, zeroed

logger = logging.getLogger(__name__)

CHUNK_SECONDS = 300.0  # estimated work per pass over the data; results are saved after each pass


@dataclass
class Variant:
    """One (param, ratio) in flight: the slices to zero, the metric sums gathered over batches and, with adaptive
    precision or decision-driven sampling, the running paired estimate of its loss (and its decision); with adaptive
    BN, its re-estimated BatchNorm statistics."""

    ratio: float
    slices: list[Slice]
    sums: Scores
    estimate: PairedEstimate | None = None
    done: bool = False
    batchnorm: Estimation | None = None
    candidate: Candidate | None = None


@dataclass
class Job:
    """A prepared param with its suffix plan and its pending variants."""

    prepared: Prepared
    plan: SuffixPlan
    variants: list[Variant]


class FastSensitivityEngine(SensitivityEngine):
    """Evaluates variants on graph suffixes; needs the data as re-iterable ``(images, labels)`` batches."""

    def run(self, params: Sequence[PrunableParam]) -> EngineReport:
        """Like :meth:`SensitivityEngine.run`; falls back to it for a model torch.fx cannot trace."""
        self.runner: GraphRunner | None = None
        self.order = torch.empty(0, dtype=torch.long)  # adaptive precision: the random order of the images
        self.per_image: dict[str, torch.Tensor] = {}  # adaptive precision: every image's baseline values by metric
        self.rule: DecisionRule | None = None  # decision-driven sampling: when a variant settles
        try:
            self.runner = GraphRunner(self.model)
        except UntraceableModel as error:
            logger.info("torch.fx cannot trace this model (%s); using the reference engine.", error)
            return super().run(params)
        return super().run(params)

    def measure_baseline(self) -> Metrics:
        """With adaptive precision: one pass over the whole set in the seeded random order the variants will use,
        keeping every image's baseline values for the paired differences (top1/top5/ce with labels; for a label-free
        metric the dense outputs, against which the dense model scores 1 or 0 per image); the stored baseline is not
        reused, it lacks them. Otherwise the reference engine's baseline."""
        if not self.settings.sampled:
            return super().measure_baseline()
        assert self.data.batches is not None  # the fast engine is only made for data given as batches
        start = time.perf_counter()
        images_total = count_images(self.data.batches)
        self.order = torch.randperm(images_total, generator=torch.Generator().manual_seed(self.settings.seed))
        labelled = ("top1", "top5", "ce") if self.scoring.labelled else ()
        self.per_image = {key: torch.empty(images_total, dtype=torch.float64) for key in labelled}
        metrics = self.dense_pass(ordered_batches(self.data.batches, self.order), images_total, self.per_image)
        if self.scoring.label_free:
            self.per_image[self.settings.metric] = self.scoring.dense_per_image(images_total)
        metrics["seconds"] = round(time.perf_counter() - start, 3)
        decision = self.settings.decision
        if decision is None:
            self.store_baseline(metrics, f" (adaptive precision +-{self.settings.precision:g})")
            return metrics
        variants = decision.variants or 1
        self.rule = DecisionRule.build(decision.target, decision.error, images_total, variants, self.settings.precision)
        self.store_baseline(
            metrics,
            f" (decision-driven sampling: each variant settled above or below target_loss {decision.target:g}; "
            f"chance of any wrong decision <= {decision.error:g} over {variants} variant(s), z = {self.rule.z:.2f})",
        )
        return metrics

    def run_params(self, params: Sequence[PrunableParam], pending: Mapping[str, list[float]], state: RunState) -> None:
        if self.runner is None:
            super().run_params(params, pending, state)
            return
        self.runner.profile(self.check_input, repeats=1)
        jobs: list[Job] = []
        for param in params:
            ratios = [r for r in pending[param.name] if not self.store.has(param.name, r)]
            state.bar.update(len(pending[param.name]) - len(ratios))  # units filled in by a coupled param
            if not ratios:
                continue
            prepared = self.prepare(param, ratios, state)
            if prepared is None:
                continue
            job = self._job(prepared, ratios, state)
            if job is not None:
                jobs.append(job)
        jobs = self._check_splits(jobs, state)
        if self.settings.early_stop is None:
            for chunk in self._chunks(jobs, float(state.baseline.get("seconds", 1.0))):
                self._run_chunk(chunk, state)
            return
        self._run_in_stages(jobs, state)

    def _run_in_stages(self, jobs: list[Job], state: RunState) -> None:
        """With early stop: pass ``k`` evaluates every param's ``k``-th ratio, so a param that stops is not
        evaluated at its larger ratios (one walk of the unpruned prefix per stage instead of one in all)."""
        active = [job for job in jobs if job.variants]
        stage = 0
        while active:
            staged = [Job(job.prepared, job.plan, [job.variants[stage]]) for job in active]
            for chunk in self._chunks(staged, float(state.baseline.get("seconds", 1.0))):
                self._run_chunk(chunk, state)
            stage += 1
            still = []
            for job in active:
                remaining = len(job.variants) - stage
                if remaining and self.stops.stop_ratio(job.prepared.param.name) is not None:
                    state.bar.update(remaining)  # skipped by the early stop
                elif remaining:
                    still.append(job)
            active = still

    def _job(self, prepared: Prepared, ratios: Sequence[float], state: RunState) -> Job | None:
        """Plan a masked param's suffix; physical params and variants removing nothing are done right away."""
        assert self.runner is not None
        if prepared.mode == "physical":
            self.evaluate_ratios(prepared, ratios, state)
            return None
        plan = self.runner.plan(*self.changed_layers(prepared))
        if plan is None or not self.runner.runs_all(plan, prepared.batchnorms):
            why = (
                "the layers it changes do not reach the model's output in the traced graph"
                if plan is None
                else "a BatchNorm layer whose statistics it re-estimates runs outside the traced suffix"
            )
            logger.info(
                "%s: evaluated with full forward passes (the fast engine's suffix cannot run it: %s); the numbers "
                "are the same, only slower.",
                prepared.param.name,
                why,
            )
            self.evaluate_ratios(prepared, ratios, state)
            return None
        variants: list[Variant] = []
        for position, ratio in enumerate(ratios):
            if not prepared.removal[ratio]:  # removes nothing: the baseline's metrics
                if self.record(prepared, ratio, without_timing(state.baseline), state, 0.0, executor=Executor.BASELINE):
                    state.bar.update(len(ratios) - position - 1)
                    return None
                continue
            estimate = self._new_estimate(state.baseline)
            variants.append(
                Variant(
                    ratio,
                    self.slices(prepared, ratio),
                    self.scoring.sums(self.dense),
                    estimate=estimate,
                    batchnorm=Estimation(prepared.batchnorms) if self.settings.adaptive_bn else None,
                    candidate=None if self.rule is None or estimate is None else Candidate(ratio, estimate),
                )
            )
        return Job(prepared, plan, variants) if variants else None

    def _new_estimate(self, baseline: Metrics) -> PairedEstimate | None:
        if not self.settings.sampled:
            return None
        metric = self.settings.metric
        return PairedEstimate(
            population=len(self.order),
            baseline=float(baseline[metric]),
            relative=divides_by_baseline(metric, self.settings.metric_mode),
            discrete=metric not in CONTINUOUS_METRICS,
            z=Z_95 if self.rule is None else self.rule.z,
        )

    def _check_splits(self, jobs: list[Job], state: RunState) -> list[Job]:
        """Keep the jobs whose suffix run gives bit-identical logits to the full masked forward pass of their mode
        check (at the channels checked); the others are evaluated by the reference path. One walk of the check
        images serves every job (the unpruned prefix runs once, not once per param)."""
        assert self.runner is not None
        runner = self.runner
        checked: dict[int, tuple[Job, Variant]] = {}
        for job in jobs:
            channels = job.prepared.check.channels
            variant = next((v for v in job.variants if job.prepared.removal[v.ratio] == channels), None)
            if variant is not None:
                checked[id(job.plan)] = job, variant
        matches: dict[int, bool] = {}

        def visit(plan: SuffixPlan, frontier: NodeValues) -> None:
            job, variant = checked[id(plan)]
            assert job.prepared.check.masked_logits is not None
            with zeroed(variant.slices):
                logits = runner.run_suffix(plan, frontier)
            matches[id(job)] = torch.equal(logits, job.prepared.check.masked_logits)

        if checked:
            with torch.inference_mode():
                runner.walk(self.check_input, runner.schedule([job.plan for job, _ in checked.values()]), visit)
        kept = []
        for job in jobs:
            if matches.get(id(job), True):
                kept.append(job)
                continue
            logger.info("%s: the graph split differs from eager execution; using the reference path for it.",
                        job.prepared.param.name)  # fmt: skip
            self.evaluate_ratios(job.prepared, [v.ratio for v in job.variants], state)
        return kept

    def _chunks(self, jobs: list[Job], baseline_seconds: float) -> list[list[Job]]:
        """Group jobs (in model order) so that each pass over the data is about ``CHUNK_SECONDS`` of work."""
        assert self.runner is not None
        total = sum(self.runner.node_cost.values()) or 1.0
        chunks: list[list[Job]] = [[]]
        estimate = 0.0
        for job in jobs:
            cost = baseline_seconds * len(job.variants) * job.plan.cost / total
            if chunks[-1] and estimate + cost > CHUNK_SECONDS:
                chunks.append([])
                estimate = 0.0
            chunks[-1].append(job)
            estimate += cost
        return [chunk for chunk in chunks if chunk]

    def _run_chunk(self, chunk: list[Job], state: RunState) -> None:
        """One pass over the data for a chunk of jobs: walk each batch once, run every variant's suffix on it.

        With adaptive precision the pass follows the baseline's random order and a variant stops as soon as its
        loss is precise enough; the pass ends when every variant of the chunk has stopped.
        """
        assert self.runner is not None
        schedule = self.runner.schedule([job.plan for job in chunk])
        start = time.perf_counter()
        if self.settings.adaptive_bn:
            self._calibrate(chunk, schedule)
        if self.rule is not None:
            self._decide_chunk(chunk, state)
            return
        self._evaluate_chunk(chunk, schedule)
        seconds = time.perf_counter() - start
        variants = sum(len(job.variants) for job in chunk)
        for job in chunk:
            for position, variant in enumerate(job.variants):  # in increasing ratio order
                metrics = variant.sums.metrics()
                seconds_each = seconds / variants
                if self.record(
                    job.prepared,
                    variant.ratio,
                    metrics,
                    state,
                    seconds_each,
                    variant.estimate,
                    executor=Executor.FX_SUFFIX,
                ):
                    state.bar.update(len(job.variants) - position - 1)  # early stop: the larger ratios are dropped
                    break
        logger.debug("Chunk of %d conv(s): %d variants in %.1f s.", len(chunk), variants, seconds)

    def _calibrate(self, chunk: list[Job], schedule: Schedule) -> None:
        """Adaptive BN: one pass over the calibration batches re-estimates the affected BatchNorm statistics of every
        variant of the chunk; per batch the unpruned prefix runs once and each variant's suffix once, in train mode
        for its affected layers only (they all lie in its suffix), from where its previous batch left them."""
        assert self.runner is not None and self.data.calibration is not None
        runner, by_plan = self.runner, {id(job.plan): job for job in chunk}
        total = getattr(self.data.calibration, "num_samples", None)
        with progress_bar(self.settings.progress, total=total, desc="calibrate", unit="img", leave=False) as inner:
            for batch in self.data.calibration:
                images = batch_images(batch).to(self.device, non_blocking=True)

                def visit(plan: SuffixPlan, frontier: NodeValues, count: int = len(images)) -> None:
                    for variant in by_plan[id(plan)].variants:
                        assert variant.batchnorm is not None
                        with zeroed(variant.slices), variant.batchnorm.step(count):
                            runner.run_suffix(plan, frontier)

                with torch.no_grad():
                    runner.walk(images, schedule, visit)
                inner.update(len(images))

    def _evaluate_chunk(self, chunk: list[Job], schedule: Schedule) -> None:
        """The evaluation pass of :meth:`_run_chunk` (each variant's re-estimated statistics loaded, with adaptive
        BN)."""
        assert self.runner is not None
        runner = self.runner
        by_plan = {id(job.plan): job for job in chunk}
        active = list(chunk)
        adaptive = self.settings.sampled
        total = len(self.order) if adaptive else getattr(self.data.batches, "num_samples", None)
        with progress_bar(
            self.settings.progress, total=total, desc=f"{len(chunk)} unit(s)", unit="img", leave=False
        ) as inner:
            for images, labels, index in self._batches():

                def visit(plan: SuffixPlan, frontier: NodeValues, labels: torch.Tensor = labels,
                          index: torch.Tensor = index) -> None:  # fmt: skip
                    for variant in by_plan[id(plan)].variants:
                        if variant.done:
                            continue
                        statistics = variant.batchnorm.applied() if variant.batchnorm else contextlib.nullcontext()
                        with zeroed(variant.slices), statistics:
                            logits = runner.run_suffix(plan, frontier)
                        variant.sums.add(logits, labels, index)
                        if variant.estimate is not None:
                            variant.estimate.add(self._worse_by(logits, labels, index))

                with torch.inference_mode():
                    runner.walk(images, schedule, visit)
                inner.update(int(labels.numel()))
                if adaptive:
                    for job in active:
                        for variant in job.variants:
                            assert variant.estimate is not None and self.settings.precision is not None
                            variant.done = variant.done or variant.estimate.precise_enough(self.settings.precision)
                    still = [job for job in active if not all(v.done for v in job.variants)]
                    if not still:
                        break
                    if len(still) < len(active):
                        active = still
                        schedule = runner.schedule([job.plan for job in active])

    def _decide_chunk(self, chunk: list[Job], state: RunState) -> None:
        """Decision-driven sampling for a chunk: passes over the random order until no variant needs more images
        (see :mod:`analysis.engine._decision`), then record the variants kept, in increasing ratio order."""
        assert self.rule is not None
        start = time.perf_counter()
        decisions = {id(job): self._decision(job) for job in chunk}
        while True:
            needing = [c for decision in decisions.values() for c in decision.needing()]
            if not needing:
                break
            self._decision_pass(chunk, decisions, min(c.count for c in needing), state.baseline)
        seconds_each = (time.perf_counter() - start) / max(1, sum(len(job.variants) for job in chunk))
        for job in chunk:
            decision = decisions[id(job)]
            kept = decision.kept()
            for variant in job.variants:
                candidate = variant.candidate
                if candidate in kept:
                    assert candidate is not None
                    metrics = variant.sums.metrics()
                    self.record(job.prepared, variant.ratio, metrics, state, seconds_each, variant.estimate,
                                candidate.settled(), executor=Executor.FX_SUFFIX)  # fmt: skip
            state.bar.update(len(job.variants) - len(kept))  # skipped: above a ratio decided above the target

    def _decision(self, job: Job) -> ParamDecision:
        """The decision over ``job``'s variants, with the sides of the param's ratios already in the file."""
        assert self.rule is not None
        candidates = [v.candidate for v in job.variants if v.candidate is not None]
        recorded = self.store.sensitivities.get(job.prepared.param.name, {})
        sides = {r: "above" if loss > self.rule.target else "below" for r, loss in recorded.items()}
        return ParamDecision(self.rule, candidates, sides)

    def _decision_pass(
        self, chunk: list[Job], decisions: Mapping[int, ParamDecision], start: int, baseline: Metrics
    ) -> None:
        """One walk over the random order from image ``start``: each candidate that needs images runs on the batches
        from its own count on; the walk ends once every candidate that still needs images is behind it (it waited
        for an answer a settled variant gave later; the next walk starts from there)."""
        assert self.runner is not None and self.data.batches is not None
        runner = self.runner
        of = {id(variant.candidate): variant for job in chunk for variant in job.variants}

        def ahead(job: Job, position: int) -> list[Candidate]:
            return [c for c in decisions[id(job)].needing() if c.count >= position]

        active = [job for job in chunk if ahead(job, start)]
        schedule = runner.schedule([job.plan for job in active])
        position = start
        total = len(self.order) - start
        with progress_bar(self.settings.progress, total=total, desc=f"{len(active)} unit(s)", unit="img",
                          leave=False) as inner:  # fmt: skip
            for images, labels, index in ordered_batches(self.data.batches, self.order[start:]):
                running = {id(c) for job in active for c in ahead(job, position) if c.count == position}
                by_plan = {id(job.plan): job for job in active}
                visit = functools.partial(self._run_candidates, by_plan, running, labels, index)
                if running:
                    with torch.inference_mode():
                        runner.walk(images, schedule, visit)
                position += int(labels.numel())
                inner.update(int(labels.numel()))
                for key in running:
                    variant = of[key]
                    assert variant.candidate is not None
                    if variant.candidate.exact:
                        variant.candidate.exact_loss = self._exact_loss(variant.sums.metrics(), baseline)
                for job in active:
                    decisions[id(job)].look()
                still = [job for job in active if ahead(job, position)]
                if not still:
                    break
                if len(still) < len(active):
                    active = still
                    schedule = runner.schedule([job.plan for job in active])

    def _run_candidates(
        self,
        by_plan: Mapping[int, Job],
        running: set[int],
        labels: torch.Tensor,
        index: torch.Tensor,
        plan: SuffixPlan,
        frontier: NodeValues,
    ) -> None:
        """Run the suffix of each ``running`` candidate of ``plan``'s job on one batch and add it to its estimate."""
        assert self.runner is not None
        for variant in by_plan[id(plan)].variants:
            if id(variant.candidate) not in running:
                continue
            statistics = variant.batchnorm.applied() if variant.batchnorm else contextlib.nullcontext()
            with zeroed(variant.slices), statistics:
                logits = self.runner.run_suffix(plan, frontier)
            variant.sums.add(logits, labels, index)
            assert variant.estimate is not None
            variant.estimate.add(self._worse_by(logits, labels, index))

    def _exact_loss(self, metrics: Metrics, baseline: Metrics) -> float:
        """The loss of a variant evaluated on every image, computed as the exact run computes it."""
        metric = self.settings.metric
        return relative_loss(baseline[metric], metrics[metric], metric, self.settings.metric_mode)

    def _batches(self) -> Iterator[IndexedBatch]:
        """The data for one pass with each image's sample index: in order, or in the baseline's random order for
        precision."""
        assert self.data.batches is not None  # the fast engine is only made for data given as batches
        if self.settings.sampled:
            yield from ordered_batches(self.data.batches, self.order)
            return
        yield from indexed_batches(self.data.batches, self.device)

    def _worse_by(self, logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Per-image difference to the baseline on the same images, positive when the variant is worse."""
        metric = self.settings.metric
        if self.scoring.label_free:
            assert self.dense is not None  # kept by the baseline pass
            variant = per_image_fidelity(logits, self.dense, index, metric)
        else:
            variant = per_sample(logits, labels)[metric]
        reference = self.per_image[metric][index]
        return variant - reference if metric in LOWER_IS_BETTER else reference - variant


def ordered_batches(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], order: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches of the images at ``order`` with their indices: from an :class:`~analysis.inputs.data.EvalLoader`
    directly,
    from any other iterable of batches by collecting them in memory first (same batch size as its first batch)."""
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

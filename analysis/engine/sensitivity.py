"""The sensitivity loop: for each unit (conv filters, neurons, heads) and ratio, remove channels, evaluate, record.

One variant is one (unit, ratio): its channels are chosen with the criterion and removed from the whole coupled group
(by masking, or on a physically pruned copy where masking is not exact, see :mod:`analysis.engine._modes`); its loss
``(baseline - metric) / baseline`` is saved with the unit's other variants once they are evaluated.

The engine composes two independent choices: an *executor* runs a variant's forward pass (eager with masked slices,
a physically pruned copy, or the torch.fx suffix from a prefix shared by many variants,
:mod:`analysis.engine.executors`), and a *sampler* chooses which images each variant gets and when it stops (exact,
adaptive precision, decision-driven, early stop, :mod:`analysis.engine.samplers`). The engine prepares each unit,
picks its executor (the suffix where it is given one and it reproduces eager execution bit for bit, else eager or
physical) and records what the sampler reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch_pruning as tp
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from analysis.engine._adaptive import PairedEstimate, per_sample
from analysis.engine._early_stop import StopLedger
from analysis.engine._modes import MaskCheck
from analysis.engine._variants import Prepared, changed_layers, prepare_elements, variant_slices
from analysis.engine.approximation import loss_shift, mask_tolerance, measure_approximation
from analysis.engine.batchnorm import BatchNorm, Estimation, changed_sources, downstream_batchnorms
from analysis.engine.evaluate import MetricSums
from analysis.engine.executors import (
    EagerExecutor,
    Executor,
    Job,
    PhysicalExecutor,
    SuffixExecutor,
    Variant,
    VariantExecutor,
)
from analysis.engine.fidelity import DenseOutputs, IndexedBatch, PassMetrics, image_count, indexed_batches
from analysis.engine.loss import check_baseline, check_finite, format_metrics, relative_loss, without_timing
from analysis.engine.samplers import Passes, Sampler, ordered_batches
from analysis.engine.settings import AnalysisData, EngineSettings, Metrics
from analysis.errors import UserError
from analysis.inputs.numerics import is_approximate
from analysis.io.sidecar import NumericsRecord, ParamRecord, VariantRecord
from analysis.io.store import AnalysisStore
from analysis.metrics import LABEL_FREE_METRICS
from analysis.progress import progress_bar
from analysis.structure.criteria import channel_scores, select_channels
from analysis.structure.flops import CostModel, summarise
from analysis.structure.groups import PrunableUnit, full_group

logger = logging.getLogger(__name__)

UNIT_NOUNS = {"conv": "channels", "linear": "neurons", "heads": "heads"}
"""What a variant of each kind of unit removes, for the log."""


@dataclass
class EngineReport:
    """What a run did: the baseline, evaluated units, params that were skipped with their reasons and, per recorded
    variant, what evaluated it."""

    baseline: Metrics
    evaluated: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)
    executors: dict[str, dict[float, Executor]] = field(default_factory=dict)
    """``{param name: {ratio: executor}}`` of every variant this run recorded (a resumed one is not listed; one
    evaluation shared by coupled params is listed under each name it was saved as)."""


@dataclass
class RunState:
    """One run in progress: the baseline every loss is relative to, what the run did so far, and its progress bar
    (one tick per (param, ratio) unit, evaluated or skipped)."""

    baseline: Metrics
    report: EngineReport
    bar: tqdm


class SensitivityEngine:
    """Runs the (unit, ratio) variants of one analysis, resuming from and saving to an :class:`AnalysisStore`.

    With a label-free metric (``agreement``, ``kl``) every pass compares each image with the dense model's output
    on it, kept by the baseline pass (:attr:`dense`); the data's evaluator is then not used, the batches are.

    Args:
        model: The model, in eval mode on its device.
        data: What variants are evaluated on (``data.calibration`` is needed with ``settings.adaptive_bn``).
        graph: The dependency graph of ``model``.
        settings: Ratios, criterion, metric.
        store: Where results go.
        sampler: Which images each variant gets (:func:`~analysis.engine.samplers.make_sampler`).
        suffix: The torch.fx suffix executor, for the units it can run (None: every unit runs eagerly or on a
            physically pruned copy).
    """

    def __init__(
        self,
        model: nn.Module,
        data: AnalysisData,
        graph: tp.DependencyGraph,
        settings: EngineSettings,
        store: AnalysisStore,
        *,
        sampler: Sampler,
        suffix: SuffixExecutor | None = None,
    ) -> None:
        if settings.adaptive_bn and data.calibration is None:
            raise ValueError("adaptive_bn needs calibration batches")
        self.model, self.data, self.graph, self.settings, self.store = model, data, graph, settings, store
        self.sampler, self.suffix = sampler, suffix
        self.device = data.example_input.device
        self.scoring = PassMetrics(settings.metric, labelled=bool(getattr(data.batches, "labelled", True)))
        check_scoring(self.scoring, data.batches is not None)
        self.dense: DenseOutputs | None = None  # the dense model's outputs per image, for a label-free metric
        self.mask_check = MaskCheck(model, graph, data.example_input)
        self.check_input = self.mask_check.images
        target = None if settings.decision is None else settings.decision.target
        self.stops = StopLedger(store, settings.early_stop, settings.metric, settings.ratios, target)
        self.costs = CostModel(model, data.example_input)  # MACs/params of the dense model and of each variant
        self.eager = EagerExecutor(model, self.device)
        self.physical = PhysicalExecutor(model, data.example_input, self.device)
        self.passes = Passes(
            data.batches, data.evaluate, self.device, data.calibration if settings.adaptive_bn else None,
            settings.progress,
        )  # fmt: skip
        self._ranking = (settings.criterion, settings.group_reduction)

    # The run
    def run(self, params: Sequence[PrunableUnit]) -> EngineReport:
        """Evaluate every missing (unit, ratio) of ``params``; return what was done."""
        approximation = self.measure_approximation() if is_approximate(self.settings.numerics) else None
        baseline = self.measure_baseline()
        if approximation is not None:
            self.record_loss_shift(approximation, baseline)
        self.store.set_cost(self.costs.dense.as_dict())
        report = EngineReport(baseline=baseline)
        pending = {p.name: self.stops.pending(p.name) for p in params}
        total = sum(len(v) for v in pending.values())
        if total == 0:
            if params:
                logger.info("Nothing to evaluate: every (unit, ratio) is already in %s.", self.store.path)
            return report
        logger.info("Evaluating %d variant(s) of %d unit(s).", total, sum(bool(v) for v in pending.values()))
        with (
            logging_redirect_tqdm(loggers=[logging.getLogger("analysis")]),
            progress_bar(self.settings.progress, total=total, desc="sensitivity", unit="variant",
                         dynamic_ncols=True) as bar,
        ):  # fmt: skip
            self.run_units(params, pending, RunState(baseline, report, bar))
        return report

    def run_units(self, params: Sequence[PrunableUnit], pending: Mapping[str, list[float]], state: RunState) -> None:
        """Prepare each unit and evaluate its pending ratios: eagerly or on physical copies right away, one unit a
        pass; on the suffix executor after checking every suffix, in chunks of units sharing each pass."""
        if self.suffix is not None:
            self.suffix.runner.profile(self.check_input, repeats=1)
        suffix_jobs: list[Job] = []
        for param in params:
            ratios = [r for r in pending[param.name] if not self.store.has(param.name, r)]
            state.bar.update(len(pending[param.name]) - len(ratios))  # variants filled in by a coupled unit
            prepared = self.prepare(param, ratios, state) if ratios else None
            job = None if prepared is None else self._job(prepared, ratios, state)
            if job is None:
                continue
            executor = self._executor(job)
            if executor is self.suffix:
                suffix_jobs.append(job)
            else:
                self._evaluate(executor, [job], state)
        if self.suffix is not None and suffix_jobs:
            self._evaluate(self.suffix, self._checked(self.suffix, suffix_jobs, state), state)

    def _evaluate(self, executor: VariantExecutor, jobs: Sequence[Job], state: RunState) -> None:
        """Evaluate ``jobs`` with ``executor`` in chunks (one pass over the data and one save each)."""
        recorder = _RunRecorder(self, state)
        for chunk in executor.chunks(jobs, float(state.baseline.get("seconds", 1.0))):
            start = time.perf_counter()
            try:
                self.sampler.run(chunk, executor, self.passes, recorder)
            finally:
                executor.release(chunk)
            variants, seconds = sum(len(job.variants) for job in chunk), time.perf_counter() - start
            logger.debug("Chunk of %d unit(s) on the %s executor: %d variants in %.1f s.", len(chunk),
                         executor.kind.value, variants, seconds)  # fmt: skip

    def _job(self, prepared: Prepared, ratios: Sequence[float], state: RunState) -> Job | None:
        """The unit's variants to evaluate (increasing ratio); variants that remove nothing get the baseline's
        metrics right away. None when nothing is left to evaluate."""
        variants: list[Variant] = []
        for position, ratio in enumerate(sorted(ratios)):
            if self.store.has(prepared.param.name, ratio):
                continue
            if not prepared.removal[ratio]:  # removes nothing: the baseline's metrics
                variant = Variant(ratio, [], self.scoring.sums(self.dense))
                if self.record(prepared, variant, without_timing(state.baseline), state, 0.0, Executor.BASELINE):
                    state.bar.update(len(ratios) - position - 1)
                    return None
                continue
            physical = prepared.mode == "physical"
            variant = Variant(
                ratio,
                [] if physical else variant_slices(self.model, self.graph, prepared, ratio),
                self.scoring.sums(self.dense),
                batchnorm=Estimation(prepared.batchnorms) if self.settings.adaptive_bn and not physical else None,
            )
            self.sampler.track(variant, state.baseline)
            variants.append(variant)
        return Job(prepared, variants) if variants else None

    def _executor(self, job: Job) -> VariantExecutor:
        """The executor of a unit: physical copies where masking is not exact, else the suffix where it can run the
        unit (the job gets its plan), else eager."""
        prepared = job.prepared
        if prepared.mode == "physical":
            return self.physical
        if self.suffix is None:
            return self.eager
        plan = self.suffix.plan(prepared, *changed_layers(self.model, self.graph, prepared))
        if isinstance(plan, str):
            logger.info(
                "%s: evaluated with full forward passes (the fast engine's suffix cannot run it: %s); the numbers "
                "are the same, only slower.", prepared.param.name, plan,
            )  # fmt: skip
            return self.eager
        job.plan = plan
        return self.suffix

    def _checked(self, suffix: SuffixExecutor, jobs: list[Job], state: RunState) -> list[Job]:
        """Keep the jobs whose suffix run gives bit-identical logits to the full masked forward pass of their mode
        check (at the channels checked); the others are evaluated eagerly."""
        checked = []
        for job in jobs:
            channels = job.prepared.check.channels
            variant = next((v for v in job.variants if job.prepared.removal[v.ratio] == channels), None)
            if variant is not None:
                checked.append((job, variant))
        matches = suffix.matches(checked, self.check_input)
        kept = []
        for job in jobs:
            if matches.get(id(job), True):
                kept.append(job)
                continue
            logger.info("%s: the graph split differs from eager execution; evaluating it eagerly.",
                        job.prepared.param.name)  # fmt: skip
            job.plan = None
            self._evaluate(self.eager, [job], state)
        return kept

    def measure_approximation(self) -> NumericsRecord:
        """In a speed mode: how far it moves the dense model's logits (which sets the masked-versus-physical
        tolerance) and its exact baseline (to state how far it moves a loss), measured or read from the file's
        record, which keeps them."""
        mode, record = self.settings.numerics, self.store.numerics
        measure_approximation(self.model, self.data, self.check_input, mode, self.settings.metric, record)
        assert record.logit_noise is not None  # measured above when the file lacked it
        self.mask_check.tolerance = record.mask_tolerance = mask_tolerance(record.logit_noise)
        logger.warning(
            "Global.numerics is %s: every loss is approximate. On this model %s moves the dense model's logits by up "
            "to %.2g of the largest (masking is checked against removal within %.2g).",
            mode, mode, record.logit_noise, self.mask_check.tolerance,
        )  # fmt: skip
        return record

    def record_loss_shift(self, record: NumericsRecord, baseline: Metrics) -> None:
        """Store in ``record`` and say the loss the speed mode alone gives the dense model (when its exact baseline
        is known)."""
        exact, metric = record.exact_baseline, self.settings.metric
        if exact is None or metric not in exact or metric not in baseline:
            return
        record.loss_shift = shift = loss_shift(exact, baseline, metric, self.settings.metric_mode)
        logger.warning(
            "%s alone gives the dense model a loss of %+.4f against exact float32 (%s %.4f in float32, %.4f under "
            "%s); read the losses with that in mind.",
            self.settings.numerics, shift, metric, exact[metric], baseline[metric], self.settings.numerics,
        )  # fmt: skip

    def measure_baseline(self) -> Metrics:
        """The unpruned model's metrics: stored in the file (same model, data and settings), or measured now; always
        measured for a label-free metric, whose per-image reference outputs the file does not hold, and for a
        sampled run, which pairs every image with its baseline value."""
        paired = self.sampler.paired
        if paired is not None:
            assert self.data.batches is not None  # a sampler pairs images only when given batches
            start = time.perf_counter()
            labelled = ("top1", "top5", "ce") if self.scoring.labelled else ()
            paired.per_image = {key: torch.empty(paired.population, dtype=torch.float64) for key in labelled}
            batches = ordered_batches(self.data.batches, paired.order)
            metrics = self.dense_pass(batches, paired.population, paired.per_image)
            if self.scoring.label_free:
                paired.per_image[self.settings.metric] = self.scoring.dense_per_image(paired.population)
            paired.dense = self.dense
            metrics["seconds"] = round(time.perf_counter() - start, 3)
            self.store_baseline(metrics, self.sampler.note())
            return metrics
        if self.scoring.label_free:
            assert self.data.batches is not None  # checked by check_scoring
            start = time.perf_counter()
            metrics = self.dense_pass(indexed_batches(self.data.batches, self.device), image_count(self.data.batches))
            metrics["seconds"] = round(time.perf_counter() - start, 3)
            self.store_baseline(metrics)
            return metrics
        stored = self.store.baseline
        if stored is not None and self.settings.metric in stored:
            logger.info("Baseline (stored): %s", format_metrics(stored))
            return dict(stored)
        start = time.perf_counter()
        metrics = self.data.evaluate(self.model)
        metrics = {**metrics, "seconds": round(time.perf_counter() - start, 3)}
        self.store_baseline(metrics)
        return metrics

    def store_baseline(self, metrics: Metrics, note: str = "") -> None:
        """Check a measured baseline (finite, usable as a divisor) and store it."""
        check_finite(metrics, "baseline model")
        check_baseline(metrics[self.settings.metric], self.settings.metric, self.settings.metric_mode)
        self.store.set_baseline(metrics)
        logger.info("Baseline: %s%s", format_metrics(metrics), note)

    def dense_pass(
        self, batches: Iterable[IndexedBatch], images: int | None, per_image: dict[str, torch.Tensor] | None = None
    ) -> Metrics:
        """One pass of the unpruned model over ``batches`` (with sample indices), returning its metrics. For a
        label-free metric its outputs per image are kept in :attr:`dense`; with ``per_image`` (adaptive precision)
        each image's labelled values are written there by sample index.

        Args:
            batches: Images, labels and sample indices, in any order, each image once.
            images: Images in the pass when known (the dense outputs are then allocated once).
            per_image: ``top1``/``top5``/``ce`` tensors of every image to fill (data with labels only).
        """
        recorder = self.scoring.recorder(images) if self.scoring.label_free else None
        sums = MetricSums() if self.scoring.labelled else None
        count = 0
        with torch.inference_mode(), progress_bar(self.settings.progress, total=images, desc="dense",
                                                  unit="img", leave=False) as bar:  # fmt: skip
            for batch, labels, index in batches:
                logits = self.model(batch)
                if sums is not None:
                    sums.add(logits, labels)
                if sums is not None and per_image is not None:
                    for key, values in per_sample(logits, labels).items():
                        per_image[key][index] = values
                if recorder is not None:
                    recorder.add(logits, index)
                count += len(index)
                bar.update(len(index))
        if recorder is not None:
            self.dense = recorder.result()
        return self.scoring.baseline(self.dense, sums, count)

    # One param
    def prepare(self, param: PrunableUnit, ratios: Sequence[float], state: RunState) -> Prepared | None:
        """Rank the channels, choose them per ratio, check masking against physical pruning; None if skipped."""
        if self.settings.granularity == "element":
            prepared = prepare_elements(self.model, param, ratios, self.check_input)
            prepared.batchnorms = self._affected(prepared.conv, element=True)
            facts = ParamRecord(
                module=param.module_name,
                kind=param.kind,
                shape=list(param.shape),
                granularity="element",
                mode="element",
            )
            self.store.describe(param.name, facts)
            return prepared
        conv = self.model.get_submodule(param.module_name)  # the unit's root: conv, linear or attention module
        try:
            scores = channel_scores(self.model, self.graph, param, *self._ranking)
        except ValueError as error:
            self._skip(param, f"criterion {self.settings.criterion} not applicable: {error}", ratios, state)
            return None
        removal: dict[float, Sequence[int]] = {
            r: select_channels(scores, r, param.conv_blocks, self.settings.round_to) for r in ratios
        }
        if not any(removal.values()):
            blocks = f" in {len(param.conv_blocks)} conv groups" if param.conv_blocks else ""
            self._skip(param, f"no ratio removes a channel ({param.channels} channels{blocks})", ratios, state)
            return None
        batchnorms = self._affected(conv)
        check = self.mask_check.choose(param, max(removal.values(), key=len), batchnorms if self.settings.adaptive_bn
                                       else None)  # fmt: skip
        if check.mode is None:
            self._skip(param, f"physical pruning failed ({check.difference})", ratios, state)
            return None
        state.report.modes[param.name] = check.mode
        assert isinstance(check.difference, float)  # a number once a mode was chosen
        facts = ParamRecord(
            module=param.module_name,
            kind=param.kind,
            shape=list(param.shape),
            group=list(param.members),
            coupled_params=list(param.coupled_params),
            conv_groups=len(param.conv_blocks) or 1,
            mode=check.mode,
            mask_vs_physical_max_abs_diff=check.difference,
            round_to=self.settings.round_to if self.settings.round_to > 1 else None,
        )
        self.store.describe(param.name, facts)
        dense = self.costs.dense
        costs = {r: summarise(dense, self.costs.variant(self.graph, conv, ch)) for r, ch in removal.items() if ch}
        return Prepared(param, conv, removal, check.mode, self._sharing(param), check, costs, batchnorms=batchnorms)

    def record(
        self,
        prepared: Prepared,
        evaluated: Variant,
        metrics: Metrics,
        state: RunState,
        seconds: float,
        executor: Executor,
        settled: str | None = None,
    ) -> bool:
        """Turn a variant's metrics into its loss, save it under every sharing name, note what evaluated it
        (``executor``) in the report, log one line; return whether the early stop tripped or, with decision-driven
        sampling, the variant was decided above the target (the unit's larger ratios are then skipped).

        A sampled variant's estimate (adaptive precision, decision-driven sampling) supplies the loss estimated from
        paired differences and its interval; ``settled`` says how a decision ended (a variant evaluated on every image
        without an estimate is ``exact`` under decision-driven sampling). An ``exact`` loss is computed from the
        metrics, as an exact run computes it.
        """
        param, ratio, estimate = prepared.param, evaluated.ratio, evaluated.estimate
        check_finite(metrics, f"variant {param.name} at ratio {ratio}")
        metric = self.settings.metric
        if self.settings.decision is not None and estimate is None:
            settled = "exact"
        if estimate is None or settled == "exact":
            loss = relative_loss(state.baseline[metric], metrics[metric], metric, self.settings.metric_mode)
        else:
            loss = estimate.loss()
        variant = self._variant_record(prepared, ratio, loss, metrics, seconds, estimate)
        variant.settled = settled
        decided = self.stops.decided_above(loss, settled)
        tripped = self.stops.tripped(state.baseline, metrics)
        stopped = tripped or decided
        rule = self.stops.rule
        names = [n for n in prepared.names if not self.store.has(n, ratio)]
        if stopped:
            self.stops.mark(names, ratio, by_rule=tripped)
        self.store.record_variant(names, ratio, variant)
        state.report.evaluated += 1
        for name in names:
            state.report.executors.setdefault(name, {})[ratio] = executor
        state.bar.update(1)
        count, total = len(prepared.removal[ratio]), prepared.size
        logger.info(
            "%s @ %g: removed %d/%d %s%s, %s=%.4f, loss=%+.4f%s (%.1f s)%s",
            param.name, ratio, count, total, "weights" if prepared.element else UNIT_NOUNS[param.kind],
            " (physical)" if prepared.mode == "physical" else "", metric, metrics[metric], loss,
            _sampled(estimate, settled), seconds,
            f"; early stop ({rule.describe()}), larger ratios skipped" if rule is not None and stopped else
            "; above target_loss, larger ratios skipped" if decided else "",
        )  # fmt: skip
        return stopped

    def _variant_record(
        self,
        prepared: Prepared,
        ratio: float,
        loss: float,
        metrics: Metrics,
        seconds: float,
        estimate: PairedEstimate | None,
    ) -> VariantRecord:
        """What the sidecar keeps of one variant: its loss and metrics, what it removed, how long it took, its cost
        and, with adaptive precision, the interval of its estimated loss."""
        removed, element, cost = len(prepared.removal[ratio]), prepared.element, prepared.costs.get(ratio)
        interval = None if estimate is None else list(estimate.interval())
        return VariantRecord(
            loss=loss,
            metrics=dict(metrics),
            channels_removed=None if element else removed,
            channels=None if element else prepared.size,
            weights_zeroed=removed if element else None,
            weights=prepared.size if element else None,
            mode=prepared.mode,
            seconds=round(seconds, 3),
            macs=None if cost is None else cost.macs,
            params=None if cost is None else cost.params,
            macs_reduction=None if cost is None else cost.macs_reduction,
            params_reduction=None if cost is None else cost.params_reduction,
            interval=interval,
            samples=None if estimate is None else estimate.count,
            precision=None if estimate is None else self.settings.precision,
        )

    def _affected(self, module: nn.Module, element: bool = False) -> list[BatchNorm]:
        """With ``adaptive_bn``: the BatchNorm layers whose statistics a variant of ``module`` changes (the layers
        downstream of the group's members whose remaining outputs change; for element-wise pruning, of the layer)."""
        if not self.settings.adaptive_bn:
            return []
        sources = [module] if element else changed_sources(self.graph, full_group(self.graph, module))
        return downstream_batchnorms(self.graph, sources)

    def _sharing(self, param: PrunableUnit) -> list[str]:
        """Names recorded with this param's evaluation: with ``group_reduction: mean`` every coupled param in the
        analysis removes the same channels, so one evaluation serves them all."""
        if self.settings.group_reduction != "mean":
            return [param.name]
        return [param.name, *[n for n in param.coupled_params if n in self.store.model_order]]

    def _skip(self, param: PrunableUnit, reason: str, ratios: Sequence[float], state: RunState) -> None:
        logger.warning("%s is not analysed: %s.", param.name, reason)
        state.report.skipped[param.name] = reason
        self.store.mark_unprunable(param.name, reason)
        state.bar.update(len(ratios))


@dataclass
class _RunRecorder:
    """What the samplers report to during one run (:class:`~analysis.engine.samplers.Recorder`)."""

    engine: SensitivityEngine
    state: RunState

    def record(
        self, job: Job, variant: Variant, metrics: Metrics, seconds: float, executor: Executor, settled: str | None
    ) -> bool:
        stopped = self.engine.record(job.prepared, variant, metrics, self.state, seconds, executor, settled)
        job.stopped = job.stopped or stopped
        return stopped

    def skipped(self, count: int) -> None:
        self.state.bar.update(count)

    def stopped(self, job: Job) -> bool:
        return self.engine.stops.stop_ratio(job.prepared.param.name) is not None

    def recorded_losses(self, job: Job) -> Mapping[float, float]:
        return self.engine.store.sensitivities.get(job.prepared.param.name, {})

    def loss(self, metrics: Metrics) -> float:
        settings = self.engine.settings
        metric = settings.metric
        return relative_loss(self.state.baseline[metric], metrics[metric], metric, settings.metric_mode)


def _sampled(estimate: PairedEstimate | None, settled: str | None) -> str:
    """`` [above, 400 images]``: how a sampled loss was reached, for the log line (empty for an exact run)."""
    if estimate is None:
        return ""
    shown = f"{settled}, " if settled else ""
    return f" [{shown}{estimate.count} images]"


def check_scoring(scoring: PassMetrics, batches: bool) -> None:
    """Refuse a metric the data cannot give: a label-free one without batches (an eval function returns one number,
    not per-image outputs), or a labelled one on data without labels.

    Raises:
        UserError: Naming the metric and what to change.
    """
    if scoring.label_free and not batches:
        raise UserError(
            f"SensitivityAnalysis.metric {scoring.metric} compares each image with the unpruned model's output on it, "
            "so it needs the evaluation data as batches of (images, labels), not an eval function."
        )
    if not scoring.labelled and scoring.metric not in LABEL_FREE_METRICS:
        raise UserError(
            f"SensitivityAnalysis.metric {scoring.metric} needs labels and the evaluation data has none "
            "(Global.labels: none); use SensitivityAnalysis.metric: agreement or kl."
        )

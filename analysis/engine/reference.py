"""The sensitivity loop (reference engine): for each prunable conv and ratio, remove channels, evaluate, record.

One unit of work is one (param, ratio) variant: its channels are chosen with the criterion, removed from the
whole coupled group (by masking, or on a physically pruned copy where masking is not exact, see
:mod:`analysis.engine._modes`), the model is evaluated, and ``loss = (baseline - metric) / baseline`` is saved
before the next unit starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch_pruning as tp
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from analysis.config import LABEL_FREE_METRICS
from analysis.engine._adaptive import PairedEstimate, per_sample
from analysis.engine._early_stop import StopLedger
from analysis.engine._modes import MaskCheck
from analysis.engine._variants import Prepared, changed_layers, prepare_elements, variant_slices
from analysis.engine.batchnorm import (
    BatchNorm,
    changed_sources,
    downstream_batchnorms,
    layers_in_copy,
    reestimate,
    reestimated,
)
from analysis.engine.evaluate import MetricSums
from analysis.engine.fidelity import DenseOutputs, IndexedBatch, PassMetrics, image_count, indexed_batches
from analysis.engine.loss import check_baseline, check_finite, format_metrics, relative_loss, without_timing
from analysis.engine.settings import AnalysisData, EngineSettings, Metrics
from analysis.errors import UserError
from analysis.io.sidecar import ParamRecord, VariantRecord
from analysis.io.store import AnalysisStore
from analysis.progress import progress_bar
from analysis.structure.criteria import channel_scores, select_channels
from analysis.structure.flops import CostModel, summarise
from analysis.structure.groups import PrunableParam, full_group
from analysis.structure.masking import Slice, zeroed
from analysis.structure.physical import pruned_copy

logger = logging.getLogger(__name__)

UNIT_NOUNS = {"conv": "channels", "linear": "neurons", "heads": "heads"}
"""What a variant of each kind of unit removes, for the log."""


class Executor(Enum):
    """What computed a variant's metrics in a run (kept in :attr:`EngineReport.executors`), so that a caller (and a
    test comparing the engines) knows which path really evaluated it rather than which engine was asked for."""

    FX_SUFFIX = "fx suffix"
    """The fast engine: the variant's graph suffix, run from the unpruned prefix shared by every variant."""
    EAGER = "eager"
    """The reference path: one full forward pass of the model with the variant's slices zeroed."""
    PHYSICAL = "physical"
    """One full forward pass of a physically pruned copy (masking is not exact for the group)."""
    BASELINE = "baseline"
    """Nothing evaluated: the variant removes nothing, its metrics are the baseline's."""


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
    """Runs the (param, ratio) units of one analysis, resuming from and saving to an :class:`AnalysisStore`.

    Engines that evaluate differently (:class:`~analysis.engine.fast.FastSensitivityEngine`) override
    :meth:`measure_baseline` and :meth:`run_params` and build on :meth:`prepare`, :meth:`evaluate_variant`,
    :meth:`dense_pass`, :meth:`record`, :meth:`slices` and :meth:`changed_layers`; nothing else of this class is
    their business.

    With a label-free metric (``agreement``, ``kl``) every pass compares each image with the dense model's output
    on it, kept by the baseline pass (:attr:`dense`); the data's evaluator is then not used, the batches are.

    Args:
        model: The model, in eval mode on its device.
        data: What variants are evaluated on (``data.calibration`` is needed with ``settings.adaptive_bn``).
        graph: The dependency graph of ``model``.
        settings: Ratios, criterion, metric.
        store: Where results go.
    """

    def __init__(
        self,
        model: nn.Module,
        data: AnalysisData,
        graph: tp.DependencyGraph,
        settings: EngineSettings,
        store: AnalysisStore,
    ) -> None:
        if settings.adaptive_bn and data.calibration is None:
            raise ValueError("adaptive_bn needs calibration batches")
        self.model, self.data, self.graph, self.settings, self.store = model, data, graph, settings, store
        self.device = data.example_input.device
        self.scoring = PassMetrics(settings.metric, labelled=bool(getattr(data.batches, "labelled", True)))
        check_scoring(self.scoring, data.batches is not None)
        self.dense: DenseOutputs | None = None  # the dense model's outputs per image, for a label-free metric
        self.mask_check = MaskCheck(model, graph, data.example_input)
        self.check_input = self.mask_check.images
        target = None if settings.decision is None else settings.decision.target
        self.stops = StopLedger(store, settings.early_stop, settings.metric, settings.ratios, target)
        self.costs = CostModel(model, data.example_input)  # MACs/params of the dense model and of each variant
        self._ranking = (settings.criterion, settings.group_reduction)

    # The run
    def run(self, params: Sequence[PrunableParam]) -> EngineReport:
        """Evaluate every missing (param, ratio) of ``params``; return what was done."""
        baseline = self.measure_baseline()
        self.store.set_cost(self.costs.dense.as_dict())
        report = EngineReport(baseline=baseline)
        pending = {p.name: self.stops.pending(p.name) for p in params}
        total = sum(len(v) for v in pending.values())
        if total == 0:
            if params:
                logger.info("Nothing to evaluate: every (param, ratio) is already in %s.", self.store.path)
            return report
        logger.info("Evaluating %d variant(s) of %d unit(s).", total, sum(bool(v) for v in pending.values()))
        with (
            logging_redirect_tqdm(loggers=[logging.getLogger("analysis")]),
            progress_bar(self.settings.progress, total=total, desc="sensitivity", unit="variant",
                         dynamic_ncols=True) as bar,
        ):  # fmt: skip
            self.run_params(params, pending, RunState(baseline, report, bar))
        return report

    def run_params(self, params: Sequence[PrunableParam], pending: Mapping[str, list[float]], state: RunState) -> None:
        """Evaluate each param's pending ratios, one full pass over the data per variant."""
        for param in params:
            ratios = [r for r in pending[param.name] if not self.store.has(param.name, r)]
            state.bar.update(len(pending[param.name]) - len(ratios))  # units filled in by a coupled param
            if ratios:
                prepared = self.prepare(param, ratios, state)
                if prepared is not None:
                    self.evaluate_ratios(prepared, ratios, state)

    def evaluate_ratios(self, prepared: Prepared, ratios: Sequence[float], state: RunState) -> None:
        """Evaluate and record ``prepared`` at each ratio in increasing order, until its early stop trips."""
        for ratio in sorted(ratios):
            if self.store.has(prepared.param.name, ratio):
                continue
            start = time.perf_counter()
            removes = bool(prepared.removal[ratio])
            metrics = self.evaluate_variant(prepared, ratio) if removes else without_timing(state.baseline)
            executor = self.executor(prepared) if removes else Executor.BASELINE
            if self.record(prepared, ratio, metrics, state, time.perf_counter() - start, executor=executor):
                state.bar.update(sum(not self.store.has(prepared.param.name, r) for r in ratios if r > ratio))
                return

    def measure_baseline(self) -> Metrics:
        """The unpruned model's metrics: stored in the file (same model, data and settings), or measured now; always
        measured for a label-free metric, whose per-image reference outputs the file does not hold."""
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

    def evaluate_model(self, model: nn.Module) -> Metrics:
        """The metrics of ``model`` (the network or a variant of it): the data's evaluator, or for a label-free
        metric one pass over the batches comparing each image with the dense output kept for it."""
        if not self.scoring.label_free:
            return self.data.evaluate(model)
        assert self.data.batches is not None  # checked by check_scoring
        sums = self.scoring.sums(self.dense)
        total = image_count(self.data.batches)
        with torch.inference_mode(), progress_bar(self.settings.progress, total=total, desc="eval",
                                                  unit="img", leave=False) as bar:  # fmt: skip
            for images, labels, index in indexed_batches(self.data.batches, self.device):
                sums.add(model(images), labels, index)
                bar.update(len(index))
        return sums.metrics()

    # One param
    def prepare(self, param: PrunableParam, ratios: Sequence[float], state: RunState) -> Prepared | None:
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

    def slices(self, prepared: Prepared, ratio: float) -> list[Slice]:
        """The ``(tensor, index)`` slices zeroed by one variant."""
        return variant_slices(self.model, self.graph, prepared, ratio)

    def changed_layers(self, prepared: Prepared) -> tuple[list[nn.Module], list[torch.Tensor]]:
        """The modules and bare parameters a variant of ``prepared`` changes."""
        return changed_layers(self.model, self.graph, prepared)

    @staticmethod
    def executor(prepared: Prepared) -> Executor:
        """How :meth:`evaluate_variant` evaluates a variant of ``prepared``: eagerly with its slices zeroed (mask,
        element) or on a physically pruned copy."""
        return Executor.EAGER if prepared.mode in ("mask", "element") else Executor.PHYSICAL

    def evaluate_variant(self, prepared: Prepared, ratio: float) -> Metrics:
        """Evaluate one variant: zero its slices in place (mask, element) or evaluate a physically pruned copy."""
        calibration = self.data.calibration or ()
        if self.executor(prepared) is Executor.EAGER:
            with zeroed(self.slices(prepared, ratio)), reestimated(self.model, prepared.batchnorms, calibration):
                return self.evaluate_model(self.model)
        channels = prepared.removal[ratio]
        copy = pruned_copy(self.model, prepared.param.module_name, channels, self.data.example_input).to(self.device)
        reestimate(copy, layers_in_copy(self.model, copy, prepared.batchnorms), calibration)
        return self.evaluate_model(copy)

    def record(
        self,
        prepared: Prepared,
        ratio: float,
        metrics: Metrics,
        state: RunState,
        seconds: float,
        estimate: PairedEstimate | None = None,
        settled: str | None = None,
        *,
        executor: Executor,
    ) -> bool:
        """Turn a variant's metrics into its loss, save it under every sharing name, note what evaluated it
        (``executor``) in the report, log one line; return whether the early stop tripped or, with decision-driven
        sampling, the variant was decided above the target (the param's larger ratios are then skipped).

        ``estimate`` (adaptive precision, decision-driven sampling) supplies the loss estimated from paired
        differences and its interval; ``settled`` says how a decision ended (a variant evaluated on every image
        without an estimate is ``exact`` under decision-driven sampling). An ``exact`` loss is computed from the
        metrics, as an exact run computes it.
        """
        param = prepared.param
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

    def _sharing(self, param: PrunableParam) -> list[str]:
        """Names recorded with this param's evaluation: with ``group_reduction: mean`` every coupled param in the
        analysis removes the same channels, so one evaluation serves them all."""
        if self.settings.group_reduction != "mean":
            return [param.name]
        return [param.name, *[n for n in param.coupled_params if n in self.store.model_order]]

    def _skip(self, param: PrunableParam, reason: str, ratios: Sequence[float], state: RunState) -> None:
        logger.warning("%s is not analysed: %s.", param.name, reason)
        state.report.skipped[param.name] = reason
        self.store.mark_unprunable(param.name, reason)
        state.bar.update(len(ratios))


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

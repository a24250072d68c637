"""The sensitivity loop (reference engine): for each prunable conv and ratio, remove channels, evaluate, record.

One unit of work is one (param, ratio) variant: its channels are chosen with the criterion, removed from the
whole coupled group (by masking, or on a physically pruned copy where masking is not exact), the model is
evaluated, and ``loss = (baseline - metric) / baseline`` is saved before the next unit starts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from analysis.cli._logs import progress_disabled
from analysis.engine._early_stop import EarlyStop
from analysis.engine.batchnorm import (
    BatchNorm,
    changed_sources,
    downstream_batchnorms,
    layers_in_copy,
    reestimate,
    reestimated,
)
from analysis.errors import UserError
from analysis.io._store import AnalysisStore
from analysis.structure.criteria import CRITERIA, bn_scale, select_channels
from analysis.structure.elementwise import element_slices, magnitude_order, weights_to_zero
from analysis.structure.flops import CostModel, cost_summary
from analysis.structure.groups import PrunableParam, full_group, is_out_channel_item, removal_group
from analysis.structure.masking import masked, zeroed, zeroed_slices
from analysis.structure.physical import pruned_copy

logger = logging.getLogger(__name__)

Metrics = dict[str, float]
Evaluator = Callable[[nn.Module], Metrics]
Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
LOWER_IS_BETTER = {"ce"}
CHECK_IMAGES = 4  # images on which masking is compared with physical pruning (the difference shows on any image)


@dataclass
class EngineSettings:
    """How variants are built and scored."""

    ratios: Sequence[float]
    criterion: str = "l1_norm"
    group_reduction: str = "self"
    metric: str = "top1"
    metric_mode: str = "relative"
    progress: bool | None = None
    engine: str = "fast"
    precision: float | None = None
    seed: int = 0
    granularity: str = "filter"
    early_stop: EarlyStop | None = None
    round_to: int = 1
    adaptive_bn: bool = False


@dataclass
class ModeCheck:
    """How a param is evaluated: ``mask``, ``physical``, or None (physical pruning failed, ``difference`` says why);
    with the masked logits of the check images at the channels checked, which the fast engine compares against."""

    mode: str | None
    difference: float | str
    channels: Sequence[int] = field(default_factory=list)
    masked_logits: torch.Tensor | None = None


@dataclass
class Prepared:
    """A param ready to evaluate: its layer, the channels each ratio removes, how (mask/physical/element), and the
    names its results are recorded under (several when coupled params share the evaluation).

    With ``granularity: element`` the layer is the weight's module, ``removal[ratio]`` is ``range(k)`` and the
    weights zeroed are the first ``k`` of ``element_order`` (ascending magnitude)."""

    param: PrunableParam
    conv: nn.Module
    removal: dict[float, Sequence[int]]
    mode: str
    names: list[str]
    check: ModeCheck
    costs: dict[float, dict[str, Any]] = field(default_factory=dict)
    element_order: torch.Tensor | None = None
    batchnorms: list[BatchNorm] = field(default_factory=list)


@dataclass
class EngineReport:
    """What a run did: the baseline, evaluated units, and params that were skipped with their reasons."""

    baseline: Metrics
    evaluated: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)


def check_baseline(baseline: float, metric: str, mode: str = "relative") -> None:
    """Refuse a baseline from which relative losses cannot be computed.

    Raises:
        UserError: If ``mode`` is relative and the baseline metric is 0.
    """
    if mode == "relative" and baseline == 0:
        raise UserError(
            f"The baseline {metric} is 0, so a relative loss is undefined (the model looks untrained or the labels "
            "do not match it); check the model and data, or set SensitivityAnalysis.metric_mode: absolute."
        )


def relative_loss(baseline: float, value: float, metric: str, mode: str = "relative") -> float:
    """Loss of ``value`` against ``baseline``: positive when pruning made the metric worse.

    ``relative`` divides by the baseline (PaddleSlim's definition); ``absolute`` keeps the plain difference.
    """
    worse_by = value - baseline if metric in LOWER_IS_BETTER else baseline - value
    if mode == "absolute":
        return worse_by
    check_baseline(baseline, metric, mode)
    return worse_by / abs(baseline)


def check_finite(metrics: Mapping[str, float], what: str) -> None:
    """Refuse NaN/inf metrics, which would make every loss meaningless."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise UserError(
            f"The {what} produced non-finite {', '.join(bad)} (NaN/inf logits); check the model's weights and input "
            "preprocessing (Global.mean/std) before analysing it."
        )


def channel_scores(
    model: nn.Module, graph: tp.DependencyGraph, param: PrunableParam, settings: EngineSettings
) -> torch.Tensor:
    """Importance of each output channel of ``param`` (low = removed first).

    ``group_reduction: self`` ranks on the conv's own weight (or its BatchNorm for ``bn_scale``); ``mean``
    averages over every conv (or BatchNorm) whose output channels are in the group, mapped to the root's channels.
    """
    conv = model.get_submodule(param.module_name)
    if settings.group_reduction == "self":
        if settings.criterion == "bn_scale":
            if param.bn_name is None:
                raise ValueError(f"{param.name} has no BatchNorm after it")
            return bn_scale(model.get_submodule(param.bn_name).weight)
        return CRITERIA[settings.criterion](conv.weight)
    total = torch.zeros(param.channels, dtype=torch.float64)
    count = torch.zeros(param.channels, dtype=torch.float64)
    for item in full_group(graph, conv):
        module = item.dep.target.module
        if not is_out_channel_item(graph, item):
            continue
        if settings.criterion == "bn_scale":
            if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.weight is None:
                continue
            scores = bn_scale(module.weight)
        elif isinstance(module, nn.Conv2d):
            scores = CRITERIA[settings.criterion](module.weight)
        else:
            continue
        local = torch.tensor(list(item.idxs))
        root = torch.tensor(list(item.root_idxs))
        total.index_add_(0, root, scores.double().cpu()[local])
        count.index_add_(0, root, torch.ones(len(root), dtype=torch.float64))
    if not bool((count > 0).all()):
        raise ValueError(f"{param.name}: some channels have no {settings.criterion} score in the group")
    return (total / count).float()


class SensitivityEngine:
    """Runs the (param, ratio) units of one analysis, resuming from and saving to an :class:`AnalysisStore`.

    Args:
        model: The model, in eval mode on its device.
        evaluate: Returns the metrics of a model (keys include ``settings.metric``).
        example_input: A batch used to trace dependencies (one sample is used) and to check masking against
            physical pruning (the whole batch is used).
        graph: The dependency graph of ``model``.
        settings: Ratios, criterion, metric.
        store: Where results go.
        calibration: Batches on which ``settings.adaptive_bn`` re-estimates the affected BatchNorm statistics of
            every variant before it is evaluated.
    """

    def __init__(
        self,
        model: nn.Module,
        evaluate: Evaluator,
        example_input: torch.Tensor,
        graph: tp.DependencyGraph,
        settings: EngineSettings,
        store: AnalysisStore,
        calibration: Batches | None = None,
    ) -> None:
        if settings.adaptive_bn and calibration is None:
            raise ValueError("adaptive_bn needs calibration batches")
        self.model = model
        self.calibration = calibration
        self.evaluate = evaluate
        self.example_input = example_input
        self.check_input = example_input[:CHECK_IMAGES]
        self.graph = graph
        self.settings = settings
        self.store = store
        self.device = example_input.device
        self.costs = CostModel(model, example_input)  # MACs/params of the dense model and of each pruned variant

    def run(self, params: Sequence[PrunableParam]) -> EngineReport:
        """Evaluate every missing (param, ratio) of ``params``; return what was done."""
        baseline = self._baseline()
        self.store.set_cost(self.costs.dense.as_dict())
        report = EngineReport(baseline=baseline)
        pending = {p.name: self._pending(p.name) for p in params}
        total = sum(len(v) for v in pending.values())
        if total == 0:
            if params:
                logger.info("Nothing to evaluate: every (param, ratio) is already in %s.", self.store.path)
            return report
        logger.info("Evaluating %d variant(s) of %d conv weight(s).", total, sum(bool(v) for v in pending.values()))
        disable = self._progress_disabled()
        with (
            logging_redirect_tqdm(loggers=[logging.getLogger("analysis")]),
            tqdm(total=total, desc="sensitivity", unit="variant", disable=disable, dynamic_ncols=True) as bar,
        ):
            self._run_params(params, pending, baseline, report, bar)
        return report

    def _run_params(
        self,
        params: Sequence[PrunableParam],
        pending: dict[str, list[float]],
        baseline: Metrics,
        report: EngineReport,
        bar: tqdm,
    ) -> None:
        """Evaluate each param's pending ratios, one full pass over the data per variant."""
        for param in params:
            ratios = [r for r in pending[param.name] if not self.store.has(param.name, r)]
            if ratios:
                self._run_param(param, ratios, baseline, report, bar)
            bar.update(len(pending[param.name]) - len(ratios))  # units filled in by a coupled param

    def _pending(self, name: str) -> list[float]:
        """The ratios of ``name`` still to evaluate: not in the file, and not beyond a recorded early stop (the
        sidecar's ``early_stop`` entry is brought in line with the current rule, which may have changed)."""
        stopped_at = self.stop_ratio(name)
        info = self.store.sidecar["params"].get(name)
        if stopped_at is None and info is not None:
            info.pop("early_stop", None)
        elif stopped_at is not None:
            self._mark_early_stop([name], stopped_at)
        return [
            r for r in self.settings.ratios if not self.store.has(name, r) and (stopped_at is None or r <= stopped_at)
        ]

    def _mark_early_stop(self, names: Sequence[str], ratio: float) -> None:
        """Record in the sidecar that ``names`` stopped at ``ratio`` (and under which condition)."""
        assert self.settings.early_stop is not None
        condition = self.settings.early_stop.describe()
        for name in names:
            self.store.describe_param(name, {"early_stop": {"ratio": ratio, "condition": condition}})

    def stop_ratio(self, name: str) -> float | None:
        """The smallest recorded ratio of ``name`` whose metric trips the early stop (None: not stopped)."""
        stop, baseline, metric = self.settings.early_stop, self.store.baseline, self.settings.metric
        if stop is None or baseline is None or metric not in baseline:
            return None
        variants = (self.store.sidecar["params"].get(name) or {}).get("variants") or {}
        scores = {r: variants.get(f"{r:g}", {}).get(metric) for r in self.settings.ratios}
        base = float(baseline[metric])
        return min((r for r, v in scores.items() if v is not None and stop.tripped(base, float(v))), default=None)

    def _progress_disabled(self) -> bool:
        return progress_disabled(self.settings.progress)

    def _baseline(self) -> Metrics:
        stored = self.store.baseline
        if stored is not None and self.settings.metric in stored:
            logger.info("Baseline (stored): %s", format_metrics(stored))
            return dict(stored)
        start = time.perf_counter()
        metrics = self.evaluate(self.model)
        check_finite(metrics, "baseline model")
        check_baseline(metrics[self.settings.metric], self.settings.metric, self.settings.metric_mode)
        metrics = {**metrics, "seconds": round(time.perf_counter() - start, 3)}
        self.store.set_baseline(metrics)
        logger.info("Baseline: %s", format_metrics(metrics))
        return metrics

    def _run_param(
        self, param: PrunableParam, ratios: Sequence[float], baseline: Metrics, report: EngineReport, bar: tqdm
    ) -> None:
        prepared = self._prepare(param, ratios, report, bar)
        if prepared is None:
            return
        for position, ratio in enumerate(ratios):
            if self.store.has(param.name, ratio):
                continue
            channels = prepared.removal[ratio]
            start = time.perf_counter()
            metrics = self._evaluate_variant(prepared, ratio) if channels else _metrics_only(baseline)
            if self._record(prepared, ratio, metrics, baseline, time.perf_counter() - start, report, bar):
                bar.update(len(ratios) - position - 1)
                return

    def _prepare(
        self, param: PrunableParam, ratios: Sequence[float], report: EngineReport, bar: tqdm
    ) -> Prepared | None:
        """Rank the channels, choose them per ratio, check masking against physical pruning; None if skipped."""
        if self.settings.granularity == "element":
            return self._prepare_element(param, ratios)
        conv = self.model.get_submodule(param.module_name)
        try:
            scores = channel_scores(self.model, self.graph, param, self.settings)
        except ValueError as error:
            self._skip(param, f"criterion {self.settings.criterion} not applicable: {error}", report, bar, ratios)
            return None
        removal = {r: select_channels(scores, r, param.conv_blocks, self.settings.round_to) for r in ratios}
        if not any(removal.values()):
            blocks = f" in {len(param.conv_blocks)} conv groups" if param.conv_blocks else ""
            self._skip(param, f"no ratio removes a channel ({param.channels} channels{blocks})", report, bar, ratios)
            return None
        check = self._choose_mode(param, max(removal.values(), key=len))
        mode, difference = check.mode, check.difference
        if mode is None:
            self._skip(param, f"physical pruning failed ({difference})", report, bar, ratios)
            return None
        report.modes[param.name] = mode
        self.store.describe_param(param.name, {
            "module": param.module_name, "shape": list(param.shape), "group": param.members,
            "coupled_params": param.coupled_params, "conv_groups": len(param.conv_blocks) or 1, "mode": mode,
            "mask_vs_physical_max_abs_diff": difference,
            **({"round_to": self.settings.round_to} if self.settings.round_to > 1 else {}),
        })  # fmt: skip
        dense = self.costs.dense
        costs = {r: cost_summary(dense, self.costs.variant(self.graph, conv, ch)) for r, ch in removal.items() if ch}
        return Prepared(param, conv, removal, mode, self._sharing(param), check, costs, batchnorms=self._affected(conv))

    def _affected(self, module: nn.Module, element: bool = False) -> list[BatchNorm]:
        """With ``adaptive_bn``: the BatchNorm layers whose statistics a variant of ``module`` changes (the layers
        downstream of the group's members whose remaining outputs change; for element-wise pruning, of the layer)."""
        if not self.settings.adaptive_bn:
            return []
        sources = [module] if element else changed_sources(self.graph, full_group(self.graph, module))
        return downstream_batchnorms(self.graph, sources)

    def _prepare_element(self, param: PrunableParam, ratios: Sequence[float]) -> Prepared:
        """Element-wise: order the weights by magnitude; zeroing them is the operation itself, so it is exact."""
        module = self.model.get_submodule(param.module_name)
        weight = self.model.get_parameter(param.name)
        order = magnitude_order(weight)
        removal = {r: range(weights_to_zero(weight.numel(), r)) for r in ratios}
        largest = max(removal.values(), key=len)
        with zeroed(element_slices(weight, order[: len(largest)])), torch.inference_mode():
            masked_logits = self.model(self.check_input)
        self.store.describe_param(param.name, {"module": param.module_name, "shape": list(param.shape),
                                               "granularity": "element", "mode": "element"})  # fmt: skip
        check = ModeCheck("element", 0.0, largest, masked_logits)
        return Prepared(param, module, removal, "element", [param.name], check, element_order=order,
                        batchnorms=self._affected(module, element=True))  # fmt: skip

    def variant_slices(self, prepared: Prepared, ratio: float) -> list[tuple[torch.Tensor, Any]]:
        """The ``(tensor, index)`` slices zeroed by one variant (a channel group, or the smallest weights)."""
        if prepared.element_order is not None:
            weight = self.model.get_parameter(prepared.param.name)
            return element_slices(weight, prepared.element_order[: len(prepared.removal[ratio])])
        return zeroed_slices(self.graph, removal_group(self.graph, prepared.conv, prepared.removal[ratio]))

    def changed_layers(self, prepared: Prepared) -> tuple[list[nn.Module], list[torch.Tensor]]:
        """The modules and bare parameters a variant of ``prepared`` changes (where the fast engine's suffix starts)."""
        if prepared.element_order is not None:
            return [prepared.conv], [self.model.get_parameter(prepared.param.name)]
        members = [item.dep.target.module for item in full_group(self.graph, prepared.conv)]
        return [m for m in members if isinstance(m, nn.Module)], [m for m in members if isinstance(m, nn.Parameter)]

    def _record(
        self,
        prepared: Prepared,
        ratio: float,
        metrics: Metrics,
        baseline: Metrics,
        seconds: float,
        report: EngineReport,
        bar: tqdm,
        estimate: Mapping[str, Any] | None = None,
    ) -> bool:
        """Turn a variant's metrics into its loss, save it under every sharing name, log one line; return whether
        the early stop tripped (the param's larger ratios are then skipped).

        ``estimate`` (adaptive precision) supplies the loss estimated from paired differences and its interval.
        """
        param, channels = prepared.param, prepared.removal[ratio]
        check_finite(metrics, f"variant {param.name} at ratio {ratio}")
        metric = self.settings.metric
        if estimate is None:
            loss = relative_loss(baseline[metric], metrics[metric], metric, self.settings.metric_mode)
        else:
            loss = float(estimate["loss"])
        element = prepared.mode == "element"
        total = math.prod(param.shape) if element else param.channels
        removed = (
            {"weights_zeroed": len(channels), "weights": total}
            if element
            else {"channels_removed": len(channels), "channels": total}
        )
        details = {**metrics, **removed, "mode": prepared.mode, "seconds": round(seconds, 3),
                   **prepared.costs.get(ratio, {}), **(estimate or {})}  # fmt: skip
        stop = self.settings.early_stop
        stopped = stop is not None and stop.tripped(float(baseline[metric]), float(metrics[metric]))
        names = [n for n in prepared.names if not self.store.has(n, ratio)]
        if stopped:
            self._mark_early_stop(names, ratio)
        self.store.record(names, ratio, loss, details)
        report.evaluated += 1
        bar.update(1)
        logger.info(
            "%s @ %g: removed %d/%d %s%s, %s=%.4f, loss=%+.4f (%.1f s)%s",
            param.name, ratio, len(channels), total, "weights" if element else "channels",
            " (physical)" if prepared.mode == "physical" else "", metric, metrics[metric], loss, seconds,
            f"; early stop ({stop.describe()}), larger ratios skipped" if stopped else "",
        )  # fmt: skip
        return stopped

    def _sharing(self, param: PrunableParam) -> list[str]:
        """Names recorded with this param's evaluation: with ``group_reduction: mean`` every coupled param in the
        analysis removes the same channels, so one evaluation serves them all."""
        if self.settings.group_reduction != "mean":
            return [param.name]
        return [param.name, *[n for n in param.coupled_params if n in self.store.model_order]]

    def _evaluate_variant(self, prepared: Prepared, ratio: float) -> Metrics:
        """Evaluate one variant: zero its slices in place (mask, element) or evaluate a physically pruned copy."""
        if prepared.mode in ("mask", "element"):
            with zeroed(self.variant_slices(prepared, ratio)), reestimated(self.model, prepared.batchnorms,
                                                                          self.calibration or ()):  # fmt: skip
                return self.evaluate(self.model)
        channels = prepared.removal[ratio]
        copy = pruned_copy(self.model, prepared.param.module_name, channels, self.example_input).to(self.device)
        reestimate(copy, layers_in_copy(self.model, copy, prepared.batchnorms), self.calibration or ())
        return self.evaluate(copy)

    def _choose_mode(self, param: PrunableParam, channels: Sequence[int]) -> ModeCheck:
        """Compare masked and physically pruned logits on a few images; masking is used only when they agree."""
        conv = self.model.get_submodule(param.module_name)
        try:
            copy = pruned_copy(self.model, param.module_name, channels, self.example_input).to(self.device)
            with torch.inference_mode():
                physical = copy(self.check_input).float()
        except Exception as error:  # Torch-Pruning cannot remove these channels: report it, do not guess
            logger.debug("Physical pruning of %s failed", param.name, exc_info=True)
            text = str(error).splitlines()[0][:200] if str(error) else ""
            return ModeCheck(None, f"{type(error).__name__}: {text}")
        group = removal_group(self.graph, conv, channels)
        with masked(self.graph, group), torch.inference_mode():
            masked_logits = self.model(self.check_input)
        difference = float((masked_logits.float() - physical).abs().max())
        tolerance = 1e-4 * max(1.0, float(physical.abs().max()))
        if difference <= tolerance and self.settings.adaptive_bn:
            difference = max(difference, self._calibrated_difference(copy, group, self._affected(conv)))
        if difference <= tolerance:
            return ModeCheck("mask", difference, list(channels), masked_logits)
        logger.info(
            "%s: masking differs from physical pruning by %.3g (channel-normalising layer or f(0) != 0 in its "
            "group); evaluating it on physically pruned copies.", param.name, difference,
        )  # fmt: skip
        return ModeCheck("physical", difference, list(channels))

    def _calibrated_difference(self, copy: nn.Module, group: Any, layers: Sequence[BatchNorm]) -> float:
        """Largest logit difference between the masked model and the physically pruned ``copy`` after both
        re-estimate the affected BatchNorm statistics on the example batch (train-mode statistics must agree too)."""
        example = [(self.example_input, None)]
        with masked(self.graph, group), reestimated(self.model, layers, example), torch.inference_mode():
            masked_logits = self.model(self.check_input).float()
        reestimate(copy, layers_in_copy(self.model, copy, layers), example)
        with torch.inference_mode():
            return float((masked_logits - copy(self.check_input).float()).abs().max())

    def _skip(
        self, param: PrunableParam, reason: str, report: EngineReport, bar: tqdm, ratios: Sequence[float]
    ) -> None:
        logger.warning("%s is not analysed: %s.", param.name, reason)
        report.skipped[param.name] = reason
        self.store.mark_unprunable(param.name, reason)
        bar.update(len(ratios))


def _metrics_only(metrics: Metrics) -> Metrics:
    """The metrics of an unchanged model (a ratio that removes no channel): the baseline without its timing."""
    return {k: v for k, v in metrics.items() if k != "seconds"}


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``top1=0.9867 top5=1.0000 ce=0.0934`` (the metrics present, in that order)."""
    return " ".join(f"{k}={metrics[k]:.4f}" for k in ("top1", "top5", "ce", "score") if k in metrics)

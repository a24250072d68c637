"""Budget plans: per-group pruning ratios that reach a MACs, params or latency reduction (or several at once) with
the least predicted loss.

The analysis file gives each param's loss at the measured ratios. A group of coupled params (a residual chain)
can only lose one set of channels, so it is one decision with one ratio; its options are every channel count from
0 up to the largest count measured, each ranked by the member whose measured curve predicts the smallest loss
there (curves are interpolated linearly in the channel count and never extrapolated). What a group saves alone is
exact at the measured counts (:class:`~analysis.structure.flops.CostModel`) and linear in between.
:func:`~analysis.planning.ratios.allocate` picks the options; the plan's MACs and params are then computed exactly
for all groups pruned at once. A summed prediction outside the range a loss of its metric can take (or, for an
unbounded metric, beyond every measured single-layer loss) gets a notice (:func:`prediction_notice`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from analysis.config import check_choice
from analysis.engine.loss import divides_by_baseline
from analysis.errors import AnalysisFileError, ConfigError, UserError, did_you_mean
from analysis.inputs import arguments
from analysis.inputs.batches import ImageConversion, floating_dtype
from analysis.io.fingerprint import model_fingerprint
from analysis.io.record import AnalysisRecord, AnalysisSource, as_record
from analysis.io.results import sidecar_path
from analysis.io.sidecar import CostRecord, PlanGroupRecord, PlanRecord
from analysis.metrics import METRICS
from analysis.planning._curves import interpolate, monotone_curve
from analysis.planning.allocate import (
    Allocation,
    BudgetUnreachable,
    Choice,
    Constraint,
    GroupOptions,
    allocate,
    allocate_all,
    largest_choices,
)
from analysis.planning.latency import LatencyModel, LatencyOutcome
from analysis.ratio import normalise_ratio, ratio_problem
from analysis.structure.criteria import allowed_counts, channel_scores, lowest_channels, removal_count
from analysis.structure.flops import Cost, CostModel, ShapeDelta, cost_summary
from analysis.structure.groups import (
    PrunableUnit,
    describe_units,
    eval_mode,
    execution_order,
    removal_group,
)
from analysis.structure.physical import model_graph

logger = logging.getLogger(__name__)

MEASURES = ("macs", "params", "latency")
ALIGNED_CHANNELS = 8
"""Latency probes also try keeping a multiple of this many channels: on ONNX Runtime's CPU provider the demo ResNet
ran 15-25% slower at batch 1 with 2 of 16 or 3 of 32 channels removed, and as fast or faster with 8 of 16 or 16 of
32 removed (interleaved measurements), so a table of the analysed counts alone misses the counts that pay."""
ALIGNED_STEPS = 8
"""With ``latency_round_to: 1``, at most about this many aligned counts per group over all its channels (wide layers
step by a multiple of :data:`ALIGNED_CHANNELS`): each probe is a whole-model measurement."""
ALIGNED_PROBES = 2
"""With ``latency_round_to`` above 1, whole-model probes per group: its largest aligned count and evenly spaced ones
below it (a plan takes the aligned counts between them too, interpolated)."""


@dataclass
class PlannedGroup:
    """One pruned group of the plan.

    Attributes:
        members: The group's analysed params (model order); all get :attr:`ratio`.
        ranking_param: The member whose criterion ranks the channels (its curve predicted the loss).
        module_name: That member's conv.
        channels: Channels of the group.
        removed: Channel indices removed.
        predicted_loss: The ranking member's interpolated loss at this count.
    """

    members: list[str]
    ranking_param: str
    module_name: str
    channels: int
    removed: list[int]
    predicted_loss: float

    @property
    def ratio(self) -> float:
        """Fraction of the group's channels removed."""
        return normalise_ratio(len(self.removed) / self.channels)


@dataclass
class Plan:
    """Per-group ratios for a budget, with the predicted loss and the exact cost of the pruned model.

    Attributes:
        measure: ``macs`` or ``params``: what the target reduces.
        target: The reduction asked for (0.4 = 40% fewer).
        groups: The pruned groups, in model order.
        predicted_loss: Sum of the groups' predicted losses (each measured with that layer pruned alone).
        lower_bound: No plan reaching the target has a smaller summed predicted loss.
        dense: The unpruned model's cost.
        pruned: The cost with every group pruned at once (exact, ``macs`` convention).
        settings: Criterion and group reduction the channels are ranked with (the analysis file's).
        source: ``budget`` (allocated for :attr:`target`) or the ratios file the plan was read from.
        method: ``knapsack`` (allocated from the sensitivity curves), ``measured`` (improved with joint
            evaluations, see :mod:`analysis.planning.measured`), ``recovered`` (its finalists chosen after a brief
            recovery each) or ``ratios`` (applied as given).
        search: For ``measured``: what the search evaluated and measured (JSON-friendly).
        notice: Why the summed predicted loss predicts nothing (:func:`prediction_notice`); None when it may.
    """

    measure: str
    target: float | None
    groups: list[PlannedGroup]
    predicted_loss: float
    lower_bound: float
    dense: Cost
    pruned: Cost
    settings: dict[str, Any] = field(default_factory=dict)
    source: str = "budget"
    method: str = "knapsack"
    search: dict[str, Any] | None = None
    notice: str | None = None
    latency: LatencyOutcome | None = None
    budgets: dict[str, float] = field(default_factory=dict)
    """With combined budgets: every budget the plan meets, ``{measure: reduction}`` (its own first); else empty."""

    @property
    def ratios(self) -> dict[str, float]:
        """``{param: ratio}`` for every member of every pruned group (coupled params share their group's ratio); each
        group's ranking param comes first, so a tool applying the list in order (ACT, :func:`plan_from_ratios`)
        ranks the group's channels with it."""
        return {
            name: group.ratio
            for group in self.groups
            for name in [group.ranking_param, *[m for m in group.members if m != group.ranking_param]]
        }

    @property
    def reduction(self) -> float:
        """The reduction of :attr:`measure` the plan achieves (exact for MACs and params; measured for latency)."""
        return self.reduction_of(self.measure)

    def reduction_of(self, measure: str) -> float:
        """The reduction of ``measure`` the plan achieves (latency: measured, when it was)."""
        if measure == "latency":
            assert self.latency is not None, "a latency plan is measured"
            return self.latency.measured_reduction
        return cost_summary(self.dense, self.pruned)[f"{measure}_reduction"]

    def removals(self) -> list[tuple[str, list[int]]]:
        """``(conv module name, channels)`` to remove, one per pruned group, for physical pruning."""
        return [(group.module_name, group.removed) for group in self.groups]

    def record(self) -> PlanRecord:
        """The sidecar's record of this plan (``plan``)."""
        groups = [
            PlanGroupRecord(members=list(g.members), ranking_param=g.ranking_param, ratio=g.ratio,
                            channels=g.channels, channels_removed=len(g.removed),
                            predicted_loss=known_loss(g.predicted_loss))
            for g in self.groups
        ]  # fmt: skip
        summary = cost_summary(self.dense, self.pruned)
        return PlanRecord(
            measure=self.measure,
            target=self.target,
            source=self.source,
            method=self.method,
            method_description=self.describe_method(),
            predicted_loss=known_loss(self.predicted_loss),
            lower_bound=known_loss(self.lower_bound),
            prediction_notice=self.notice,
            dense=CostRecord.from_json(self.dense.as_dict(), "dense"),
            pruned=CostRecord(macs=self.pruned.macs, params=self.pruned.params),
            macs_reduction=summary["macs_reduction"],
            params_reduction=summary["params_reduction"],
            settings=self.settings,
            groups=groups,
            search=self.search,
            latency=None if self.latency is None else self.latency.as_dict(),
            budgets=dict(self.budgets) or None,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON form (as stored in the sidecar under ``plan``)."""
        return self.record().to_json()

    @property
    def gap(self) -> float:
        """How far the summed predicted loss can lie above the smallest one any plan meeting the budget can have."""
        return max(0.0, self.predicted_loss - self.lower_bound)

    def describe_method(self) -> str:
        """One sentence on how the plan was chosen and what its predicted loss is."""
        if self.method == "ratios":
            return "ratios as given; predicted loss = sum of the single-layer losses"
        knapsack = (
            "multiple-choice knapsack by dynamic programming over the monotone sensitivity curves; summed predicted "
            f"loss within {self.gap:.6g} of the smallest summed predicted loss any plan meeting the budget can have"
        )
        if self.method == "knapsack":
            return knapsack
        evaluations = (self.search or {}).get("evaluations", 0)
        measured = (
            f"started from the knapsack plan, improved with {evaluations} joint evaluations (all groups pruned at "
            "once, BatchNorm re-estimated); predicted loss = the loss measured for this plan"
        )
        if self.method == "recovered":
            probed = len((self.search or {}).get("probed", []))
            return (f"recovered: the measured search {measured.split('; ')[0]}, then its {probed} finalists each "
                    f"recovered briefly on the same batches and the best kept; {measured.split('; ')[1]} before "
                    "recovery")  # fmt: skip
        return f"measured: {measured}"


def prediction_notice(
    predicted: float, metric: str, mode: str, baseline: float | None, largest_measured: float
) -> str | None:
    """Why a summed predicted loss predicts nothing, or None while it stays where a loss of ``metric`` can be.

    A sum of single-layer losses is a guess that the losses add up. For a metric between 0 and 1 a loss above 1
    (relative) or above the baseline (absolute) cannot happen at all, so a sum there says only that the additive
    guess broke. Cross-entropy, KL divergence and an eval function's score have no such bound; for them the limit
    is the largest loss any single variant measured: a sum above it claims a model worse than any the analysis
    measured, which no measurement supports. Curves are floored at 0, so a sum is never below the range.
    """
    if not math.isfinite(predicted):
        return None  # a ratio beyond the analysed ones: said separately
    bounded = metric in METRICS and METRICS[metric].bounded  # a fraction: its loss cannot exceed 1 or the baseline
    if bounded and divides_by_baseline(metric, mode):
        ceiling, why = 1.0, f"a relative {metric} loss cannot exceed 1 ({metric} 0), so the losses cannot add up to it"
    elif bounded and baseline is not None:
        ceiling = baseline
        why = (f"an absolute {metric} loss cannot exceed the baseline {baseline:.4f} ({metric} 0), so the losses "
               "cannot add up to it")  # fmt: skip
    else:
        ceiling = largest_measured
        why = (f"{metric} has no upper bound, but no single layer pruned alone measured a loss above "
               f"{largest_measured:.4f} in the analysis, so nothing measured supports a sum this large")  # fmt: skip
    if predicted <= ceiling:
        return None
    return (
        f"the predicted loss {predicted:+.4f} (a sum of single-layer losses) lies outside the range where such a sum "
        f"predicts anything: {why}. Measure the plan with all groups pruned at once (--verify, or run.py verify "
        "<analysis file> --ratios <plan yaml>), or let joint evaluations choose it (--method measured)"
    )


def summed_prediction_notice(record: AnalysisRecord, predicted: float) -> str | None:
    """:func:`prediction_notice` with the metric, metric mode, baseline and measured losses of the analysis."""
    settings = record.settings
    metric = settings.metric_name
    baseline = record.baseline.get(metric)
    losses = [loss for curve in record.sensitivities.values() for loss in curve.values()]
    largest = max((loss for loss in losses if math.isfinite(loss)), default=0.0)
    return prediction_notice(predicted, metric, settings.metric_mode or "relative", baseline, largest)


def known_loss(value: float) -> float | None:
    """``value`` for JSON, None when it is not a finite number: a loss is unknown (NaN) where a ratio lies beyond the
    analysed ones, which no curve can predict."""
    return value if math.isfinite(value) else None


def build_plan(
    model: nn.Module,
    example_input: torch.Tensor,
    analysis: AnalysisSource,
    target: float,
    measure: str = "macs",
    latency: LatencyModel | None = None,
    also: Mapping[str, float] | None = None,
) -> Plan:
    """Allocate per-group ratios from the analysis so that ``measure`` drops by at least ``target`` (and every
    measure in ``also`` by its reduction: combined budgets).

    Args:
        model: The analysed model (its weights must be the ones the file was computed on).
        example_input: A batch fixing the input size (the first sample is used for costs).
        analysis: The analysis record, or the analysis pickle to read; its JSON sidecar supplies the criterion and
            the fingerprint.
        target: The reduction to reach, strictly between 0 and 1.
        measure: ``macs``, ``params`` or ``latency``.
        latency: With ``latency`` (and only then): the latency model the savings are predicted with.
        also: Other budgets met at once, ``{measure: reduction}`` (e.g. ``{"params": 0.3}`` with a MACs target): each
            key ``macs`` or ``params`` other than ``measure``, each reduction between 0 and 1.

    Raises:
        AnalysisFileError: If the file has no sidecar, was computed on other weights, or element-wise.
        ConfigError: For an argument of the wrong type, an unknown ``measure``, or a bad ``also`` budget.
        UserError: If the target is outside (0, 1) or not reachable with the measured ratios.
    """
    model = arguments.module("model", model)
    example_input = ImageConversion("example_input", floating_dtype(model))(
        arguments.tensor("example_input", example_input)
    )
    analysis = arguments.analysis_source("analysis", analysis)
    target = arguments.number("target", target)
    check_choice("measure", arguments.text("measure", measure), MEASURES)
    if latency is not None and not isinstance(latency, LatencyModel):
        raise arguments.refuse("latency", "a LatencyModel (with measure='latency') or None", latency)
    if (measure == "latency") != (latency is not None):
        raise ConfigError("latency (a LatencyModel) is given exactly with measure='latency'; pass both or neither.")
    budgets = also_budgets(also, measure)
    if not 0.0 < target < 1.0:
        raise UserError(f"target_{measure}_reduction must be between 0 and 1 (0.4 = 40% fewer), got {target}.")
    record = as_record(analysis)
    with eval_mode(model):
        planner, options = open_planner(model, example_input, record, measure, latency)
        for other, reduction in budgets.items():
            planner.require(other, reduction)
        allocation = planner.allocate(options, target)
        plan = planner.plan(options, allocation.choices, target, allocation.predicted_loss, allocation.lower_bound)
    plan.notice = summed_prediction_notice(record, plan.predicted_loss)
    return plan


def also_budgets(also: object, measure: str) -> dict[str, float]:
    """:func:`build_plan`'s ``also``: ``{measure: reduction}`` of other budgets (None: none), each key ``macs`` or
    ``params`` other than the plan's own ``measure``, each reduction between 0 and 1.

    Raises:
        ConfigError: Naming ``also`` and the key at fault.
    """
    budgets: dict[str, float] = {}
    allowed = [name for name in ("macs", "params") if name != measure]
    for key, value in (arguments.optional(arguments.mapping, "also", also) or {}).items():
        if key not in allowed:
            hint = did_you_mean(key, allowed) if isinstance(key, str) else ""
            raise ConfigError(
                f"also's keys must be {' or '.join(map(repr, allowed))} (budgets besides measure='{measure}'), got "
                f"{arguments.described(key)}{hint}."
            )
        reduction = arguments.number(f"also['{key}']", value)
        if not (0.0 < reduction < 1.0):
            raise ConfigError(f"also['{key}'] must be a reduction between 0 and 1 (0.3 = 30% fewer), got {reduction}.")
        budgets[key] = reduction
    return budgets


def open_planner(
    model: nn.Module,
    example_input: torch.Tensor,
    analysis: AnalysisSource,
    measure: str = "macs",
    latency: LatencyModel | None = None,
) -> tuple[Planner, list[GroupOptions]]:
    """The :class:`Planner` of ``model`` with the settings of the analysis (a record, or a file to read), and every
    analysed group's options (call in eval mode).

    Raises:
        AnalysisFileError: As :func:`build_plan`, or when the file holds no filter-pruning losses.
    """
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    record = as_record(analysis)
    settings = _analysis_settings(model, record)
    planner = Planner(model, example_input, settings, measure, latency)
    options = planner.options(record.sensitivities)
    if not options:
        raise AnalysisFileError(f"{record.path} has no measured filter-pruning losses to plan with.")
    return planner, options


def plan_from_ratios(
    model: nn.Module,
    example_input: torch.Tensor,
    analysis: AnalysisSource,
    ratios: Mapping[str, float],
    source: str = "ratios",
) -> Plan:
    """A :class:`Plan` applying given per-param ratios (e.g. a ``ChannelPrune`` YAML), to verify or export them.

    Channels are chosen as the analysis did (its criterion, ``min(C - 1, round(C * r))`` per param). Coupled params
    share one removal: the first listed member of a group decides it, as PaddleSlim's pruner does; a differing ratio
    of a later member is ignored with a warning. The predicted loss sums the deciding params' interpolated losses.

    Raises:
        AnalysisFileError: As :func:`build_plan`.
        UserError: For a name that is not a prunable unit of the model, or a ratio outside [0, 1).
    """
    record = as_record(analysis)
    settings = _analysis_settings(model, record)
    sensitivities = record.sensitivities
    with eval_mode(model):
        planner = Planner(model, example_input, settings, "macs")
        params, costs = planner.params, planner.costs
        decided: dict[str, str] = {}  # param -> the member that decided its group
        listed: dict[str, str] = {}  # param -> the name the ratios gave it
        groups: list[PlannedGroup] = []
        for name, ratio in ratios.items():
            param = planner.by_name.get(name) or planner.by_name.get(f"{name}.weight")
            if param is None:
                reasons = {p.name: p.reason for p in params if p.reason}
                why = f": {reasons[name]}" if name in reasons else did_you_mean(name, planner.by_name)
                raise UserError(f"ratios: '{name}' is not a prunable unit of this model{why}.")
            if param.name in listed:
                raise UserError(
                    f"ratios: '{listed[param.name]}' and '{name}' name the same param {param.name}; list it once."
                )
            listed[param.name] = name
            if ratio_problem(ratio, zero_allowed=True) is not None:
                raise UserError(f"ratios: {name} has ratio {ratio}; ratios must lie in [0, 1).")
            if param.name in decided:
                if decided[param.name] != param.name:
                    logger.warning("%s is coupled to %s, listed earlier, whose ratio decides their shared channels.",
                                   param.name, decided[param.name])  # fmt: skip
                continue
            members = [param.name, *[n for n in param.coupled_params if n in planner.by_name]]
            decided.update({member: param.name for member in members})
            count = param_count(param, ratio, planner.round_to)
            if count == 0:
                continue
            measured = sensitivities.get(param.name, {}).items()
            points = monotone_curve([(param_count(param, r, planner.round_to), loss) for r, loss in measured])
            predicted = interpolate(points, count) if count <= points[-1][0] else float("nan")
            ordered = [p.name for p in params if p.name in members]
            groups.append(PlannedGroup(ordered, param.name, param.module_name, param.channels,
                                       planner.removed(param.name, count), predicted))  # fmt: skip
        order = {p.name: index for index, p in enumerate(params)}
        groups.sort(key=lambda g: order[g.members[0]])
        pruned = planner.picks_cost((g.ranking_param, len(g.removed)) for g in groups)
        predicted_total = sum(g.predicted_loss for g in groups)
        notice = summed_prediction_notice(record, predicted_total)
        return Plan("macs", None, groups, predicted_total, predicted_total, costs.dense, pruned, settings, source,
                    method="ratios", notice=notice)  # fmt: skip


def evenly_spaced(counts: Sequence[int], number: int) -> list[int]:
    """Up to ``number`` of the sorted ``counts``: the largest and those nearest to even fractions of it."""
    if not counts:
        return []
    top = counts[-1]
    return sorted({min(counts, key=lambda count: abs(count - top * k / number)) for k in range(1, number + 1)})


def _keeping_multiple(group: GroupOptions, largest: int, multiple: int) -> list[int]:
    """The counts of ``group``'s choices up to ``largest`` that keep a multiple of ``multiple`` channels, sorted."""
    kept = (c.count for c in group.choices if 0 < c.count <= largest and (group.channels - c.count) % multiple == 0)
    return sorted(kept)


def param_count(param: PrunableUnit, ratio: float, round_to: int = 1) -> int:
    """Channels the analysis removed from ``param`` at ``ratio`` (whole conv-group steps, ``round_to`` kept)."""
    return removal_count(param.channels, ratio, len(param.conv_blocks), round_to)


def _analysis_settings(model: nn.Module, record: AnalysisRecord) -> dict[str, Any]:
    """How the analysis ranked channels (:meth:`~analysis.io.sidecar.SettingsRecord.ranking`), after checking that
    the file was computed on this model's weights with filter pruning."""
    if record.sidecar is None:
        raise AnalysisFileError(
            f"{record.path} has no sidecar ({sidecar_path(record.path).name}), which a plan needs for the "
            "criterion the losses were measured with; rerun the analysis to create it."
        )
    stored = record.fingerprint.model if record.fingerprint is not None else None
    if stored is not None and stored != model_fingerprint(model):
        raise AnalysisFileError(
            f"{record.path} was computed on other weights than this model's; plan with the config that wrote it."
        )
    if (record.settings.granularity or "filter") != "filter":
        raise AnalysisFileError(f"{record.path} holds element-wise losses; a budget plan needs filter pruning.")
    return record.settings.ranking()


class Planner:
    """Options per group and exact joint savings for one model, analysis settings and measure."""

    def __init__(
        self,
        model: nn.Module,
        example_input: torch.Tensor,
        settings: Mapping[str, Any],
        measure: str,
        latency: LatencyModel | None = None,
    ) -> None:
        if (measure == "latency") != (latency is not None):
            raise ValueError("a latency model is given exactly with measure latency")
        self.model, self.measure, self.example_input, self.latency = model, measure, example_input, latency
        self.also: dict[str, float] = {}
        """Budgets met besides :attr:`measure`'s: ``{measure: reduction}`` (:meth:`require`)."""
        self.latency_goal_ms: float | None = None
        """The latency goal in ms when the user gave one (``target_latency_ms``): messages speak of it, not of the
        reduction it stands for."""
        self._group_key: dict[str, str] = {}
        self.settings = dict(settings)
        self.graph: tp.DependencyGraph = model_graph(model, example_input)  # the one the plan's copies reuse
        self.params = describe_units(model, self.graph, execution_order(model, example_input))
        self.costs = CostModel(model, example_input)
        self.by_name = {p.name: p for p in self.params if p.prunable}
        self.round_to = int(settings.get("round_to", 1))
        self.latency_round_to = 1  # set with the latency model (use_latency)
        self._scores: dict[str, torch.Tensor] = {}
        self._removed: dict[tuple[str, int], list[int]] = {}
        self._deltas: dict[tuple[str, int], ShapeDelta] = {}

    def removals(self, picks: Iterable[tuple[str, int]]) -> list[tuple[str, list[int]]]:
        """``(conv module name, channels)`` of every ``(ranking param, count)`` pick that removes channels, for
        physical pruning (:func:`~analysis.structure.physical.jointly_pruned_copy`)."""
        return [(self.by_name[name].module_name, self.removed(name, count)) for name, count in picks if count]

    def removed(self, name: str, count: int) -> list[int]:
        """The channels ``name``'s ranking removes at ``count`` (the analysis engine's choice)."""
        key = (name, count)
        if key not in self._removed:
            param = self.by_name[name]
            if name not in self._scores:
                self._scores[name] = channel_scores(
                    self.model, self.graph, param, self.settings["criterion"], self.settings["group_reduction"]
                )
            self._removed[key] = lowest_channels(self._scores[name], count, param.conv_blocks)
        return self._removed[key]

    def saved_alone(self, name: str, count: int) -> float:
        """What removing ``count`` of ``name``'s channels (with its group) saves on its own."""
        if self.latency is not None:
            return self.latency.saved(self._group_key[name], count)
        return self.saved(self.picks_cost([(name, count)]))

    def options(self, sensitivities: Mapping[str, Mapping[float, float]]) -> list[GroupOptions]:
        """One :class:`GroupOptions` per group of coupled params that has measured losses."""
        analysed = [p for p in self.params if p.prunable and sensitivities.get(p.name)]
        groups: list[list[PrunableUnit]] = []
        seen: set[str] = set()
        for param in analysed:
            if param.name in seen:
                continue
            members = [p for p in analysed if p is param or p.name in param.coupled_params]  # model order
            seen.update(p.name for p in members)
            self._group_key.update({p.name: members[0].name for p in members})
            groups.append(members)
        return [self._group_options(members, sensitivities) for members in groups]

    def _group_options(self, members: list[PrunableUnit], sensitivities: Mapping[str, Mapping[float, float]]
                       ) -> GroupOptions:  # fmt: skip
        channels = members[0].channels
        curves: dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}
        for param in members:
            counts = {ratio: param_count(param, ratio, self.round_to) for ratio in sensitivities[param.name]}
            losses = monotone_curve([(counts[r], loss) for r, loss in sensitivities[param.name].items()])
            saved = [(count, self.saved_alone(param.name, int(count)) if count else 0.0) for count, _ in losses]
            curves[param.name] = (losses, saved)
        largest = int(max(points[0][-1][0] for points in curves.values()))
        choices = []
        for count in allowed_counts(channels, len(members[0].conv_blocks), self.round_to):
            if count > largest:
                break
            offered = (
                self.latency is None
                or not count
                or (
                    (channels - count) % self.latency_round_to == 0
                    and self.latency.table.offers(members[0].name, count, between=self.latency_round_to > 1)
                )
            )
            if not offered:
                continue  # latency jumps at unaligned counts: measured ones, or aligned ones between measured ones
            candidates = [
                (interpolate(losses, count), interpolate(saved, count), name)
                for name, (losses, saved) in curves.items()
                if count <= losses[-1][0]
            ]
            loss, saving, name = min(candidates)  # the member whose ranking is predicted to hurt least
            choices.append(Choice(count, name, 0.0 if count == 0 else loss, saving))
        return GroupOptions([p.name for p in members], channels, choices)

    def member_loss(self, sensitivities: Mapping[str, Mapping[float, float]], name: str, count: int) -> float:
        """The planning curve of param ``name`` at ``count`` channels (NaN beyond its largest measured count)."""
        param = self.by_name[name]
        measured = sensitivities.get(name, {}).items()
        points = monotone_curve([(param_count(param, r, self.round_to), loss) for r, loss in measured])
        return interpolate(points, count) if count <= points[-1][0] else float("nan")

    def joint_saved(self, selection: Mapping[str, Choice]) -> float:
        """The saving when every selected group (by key) is pruned at once: exact for MACs and params, the latency
        model's prediction for latency."""
        return self.saved_in(self.measure, selection)

    def saved(self, cost: Cost, measure: str | None = None) -> float:
        """What ``cost`` saves against the dense model, in ``measure`` (MACs or params; default :attr:`measure`)."""
        dense, measure = self.costs.dense, measure or self.measure
        return float(dense.macs - cost.macs if measure == "macs" else dense.params - cost.params)

    def saved_in(self, measure: str, selection: Mapping[str, Choice]) -> float:
        """The saving of ``selection`` (by group key) in ``measure``: exact for MACs and params, the latency model's
        prediction for latency."""
        if measure == "latency":
            assert self.latency is not None, "a latency budget plans on a latency model"
            return self.latency.dense_ms - self.latency.predicted_ms({key: c.count for key, c in selection.items()})
        return self.saved(self.picks_cost((c.param, c.count) for c in selection.values()), measure)

    def dense_in(self, measure: str) -> float:
        """The dense model's MACs, params or latency."""
        if measure == "latency":
            assert self.latency is not None, "a latency budget plans on a latency model"
            return self.latency.dense_ms
        return float(self.costs.dense.macs if measure == "macs" else self.costs.dense.params)

    def require(self, measure: str, target: float) -> None:
        """Meet a reduction of ``measure`` by ``target`` too, whatever the plan's own budget (combined budgets)."""
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
        if measure != self.measure:
            self.also[measure] = target

    def budgets(self, target: float) -> dict[str, float]:
        """Every budget a plan meets: ``{measure: reduction}``, the plan's own first."""
        return {self.measure: target, **self.also}

    def meets(self, selection: Mapping[str, Choice], target: float) -> bool:
        """Whether ``selection`` reaches ``target`` in :attr:`measure` and every other required budget."""
        return all(
            self.saved_in(measure, selection) >= reduction * self.dense_in(measure)
            for measure, reduction in self.budgets(target).items()
        )

    def picks_cost(self, picks: Iterable[tuple[str, int]]) -> Cost:
        """The exact cost with every ``(ranking param, channel count)`` pick pruned at once (one pick per group;
        each pick's shape change is computed once)."""
        return self.costs.delta_cost(self._pick_delta(pick) for pick in picks if pick[1])

    def pick_delta(self, pick: tuple[str, int]) -> ShapeDelta:
        """What one ``(ranking param, channel count)`` pick takes from each parameter's shape (computed once)."""
        return self._pick_delta(pick)

    def _pick_delta(self, pick: tuple[str, int]) -> ShapeDelta:
        if pick not in self._deltas:
            param, count = pick
            conv = self.model.get_submodule(self.by_name[param].module_name)
            group = removal_group(self.graph, conv, self.removed(param, count))
            self._deltas[pick] = self.costs.shape_delta(self.graph, self.costs.removed_channels(self.graph, group))
        return self._deltas[pick]

    def allocate(self, options: Sequence[GroupOptions], target: float, resolution: int | None = None) -> Allocation:
        """The knapsack allocation reaching ``target`` (a reduction fraction of :attr:`measure`); ``resolution`` as
        :func:`~analysis.planning.ratios.allocate`.

        Raises:
            UserError: If even the largest measured ratios do not reach it.
        """
        dense = self.dense_measure
        try:
            if self.also:
                return allocate_all(options, self._constraints(options, target), resolution)
            return allocate(options, target * dense, self.joint_saved, resolution)
        except BudgetUnreachable as error:
            if self.also:
                largest = largest_choices(options)
                reached = " and ".join(self._reached(m, self.saved_in(m, largest) / self.dense_in(m))
                                       for m in self.budgets(target))  # fmt: skip
                asked = " and ".join(self._goal(m, r) for m, r in self.budgets(target).items())
                raise UserError(
                    f"{asked} cannot all be reached: pruning every analysed unit as far as the analysed ratios go "
                    f"{reached}; analyse larger SensitivityAnalysis.pruned_ratios or lower a target."
                ) from error
            best = self.joint_saved({g.key: max(g.choices, key=lambda c: c.saved) for g in options}) / dense
            raise UserError(
                f"{self._goal(self.measure, target)} cannot be reached: pruning every analysed unit where it saves "
                f"most within the analysed ratios {self._reached(self.measure, best)}; analyse larger "
                "SensitivityAnalysis.pruned_ratios or lower the target."
            ) from error

    def _goal(self, measure: str, reduction: float) -> str:
        """A budget as the user gave it: ``target_macs_reduction 0.4``, or a latency goal in ms with the reduction of
        the table's dense latency it stands for."""
        if measure == "latency" and self.latency_goal_ms is not None:
            return (f"target_latency_ms {self.latency_goal_ms:g} ({reduction:.1%} below the dense model's "
                    f"{self.dense_in(measure):.3f} ms in the latency table)")  # fmt: skip
        return f"target_{measure}_reduction {reduction:g}"

    def _reached(self, measure: str, fraction: float) -> str:
        """What the most pruning saves of ``measure`` (``fraction`` of the dense model's), in the budget's form."""
        if measure == "latency" and self.latency_goal_ms is not None:
            return f"gets the predicted latency down to {self.dense_in(measure) * (1.0 - fraction):.3f} ms"
        return f"removes {fraction:.1%} of the {measure}"

    def _constraints(self, options: Sequence[GroupOptions], target: float) -> list[Constraint]:
        """Each budget as a :class:`~analysis.planning.allocate.Constraint`: per choice its saving alone, the goal,
        and the exact joint saving."""
        constraints = []
        for measure, reduction in self.budgets(target).items():
            savings = {
                group.key: [self.saved_in(measure, {group.key: c}) if c.count else 0.0 for c in group.choices]
                for group in options
            }
            joint = (lambda m: lambda selection: self.saved_in(m, selection))(measure)
            constraints.append(Constraint(measure, savings, reduction * self.dense_in(measure), joint))
        return constraints

    @property
    def dense_measure(self) -> float:
        """The dense model's MACs, params or latency (whichever :attr:`measure` is)."""
        return self.dense_in(self.measure)

    def use_latency(self, latency: LatencyModel, round_to: int = 1) -> None:
        """Plan on ``latency`` from now on (options made after this call predict latency savings and, with
        ``round_to`` above 1, keep a multiple of ``round_to`` channels in every pruned group)."""
        self.measure, self.latency, self.latency_round_to = "latency", latency, round_to
        self.also.pop("latency", None)

    def probe_counts(
        self, options: Sequence[GroupOptions], sensitivities: Mapping[str, Mapping[float, float]], round_to: int = 1
    ) -> dict[str, list[int]]:
        """Per group (by key), where the latency table measures the whole model with that group pruned, up to the
        largest count the analysis measured for any member.

        With ``round_to`` above 1 (``latency_round_to``): :data:`ALIGNED_PROBES` counts that keep a multiple of
        ``round_to`` channels, the largest such count and evenly spaced ones below it; a plan may take any aligned
        count up to the largest, its saving interpolated (aligned counts run smoothly in the count). With 1: the
        analysed counts and those keeping a multiple of :data:`ALIGNED_CHANNELS` (of a coarser multiple of it for
        wide layers, at most about :data:`ALIGNED_STEPS` counts); a plan offers only these."""
        counts: dict[str, list[int]] = {}
        for group in options:
            analysed = {c for name in group.members for r in sensitivities.get(name, {})
                        if (c := param_count(self.by_name[name], r, self.round_to))}  # fmt: skip
            largest = max(analysed, default=0)
            if round_to > 1:
                counts[group.key] = evenly_spaced(_keeping_multiple(group, largest, round_to), ALIGNED_PROBES)
                continue
            step = ALIGNED_CHANNELS * max(1, math.ceil(group.channels / (ALIGNED_CHANNELS * ALIGNED_STEPS)))
            counts[group.key] = sorted(analysed.union(_keeping_multiple(group, largest, step)))
        return counts

    def probe_limits(self) -> dict[str, range]:
        """Per prunable unit, every channel count a latency probe of its group can remove, whatever the analysed ratios
        and ``round_to`` (:func:`~analysis.structure.criteria.allowed_counts` less 0): what a cached latency table,
        kept across analyses of one model, may hold."""
        limits = {}
        for name, param in self.by_name.items():
            step = len(param.conv_blocks) or 1
            limits[name] = range(step, param.channels, step)
        return limits

    def plan(
        self,
        options: Sequence[GroupOptions],
        choices: Mapping[str, Choice],
        target: float,
        predicted_loss: float,
        lower_bound: float,
        method: str = "knapsack",
        search: dict[str, Any] | None = None,
    ) -> Plan:
        """The :class:`Plan` of one choice per group (groups missing from ``choices`` stay unpruned)."""
        groups = []
        for group in options:
            choice = choices.get(group.key)
            if choice is not None and choice.count:
                ranking = self.by_name[choice.param]
                groups.append(PlannedGroup(group.members, choice.param, ranking.module_name, group.channels,
                                           self.removed(choice.param, choice.count), choice.loss))  # fmt: skip
        pruned = self.picks_cost((g.ranking_param, len(g.removed)) for g in groups)
        return Plan(self.measure, target, groups, predicted_loss, lower_bound, self.costs.dense, pruned,
                    dict(self.settings), method=method, search=search,
                    budgets=self.budgets(target) if self.also else {})  # fmt: skip

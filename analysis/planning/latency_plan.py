"""A plan for a latency budget, measured end to end: the latency table is measured on the runtime (or read from its
cache), the knapsack plans on it, the planned model is timed between timings of the dense model on the same runtime
(:func:`~analysis.runtimes.compare.bracket`), and while it misses the budget the latency model is rescaled to that
measurement and the plan made again (at most :data:`MAX_ATTEMPTS`). A plan that beats the goal by more than
:data:`~analysis.planning.latency.OVERSHOOT` removed more than it needed: the model is rescaled to it too and a smaller
plan tried, kept only when it meets the goal as well.

The verdict rests on the measured interval's worse end, and on dense timings that agree: a machine too noisy to
judge is said to be so, not called a miss or a success. When no plan can reach the goal, the largest plan the
analysed ratios allow is measured too, so the sentence names the cause that was measured: that plan's own saving
(not reachable), or the table's error (its prediction against the measurement).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from analysis.errors import UserError
from analysis.io.lock import exclusive
from analysis.io.record import AnalysisRecord
from analysis.planning.allocate import GroupOptions, largest_choices
from analysis.planning.latency import (
    OVERSHOOT,
    LatencyAttempt,
    LatencyGoalNotReached,
    LatencyModel,
    LatencyOutcome,
    LatencyRuntime,
)
from analysis.planning.layer_table import JointLayerSavings, measure_layer_table
from analysis.planning.measured import PlanScoring, SearchSettings, search_plan
from analysis.planning.plan import Plan, Planner, open_planner, summed_prediction_notice
from analysis.planning.probes import measure_table
from analysis.runtimes.compare import ROUNDS, TOLERANCE, Bracketed, bracket
from analysis.runtimes.runtime import Prepared
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
"""Plans measured end to end at most, for one latency budget."""
PREDICTED_RAISES = 4
"""Times per attempt the target is raised before measuring, while a layer-level table's whole-plan prediction (with
the groups' interactions) says the knapsack's plan misses the goal."""


@dataclass(frozen=True)
class MeasuredMethod:
    """How a latency plan is chosen with the measured method (:mod:`analysis.planning.measured`) instead of the
    knapsack: the scoring images and the search's settings."""

    scoring: PlanScoring
    search: SearchSettings
    progress: bool | None = None


@dataclass(frozen=True)
class LatencyGoal:
    """How the plan loop measures a plan against its goal (the goal itself, in ms, is the outcome's).

    Attributes:
        reduction: The fraction less latency asked (None for a goal in ms): a straddling interval is timed again.
        batch: Images per call.
        tolerance: Largest drift of the dense timings around a measurement (``latency_tolerance``).
        round_to: Every pruned group keeps a multiple of this many channels (``latency_round_to``; 1: any count).
    """

    reduction: float | None = None
    batch: int = 1
    tolerance: float = TOLERANCE
    round_to: int = 1


def plan_for_latency(
    model: nn.Module,
    example_input: torch.Tensor,
    record: AnalysisRecord,
    runtime: LatencyRuntime,
    *,
    reduction: float | None = None,
    goal_ms: float | None = None,
    batch: int = 1,
    progress: bool | None = None,
    also: Mapping[str, float] | None = None,
    measured_method: MeasuredMethod | None = None,
    table: str = "auto",
    tolerance: float = TOLERANCE,
    round_to: int = 8,
) -> Plan:
    """The knapsack plan whose measured latency on ``runtime`` is at most the goal (``goal_ms``, or the dense
    latency times ``1 - reduction``), on a latency table of kind ``table`` (``model``: whole-model probes,
    ``layers``: single layers, ``auto``: :func:`table_kind`), and that meets every MACs or params budget in ``also``
    (``{measure: reduction}``) too, keeping a multiple of ``round_to`` channels in every pruned group (1: any
    analysed count; runtimes run aligned channel counts faster, see
    :func:`~analysis.planning.plan.Planner.probe_counts`). Each attempt plans with the knapsack, or with
    ``measured_method`` the measured search. The plan's
    :attr:`~analysis.planning.plan.Plan.latency` holds every attempt and the verdict (met, missed, or noisy).

    Raises:
        UserError: If the goal is not below the dense latency.
        LatencyGoalNotReached: If no plan of the analysed ratios was found for the goal (a ``UserError`` carrying the
            attempts and the largest plan's measurement).
    """
    goal = LatencyGoal(reduction, batch, tolerance, round_to)
    with eval_mode(model):
        planner, options = open_planner(model, example_input, record, "macs")
        counts = planner.probe_counts(options, record.sensitivities, round_to)
        kind = table_kind(table, runtime, batch)
        if kind == "model":
            latency_table, path, seconds = measure_table(planner, counts, runtime, batch, record.path, progress,
                                                         tolerance)  # fmt: skip
        else:
            latency_table, path, seconds = measure_layer_table(planner, counts, runtime, batch, record.path, progress)
        joint = JointLayerSavings(planner, latency_table, runtime, batch, path) if kind == "layers" else None
        latency = LatencyModel(latency_table, joint=joint)
        goal_on_table = goal_ms if goal_ms is not None else latency.dense_ms * (1.0 - float(reduction or 0.0))
        if not 0.0 < goal_on_table < latency.dense_ms:
            refused = (f"SensitivityAnalysis.target_latency_ms {goal_ms:g} is not below" if goal_ms is not None else
                       f"SensitivityAnalysis.target_latency_reduction {float(reduction or 0.0):g} asks for no time "
                       "below")  # fmt: skip
            raise UserError(
                f"{refused} the dense model's measured {latency.dense_ms:.3f} ms on {runtime.device} (batch {batch}); "
                "ask for less."
            )
        planner.latency_goal_ms = goal_ms  # its messages then speak of the goal in ms
        outcome = LatencyOutcome(runtime.name, runtime.device, batch, latency.dense_ms, goal_on_table,
                                 table_file=str(path), table_seconds=round(seconds, 3), goal_reduction=reduction,
                                 tolerance=tolerance, settings=runtime.settings(), table=kind)  # fmt: skip
        sample_shape = tuple(example_input.shape[1:])
        with runtime.prepare(model, sample_shape) as dense:
            loop = _Loop(planner, record, runtime, dense, goal, outcome, measured_method, also or {})
            plan = loop.run(options, latency, 1.0 - goal_on_table / latency.dense_ms)
    if outcome.verdict == "noisy":
        logger.warning("%s.", outcome.noisy_sentence())
    elif not outcome.met:
        last = outcome.last
        logger.warning(
            "The latency plan measured %.1f%% faster (%.1f%% to %.1f%% over %d timings; %.3f ms, dense %.3f ms around "
            "it) after %d attempts, short of the goal (%s); the last plan is kept.", 100 * last.measured.reduction,
            100 * last.measured.interval[0], 100 * last.measured.interval[1], len(last.measured.candidate_ms),
            last.measured_ms, last.dense_ms, len(outcome.attempts), outcome.goal_text(),
        )  # fmt: skip
    plan.latency = outcome
    if also:  # the asked reduction, not the one the corrections planned for
        asked = reduction if reduction is not None else 1.0 - goal_on_table / outcome.dense_ms
        plan.budgets = {"latency": asked, **also}
    if measured_method is None:
        plan.notice = summed_prediction_notice(record, plan.predicted_loss)
    return plan


def worse_margin(measured: Bracketed, tolerance: float) -> float:
    """How far below its median a plan's worse end is expected to measure, to aim the next plan above the goal by:
    the measured distance, believed only as far as the better side's spread or the machine's ``tolerance`` reach. A
    single slow timing is treated as the machine's, not the plan's: aiming the whole distance below it (0.14 on the demo
    MobileNetV2 at batch 32, 2026-11-29) made the next plan remove 45% of the MACs for a 30% latency goal."""
    low, high = measured.interval
    below = measured.reduction - low
    return min(below, max(tolerance, high - measured.reduction))


class _Loop:
    """The plan, measure, correct loop of one latency budget, with the dense model prepared once for all of it."""

    def __init__(
        self,
        planner: Planner,
        record: AnalysisRecord,
        runtime: LatencyRuntime,
        dense: Prepared,
        goal: LatencyGoal,
        outcome: LatencyOutcome,
        method: MeasuredMethod | None,
        also: Mapping[str, float],
    ) -> None:
        self.planner, self.record, self.runtime, self.dense = planner, record, runtime, dense
        self.goal, self.outcome, self.method, self.also = goal, outcome, method, also

    def run(self, options: list[GroupOptions], latency: LatencyModel, target: float) -> Plan:
        """Plan, measure and correct until the goal is met, the machine is too noisy, or the attempts run out."""
        planner, outcome = self.planner, self.outcome
        goal = target  # the goal's reduction on the table's scale; a missed plan raises the target above it
        tried: set[tuple[tuple[str, int], ...]] = set()
        plan: Plan | None = None
        kept: tuple[int, Plan] | None = None  # a met plan that beat the goal by far, while a smaller one is tried
        measured_plan: Plan | None = None  # the plan of the newest attempt
        while len(outcome.attempts) < MAX_ATTEMPTS:
            planner.use_latency(latency, self.goal.round_to)
            for other, value in self.also.items():
                planner.require(other, value)
            options = planner.options(self.record.sensitivities)
            try:
                plan = _plan(planner, options, self.record, target, self.method)
            except UserError:
                if kept is not None:
                    break  # no smaller plan: the met one stands
                latency = self._unreachable(options, latency)  # raises unless the largest plan reaches it
                continue
            picks = _picks(plan)
            predicted = latency.plan_ms(picks)
            for _raise in range(PREDICTED_RAISES if latency.joint is not None else 0):
                if predicted <= outcome.goal_ms:
                    break
                # the whole plan's prediction (with the groups' interactions) misses: ask for more before measuring
                higher = min(0.999, target + (predicted - outcome.goal_ms) / latency.dense_ms)
                try:
                    plan, target = _plan(planner, options, self.record, higher, self.method), higher
                except UserError:
                    break  # the analysed ratios allow no more: measure the plan there is
                picks = _picks(plan)
                predicted = latency.plan_ms(picks)
            chosen = tuple(sorted(picks.items()))
            if kept is not None and chosen in tried:
                break  # fitted to the met plan, the model offers no plan not measured already
            measured = self._measure(plan)
            outcome.attempts.append(LatencyAttempt(round(target, 6), 1.0 - predicted / latency.dense_ms, measured,
                                                   latency.scale))  # fmt: skip
            outcome.chosen, measured_plan = len(outcome.attempts) - 1, plan
            logger.info(
                "Latency plan (attempt %d): predicted %.1f%% faster, measured %.1f%% (%.1f%% to %.1f%%; %.3f ms, "
                "dense %.3f ms around it, %.1f%% apart) on %s, goal %s: %s.", len(outcome.attempts),
                100 * outcome.last.predicted_reduction, 100 * measured.reduction, 100 * measured.interval[0],
                100 * measured.interval[1], measured.candidate_median, measured.dense_median, 100 * measured.drift,
                self.runtime.device, outcome.goal_text(), outcome.verdict,
            )  # fmt: skip
            verdict = outcome.verdict
            if kept is not None and verdict != "met":
                break  # the smaller plan missed (or could not be judged): the met one stands
            if verdict == "noisy":
                break  # a noisy measurement corrects nothing: the verdict says so instead
            if verdict == "met":
                beaten = outcome.overshoot(outcome.last)
                if beaten <= OVERSHOOT or len(outcome.attempts) >= MAX_ATTEMPTS:
                    break
                kept = (outcome.chosen, plan)
                logger.info(
                    "The latency plan beat the goal by %.1f%% of the dense latency: it removes more than needed; "
                    "fitting the latency model to it and trying a smaller plan.", 100 * beaten,
                )  # fmt: skip
            on_table = latency.dense_ms * (1.0 - measured.reduction)  # the measured reduction on the table's scale
            if verdict == "missed":
                # the verdict rests on the interval's worse end: aim so that it meets the goal, not the median
                margin = worse_margin(measured, self.goal.tolerance)
                target = min(0.999, max(target, goal + margin))
                if chosen in tried:  # rescaling did not change the plan: ask for the worse end's shortfall too
                    target = min(0.999, target + max(0.0, goal - (measured.reduction - margin)))
            tried.add(chosen)
            latency = latency.fitted(picks, on_table)
        if kept is not None and not outcome.met:  # the newest attempt (chosen so far) missed: the met one stands
            outcome.chosen, measured_plan = kept
        assert measured_plan is not None
        return measured_plan

    def _measure(self, plan: Plan) -> Bracketed:
        """``plan``'s pruned model timed between timings of the dense model, with more rounds when its interval
        straddles the goal (so that the verdict rests on enough timings)."""
        planner, goal = self.planner, self.goal
        copy = jointly_pruned_copy(planner.model, plan.removals(), planner.example_input) if plan.groups else (
            planner.model)  # fmt: skip
        with self.runtime.prepare(copy, tuple(planner.example_input.shape[1:])) as pruned:
            measured = bracket(self.dense, pruned, goal.batch, ROUNDS, goal.tolerance)
            wanted = goal.reduction
            if wanted is not None and measured.steady(goal.tolerance) and measured.interval[0] < wanted <= (
                    measured.interval[1]):  # fmt: skip
                more = bracket(self.dense, pruned, goal.batch, ROUNDS, goal.tolerance,
                               dense_before_ms=measured.dense_ms[-1])  # fmt: skip
                if more.steady(goal.tolerance):
                    measured = measured.joined(more)
        return measured

    def _rounded(self) -> str:
        """How the plans' channel counts are rounded, for a sentence (empty when they are not)."""
        multiple = self.goal.round_to
        return f", keeping a multiple of {multiple} channels as latency_round_to asks" if multiple > 1 else ""

    def _unreachable(self, options: list[GroupOptions], latency: LatencyModel) -> LatencyModel:
        """The knapsack found no plan for the goal: measure the largest plan the analysed ratios allow (once). When it
        misses the goal too, raise the measured cause; when it reaches it, the table underrated the savings:
        return the latency model fitted to that measurement, to plan again.

        Raises:
            LatencyGoalNotReached: The goal is not reachable within the analysed ratios (as measured), the machine was
                too noisy to tell, or the table could not be corrected enough to find a plan.
        """
        outcome, planner = self.outcome, self.planner
        largest = largest_plan(planner, options)
        device = f"{self.runtime.device}, batch {self.goal.batch}"
        if outcome.largest is not None:
            last = outcome.attempts[-1] if outcome.attempts else None
            error = ("" if last is None else f"; the last plan was predicted {last.predicted_reduction:.1%} faster and "
                     f"measured {last.measured.reduction:.1%}")  # fmt: skip
            raise LatencyGoalNotReached(
                f"No latency plan for {outcome.goal_text()} on {device}: the largest plan the analysed ratios allow "
                f"measured {outcome.largest.reduction:.1%} faster, but the table's predictions stayed too far from the "
                f"measurements to find a smaller one{error}; try SensitivityAnalysis.latency_table: layers, a larger "
                "latency_batch, or a lower target.",
                outcome,
            ) from None
        measured = self._measure(largest)
        outcome.largest, outcome.largest_picks = measured, _picks(largest)
        low, high = measured.interval
        if not measured.steady(self.goal.tolerance):
            noisy = outcome.noisy_sentence(measured, "the largest plan the analysed ratios allow")
            raise LatencyGoalNotReached(f"{noisy}.", outcome)
        reaches = (measured.reduction >= outcome.goal_reduction if outcome.goal_reduction is not None else
                   measured.candidate_median <= outcome.goal_ms)  # fmt: skip
        if not reaches:
            raise LatencyGoalNotReached(
                f"The latency goal ({outcome.goal_text()} on {device}) is not reachable within the analysed ratios: "
                f"the largest plan they allow (every group at its largest analysed ratio{self._rounded()}) measured "
                f"{measured.reduction:.1%} faster ({low:.1%} to {high:.1%}; {measured.candidate_median:.3f} ms, dense "
                f"{measured.dense_median:.3f} ms around it); lower the target, analyse larger ratios, or measure at a "
                "larger SensitivityAnalysis.latency_batch.",
                outcome,
            ) from None
        logger.info("The table found no plan for the goal, but the largest plan the analysed ratios allow measured "
                    "%.1f%% faster: the table underrates the savings; planning again on that measurement.",
                    100 * measured.reduction)  # fmt: skip
        return latency.fitted(_picks(largest), latency.dense_ms * (1.0 - measured.reduction))


LAYERS_FROM_BATCH = 32
"""``latency_table: auto`` measures single layers from this batch on (on a CPU), whole-model probes below it."""


def table_kind(table: str, runtime: LatencyRuntime, batch: int) -> str:
    """The kind of latency table ``table`` asks for: ``auto`` is ``layers`` at a batch of :data:`LAYERS_FROM_BATCH` or
    more on a CPU, else ``model``. At onnxruntime batch 32 on a 2-core CPU (ResNet-18, MobileNetV2, EfficientNet-B0,
    2026-11-28, docs/benchmarks.md) the layer table cost 0.08-0.18x the analysis and its kept plans were predicted
    within 5.5%, where whole-model probes cost 0.54-0.75x (a call takes 0.3-1.5 s there); at batch 1 the layer
    table's first MobileNetV2 plans measured 8.3% and 9.6% for a predicted 22.4% and 30.3%, while the probes cost
    0.1-0.3x. Other devices and torch at batch 32 were not measured."""
    if table != "auto":
        return table
    return "layers" if batch >= LAYERS_FROM_BATCH and runtime.on_cpu else "model"


def largest_plan(planner: Planner, options: list[GroupOptions]) -> Plan:
    """The plan with every group at the largest count ``options`` offer (the largest analysed count, rounded to
    ``latency_round_to`` in a latency plan): what the loop measures before it says a goal is not reachable within
    the analysed ratios."""
    return planner.plan(options, largest_choices(options), 0.0, 0.0, 0.0)


def _picks(plan: Plan) -> dict[str, int]:
    """``{group key: channels removed}`` of ``plan`` (the latency model's keys)."""
    return {group.members[0]: len(group.removed) for group in plan.groups}


def _plan(
    planner: Planner, options: list[GroupOptions], record: AnalysisRecord, target: float, method: MeasuredMethod | None
) -> Plan:
    """One attempt's plan for ``target`` on the planner's latency model: the knapsack's, or the measured search's
    (under the analysis file's lock, which guards its search log)."""
    if method is None:
        allocation = planner.allocate(options, target)
        return planner.plan(options, allocation.choices, target, allocation.predicted_loss, allocation.lower_bound)
    with exclusive(record.path):
        return search_plan(planner, options, record, target, method.scoring, method.search, method.progress)

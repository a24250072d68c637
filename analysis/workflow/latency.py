"""A plan for a latency budget, measured end to end: the latency table is measured on the runtime (or read from its
cache), the knapsack plans on it, the planned model is measured on the same runtime, and while it misses the
budget the latency model is rescaled to that measurement and the plan made again (at most :data:`MAX_ATTEMPTS`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from analysis.config import Config, runtime_timed_by_verify
from analysis.errors import UserError
from analysis.io.lock import exclusive
from analysis.io.record import AnalysisRecord
from analysis.planning.allocate import GroupOptions
from analysis.planning.latency import LatencyModel, LatencyOutcome
from analysis.planning.measured import PlanScoring, SearchSettings, search_plan
from analysis.planning.plan import Plan, Planner, open_planner, summed_prediction_notice
from analysis.planning.verify import RuntimeLatency
from analysis.runtimes.layers import JointLayerSavings, measure_layer_table
from analysis.runtimes.onnx_export import missing_modules
from analysis.runtimes.probes import measure_table
from analysis.runtimes.runtime import Runtime, make_runtime, measure_pair
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
"""Plans measured end to end at most, for one latency budget."""
PREDICTED_RAISES = 4
"""Times per attempt the target is raised before measuring, while a layer-level table's whole-plan prediction (with
the groups' interactions) says the knapsack's plan misses the goal."""


def latency_runtime(config: Config, device: torch.device) -> Runtime:
    """The runtime ``SensitivityAnalysis.latency_runtime`` names; ``auto`` is ONNX Runtime when the onnx extra is
    installed (what most deployments run, and the format every other runtime takes), else torch eager."""
    s = config.SensitivityAnalysis
    name = s.latency_runtime
    if name == "auto":
        name = "onnxruntime" if not missing_modules() else "torch"
    return make_runtime(name, device, s.runtime_command, s.runtime_pattern, key="SensitivityAnalysis.latency_runtime")


def plan_for_latency(
    model: nn.Module,
    example_input: torch.Tensor,
    record: AnalysisRecord,
    runtime: Runtime,
    *,
    reduction: float | None = None,
    goal_ms: float | None = None,
    batch: int = 1,
    progress: bool | None = None,
    also: Mapping[str, float] | None = None,
    measured_method: MeasuredMethod | None = None,
    table: str = "model",
) -> Plan:
    """The knapsack plan whose measured latency on ``runtime`` is at most the goal (``goal_ms``, or the dense
    latency times ``1 - reduction``), on a latency table of kind ``table`` (``model``: whole-model probes,
    ``layers``: single layers), and that meets every MACs or params budget in ``also`` (``{measure: reduction}``)
    too. Each attempt plans with the knapsack, or with ``measured_method`` the measured search.

    Raises:
        UserError: If the goal is not below the dense latency, or cannot be reached with the analysed ratios.
    """
    sample_shape = tuple(example_input.shape[1:])
    with eval_mode(model):
        planner, options = open_planner(model, example_input, record, "macs")
        counts = planner.probe_counts(options, record.sensitivities)
        measure = {"model": measure_table, "layers": measure_layer_table}[table]
        latency_table, path, seconds = measure(planner, counts, runtime, batch, record.path, progress)
        joint = JointLayerSavings(planner, latency_table, runtime, batch, path) if table == "layers" else None
        latency = LatencyModel(latency_table, joint=joint)
        goal = goal_ms if goal_ms is not None else latency.dense_ms * (1.0 - float(reduction or 0.0))
        if not 0.0 < goal < latency.dense_ms:
            refused = (f"SensitivityAnalysis.target_latency_ms {goal_ms:g} is not below" if goal_ms is not None else
                       f"SensitivityAnalysis.target_latency_reduction {float(reduction or 0.0):g} asks for no time "
                       "below")  # fmt: skip
            raise UserError(
                f"{refused} the dense model's measured {latency.dense_ms:.3f} ms on {runtime.device} (batch {batch}); "
                "ask for less."
            )
        planner.latency_goal_ms = goal_ms  # its messages then speak of the goal in ms
        outcome = LatencyOutcome(runtime.name, runtime.device, batch, latency.dense_ms, goal, table_file=str(path),
                                 table_seconds=round(seconds, 3), goal_reduction=reduction)  # fmt: skip
        target = 1.0 - goal / latency.dense_ms
        tried: set[tuple[tuple[str, int], ...]] = set()
        plan: Plan | None = None
        for _attempt in range(MAX_ATTEMPTS):
            planner.use_latency(latency)
            for other, value in (also or {}).items():
                planner.require(other, value)
            options = planner.options(record.sensitivities)
            try:
                plan = _plan(planner, options, record, target, measured_method)
            except UserError:
                if not outcome.attempts:
                    raise  # the table alone says the analysed ratios cannot reach it
                measured_so_far = ", ".join(f"{a['measured_ms']:.3f} (dense {a['dense_ms']:.3f})"
                                            for a in outcome.attempts)  # fmt: skip
                wanted = f"{goal:.3f} ms" if reduction is None else f"{reduction:.1%} less than the dense model"
                raise UserError(
                    f"The latency goal ({wanted} on {runtime.device}, batch {batch}) was not reached: the plans "
                    f"measured {measured_so_far} ms, and pruning the analysed ratios saves less on this runtime than "
                    "the table predicted; lower the target, analyse larger ratios, or measure at a larger "
                    "SensitivityAnalysis.latency_batch."
                ) from None
            picks = _picks(plan)
            predicted = latency.plan_ms(picks)
            for _raise in range(PREDICTED_RAISES if latency.joint is not None else 0):
                if predicted <= goal:
                    break
                # the whole plan's prediction (with the groups' interactions) misses: ask for more before measuring
                higher = min(0.999, target + (predicted - goal) / latency.dense_ms)
                try:
                    plan, target = _plan(planner, options, record, higher, measured_method), higher
                except UserError:
                    break  # the analysed ratios allow no more: measure the plan there is
                picks = _picks(plan)
                predicted = latency.plan_ms(picks)
            copy = jointly_pruned_copy(model, plan.removals(), example_input) if plan.groups else model
            dense_now, measured = measure_pair(runtime, model, copy, sample_shape, batch)  # the machine's speed now
            outcome.attempts.append({"target_reduction": round(target, 6), "predicted_ms": predicted,
                                     "measured_ms": measured, "dense_ms": dense_now,
                                     "scale": latency.scale})  # fmt: skip
            logger.info(
                "Latency plan (attempt %d): predicted %.3f ms, measured %.3f ms (dense %.3f ms beside it) on %s, goal "
                "%s.", len(outcome.attempts), predicted, measured, dense_now, runtime.device,
                f"{goal:.3f} ms" if reduction is None else f"{reduction:.1%} faster",
            )  # fmt: skip
            if outcome.met:
                break
            measured = measured * latency.dense_ms / dense_now  # on the table's scale, for the corrections below
            chosen = tuple(sorted(picks.items()))
            if chosen in tried:  # rescaling did not change the plan: ask the knapsack for the shortfall too
                target = min(0.999, target + (measured - goal) / latency.dense_ms)
            tried.add(chosen)
            latency = latency.fitted(picks, measured)
        assert plan is not None
    if not outcome.met:
        logger.warning(
            "The latency plan measured %.3f ms (%.1f%% below the dense model measured beside it) after %d attempts, "
            "short of the goal (%s); the last plan is kept.", outcome.measured_ms, 100 * outcome.measured_reduction,
            len(outcome.attempts), f"{goal:.3f} ms" if reduction is None else f"{reduction:.1%} faster",
        )  # fmt: skip
    plan.latency = outcome
    if also:  # the asked reduction, not the one the corrections planned for
        asked = reduction if reduction is not None else 1.0 - goal / latency.dense_ms
        plan.budgets = {"latency": asked, **also}
    if measured_method is None:
        plan.notice = summed_prediction_notice(record, plan.predicted_loss)
    return plan


def _picks(plan: Plan) -> dict[str, int]:
    """``{group key: channels removed}`` of ``plan`` (the latency model's keys)."""
    return {group.members[0]: len(group.removed) for group in plan.groups}


@dataclass(frozen=True)
class MeasuredMethod:
    """How a latency plan is chosen with the measured method (:mod:`analysis.planning.measured`) instead of the
    knapsack: the scoring images and the search's settings."""

    scoring: PlanScoring
    search: SearchSettings
    progress: bool | None = None


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


def wants_runtime_latency(config: Config, plan: Plan) -> bool:
    """Whether ``verify`` also times the plan on the latency runtime: for a latency plan, and whenever the config
    names a runtime or a batch for it (:func:`~analysis.config.runtime_timed_by_verify`)."""
    return plan.latency is not None or runtime_timed_by_verify(config)


def runtime_latency(
    config: Config, plan: Plan, model: nn.Module, pruned: nn.Module, example_input: torch.Tensor
) -> RuntimeLatency:
    """The dense and the pruned model timed side by side on the config's latency runtime at ``latency_batch``
    (:func:`~analysis.runtimes.runtime.measure_pair`), with the plan's prediction when it was planned on that runtime
    and batch."""
    runtime = latency_runtime(config, example_input.device)
    batch = config.SensitivityAnalysis.latency_batch
    dense_ms, pruned_ms = measure_pair(runtime, model, pruned, tuple(example_input.shape[1:]), batch)
    outcome = plan.latency
    same = outcome is not None and (outcome.runtime, outcome.device, outcome.batch) == (runtime.name, runtime.device,
                                                                                          batch)  # fmt: skip
    predicted = outcome.predicted_ms if same and outcome is not None else None
    return RuntimeLatency(runtime.name, runtime.device, batch, dense_ms, pruned_ms, predicted)

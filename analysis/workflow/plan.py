"""The plan step: from an analysis file to a budget plan (or the ratios of a YAML), its joint verification, the
BatchNorm statistics re-estimated for the export, the exported pruned model, and the plan recorded in the sidecar.

Run by ``run.py plan`` and ``run.py verify``, and after the main job when the config sets a budget, ``verify`` or
``export_dir``; callable from Python as :func:`run_plan_step` with a loaded config and its inputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from analysis.config import SEARCHED_PLAN_METHODS, Config, load_config
from analysis.engine.batchnorm import recalibrate_copy
from analysis.engine.evaluate import evaluate
from analysis.engine.fidelity import PassMetrics, fidelity_evaluator
from analysis.errors import ConfigError
from analysis.inputs import arguments
from analysis.inputs.build import Inputs, build_inputs, needs_calibration
from analysis.inputs.numerics import numerics
from analysis.io import sidecar as schema
from analysis.io.atomic import atomic_write_text
from analysis.io.lock import exclusive
from analysis.io.ratios_yaml import channel_prune_yaml, load_ratios_yaml
from analysis.io.record import AnalysisRecord, load_record
from analysis.io.results import ratios_path
from analysis.io.sidecar import Sidecar
from analysis.metrics import LABEL_FREE_METRICS
from analysis.planning.estimates import estimate_notice
from analysis.planning.latency_plan import MeasuredMethod, plan_for_latency
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import Plan, build_plan, plan_from_ratios
from analysis.planning.result import PlanResult
from analysis.planning.verify import CalibrationCheck, check_calibration, verify_plan
from analysis.structure.physical import jointly_pruned_copy
from analysis.workflow.export import write_export
from analysis.workflow.latency import latency_runtime, runtime_latency, wants_runtime_latency
from analysis.workflow.probe import build_probe

logger = logging.getLogger(__name__)

PLAN_YAML_SUFFIX = ".plan.yaml"


def plan_path(analysis_file: str | Path) -> Path:
    """``<analysis_file>.plan.yaml``: the budget plan as an ACT ``ChannelPrune`` block."""
    return Path(f"{analysis_file}{PLAN_YAML_SUFFIX}")


def budgets(config: Config) -> dict[str, float]:
    """Every budget of the config, ``{measure: target}`` in the order macs, params, latency (a reduction) or
    latency_ms (a goal in ms); empty for none. Several are met at once."""
    s = config.SensitivityAnalysis
    given = {
        "macs": s.target_macs_reduction,
        "params": s.target_params_reduction,
        "latency": s.target_latency_reduction,
        "latency_ms": s.target_latency_ms,
    }
    return {measure: value for measure, value in given.items() if value is not None}


def wants_plan_step(config: Config) -> bool:
    """Whether the main job goes on to a plan (a budget, ``verify`` or ``export_dir`` is set)."""
    s = config.SensitivityAnalysis
    return bool(budgets(config)) or s.verify or s.export_dir is not None


def run_plan_step(
    config: Config | str | os.PathLike[str],
    inputs: Inputs | None = None,
    progress: bool | None = None,
    ratios_file: str | Path | None = None,
    record: AnalysisRecord | None = None,
) -> PlanResult:
    """Plan (the config's budget, else the given or the ``target_loss`` ratios), then verify and export if asked.

    The plan and its verification are added to the sidecar (under the analysis file's lock), so the report shows
    them; the budget plan's ratios go to ``<analysis_file>.plan.yaml``. From Python::

        config = load_config("configs/digits_resnet.yaml", ["SensitivityAnalysis.target_macs_reduction=0.4",
                                                             "SensitivityAnalysis.verify=true"])
        result = run_plan_step(config)  # result.plan.ratios, result.verification, result.exported

    Args:
        config: A loaded config (:func:`~analysis.config.load_config`), or the path of a YAML config to load without
            overrides; its analysis file must exist (run the analysis first).
        inputs: The model and data built from ``config`` (built here when not given).
        progress: Progress bars (None: when stderr is a terminal).
        ratios_file: Apply this ratios YAML instead of planning a budget (``run.py verify --ratios``).
        record: The config's analysis file already read (:func:`~analysis.io.record.load_record`); read here once
            when not given. Every step below takes this record; only the plan's entry in the sidecar is written back.

    Raises:
        ConfigError: For an argument of the wrong type, a config file that does not exist or does not load.
    """
    config = config_argument(config)
    if inputs is not None and not isinstance(inputs, Inputs):
        raise arguments.refuse("inputs", "an Inputs (build_inputs(config)) or None", inputs)
    progress = arguments.optional(arguments.flag, "progress", progress)
    ratios_file = arguments.optional(arguments.path, "ratios_file", ratios_file)
    if record is not None and not isinstance(record, AnalysisRecord):
        raise arguments.refuse("record", "an AnalysisRecord (load_record(analysis_file)) or None", record)
    s = config.SensitivityAnalysis
    assert s.analysis_file is not None
    record = record if record is not None else load_record(s.analysis_file)
    inputs = inputs or build_inputs(config, progress, calibration=needs_calibration(config))
    with numerics(config.Global.numerics, inputs.example_input.device):
        return _plan_step(config, inputs, progress, ratios_file, record)


def config_argument(config: object) -> Config:
    """A workflow function's ``config``: a :class:`~analysis.config.Config`, or a YAML file's path, loaded.

    Raises:
        ConfigError: For another type, or a path that is not a file.
    """
    if isinstance(config, Config):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise arguments.refuse("config", "a Config (load_config(path)) or the path of a YAML config", config)
    path = Path(arguments.path("config", config))
    if not path.is_file():
        raise ConfigError(f"config: {path} is not a file; pass the path of a YAML config, or a Config (load_config).")
    return load_config(path)


@dataclass
class Planned:
    """The plan step's plan and the ratios file that goes with it.

    Attributes:
        result: What the step returns, filled in by the later steps.
        ratios_yaml: The applied ratios' YAML, exported as ``channel_prune.yaml``.
        plan_yaml: A budget plan's ratios, written to ``<analysis_file>.plan.yaml`` once the export (if any)
            succeeded (None when the ratios came from a file).
    """

    result: PlanResult
    ratios_yaml: bytes
    plan_yaml: str | None = None


@dataclass
class _Pruned:
    """The pruned model of the verify step, kept for the export, and the note on its BatchNorm statistics."""

    model: nn.Module | None = None
    batchnorm: dict[str, Any] | None = None


def _plan_step(
    config: Config, inputs: Inputs, progress: bool | None, ratios_file: str | Path | None, record: AnalysisRecord
) -> PlanResult:
    """:func:`run_plan_step` under the config's numerics, one step after another: plan, verify, export, record;
    latency and the ONNX export are float32 (what is deployed)."""
    s = config.SensitivityAnalysis
    assert s.analysis_file is not None
    planned = make_plan(config, inputs, progress, ratios_file, record)
    result = planned.result
    pruned = _verify(config, inputs, record, result, progress) if s.verify else _Pruned()
    if s.export_dir is not None:
        _export(config, inputs, record, planned, pruned, progress)
    if planned.plan_yaml is not None:  # after the export: a failed export leaves the previous plan's file too
        atomic_write_text(plan_path(s.analysis_file), planned.plan_yaml)
    _record(Path(s.analysis_file), result)
    return result


def make_plan(
    config: Config, inputs: Inputs, progress: bool | None, ratios_file: str | Path | None, record: AnalysisRecord
) -> Planned:
    """The budget plan of the config (latency budgets measured on the runtime), else the ratios of ``ratios_file``
    or of the ``target_loss`` ratios file, as a plan."""
    s = config.SensitivityAnalysis
    assert s.analysis_file is not None
    analysis_file = Path(s.analysis_file)
    targets = budgets(config)
    if ratios_file is not None or not targets:
        source = Path(ratios_file) if ratios_file is not None else ratios_path(analysis_file)
        if ratios_file is None and not source.exists():
            raise ConfigError(f"No ratios to apply: {source} does not exist; set a budget or target_loss first.")
        plan = plan_from_ratios(inputs.model, inputs.example_input, record, load_ratios_yaml(source),
                                source=str(source))  # fmt: skip
        result = PlanResult(plan, None)
        result.estimates = estimate_notice(record)
        return Planned(result, source.read_bytes())  # the export copies the file as it was read
    plan, how, targets = _budget_plan(config, inputs, progress, record, targets)
    reached = ", ".join(f"{m} reduced by >= {v:g} (exactly {plan.reduction_of(m):.4f})" for m, v in targets.items())
    note = f"Budget plan: {reached} with {how}; coupled params share their group's ratio."
    text = channel_prune_yaml(plan.ratios, list(plan.ratios), plan.settings["criterion"], note=note)
    result = PlanResult(plan, plan_path(analysis_file))
    result.estimates = estimate_notice(record)
    return Planned(result, text.encode("utf-8"), text)


def _budget_plan(
    config: Config, inputs: Inputs, progress: bool | None, record: AnalysisRecord, targets: dict[str, float]
) -> tuple[Plan, str, dict[str, float]]:
    """The plan of the config's budgets, how it was chosen (for the ratios file's note), and the budgets it meets."""
    s = config.SensitivityAnalysis
    model, example = inputs.model, inputs.example_input
    also = {measure: value for measure, value in targets.items() if measure in ("macs", "params")}
    method = None
    if s.plan_method in SEARCHED_PLAN_METHODS:
        search = SearchSettings(evaluations=s.eval_budget, seed=config.Global.seed)
        scoring = _scoring(inputs, search, config.Global.seed)
        if s.plan_method == "recovered":
            scoring.probe = build_probe(config, inputs)
        method = MeasuredMethod(scoring, search, progress)
    if "latency" not in targets and "latency_ms" not in targets:
        measure, value = next(iter(also.items()))
        also.pop(measure)
        if method is not None:
            plan = build_measured_plan(model, example, record, value, method.scoring, measure, method.search,
                                       progress, also)  # fmt: skip
        else:
            plan = build_plan(model, example, record, value, measure, also=also)
        return plan, _chosen(plan, method), targets
    runtime = latency_runtime(config, example.device)
    with numerics("exact", example.device):
        plan = plan_for_latency(model, example, record, runtime, reduction=targets.get("latency"),
                                goal_ms=targets.get("latency_ms"), batch=s.latency_batch, progress=progress, also=also,
                                measured_method=method, table=s.latency_table,
                                tolerance=s.latency_tolerance, round_to=s.latency_round_to)  # fmt: skip
    outcome = plan.latency
    assert outcome is not None
    last = outcome.last
    low, high = last.measured.interval
    how = (f"{_chosen(plan, method)}; latency measured on {runtime.device}: {last.measured.reduction:.1%} faster "
           f"({low:.1%} to {high:.1%}; {last.measured_ms:.3f} ms, dense {last.dense_ms:.3f} ms around it), predicted "
           f"{last.predicted_reduction:.1%}, verdict {outcome.verdict}")  # fmt: skip
    return plan, how, {"latency": 1.0 - outcome.goal_ms / outcome.dense_ms, **also}


def _verify(
    config: Config, inputs: Inputs, record: AnalysisRecord, result: PlanResult, progress: bool | None
) -> _Pruned:
    """Prune the plan into a copy and measure it (raw and re-estimated; on the latency runtime when asked); the copy
    is kept for the export."""
    model, example, plan = inputs.model, inputs.example_input, result.plan
    baseline, evaluator = _evaluation(config, inputs, record, progress)
    pruned, result.verification = verify_plan(model, plan, evaluator, example, baseline,
                                              calibration=inputs.calibration, progress=progress)  # fmt: skip
    if wants_runtime_latency(config, plan):
        with numerics("exact", example.device):
            result.verification.runtime_latency = runtime_latency(config, plan, model, pruned, example)
    recalibrated = result.verification.recalibrated
    batchnorm = None
    if recalibrated is not None:
        batchnorm = _batchnorm_note(recalibrated.layers, recalibrated.calibration, result.calibration_check)
    return _Pruned(pruned, batchnorm)


def _export(
    config: Config, inputs: Inputs, record: AnalysisRecord, planned: Planned, pruned: _Pruned, progress: bool | None
) -> None:
    """Write the export folder: the verified copy, or a copy pruned (and re-estimated, its calibration checked) now."""
    s = config.SensitivityAnalysis
    assert s.export_dir is not None
    model, example, result = inputs.model, inputs.example_input, planned.result
    removals = result.plan.removals()
    model_out, batchnorm = pruned.model, pruned.batchnorm
    if model_out is None:
        model_out = jointly_pruned_copy(model, removals, example)
        if inputs.calibration is not None:
            stats = recalibrate_copy(model, model_out, removals, example, inputs.calibration.loader, progress)
            if stats.layers:  # the exported statistics get deployed: check their calibration images as verify does
                baseline, evaluator = _evaluation(config, inputs, record, progress)
                result.export_check = check_calibration(model, stats.layers, evaluator, baseline, inputs.calibration,
                                                        progress)  # fmt: skip
            batchnorm = _batchnorm_note(stats.layers, inputs.calibration.as_dict(), result.export_check)
    extra = {
        "plan": result.plan.as_dict(),
        "arch": config.Global.arch,
        "arch_kwargs": config.Global.arch_kwargs,
        "batchnorm": batchnorm or {"reestimated": False, "why": "no calibration images (Global.calib_list)"},
    }
    result.exported, result.onnx_check = write_export(s.export_dir, model_out, model, example, inputs.loader, extra,
                                                      planned.ratios_yaml, s.export_onnx, s.onnx_exporter)  # fmt: skip


def _chosen(plan: Plan, method: MeasuredMethod | None) -> str:
    """How the budget plan was chosen, for the ratios file's note."""
    if method is not None and method.scoring.probe is not None:
        steps = method.scoring.probe.steps
        return (f"the best of the measured search's finalists after {steps} steps of recovery each (loss "
                f"{plan.predicted_loss:.4f} measured with all groups pruned at once, before recovery)")  # fmt: skip
    if method is not None:
        return f"the best measured plan (loss {plan.predicted_loss:.4f} measured with all groups pruned at once)"
    return f"the smallest summed predicted loss ({plan.predicted_loss:.4f})"


def _scoring(inputs: Inputs, search: SearchSettings, seed: int) -> PlanScoring:
    """The measured method scores plans on the evaluation data, re-estimating BatchNorm on the calibration images."""
    calibration = inputs.calibration.loader if inputs.calibration is not None else None
    return PlanScoring.from_loaders(inputs.loader, calibration, search.calibration_images, seed)


def _batchnorm_note(layers: list[str], calibration: dict[str, Any], check: CalibrationCheck | None) -> dict[str, Any]:
    """What ``pruned_channels.json`` says about the exported BatchNorm statistics, with the calibration check."""
    note: dict[str, Any] = {"reestimated": True, "layers": layers, "calibration": calibration}
    if check is not None:
        note["reliable"] = check.reliable
        note["calibration_check"] = check.record().to_json()
        warning = check.warning()
        if warning is not None:
            note["warning"] = warning
    return note


def _evaluation(
    config: Config, inputs: Inputs, record: AnalysisRecord, progress: bool | None
) -> tuple[dict[str, Any], Callable[[nn.Module], dict[str, float]]]:
    """The dense model's metrics and how a pruned model is evaluated: on the labels, or, after a label-free
    analysis, against the dense model's own outputs on the same images (its metric is then measured too)."""
    metric = config.SensitivityAnalysis.metric
    if metric in LABEL_FREE_METRICS:
        scoring = PassMetrics(metric, labelled=config.Global.labels != "none")
        return fidelity_evaluator(scoring, inputs.model, inputs.loader, inputs.example_input.device)
    return dense_metrics(inputs, record, progress), lambda m: evaluate(
        m, inputs.loader, progress=progress, desc="verify"
    ).metrics()


def dense_metrics(inputs: Inputs, record: AnalysisRecord, progress: bool | None) -> dict[str, Any]:
    """The dense model's metrics on this data: the analysis's baseline when it was measured on the same data."""
    stored = record.baseline
    data = record.fingerprint.data if record.fingerprint is not None else None
    if data == inputs.loader.fingerprint() and "top1" in stored:
        return dict(stored)
    logger.info("Evaluating the dense model (the analysis file's baseline is from other data).")
    return evaluate(inputs.model, inputs.loader, progress=progress, desc="dense").metrics()


def _record(analysis_file: Path, result: PlanResult) -> None:
    """Store the plan (and verification) in the sidecar, atomically and under the analysis file's lock; the sidecar is
    read afresh there, as the measured method keeps its search log in it meanwhile."""
    with exclusive(analysis_file):
        sidecar = schema.load(analysis_file) or Sidecar()
        plan = result.plan.record()
        plan.ratios_file = str(result.ratios_file or result.plan.source)
        if result.verification is not None:
            plan.verification = result.verification.record()
        if result.exported is not None:
            plan.exported = {kind: str(path) for kind, path in result.exported.items()}
        sidecar.plan = plan
        schema.save(analysis_file, sidecar)

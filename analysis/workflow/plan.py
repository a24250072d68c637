"""The plan step: from an analysis file to a budget plan (or the ratios of a YAML), its joint verification, the
BatchNorm statistics re-estimated for the export, the exported pruned model, and the plan recorded in the sidecar.

Run by ``run.py plan`` and ``run.py verify``, and after the main job when the config sets a budget, ``verify`` or
``export_dir``; callable from Python as :func:`run_plan_step` with a loaded config and its inputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from analysis.config import Config, load_config
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
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import Plan, build_plan, plan_from_ratios
from analysis.planning.result import PlanResult
from analysis.planning.verify import CalibrationCheck, check_calibration, verify_plan
from analysis.structure.physical import jointly_pruned_copy
from analysis.workflow.export import write_export
from analysis.workflow.latency import (
    MeasuredMethod,
    latency_runtime,
    plan_for_latency,
    runtime_latency,
    wants_runtime_latency,
)

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
    config = _config(config)
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


def _config(config: object) -> Config:
    """``run_plan_step``'s ``config``: a :class:`~analysis.config.Config`, or a YAML file's path, loaded."""
    if isinstance(config, Config):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise arguments.refuse("config", "a Config (load_config(path)) or the path of a YAML config", config)
    path = Path(arguments.path("config", config))
    if not path.is_file():
        raise ConfigError(f"config: {path} is not a file; pass the path of a YAML config, or a Config (load_config).")
    return load_config(path)


def _plan_step(
    config: Config, inputs: Inputs, progress: bool | None, ratios_file: str | Path | None, record: AnalysisRecord
) -> PlanResult:
    """:func:`run_plan_step` under the config's numerics; latency and the ONNX export are float32 (what is deployed)."""
    s = config.SensitivityAnalysis
    assert s.analysis_file is not None
    analysis_file = Path(s.analysis_file)
    model, example = inputs.model, inputs.example_input
    targets = budgets(config)
    plan_yaml: str | None = None  # the budget plan's ratios file, when there is a budget
    if ratios_file is None and targets:
        also = {measure: value for measure, value in targets.items() if measure in ("macs", "params")}
        method = None
        if s.plan_method == "measured":
            search = SearchSettings(evaluations=s.eval_budget, seed=config.Global.seed)
            method = MeasuredMethod(_scoring(inputs, search, config.Global.seed), search, progress)
        if "latency" in targets or "latency_ms" in targets:
            runtime = latency_runtime(config, example.device)
            with numerics("exact", example.device):
                plan = plan_for_latency(model, example, record, runtime, reduction=targets.get("latency"),
                                        goal_ms=targets.get("latency_ms"), batch=s.latency_batch,
                                        progress=progress, also=also, measured_method=method,
                                        table=s.latency_table)  # fmt: skip
            assert plan.latency is not None
            last = plan.latency.attempts[-1]
            how = (f"{_chosen(plan, method)}; latency measured on {runtime.device}: {last['measured_ms']:.3f} ms "
                   f"(dense {last['dense_ms']:.3f} ms beside it; predicted {last['predicted_ms']:.3f} ms of the "
                   f"table's dense {plan.latency.dense_ms:.3f} ms)")  # fmt: skip
            targets = {"latency": 1.0 - plan.latency.goal_ms / plan.latency.dense_ms, **also}
        else:
            measure, value = next(iter(also.items()))
            also.pop(measure)
            if method is not None:
                plan = build_measured_plan(model, example, record, value, method.scoring, measure, method.search,
                                           progress, also)  # fmt: skip
            else:
                plan = build_plan(model, example, record, value, measure, also=also)
            how = _chosen(plan, method)
        source = plan_path(analysis_file)
        reached = ", ".join(f"{m} reduced by >= {v:g} (exactly {plan.reduction_of(m):.4f})" for m, v in targets.items())
        note = f"Budget plan: {reached} with {how}; coupled params share their group's ratio."
        text = channel_prune_yaml(plan.ratios, list(plan.ratios), plan.settings["criterion"], note=note)
        plan_yaml, ratios_yaml = text, text.encode("utf-8")  # written once the export (if any) succeeded
        result = PlanResult(plan, source)
    else:
        source = Path(ratios_file) if ratios_file is not None else ratios_path(analysis_file)
        if ratios_file is None and not source.exists():
            raise ConfigError(f"No ratios to apply: {source} does not exist; set a budget or target_loss first.")
        plan = plan_from_ratios(model, example, record, load_ratios_yaml(source), source=str(source))
        ratios_yaml = source.read_bytes()  # the export copies the file as it was read
        result = PlanResult(plan, None)
    result.estimates = estimate_notice(record)
    pruned, batchnorm = None, None
    if s.verify:
        baseline, evaluator = _evaluation(config, inputs, record, progress)
        pruned, result.verification = verify_plan(
            model, plan, evaluator, example, baseline, calibration=inputs.calibration, progress=progress
        )  # fmt: skip
        if wants_runtime_latency(config, plan):
            with numerics("exact", example.device):
                result.verification.runtime_latency = runtime_latency(config, plan, model, pruned, example)
        recalibrated = result.verification.recalibrated
        if recalibrated is not None:
            batchnorm = _batchnorm_note(recalibrated.layers, recalibrated.calibration, result.calibration_check)
    if s.export_dir is not None:
        if pruned is None:
            pruned = jointly_pruned_copy(model, plan.removals(), example)
            if inputs.calibration is not None:
                stats = recalibrate_copy(model, pruned, plan.removals(), example, inputs.calibration.loader, progress)
                if stats.layers:  # the exported statistics get deployed: check their calibration images as verify does
                    baseline, evaluator = _evaluation(config, inputs, record, progress)
                    result.export_check = check_calibration(model, stats.layers, evaluator, baseline,
                                                            inputs.calibration, progress)  # fmt: skip
                batchnorm = _batchnorm_note(stats.layers, inputs.calibration.as_dict(), result.export_check)
        extra = {
            "plan": plan.as_dict(),
            "arch": config.Global.arch,
            "arch_kwargs": config.Global.arch_kwargs,
            "batchnorm": batchnorm or {"reestimated": False, "why": "no calibration images (Global.calib_list)"},
        }
        result.exported, result.onnx_check = write_export(s.export_dir, pruned, model, example, inputs.loader, extra,
                                                          ratios_yaml, s.export_onnx)  # fmt: skip
    if plan_yaml is not None:  # after the export: a failed export leaves the previous plan's file too
        atomic_write_text(source, plan_yaml)
    _record(analysis_file, result)
    return result


def _chosen(plan: Plan, method: MeasuredMethod | None) -> str:
    """How the budget plan was chosen, for the ratios file's note."""
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
    return _baseline(inputs, record, progress), lambda m: evaluate(
        m, inputs.loader, progress=progress, desc="verify"
    ).metrics()


def _baseline(inputs: Inputs, record: AnalysisRecord, progress: bool | None) -> dict[str, Any]:
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

"""``run.py plan`` and ``run.py verify``: from an analysis file to a budget plan, its joint verification and the
exported pruned model; also run after the main job when the config sets a budget, ``verify`` or ``export_dir``."""

from __future__ import annotations

import argparse
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from analysis.cli._exit import EXIT_OK
from analysis.cli._job import run_job
from analysis.cli._logs import setup_logging
from analysis.cli._parser import CommandParser
from analysis.config import (
    LABEL_FREE_METRICS,
    PLAN_METHODS,
    Config,
    check_plan_granularity,
    config_from_data,
    load_config,
)
from analysis.engine._fidelity import Scoring as MetricScoring
from analysis.engine._fidelity import fidelity_evaluator
from analysis.engine.batchnorm import recalibrate_copy
from analysis.engine.evaluate import evaluate
from analysis.errors import AnalysisFileError, ConfigError
from analysis.inputs._job import Inputs, build_inputs, needs_calibration
from analysis.io import sidecar as schema
from analysis.io._lock import exclusive
from analysis.io.outputs import check_config_outputs, check_output_folder
from analysis.io.ratios_yaml import load_ratios_yaml, save_ratios_yaml
from analysis.io.results import ratios_path
from analysis.io.sidecar import ConfigRecord, Sidecar
from analysis.planning._estimates import estimate_notice
from analysis.planning.export import export_pruned
from analysis.planning.measured import Scoring, SearchSettings, build_measured_plan
from analysis.planning.plan import Plan, build_plan, plan_from_ratios
from analysis.planning.verify import CalibrationCheck, Verification, check_calibration, verify_plan
from analysis.structure.flops import format_count
from analysis.structure.physical import jointly_pruned_copy

logger = logging.getLogger(__name__)

PLAN_YAML_SUFFIX = ".plan.yaml"
EXPORTED_YAML = "channel_prune.yaml"


@dataclass
class PlanResult:
    """A plan, where its ratios went, and (when asked for) its verification and exported files."""

    plan: Plan
    ratios_file: Path | None
    verification: Verification | None = None
    exported: dict[str, Path] | None = None
    estimates: str | None = None
    export_check: CalibrationCheck | None = None  # the calibration check of an export without verification

    @property
    def calibration_check(self) -> CalibrationCheck | None:
        """The check of the calibration images the verified or exported statistics were re-estimated on."""
        return self.verification.calibration_check if self.verification is not None else self.export_check


def plan_path(analysis_file: str | Path) -> Path:
    """``<analysis_file>.plan.yaml``: the budget plan as an ACT ``ChannelPrune`` block."""
    return Path(f"{analysis_file}{PLAN_YAML_SUFFIX}")


def budget(config: Config) -> tuple[str, float] | None:
    """``(measure, target)`` of the config's budget, or None."""
    s = config.SensitivityAnalysis
    if s.target_macs_reduction is not None:
        return "macs", s.target_macs_reduction
    if s.target_params_reduction is not None:
        return "params", s.target_params_reduction
    return None


def wants_plan_step(config: Config) -> bool:
    """Whether the main job goes on to a plan (a budget, ``verify`` or ``export_dir`` is set)."""
    s = config.SensitivityAnalysis
    return budget(config) is not None or s.verify or s.export_dir is not None


def run_plan_step(
    config: Config, inputs: Inputs, progress: bool | None = None, ratios_file: str | Path | None = None
) -> PlanResult:
    """Plan (the config's budget, else the given or the ``target_loss`` ratios), then verify and export if asked.

    The plan and its verification are added to the sidecar (under the analysis file's lock), so the report shows
    them; the budget plan's ratios go to ``<analysis_file>.plan.yaml``.
    """
    s = config.SensitivityAnalysis
    assert s.analysis_file is not None
    analysis_file = Path(s.analysis_file)
    model, example = inputs.model, inputs.example_input
    target = budget(config)
    if ratios_file is None and target is not None:
        measure, value = target
        if s.plan_method == "measured":
            search = SearchSettings(evaluations=s.eval_budget, seed=config.Global.seed)
            plan = build_measured_plan(
                model,
                example,
                analysis_file,
                value,
                _scoring(inputs, search, config.Global.seed),
                measure,
                search,
                progress,
            )
            how = f"the best measured plan (loss {plan.predicted_loss:.4f} measured with all groups pruned at once)"
        else:
            plan = build_plan(model, example, analysis_file, value, measure)
            how = f"the smallest summed predicted loss ({plan.predicted_loss:.4f})"
        source = plan_path(analysis_file)
        note = (
            f"Budget plan: {measure} reduced by >= {value:g} (exactly {plan.reduction:.4f}) with {how}; coupled "
            "params share their group's ratio."
        )
        save_ratios_yaml(source, plan.ratios, list(plan.ratios), plan.settings["criterion"], note=note)
        result = PlanResult(plan, source)
    else:
        source = Path(ratios_file) if ratios_file is not None else ratios_path(analysis_file)
        if ratios_file is None and not source.exists():
            raise ConfigError(f"No ratios to apply: {source} does not exist; set a budget or target_loss first.")
        plan = plan_from_ratios(model, example, analysis_file, load_ratios_yaml(source), source=str(source))
        result = PlanResult(plan, None)
    result.estimates = estimate_notice(analysis_file)
    pruned, batchnorm = None, None
    if s.verify:
        baseline, evaluator = _evaluation(config, inputs, analysis_file, progress)
        pruned, result.verification = verify_plan(
            model, plan, evaluator, example, baseline, calibration=inputs.calibration
        )  # fmt: skip
        recalibrated = result.verification.recalibrated
        if recalibrated is not None:
            batchnorm = _batchnorm_note(recalibrated.layers, recalibrated.calibration, result.calibration_check)
    if s.export_dir is not None:
        if pruned is None:
            pruned = jointly_pruned_copy(model, plan.removals(), example)
            if inputs.calibration is not None:
                stats = recalibrate_copy(model, pruned, plan.removals(), example, inputs.calibration.loader)
                if stats.layers:  # the exported statistics get deployed: check their calibration images as verify does
                    baseline, evaluator = _evaluation(config, inputs, analysis_file, progress)
                    result.export_check = check_calibration(model, stats.layers, evaluator, baseline,
                                                            inputs.calibration)  # fmt: skip
                batchnorm = _batchnorm_note(stats.layers, inputs.calibration.as_dict(), result.export_check)
        extra = {
            "plan": plan.as_dict(),
            "arch": config.Global.arch,
            "arch_kwargs": config.Global.arch_kwargs,
            "batchnorm": batchnorm or {"reestimated": False, "why": "no calibration images (Global.calib_list)"},
        }
        result.exported = export_pruned(pruned, model, s.export_dir, extra)
        shutil.copyfile(source, Path(s.export_dir) / EXPORTED_YAML)
        result.exported["ratios"] = Path(s.export_dir) / EXPORTED_YAML
    _record(analysis_file, result)
    return result


def _scoring(inputs: Inputs, search: SearchSettings, seed: int) -> Scoring:
    """The measured method scores plans on the evaluation data, re-estimating BatchNorm on the calibration images."""
    calibration = inputs.calibration.loader if inputs.calibration is not None else None
    return Scoring.from_loaders(inputs.loader, calibration, search.calibration_images, seed)


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
    config: Config, inputs: Inputs, analysis_file: Path, progress: bool | None
) -> tuple[dict[str, Any], Callable[[nn.Module], dict[str, float]]]:
    """The dense model's metrics and how a pruned model is evaluated: on the labels, or, after a label-free
    analysis, against the dense model's own outputs on the same images (its metric is then measured too)."""
    metric = config.SensitivityAnalysis.metric
    if metric in LABEL_FREE_METRICS:
        scoring = MetricScoring(metric, labelled=config.Global.labels != "none")
        return fidelity_evaluator(scoring, inputs.model, inputs.loader, inputs.example_input.device)
    return _baseline(inputs, analysis_file, progress), lambda m: evaluate(
        m, inputs.loader, progress=progress, desc="verify"
    ).metrics()


def _baseline(inputs: Inputs, analysis_file: Path, progress: bool | None) -> dict[str, Any]:
    """The dense model's metrics on this data: the sidecar's when it was measured on the same data."""
    sidecar = schema.load(analysis_file) or Sidecar()
    stored = sidecar.baseline or {}
    data = sidecar.fingerprint.data if sidecar.fingerprint is not None else None
    if data == inputs.loader.fingerprint() and "top1" in stored:
        return dict(stored)
    logger.info("Evaluating the dense model (the analysis file's baseline is from other data).")
    return evaluate(inputs.model, inputs.loader, progress=progress, desc="dense").metrics()


def _record(analysis_file: Path, result: PlanResult) -> None:
    """Store the plan (and verification) in the sidecar, atomically and under the analysis file's lock."""
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


def format_plan(result: PlanResult) -> str:
    """The plan's groups and totals, and the verification next to the prediction."""
    plan = result.plan
    check = result.calibration_check
    unreliable = " [UNRELIABLE: calibration check failed]" if check is not None and not check.reliable else ""
    lines = [f"plan ({plan.source}): {len(plan.groups)} group(s) pruned"]
    width = max([len(g.members[0]) for g in plan.groups] + [5])
    for group in plan.groups:
        coupled = f" +{len(group.members) - 1} coupled" if len(group.members) > 1 else ""
        removed = f"{len(group.removed):>4}/{group.channels:<4} channels"
        lines.append(f"  {group.members[0]:<{width}}  ratio {group.ratio:.4f}  {removed}  predicted loss "
                     f"{_loss(group.predicted_loss)}{coupled}")  # fmt: skip
    beyond = [g.members[0] for g in plan.groups if math.isnan(g.predicted_loss)]
    if beyond:
        named = ", ".join(beyond[:3]) + (", ..." if len(beyond) > 3 else "")
        measured = "the verification below measures the plan" if result.verification else "verify measures it"
        lines.append(f"note: {len(beyond)} group(s) ({named}) have a ratio above the largest analysed one, so their "
                     f"loss and the plan's are unknown (no curve reaches there); {measured}.")  # fmt: skip
    dense, pruned = plan.dense, plan.pruned
    if plan.method == "measured" and plan.search is not None:
        search = plan.search
        budget_of = f" of {search['budget']}" if search.get("budget") is not None else ""  # older sidecars lack it
        ended = "; the search ended early: no untried plan was left" if search.get("exhausted") else ""
        lines.append(
            f"predicted loss (measured by the search, all groups pruned at once): {plan.predicted_loss:+.4f}; "
            f"{search['evaluations']}{budget_of} evaluations ({search['from_earlier_runs']} taken from earlier runs' "
            f"log, {search['repeated_plans']} trades passed over as repeats of measured plans), "
            f"{search['accepted_trades']} trades kept{ended}{unreliable}"
        )
        finalists = ", ".join(f"{f['name']} {f['top1']:.4f}" for f in search["finalists"])
        lines.append(f"finalists (top1, every calibration image): {finalists}; chosen: {search['chosen']}")
    else:
        lines.append(
            f"predicted loss (sum of single-layer losses): {_loss(plan.predicted_loss)}"
            + (f" (within {plan.gap:.4f} of the smallest summed predicted loss any plan meeting the budget can have)"
               if plan.source == "budget" else "")
        )  # fmt: skip
        if plan.notice is not None:
            lines.append(f"note: {plan.notice}.")
    lines.append(f"MACs {format_count(dense.macs)} -> {format_count(pruned.macs)} "
                 f"(-{1 - pruned.macs / dense.macs:.1%}), params {format_count(dense.params)} -> "
                 f"{format_count(pruned.params)} (-{1 - pruned.params / dense.params:.1%})")  # fmt: skip
    if result.ratios_file is not None:
        lines.append(f"ratios as an ACT ChannelPrune block: {result.ratios_file}")
    verification = result.verification
    if result.estimates is not None:
        how = "; the verification below measures it" if verification is not None else (
            "; measure it: python run.py verify --config_path <config> (or SensitivityAnalysis.verify: true)"
        )  # fmt: skip
        lines.append(f"note: {result.estimates}{how}.")
    if check is not None and not check.reliable:
        lines.append(f"WARNING: {check.warning()}")
    if verification is not None:
        losses = verification.losses()
        shown = next(m for m in (*LABEL_FREE_METRICS, "top1") if m in verification.baseline)  # the analysis metric
        also = "top5" if "top5" in losses else None
        predicted = _loss(plan.predicted_loss) + (", outside its meaningful range (see note)" if plan.notice else "")
        if plan.method == "measured":
            predicted += unreliable
        lines.append(
            f"verified (all groups pruned at once, predicted loss {predicted}): {shown} "
            f"{verification.baseline[shown]:.4f} ->"
        )
        lines.append(
            f"  raw (dense BatchNorm statistics):   {shown} {verification.pruned[shown]:.4f} (measured loss "
            f"{losses[shown]:+.4f})" + (f", {also} loss {losses[also]:+.4f}" if also else "")
        )
        recalibrated = verification.recalibrated
        if recalibrated is None:
            lines.append("  BatchNorm re-estimated: not measured (no calibration images; see Global.calib_list)")
        elif not recalibrated.layers:
            lines.append(
                "  BatchNorm re-estimated: the same model (no BatchNorm layer follows a layer the plan changes)"
            )
        else:
            again = verification.losses(reestimated=True)
            lines.append(
                f"  BatchNorm re-estimated ({len(recalibrated.layers)} layers, {recalibrated.images} calibration "
                f"images): {shown} {recalibrated.metrics[shown]:.4f} (measured loss {again[shown]:+.4f})"
                + (f", {also} loss {again[also]:+.4f}" if also else "")
                + unreliable
            )
        if check is not None:
            lines.append(f"  calibration check passed: {check.describe()}" if check.reliable else
                         "  calibration check FAILED: see the warning above")  # fmt: skip
        v = verification
        lines.append(f"measured MACs {format_count(v.dense_cost['macs'])} -> {format_count(v.pruned_cost['macs'])}, "
                     f"params {format_count(v.dense_cost['params'])} -> {format_count(v.pruned_cost['params'])}, "
                     f"checkpoint {v.checkpoint_bytes['dense'] / 1e6:.2f} MB -> "
                     f"{v.checkpoint_bytes['pruned'] / 1e6:.2f} MB")  # fmt: skip
        for batch, times in v.latency_ms.items():
            lines.append(f"latency {batch.replace('_', ' ')} on {v.device}: {times['dense']:.2f} ms -> "
                         f"{times['pruned']:.2f} ms ({times['dense'] / times['pruned']:.2f}x, median)")  # fmt: skip
    if result.exported is not None:
        if result.verification is None and check is not None:
            lines.append(f"calibration check of the exported statistics: {check.describe()}")
        statistics = (" (its BatchNorm statistics re-estimated on calibration images that failed the calibration "
                      "check: unreliable)") if unreliable else ""  # fmt: skip
        lines.append(f"exported: {', '.join(str(p) for p in result.exported.values())}{statistics}")
    return "\n".join(lines)


def _loss(value: float) -> str:
    """A predicted loss as printed: signed, or ``unknown`` (NaN) where a ratio lies beyond the analysed ones."""
    return "unknown" if math.isnan(value) else f"{value:+.4f}"


def build_plan_parser() -> CommandParser:
    """The parser of ``run.py plan``."""
    parser = CommandParser(
        prog="run.py plan",
        description="Allocate per-layer ratios reaching a MACs or params reduction with the smallest predicted loss, "
        "from the analysis file the config names (the analysis runs first if that file is missing); optionally "
        "verify the jointly pruned model and export it.",
    )
    parser.add_argument("--config_path", required=True, help="YAML config (Global + SensitivityAnalysis blocks)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target_macs_reduction", type=float, help="e.g. 0.4 for 40%% fewer MACs")
    target.add_argument("--target_params_reduction", type=float, help="e.g. 0.4 for 40%% fewer params")
    parser.add_argument("--method", choices=PLAN_METHODS, help="knapsack (from the sensitivity curves, default) or "
                        "measured (improved with joint evaluations, BatchNorm re-estimated)")  # fmt: skip
    parser.add_argument(
        "--eval_budget",
        type=int,
        help="joint evaluations of the measured method's search (default: 10 per group of coupled convs)",
    )
    _add_common(parser)
    return parser


def build_verify_parser() -> CommandParser:
    """The parser of ``run.py verify``."""
    parser = CommandParser(
        prog="run.py verify",
        description="Prune a ratios YAML (ChannelPrune block) into the model all at once, evaluate it on the "
        "analysis data, and measure MACs, params, checkpoint size and latency next to the prediction.",
    )
    parser.add_argument("analysis_file", help="the analysis pickle the ratios were derived from")
    parser.add_argument("--ratios", required=True, help="YAML with a ChannelPrune block (e.g. *.plan.yaml)")
    parser.add_argument("--config_path", help="YAML config (default: the one stored in the analysis file's sidecar)")
    _add_common(parser, verify_flag=False)
    return parser


def _add_common(parser: CommandParser, verify_flag: bool = True) -> None:
    if verify_flag:
        parser.add_argument("--verify", action="store_true", help="prune all groups at once and measure the model")
    parser.add_argument("--export_dir", help="write pruned_model.pt, pruned_state_dict.pt, pruned_channels.json")
    parser.add_argument("--no_report", action="store_true", help="do not rewrite the report")
    parser.add_argument("--quiet", action="store_true", help="only warnings, errors and results")
    parser.add_overrides()


def plan_main(argv: Sequence[str]) -> int:
    """``run.py plan``: budget plan from the config's analysis file (analysing first if it is missing)."""
    args = build_plan_parser().parse(argv)
    setup_logging(args.quiet)
    flags = {
        "SensitivityAnalysis.target_macs_reduction": args.target_macs_reduction,
        "SensitivityAnalysis.target_params_reduction": args.target_params_reduction,
        "SensitivityAnalysis.verify": True if args.verify else None,
        "SensitivityAnalysis.export_dir": args.export_dir,
        "SensitivityAnalysis.plan_method": args.method,
        "SensitivityAnalysis.eval_budget": args.eval_budget,
    }
    if args.export_dir is not None:
        check_output_folder(args.export_dir, "--export_dir")
    config = load_config(args.config_path, args.overrides, flags)
    if budget(config) is None:
        raise ConfigError("run.py plan needs --target_macs_reduction or --target_params_reduction (or "
                          "SensitivityAnalysis.target_macs_reduction in the config).")  # fmt: skip
    check_config_outputs(config)
    progress = False if args.quiet else None
    inputs = build_inputs(config, progress, calibration=needs_calibration(config))
    analysis_file = config.SensitivityAnalysis.analysis_file
    assert analysis_file is not None
    if not Path(analysis_file).is_file():
        logger.info("%s does not exist yet: running the analysis first.", analysis_file)
        run_job(config, progress=progress, inputs=inputs)
    return _finish(config, inputs, args, progress)


def verify_main(argv: Sequence[str]) -> int:
    """``run.py verify``: apply a ratios YAML jointly and measure the pruned model."""
    args = build_verify_parser().parse(argv)
    setup_logging(args.quiet)
    if args.export_dir is not None:
        check_output_folder(args.export_dir, "--export_dir")
    if not Path(args.analysis_file).is_file():
        raise AnalysisFileError(f"Analysis file {args.analysis_file} does not exist; pass the .pkl a run wrote.")
    flags = {"SensitivityAnalysis.analysis_file": args.analysis_file}
    if args.config_path:
        config = load_config(args.config_path, args.overrides, flags)
    else:
        stored = (schema.load(args.analysis_file) or Sidecar()).config or ConfigRecord()
        raw = stored.cli_config(target_macs_reduction=None, target_params_reduction=None)
        if raw is None:
            raise ConfigError(f"{args.analysis_file} does not record the config that wrote it (Python API run); "
                              "pass --config_path.")  # fmt: skip
        config = config_from_data(raw, stored.source or args.analysis_file, args.overrides, flags)
    # --ratios gives the ratios, so verifying and exporting need no target in the config: set after its validation
    config.SensitivityAnalysis.verify = True
    if args.export_dir is not None:
        config.SensitivityAnalysis.export_dir = args.export_dir
    check_plan_granularity(config.SensitivityAnalysis)
    check_config_outputs(config)
    load_ratios_yaml(args.ratios)  # read before the model and the data load, so a bad file is refused at once
    progress = False if args.quiet else None
    inputs = build_inputs(config, progress, calibration=needs_calibration(config))
    return _finish(config, inputs, args, progress, ratios_file=args.ratios)


def _finish(config: Config, inputs: Inputs, args: argparse.Namespace, progress: bool | None,
            ratios_file: str | None = None) -> int:  # fmt: skip
    result = run_plan_step(config, inputs, progress, ratios_file)
    print(format_plan(result))
    if config.SensitivityAnalysis.report and not args.no_report:
        from analysis.cli._commands import write_reports

        written = write_reports(config.SensitivityAnalysis.analysis_file or "", config.SensitivityAnalysis.target_loss)
        print(f"report: {written[-1]}")
    return EXIT_OK


PLAN_COMMANDS = {"plan": plan_main, "verify": verify_main}

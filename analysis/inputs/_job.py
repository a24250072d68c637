"""Building a job's inputs from a config (model, data, example batch) and running its analysis.

Shared by the main command, torchrun ranks and the plan/verify subcommands.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.config import Config
from analysis.engine._early_stop import early_stop_from
from analysis.engine.evaluate import evaluate
from analysis.engine.reference import EngineSettings
from analysis.engine.run import AnalysisOutcome, run_analysis
from analysis.errors import ConfigError
from analysis.inputs.calibration import CalibrationSet, build_calibration_set
from analysis.inputs.data import EvalLoader, apply_data_cache, build_eval_loader
from analysis.inputs.device import resolve_device
from analysis.inputs.models import build_model, count_outputs
from analysis.scale._shards import ShardSpec

logger = logging.getLogger(__name__)

EXAMPLE_BATCH = 32  # images used to trace the model and to check masking against physical pruning


@dataclass
class Inputs:
    """The model and the data of a job, built once (a torchrun rank analyses twice with them)."""

    model: torch.nn.Module
    loader: EvalLoader
    example_input: torch.Tensor
    calibration: CalibrationSet | None = None


def build_inputs(config: Config, progress: bool | None = None, calibration: bool = False) -> Inputs:
    """Build the model and the evaluation data of ``config`` (decoded into RAM when the cache allows), and with
    ``calibration`` its calibration images for BatchNorm re-estimation (always decoded into RAM, so that a broken
    one fails before any output is written)."""
    g = config.Global
    device = resolve_device(g.device)
    torch.manual_seed(g.seed)
    loader = build_eval_loader(g, device)
    logger.info("data: %s, %d images", loader.layout, loader.num_samples)
    model = build_model(g).to(device)
    loader.check_labels(count_outputs(model, g.img_size, device))
    apply_data_cache(loader, g.data_cache, g.cache_max_gb, progress)
    calibration_set = build_calibration_set(g, device, loader, progress) if calibration else None
    if calibration_set is not None:
        logger.info("calibration: %s", calibration_set.describe())
    return Inputs(model, loader, next(iter(loader))[0][:EXAMPLE_BATCH], calibration_set)


def needs_calibration(config: Config) -> bool:
    """Whether the job re-estimates BatchNorm statistics: adaptive BN sensitivities, a measured plan, a verification
    (which reports raw and re-estimated numbers) or an export (which carries the re-estimated statistics)."""
    s = config.SensitivityAnalysis
    return s.adaptive_bn or s.verify or s.export_dir is not None or s.plan_method == "measured"


def run_job(
    config: Config,
    overwrite: bool = False,
    progress: bool | None = None,
    shard: ShardSpec | None = None,
    analysis_file: str | Path | None = None,
    baseline_only: bool = False,
    inputs: Inputs | None = None,
) -> AnalysisOutcome:
    """The main job: build model and data from ``config`` (unless given), run the sensitivity analysis, derive
    ratios (or, for a shard, analyse its share of the convs into ``analysis_file``, by default the shard's file)."""
    g, s = config.Global, config.SensitivityAnalysis
    inputs = inputs or build_inputs(config, progress, calibration=needs_calibration(config))
    model, loader, example_input = inputs.model, inputs.loader, inputs.example_input

    def evaluate_model(candidate: torch.nn.Module) -> dict[str, float]:
        return evaluate(candidate, loader, progress=progress, desc="eval").metrics()

    settings = EngineSettings(
        ratios=s.pruned_ratios,
        criterion=s.criterion,
        group_reduction=s.group_reduction,
        metric=s.metric,
        metric_mode=s.metric_mode,
        progress=progress,
        engine=s.engine,
        precision=s.precision,
        seed=g.seed,
        granularity=s.granularity,
        early_stop=early_stop_from(s.early_stop_mode, s.early_stop_value),
        round_to=s.round_to,
        adaptive_bn=s.adaptive_bn,
    )
    calibration = inputs.calibration if s.adaptive_bn else None
    if s.adaptive_bn and calibration is None:
        raise ConfigError(
            "SensitivityAnalysis.adaptive_bn needs calibration images and none were found: name a list file or a "
            "folder of training images in Global.calib_list."
        )
    assert s.analysis_file is not None
    return run_analysis(
        model,
        evaluate_model,
        example_input,
        analysis_file or (shard.path(s.analysis_file) if shard else s.analysis_file),
        settings,
        prune_params=s.prune_params_name,
        skip_params=s.skip_params,
        target_loss=None if shard or baseline_only else s.target_loss,
        data_fingerprint=loader.fingerprint(),
        config=dataclasses.asdict(config),
        overwrite=overwrite,
        batches=loader,
        shard=shard,
        baseline_only=baseline_only,
        calibration=calibration.loader if calibration else None,
        calibration_fingerprint=calibration.fingerprint() if calibration else None,
    )

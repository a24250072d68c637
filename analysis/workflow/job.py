"""The main job from a config: build (or reuse) its inputs, run the sensitivity analysis, derive ratios.

Shared by the main command, torchrun ranks and the plan/verify subcommands.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from analysis.config import Config
from analysis.engine.evaluate import evaluate
from analysis.engine.run import AnalysisOutcome
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.errors import ConfigError
from analysis.inputs.build import Inputs, build_inputs, needs_calibration
from analysis.inputs.model_preprocessing import with_model_preprocessing
from analysis.scale.shards import ShardSpec
from analysis.workflow.analyse import Selection, run_analysis


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

    settings = EngineSettings.from_section(s, seed=g.seed, numerics=g.numerics, progress=progress)
    calibration = inputs.calibration if s.adaptive_bn else None
    if s.adaptive_bn and calibration is None:
        raise ConfigError(
            "SensitivityAnalysis.adaptive_bn needs calibration images and none were found: name a list file or a "
            "folder of training images in Global.calib_list."
        )
    assert s.analysis_file is not None
    data = AnalysisData(
        evaluate=evaluate_model,
        example_input=example_input,
        batches=loader,
        fingerprint=loader.fingerprint(),
        calibration=calibration.loader if calibration else None,
        calibration_fingerprint=calibration.fingerprint() if calibration else None,
    )
    return run_analysis(
        model,
        data,
        analysis_file or (shard.path(s.analysis_file) if shard else s.analysis_file),
        settings,
        selection=Selection(prune_params=s.prune_params_name, skip_params=s.skip_params, shard=shard, units=s.units),
        target_loss=None if shard or baseline_only else s.target_loss,
        config=_config_record(config, inputs),
        overwrite=overwrite,
        baseline_only=baseline_only,
    )


def _config_record(config: Config, inputs: Inputs) -> dict[str, Any]:
    """The resolved config as the sidecar records it, with what the inputs added: whether the weights are random and
    where the preprocessing keys the YAML left unset came from."""
    resolved = with_model_preprocessing(config, inputs.preprocessing)
    bookkeeping = ("explicit_keys", "ratios_from")
    record = {key: value for key, value in dataclasses.asdict(resolved).items() if key not in bookkeeping}
    if inputs.random_weights:
        record["random_weights"] = True
    if inputs.preprocessing is not None:
        record["preprocessing_from"] = inputs.preprocessing.source
    return record

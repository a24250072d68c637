"""Building a job's inputs from a config: the model, the evaluation data, the example batch, calibration images.

Shared by the main command, torchrun ranks and the plan/verify subcommands.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from analysis.config import SEARCHED_PLAN_METHODS, Config
from analysis.inputs.calibration import CalibrationSet, build_calibration_set
from analysis.inputs.data import EvalLoader, apply_data_cache, build_eval_loader
from analysis.inputs.device import resolve_device
from analysis.inputs.model_preprocessing import (
    PREPROCESSING_KEYS,
    ModelPreprocessing,
    resolve_model_preprocessing,
    with_model_preprocessing,
)
from analysis.inputs.models import build_model, count_outputs, random_weights_warning

logger = logging.getLogger(__name__)

EXAMPLE_BATCH = 32  # images used to trace the model and to check masking against physical pruning


@dataclass
class Inputs:
    """The model and the data of a job, built once (a torchrun rank analyses twice with them)."""

    model: torch.nn.Module
    loader: EvalLoader
    example_input: torch.Tensor
    calibration: CalibrationSet | None = None
    random_weights: bool = False
    # the model's own, when it filled keys the YAML left unset (with_model_preprocessing gives the config they make)
    preprocessing: ModelPreprocessing | None = None


def build_inputs(config: Config, progress: bool | None = None, calibration: bool = False) -> Inputs:
    """Build the model and the evaluation data of ``config`` (decoded into RAM when the cache allows), and with
    ``calibration`` its calibration images for BatchNorm re-estimation (always decoded into RAM, so that a broken
    one fails before any output is written). On a GPU both decoded caches are then kept in GPU memory or pinned
    host memory (``Global.device_cache_share``; the placements are in ``loader.cache_placement``)."""
    device = resolve_device(config.Global.device)
    torch.manual_seed(config.Global.seed)
    random_weights = random_weights_warning(config.Global)
    if random_weights is not None:
        logger.warning(random_weights)
    preprocessing = resolve_model_preprocessing(config)
    g = with_model_preprocessing(config, preprocessing).Global  # the keys the YAML leaves unset: the model's own
    if preprocessing is not None:
        chosen = ", ".join(f"{key}={getattr(g, key)}" + (" (YAML)" if f"Global.{key}" in config.explicit_keys else "")
                           for key in PREPROCESSING_KEYS)  # fmt: skip
        logger.info("preprocessing from %s: %s", preprocessing.source, chosen)
    loader = build_eval_loader(g, device)
    logger.info("data: %s, %d images", loader.layout, loader.num_samples)
    model = build_model(g).to(device)
    loader.check_labels(count_outputs(model, g.img_size, device))
    if apply_data_cache(loader, g.data_cache, g.cache_max_gb, progress):
        loader.place_cache(g.device_cache_share, "decoded evaluation images")  # on a GPU: GPU or pinned memory
    calibration_set = build_calibration_set(g, device, loader, progress) if calibration else None
    if calibration_set is not None:
        logger.info("calibration: %s", calibration_set.describe())
    example_input = next(iter(loader))[0][:EXAMPLE_BATCH]
    return Inputs(model, loader, example_input, calibration_set, random_weights is not None, preprocessing)


def needs_calibration(config: Config) -> bool:
    """Whether the job re-estimates BatchNorm statistics: adaptive BN sensitivities, a measured plan, a verification
    (which reports raw and re-estimated numbers) or an export (which carries the re-estimated statistics)."""
    s = config.SensitivityAnalysis
    return s.adaptive_bn or s.verify or s.export_dir is not None or s.plan_method in SEARCHED_PLAN_METHODS

"""What a recovery run is made of, read from the config: ACT's ``TrainConfig`` and ``Distillation``, the training
batches, the precision and the run's identity; shared by ``compress`` and the ``recovered`` plan method's probes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from analysis.config import Config, RecoveryConfig
from analysis.errors import ConfigError
from analysis.inputs.build import Inputs
from analysis.inputs.data import Preprocess
from analysis.inputs.model_preprocessing import with_model_preprocessing
from analysis.io.fingerprint import json_fingerprint, model_fingerprint
from analysis.recovery.act import DistillSettings, TrainSettings, read_distillation, read_train_config
from analysis.recovery.data import Sharding, TrainBatches, build_train_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """How the pruned model is recovered: ACT's ``TrainConfig`` and ``Distillation``, read."""

    train: TrainSettings
    distill: DistillSettings


def read_recipe(config: Config, why: str = "run.py compress", announce: bool = True) -> Recipe:
    """The config's ``TrainConfig`` and ``Distillation``, read before any model or data is loaded; ``why`` names what
    needs them in the labels error; ``announce``: log the defaults taken, the keys ignored and the old names read (off
    for the command line's early check, which the workflow follows by reading them again).

    Raises:
        ConfigError: For a key or type of either block with no PyTorch counterpart, naming it.
    """
    if config.Global.labels == "none":
        raise ConfigError(f"{why} keeps the best recovered weights by top1 on labelled evaluation images; "
                          "Global.labels is none: give the evaluation list its labels.")  # fmt: skip
    blocks = config.act_blocks
    if announce and "TrainConfig" not in blocks:
        logger.warning("%s has no TrainConfig block: ACT's defaults apply (100 epochs, SGD at a constant learning rate "
                       "of 0.02); add one (docs/recovery.md).", config.source or "the config")  # fmt: skip
    if announce and "Distillation" not in blocks:
        logger.info("No Distillation block: the pruned model learns the dense model's logits (l2, ACT's default).")
    return Recipe(read_train_config(blocks.get("TrainConfig"), announce),
                  read_distillation(blocks.get("Distillation"), legacy_note=announce))  # fmt: skip


def resolve_precision(r: RecoveryConfig, device: torch.device) -> str:
    """``Recovery.precision`` for this device: auto is bf16 on a GPU, fp32 elsewhere."""
    if r.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return r.precision


def training_preprocess(config: Config, inputs: Inputs) -> Preprocess:
    """The model's own preprocessing (timm's data config where the model is timm's), as training normalises."""
    return Preprocess.from_config(with_model_preprocessing(config, inputs.preprocessing).Global)


def train_batches(config: Config, inputs: Inputs, preprocess: Preprocess, sharding: Sharding) -> TrainBatches:
    """The training batches of ``config`` for this process's share (page-locked when training on a GPU)."""
    device = inputs.example_input.device
    return build_train_batches(config, preprocess, labelled=config.Recovery.label_loss_weight > 0, sharding=sharding,
                               pin_memory=device.type == "cuda")  # fmt: skip


def run_identity(
    config: Config, inputs: Inputs, recipe: Recipe, batches: TrainBatches, preprocess: Preprocess, **extra: Any
) -> str:
    """Fingerprint of what a recovery's result depends on (dense model, recipe, ``Recovery`` keys, training images,
    preprocessing, evaluation images) and of ``extra`` (the plan, the probe's length): a checkpoint or a probe's
    stored score is reused only under the same one."""
    r = config.Recovery
    return json_fingerprint({
        "dense": model_fingerprint(inputs.model),
        **extra,
        "recipe": recipe.train.as_dict(),
        "distillation": recipe.distill.as_dict(),
        "recovery": {key: value for key, value in dataclasses.asdict(r).items()
                     if key not in ("output_dir", "num_workers", "resume", "probe_steps")},
        "train_images": [sample.path for sample in batches.images.samples],
        "batch_size": batches.batch_size,
        "preprocess": preprocess.identity(),
        "eval_data": inputs.loader.fingerprint(),
    })  # fmt: skip


@contextmanager
def seeded(config: Config, device: torch.device) -> Iterator[None]:
    """Seed PyTorch's generators with ``Recovery.seed`` (else ``Global.seed``) for one recovery, and give the caller's
    generator states back afterwards (dropout and initialisation then depend on the seed alone)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.Recovery.seed if config.Recovery.seed is not None else config.Global.seed)
        yield

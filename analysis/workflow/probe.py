"""The ``recovered`` plan method's probe: a finalist of the measured search pruned, its BatchNorm statistics
re-estimated, recovered for ``Recovery.probe_steps`` steps of the config's own recipe and scored on the evaluation
images.

Every finalist trains from the same seed on the same batches with the same schedule (``TrainConfig`` with
``train_iter`` set to the probe's length, evaluated once at its end; ``target_metric`` and ``origin_metric`` do not
stop it, so no finalist trains shorter than another). Scores are kept in the search log under a setting named by the
probe's fingerprint, so a resumed plan does not train a finalist twice.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.config import Config
from analysis.engine.batchnorm import recalibrate_copy
from analysis.engine.evaluate import evaluate
from analysis.inputs.build import Inputs
from analysis.inputs.data import Preprocess
from analysis.inputs.numerics import numerics
from analysis.planning.measured import Removals
from analysis.recovery.act import TrainSettings
from analysis.recovery.data import Sharding, TrainBatches
from analysis.recovery.train import RecoveryJob, recover
from analysis.structure.physical import jointly_pruned_copy
from analysis.workflow.recipe import (
    Recipe,
    read_recipe,
    resolve_precision,
    run_identity,
    seeded,
    train_batches,
    training_preprocess,
)

logger = logging.getLogger(__name__)


@dataclass
class RecoveryProbe:
    """Scores plans after a brief recovery (:class:`analysis.planning.measured.FinalistProbe`).

    Attributes:
        config: The config (``Recovery`` keys, ``Global.numerics`` and seed).
        inputs: The dense model, its evaluation and calibration images.
        recipe: ``TrainConfig`` shortened to the probe and ``Distillation``.
        batches: The training batches (the first ``steps`` of them train every finalist).
        preprocess: The model's normalisation.
        identity: Fingerprint of everything a score depends on.
    """

    config: Config
    inputs: Inputs
    recipe: Recipe
    batches: TrainBatches
    preprocess: Preprocess
    identity: str

    @property
    def setting(self) -> str:
        """The search log's setting of this probe's scores."""
        return f"probe {self.steps} steps {self.identity}"

    @property
    def steps(self) -> int:
        """The recovery steps each finalist trains (``Recovery.probe_steps``)."""
        return self.config.Recovery.probe_steps

    def score(self, removals: Removals) -> dict[str, float]:
        """The metrics of the dense model with ``removals`` pruned, re-estimated and recovered for the probe's steps."""
        model, example = self.inputs.model, self.inputs.example_input
        pruned = jointly_pruned_copy(model, removals, example)
        if self.inputs.calibration is not None:
            recalibrate_copy(model, pruned, removals, example, self.inputs.calibration.loader, False)
        r = self.config.Recovery
        device = example.device
        with tempfile.TemporaryDirectory(prefix="recovery-probe-") as folder:
            job = RecoveryJob(self.recipe.train, self.recipe.distill, resolve_precision(r, device), r.label_loss_weight,
                              Path(folder), self.identity, self.preprocess, resume=False, progress=False)  # fmt: skip
            with seeded(self.config, device):
                outcome = recover(pruned, model, self.batches, self._evaluate, job, {})
        return dict(outcome.best.metrics)

    def _evaluate(self, candidate: torch.nn.Module) -> dict[str, float]:
        with numerics(self.config.Global.numerics, self.inputs.example_input.device):
            return evaluate(candidate, self.inputs.loader, progress=False).metrics()


def build_probe(config: Config, inputs: Inputs) -> RecoveryProbe:
    """The probe of ``config``: its recipe trained for ``Recovery.probe_steps`` steps on one process.

    Raises:
        ConfigError: For a ``TrainConfig`` or ``Distillation`` key with no PyTorch counterpart, naming it.
        UserError: For missing or unreadable training images.
    """
    recipe = read_recipe(config, why="SensitivityAnalysis.plan_method: recovered")
    steps = config.Recovery.probe_steps
    train: TrainSettings = dataclasses.replace(
        recipe.train,
        epochs=None,
        train_iter=steps,
        eval_iter=steps,
        logging_iter=steps,
        origin_metric=None,
        target_metric=None,
    )
    probe_recipe = Recipe(train, recipe.distill)
    preprocess = training_preprocess(config, inputs)
    batches = train_batches(config, inputs, preprocess, Sharding())
    calibration = inputs.calibration.loader.fingerprint() if inputs.calibration is not None else None
    identity = run_identity(config, inputs, probe_recipe, batches, preprocess, calibration=calibration)
    logger.info("Recovery probe: %d steps of %d images for each finalist (%s, learning rate %s).", steps,
                batches.batch_size, train.optimizer.describe(), train.schedule.type)  # fmt: skip
    return RecoveryProbe(config, inputs, probe_recipe, batches, preprocess, identity)

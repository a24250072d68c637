"""``run.py compress``: the whole pipeline ACT's ``ac.compress`` runs, from one config.

analysis (or its resume) -> plan (``--ratios``, the config's budget, its ``target_loss`` ratios, or ACT's
``ChannelPrune.pruned_ratio``) -> prune -> BatchNorm re-estimation -> recovery (distillation from the dense model as
``TrainConfig`` and ``Distillation`` say, resumable) -> export (PyTorch files and ONNX, as ``run.py plan`` exports) ->
the dense, one-shot, re-estimated and recovered metrics recorded in the sidecar with the plan.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from analysis.config import Config
from analysis.engine.batchnorm import recalibrate_copy
from analysis.engine.evaluate import evaluate
from analysis.errors import ConfigError, UserError
from analysis.inputs import arguments
from analysis.inputs.build import Inputs, build_inputs
from analysis.inputs.numerics import numerics
from analysis.io import sidecar as schema
from analysis.io.lock import exclusive
from analysis.io.ratios_yaml import channel_prune_yaml
from analysis.io.record import AnalysisRecord, load_record
from analysis.io.sidecar import RecoveryRecord, Sidecar
from analysis.planning.measured import Removals
from analysis.planning.plan import Plan, plan_from_ratios
from analysis.planning.result import PlanResult
from analysis.recovery.checkpoint import remove_checkpoints
from analysis.recovery.data import Sharding
from analysis.recovery.train import RecoveryJob, RecoveryOutcome, check_origin_metric, recover
from analysis.scale.distributed import agree
from analysis.structure.physical import jointly_pruned_copy
from analysis.workflow.export import write_export
from analysis.workflow.job import run_job
from analysis.workflow.plan import Planned, budgets, config_argument, dense_metrics, make_plan
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

EXPORT_FOLDER = "export"
DEFAULT_FOLDER = "compress"


@dataclass
class CompressResult:
    """What ``compress`` did: the plan, the metrics at each stage, the recovery and the exported files.

    Attributes:
        plan: The applied plan (None on a torchrun process other than the first, which records it).
        dense: The dense model's metrics on the evaluation images.
        one_shot: The pruned model's, before any training (BatchNorm statistics as the dense model left them).
        reestimated: After BatchNorm re-estimation on calibration images (None without calibration images).
        recovered: The recovered model's (the best evaluation's weights).
        recovery: How training went.
        exported: The recovered model's files by kind.
        folder: Where checkpoints, the log and the export are.
    """

    plan: Plan | None
    dense: dict[str, float]
    one_shot: dict[str, float]
    reestimated: dict[str, float] | None
    recovered: dict[str, float]
    recovery: RecoveryOutcome
    exported: dict[str, Path]
    folder: Path


def recovery_folder(config: Config) -> Path:
    """``Recovery.output_dir``, else ``compress/`` beside the analysis file."""
    if config.Recovery.output_dir is not None:
        return Path(config.Recovery.output_dir)
    analysis_file = config.SensitivityAnalysis.analysis_file
    assert analysis_file is not None
    return Path(analysis_file).parent / DEFAULT_FOLDER


def run_compress(
    config: Config | str | os.PathLike[str],
    progress: bool | None = None,
    ratios_file: str | Path | None = None,
    fresh: bool = False,
    inputs: Inputs | None = None,
) -> CompressResult:
    """Analyse (or resume), plan, prune, recover and export the model of ``config``. From Python::

        result = run_compress("configs/act/digits_resnet_prune_dis.yaml")
        result.dense["top1"], result.one_shot["top1"], result.recovered["top1"], result.exported["state_dict"]

    Args:
        config: A loaded config, or the path of a YAML config.
        progress: Progress bars (None: on a terminal).
        ratios_file: Apply this ratios YAML (a ``ChannelPrune`` block) instead of the config's plan.
        fresh: Remove the checkpoints of an earlier recovery and start over.
        inputs: The model and data built from ``config`` (built here when not given).

    Raises:
        UserError: For bad settings or data (one sentence naming the key or file), a checkpoint of another run.
    """
    config = config_argument(config)
    progress = arguments.optional(arguments.flag, "progress", progress)
    recipe = read_recipe(config)
    run = _Run(config, inputs or build_inputs(config, progress, calibration=True), progress)
    planned, removals, dense = _planned_on_leader(run, ratios_file)
    check_origin_metric(recipe.train, dense)
    model, example = run.inputs.model, run.inputs.example_input
    pruned = jointly_pruned_copy(model, removals, example)
    one_shot = run.measure(pruned, "one-shot")
    reestimated = None
    if run.inputs.calibration is not None:
        recalibrate_copy(model, pruned, removals, example, run.inputs.calibration.loader, progress)
        reestimated = run.measure(pruned, "re-estimated")
    logger.info("Dense top1 %.4f; pruned at once %.4f, BatchNorm re-estimated %s.", dense["top1"], one_shot["top1"],
                "-" if reestimated is None else f"{reestimated['top1']:.4f}")  # fmt: skip
    if fresh and _leader():
        remove_checkpoints(run.folder)
    outcome, job = _recover(run, recipe, removals, pruned, dense)
    recovered = dict(outcome.best.metrics)  # the model holds the best evaluation's weights: no second pass needed
    logger.info("Recovered top1 %.4f (best of %d evaluations, step %d of %d; %s).", recovered["top1"],
                len(outcome.history), outcome.best.step, outcome.total_steps, outcome.stopped)  # fmt: skip
    if planned is None:  # a torchrun process other than the first: the first exports and records
        return CompressResult(None, dense, one_shot, reestimated, recovered, outcome, {}, run.folder)
    exported = _export(run, planned, pruned, outcome)
    result = CompressResult(planned.result.plan, dense, one_shot, reestimated, recovered, outcome, exported,
                            run.folder)  # fmt: skip
    _record(run, planned.result, result, job)
    return result


@dataclass(frozen=True)
class _Run:
    """What every step of one ``compress`` shares: the config, its model and data, progress bars."""

    config: Config
    inputs: Inputs
    progress: bool | None

    @property
    def folder(self) -> Path:
        return recovery_folder(self.config)

    @property
    def analysis_file(self) -> Path:
        assert self.config.SensitivityAnalysis.analysis_file is not None
        return Path(self.config.SensitivityAnalysis.analysis_file)

    def numerics(self) -> AbstractContextManager[None]:
        """The arithmetic of every evaluation: ``Global.numerics``, as the analysis and ``run.py plan`` evaluate."""
        return numerics(self.config.Global.numerics, self.inputs.example_input.device)

    def measure(self, candidate: nn.Module, desc: str) -> dict[str, float]:
        """The metrics of ``candidate`` (put in eval mode) on the evaluation images."""
        candidate.eval()
        with self.numerics():
            return evaluate(candidate, self.inputs.loader, progress=self.progress, desc=desc).metrics()


def _planned_on_leader(run: _Run, ratios_file: str | Path | None) -> tuple[Planned | None, Removals, dict[str, Any]]:
    """The analysis (or its resume), the plan and the dense model's metrics (the analysis's baseline where it was
    measured on these images), on the first process alone; every process gets the removals and the metrics.

    Under torchrun the other processes wait, and a user error of the first stops them all with its message.
    """
    planned, shared, error = None, None, None
    if _leader():
        try:
            run_job(run.config, progress=run.progress, inputs=run.inputs)
            record = load_record(run.analysis_file)
            planned = _plan(run, ratios_file, record)
            with run.numerics():
                dense = dense_metrics(run.inputs, record, run.progress)
            shared = ([(name, list(channels)) for name, channels in planned.result.plan.removals()], dense)
        except UserError as caught:
            if not dist.is_initialized():
                raise
            error = caught
    if dist.is_initialized():
        agree(error)
        sent = [shared]
        dist.broadcast_object_list(sent, src=0)
        shared = sent[0]
    assert shared is not None
    return planned, *shared


def _plan(run: _Run, ratios_file: str | Path | None, record: AnalysisRecord) -> Planned:
    """The plan to recover: ``--ratios``, a budget, ``ChannelPrune.pruned_ratio`` when the config sets no
    ``target_loss``, else the ``target_loss`` ratios."""
    config = run.config
    channel_prune = config.act_blocks.get("ChannelPrune")
    uses_channel_prune = (
        ratios_file is None
        and not budgets(config)
        and config.SensitivityAnalysis.target_loss is None
        and isinstance(channel_prune, dict)
        and channel_prune.get("pruned_ratio") is not None
    )
    if not uses_channel_prune:
        return make_plan(config, run.inputs, run.progress, ratios_file, record)
    assert isinstance(channel_prune, dict)
    ratios = _channel_prune_ratios(channel_prune, record.sensitivities)
    plan = plan_from_ratios(run.inputs.model, run.inputs.example_input, record, ratios, source="ChannelPrune")
    text = channel_prune_yaml(plan.ratios, list(plan.ratios), plan.settings["criterion"],
                              note="ChannelPrune.pruned_ratio of the config.")  # fmt: skip
    return Planned(PlanResult(plan, None), text.encode("utf-8"), None)


def _channel_prune_ratios(block: dict[str, Any], analysed: dict[str, Any]) -> dict[str, float]:
    """``ChannelPrune``'s ratio per param: one ratio for every listed param (every analysed one when
    ``prune_params_name`` is empty, as ACT prunes every ``groups == 1`` conv), or a list in the same order."""
    names = block.get("prune_params_name") or list(analysed)
    ratio = block["pruned_ratio"]
    if isinstance(ratio, list):
        if len(ratio) != len(names):
            raise ConfigError(f"ChannelPrune.pruned_ratio lists {len(ratio)} ratios for {len(names)} params in "
                              "ChannelPrune.prune_params_name; give one ratio per param, or one for all.")  # fmt: skip
        return {str(name): float(value) for name, value in zip(names, ratio, strict=True)}
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ConfigError(f"ChannelPrune.pruned_ratio must be a number or a list of numbers, got {ratio!r}.")
    return {str(name): float(ratio) for name in names}


def _recover(
    run: _Run, recipe: Recipe, removals: Removals, pruned: nn.Module, dense: dict[str, float]
) -> tuple[RecoveryOutcome, RecoveryJob]:
    """Build the training batches and the job, and recover ``pruned`` in place."""
    config, inputs, train, distill = run.config, run.inputs, recipe.train, recipe.distill
    r = config.Recovery
    sharding = Sharding(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else Sharding()
    preprocess = training_preprocess(config, inputs)
    device = inputs.example_input.device
    batches = train_batches(config, inputs, preprocess, sharding)
    precision = resolve_precision(r, device)
    identity = run_identity(config, inputs, recipe, batches, preprocess, plan=removals)
    job = RecoveryJob(train, distill, precision, r.label_loss_weight, run.folder, identity, preprocess, r.resume,
                      run.progress)  # fmt: skip
    total = train.total_steps(batches.steps_per_epoch)
    logger.info("Recovery: %d training images (%s); %d steps of %d images (%.3g epochs of %d steps), %s, learning "
                "rate %s, %s.", len(batches.images), batches.images.source.layout, total, batches.batch_size,
                total / batches.steps_per_epoch, batches.steps_per_epoch, train.optimizer.describe(),
                train.schedule.type, precision)  # fmt: skip
    with seeded(config, device):
        outcome = recover(pruned, inputs.model, batches, lambda model: run.measure(model, "eval"), job, dense)
    return outcome, job


def _export(run: _Run, planned: Planned, recovered: nn.Module, outcome: RecoveryOutcome) -> dict[str, Path]:
    """The recovered model's files in ``<folder>/export`` (the first process writes them)."""
    if not _leader():
        return {}
    config, inputs = run.config, run.inputs
    s = config.SensitivityAnalysis
    extra = {
        "plan": planned.result.plan.as_dict(),
        "arch": config.Global.arch,
        "arch_kwargs": config.Global.arch_kwargs,
        "recovery": {"best": outcome.best.as_dict(), "steps": outcome.steps, "stopped": outcome.stopped},
    }
    recovered.eval()
    exported, _ = write_export(run.folder / EXPORT_FOLDER, recovered, inputs.model, inputs.example_input, inputs.loader,
                               extra, planned.ratios_yaml, s.export_onnx, s.onnx_exporter)  # fmt: skip
    return exported


def _leader() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _record(run: _Run, planned: PlanResult, result: CompressResult, job: RecoveryJob) -> None:
    """The plan with its recovery in the sidecar (under the analysis file's lock)."""
    outcome = result.recovery
    recovery = RecoveryRecord(
        dense=result.dense,
        one_shot=result.one_shot,
        reestimated=result.reestimated,
        recovered=result.recovered,
        best_step=outcome.best.step,
        steps=outcome.steps,
        total_steps=outcome.total_steps,
        stopped=outcome.stopped,
        resumed_from=outcome.resumed_from,
        seconds=round(outcome.seconds, 3),
        images_per_second=round(outcome.images_per_second, 1),
        train_images=outcome.train_images,
        processes=dist.get_world_size() if dist.is_initialized() else 1,
        precision=job.precision,
        recipe=job.train.as_dict(),
        distillation=job.distill.as_dict(),
        history=[evaluation.as_dict() for evaluation in outcome.history],
        folder=str(result.folder),
        exported={kind: str(path) for kind, path in result.exported.items()},
    )
    with exclusive(run.analysis_file):
        sidecar = schema.load(run.analysis_file) or Sidecar()
        plan = planned.plan.record()
        plan.ratios_file = str(planned.ratios_file or planned.plan.source)
        plan.recovery = recovery
        sidecar.plan = plan
        schema.save(run.analysis_file, sidecar)

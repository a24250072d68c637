"""Python API mirroring PaddleSlim's ``analysis_prune``, for models and data you already have in memory."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from analysis.config import NUMERICS_MODES, SensitivityConfig, check_choice, validate_section
from analysis.early_stop import early_stop_from
from analysis.engine.evaluate import evaluate
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.errors import ConfigError, ModelError, first_line
from analysis.inputs import arguments
from analysis.inputs.batches import BatchCheck, ImageConversion, Labels, checked_batches, floating_dtype
from analysis.inputs.device import model_device
from analysis.inputs.numerics import numerics as forward_numerics  # the argument `numerics` is a mode name
from analysis.io.fingerprint import json_fingerprint
from analysis.metrics import LABEL_FREE_METRICS
from analysis.structure.groups import eval_mode
from analysis.text import explain_target_loss
from analysis.workflow.analyse import Selection, run_analysis

logger = logging.getLogger(__name__)

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
EvalFunction = Callable[[nn.Module], float]


def analysis_prune(
    model: nn.Module,
    data: Batches | EvalFunction,
    analysis_file: str | Path,
    pruned_ratios: Sequence[float] = (0.1, 0.2, 0.3, 0.4),
    target_loss: float | None = None,
    criterion: str = "l1_norm",
    prune_params: Sequence[str] | None = None,
    metric: str = "top1",
    example_input: torch.Tensor | None = None,
    group_reduction: str = "self",
    metric_mode: str = "relative",
    overwrite: bool = False,
    progress: bool | None = None,
    engine: str = "fast",
    precision: float | str | None = None,
    seed: int = 0,
    granularity: str = "filter",
    early_stop_mode: str | None = None,
    early_stop_value: float | None = None,
    round_to: int = 1,
    adaptive_bn: bool = False,
    calibration: Batches | None = None,
    units: Sequence[str] | None = None,
    decision_error: float = 0.05,
    decision_precision: float | None = None,
    numerics: str = "exact",
) -> dict[str, float]:
    """Filter-pruning sensitivity of every prunable conv of ``model`` (and, by ``units``, of its Linear neurons and
    attention heads); writes the same files as ``run.py``.

    Args:
        model: The classifier (an ``nn.Module`` returning ``(batch, classes)`` logits), analysed in eval mode on the
            device its parameters are on; its weights and its modules' training flags are as before afterwards.
        data: Either batches or an eval function. Batches: an iterable of ``(images, labels)`` pairs (tuples or lists
            of two tensors, as a DataLoader yields), re-iterated for every variant (a DataLoader or a list); a one-pass
            iterator such as a generator is read once and its batches are kept in memory. Images have the batch
            first, e.g. ``(batch, 3, height, width)``: floating-point (converted to the model's dtype if another), or
            uint8 (divided by 255 into [0, 1], without normalisation); each conversion is logged once as a warning.
            Labels are integer class indices of shape ``(batch,)`` within the model's classes. With the label-free
            metrics (``agreement``, ``kl``) bare image tensors are batches too. A list is checked whole, any other
            iterable batch by batch as it is read (its first batch before any work starts). Or
            ``eval_function(model)`` returning a score where higher is better: a number (or a one-element tensor).
        analysis_file: The pickle to write (a ``str`` or ``Path``); an existing one is resumed (same model, data and
            settings only).
        pruned_ratios: A list of fractions of filters to remove, each strictly between 0 and 1 (for one ratio pass
            ``[0.3]``: a bare number is refused).
        target_loss: If given, derive per-layer ratios keeping each layer's relative loss under it.
        criterion: ``l1_norm``, ``l2_norm``, ``geometry_median`` or ``bn_scale``.
        prune_params: Conv weights to analyse (PyTorch parameter names); default all prunable ones.
        metric: ``top1``, ``top5`` or ``ce`` for batches, or, needing no labels, ``agreement`` (top-1 agreement with
            the unpruned model) or ``kl`` (mean KL divergence from it); ignored for an eval function (its score).
        example_input: An input batch for tracing; required with an eval function, else the first batch is used.
        group_reduction: ``self`` ranks channels on the conv alone (PaddleSlim); ``mean`` on its whole group.
        metric_mode: ``relative`` loss (PaddleSlim) or ``absolute`` difference.
        overwrite: Replace an existing analysis file instead of resuming it.
        progress: Show progress bars (default: only on a terminal).
        engine: ``fast`` (default; needs batches, same numbers) or ``reference`` (one full pass per variant).
        precision: Adaptive precision (fast engine, batches only): evaluate each variant on a random order of the
            images (seeded by ``seed``) and stop once its loss is known within +-precision at 95% confidence; or
            ``"decision"`` (needs ``target_loss``): stop once it is known on which side of ``target_loss`` it lies,
            skip the ratios above the first one settled above it, and complete the two the derived ratio
            interpolates between on every image.
        seed: Seed of that order.
        granularity: ``filter`` (remove conv filters with their group) or ``element`` (zero the smallest-magnitude
            elements of each 2D/4D weight, linear layers included; ``prune_params`` then names any such weight).
        early_stop_mode: ``minimize``, ``maximize``, ``dropped`` or ``raised`` (NNI's modes, on the raw metric): the
            ratio that trips it is recorded and the param's larger ratios are skipped.
        early_stop_value: The threshold or allowed change for ``early_stop_mode``.
        round_to: Keep a multiple of this many channels in every pruned group (1: any count).
        adaptive_bn: Re-estimate the BatchNorm statistics the removal changes on ``calibration`` before evaluating
            each variant (EagleEye's adaptive BN).
        calibration: Batches of calibration images (bare images or ``(images, labels)``, labels unused), e.g.
            training images, with ``data``'s rules for images; needed by ``adaptive_bn``, checked whenever given.
        units: The kinds of unit analysed: ``conv`` (filters), ``linear`` (neurons of Linear layers not producing
            the logits), ``heads`` (attention heads, named ``<module>.heads``). Default: ``conv`` only, as
            PaddleSlim (with ``granularity: element``, every 2D/4D weight).
        decision_error: With ``precision="decision"``, the chance that any variant is settled on the wrong side of
            ``target_loss`` (split over every variant and look, Bonferroni).
        decision_precision: With ``precision="decision"``, also stop a variant once its loss is known within +-this.
        numerics: The arithmetic of the forward passes (``Global.numerics``): ``exact`` (float32, TF32 off,
            deterministic cuDNN), or ``tf32``/``bf16`` (faster on a GPU, approximate losses). Set for the call only:
            the caller's backend flags and autocast state are as before afterwards.

    Returns:
        ``{param name: ratio}`` derived with ``target_loss`` (PaddleSlim's rule), or ``{}`` without one.

    Raises:
        ConfigError: For an argument of the wrong type, or an invalid setting (unknown criterion or metric, ratios
            outside (0, 1), unknown params); the message names the argument.
        DataError: For data or calibration batches that break the rules above, or an eval function returning no
            number.
        ModelError: If ``model`` is no ``nn.Module``, or it cannot run on the data's images.
    """
    model = arguments.module("model", model)
    section = SensitivityConfig(
        analysis_file=str(arguments.path("analysis_file", analysis_file)),
        pruned_ratios=arguments.numbers("pruned_ratios", pruned_ratios),
        target_loss=arguments.optional(arguments.number, "target_loss", target_loss),
        criterion=arguments.text("criterion", criterion),
        prune_params_name=arguments.optional(arguments.names, "prune_params", prune_params),
        metric=arguments.text("metric", metric),
        metric_mode=arguments.text("metric_mode", metric_mode),
        group_reduction=arguments.text("group_reduction", group_reduction),
        engine=arguments.text("engine", engine),
        precision=_precision(precision),
        decision_error=arguments.number("decision_error", decision_error),
        decision_precision=arguments.optional(arguments.number, "decision_precision", decision_precision),
        granularity=arguments.text("granularity", granularity),
        units=arguments.optional(arguments.names, "units", units),
        early_stop_mode=arguments.optional(arguments.text, "early_stop_mode", early_stop_mode),
        early_stop_value=arguments.optional(arguments.number, "early_stop_value", early_stop_value),
        adaptive_bn=arguments.flag("adaptive_bn", adaptive_bn),
        round_to=round_to,  # checked with the YAML's rule below
    )
    overwrite = arguments.flag("overwrite", overwrite)
    progress = arguments.optional(arguments.flag, "progress", progress)
    seed = arguments.integer("seed", seed)
    check_choice("numerics", arguments.text("numerics", numerics), NUMERICS_MODES)
    example_input = arguments.optional(arguments.tensor, "example_input", example_input)
    section = validate_section(section, prefix="")  # the YAML's own checks: both entries refuse the same settings
    ratios = section.pruned_ratios
    prune_params, units = section.prune_params_name, section.units
    if units is None and granularity == "filter":
        units = ["conv"]
    early_stop = early_stop_from(early_stop_mode, early_stop_value)
    if adaptive_bn and calibration is None:
        raise ConfigError("adaptive_bn=True needs calibration batches: pass calibration=<batches of training images>.")
    device, dtype = model_device(model), floating_dtype(model)
    if example_input is not None:
        example_input = ImageConversion("example_input", dtype)(example_input)
    if callable(data):
        if example_input is None:
            raise ConfigError("example_input is required when data is an eval function (it is used for tracing).")
        evaluate_model, fingerprint, batches = _function_evaluator(data), None, None
        metric = "score"  # the eval function's score, whatever ``metric`` said
    else:
        labels = Labels.OPTIONAL if metric in LABEL_FREE_METRICS else Labels.REQUIRED
        checked = checked_batches(data, BatchCheck(ImageConversion("data", dtype), labels, _class_count(model, device)))
        batches = checked.batches

        def evaluate_model(candidate: nn.Module) -> dict[str, float]:
            return evaluate(candidate, batches, device=device, progress=progress).metrics()

        example_input = checked.images if example_input is None else example_input
        fingerprint = _batch_fingerprint(checked.images, checked.labels)
    settings = EngineSettings.from_section(
        section, seed=seed, numerics=numerics, progress=progress, early_stop=early_stop, metric=metric
    )
    calibration_fingerprint = None
    if calibration is not None:  # checked whenever given, used with adaptive_bn
        calibrated = checked_batches(calibration, BatchCheck(ImageConversion("calibration", dtype), Labels.UNUSED))
        calibration = calibrated.batches
        calibration_fingerprint = _batch_fingerprint(calibrated.images, calibrated.labels) if adaptive_bn else None
    analysis_data = AnalysisData(
        evaluate=evaluate_model,
        example_input=example_input.to(device),
        batches=batches,
        fingerprint=fingerprint,
        calibration=calibration if adaptive_bn else None,
        calibration_fingerprint=calibration_fingerprint,
    )
    outcome = run_analysis(
        model,
        analysis_data,
        analysis_file,
        settings,
        selection=Selection(
            prune_params=prune_params, names_key="prune_params", skip_key="skip_params", units=units, units_key="units"
        ),
        target_loss=target_loss,
        config={"api": "analysis_prune", "pruned_ratios": ratios, "criterion": criterion, "metric": metric},
        overwrite=overwrite,
    )
    if target_loss is not None and outcome.ratios_file is not None:
        logger.info("%s Ratios: %s", explain_target_loss(target_loss), outcome.ratios_file)
    return outcome.ratios


def _precision(value: object) -> float | str | None:
    """``precision``: None, a number, or a word (``"decision"``; others are refused by the YAML's rule)."""
    return value if value is None or isinstance(value, str) else arguments.number("precision", value)


def _function_evaluator(function: EvalFunction) -> Callable[[nn.Module], dict[str, float]]:
    """The eval function as an evaluator; what it returns is checked on every call (a number, or a UserError)."""

    def evaluate_model(candidate: nn.Module) -> dict[str, float]:
        with torch.inference_mode():
            score = function(candidate)
        return {"score": arguments.score("data (the eval function)", score)}

    return evaluate_model


def _class_count(model: nn.Module, device: torch.device) -> Callable[[torch.Tensor], int]:
    """How many classes the model predicts, from one of the data's images (labels must lie below it); run exact, as
    tracing is, never under the caller's backend flags."""

    def count(images: torch.Tensor) -> int:
        try:
            with eval_mode(model), torch.inference_mode(), forward_numerics("exact", device):
                logits = model(images[:1].to(device))
        except RuntimeError as error:  # the images do not fit the model: the user's data, not a bug
            raise ModelError(
                f"model cannot run on the images of data's batch 0 (shape {tuple(images.shape)}): {first_line(error)}; "
                "check their size and channels."
            ) from error
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ModelError(f"model must return (batch, classes) logits, got {arguments.described(logits)}.")
        return int(logits.shape[1])

    return count


def _batch_fingerprint(images: torch.Tensor, labels: torch.Tensor | None) -> str:
    """Identify in-memory data by its first batch (cheap, and enough to catch resuming on other data)."""
    return json_fingerprint(
        {"images": hashlib.sha256(images.detach().cpu().contiguous().numpy().tobytes()).hexdigest(),
         "labels": None if labels is None else labels.tolist(), "shape": list(images.shape)}
    )  # fmt: skip

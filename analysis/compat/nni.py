"""NNI's ``SensitivityAnalysis`` (removed in NNI 3.0) with the same call signature, on the exact engine.

Code written for ``nni.compression.pytorch.utils.SensitivityAnalysis`` runs after changing the import. The results
have NNI's shape, ``{layer_name: {sparsity: metric}}`` with whatever ``val_func`` returns, but by default a filter
is removed the way it would be from the real network: with its bias, its BatchNorm, every coupled channel
(residual adds, depthwise convs) and the consumers' input channels, evaluated on the model itself (masking) or,
where masking is not exact (LayerNorm over channels), on a physically pruned copy. NNI masked the conv's weight
and bias only, so the BatchNorm's shift kept the "removed" channel alive; ``dependency_aware=False`` reproduces
that naive rule for comparison.

Differences from NNI 2.x, all deliberate: unknown names in ``specified_layers`` are an error (NNI ignored them);
in the exact mode a conv that cannot be a pruning root (depthwise, coupled to the output) is not analysed and is
listed in :attr:`SensitivityAnalysis.unprunable` with the reason; the exact mode removes
``min(C - 1, round(C * s))`` filters (NNI: ``int(C * s)``), the naive mode keeps NNI's count.
"""

from __future__ import annotations

import csv
import io
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.config import SensitivityConfig, validate_section
from analysis.early_stop import EarlyStop, early_stop_from
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.errors import ConfigError, ModelError, did_you_mean, first_line
from analysis.inputs import arguments
from analysis.inputs.batches import ImageConversion, floating_dtype
from analysis.io.atomic import atomic_write_text
from analysis.io.record import load_record
from analysis.io.sidecar import VariantRecord
from analysis.ratio import RATIO_DECIMALS
from analysis.structure.criteria import CRITERIA, lowest_channels
from analysis.structure.elementwise import ELEMENT_DIMS, element_slices, magnitude_order
from analysis.structure.masking import zeroed
from analysis.workflow.analyse import Selection, run_analysis

logger = logging.getLogger(__name__)

PRUNE_TYPES = {"l1": "l1_norm", "l2": "l2_norm", "fpgm": "geometry_median", "level": "magnitude"}
DEFAULT_SPARSITIES = tuple(round(0.1 * step, 2) for step in range(1, 10))  # NNI: numpy.arange(0.1, 1.0, 0.1), rounded
EXAMPLE_IMAGES = 8  # images of the first batch val_func feeds the model, kept for tracing and the masking check
TEMPORARY_FILE = "sensitivity.pkl"  # the analysis file's name in a temporary folder when no analysis_file is given
NNI_NAMES = {"pruned_ratios": "sparsities"}  # NNI's names of the YAML keys it calls otherwise, for messages


class SensitivityAnalysis:
    """Per-layer pruning sensitivity with NNI 2.x's interface.

    Args:
        model: The model ``val_func`` evaluates; pruned in place during :meth:`analysis` and restored bit-exactly.
        val_func: Called as ``val_func(*val_args, **val_kwargs)``; returns the metric, a number (or a one-element
            tensor; higher or lower is better, whatever it is). It must run ``model`` itself (typically
            ``val_args=[model]``).
        sparsities: Fractions to prune, each in (0, 1); default ``0.1, 0.2, ..., 0.9``.
        prune_type: ``l1``, ``l2`` or ``fpgm`` filter ranking, or ``level`` for element-wise (magnitude) pruning of
            each 2D/4D weight (conv and linear layers).
        early_stop_mode: ``minimize``, ``maximize``, ``dropped`` or ``raised`` (see :mod:`analysis.engine._early_stop`);
            the sparsity that trips it is recorded and that layer's larger sparsities are skipped.
        early_stop_value: The threshold or allowed change for ``early_stop_mode``.
        dependency_aware: Remove filters with everything coupled to them (exact, default), or mask the conv's
            weight and bias alone as NNI did.
        dummy_input: An input batch for tracing (uint8 or other float dtypes converted as ``analysis_prune``'s
            images); by default the first batch ``val_func`` feeds the model is used.
        analysis_file: Also keep the results in this analysis file (resumable, with its JSON sidecar); by default
            they live in a temporary file that is removed afterwards.

    Raises:
        ConfigError: For an argument of the wrong type (``sparsities`` is a list: a bare number is refused), an
            unknown ``prune_type``, or a setting the YAML refuses too (checked by
            :func:`analysis.config.validate_section`): sparsities outside (0, 1), an unknown early-stop mode or one
            without a value, an empty ``analysis_file``.
        ModelError: If ``model`` is no ``nn.Module``.
    """

    def __init__(
        self,
        model: nn.Module,
        val_func: Callable[..., float],
        sparsities: Sequence[float] | None = None,
        prune_type: str = "l1",
        early_stop_mode: str | None = None,
        early_stop_value: float | None = None,
        dependency_aware: bool = True,
        dummy_input: torch.Tensor | None = None,
        analysis_file: str | Path | None = None,
    ) -> None:
        model = arguments.module("model", model)
        val_func = arguments.function("val_func", val_func)
        ratios = arguments.optional(arguments.numbers, "sparsities", sparsities)
        prune_type = arguments.text("prune_type", prune_type)
        early_stop_mode = arguments.optional(arguments.text, "early_stop_mode", early_stop_mode)
        early_stop_value = arguments.optional(arguments.number, "early_stop_value", early_stop_value)
        dependency_aware = arguments.flag("dependency_aware", dependency_aware)
        dummy_input = arguments.optional(arguments.tensor, "dummy_input", dummy_input)
        analysis_file = arguments.optional(arguments.path, "analysis_file", analysis_file)
        if prune_type not in PRUNE_TYPES:
            hint = did_you_mean(prune_type, PRUNE_TYPES)
            raise ConfigError(f"prune_type must be one of {', '.join(PRUNE_TYPES)}, got '{prune_type}'{hint}.")
        self.element = prune_type == "level"
        section = SensitivityConfig(
            analysis_file=TEMPORARY_FILE if analysis_file is None else str(analysis_file),
            pruned_ratios=list(DEFAULT_SPARSITIES) if ratios is None else ratios,
            criterion="l1_norm" if self.element else PRUNE_TYPES[prune_type],
            metric_mode="absolute",  # the metric may be anything (a loss, a baseline of 0): keep differences
            engine="reference",
            granularity="element" if self.element else "filter",
            early_stop_mode=early_stop_mode,
            early_stop_value=early_stop_value,
        )
        self._section = validate_section(section, prefix="", names=NNI_NAMES)  # the YAML's checks: both refuse the same
        if dummy_input is not None:
            dummy_input = ImageConversion("dummy_input", floating_dtype(model))(dummy_input)
        self.model = model
        self.val_func = val_func
        self.sparsities = self._section.pruned_ratios
        self.prune_type = prune_type
        self.early_stop: EarlyStop | None = early_stop_from(early_stop_mode, early_stop_value)
        self.early_stop_mode, self.early_stop_value = early_stop_mode, early_stop_value
        self.dependency_aware = dependency_aware
        self.dummy_input = dummy_input
        self.analysis_file = analysis_file
        self.target_layer: dict[str, nn.Module] = {
            name: module for name, module in model.named_modules() if self._is_target(module)
        }
        self.sensitivities: dict[str, dict[float, float]] = {}
        self.ori_metric: float | None = None
        self.unprunable: dict[str, str] = {}

    def _is_target(self, module: nn.Module) -> bool:
        """NNI's targets: every Conv1d/Conv2d; element-wise also every linear layer (any 2D/4D weight)."""
        if self.element:
            weight = getattr(module, "weight", None)
            return isinstance(weight, nn.Parameter) and weight.dim() in ELEMENT_DIMS
        return isinstance(module, (nn.Conv1d, nn.Conv2d))

    @property
    def layers_count(self) -> int:
        """Number of layers that can be analysed."""
        return len(self.target_layer)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load new weights into the model before (another) :meth:`analysis`.

        Raises:
            ConfigError: For a ``state_dict`` that is no mapping (a dict).
            ModelError: For a ``state_dict`` whose keys or shapes do not fit the model.
        """
        state_dict = arguments.mapping("state_dict", state_dict)
        try:
            self.model.load_state_dict(state_dict)
        except RuntimeError as error:  # missing, unexpected or misshapen keys: the user's weights, not a bug
            raise ModelError(f"state_dict does not fit the model: {first_line(error)}") from error

    def analysis(
        self,
        val_args: Sequence[Any] | None = None,
        val_kwargs: Mapping[str, Any] | None = None,
        specified_layers: Sequence[str] | None = None,
    ) -> dict[str, dict[float, float]]:
        """Prune each layer alone at each sparsity, call ``val_func``, and record what it returns.

        Args:
            val_args: Positional arguments of ``val_func`` (a list or tuple).
            val_kwargs: Keyword arguments of ``val_func`` (a dict).
            specified_layers: Module names to analyse, a list (default: all targets).

        Returns:
            ``{layer_name: {sparsity: metric}}`` in model order (also kept in :attr:`sensitivities`).

        Raises:
            ConfigError: For an argument of the wrong type (checked before ``val_func`` runs), a name in
                ``specified_layers`` that is not a target layer, or, in the exact mode, a specified layer that cannot
                be pruned (with the reason).
            DataError: If ``val_func`` returns something other than a number.
        """
        args = arguments.optional(arguments.items, "val_args", val_args) or []
        kwargs = dict(arguments.optional(arguments.mapping, "val_kwargs", val_kwargs) or {})
        if not all(isinstance(key, str) for key in kwargs):
            raise ConfigError(f"val_kwargs must be a dict of keyword arguments (str keys), got keys {list(kwargs)}.")
        specified_layers = arguments.optional(arguments.names, "specified_layers", specified_layers)
        layers = self._layers(specified_layers)
        with _first_input(self.model) as captured:
            self.ori_metric = self._call(args, kwargs)
        logger.info("Baseline metric: %.6f", self.ori_metric)
        if self.dependency_aware:
            example = self.dummy_input if self.dummy_input is not None else captured.get("input")
            if example is None:
                raise ConfigError("val_func did not run the model, so nothing can be traced; pass dummy_input.")
            results = self._exact(layers, specified_layers is not None, example, args, kwargs)
        else:
            results = {name: self._naive_layer(name, args, kwargs) for name in layers}
        self.sensitivities.update(results)
        return self.sensitivities

    def _layers(self, specified: Sequence[str] | None) -> list[str]:
        if specified is None:
            return list(self.target_layer)
        for name in specified:
            if name not in self.target_layer:
                kind = "a 2D/4D weight layer" if self.element else "a Conv1d/Conv2d layer"
                raise ConfigError(
                    f"specified_layers: '{name}' is not {kind} of this model{did_you_mean(name, self.target_layer)}."
                )
        wanted = set(specified)
        return [name for name in self.target_layer if name in wanted]

    def _exact(
        self, layers: list[str], specified: bool, example: torch.Tensor, args: list[Any], kwargs: dict[str, Any]
    ) -> dict[str, dict[float, float]]:
        """Run the dependency-aware engine with ``val_func`` as the evaluator; metrics come from the sidecar."""
        settings = EngineSettings.from_section(self._section, metric="score")  # val_func's value, not a YAML metric
        assert self.ori_metric is not None  # measured by analysis() before this runs
        with _analysis_file(self.analysis_file) as path:
            outcome = run_analysis(
                self.model,
                AnalysisData(evaluate=self._evaluator(args, kwargs), example_input=example),
                path,
                settings,
                selection=Selection(
                    prune_params=[f"{name}.weight" for name in layers] if specified else None,
                    names_key="specified_layers",
                    units=None if self.element else ("conv",),  # NNI's targets: convs (every 2D/4D weight by level)
                ),
                config={"api": "SensitivityAnalysis", "prune_type": self.prune_type, "sparsities": self.sparsities},
                baseline={"score": self.ori_metric},
            )
            record = load_record(path)
        self.unprunable = {name.removesuffix(".weight"): reason for name, reason in outcome.unprunable.items()}
        for name, reason in self.unprunable.items():
            if name in layers and not specified:
                logger.info("%s is not analysed: %s.", name, reason)
        results: dict[str, dict[float, float]] = {}
        analysed = {param.module_name for param in outcome.analysed}
        for name in (name for name in layers if name in analysed):  # NNI's order: named_modules
            scores = {r: _score(record.variant(f"{name}.weight", r)) for r in self.sparsities}
            curve = {r: score for r, score in scores.items() if score is not None}
            if curve:
                results[name] = curve
        return results

    def _evaluator(self, args: list[Any], kwargs: dict[str, Any]) -> Callable[[nn.Module], dict[str, float]]:
        """``val_func`` as an engine evaluator: a physically pruned copy stands in for the model while it runs."""

        def evaluate_model(candidate: nn.Module) -> dict[str, float]:
            with standing_in(self.model, candidate):
                return {"score": self._call(args, kwargs)}

        return evaluate_model

    def _call(self, args: list[Any], kwargs: dict[str, Any]) -> float:
        """``val_func``'s metric, checked to be a number on every call."""
        return arguments.score("val_func", self.val_func(*args, **kwargs))

    def _naive_layer(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> dict[float, float]:
        """NNI's rule: zero ``int(C * s)`` filters of the conv's weight and bias (or ``int(N * s)`` weights)."""
        module = self.target_layer[name]
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        curve: dict[float, float] = {}
        order = magnitude_order(weight) if self.element else None
        scores = None if self.element else CRITERIA[PRUNE_TYPES[self.prune_type]](weight)
        for sparsity in self.sparsities:
            if order is not None:
                slices = element_slices(weight, order[: int(weight.numel() * sparsity)])
            else:
                assert scores is not None
                count = int(weight.shape[0] * sparsity) if weight.shape[0] > 1 else 0
                filters = torch.tensor(lowest_channels(scores, count), dtype=torch.long, device=weight.device)
                slices = [(weight.data, filters)]
                bias = getattr(module, "bias", None)
                if bias is not None:
                    slices.append((bias.data, filters))
            with zeroed(slices):
                value = self._call(args, kwargs)
            curve[sparsity] = value
            logger.info("Layer: %s Sparsity: %.2f Validation Metric: %.4f", name, sparsity, value)
            if self.early_stop is not None and self.early_stop.tripped(float(self.ori_metric or 0.0), value):
                break
        return curve

    def export(self, filepath: str | Path) -> None:
        """Write NNI's CSV: ``layername`` and the sparsities, then one row of metrics per analysed layer (rows of
        early-stopped layers are shorter, as in NNI)."""
        filepath = arguments.path("filepath", filepath)
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["layername", *[_sparsity_text(s) for s in self.sparsities]])
        for name, curve in self.sensitivities.items():
            writer.writerow([name, *[curve[s] for s in sorted(curve)]])
        atomic_write_text(filepath, buffer.getvalue())


def _score(variant: VariantRecord | None) -> float | None:
    """The ``val_func`` score a variant recorded (None when not evaluated)."""
    score = None if variant is None else variant.metric("score")
    return None if score is None else float(score)


def _sparsity_text(sparsity: float) -> str:
    return repr(round(sparsity, RATIO_DECIMALS))


@contextmanager
def standing_in(model: nn.Module, replacement: nn.Module) -> Iterator[None]:
    """Make ``model`` compute with ``replacement``'s submodules, parameters and buffers for the block.

    ``val_func`` holds the model object, so a physically pruned copy can only be evaluated through it; the
    original dictionaries are put back afterwards, also when the block raises.
    """
    if replacement is model:
        yield
        return
    keys = ("_modules", "_parameters", "_buffers")
    saved = {key: model.__dict__[key] for key in keys}
    try:
        model.__dict__.update({key: replacement.__dict__[key] for key in keys})
        yield
    finally:
        model.__dict__.update(saved)


@contextmanager
def _first_input(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Capture (a few images of) the first tensor the model is called with while the block runs."""
    captured: dict[str, torch.Tensor] = {}

    def hook(_: nn.Module, inputs: tuple[Any, ...]) -> None:
        if "input" not in captured and inputs and isinstance(inputs[0], torch.Tensor):
            captured["input"] = inputs[0][:EXAMPLE_IMAGES].detach().clone()

    handle = model.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


@contextmanager
def _analysis_file(path: str | Path | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="sensitivity-") as directory:
        yield Path(directory) / TEMPORARY_FILE

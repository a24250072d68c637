"""The JSON sidecar of an analysis file as typed records: the one schema every reader and writer of it goes through.

``<file>.pkl.json`` holds what the pickle cannot: the baseline, each param's static facts and each variant's metrics,
removed channels, costs and timing, the fingerprints a resumed run must match, the resolved config, and the latest
plan with its search log. :func:`load` parses and validates it (a wrongly typed entry raises
:class:`~analysis.errors.AnalysisFileError` naming the file and the key); :func:`dump` turns it back into text.

Records remember the order in which their keys were read or first set (as a JSON object built by assignment would)
and keep every key this version does not know, so a file read and written again is byte-identical whichever version
wrote it. A field that is ``None`` is absent, except a key read as ``null`` (kept) and the keys marked as always
written. :func:`variant_key` is the one place a ratio becomes a JSON key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from analysis.errors import AnalysisFileError
from analysis.io.atomic import atomic_write_text
from analysis.io.results import load_sidecar, sidecar_path, sidecar_text
from analysis.metrics import METRIC_NAMES
from analysis.ratio import normalise_ratio

R = TypeVar("R", bound="_Record")
Decoder = Callable[[Any, str], Any]
Metrics = dict[str, float]
"""Metric name -> value (``top1``, ``top5``, ``ce``, ``images``, ``seconds``, an eval function's ``score``...)."""

_ADVICE = "fix or delete it (it is rewritten on the next run)"


def variant_key(ratio: float) -> str:
    """The JSON key of the variant pruned at ``ratio``: ``0.3`` and ``0.30000000000000004`` are both ``"0.3"``."""
    return f"{normalise_ratio(ratio):g}"


# ------------------------------------------------------------------------------------------------- validation


class InvalidEntry(ValueError):
    """A sidecar entry of the wrong type: where it is (``params["a.weight"].variants["0.1"].loss``) and what was
    expected."""

    def __init__(self, where: str, expected: str, value: Any) -> None:
        shown = json.dumps(value, ensure_ascii=False) if _jsonable(value) else repr(value)
        super().__init__(f"{where or 'the top level'} should be {expected}, not {_shorten(shown)}")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _at(where: str, name: str) -> str:
    """The path of a record's field: ``params["a.weight"].variants``."""
    return f"{where}.{name}" if where else name


def _item(where: str, key: str) -> str:
    """The path of a map's entry: ``params["a.weight"]``."""
    return f'{where}["{key}"]'


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidEntry(where, "a number", value)
    return value


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidEntry(where, "an integer", value)
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidEntry(where, "a string", value)
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidEntry(where, "true or false", value)
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    """Any JSON object, kept as it is (blocks this schema does not type)."""
    if not isinstance(value, dict):
        raise InvalidEntry(where, "an object", value)
    return value


def _list_of(item: Decoder) -> Decoder:
    def decode(value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise InvalidEntry(where, "a list", value)
        return [item(entry, f"{where}[{index}]") for index, entry in enumerate(value)]

    return decode


def _map_of(item: Decoder, key: Decoder | None = None) -> Decoder:
    def decode(value: Any, where: str) -> dict[str, Any]:
        found = _object(value, where)
        if key is not None:
            for name in found:
                key(name, _item(where, name))
        return {name: item(entry, _item(where, name)) for name, entry in found.items()}

    return decode


def _ratio_key(value: str, where: str) -> str:
    try:
        ratio = float(value)
    except ValueError:
        ratio = math.nan
    if not math.isfinite(ratio):
        raise InvalidEntry(where, "keyed by a ratio such as 0.3", value)
    return value


ALWAYS = {"always": True}
"""Field metadata: the key is written even when None (as ``null``), as this tool always has."""
SPREAD = {"spread": True}
"""Field metadata: the field holds the record's other numeric keys (metrics), written among the named ones."""
METRIC_SET = frozenset(METRIC_NAMES)
"""Keys of a spread field that must be numbers when present: a metric this tool evaluates is never kept aside as an
unknown key, so a damaged one is an error rather than a silently missing value."""
RATIO_KEYS = {"keys": _ratio_key}
"""Field metadata: the field maps ratios (written by :func:`variant_key`) to records."""

_SCALARS: dict[Any, Decoder] = {str: _text, int: _integer, float: _number, bool: _flag}


def _decoder(hint: Any, keys: Decoder | None = None) -> Decoder:
    """The decoder of a field's type: ``str``, ``int``, ``float``, ``bool``, a record, ``list[...]``,
    ``dict[str, ...]`` (``dict[str, Any]``: any JSON object, kept as it is), each optionally ``| None``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _decoder(inner, keys)
    if hint in _SCALARS:
        return _SCALARS[hint]
    if isinstance(hint, type) and issubclass(hint, _Record):
        return hint.from_json
    if origin is list:
        return _list_of(_decoder(args[0]))
    if origin is dict and args[1] is Any:
        return _object
    if origin is dict:
        return _map_of(_decoder(args[1]), keys)
    raise TypeError(f"the sidecar schema has no decoder for {hint!r}")


# ------------------------------------------------------------------------------------------------ record base


@dataclass(frozen=True)
class _Schema:
    decoders: dict[str, Decoder]  # named field -> decoder, in declaration order
    always: frozenset[str]
    spread: str | None  # the field of unknown numeric keys, if the record has one
    order: tuple[str, ...]  # every field, in declaration order


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    """The schema of a record class, read from its fields' types and metadata (once per class)."""
    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    hints = typing.get_type_hints(cls)
    decoders, always, spread, order = {}, set(), None, []
    for item in dataclasses.fields(cls):
        if item.name == "extra":
            continue
        if item.metadata.get("spread"):
            spread = item.name
        else:
            decoders[item.name] = _decoder(hints[item.name], item.metadata.get("keys"))
            if item.metadata.get("always"):
                always.add(item.name)
        order.append(item.name)
    _SCHEMAS[cls] = _Schema(decoders, frozenset(always), spread, tuple(order))
    return _SCHEMAS[cls]


@dataclass(kw_only=True)
class _Record:
    """A JSON object with typed fields, its key order, and the keys this version does not know (``extra``)."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        schema = _schema(type(self))
        order: list[str] = []
        for name in schema.order:
            value = getattr(self, name)
            if name == schema.spread:
                order += list(value)
            elif value is not None or name in schema.always:
                order.append(name)
        object.__setattr__(self, "_order", order + [key for key in self.extra if key not in order])

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        order: list[str] | None = self.__dict__.get("_order")  # None while __init__ runs
        schema = _schema(type(self))
        if order is None or name not in schema.decoders:
            return
        if value is not None and name not in order:
            order.append(name)  # a key set for the first time goes last, as in a dict
        elif value is None and name in order and name not in schema.always:
            order.remove(name)

    @classmethod
    def from_json(cls: type[R], data: Any, where: str = "") -> R:
        """Parse and validate a JSON object.

        Raises:
            InvalidEntry: An entry has the wrong type.
        """
        found = _object(data, where)
        schema = _schema(cls)
        values: dict[str, Any] = {}
        spread: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in found.items():
            decode = schema.decoders.get(key)
            if decode is not None:
                values[key] = None if value is None else decode(value, _at(where, key))
            elif schema.spread is not None and (key in METRIC_SET or _is_number(value)):
                spread[key] = _number(value, _at(where, key))
            else:
                extra[key] = value
        if schema.spread is not None:
            values[schema.spread] = spread
        record = cls(**values, extra=extra)
        object.__setattr__(record, "_order", list(found))
        return record

    def to_json(self) -> dict[str, Any]:
        """The JSON object: keys in the order they were read or first set, unknown keys included."""
        present = self._present()
        ordered = {key: present[key] for key in self.__dict__["_order"] if key in present}
        ordered.update((key, value) for key, value in present.items() if key not in ordered)
        return ordered

    def _present(self) -> dict[str, Any]:
        """Every present key with its JSON value, in declaration order."""
        schema = _schema(type(self))
        order = self.__dict__["_order"]
        present: dict[str, Any] = {}
        for name in schema.order:
            value = getattr(self, name)
            if name == schema.spread:
                present.update((key, item) for key, item in value.items() if key not in schema.decoders)
            elif value is not None or name in order:
                present[name] = _encode(value)
        present.update((key, value) for key, value in self.extra.items() if key not in present)
        return present

    def update_json(self, data: Mapping[str, Any], where: str = "") -> None:
        """Set the keys of ``data`` as ``dict.update`` would (known ones validated, new ones last).

        Raises:
            InvalidEntry: An entry has the wrong type.
        """
        schema = _schema(type(self))
        order: list[str] = self.__dict__["_order"]
        for key, value in data.items():
            decode = schema.decoders.get(key)
            if decode is not None:
                object.__setattr__(self, key, None if value is None else decode(value, _at(where, key)))
            elif schema.spread is not None and (key in METRIC_SET or _is_number(value)):
                getattr(self, schema.spread)[key] = _number(value, _at(where, key))
                self.extra.pop(key, None)
            else:
                self.extra[key] = value
            if key not in order:
                order.append(key)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _encode(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


# ---------------------------------------------------------------------------------------------------- records


@dataclass(kw_only=True)
class ToolRecord(_Record):
    """The program that wrote the file."""

    name: str | None = None
    version: str | None = None


@dataclass(kw_only=True)
class MachineRecord(_Record):
    """A device and the library versions that computed numbers on it (CUDA and cuDNN only on a CUDA device)."""

    device: str | None = None
    name: str | None = None
    torch: str | None = None
    cuda: str | None = None
    cudnn: str | None = None

    def describe(self) -> str:
        """``cuda (NVIDIA H100), torch 2.5.1, CUDA 12.4, cuDNN 90100`` for logs and reports."""
        parts = [f"{self.device} ({self.name})" if self.name else str(self.device), f"torch {self.torch}"]
        parts += [f"CUDA {self.cuda}"] if self.cuda else []
        parts += [f"cuDNN {self.cudnn}"] if self.cudnn else []
        return ", ".join(parts)


@dataclass(kw_only=True)
class NumericsRecord(_Record):
    """How an analysis file's numbers were computed: the arithmetic (``Global.numerics``), every machine that added
    numbers to the file, and in a speed mode how far the mode moves this model's own outputs.

    Attributes:
        mode: ``exact``, ``tf32`` or ``bf16``.
        machines: Each distinct device and library versions that evaluated variants of this file, in order.
        logit_noise: Speed modes: the largest difference between the dense model's logits under the mode and in
            exact float32 on the check images, as a fraction of the largest exact logit.
        exact_baseline: Speed modes with labels: the dense model's metrics computed in exact float32.
        loss_shift: Speed modes with labels: the loss the mode alone gives the dense model, ``(exact - mode) /
            exact`` of the run's metric: how far the arithmetic moves a loss on this model.
        mask_tolerance: Speed modes: the masked-versus-physical check's tolerance derived from ``logit_noise``, as
            a fraction of the largest logit (exact float32 uses 1e-4).
    """

    mode: str | None = None
    machines: list[MachineRecord] | None = None
    logit_noise: float | None = None
    mask_tolerance: float | None = None
    exact_baseline: Metrics | None = None
    loss_shift: float | None = None

    @property
    def approximate(self) -> bool:
        """Whether the losses were computed in a speed mode (``tf32``, ``bf16``) rather than exact float32."""
        return self.mode is not None and self.mode != "exact"

    def notice(self) -> str | None:
        """One sentence saying the losses are approximate and how far the mode moves them on this model (None for
        exact numbers)."""
        if not self.approximate:
            return None
        moved = (
            f"{self.mode} alone gives the dense model a loss of {self.loss_shift:+.4f} against exact float32"
            if self.loss_shift is not None
            else "how far it moves a loss was not measured (a label-free metric)"
        )
        noise = (
            "" if self.logit_noise is None else f", and moves its logits by up to {self.logit_noise:.2g} of the largest"
        )
        return f"losses are approximate (Global.numerics: {self.mode}): {moved}{noise}"

    def describe(self) -> str:
        """``exact (float32, TF32 off, deterministic) on cpu (x86_64), torch 2.5.1`` for reports."""
        how = {"tf32": "TF32 convolutions and matmuls, approximate", "bf16": "bfloat16 autocast, approximate"}.get(
            self.mode or "exact", "float32, TF32 off, deterministic cuDNN"
        )
        machines = "; ".join(machine.describe() for machine in self.machines or [])
        return f"{self.mode or 'exact'} ({how})" + (f" on {machines}" if machines else "")


@dataclass(kw_only=True)
class SettingsRecord(_Record):
    """The settings the numbers depend on (``fingerprint.settings``). ``granularity``, ``round_to``, ``adaptive_bn``,
    ``calibration`` and ``numerics`` are written only when they differ from the defaults, so files of earlier versions
    resume."""

    criterion: str | None = None
    group_reduction: str | None = None
    metric: str | None = None
    metric_mode: str | None = None
    # [precision, seed] of adaptive precision; written as null without it
    precision: list[float] | None = None
    # [target_loss, decision_error, seed] of decision-driven sampling; absent without it
    decision: list[float] | None = None
    granularity: str | None = None
    round_to: int | None = None
    adaptive_bn: bool | None = None
    calibration: str | None = None
    # Global.numerics of a speed mode (tf32, bf16); absent for exact
    numerics: str | None = None

    @property
    def metric_name(self) -> str:
        """The metric the losses are computed from (``top1`` when not recorded)."""
        return self.metric or "top1"

    def ranking(self) -> dict[str, Any]:
        """How channels were ranked, the defaults filled in: a plan's ``settings`` block (``criterion``,
        ``group_reduction``, ``round_to``)."""
        return {
            "criterion": self.criterion or "l1_norm",
            "group_reduction": self.group_reduction or "self",
            "round_to": self.round_to or 1,
        }


@dataclass(kw_only=True)
class FingerprintRecord(_Record):
    """What the numbers depend on: the model's weights, the data, the settings (None: unknown)."""

    model: str | None = field(default=None, metadata=ALWAYS)
    data: str | None = field(default=None, metadata=ALWAYS)
    settings: SettingsRecord | None = None


@dataclass(kw_only=True)
class GlobalRecord(_Record):
    """The resolved ``Global`` block of the CLI's config: the keys the report describes the run with (the others
    are kept as they are)."""

    model_dir: str | None = None
    model_filename: str | None = None
    params_filename: str | None = None
    arch: str | None = None
    arch_kwargs: dict[str, Any] | None = None
    weights: str | None = None
    data_dir: str | None = None
    val_list: str | None = None
    max_samples: int | None = None


RANDOM_WEIGHTS = "random weights: the numbers describe an untrained network"
"""What the log and the report say of a model built from ``Global.arch`` with no weights."""


@dataclass(kw_only=True)
class ConfigRecord(_Record):
    """The resolved configuration: the CLI's ``Global`` and ``SensitivityAnalysis`` blocks with the config file, or
    the Python API's arguments (``api`` names the entry point; its other arguments stay in ``extra``)."""

    Global: GlobalRecord | None = None
    SensitivityAnalysis: dict[str, Any] | None = None
    source: str | None = None
    ignored_blocks: list[str] | None = None
    api: str | None = None
    # true when Global.arch was built with no weights (no checkpoint, no Global.weights); absent otherwise
    random_weights: bool | None = None
    # the model's own preprocessing (timm's pretrained config, torchvision's weights) that filled unset Global keys
    preprocessing_from: str | None = None

    def target_loss(self) -> float | None:
        """The run's ``target_loss`` (``SensitivityAnalysis.target_loss``, or the API's), if it is a number."""
        section = self.SensitivityAnalysis or {}
        value = section.get("target_loss", self.extra.get("target_loss"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def cli_config(self, **overrides: Any) -> dict[str, Any] | None:
        """``{"Global": ..., "SensitivityAnalysis": ...}`` to rebuild the CLI's config from (with ``overrides`` in
        ``SensitivityAnalysis``); None when the API wrote the file."""
        if self.Global is None:
            return None
        section = {**(self.SensitivityAnalysis or {}), **overrides}
        return {"Global": self.Global.to_json(), "SensitivityAnalysis": section}


@dataclass(kw_only=True)
class CostRecord(_Record):
    """MACs and params of a model, with their counting convention when it is the dense model's."""

    convention: str | None = None
    mode: str | None = None
    macs: int | None = None
    params: int | None = None


@dataclass(kw_only=True)
class EarlyStopRecord(_Record):
    """Where a param's early stop tripped, and the condition."""

    ratio: float | None = None
    condition: str | None = None


@dataclass(kw_only=True)
class VariantRecord(_Record):
    """One param pruned at one ratio: its loss, the evaluation's metrics, what was removed, how it was evaluated,
    its cost after physical removal and, with adaptive precision or decision-driven sampling, the loss's interval
    (95%, or at the decision's confidence), the images used and, for a decision, how it ended (``settled``: ``above``
    or ``below`` target_loss, ``exact`` on every image, or ``precise`` within the precision)."""

    loss: float | None = None
    metrics: Metrics = field(default_factory=dict, metadata=SPREAD)
    channels_removed: int | None = None
    channels: int | None = None
    weights_zeroed: int | None = None
    weights: int | None = None
    mode: str | None = None
    seconds: float | None = None
    macs: int | None = None
    params: int | None = None
    macs_reduction: float | None = None
    params_reduction: float | None = None
    interval: list[float] | None = None
    samples: int | None = None
    precision: float | None = None
    settled: str | None = None

    @property
    def estimated(self) -> bool:
        """Whether the loss is an estimate from part of the images (an interval of non-zero width)."""
        interval = self.interval
        return interval is not None and len(interval) == 2 and interval[0] != interval[1]

    def metric(self, name: str) -> float | None:
        """The value of metric ``name`` (None when not recorded)."""
        return self.metrics.get(name)

    def reduction(self, measure: str) -> float | None:
        """The share of the dense model's ``macs`` or ``params`` this variant removes (None when not recorded)."""
        return {"macs": self.macs_reduction, "params": self.params_reduction}[measure]


@dataclass(kw_only=True)
class ParamRecord(_Record):
    """Static facts about one analysed param and its measured variants (keyed by :func:`variant_key`)."""

    module: str | None = None
    kind: str | None = None
    shape: list[int] | None = None
    group: list[str] | None = None
    coupled_params: list[str] | None = None
    conv_groups: int | None = None
    granularity: str | None = None
    mode: str | None = None
    mask_vs_physical_max_abs_diff: float | None = None
    round_to: int | None = None
    early_stop: EarlyStopRecord | None = None
    variants: dict[str, VariantRecord] | None = field(default=None, metadata=RATIO_KEYS)

    def variant(self, ratio: float) -> VariantRecord | None:
        """The variant at ``ratio``; a key written with another formatting (``"0.50"``) is found too."""
        variants = self.variants or {}
        found = variants.get(variant_key(ratio))
        if found is None:
            wanted = normalise_ratio(ratio)
            found = next((v for k, v in variants.items() if normalise_ratio(float(k)) == wanted), None)
        return found


@dataclass(kw_only=True)
class PlanGroupRecord(_Record):
    """One pruned group of a plan."""

    members: list[str] | None = None
    ranking_param: str | None = None
    ratio: float | None = None
    channels: int | None = None
    channels_removed: int | None = None
    predicted_loss: float | None = field(default=None, metadata=ALWAYS)


@dataclass(kw_only=True)
class DensePrunedRecord(_Record):
    """A measurement of the dense and of the pruned model (MACs, params, bytes, milliseconds)."""

    dense: float | None = None
    pruned: float | None = None


@dataclass(kw_only=True)
class RuntimeLatencyRecord(_Record):
    """The dense and the pruned model timed on a deployment runtime, with the latency plan's prediction there."""

    runtime: str | None = None
    device: str | None = None
    batch: int | None = None
    dense_ms: float | None = None
    pruned_ms: float | None = None
    predicted_ms: float | None = None
    # written since each measurement is bracketed by dense timings: the median reduction, its interval over the
    # timings, how far apart the dense timings were, whether that was within the tolerance, the runtime's settings
    reduction: float | None = None
    interval: list[float] | None = None
    drift: float | None = None
    steady: bool | None = None
    settings: dict[str, Any] | None = None


@dataclass(kw_only=True)
class ReestimatedRecord(_Record):
    """The verified model after BatchNorm re-estimation: its metrics and losses, on what it was re-estimated, and
    (written since the calibration check exists) whether the calibration check found these figures reliable."""

    metrics: Metrics | None = None
    measured_loss: Metrics | None = None
    batchnorm_layers: list[str] | None = None
    calibration_images: int | None = None
    calibration: dict[str, Any] | None = None
    reliable: bool | None = None


@dataclass(kw_only=True)
class CalibrationCheckRecord(_Record):
    """The dense model with the same BatchNorm layers re-estimated on the same calibration images: its metrics, the
    relative loss of ``metric`` against the baseline, the tolerance, and whether re-estimated figures are reliable."""

    metric: str | None = None
    dense_reestimated: Metrics | None = None
    loss: float | None = None
    tolerance: float | None = None
    reliable: bool | None = None


@dataclass(kw_only=True)
class VerificationRecord(_Record):
    """What the jointly pruned model measured (``run.py verify``)."""

    baseline: Metrics | None = None
    pruned: Metrics | None = None
    predicted_loss: float | None = field(default=None, metadata=ALWAYS)
    measured_loss: Metrics | None = None
    reestimated: ReestimatedRecord | None = field(default=None, metadata=ALWAYS)
    macs: DensePrunedRecord | None = None
    params: DensePrunedRecord | None = None
    checkpoint_bytes: DensePrunedRecord | None = None
    latency_ms: dict[str, DensePrunedRecord] | None = None
    device: str | None = None
    calibration_check: CalibrationCheckRecord | None = None
    # timed on the plan's latency runtime (a latency budget, or latency_runtime set); absent else
    runtime_latency: RuntimeLatencyRecord | None = None


@dataclass(kw_only=True)
class RecoveryRecord(_Record):
    """The plan's model recovered by ``run.py compress``: the dense, one-shot, re-estimated and recovered metrics on
    the evaluation images, how training went, the recipe and where the files are; ``history`` lists every
    evaluation (``step`` and metrics)."""

    dense: Metrics | None = None
    one_shot: Metrics | None = None
    reestimated: Metrics | None = None
    recovered: Metrics | None = None
    best_step: int | None = None
    steps: int | None = None
    total_steps: int | None = None
    stopped: str | None = None
    resumed_from: int | None = None
    seconds: float | None = None
    images_per_second: float | None = None
    train_images: int | None = None
    processes: int | None = None
    precision: str | None = None
    recipe: dict[str, Any] | None = None
    distillation: dict[str, Any] | None = None
    history: list[dict[str, Any]] | None = None
    folder: str | None = None
    exported: dict[str, str] | None = None


@dataclass(kw_only=True)
class PlanRecord(_Record):
    """The latest pruning plan (``run.py plan``/``verify``); ``settings`` (channel ranking) and ``search`` (what the
    measured method's search did) stay JSON objects."""

    measure: str | None = None
    target: float | None = field(default=None, metadata=ALWAYS)
    source: str | None = None
    method: str | None = None
    method_description: str | None = None
    predicted_loss: float | None = field(default=None, metadata=ALWAYS)
    lower_bound: float | None = field(default=None, metadata=ALWAYS)
    # why the summed predicted loss predicts nothing (outside the range a loss of its metric can mean); absent else
    prediction_notice: str | None = None
    dense: CostRecord | None = None
    pruned: CostRecord | None = None
    macs_reduction: float | None = None
    params_reduction: float | None = None
    settings: dict[str, Any] | None = None
    groups: list[PlanGroupRecord] | None = None
    search: dict[str, Any] | None = None
    ratios_file: str | None = None
    verification: VerificationRecord | None = None
    exported: dict[str, str] | None = None
    # a latency budget's runtime, predicted and measured latency per attempt (JSON object); absent else
    latency: dict[str, Any] | None = None
    # combined budgets: every budget the plan meets, {measure: reduction}; absent for one budget
    budgets: dict[str, float] | None = None
    # run.py compress: the recovered model (absent for a plan that was not recovered)
    recovery: RecoveryRecord | None = None


@dataclass(kw_only=True)
class Sidecar(_Record):
    """The whole sidecar. Sections of files written by earlier versions may be missing (None)."""

    tool: ToolRecord | None = None
    fingerprint: FingerprintRecord | None = None
    numerics: NumericsRecord | None = None
    config: ConfigRecord | None = None
    params: dict[str, ParamRecord] | None = None
    unprunable: dict[str, str] | None = None
    model_order: list[str] | None = None
    baseline: Metrics | None = None
    cost: CostRecord | None = None
    saved_at: str | None = None
    plan: PlanRecord | None = None
    plan_search: dict[str, dict[str, Any]] | None = None

    @property
    def settings(self) -> SettingsRecord:
        """The fingerprint's settings (empty when not recorded)."""
        settings = self.fingerprint.settings if self.fingerprint is not None else None
        return settings if settings is not None else SettingsRecord()

    def param(self, name: str) -> ParamRecord | None:
        """The record of param ``name``, if any."""
        return (self.params or {}).get(name)

    def param_records(self) -> dict[str, ParamRecord]:
        """Every param's record, in the file's order."""
        return self.params or {}

    def variant(self, name: str, ratio: float) -> VariantRecord | None:
        """The variant of ``name`` pruned at ``ratio``, if recorded."""
        param = self.param(name)
        return None if param is None else param.variant(ratio)

    def variants(self) -> Iterator[tuple[str, float, VariantRecord]]:
        """``(param, ratio, variant)`` of every recorded variant."""
        for name, param in self.param_records().items():
            for key, variant in (param.variants or {}).items():
                yield name, float(key), variant

    def early_stops(self) -> dict[str, float]:
        """The ratio each early-stopped param stopped at."""
        return {
            name: float(param.early_stop.ratio)
            for name, param in self.param_records().items()
            if param.early_stop is not None and param.early_stop.ratio is not None
        }

    def keep_search_log(
        self, key: str, description: Mapping[str, Any], evaluations: Sequence[Mapping[str, Any]]
    ) -> None:
        """Keep the measured method's evaluations of one search key (``plan_search.<key>``: what they depend on and
        each evaluation)."""
        section = dict(self.plan_search or {})
        section[key] = {"key": dict(description), "evaluations": [dict(entry) for entry in evaluations]}
        self.plan_search = section

    def absorb(self, other: Sidecar) -> None:
        """Take in another file's params (its variants win for the same ratio), unprunable units and, when this
        sidecar has none, its baseline and dense cost."""
        params = self.params if self.params is not None else {}
        for name, theirs in other.param_records().items():
            mine = params.setdefault(name, ParamRecord())
            variants = {**(mine.variants or {}), **(theirs.variants or {})}
            mine.update_json({**theirs.to_json(), "variants": _encode(variants)}, _item("params", name))
        self.params = params
        self.unprunable = {**(self.unprunable or {}), **(other.unprunable or {})}
        if self.baseline is None and other.baseline is not None:
            self.baseline = dict(other.baseline)
        if self.cost is None and other.cost is not None:
            self.cost = CostRecord.from_json(other.cost.to_json(), "cost")


# ------------------------------------------------------------------------------------------------ load and dump


def parse(data: Any, path: str | os.PathLike[str] = "") -> Sidecar:
    """Validate a parsed sidecar (a JSON object) into a :class:`Sidecar`.

    Raises:
        AnalysisFileError: An entry has the wrong type; the message names ``path`` and the key.
    """
    try:
        return Sidecar.from_json(data)
    except InvalidEntry as error:
        raise AnalysisFileError(f"Sidecar file {path} has the wrong structure: {error}; {_ADVICE}.") from None


def load(analysis_file: str | os.PathLike[str]) -> Sidecar | None:
    """The sidecar of ``analysis_file``, validated, or None when there is none.

    Raises:
        AnalysisFileError: The sidecar is unreadable, not strict UTF-8 JSON, or has the wrong structure.
    """
    data = load_sidecar(analysis_file)
    return None if data is None else parse(data, sidecar_path(analysis_file))


def dump(sidecar: Sidecar) -> str:
    """The sidecar as text: indent 2, UTF-8 characters as they are, a trailing newline.

    Raises:
        ValueError: It holds NaN or infinity (refused so the file stays strict JSON).
    """
    return sidecar_text(sidecar.to_json())


def save(analysis_file: str | os.PathLike[str], sidecar: Sidecar) -> Path:
    """Write the sidecar of ``analysis_file`` atomically; returns its path."""
    path = sidecar_path(analysis_file)
    atomic_write_text(path, dump(sidecar))
    return path

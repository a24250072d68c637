"""Typed configuration: ACT-style YAML + dotted overrides + CLI flags -> :class:`Config`.

The dataclasses below are the single source of truth for every key, its type and its default. Loading goes
YAML (parsed with line numbers) -> key checks with suggestions -> ``OmegaConf.merge(schema, yaml, dotted,
flags)`` -> semantic validation. Every problem is a :class:`~analysis.errors.ConfigError` naming the full key.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import textwrap
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from analysis.early_stop import EARLY_STOP_MODES, early_stop_from
from analysis.errors import ConfigError, did_you_mean, first_line
from analysis.metrics import LABEL_FREE_METRICS, METRIC_NAMES
from analysis.ratio import RATIO_DECIMALS, normalise_ratio, ratio_problem

logger = logging.getLogger(__name__)

# A config holds hundreds of values; aliases that expand past this are a mistake or an attack ("billion laughs").
MAX_YAML_NODES = 100_000
_IN_PROGRESS = -1
# Images with more pixels are refused unless Global.max_image_pixels allows them: Pillow's own refusal threshold (twice
# its MAX_IMAGE_PIXELS), which guards against decompression bombs (a small file that decodes to gigabytes).
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
# torch keeps a device index in 8 bits (cuda:128 would become cuda:-128) and seeds in 64 bits (signed or not).
MAX_DEVICE_INDEX = 127
SEED_RANGE = (-(2**63), 2**64 - 1)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("bilinear", "bicubic", "lanczos")
CRITERIA = ("l1_norm", "l2_norm", "geometry_median", "bn_scale")
LABEL_MODES = ("required", "none")
GROUP_REDUCTIONS = ("self", "mean")
DATA_CACHE_MODES = ("auto", "ram", "off")
NUMERICS_MODES = ("exact", "tf32", "bf16")
"""Arithmetic of the forward passes: float32 with TF32 off and deterministic algorithms, or an opt-in speed mode."""
ENGINES = ("fast", "reference")
LATENCY_RUNTIMES = ("auto", "torch", "onnxruntime", "command")
LATENCY_TABLES = ("model", "layers")
METRIC_MODES = ("relative", "absolute")
GRANULARITIES = ("filter", "element")
UNIT_KINDS = ("conv", "linear", "heads")
"""Kinds of prunable unit: conv filters (Conv1d/2d/3d), Linear neurons, attention heads."""
PLAN_METHODS = ("knapsack", "measured")

# Blocks of PaddleSlim ACT compression configs. They configure training-time compression, which this tool does
# not run, so they are accepted and reported as ignored (ChannelPrune lends two defaults, see _channel_prune_defaults).
ACT_BLOCKS = (
    "Distillation",
    "MultiTeacherDistillation",
    "ChannelPrune",
    "UnstructurePrune",
    "TransformerPrune",
    "ASPPrune",
    "QuantAware",
    "QuantPost",
    "Quantization",
    "TrainConfig",
    "HyperParameterOptimization",
)
# Keys of ACT's Global block that only matter to Paddle's reader; accepted and ignored.
IGNORED_GLOBAL_KEYS = ("input_name", "reader_config")
GLOBAL_ALIASES = {"crop_size": "img_size"}
CHANNEL_PRUNE_DEFAULTS = ("prune_params_name", "criterion")


@dataclass
class GlobalConfig:
    """The ``Global`` block: where the model and the evaluation data come from and how images are prepared."""

    model_dir: str | None = None
    model_filename: str | None = None
    params_filename: str | None = None
    arch: str | None = None
    arch_kwargs: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    trust_model_file: bool = False
    data_dir: str | None = None
    val_list: str = "val_list.txt"
    batch_size: int = 32
    img_size: int = 224
    resize_size: int = 256
    interpolation: str = "bilinear"
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    num_workers: int | None = None
    data_cache: str = "auto"
    cache_max_gb: float | None = None
    device: str = "auto"
    numerics: str = "exact"
    device_cache_share: float = 0.5
    max_samples: int | None = None
    seed: int = 0
    calib_list: str | None = None
    calib_samples: int = 1024
    calib_resize_size: int | None = None
    calib_img_size: int | None = None
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    labels: str = "required"


@dataclass
class SensitivityConfig:
    """The ``SensitivityAnalysis`` block: what to prune, at which ratios, and how to score it."""

    analysis_file: str | None = None
    pruned_ratios: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4])
    target_loss: float | None = None
    criterion: str = "l1_norm"
    prune_params_name: list[str] | None = None
    skip_params: list[str] = field(default_factory=list)
    metric: str = "top1"
    metric_mode: str = "relative"
    group_reduction: str = "self"
    engine: str = "fast"
    precision: float | int | str | None = None
    decision_error: float = 0.05
    decision_precision: float | None = None
    granularity: str = "filter"
    units: list[str] | None = None
    early_stop_mode: str | None = None
    early_stop_value: float | None = None
    adaptive_bn: bool = False
    round_to: int = 1
    target_macs_reduction: float | None = None
    target_params_reduction: float | None = None
    target_latency_reduction: float | None = None
    target_latency_ms: float | None = None
    latency_runtime: str = "auto"
    latency_table: str = "model"
    latency_batch: int = 1
    runtime_command: str | None = None
    runtime_pattern: str | None = None
    plan_method: str = "knapsack"
    eval_budget: int | None = None
    verify: bool = False
    export_dir: str | None = None
    export_onnx: bool = True
    report: bool = True


@dataclass
class Config:
    """The whole resolved configuration, plus what was read but not used."""

    Global: GlobalConfig = field(default_factory=GlobalConfig)
    SensitivityAnalysis: SensitivityConfig = field(default_factory=SensitivityConfig)
    source: str | None = None
    ignored_blocks: list[str] = field(default_factory=list)
    # "Section.key" of every key the YAML, an override or a flag set: those win over a model's own preprocessing
    explicit_keys: list[str] = field(default_factory=list, compare=False)  # bookkeeping, not configuration


SECTIONS: dict[str, type] = {"Global": GlobalConfig, "SensitivityAnalysis": SensitivityConfig}


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Load a YAML config and apply overrides.

    Args:
        path: The YAML file (ACT style: ``Global`` plus optional ``SensitivityAnalysis`` and ACT blocks).
        overrides: Dotted ``Section.key=value`` strings; values are parsed as YAML.
        flags: Values from dedicated CLI flags as ``{"Section.key": value}``; ``None`` values are skipped.
            Precedence: flags > overrides > YAML > defaults.

    Raises:
        ConfigError: For any unreadable file, unknown key, wrong type or out-of-range value.
    """
    path = Path(path)
    return config_from_data(_read_yaml(path), path, overrides, flags)


def config_from_data(
    raw: dict[str, Any],
    path: str | Path,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Like :func:`load_config`, from an already parsed mapping (e.g. the resolved config an analysis file's sidecar
    keeps); ``path`` names where it came from in messages and gives the default analysis file's folder."""
    path = Path(path)
    sections, ignored = _split_blocks(raw, path)
    dotted = _parse_overrides(overrides)
    layers = (sections, dotted, _flags_to_nested(flags or {}))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_describe_omegaconf_error(error)) from None
    except TypeError:  # OmegaConf's "Cannot merge incompatible container types" names no key
        clash = _describe_container_clash(layers)
        if clash is None:
            raise  # not a mapping/list clash: a bug, which keeps its traceback
        raise ConfigError(clash) from None
    assert isinstance(config, Config)
    _check_list_items(config)
    config.source = str(path)
    config.ignored_blocks = ignored
    config.explicit_keys = sorted({f"{section}.{key}" for layer in layers for section, block in layer.items()
                                   for key in block})  # fmt: skip
    if config.SensitivityAnalysis.analysis_file is None:
        config.SensitivityAnalysis.analysis_file = str(Path("outputs") / path.stem / "sensitivity.pkl")
    validate(config)
    return config


def validate(config: Config) -> None:
    """Check values that types alone cannot express; normalise ratios to sorted ``round(r, 6)`` keys."""
    g, s = config.Global, config.SensitivityAnalysis
    if not g.data_dir:
        raise ConfigError("Global.data_dir is not set; point it at the folder holding val_list.txt or val/<class>/.")
    if g.arch is None and g.model_filename is None and g.params_filename is None and g.model_dir is None:
        raise ConfigError(
            "Global has no model: set Global.arch (a torchvision name or module:callable) and optionally "
            "Global.model_dir/params_filename for its weights."
        )
    for key in ("batch_size", "img_size", "resize_size"):
        if getattr(g, key) < 1:
            raise ConfigError(f"Global.{key} must be a positive integer, got {getattr(g, key)}.")
    if g.resize_size < g.img_size:
        raise ConfigError(
            f"Global.resize_size ({g.resize_size}) is smaller than Global.img_size ({g.img_size}); the center crop "
            "would pad the image with black borders, so set resize_size >= img_size."
        )
    check_choice("Global.interpolation", g.interpolation, INTERPOLATIONS)
    for key in ("mean", "std"):
        values = getattr(g, key)
        if len(values) != 3:
            raise ConfigError(f"Global.{key} must list 3 values (R, G, B), got {len(values)}.")
        if not all(math.isfinite(v) for v in values):
            raise ConfigError(f"Global.{key} must hold finite numbers, got {list(values)}.")
    if any(v <= 0 for v in g.std):
        raise ConfigError(f"Global.std values must be positive, got {list(g.std)}.")
    if g.num_workers is not None and g.num_workers < 0:
        raise ConfigError(f"Global.num_workers must be 0 or more (or unset for automatic), got {g.num_workers}.")
    check_choice("Global.data_cache", g.data_cache, DATA_CACHE_MODES)
    check_choice("Global.labels", g.labels, LABEL_MODES)
    check_choice("Global.numerics", g.numerics, NUMERICS_MODES)
    if not 0 <= g.device_cache_share <= 1:
        raise ConfigError(
            "Global.device_cache_share must be a share of the free GPU memory from 0 (keep the decoded images in host "
            f"memory) to 1, got {g.device_cache_share}."
        )
    if g.cache_max_gb is not None and not (0 < g.cache_max_gb < math.inf):
        raise ConfigError(
            f"Global.cache_max_gb must be a positive number of GB (unset: half the free RAM), got {g.cache_max_gb}."
        )
    if g.max_samples is not None and g.max_samples < 1:
        raise ConfigError(f"Global.max_samples must be a positive integer (or unset for all), got {g.max_samples}.")
    if g.max_image_pixels is not None and g.max_image_pixels < 1:
        raise ConfigError(
            f"Global.max_image_pixels must be a positive number of pixels (null: no limit), got {g.max_image_pixels}."
        )
    validate_calibration(g)
    device = re.fullmatch(r"auto|cpu|cuda|cuda:(0|[1-9][0-9]{0,2})|mps", g.device)
    if device is None or int(device.group(1) or 0) > MAX_DEVICE_INDEX:
        raise ConfigError(f"Global.device must be auto, cpu, cuda or cuda:N, got '{printable(g.device)}'.")
    if not SEED_RANGE[0] <= g.seed <= SEED_RANGE[1]:
        raise ConfigError(
            f"Global.seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (what torch.manual_seed takes), "
            f"got {g.seed}."
        )

    validate_section(s)
    if s.adaptive_bn and g.calib_samples == 0:
        raise ConfigError(
            "SensitivityAnalysis.adaptive_bn re-estimates BatchNorm statistics on calibration images, but "
            "Global.calib_samples is 0; set it to a positive number (default 1024)."
        )
    validate_budget(s)
    validate_label_free(g, s)


def validate_section(
    s: SensitivityConfig, prefix: str = "SensitivityAnalysis.", names: Mapping[str, str] | None = None
) -> None:
    """Check the analysis settings the YAML block and the Python APIs share; normalises the ratios to sorted
    ``round(r, 6)``.

    One function for every entry (``run.py``, ``analysis_prune`` and NNI's ``SensitivityAnalysis``), so they accept
    and refuse the same settings.

    Args:
        s: The settings, as the YAML block or built from an API's arguments.
        prefix: Put before every key a message names: the YAML's section, or ``""`` for the APIs, whose arguments
            carry the bare names.
        names: An API's own names for keys it calls otherwise (NNI's ``sparsities`` for ``pruned_ratios``), used in
            the messages this function writes (the sampling and granularity checks name their keys with ``prefix``).

    Raises:
        ConfigError: For the first setting that is refused, naming its key.
    """
    renamed = names or {}

    def key(name: str) -> str:
        return prefix + renamed.get(name, name)

    s.pruned_ratios = normalise_ratios(s.pruned_ratios, key("pruned_ratios"))
    check_target_loss(s.target_loss, key("target_loss"))
    check_choice(key("criterion"), s.criterion, CRITERIA)
    choices = (
        ("metric", METRIC_NAMES),
        ("metric_mode", METRIC_MODES),
        ("group_reduction", GROUP_REDUCTIONS),
        ("engine", ENGINES),
        ("granularity", GRANULARITIES),
    )
    for name, allowed in choices:
        check_choice(key(name), getattr(s, name), allowed)
    check_sampling(
        Sampling(s.precision, s.decision_error, s.decision_precision), s.engine, s.target_loss, s.early_stop_mode,
        prefix,
    )  # fmt: skip
    if s.units is not None:
        check_units(s.units, key("units"))
    if s.early_stop_mode is not None:
        check_choice(key("early_stop_mode"), s.early_stop_mode, EARLY_STOP_MODES)
    early_stop_from(s.early_stop_mode, s.early_stop_value, key("early_stop_mode"))
    if isinstance(s.round_to, bool) or not isinstance(s.round_to, int) or s.round_to < 1:
        raise ConfigError(f"{key('round_to')} must be a positive integer (1 = no rounding), got {s.round_to!r}.")
    if s.round_to > 1 and s.granularity == "element":
        raise ConfigError(f"{key('round_to')} rounds channel counts; it does not apply to granularity: element.")
    check_granularity(s.granularity, s.criterion, prefix)
    if not s.analysis_file:
        raise ConfigError(f"{key('analysis_file')} must not be empty.")


def validate_budget(s: SensitivityConfig) -> None:
    """Budget targets, each a fraction in (0, 1) (any of MACs, params and latency at once, one latency form);
    ``verify``/``export_dir`` need something to apply."""
    if s.export_dir is not None and not s.export_dir.strip():
        raise ConfigError("SensitivityAnalysis.export_dir is empty; name a folder (. for the current one).")
    targets = {
        "target_macs_reduction": s.target_macs_reduction,
        "target_params_reduction": s.target_params_reduction,
        "target_latency_reduction": s.target_latency_reduction,
    }
    given = {k: v for k, v in targets.items() if v is not None}
    absolute = s.target_latency_ms is not None
    if absolute and s.target_latency_reduction is not None:
        raise ConfigError(
            "SensitivityAnalysis.target_latency_reduction and target_latency_ms are both set; keep one latency budget."
        )
    validate_latency(s)
    if given and s.granularity == "element":
        raise ConfigError(
            f"SensitivityAnalysis.{next(iter(given))} plans filter pruning; it does not apply to granularity: element."
        )
    for key, value in given.items():
        if not (0.0 < value < 1.0 and math.isfinite(value)):
            raise ConfigError(f"SensitivityAnalysis.{key} must be between 0 and 1 (0.4 = 40% fewer), got {value}.")
        if value < 10**-RATIO_DECIMALS:  # a budget of 1e-308 overflows the plan's units
            raise ConfigError(
                f"SensitivityAnalysis.{key} must be at least {10**-RATIO_DECIMALS:g} (budgets, like ratios, count "
                f"{RATIO_DECIMALS} decimals), got {value}."
            )
    check_choice("SensitivityAnalysis.plan_method", s.plan_method, PLAN_METHODS)
    if s.eval_budget is not None and s.eval_budget < 1:
        raise ConfigError(
            f"SensitivityAnalysis.eval_budget must be a positive number of evaluations, got {s.eval_budget}."
        )
    check_plan_granularity(s)
    if (s.verify or s.export_dir is not None) and not given and not absolute and s.target_loss is None:
        key = "verify" if s.verify else "export_dir"
        raise ConfigError(
            f"SensitivityAnalysis.{key} needs ratios to apply: set SensitivityAnalysis.target_macs_reduction, "
            "target_params_reduction, target_latency_reduction, target_latency_ms or target_loss."
        )


def validate_latency(s: SensitivityConfig) -> None:
    """The latency budget's keys: a positive goal in ms, a known runtime (a command template for ``command``), a
    known table kind, a positive batch."""
    if s.target_latency_ms is not None and not (s.target_latency_ms > 0 and math.isfinite(s.target_latency_ms)):
        raise ConfigError(
            f"SensitivityAnalysis.target_latency_ms must be a positive time in ms, got {s.target_latency_ms}."
        )
    check_choice("SensitivityAnalysis.latency_runtime", s.latency_runtime, LATENCY_RUNTIMES)
    check_choice("SensitivityAnalysis.latency_table", s.latency_table, LATENCY_TABLES)
    if s.latency_runtime == "command" and not (s.runtime_command or "").strip():
        raise ConfigError(
            "SensitivityAnalysis.latency_runtime: command needs SensitivityAnalysis.runtime_command, e.g. "
            "'trtexec --onnx={onnx}' (it must print the latency in ms)."
        )
    if s.latency_batch < 1:
        raise ConfigError(f"SensitivityAnalysis.latency_batch must be a positive batch size, got {s.latency_batch}.")


def check_plan_granularity(s: SensitivityConfig) -> None:
    """``verify`` and ``export_dir`` prune filters physically: refused with ``granularity: element``, which zeroes
    single weights and has no smaller model to measure or export."""
    if s.granularity != "element":
        return
    for key, value in (("verify", s.verify), ("export_dir", s.export_dir is not None)):
        if value:
            raise ConfigError(
                f"SensitivityAnalysis.{key} prunes filters into a smaller model; it does not apply to granularity: "
                "element, which zeroes single weights (apply the ElementPrune ratios with your own pruning schedule)."
            )


def validate_label_free(g: GlobalConfig, s: SensitivityConfig) -> None:
    """Without labels (``Global.labels: none``) only the label-free metrics can be measured (verification then
    measures the same metric), and the measured plan method, which scores top1 against labels, cannot run."""
    if g.labels != "none":
        return
    if s.metric not in LABEL_FREE_METRICS:
        raise ConfigError(
            f"Global.labels is none, so SensitivityAnalysis.metric must be agreement or kl (top1, top5 and ce need "
            f"labels), got '{printable(s.metric)}'."
        )
    budget = any(value is not None for value in (s.target_macs_reduction, s.target_params_reduction,
                                                  s.target_latency_reduction, s.target_latency_ms))  # fmt: skip
    if s.plan_method == "measured" and budget:
        raise ConfigError(
            "SensitivityAnalysis.plan_method: measured scores plans on top1 and cross-entropy against labels, which "
            "Global.labels: none turns off; use plan_method: knapsack, or give the list file labels."
        )


def validate_calibration(g: GlobalConfig) -> None:
    """Calibration keys: a non-negative image count and sizes that make a valid center crop."""
    if g.calib_samples < 0:
        raise ConfigError(
            f"Global.calib_samples must be 0 (no calibration) or a positive number of images, got {g.calib_samples}."
        )
    for key in ("calib_img_size", "calib_resize_size"):
        value = getattr(g, key)
        if value is not None and value < 1:
            raise ConfigError(
                f"Global.{key} must be a positive integer (or unset for the evaluation size), got {value}."
            )
    img = g.calib_img_size if g.calib_img_size is not None else g.img_size
    resize = g.calib_resize_size if g.calib_resize_size is not None else g.resize_size
    if resize < img:
        raise ConfigError(
            f"Global.calib_resize_size ({resize}) is smaller than Global.calib_img_size ({img}); the center crop would "
            "pad the calibration images, so set calib_resize_size >= calib_img_size."
        )
    if g.calib_list is not None and not g.calib_list.strip():
        raise ConfigError(
            "Global.calib_list is empty; name a list file or a folder of class folders, or leave it unset."
        )


def check_units(units: Sequence[str], key: str) -> None:
    """A non-empty list of distinct unit kinds (:data:`UNIT_KINDS`).

    Raises:
        ConfigError: Naming ``key``: an empty list, a repeated or an unknown kind.
    """
    if not units:
        raise ConfigError(f"{key} must list at least one of {', '.join(UNIT_KINDS)} (leave it out for all of them).")
    for kind in units:
        check_choice(f"{key}", kind, UNIT_KINDS)
    if len(set(units)) != len(units):
        raise ConfigError(f"{key} lists a kind twice: {list(units)}.")


def check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    """Raise a :class:`ConfigError` naming ``key`` when ``value`` is not one of ``allowed`` (with a suggestion)."""
    if value not in allowed:
        choices = ", ".join(allowed)
        raise ConfigError(f"{key} must be one of {choices}, got '{printable(value)}'{did_you_mean(value, allowed)}.")


def printable(text: object) -> str:
    """``text`` with every character that is not printable (line breaks, control and format characters) escaped as
    in a Python literal, so that a message quoting the user's input stays one line."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))


def check_granularity(granularity: str, criterion: str, prefix: str = "") -> None:
    """Refuse a channel-ranking criterion with element-wise pruning, which always goes by weight magnitude."""
    check_choice(f"{prefix}granularity", granularity, GRANULARITIES)
    if granularity == "element" and criterion not in ("l1_norm", "l2_norm"):
        raise ConfigError(
            f"{prefix}granularity: element zeroes the smallest weights by magnitude, so {prefix}criterion "
            f"'{criterion}' does not apply; leave it at l1_norm."
        )


def normalise_ratios(ratios: Sequence[float], key: str) -> list[float]:
    """Return the ratios rounded to 6 decimals, deduplicated and sorted; each must lie strictly in (0, 1)."""
    if not ratios:
        raise ConfigError(f"{key} is empty; list at least one ratio, e.g. [0.1, 0.2, 0.3, 0.4].")
    for ratio in ratios:
        if not (0.0 < ratio < 1.0):
            raise ConfigError(f"{key} must hold ratios strictly between 0 and 1, got {ratio}.")
        if ratio_problem(ratio, zero_allowed=False) is not None:  # stored rounded: 1e-7 would become 0.0
            raise ConfigError(
                f"{key} holds {ratio}, which rounds to {normalise_ratio(ratio)} at the "
                f"{RATIO_DECIMALS} decimals ratios are stored with; use a ratio between "
                f"{10**-RATIO_DECIMALS:g} and {1 - 10**-RATIO_DECIMALS:g}."
            )
    return sorted({normalise_ratio(r) for r in ratios})


def describe(config: Config) -> str:
    """Return a compact, human-readable summary of the resolved config (set values only)."""
    lines = [f"config: {config.source}"]
    for name in SECTIONS:
        section = getattr(config, name)
        items = [f"{k}={_short(v)}" for k, v in dataclasses.asdict(section).items() if v not in (None, [], {})]
        lines.append(textwrap.fill(" ".join(items), width=118, initial_indent=f"  {name}: ", subsequent_indent="    "))
    if config.ignored_blocks:
        lines.append(f"  ignored blocks: {', '.join(config.ignored_blocks)}")
    return "\n".join(lines)


DECISION = "decision"
"""``precision: decision``: decision-driven sampling (see :mod:`analysis.engine._decision`)."""


@dataclass(frozen=True)
class Sampling:
    """How many images a variant is evaluated on: ``precision`` None (all: exact), a number (adaptive precision,
    +-precision at 95%) or ``decision`` (until its side of ``target_loss`` is known, with a run-wide error rate of
    ``decision_error``, or within +-``decision_precision`` if set)."""

    precision: float | int | str | None = None
    decision_error: float = 0.05
    decision_precision: float | None = None

    @property
    def decision(self) -> bool:
        """Whether decision-driven sampling is asked for."""
        return self.precision == DECISION


def check_sampling(
    sampling: Sampling, engine: str, target_loss: float | None, early_stop_mode: str | None, prefix: str = ""
) -> None:
    """Refuse a sampling setting the run cannot honour, naming the key (``prefix`` + key).

    Raises:
        ConfigError: For a precision that is neither a fraction nor ``decision``, sampling without the fast engine,
            decision-driven sampling without ``target_loss`` or with an early stop, or a bad error rate.
    """
    precision = sampling.precision
    if precision is None:
        if sampling.decision_precision is not None:
            raise ConfigError(f"{prefix}decision_precision is set but {prefix}precision is not decision; set both.")
        return
    if isinstance(precision, str) and not sampling.decision:
        raise ConfigError(
            f"{prefix}precision must be a number between 0 and 1 (e.g. 0.002) or decision, "
            f"got '{printable(precision)}'."
        )
    if not sampling.decision and not (isinstance(precision, (int, float)) and 0.0 < float(precision) < 1.0):
        raise ConfigError(f"{prefix}precision must be between 0 and 1 (e.g. 0.002) or decision, got {precision}.")
    if engine != "fast":
        raise ConfigError(f"{prefix}precision needs {prefix}engine: fast.")
    if not sampling.decision:
        if sampling.decision_precision is not None:
            raise ConfigError(f"{prefix}decision_precision applies to precision: decision, not to a number.")
        return
    if target_loss is None:
        raise ConfigError(
            f"{prefix}precision: decision settles each variant on its side of {prefix}target_loss; set target_loss "
            "(e.g. 0.02)."
        )
    if early_stop_mode is not None:
        raise ConfigError(
            f"{prefix}precision: decision already skips the ratios above the first one settled above target_loss; "
            f"remove {prefix}early_stop_mode."
        )
    error = sampling.decision_error
    if not (0.0 < error < 1.0 and math.isfinite(error)):
        raise ConfigError(f"{prefix}decision_error must be between 0 and 1 (e.g. 0.05), got {error}.")
    extra = sampling.decision_precision
    if extra is not None and not (0.0 < extra < 1.0):
        raise ConfigError(f"{prefix}decision_precision must be between 0 and 1 (e.g. 0.005), got {extra}.")


def check_target_loss(value: float | None, key: str) -> None:
    """Refuse a ``target_loss`` that is not a finite relative loss in [0, 1] (None: unset), naming ``key``."""
    if value is not None and not (0.0 <= value <= 1.0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a relative loss between 0 and 1 (0.01 = 1%), got {value}.")


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{', '.join(map(str, value[:3]))}, ... {len(value)} items]"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type information
    """PyYAML's safe loader, refusing a key written twice in one mapping (plain PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[str, int] = {}
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in first_lines:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key '{printable(key)}' on line {line} repeats the key on line {first_lines[key]}",
                    key_node.start_mark,
                )  # fmt: skip
            if isinstance(key, str):
                first_lines[key] = line
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping

    def construct_document(self, node: yaml.Node) -> Any:
        """Refuse a document whose aliases expand past ``MAX_YAML_NODES`` before anything copies it out."""
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"its aliases (*name) expand to more than {MAX_YAML_NODES:,} values, the most a config may hold; "
                "use fewer aliases", node.start_mark,
            )  # fmt: skip
        return super().construct_document(node)


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` holds once every alias is copied out, in time linear in the distinct nodes (the graph
    is walked with memoisation, never expanded); an alias inside its own anchor (&a [*a]) is refused."""
    if sizes.get(id(node)) == _IN_PROGRESS:
        raise yaml.constructor.ConstructorError(
            None, None, "an alias (*name) is used inside its own anchor, which would make the value contain itself",
            node.start_mark,
        )  # fmt: skip
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = _IN_PROGRESS
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    total = 1
    for child in children:
        total += _expanded_size(child, sizes)
        if total > MAX_YAML_NODES:
            break  # already too large: the exact count is not needed
    sizes[id(node)] = total
    return total


def yaml_problem(error: yaml.MarkedYAMLError) -> str:
    """`` line L, column C: invalid YAML (what)`` for a PyYAML error, with the line its context opened on."""
    mark, context = error.problem_mark, error.context_mark
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    opened = (
        f", in the {error.context.split()[-1]} opened on line {context.line + 1}"
        if context and error.context and mark and context.line != mark.line
        else ""
    )
    return f"{where}: invalid YAML ({printable(error.problem)}{opened})"


UNHOLDABLE = (RecursionError, ValueError, OverflowError)
"""What Python raises for YAML it parses but cannot hold: nesting thousands deep, a date like 2001-02-30, an integer
of thousands of digits."""


def unholdable(error: BaseException) -> str:
    """What an :data:`UNHOLDABLE` error says, in a few words for a message."""
    return "it nests too deeply" if isinstance(error, RecursionError) else first_line(error)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist; pass an existing YAML file with --config_path.")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.reader.ReaderError as error:  # a character YAML does not allow; its own message spans two lines
        line = text.count("\n", 0, error.position) + 1
        raise ConfigError(
            f"Config file {path} line {line}: invalid YAML (unacceptable character #x{error.character:04x}: "
            f"{error.reason}); remove it."
        ) from None
    except yaml.MarkedYAMLError as error:
        raise ConfigError(f"Config file {path}{yaml_problem(error)}.") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"Config file {path} is not valid YAML ({error}).") from None
    except UNHOLDABLE as error:
        raise ConfigError(
            f"Config file {path} holds a value Python cannot hold ({unholdable(error)}); fix it."
        ) from None
    if data is None:
        raise ConfigError(f"Config file {path} is empty; it needs at least a Global block.")
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must be a mapping of blocks (Global: ...), not a {type(data).__name__}.")
    return data


def _split_blocks(raw: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[str]]:
    """Separate our sections from ACT blocks; check keys; apply aliases and ChannelPrune defaults."""
    if not isinstance(raw.get("Global"), dict):
        raise ConfigError(
            f"Config file {path} has no Global block; add one with the model (arch/model_dir) and data_dir."
        )
    sections: dict[str, Any] = {}
    ignored: list[str] = []
    for name, block in raw.items():
        if name in SECTIONS:
            if block is None:
                block = {}
            if not isinstance(block, dict):
                raise ConfigError(f"{name} in {path} must be a mapping of keys, not a {type(block).__name__}.")
            sections[name] = _check_section(name, block)
        elif name in ACT_BLOCKS:
            ignored.append(name)
        else:
            logger.warning(
                "Unknown top-level block '%s' in %s is ignored%s.", name, path, did_you_mean(str(name), SECTIONS)
            )
            ignored.append(str(name))
    analysis = sections.setdefault("SensitivityAnalysis", {})
    channel_prune = raw.get("ChannelPrune")
    if isinstance(channel_prune, dict):
        for key in CHANNEL_PRUNE_DEFAULTS:
            if key in channel_prune and key not in analysis:
                analysis[key] = channel_prune[key]
                logger.info("Using ChannelPrune.%s as SensitivityAnalysis.%s.", key, key)
    return sections, ignored


def _check_section(name: str, block: dict[str, Any]) -> dict[str, Any]:
    """Return the block with aliases resolved; raise on unknown keys, suggesting the closest valid one."""
    schema_keys = [f.name for f in dataclasses.fields(SECTIONS[name])]
    checked: dict[str, Any] = {}
    for key, value in block.items():
        key = str(key)
        if name == "Global" and key in IGNORED_GLOBAL_KEYS:
            continue
        target = GLOBAL_ALIASES.get(key, key) if name == "Global" else key
        if target not in schema_keys:
            raise ConfigError(f"Unknown key {name}.{printable(key)}{did_you_mean(key, schema_keys)}.")
        if target in checked and checked[target] != value:
            raise ConfigError(f"{name}.{key} and {name}.{target} are aliases but set to different values; keep one.")
        checked[target] = value
    return checked


def _parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn ``Section.key=value`` strings into nested dicts, checking sections and keys."""
    nested: dict[str, dict[str, Any]] = {}
    for item in overrides:
        dotted, sep, value = item.partition("=")
        parts = dotted.split(".")
        shown = printable(item)
        if not sep or len(parts) < 2 or not all(parts):
            raise ConfigError(f"Override '{shown}' must look like Section.key=value, e.g. Global.batch_size=64.")
        if parts[0] not in SECTIONS:
            raise ConfigError(
                f"Override '{shown}' names unknown section '{printable(parts[0])}'{did_you_mean(parts[0], SECTIONS)}; "
                f"use one of {', '.join(SECTIONS)}."
            )
        if _has_tag(value):
            raise ConfigError(
                f"Override '{shown}' carries a YAML tag (!...); write the plain value, as in Global.seed=3."
            )
        try:
            yaml.load(value, Loader=UniqueKeyLoader)  # the same limits as a config file
            layer = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError) as error:
            problem = getattr(error, "problem", None) or first_line(str(error))
            raise ConfigError(f"Override '{shown}' could not be parsed ({problem}); check its YAML value.") from None
        except UNHOLDABLE as error:
            raise ConfigError(f"Override '{shown}' could not be parsed ({unholdable(error)}); fix its value.") from None
        assert isinstance(layer, dict)
        section = _check_section(parts[0], layer[parts[0]])
        _deep_update(nested.setdefault(parts[0], {}), section)
    return nested


def _has_tag(value: str) -> bool:
    """Whether a YAML value carries an explicit tag (``!!binary``, ``!!python/...``): overrides are plain values."""
    try:
        return any(isinstance(token, yaml.TagToken) for token in yaml.scan(value, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return False  # malformed: reported by the parser with its own reason


def _flags_to_nested(flags: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        nested.setdefault(section, {})[key] = value
    return nested


def _deep_update(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


_EXPECTED = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "String": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
}


_ITEM_KINDS = {float: "numbers", int: "integers", str: "strings", bool: "true or false values"}


def _check_list_items(config: Config) -> None:
    """Refuse a list or mapping inside a list of scalars: OmegaConf converts a typed list's scalars but lets a
    container through."""
    for name, cls in SECTIONS.items():
        for key, hint in typing.get_type_hints(cls).items():
            value = getattr(getattr(config, name), key)
            lists = [arg for arg in (hint, *typing.get_args(hint)) if typing.get_origin(arg) is list]
            if lists and isinstance(value, list) and any(isinstance(item, (list, dict)) for item in value):
                kind = _ITEM_KINDS.get(typing.get_args(lists[0])[0], "plain values")
                raise ConfigError(f"{name}.{key} must be a list of {kind}, got {value!r}.")


def _describe_container_clash(layers: Sequence[Mapping[str, Mapping[str, Any]]]) -> str | None:
    """Name the key OmegaConf could not merge because a mapping meets a list (its TypeError names none), found by
    merging one key at a time; ``None`` when no key alone fails."""
    schema = OmegaConf.structured(Config)
    keys = dict.fromkeys((section, key) for layer in layers for section, block in layer.items() for key in block)
    for section, key in keys:
        values = [layer[section][key] for layer in layers if key in layer.get(section, {})]
        for value in values:
            if _merge_clashes(schema, {section: {key: value}}):
                expected = "a list (e.g. [a, b])" if isinstance(value, Mapping) else "a mapping (key: value)"
                return f"{section}.{key} must be {expected}, got {value!r}."
        if _merge_clashes(schema, *({section: {key: value}} for value in values)):
            return (
                f"{section}.{key} holds a value that is a mapping in one place and a list in another (config file, "
                "overrides, flags); write it the same way everywhere."
            )
    return None


def _merge_clashes(*layers: Any) -> bool:
    """Whether merging ``layers`` fails on a mapping meeting a list."""
    try:
        OmegaConf.merge(*layers)
    except TypeError:
        return True
    except OmegaConfBaseException:
        return False
    return False


def _describe_omegaconf_error(error: OmegaConfBaseException) -> str:
    """Turn an OmegaConf validation error into one sentence that names the full key."""
    key = printable(getattr(error, "full_key", None) or "config")
    value = getattr(error, "value", None)
    message = first_line(getattr(error, "msg", None) or str(error))
    match = re.search(r"converted to (\w+)|field of type '(\w+)'|is not a valid (\w+)", message)
    if match:
        kind = match.group(1) or match.group(2) or match.group(3)
        return f"{key} must be {_EXPECTED.get(kind, kind)}, got {value!r}."
    if "is not a ListConfig" in message or "not a list" in message.lower():
        return f"{key} must be a list (e.g. [a, b]), got {value!r}."
    if "is not a DictConfig" in message or "not a dict" in message.lower():
        return f"{key} must be a mapping (key: value), got {value!r}."
    return f"{key}: {printable(message)}."

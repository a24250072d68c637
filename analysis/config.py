"""Typed configuration: ACT-style YAML + dotted overrides + CLI flags -> :class:`Config`.

The dataclasses below are the single source of truth for every key, its type and its default. Loading goes
YAML (parsed with line numbers) -> key checks with suggestions -> ``OmegaConf.merge(schema, yaml, dotted,
flags)`` -> semantic validation. Every problem is a :class:`~analysis.errors.ConfigError` naming the full key.
The result is frozen: a step that needs other values gets a new config from :func:`derive`, validated the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import re
import textwrap
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from analysis.command_template import CommandTemplate, compile_pattern
from analysis.early_stop import EARLY_STOP_MODES, early_stop_from
from analysis.errors import ConfigError, did_you_mean, first_line, printable
from analysis.metrics import LABEL_FREE_METRICS, METRIC_NAMES
from analysis.ratio import RATIO_DECIMALS, normalise_ratio, ratio_problem
from analysis.trust import CODE_SETTINGS, arch_refusal, arch_target_problem, check_file_settings

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
LATENCY_TABLES = ("auto", "model", "layers")
GRAPH_OPTIMIZATIONS = ("disable", "basic", "extended", "all")
ONNX_EXPORTERS = ("torchscript", "dynamo")
METRIC_MODES = ("relative", "absolute")
GRANULARITIES = ("filter", "element")
UNIT_KINDS = ("conv", "linear", "heads")
"""Kinds of prunable unit: conv filters (Conv1d/2d/3d), Linear neurons, attention heads."""
PLAN_METHODS = ("knapsack", "measured", "recovered")
SEARCHED_PLAN_METHODS = ("measured", "recovered")  # methods that measure whole plans (the measured search)

# Blocks of PaddleSlim ACT compression configs. They configure training-time compression, which the analysis does
# not run, so it accepts them and reports them as ignored (ChannelPrune lends two defaults, see _split_blocks);
# run.py compress reads TrainConfig, Distillation and ChannelPrune (COMPRESS_BLOCKS).
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


def setting(
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    doc: str,
    shown_default: str | None = None,
) -> Any:
    """A dataclass field that carries its user documentation, so the docs' configuration reference is generated from
    the schema (:mod:`analysis.config_reference`) and cannot drift from it.

    Args:
        default: The default value (immutable); ``factory`` instead for a list or a mapping.
        factory: Builds the default on every instantiation (``dataclasses.field``'s ``default_factory``).
        doc: What the key means, as Markdown for the reference table (required: a key without one fails the docs
            build and a test).
        shown_default: The default as the reference shows it when the literal default says less (``None`` worked
            out at run time, a model's own preprocessing); else the literal default is shown in YAML spelling.

    Ruff is told that this wraps ``dataclasses.field`` (``extend-immutable-calls`` in pyproject.toml), so its RUF009
    does not flag the fields of a mutable type.
    """
    metadata = {"doc": doc, "shown_default": shown_default}
    if factory is None:
        return field(default=default, metadata=metadata)
    if default is not dataclasses.MISSING:
        raise TypeError("setting() takes a default or a factory, not both")
    return field(default_factory=factory, metadata=metadata)


@dataclass(frozen=True)
class GlobalConfig:
    """The ``Global`` block: where the model and the evaluation data come from and how images are prepared."""

    model_dir: str | None = setting(
        None, doc="folder of the checkpoint (or the checkpoint file itself when no filename is given)"
    )
    model_filename: str | None = setting(
        None,
        doc="with `arch`: the weights file when `params_filename` is absent. Without `arch`: a whole pickled "
        "`nn.Module` (needs `trust_model_file`)",
    )
    params_filename: str | None = setting(
        None,
        doc="weights for `arch`: a `state_dict` file in `model_dir`, read with `torch.load(weights_only=True)`",
    )
    arch: str | None = setting(
        None,
        doc="torchvision model name (`resnet50`, built with `torchvision.models.get_model`), `timm/<model name>` "
        "(see [Models](../configuration.md#models)), `package.module:callable`, or `path/to/file.py:callable`",
    )
    arch_kwargs: dict[str, Any] = setting(
        factory=dict, doc="keyword arguments for `arch` (e.g. `num_classes: 10`, `width_mult: 0.5`)"
    )
    weights: str | None = setting(
        None,
        doc="a torchvision weights name (`ResNet50_Weights.IMAGENET1K_V2`, `DEFAULT`); torchvision downloads it to "
        "its cache",
    )
    trust_model_file: bool = setting(
        False,
        doc="allow unpickling a whole `nn.Module` (unpickling can run arbitrary code: only for files you trust); "
        "honoured from the command line (`Global.trust_model_file=true`) or with `--trust_config`, never from a "
        "config file alone (see [Security](../security.md))",
    )
    trust_arch: bool = setting(
        False,
        doc="let `Global.arch` call any callable; without it a `module:callable` or `file.py:callable` must be a "
        "`torch.nn.Module` subclass or a function annotated to return one, outside the standard library; honoured "
        "from the command line or with `--trust_config` only (see [Security](../security.md))",
    )
    data_dir: str | None = setting(
        None,
        doc="evaluation data folder (layouts: see [Data](../configuration.md#data))",
        shown_default="required",
    )
    val_list: str = setting(
        "val_list.txt", doc="list file of the PaddleSlim layout, relative to `data_dir` (or absolute)"
    )
    batch_size: int = setting(32, doc="images per batch")
    img_size: int = setting(
        224, doc="center-crop size", shown_default="`224`, or the model's own (timm, torchvision `weights`)"
    )
    resize_size: int = setting(
        256,
        doc="the short side is resized to this before cropping; must be >= `img_size`",
        shown_default="`256`, or the model's own",
    )
    interpolation: str = setting(
        "bilinear",
        doc="resize filter: `bilinear` (torchvision), `bicubic` (timm), `lanczos` (PaddleSlim's reader)",
        shown_default="`bilinear`, or the model's own",
    )
    mean: list[float] = setting(
        factory=lambda: list(IMAGENET_MEAN),
        doc="per-channel mean of the normalisation of RGB values in [0, 1], `(value - mean) / std`: three values "
        "(R, G, B)",
        shown_default="ImageNet (`[0.485, 0.456, 0.406]`), or the model's own",
    )
    std: list[float] = setting(
        factory=lambda: list(IMAGENET_STD),
        doc="per-channel standard deviation of the normalisation of RGB values in [0, 1], `(value - mean) / std`: "
        "three positive values (R, G, B)",
        shown_default="ImageNet (`[0.229, 0.224, 0.225]`), or the model's own",
    )
    num_workers: int | None = setting(
        None, doc="image-decoding processes; `0` decodes in the main process", shown_default="cores (max 8)"
    )
    data_cache: str = setting(
        "auto",
        doc="`auto`: decode every image once into RAM when it fits the budget and the available memory, else stream "
        "and say so; `ram`: always (exit 2 when the decoded images exceed the available memory); `off`: decode on "
        "every pass",
    )
    cache_max_gb: float | None = setting(
        None,
        doc="budget for `data_cache: auto` (N x 3 x img_size^2 bytes: 7.5 GB for ImageNet val at 224)",
        shown_default="half the free RAM",
    )
    device: str = setting(
        "auto", doc="`auto` (first GPU, else CPU), `cpu`, `cuda`, `cuda:N` (N from 0 to 127, ASCII digits)"
    )
    numerics: str = setting(
        "exact",
        doc="arithmetic of every forward pass: `exact` (float32, TF32 off, deterministic cuDNN), `tf32` or `bf16` "
        "(faster on a GPU, losses approximate; see [Running on a GPU](../scale-out.md#running-on-a-gpu))",
    )
    device_cache_share: float = setting(
        0.5,
        doc="on a GPU, the decoded images live in GPU memory when they take at most this share of the free GPU "
        "memory, else in pinned host memory; `0`: always host memory",
    )
    max_samples: int | None = setting(
        None, doc="evaluate a fixed, seeded, class-balanced subset of this many images", shown_default="all"
    )
    seed: int = setting(
        0,
        doc="seed for the subsets and for randomly initialised models (from -2^63 to 2^64-1, what "
        "`torch.manual_seed` takes)",
    )
    calib_list: str | None = setting(
        None,
        doc="calibration images for BatchNorm re-estimation (see [Data](../configuration.md#data)): a list file in "
        "the PaddleSlim layout or a folder of class folders, relative to `data_dir` or absolute",
        shown_default="`train_list.txt` beside the evaluation list, else `data_dir/train/`",
    )
    calib_samples: int = setting(
        1024,
        doc="a seeded, class-balanced subset of this many calibration images (all when fewer); `0` turns "
        "calibration off",
    )
    calib_resize_size: int | None = setting(
        None,
        doc="preprocessing of the calibration images: the size their short side is resized to, when it should "
        "differ from `resize_size`",
        shown_default="the evaluation's `resize_size`",
    )
    calib_img_size: int | None = setting(
        None,
        doc="preprocessing of the calibration images: their center-crop size, when it should differ from `img_size`",
        shown_default="the evaluation's `img_size`",
    )
    max_image_pixels: int | None = setting(
        DEFAULT_MAX_IMAGE_PIXELS,
        doc="an image with more pixels (width x height, read from its header before decoding) is an error naming "
        "it and its list line: a guard against decompression bombs. Raise it for genuine huge images; `null` "
        "removes the limit. It changes no pixel, so it is not part of the data fingerprint (a run resumes under "
        "another limit)",
        shown_default=f"`{DEFAULT_MAX_IMAGE_PIXELS}` (Pillow's own refusal threshold)",
    )
    labels: str = setting(
        "required",
        doc="`required`: every list line ends with an integer label; `none`: lines may be a path alone and every "
        "label (listed, or an ImageFolder class) is ignored, so `SensitivityAnalysis.metric` must be `agreement` "
        "or `kl` and `verify`/`plan_method: measured` are refused; `max_samples` then takes a seeded random subset",
    )


@dataclass(frozen=True)
class SensitivityConfig:
    """The ``SensitivityAnalysis`` block: what to prune, at which ratios, and how to score it."""

    analysis_file: str | None = setting(
        None,
        doc="the analysis pickle to write and resume from",
        shown_default="`outputs/<config name>/sensitivity.pkl`",
    )
    pruned_ratios: list[float] = setting(
        factory=lambda: [0.1, 0.2, 0.3, 0.4],
        doc="fractions of filters to remove, each strictly between 0 and 1 also after rounding to the 6 decimals "
        "they are stored with (1e-6 to 0.999999; sorted, deduplicated)",
    )
    target_loss: float | None = setting(
        None, doc="derive, per layer, the largest ratio whose relative loss stays under this (0.01 = 1%)"
    )
    criterion: str = setting("l1_norm", doc="filter ranking: `l1_norm`, `l2_norm`, `geometry_median`, `bn_scale`")
    prune_params_name: list[str] | None = setting(
        None,
        doc="units to analyse, by PyTorch parameter name (`layer1.0.conv1.weight`; module names work too) or "
        "`<attention module>.heads`",
        shown_default="all prunable",
    )
    skip_params: list[str] = setting(factory=list, doc="units to leave out")
    metric: str = setting(
        "top1",
        doc="what the loss is measured on: `top1`, `top5`, `ce` (cross-entropy, lower is better), or, needing no "
        "labels, `agreement` (fraction of images whose top-1 class is the unpruned model's; loss `1 - agreement` "
        "in both modes) or `kl` (mean KL(p_dense || p_pruned) in nats; the loss is the divergence itself in both "
        "modes, since the unpruned model's is 0). See [Label-free sensitivity](../concepts.md#label-free-sensitivity)",
    )
    metric_mode: str = setting(
        "relative",
        doc="`relative`: `(baseline - metric) / baseline` (PaddleSlim); `absolute`: `baseline - metric`",
    )
    group_reduction: str = setting(
        "self",
        doc="rank a conv's filters on its own weight (`self`, PaddleSlim) or averaged over its coupled group "
        "(`mean`; coupled params then share one evaluation)",
    )
    engine: str = setting(
        "fast",
        doc="`fast`: the unchanged part of the network runs once per batch, only the part a removal changes runs "
        "per ratio (identical numbers); `reference`: one full pass per variant",
    )
    precision: float | int | str | None = setting(
        None,
        doc="adaptive precision (fast engine): evaluate each variant on a seeded random order of the images and stop "
        "once its loss is known within +-precision (95%); `decision`: decision-driven sampling (needs "
        "`target_loss`, see [Decision-driven sampling](../engines.md#decision-driven-sampling)); exact when unset",
    )
    decision_error: float = setting(
        0.05,
        doc="with `precision: decision`: the chance that any variant of the run is settled on the wrong side of "
        "`target_loss` (split over every variant and look, Bonferroni); any value in (0, 1), down to the smallest "
        "float (5e-324)",
    )
    decision_precision: float | None = setting(
        None,
        doc="with `precision: decision`: also stop a variant once its loss is known within +-this (95%), including "
        "the two the derived ratio interpolates between (then the derived ratio is approximate)",
    )
    granularity: str = setting(
        "filter",
        doc="`filter`: remove conv filters with their coupled group (what the rest of these docs describe); "
        "`element`: zero the `min(N - 1, round(N * r))` smallest-magnitude elements of one 2D/4D weight at a time "
        "(every conv and linear layer, the classifier included; Distiller's `--sense=element`); the ratios file "
        "then holds an `ElementPrune` block",
    )
    units: list[str] | None = setting(
        None,
        doc="kinds of unit analysed: `conv` (filters), `linear` (neurons), `heads` (attention heads), see "
        "[Units](../concepts.md#units-conv-filters-linear-neurons-attention-heads); `prune_params_name` may name "
        "only units of these kinds",
        shown_default="all the model has",
    )
    early_stop_mode: str | None = setting(
        None,
        doc="NNI's early stop per param, on the raw `metric` value: `minimize` (stop when metric < value), "
        "`maximize` (> value), `dropped` (< baseline - value), `raised` (> baseline + value); the ratio that trips "
        "it is recorded, the param's larger ratios are skipped (also on resume; the table shows `stop`). The work "
        "is skipped too: with early stop the fast engine runs ratio by ratio (one pass over the data per ratio, "
        "serving every param still running). Demo MobileNetV2, ratios 0.1-0.9, `dropped` 0.05: 192 of 315 "
        "variants evaluated, 26.7 s against 36.2 s without early stop (wall, 2-core CPU)",
    )
    early_stop_value: float | None = setting(
        None,
        doc="the threshold or allowed change for `early_stop_mode` (required with it), in the metric's units (top1 "
        "0.05 = 5 points)",
    )
    adaptive_bn: bool = setting(
        False,
        doc="before each variant is evaluated, re-estimate the BatchNorm statistics its removal changes on the "
        "calibration images (EagleEye's adaptive BN; both engines, same numbers). Part of the resume fingerprint; "
        "the report says so and the CSV metric columns are suffixed `_adaptive_bn`",
    )
    round_to: int = setting(
        1,
        doc="every removal keeps a multiple of this many channels in its group (at least that many; with a grouped "
        "conv in the group a multiple of the least common multiple with its conv groups), in the analysis and in "
        "plans: a ratio maps to the allowed count whose kept channels are nearest to `C - min(C - 1, round(C * r))` "
        "(ties keep more). For hardware that runs some channel multiples faster than others",
    )
    target_macs_reduction: float | None = setting(
        None,
        doc="after the analysis, plan per-layer ratios removing at least this fraction of the MACs (see "
        "[Budget plans](../plans.md)), between 1e-6 and 1; `<analysis_file>.plan.yaml`",
    )
    target_params_reduction: float | None = setting(
        None,
        doc="the same for the parameter count; budgets given together (MACs, params, one latency target) are all met",
    )
    target_latency_reduction: float | None = setting(
        None,
        doc="plan for this fraction less latency, measured on `latency_runtime` (see "
        "[Planning for latency](../latency.md))",
    )
    target_latency_ms: float | None = setting(
        None, doc="plan for this measured latency in ms (an absolute goal instead of a fraction)"
    )
    latency_runtime: str = setting(
        "auto",
        doc="where latency is measured: `torch` (eager on the analysis device), `onnxruntime` (CPU provider, CUDA's "
        "on a GPU), `command` (`runtime_command`); `auto` is `onnxruntime` with the onnx extra, else `torch`",
    )
    latency_table: str = setting(
        "auto",
        doc="how the latency table is measured: `model` (the whole model once per group and channel count), "
        "`layers` (each conv/linear layer shape a probe changes, timed alone once; faster, blind to the other "
        "layers); `auto` is `layers` at a latency_batch of 32 or more on a CPU, where one call is long and the "
        "layers' times add up (docs/latency.md), else `model`",
    )
    latency_batch: int = setting(1, doc="images per call when latency is measured")
    latency_round_to: int = setting(
        8,
        doc="a latency plan keeps a multiple of this many channels in every group it prunes (its table probes only "
        "those counts); 1 offers every analysed count. ONNX Runtime's CPU provider ran MobileNetV2 at batch 1 44.7% "
        "slower than the dense model with every group pruned 15% to counts that are not multiples of 8, and 23.1% "
        "faster with them rounded to multiples of 8 (see [Latency](../latency.md))",
    )
    runtime_command: str | None = setting(
        None,
        doc="with `latency_runtime: command`: a command given `{onnx}` (and `{batch}`, `{shape}`) that prints the "
        "latency in ms (its last number)",
    )
    runtime_pattern: str | None = setting(
        None,
        doc="a regular expression with one group that picks the latency from the command's output instead",
    )
    runtime_threads: int = setting(
        0,
        doc="threads one inference may use where latency is measured: ONNX Runtime's intra-op threads, torch's "
        "`set_num_threads` while timing; `0` keeps the runtime's own default (ONNX Runtime: one per physical core; "
        "torch: its current count, `OMP_NUM_THREADS`)",
    )
    runtime_inter_op_threads: int = setting(
        0, doc="ONNX Runtime's inter-op threads (independent branches of the graph run in parallel); `0`: its default"
    )
    runtime_graph_optimization: str = setting(
        "all",
        doc="ONNX Runtime's graph optimisation level: `disable`, `basic`, `extended` or `all` (its own default)",
    )
    runtime_provider: str = setting(
        "auto",
        doc="ONNX Runtime's execution provider, e.g. `CPUExecutionProvider`, `CUDAExecutionProvider`, "
        "`TensorrtExecutionProvider`, `OpenVINOExecutionProvider` (installed ones only); `auto`: CUDA's when the "
        "analysis runs on a GPU and it is installed, else the CPU's",
    )
    runtime_cudnn_benchmark: bool = setting(
        True,
        doc="torch on CUDA: time with cuDNN's benchmark mode, which picks the fastest kernels as deployments turn it "
        "on (the analysis itself runs with exact, deterministic flags)",
    )
    runtime_tf32: bool = setting(
        True,
        doc="torch on CUDA: allow TF32 in convolutions and matmuls while timing (Ampere and later), as a deployment "
        "with `torch.backends.cudnn.allow_tf32` and `torch.backends.cuda.matmul.allow_tf32` runs",
    )
    latency_tolerance: float = setting(
        0.05,
        doc="how far apart the dense model's timings around a measurement may be (a fraction of its latency) before "
        "the machine counts as too noisy: the measurement is repeated a few times, then reported as too noisy "
        "instead of judged (see [Planning for latency](../latency.md))",
    )
    onnx_exporter: str = setting(
        "torchscript",
        doc="the exporter tried first for every ONNX file, the shipped `pruned_model.onnx` and the latency probes "
        "alike, so the runtime times what is deployed: `torchscript` (fast, about 0.8 s a MobileNetV2) or `dynamo` "
        "(torch.export, about 20 s); the other is tried when it fails",
    )
    plan_method: str = setting(
        "knapsack",
        doc="`knapsack`: the smallest summed single-layer loss; `measured`: start there and improve with joint "
        "evaluations (all groups pruned at once, BatchNorm re-estimated), see [Budget plans](../plans.md); "
        "`recovered`: the measured search, its finalists then each recovered for `Recovery.probe_steps` steps "
        "and the best kept, see [Recover the pruned model](../recovery.md)",
    )
    eval_budget: int | None = setting(
        None,
        doc="joint evaluations of the `measured` method's search (its finalists are measured once more with every "
        "calibration image)",
        shown_default="10 per group",
    )
    verify: bool = setting(
        False,
        doc="prune the plan (or, without a budget, the `target_loss` ratios) into a copy at once and measure "
        "accuracy (raw and with BatchNorm re-estimated), MACs, params, checkpoint size and latency",
    )
    export_dir: str | None = setting(
        None,
        doc="write the pruned model there (`pruned_model.pt`, `pruned_state_dict.pt`, `pruned_channels.json`, "
        "`channel_prune.yaml`), with re-estimated BatchNorm statistics when calibration images exist",
    )
    export_onnx: bool = setting(
        True,
        doc="with `export_dir` and the onnx extra, also write `pruned_model.onnx`, checked against PyTorch with "
        "ONNX Runtime",
    )
    report: bool = setting(
        True, doc="write the CSV exports, plots and HTML report beside the analysis file after the run"
    )


PRECISIONS = ("auto", "fp32", "bf16")
"""``Recovery.precision``: auto is bf16 autocast on a GPU and float32 on a CPU."""


@dataclass(frozen=True)
class RecoveryConfig:
    """The ``Recovery`` block: what ``run.py compress`` needs to fine-tune the pruned model that ACT's ``TrainConfig``
    and ``Distillation`` do not say (where the training images are, their augmentation, precision, outputs)."""

    train_list: str | None = setting(
        None,
        doc="the training images: a PaddleSlim list file (`path label` lines, relative to `Global.data_dir`) or a "
        "folder of class folders",
        shown_default="train_list.txt beside the val list, else train/ under Global.data_dir",
    )
    output_dir: str | None = setting(
        None,
        doc="where checkpoints (`last.pt`, `best.pt`), `train.log` and the recovered model's export go",
        shown_default="compress/ beside the analysis file",
    )
    batch_size: int | None = setting(
        None,
        doc="training images per step over all processes (torchrun splits it evenly, so a run gives the same "
        "result on any number of processes)",
        shown_default="Global.batch_size",
    )
    num_workers: int | None = setting(None, doc="training loader processes", shown_default="Global.num_workers")
    crop_scale: list[float] = setting(
        factory=lambda: [0.08, 1.0],
        doc="random resized crop: the range of the crop's share of the image area (torchvision's default)",
    )
    crop_ratio: list[float] = setting(
        factory=lambda: [0.75, 4 / 3], doc="random resized crop: the range of the crop's aspect ratio"
    )
    hflip: float = setting(0.5, doc="probability of a horizontal flip (0 for images that flipping changes, digits)")
    precision: str = setting(
        "auto", doc="training arithmetic: `auto` (bf16 autocast on a GPU, float32 on a CPU), `fp32` or `bf16`"
    )
    label_loss_weight: float = setting(
        0.0,
        doc="weight of the cross-entropy on the labels added to the distillation loss (ACT trains on the "
        "distillation loss alone: 0)",
    )
    seed: int | None = setting(
        None, doc="seed of the data order, augmentation and dropout", shown_default="Global.seed"
    )
    resume: bool = setting(
        True, doc="continue from `output_dir`'s last checkpoint when it belongs to the same plan and recipe"
    )
    probe_steps: int = setting(
        100,
        doc="training steps of each finalist's brief recovery under `plan_method: recovered` (the recipe of "
        "`TrainConfig` and `Distillation` with `train_iter` set to this, the same batches for every finalist)",
    )


@dataclass(frozen=True)
class Config:
    """The whole resolved configuration, plus what was read but not used.

    Frozen, like its sections: validated once, never written afterwards (a step needing another value derives a new,
    validated config with :func:`derive`).
    """

    Global: GlobalConfig = field(default_factory=GlobalConfig)
    SensitivityAnalysis: SensitivityConfig = field(default_factory=SensitivityConfig)
    Recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    source: str | None = None
    ignored_blocks: list[str] = field(default_factory=list)
    # ACT's TrainConfig, Distillation and ChannelPrune blocks as the file gives them: run.py compress reads them
    # (analysis.recovery.act), the analysis does not
    act_blocks: dict[str, Any] = field(default_factory=dict)
    # "Section.key" of every key the YAML, an override or a flag set: those win over a model's own preprocessing
    explicit_keys: list[str] = field(default_factory=list, compare=False)  # bookkeeping, not configuration
    # "Section.key" of the keys an override or a flag set: the user's own choices, not the file's
    command_line_keys: list[str] = field(default_factory=list, compare=False)
    # the ratios YAML ``run.py verify --ratios`` applies: verify and export_dir then need no target in the config
    ratios_from: str | None = field(default=None, compare=False)


SECTIONS: dict[str, type] = {
    "Global": GlobalConfig,
    "SensitivityAnalysis": SensitivityConfig,
    "Recovery": RecoveryConfig,
}
COMPRESS_BLOCKS = ("TrainConfig", "Distillation", "ChannelPrune")
"""ACT blocks kept as given for ``run.py compress`` (:attr:`Config.act_blocks`)."""


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
    *,
    trust_config: bool = False,
    ratios_from: str | None = None,
) -> Config:
    """Load a YAML config and apply overrides.

    Args:
        path: The YAML file (ACT style: ``Global`` plus optional ``SensitivityAnalysis`` and ACT blocks).
        overrides: Dotted ``Section.key=value`` strings; values are parsed as YAML.
        flags: Values from dedicated CLI flags as ``{"Section.key": value}``; ``None`` values are skipped.
            Precedence: flags > overrides > YAML > defaults.
        trust_config: Let the file turn on the settings that run code (``runtime_command``, ``trust_model_file``,
            ``trust_arch``; see :mod:`analysis.trust`); without it only ``overrides`` and ``flags`` may.
        ratios_from: The ratios YAML that ``verify`` and ``export_dir`` apply (``run.py verify --ratios``), so the
            config needs no budget or ``target_loss`` for them (kept as :attr:`Config.ratios_from`).

    Raises:
        ConfigError: For any unreadable file, unknown key, wrong type or out-of-range value, or a setting that runs
            code given by the file alone.
    """
    path = Path(path)
    return config_from_data(
        _read_yaml(path), path, overrides, flags, trust_config=trust_config, ratios_from=ratios_from
    )


def config_from_data(
    raw: dict[str, Any],
    path: str | Path,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
    *,
    trust_config: bool = False,
    described_as: str | None = None,
    ratios_from: str | None = None,
) -> Config:
    """Like :func:`load_config`, from an already parsed mapping (e.g. the resolved config an analysis file's sidecar
    keeps, which is a file like any other); ``path`` names where it came from in messages and gives the default
    analysis file's folder, ``described_as`` (default: ``path``) names the file in the refusal of a setting that runs
    code."""
    path = Path(path)
    sections, ignored = _split_blocks(raw, path)
    dotted = _parse_overrides(overrides)
    act_blocks = _act_blocks(raw, {name: dotted.pop(name) for name in COMPRESS_BLOCKS if name in dotted})
    nested_flags = _flags_to_nested(flags or {})
    command_line = {f"{section}.{key}" for layer in (dotted, nested_flags) for section, block in layer.items()
                    for key in block}  # fmt: skip
    _latency_form_from_command_line(sections, command_line)
    layers = (sections, dotted, nested_flags)
    explicit = {f"{section}.{key}" for layer in layers for section, block in layer.items() for key in block}
    config = dataclasses.replace(
        _merged(layers),
        source=str(path),
        ignored_blocks=ignored,
        act_blocks=act_blocks,
        explicit_keys=sorted(explicit),
        command_line_keys=sorted(command_line),
        ratios_from=ratios_from,
    )
    resolved = {setting.key: _value(config, setting.key) for setting in CODE_SETTINGS}
    check_file_settings(
        resolved, command_line, described_as or str(path), trust_config
    )  # before anything else is looked at
    if config.SensitivityAnalysis.analysis_file is None:
        default = str(Path("outputs") / path.stem / "sensitivity.pkl")
        config = _with_sections(config, SensitivityAnalysis={"analysis_file": default})
    return validate(config)


def _act_blocks(raw: Mapping[str, Any], overrides: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The file's ``TrainConfig``, ``Distillation`` and ``ChannelPrune`` blocks with the command line's overrides of
    their keys (``TrainConfig.epochs=3``) applied."""
    blocks = {name: copy.deepcopy(raw[name]) for name in COMPRESS_BLOCKS if name in raw}
    for name, layer in overrides.items():
        block = blocks.get(name)
        if block is not None and not isinstance(block, dict):  # an override would drop it silently: refuse it
            raise ConfigError(f"{name} must be a mapping of keys, not a {type(block).__name__}; fix the file's block "
                              f"before overriding {name} keys.")  # fmt: skip
        blocks[name] = block = block if block is not None else {}
        _deep_update(block, layer)
    return blocks


def derive(config: Config, changes: Mapping[str, Any], *, command_line: bool = True) -> Config:
    """A new config: ``config`` with ``changes`` (``{"Section.key": value}``) applied and validated again, by the same
    type conversion and checks as a loaded one; ``config`` itself is left as it was (configs are frozen).

    Args:
        config: A loaded (validated) config.
        changes: The values to replace, by dotted key.
        command_line: True when the changes carry out flags the user passed (``plan``'s budget flags leaving out
            the file's other budgets): the keys then count as given on the command line, as a flag would
            (``explicit_keys`` and ``command_line_keys``, which :mod:`analysis.trust` honours). False for values the
            tool works out itself (a model's own preprocessing, a torchrun rank's device): both lists stay as they
            were, and turning on a setting that runs code is refused.

    Raises:
        ConfigError: For a value the validation refuses, naming its key.
        KeyError: For a key that is not in the schema (a bug in the caller).
        ValueError: For a setting that runs code turned on without ``command_line`` (a bug in the caller).
    """
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
            raise KeyError(f"{dotted} is not a config key (Section.key)")
        nested.setdefault(section, {})[key] = value
    if not command_line:
        for code in CODE_SETTINGS:
            if code.key in changes and code.active(changes[code.key]):
                raise ValueError(f"{code.key} {code.does}: only the user turns it on (derive with command_line=True)")
    current = {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
    given = set(changes) if command_line else set()
    derived = dataclasses.replace(
        _merged((current, nested)),
        source=config.source,
        ignored_blocks=list(config.ignored_blocks),
        act_blocks=copy.deepcopy(config.act_blocks),
        explicit_keys=sorted(set(config.explicit_keys) | given),
        command_line_keys=sorted(set(config.command_line_keys) | given),
        ratios_from=config.ratios_from,
    )
    return validate(derived)


@functools.cache
def _schema() -> DictConfig:
    """The structured schema of :class:`Config`, built once (building it is most of a config's load time; merging
    copies it, so the cached one is never changed)."""
    schema = OmegaConf.structured(Config)
    assert isinstance(schema, DictConfig)
    return schema


def _merged(layers: Sequence[Mapping[str, Mapping[str, Any]]]) -> Config:
    """The schema merged with ``layers`` (later ones win), types converted and checked; not yet validated."""
    try:
        config = OmegaConf.to_object(OmegaConf.merge(_schema(), *layers))
    except OmegaConfBaseException as error:
        raise ConfigError(_describe_omegaconf_error(error)) from None
    except TypeError:  # OmegaConf's "Cannot merge incompatible container types" names no key
        clash = _describe_container_clash(layers)
        if clash is None:
            raise  # not a mapping/list clash: a bug, which keeps its traceback
        raise ConfigError(clash) from None
    assert isinstance(config, Config)
    _check_list_items(config)
    return config


def _with_sections(config: Config, **changes: Mapping[str, Any]) -> Config:
    """``config`` with some values of its sections replaced, unchecked: for building a config before validation."""
    sections = {name: dataclasses.replace(getattr(config, name), **values) for name, values in changes.items()}
    return dataclasses.replace(config, **sections)


def _value(config: Config, dotted: str) -> Any:
    """The value of ``Section.key`` in ``config``."""
    section, key = dotted.split(".", 1)
    return getattr(getattr(config, section), key)


LATENCY_FORMS = ("target_latency_reduction", "target_latency_ms")
"""The two ways to give a latency budget; one at a time."""


def _latency_form_from_command_line(sections: dict[str, Any], command_line: set[str]) -> None:
    """A latency budget given on the command line replaces the file's other form (docs/latency.md), instead of the
    two being refused as both set; both forms on the command line are still refused by validation."""
    given = [form for form in LATENCY_FORMS if f"SensitivityAnalysis.{form}" in command_line]
    block = sections.get("SensitivityAnalysis", {})
    if len(given) != 1:
        return
    other = next(form for form in LATENCY_FORMS if form != given[0])
    if block.get(other) is not None:
        logger.info("SensitivityAnalysis.%s of the config is left out: the command line gives %s.", other, given[0])
        block.pop(other)


def validate(config: Config) -> Config:
    """Check values that types alone cannot express; return ``config`` with its ratios normalised to sorted
    ``round(r, 6)`` keys (the only value validation changes)."""
    g, s = config.Global, config.SensitivityAnalysis
    if not g.data_dir:
        raise ConfigError("Global.data_dir is not set; point it at the folder holding val_list.txt or val/<class>/.")
    if g.arch is None and g.model_filename is None and g.params_filename is None and g.model_dir is None:
        raise ConfigError(
            "Global has no model: set Global.arch (a torchvision name or module:callable) and optionally "
            "Global.model_dir/params_filename for its weights."
        )
    check_arch_text(g)
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

    s = validate_section(s)
    if s.adaptive_bn and g.calib_samples == 0:
        raise ConfigError(
            "SensitivityAnalysis.adaptive_bn re-estimates BatchNorm statistics on calibration images, but "
            "Global.calib_samples is 0; set it to a positive number (default 1024)."
        )
    validate_budget(s, ratios_given=config.ratios_from is not None)
    validate_label_free(g, s)
    validate_recovery(config.Recovery)
    return dataclasses.replace(config, SensitivityAnalysis=s)


def validate_recovery(r: RecoveryConfig) -> None:
    """Check the ``Recovery`` block's values (ACT's training blocks are read by ``run.py compress`` alone)."""
    for key in ("batch_size", "num_workers"):
        value = getattr(r, key)
        low = 1 if key == "batch_size" else 0
        if value is not None and value < low:
            raise ConfigError(f"Recovery.{key} must be {low} or more (or unset for Global.{key}), got {value}.")
    scale, ratio = r.crop_scale, r.crop_ratio
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        raise ConfigError(f"Recovery.crop_scale must be [low, high] with 0 < low <= high <= 1, got {list(scale)}.")
    if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1] < math.inf:
        raise ConfigError(f"Recovery.crop_ratio must be [low, high] with 0 < low <= high, got {list(ratio)}.")
    if not 0 <= r.hflip <= 1:
        raise ConfigError(f"Recovery.hflip must be a probability from 0 to 1, got {r.hflip}.")
    check_choice("Recovery.precision", r.precision, PRECISIONS)
    if not 0 <= r.label_loss_weight < math.inf:
        raise ConfigError(f"Recovery.label_loss_weight must be 0 or more, got {r.label_loss_weight}.")
    if r.seed is not None and not SEED_RANGE[0] <= r.seed <= SEED_RANGE[1]:
        raise ConfigError(f"Recovery.seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {r.seed}.")
    if r.probe_steps < 1:
        raise ConfigError(f"Recovery.probe_steps must be 1 or more training steps, got {r.probe_steps}.")


def check_arch_text(g: GlobalConfig) -> None:
    """Refuse a ``Global.arch`` callable that :func:`~analysis.trust.arch_target_problem` refuses by its text, before
    anything is imported (``trust_arch`` lifts the rule)."""
    if not g.arch or ":" not in g.arch or g.trust_arch or g.arch.startswith("timm/"):
        return
    problem = arch_target_problem(g.arch)
    if problem is not None:
        raise ConfigError(arch_refusal(g.arch, problem))


def validate_section(
    s: SensitivityConfig, prefix: str = "SensitivityAnalysis.", names: Mapping[str, str] | None = None
) -> SensitivityConfig:
    """Check the analysis settings the YAML block and the Python APIs share; return ``s`` with the ratios normalised
    to sorted ``round(r, 6)`` (``s`` is frozen: use the returned section).

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

    s = dataclasses.replace(s, pruned_ratios=normalise_ratios(s.pruned_ratios, key("pruned_ratios")))
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
    return s


def validate_budget(s: SensitivityConfig, ratios_given: bool = False) -> None:
    """Budget targets, each a fraction in (0, 1) (any of MACs, params and latency at once, one latency form);
    ``verify``/``export_dir`` need something to apply, unless a ratios file gives it (``ratios_given``)."""
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
    applied = given or absolute or s.target_loss is not None or ratios_given
    if (s.verify or s.export_dir is not None) and not applied:
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
    if isinstance(s.latency_round_to, bool) or not isinstance(s.latency_round_to, int) or s.latency_round_to < 1:
        raise ConfigError(f"SensitivityAnalysis.latency_round_to must be a positive channel count (1 = any count), "
                          f"got {s.latency_round_to!r}.")  # fmt: skip
    for key in ("runtime_threads", "runtime_inter_op_threads"):
        value = getattr(s, key)
        if not 0 <= value <= 1024:
            raise ConfigError(f"SensitivityAnalysis.{key} must be a thread count from 0 (the runtime's default) to "
                              f"1024, got {value}.")  # fmt: skip
    check_choice("SensitivityAnalysis.runtime_graph_optimization", s.runtime_graph_optimization, GRAPH_OPTIMIZATIONS)
    check_choice("SensitivityAnalysis.onnx_exporter", s.onnx_exporter, ONNX_EXPORTERS)
    if not s.runtime_provider.strip():
        raise ConfigError("SensitivityAnalysis.runtime_provider is empty; name an execution provider or use auto.")
    if not (0 < s.latency_tolerance < 1 and math.isfinite(s.latency_tolerance)):
        raise ConfigError(f"SensitivityAnalysis.latency_tolerance must be a fraction between 0 and 1, got "
                          f"{s.latency_tolerance}.")  # fmt: skip
    if s.runtime_command is not None:  # checked now, not when the first probe runs after the analysis
        CommandTemplate.parse(s.runtime_command, "SensitivityAnalysis.runtime_command")
    if s.runtime_pattern is not None:
        compile_pattern(s.runtime_pattern, "SensitivityAnalysis.runtime_pattern")


LATENCY_FLAGS = {
    "latency_runtime": "--runtime",
    "latency_table": "--latency_table",
    "latency_batch": "--latency_batch",
    "latency_round_to": "--latency_round_to",
    "runtime_command": "--runtime_command",
    "runtime_pattern": None,
    "runtime_threads": None,
    "runtime_inter_op_threads": None,
    "runtime_graph_optimization": None,
    "runtime_provider": None,
    "runtime_cudnn_benchmark": None,
    "runtime_tf32": None,
    "latency_tolerance": None,
}
"""The latency settings, with the ``run.py plan`` flag that gives each (None: an override only)."""


RUNTIME_KEYS = {
    "runtime_command": ("command",),
    "runtime_pattern": ("command",),
    "runtime_threads": ("torch", "onnxruntime", "auto"),
    "runtime_inter_op_threads": ("onnxruntime", "auto"),
    "runtime_graph_optimization": ("onnxruntime", "auto"),
    "runtime_provider": ("onnxruntime", "auto"),
    "runtime_cudnn_benchmark": ("torch", "auto"),
    "runtime_tf32": ("torch", "auto"),
}
"""The settings of one runtime, with the ``latency_runtime`` values that use them (``auto`` may be either)."""


def unused_latency_settings(config: Config) -> dict[str, str]:
    """The latency settings ``config`` sets that nothing would use, with why: the table's kind without a latency
    target; the runtime, its batch and settings when nothing is timed (no latency target, no ``verify`` timing on a
    runtime); a runtime's own settings (:data:`RUNTIME_KEYS`) on another runtime."""
    s = config.SensitivityAnalysis
    target = s.target_latency_reduction is not None or s.target_latency_ms is not None
    timed = target or (s.verify and runtime_timed_by_verify(config))
    reasons = {}
    if not target:
        reasons["latency_table"] = "a table is measured only for target_latency_reduction or target_latency_ms"
        reasons["latency_round_to"] = "only a latency plan rounds to it (target_latency_reduction or target_latency_ms)"
    if not timed:
        why = "nothing is timed: there is no latency target, and verify times the plan only on a named runtime"
        reasons.update(dict.fromkeys(("latency_runtime", "latency_batch", "latency_tolerance", *RUNTIME_KEYS), why))
    else:
        for key, runtimes in RUNTIME_KEYS.items():
            if s.latency_runtime not in runtimes:
                names = " or ".join(name for name in runtimes if name != "auto")
                reasons[key] = f"it applies only to latency_runtime: {names}, and the runtime is {s.latency_runtime}"
    given = set(config.explicit_keys)
    return {key: why for key, why in reasons.items() if f"SensitivityAnalysis.{key}" in given}


def runtime_timed_by_verify(config: Config) -> bool:
    """Whether ``verify`` times a plan without a latency target on the latency runtime: when the config names one,
    or a batch for it (``auto`` with no batch given: torch eager is timed at batch 1 and 32 anyway)."""
    s = config.SensitivityAnalysis
    return s.latency_runtime != "auto" or "SensitivityAnalysis.latency_batch" in config.explicit_keys


def check_latency_settings_used(config: Config) -> None:
    """Refuse a latency setting the command line gives that nothing would use (a flag silently ignored, found minutes
    later or never); one the config file gives is only warned about, since a file may keep settings for later runs.

    Call once the command's config is final (``plan`` replaces budgets, ``verify`` turns verification on).

    Raises:
        ConfigError: Naming the flag or key and why it is unused.
    """
    command_line = set(config.command_line_keys)
    for key, why in unused_latency_settings(config).items():
        flag = LATENCY_FLAGS[key]
        named = f"SensitivityAnalysis.{key}" + (f" ({flag})" if flag else "")
        if f"SensitivityAnalysis.{key}" in command_line:
            raise ConfigError(f"{named} would be ignored: {why}; leave it out or add what uses it.")
        logger.warning("%s from %s is ignored: %s.", named, config.source or "the config", why)


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
    if s.plan_method in SEARCHED_PLAN_METHODS and budget:
        raise ConfigError(
            f"SensitivityAnalysis.plan_method: {s.plan_method} scores plans on top1 and cross-entropy against labels, "
            "which Global.labels: none turns off; use plan_method: knapsack, or give the list file labels."
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
        if parts[0] not in SECTIONS and parts[0] not in COMPRESS_BLOCKS:
            known = (*SECTIONS, *COMPRESS_BLOCKS)
            raise ConfigError(
                f"Override '{shown}' names unknown section '{printable(parts[0])}'{did_you_mean(parts[0], known)}; "
                f"use one of {', '.join(known)}."
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
        if parts[0] in COMPRESS_BLOCKS:  # ACT's blocks: run.py compress checks their keys when it reads them
            _deep_update(nested.setdefault(parts[0], {}), layer[parts[0]])
            continue
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
    schema = _schema()
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

"""ACT's ``TrainConfig.optimizer_builder`` and ``TrainConfig.learning_rate``, mapped to PyTorch optimizers and
learning-rate schedules.

ACT (PaddleSlim's auto compression) builds ``paddle.optimizer.<type>(learning_rate=..., weight_decay=...,
grad_clip=..., **rest)`` from ``optimizer_builder`` and ``paddle.optimizer.lr.<type>(**rest)`` from a
``learning_rate`` mapping, and steps the schedule after every batch: every Paddle argument counted in "epochs"
(``T_max``, ``boundaries``, ``step_size``, ``milestones``, ``decay_steps``...) counts iterations, here too. Each type
maps to the PyTorch class computing the same learning rate (a ``LambdaLR`` with Paddle's formula where PyTorch has
none); a type with no counterpart a config file can express is refused naming the key and the supported types.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import lr_scheduler

from analysis.errors import ConfigError, did_you_mean
from analysis.recovery.gradients import GradientRules, parse_grad_clip, parse_regularizer
from analysis.recovery.values import check_arguments, config_number

Arguments = dict[str, Any]
"""A type's arguments as the config gives them (numbers, flags, lists of numbers, a few strings)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """``TrainConfig.optimizer_builder``: the optimizer's Paddle type and arguments, the weight decay beside it.

    Attributes:
        type: The Paddle optimizer (:data:`OPTIMIZERS`).
        arguments: Its other arguments, Paddle's names (numbers read from strings).
        weight_decay: ``optimizer_builder.weight_decay``, or the coefficient of ``regularizer: {type: L2Decay}``
            (L2, decoupled for AdamW, as in Paddle); None when absent (no decay, and AdamW's own default 0.01).
        gradients: ``grad_clip`` and an L1 ``regularizer``: what is done to the gradients before each update.
    """

    type: str
    arguments: Arguments = field(default_factory=dict)
    weight_decay: float | None = None
    gradients: GradientRules = field(default_factory=GradientRules)

    def describe(self) -> str:
        """The optimizer for a log line: its type, then the decay and the gradient rules where given."""
        parts = [self.type]
        if self.weight_decay:
            parts.append(f"weight decay {self.weight_decay:g}")
        if self.gradients.l1_decay:
            parts.append(f"L1 decay {self.gradients.l1_decay:g}")
        clip = self.gradients.clip
        if clip is not None:
            bound = f"{clip.clip_norm:g}" if clip.clip_norm is not None else f"[{clip.low:g}, {clip.high:g}]"
            parts.append(f"gradients clipped by {clip.type} {bound}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The optimizer as the sidecar records it and a recovery's identity includes (Paddle's names; the gradient
        rules only where given, so that a checkpoint written before they were read still continues)."""
        recorded: dict[str, Any] = {"type": self.type, **self.arguments, "weight_decay": self.weight_decay}
        if self.gradients.clip is not None:
            recorded["grad_clip"] = self.gradients.clip.as_dict()
        if self.gradients.l1_decay:
            recorded["regularizer"] = {"type": "L1Decay", "coeff": self.gradients.l1_decay}
        return recorded


@dataclass(frozen=True)
class ScheduleSpec:
    """``TrainConfig.learning_rate``: a constant, or a Paddle schedule's type and arguments.

    Attributes:
        type: The Paddle schedule (:data:`SCHEDULES`), or ``constant``.
        arguments: Its arguments, Paddle's names (``learning_rate`` for a constant; numbers read from strings).
    """

    type: str
    arguments: Arguments = field(default_factory=dict)

    @property
    def initial_lr(self) -> float:
        """The learning rate the optimizer is built with (the schedule's base)."""
        args = self.arguments
        if self.type == "PiecewiseDecay":
            return float(args["values"][0])
        if self.type == "OneCycleLR":
            return float(args["max_learning_rate"]) / float(args.get("divide_factor", 25.0))
        if self.type == "NoamDecay":
            return float(args.get("learning_rate", 1.0))
        return float(args["learning_rate"])


def parse_optimizer(builder: Mapping[str, Any] | None, key: str = "TrainConfig.optimizer_builder") -> OptimizerSpec:
    """The optimizer ``optimizer_builder`` names (ACT's default when absent: SGD), with its gradient clip and
    regularizer. As in ACT, a ``regularizer`` takes the place of ``weight_decay`` when both are given.

    Raises:
        ConfigError: For an unknown type or argument, a non-numeric value, or a key ACT does not read.
    """
    builder = dict(builder or {})
    unknown = set(builder) - set(BUILDER_KEYS)
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(f"{key}.{name} is not an optimizer_builder key{did_you_mean(name, BUILDER_KEYS)}; "
                          f"it takes {', '.join(BUILDER_KEYS)}.")  # fmt: skip
    optimizer = dict(builder.get("optimizer") or {"type": "SGD"})
    kind = str(optimizer.pop("type", "SGD"))
    if kind not in OPTIMIZERS:
        raise ConfigError(f"{key}.optimizer.type '{kind}' has no PyTorch counterpart here"
                          f"{did_you_mean(kind, OPTIMIZERS)}; supported: {', '.join(OPTIMIZERS)}.")  # fmt: skip
    check_arguments(f"{key}.optimizer", kind, optimizer, OPTIMIZER_ARGUMENTS[kind], IGNORED_ARGUMENTS)
    clip = parse_grad_clip(builder.get("grad_clip"), f"{key}.grad_clip")
    regularizer = parse_regularizer(builder.get("regularizer"), f"{key}.regularizer")
    if regularizer is not None:  # ACT passes the regularizer as Paddle's weight_decay, in place of the number
        if kind == "AdamW":
            raise ConfigError(f"{key}.regularizer cannot be given with AdamW, whose decay is decoupled (Paddle takes a "
                              "number only); set optimizer_builder.weight_decay instead.")  # fmt: skip
        l2 = regularizer.coeff if regularizer.type == "L2Decay" else None
        l1 = regularizer.coeff if regularizer.type == "L1Decay" else 0.0
        return OptimizerSpec(kind, _numbers(optimizer), l2, GradientRules(clip, l1))
    decay = builder.get("weight_decay")
    weight_decay = None if decay is None else config_number(f"{key}.weight_decay", decay)
    return OptimizerSpec(kind, _numbers(optimizer), weight_decay, GradientRules(clip))


def parse_schedule(learning_rate: Any, key: str = "TrainConfig.learning_rate") -> ScheduleSpec:
    """The schedule ``learning_rate`` gives: a number (constant), or a mapping with a Paddle ``type``.

    Raises:
        ConfigError: For an unknown or unsupported type, a missing or unknown argument, or a non-numeric value.
    """
    if not isinstance(learning_rate, Mapping):
        return ScheduleSpec("constant", {"learning_rate": config_number(key, learning_rate)})
    arguments = dict(learning_rate)
    kind = str(arguments.pop("type", ""))
    arguments = {name: value for name, value in arguments.items() if name not in ("last_epoch", "verbose")}
    if kind in REFUSED_SCHEDULES:
        raise ConfigError(f"{key}.type '{kind}' cannot be given in a config file ({REFUSED_SCHEDULES[kind]}); "
                          f"supported: {', '.join(SCHEDULES)}.")  # fmt: skip
    if kind not in SCHEDULES:
        raise ConfigError(f"{key}.type '{kind}' is not a Paddle learning-rate schedule with a PyTorch counterpart here"
                          f"{did_you_mean(kind, SCHEDULES)}; supported: {', '.join(SCHEDULES)}.")  # fmt: skip
    required, optional = SCHEDULE_ARGUMENTS[kind]
    missing = [name for name in required if name not in arguments]
    if missing:
        raise ConfigError(f"{key}.{missing[0]} is missing: the {kind} schedule needs {', '.join(required)}.")
    check_arguments(key, kind, arguments, (*required, *optional), IGNORED_ARGUMENTS)
    return ScheduleSpec(kind, _numbers(arguments))


def build_optimizer(parameters: Iterable[torch.nn.Parameter], spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    """The PyTorch optimizer computing what Paddle's ``spec.type`` does, at learning rate ``lr``."""
    args = spec.arguments
    params = list(parameters)
    decay = spec.weight_decay or 0.0
    if spec.type in ("SGD", "Momentum"):
        momentum = float(args.get("momentum", 0.9)) if spec.type == "Momentum" else 0.0  # Paddle's Momentum: 0.9
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=bool(args.get("use_nesterov", False)),
                               weight_decay=decay)  # fmt: skip
    betas = (float(args.get("beta1", 0.9)), float(args.get("beta2", 0.999)))
    if spec.type == "Adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=float(args.get("epsilon", 1e-8)), weight_decay=decay)
    if spec.type == "AdamW":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=float(args.get("epsilon", 1e-8)),
                                 weight_decay=0.01 if spec.weight_decay is None else decay)  # fmt: skip
    if spec.type == "Adamax":
        return torch.optim.Adamax(params, lr=lr, betas=betas, eps=float(args.get("epsilon", 1e-8)), weight_decay=decay)
    if spec.type == "RMSProp":
        return torch.optim.RMSprop(params, lr=lr, alpha=float(args.get("rho", 0.95)),
                                   eps=float(args.get("epsilon", 1e-6)), momentum=float(args.get("momentum", 0.0)),
                                   centered=bool(args.get("centered", False)), weight_decay=decay)  # fmt: skip
    assert spec.type == "Adagrad", spec.type
    return torch.optim.Adagrad(params, lr=lr, eps=float(args.get("epsilon", 1e-6)), weight_decay=decay,
                               initial_accumulator_value=float(args.get("initial_accumulator_value", 0.0)))  # fmt: skip


def build_schedule(
    optimizer: torch.optim.Optimizer, spec: ScheduleSpec, total_steps: int | None = None
) -> lr_scheduler.LRScheduler:
    """The PyTorch schedule of ``optimizer`` (built at :attr:`ScheduleSpec.initial_lr`) computing Paddle's learning
    rate at every iteration; step it after every optimizer step, as ACT steps Paddle's.

    A ``CosineAnnealingDecay`` without ``T_max`` anneals over ``total_steps``, the whole training (ACT's image
    classification example fills ``T_max`` in the same way, with its one epoch's iterations).
    """
    arguments = spec.arguments
    if spec.type == "CosineAnnealingDecay" and "T_max" not in arguments:
        if total_steps is None:
            raise ValueError("CosineAnnealingDecay without T_max needs total_steps")
        arguments = {**arguments, "T_max": total_steps}
    return _BUILDERS[spec.type](optimizer, arguments, spec.initial_lr)


def _piecewise(optimizer: torch.optim.Optimizer, args: Arguments, base: float) -> lr_scheduler.LRScheduler:
    boundaries, values = list(args["boundaries"]), [float(v) for v in args["values"]]
    return lr_scheduler.LambdaLR(optimizer, lambda t: values[bisect.bisect_right(boundaries, t)] / base)


def _warmup(optimizer: torch.optim.Optimizer, args: Arguments, base: float) -> lr_scheduler.LRScheduler:
    steps, start, end = int(args["warmup_steps"]), float(args["start_lr"]), float(args["end_lr"])
    return lr_scheduler.LambdaLR(optimizer, lambda t: (start + (end - start) * t / steps) / base if t < steps else 1.0)


def _polynomial(optimizer: torch.optim.Optimizer, args: Arguments, base: float) -> lr_scheduler.LRScheduler:
    steps, end = int(args["decay_steps"]), float(args.get("end_lr", 1e-4))
    power, cycle = float(args.get("power", 1.0)), bool(args.get("cycle", False))

    def factor(t: int) -> float:
        span = steps * max(1, math.ceil(t / steps)) if cycle else steps
        done = t if cycle else min(t, steps)
        return float((base - end) * (1 - done / span) ** power + end) / base

    return lr_scheduler.LambdaLR(optimizer, factor)


def _noam(optimizer: torch.optim.Optimizer, args: Arguments, base: float) -> lr_scheduler.LRScheduler:
    model, warmup = float(args["d_model"]), float(args["warmup_steps"])
    return lr_scheduler.LambdaLR(optimizer, lambda t: float(model**-0.5 * min(t**-0.5 if t else 1.0, t * warmup**-1.5)))


def _one_cycle(optimizer: torch.optim.Optimizer, args: Arguments, base: float) -> lr_scheduler.LRScheduler:
    peak, divide = float(args["max_learning_rate"]), float(args.get("divide_factor", 25.0))
    return lr_scheduler.OneCycleLR(
        optimizer, max_lr=peak, total_steps=int(args["total_steps"]), pct_start=float(args.get("phase_pct", 0.3)),
        anneal_strategy="linear" if args.get("anneal_strategy") == "linear" else "cos", div_factor=divide,
        cycle_momentum=False,
        final_div_factor=(peak / divide) / float(args.get("end_learning_rate", 1e-4)),
        three_phase=bool(args.get("three_phase", False)),
    )  # fmt: skip


_BUILDERS: dict[str, Callable[[torch.optim.Optimizer, Arguments, float], lr_scheduler.LRScheduler]] = {
    "constant": lambda o, a, b: lr_scheduler.LambdaLR(o, lambda t: 1.0),
    "CosineAnnealingDecay": lambda o, a, b: lr_scheduler.CosineAnnealingLR(o, int(a["T_max"]),
                                                                           float(a.get("eta_min", 0.0))),
    "PiecewiseDecay": _piecewise,
    "LinearWarmup": _warmup,
    "ExponentialDecay": lambda o, a, b: lr_scheduler.ExponentialLR(o, float(a["gamma"])),
    "NaturalExpDecay": lambda o, a, b: lr_scheduler.ExponentialLR(o, math.exp(-float(a["gamma"]))),
    "InverseTimeDecay": lambda o, a, b: lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1.0 + float(a["gamma"]) * t)),
    "PolynomialDecay": _polynomial,
    "StepDecay": lambda o, a, b: lr_scheduler.StepLR(o, int(a["step_size"]), float(a.get("gamma", 0.1))),
    "MultiStepDecay": lambda o, a, b: lr_scheduler.MultiStepLR(o, [int(m) for m in a["milestones"]],
                                                               float(a.get("gamma", 0.1))),
    "LinearLR": lambda o, a, b: lr_scheduler.LinearLR(o, float(a.get("start_factor", 1 / 3)),
                                                      float(a.get("end_factor", 1.0)), int(a["total_steps"])),
    "CosineAnnealingWarmRestarts": lambda o, a, b: lr_scheduler.CosineAnnealingWarmRestarts(
        o, int(a["T_0"]), int(a.get("T_mult", 1)), float(a.get("eta_min", 0.0))),
    "OneCycleLR": _one_cycle,
    "NoamDecay": _noam,
}  # fmt: skip

SCHEDULE_ARGUMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "CosineAnnealingDecay": (("learning_rate",), ("T_max", "eta_min")),
    "PiecewiseDecay": (("boundaries", "values"), ()),
    "LinearWarmup": (("learning_rate", "warmup_steps", "start_lr", "end_lr"), ()),
    "ExponentialDecay": (("learning_rate", "gamma"), ()),
    "NaturalExpDecay": (("learning_rate", "gamma"), ()),
    "InverseTimeDecay": (("learning_rate", "gamma"), ()),
    "PolynomialDecay": (("learning_rate", "decay_steps"), ("end_lr", "power", "cycle")),
    "StepDecay": (("learning_rate", "step_size"), ("gamma",)),
    "MultiStepDecay": (("learning_rate", "milestones"), ("gamma",)),
    "LinearLR": (("learning_rate", "total_steps"), ("start_factor", "end_factor")),
    "CosineAnnealingWarmRestarts": (("learning_rate", "T_0"), ("T_mult", "eta_min")),
    "OneCycleLR": (("max_learning_rate", "total_steps"),
                   ("divide_factor", "end_learning_rate", "phase_pct", "anneal_strategy", "three_phase")),
    "NoamDecay": (("d_model", "warmup_steps"), ("learning_rate",)),
}  # fmt: skip
"""Per Paddle schedule (``paddle.optimizer.lr``): its required and optional arguments."""
SCHEDULES = tuple(SCHEDULE_ARGUMENTS)
REFUSED_SCHEDULES = {
    "ReduceOnPlateau": "it needs a metric at every step, which ACT does not give it either",
    "LambdaDecay": "it needs a Python function",
    "MultiplicativeDecay": "it needs a Python function",
}
OPTIMIZER_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "SGD": (),
    "Momentum": ("momentum", "use_nesterov"),
    "Adam": ("beta1", "beta2", "epsilon"),
    "AdamW": ("beta1", "beta2", "epsilon"),
    "Adamax": ("beta1", "beta2", "epsilon"),
    "RMSProp": ("rho", "epsilon", "momentum", "centered"),
    "Adagrad": ("epsilon", "initial_accumulator_value"),
}
"""Per Paddle optimizer (``paddle.optimizer``): the arguments it maps (``multi_precision`` and the like are Paddle's
own and accepted without effect: :data:`IGNORED_ARGUMENTS`)."""
OPTIMIZERS = tuple(OPTIMIZER_ARGUMENTS)
IGNORED_ARGUMENTS = ("multi_precision", "use_multi_tensor", "lazy_mode", "name")
BUILDER_KEYS = ("optimizer", "weight_decay", "grad_clip", "regularizer")


def _numbers(arguments: Arguments) -> Arguments:
    """Checked arguments with every string that reads as a number made one (YAML 1.1 gives ``1e-4`` as a string)."""
    return {name: _value(value) for name, value in arguments.items()}


def _value(value: Any) -> Any:
    """A config value as a number where it reads as one."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value

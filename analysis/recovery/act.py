"""ACT's ``TrainConfig`` and ``Distillation`` blocks read into typed records, with ACT's defaults and meanings.

PaddleSlim ACT builds ``TrainConfig(**block)`` and ``Distillation(**block)`` and so refuses any key it does not know;
the same keys are read here (and the names of PaddleSlim 2.3, ``optimizer``/``optim_args`` and
``distill_loss``/``distill_lambda``/``distill_node_pair``, are translated with a notice). Keys that only steer
Paddle's static graph (``amp_config``, ``recompute_config``, ``sharding_config``, ``use_fleet``) are accepted and
listed as ignored by name; ``Recovery.precision`` is this tool's mixed precision.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analysis.act_keys import (
    DISTILLATION_KEYS,
    IGNORED_TRAIN_KEYS,
    LEGACY_DISTILL_KEYS,
    LEGACY_TRAIN_KEYS,
    TRAIN_CONFIG_KEYS,
)
from analysis.errors import ConfigError, did_you_mean, printable
from analysis.recovery.optim import OptimizerSpec, ScheduleSpec, parse_optimizer, parse_schedule

logger = logging.getLogger(__name__)

TRAIN_KEYS = tuple(TRAIN_CONFIG_KEYS)
DISTILL_KEYS = tuple(DISTILLATION_KEYS)
DISTILL_LOSSES = ("l2", "soft_label", "dkd", "skd")
"""Losses of ``paddleslim.dist`` a ``Distillation.loss`` may name (ACT calls each with a teacher and a student
tensor and its default arguments)."""
LEGACY_LOSS_NAMES = {"l2_loss": "l2", "soft_label_loss": "soft_label", "fsp_loss": "fsp"}
REFUSED_LOSSES = {"fsp": "it compares four tensors and ACT passes two", "loss": "it needs a Python function"}
DEFAULT_EPOCHS = 100
"""ACT trains this many epochs when neither ``epochs`` nor ``train_iter`` is set."""
ORIGIN_METRIC_TOLERANCE = 0.05
"""ACT refuses to train when the dense model's metric is further than this from ``TrainConfig.origin_metric``."""
EARLY_STOP_SHARE = 0.005
"""With ``origin_metric``, ACT stops once the best metric is within this share of the dense model's."""


@dataclass(frozen=True)
class TrainSettings:
    """``TrainConfig``: how long to train, the optimizer and learning rate, when to evaluate and log.

    Attributes:
        epochs: Passes over the training images (None: bounded by ``train_iter``, or 100 epochs when both are None).
        train_iter: Optimizer steps at most (None: bounded by ``epochs``); whichever bound comes first ends training.
        schedule: The learning rate: a constant or a Paddle schedule, stepped every iteration.
        optimizer: The optimizer and its weight decay.
        eval_iter: Evaluate, keep the best and write a checkpoint every this many steps (and at the end).
        logging_iter: Log the loss every this many batches of an epoch.
        origin_metric: The dense model's metric the user expects (a check of the data, as ACT's); None: unchecked.
        target_metric: Stop once an evaluation exceeds it; None: never.
        ignored: The keys read and ignored, with why (shown in the log).
    """

    epochs: int | None = None
    train_iter: int | None = None
    schedule: ScheduleSpec = field(default_factory=lambda: ScheduleSpec("constant", {"learning_rate": 0.02}))
    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("SGD"))
    eval_iter: int = 1000
    logging_iter: int = 10
    origin_metric: float | None = None
    target_metric: float | None = None
    ignored: dict[str, str] = field(default_factory=dict)

    def total_steps(self, steps_per_epoch: int) -> int:
        """The optimizer steps training takes: the first of ``epochs`` and ``train_iter`` reached (ACT's rule)."""
        bounds = []
        if self.epochs is not None:
            bounds.append(self.epochs * steps_per_epoch)
        if self.train_iter is not None:
            bounds.append(self.train_iter)
        return min(bounds) if bounds else DEFAULT_EPOCHS * steps_per_epoch

    def as_dict(self) -> dict[str, Any]:
        """The recipe as the sidecar records it."""
        return {
            "epochs": self.epochs,
            "train_iter": self.train_iter,
            "learning_rate": {"type": self.schedule.type, **self.schedule.arguments},
            "optimizer": self.optimizer.as_dict(),
            "eval_iter": self.eval_iter,
            "logging_iter": self.logging_iter,
            "origin_metric": self.origin_metric,
            "target_metric": self.target_metric,
        }  # fmt: skip


@dataclass(frozen=True)
class DistillPair:
    """One distillation term: ``alpha * loss(teacher's output of module, student's output of module)``.

    Attributes:
        loss: A :data:`DISTILL_LOSSES` name.
        teacher: The teacher's module whose output is compared ("" for the model's output, the logits).
        student: The student's module (the same name: the pruned model keeps the dense model's names).
        alpha: The term's weight.
    """

    loss: str
    teacher: str
    student: str
    alpha: float


@dataclass(frozen=True)
class DistillSettings:
    """``Distillation``: the terms of the distillation loss; the teacher is the dense (unpruned) model."""

    pairs: tuple[DistillPair, ...] = (DistillPair("l2", "", "", 1.0),)

    @property
    def modules(self) -> list[str]:
        """Every module name whose output a term reads ("" is the model's output), each once."""
        names = [name for pair in self.pairs for name in (pair.teacher, pair.student)]
        return list(dict.fromkeys(names))

    def as_dict(self) -> dict[str, Any]:
        """The terms as the sidecar records them."""
        return {"pairs": [{"loss": p.loss, "teacher": p.teacher or "output", "student": p.student or "output",
                           "alpha": p.alpha} for p in self.pairs]}  # fmt: skip


def read_train_config(block: Any, announce: bool = True) -> TrainSettings:
    """Read ``TrainConfig`` (a mapping, or None/absent for ACT's defaults); ``announce``: log the keys ignored and the
    old names translated (off for a check that reads the block once more later).

    Raises:
        ConfigError: For an unknown key, a value of the wrong type, an optimizer or schedule with no PyTorch
            counterpart.
    """
    raw = _mapping(block, "TrainConfig")
    raw = _translate_legacy_train(raw, announce)
    ignored: dict[str, str] = {}
    for key in list(raw):
        if key in IGNORED_TRAIN_KEYS:
            ignored[key] = IGNORED_TRAIN_KEYS[key]
            del raw[key]
        elif key not in TRAIN_KEYS:
            raise ConfigError(f"TrainConfig.{printable(key)} is not an ACT TrainConfig key"
                              f"{did_you_mean(key, (*TRAIN_KEYS, *IGNORED_TRAIN_KEYS))}.")  # fmt: skip
    builder = raw.get("optimizer_builder")
    if isinstance(builder, Mapping) and builder.get("regularizer") is not None and "weight_decay" in builder:
        ignored["optimizer_builder.weight_decay"] = "optimizer_builder.regularizer is given, and ACT then decays by it"
    for key, why in ignored.items() if announce else ():
        logger.info("TrainConfig.%s is ignored: %s.", key, why)
    epochs = _count(raw, "epochs", optional=True)
    train_iter = _count(raw, "train_iter", optional=True)
    return TrainSettings(
        epochs=epochs,
        train_iter=train_iter,
        schedule=parse_schedule(raw.get("learning_rate", 0.02)),
        optimizer=parse_optimizer(raw.get("optimizer_builder")),
        eval_iter=_count(raw, "eval_iter", default=1000),
        logging_iter=_count(raw, "logging_iter", default=10),
        origin_metric=_metric(raw, "origin_metric"),
        target_metric=_metric(raw, "target_metric"),
        ignored=ignored,
    )


def read_distillation(block: Any, legacy_note: bool = True) -> DistillSettings:
    """Read ``Distillation`` (a mapping, or None/absent for ACT's defaults: l2 on the model's output, alpha 1).

    ``node`` names modules of the model (the pruned model keeps the dense model's names), each compared with the
    same module of the teacher; an empty ``node`` compares the model's outputs (ACT's default: the outputs of the
    final layer). A list of lists gives one group of modules per ``loss`` (and ``alpha``) in a list.

    Raises:
        ConfigError: For an unknown key or loss, a teacher other than the dense model, mismatched list lengths.
    """
    raw = _mapping(block, "Distillation")
    for old, new in LEGACY_DISTILL_KEYS.items():
        if old in raw:
            if new in raw:
                raise ConfigError(f"Distillation.{old} and Distillation.{new} are the same key (old and new name); "
                                  f"keep {new}.")  # fmt: skip
            raw[new] = raw.pop(old)
            if legacy_note:
                logger.info("Distillation.%s is PaddleSlim 2.3's name of Distillation.%s; read as that.", old, new)
    raw.pop("merge_feed", None)  # PaddleSlim 2.3's feed merging: nothing to merge in PyTorch
    for key in raw:
        if key not in DISTILL_KEYS:
            raise ConfigError(f"Distillation.{printable(key)} is not an ACT Distillation key"
                              f"{did_you_mean(key, DISTILL_KEYS)}.")  # fmt: skip
    for key in ("teacher_model_dir", "teacher_model_filename", "teacher_params_filename"):
        if raw.get(key) not in (None, "None"):
            raise ConfigError(f"Distillation.{key} is not supported: the teacher is the dense model of Global (ACT's "
                              "default when it is unset); remove the key.")  # fmt: skip
    losses = _losses(raw.get("loss"))
    groups = _node_groups(raw.get("node"), len(losses))
    alphas = _alphas(raw.get("alpha"), len(losses))
    pairs = tuple(
        DistillPair(loss, teacher, student, alpha)
        for loss, group, alpha in zip(losses, groups, alphas, strict=True)
        for teacher, student in group
    )
    return DistillSettings(pairs)


def _mapping(block: Any, name: str) -> dict[str, Any]:
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"{name} must be a mapping of keys, not a {type(block).__name__}.")
    return {str(key): value for key, value in block.items()}


def _translate_legacy_train(raw: dict[str, Any], announce: bool) -> dict[str, Any]:
    """PaddleSlim 2.3's ``optimizer: Momentum`` and ``optim_args: {weight_decay: ...}`` as ``optimizer_builder``
    (``announce``: say so in the log)."""
    if not any(key in raw for key in LEGACY_TRAIN_KEYS):
        return raw
    if "optimizer_builder" in raw:
        raise ConfigError("TrainConfig.optimizer_builder and TrainConfig.optimizer/optim_args (PaddleSlim 2.3's "
                          "names) are both set; keep optimizer_builder.")  # fmt: skip
    arguments = _mapping(raw.pop("optim_args", None), "TrainConfig.optim_args")
    builder: dict[str, Any] = {"optimizer": {"type": raw.pop("optimizer", "SGD")}}
    if "weight_decay" in arguments:
        builder["weight_decay"] = arguments.pop("weight_decay")
    builder["optimizer"].update(arguments)
    if announce:
        logger.info(
            "TrainConfig.optimizer/optim_args are PaddleSlim 2.3's names; read as TrainConfig.optimizer_builder."
        )
    return {**raw, "optimizer_builder": builder}


def _count(raw: Mapping[str, Any], key: str, default: int | None = None, optional: bool = False) -> Any:
    value = raw.get(key)
    if value is None:
        return None if optional else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"TrainConfig.{key} must be a positive integer, got {printable(repr(value))}.")
    return value


def _metric(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"TrainConfig.{key} must be a number (the metric, e.g. top1 0.7912), got "
                          f"{printable(repr(value))}.")  # fmt: skip
    return float(value)


def _losses(value: Any) -> list[str]:
    names = [value] if value is None or isinstance(value, str) else value
    if not isinstance(names, Sequence) or not names:
        raise ConfigError(f"Distillation.loss must be a loss name or a list of them ({', '.join(DISTILL_LOSSES)}).")
    losses = []
    for name in names:
        loss = LEGACY_LOSS_NAMES.get(str(name), str(name)) if name is not None else "l2"
        if loss in REFUSED_LOSSES:
            raise ConfigError(f"Distillation.loss '{loss}' cannot be given in a config file ({REFUSED_LOSSES[loss]}); "
                              f"supported: {', '.join(DISTILL_LOSSES)}.")  # fmt: skip
        if loss not in DISTILL_LOSSES:
            supported = ", ".join(DISTILL_LOSSES)
            raise ConfigError(f"Distillation.loss '{printable(loss)}' is not a paddleslim.dist loss"
                              f"{did_you_mean(loss, DISTILL_LOSSES)}; supported: {supported}.")  # fmt: skip
        losses.append(loss)
    return losses


def _node_groups(value: Any, groups: int) -> list[list[tuple[str, str]]]:
    """(teacher, student) module pairs per loss group; [("", "")] (the outputs) for an empty group."""
    if value is None or value == []:
        return [[("", "")] for _ in range(groups)]
    if not isinstance(value, Sequence) or isinstance(value, str):
        value = [value]
    nested = all(isinstance(item, Sequence) and not isinstance(item, str) for item in value)
    lists = [list(item) for item in value] if nested else [list(value)]
    if len(lists) != groups:
        raise ConfigError(f"Distillation.node has {len(lists)} group(s) of nodes but Distillation.loss names "
                          f"{groups} loss(es); give one list of nodes per loss.")  # fmt: skip
    return [_pairs(names) for names in lists]


TEACHER_PREFIX = "teacher_"


def _pairs(names: list[Any]) -> list[tuple[str, str]]:
    """Module names as (teacher, student) pairs: ``[a, b]`` compares a with a and b with b; PaddleSlim 2.3's
    explicit ``[teacher_a, a, ...]`` pairs name the teacher's module with the ``teacher_`` prefix."""
    texts = [str(name) for name in names]
    if texts and all(name.startswith(TEACHER_PREFIX) for name in texts[::2]) and len(texts) % 2 == 0:
        pairs = zip(texts[::2], texts[1::2], strict=True)
        return [(teacher.removeprefix(TEACHER_PREFIX), student) for teacher, student in pairs]
    return [(name, name) for name in texts]


def _alphas(value: Any, groups: int) -> list[float]:
    items = [1.0] * groups if value is None else (value if isinstance(value, list) else [value])
    if len(items) != groups:
        raise ConfigError(f"Distillation.alpha has {len(items)} value(s) but Distillation.loss names {groups} "
                          "loss(es); give one alpha per loss.")  # fmt: skip
    alphas = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) or item < 0:
            raise ConfigError(f"Distillation.alpha must be a non-negative number per loss, got {item!r}.")
        alphas.append(float(item))
    return alphas

"""ACT's ``optimizer_builder.grad_clip`` and ``optimizer_builder.regularizer``: what Paddle does to the gradients
between the backward pass and the optimizer's update, done the same way here.

Paddle clips first (``paddle.nn.ClipGradByGlobalNorm``, ``ClipGradByNorm``, ``ClipGradByValue``), then adds the
regularizer's term to each gradient (``paddle.regularizer.L2Decay`` / ``L1Decay``). An L2 term is the optimizer's
own ``weight_decay`` in PyTorch (added inside its step, so after the clip too); an L1 term, which PyTorch's optimizers
do not have, is added here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from analysis.errors import ConfigError, did_you_mean
from analysis.recovery.values import check_arguments, config_number

CLIP_ARGUMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "ClipGradByGlobalNorm": (("clip_norm",), ("group_name", "auto_skip_clip")),
    "ClipGradByNorm": (("clip_norm",), ()),
    "ClipGradByValue": (("max",), ("min",)),
}
"""Per Paddle clip type: its required and its optional arguments (``group_name`` and ``auto_skip_clip`` steer
Paddle's graph only and are accepted without effect)."""
CLIP_TYPES = tuple(CLIP_ARGUMENTS)
REGULARIZERS = ("L2Decay", "L1Decay")


@dataclass(frozen=True)
class GradClip:
    """``optimizer_builder.grad_clip``: one of Paddle's clip types and its bounds.

    Attributes:
        type: :data:`CLIP_TYPES`.
        clip_norm: The norm bound of the two norm types (None for ``ClipGradByValue``).
        low: ``ClipGradByValue``'s ``min`` (``-max`` when absent, as Paddle's).
        high: ``ClipGradByValue``'s ``max``.
    """

    type: str
    clip_norm: float | None = None
    low: float | None = None
    high: float | None = None

    def apply(self, grads: list[torch.Tensor]) -> None:
        """Clip ``grads`` in place as Paddle's class does, without reading a value back from the device.

        Global norm: every gradient times ``clip_norm / max(global norm, clip_norm)``; norm: each gradient by its own
        norm the same way; value: each element clamped to ``[low, high]``.
        """
        if not grads:
            return
        if self.type == "ClipGradByValue":
            for grad in grads:
                grad.clamp_(self.low, self.high)
            return
        assert self.clip_norm is not None
        norms = [torch.linalg.vector_norm(grad.float()) for grad in grads]
        if self.type == "ClipGradByGlobalNorm":
            total = torch.linalg.vector_norm(torch.stack(norms))
            norms = [total] * len(grads)
        for grad, norm in zip(grads, norms, strict=True):
            grad.mul_((self.clip_norm / torch.clamp(norm, min=self.clip_norm)).to(grad.dtype))

    def as_dict(self) -> dict[str, Any]:
        """The clip as the sidecar records it, Paddle's names."""
        if self.type == "ClipGradByValue":
            return {"type": self.type, "min": self.low, "max": self.high}
        return {"type": self.type, "clip_norm": self.clip_norm}


@dataclass(frozen=True)
class GradientRules:
    """What happens to the gradients before the optimizer's update: the clip, then an L1 term.

    Attributes:
        clip: ``grad_clip``; None: none.
        l1_decay: The coefficient of ``regularizer: {type: L1Decay}`` (each gradient gains ``l1_decay * sign(w)``);
            0: none.
    """

    clip: GradClip | None = None
    l1_decay: float = 0.0

    def apply(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Clip the gradients of ``parameters``, then add the L1 term, in place (Paddle's order)."""
        if self.clip is None and not self.l1_decay:
            return
        with torch.no_grad():
            pairs = [(weight, weight.grad) for weight in parameters if weight.grad is not None]
            if self.clip is not None:
                self.clip.apply([grad for _, grad in pairs])
            if self.l1_decay:
                for weight, grad in pairs:
                    grad.add_(torch.sign(weight), alpha=self.l1_decay)


@dataclass(frozen=True)
class Regularizer:
    """``optimizer_builder.regularizer``: Paddle's type and coefficient."""

    type: str
    coeff: float


def parse_grad_clip(value: Any, key: str) -> GradClip | None:
    """``grad_clip`` (a mapping with a Paddle ``type``; None or absent: no clip).

    Raises:
        ConfigError: For an unknown type or argument, a missing or non-positive bound, or ``min`` above ``max``.
    """
    if value is None:
        return None
    if isinstance(value, Mapping) and "min" in value and value["min"] is None:  # Paddle's default: -max
        value = {name: given for name, given in value.items() if name != "min"}
    takes = {kind: (*required, *optional) for kind, (required, optional) in CLIP_ARGUMENTS.items()}
    kind, arguments = _typed(value, key, "gradient clip", takes)
    required, _ = CLIP_ARGUMENTS[kind]
    missing = [name for name in required if name not in arguments]
    if missing:
        raise ConfigError(f"{key}.{missing[0]} is missing: {kind} needs {', '.join(required)}.")
    if kind != "ClipGradByValue":
        clip_norm = config_number(f"{key}.clip_norm", arguments["clip_norm"])
        if clip_norm <= 0:
            raise ConfigError(f"{key}.clip_norm must be positive, not {arguments['clip_norm']!r}.")
        return GradClip(kind, clip_norm=clip_norm)
    high = config_number(f"{key}.max", arguments["max"])
    if "min" not in arguments:
        if high <= 0:
            raise ConfigError(f"{key}.max must be positive when min is not given (min is then -max), not {high:g}.")
        return GradClip(kind, low=-high, high=high)
    low = config_number(f"{key}.min", arguments["min"])
    if low > high:
        raise ConfigError(f"{key}.min {low:g} is above {key}.max {high:g}.")
    return GradClip(kind, low=low, high=high)


def parse_regularizer(value: Any, key: str) -> Regularizer | None:
    """``regularizer`` (a mapping with a Paddle ``type`` and ``coeff``, 0 by default as in Paddle; None: none).

    Raises:
        ConfigError: For an unknown type or argument, or a coefficient that is not a non-negative number.
    """
    if value is None:
        return None
    kind, arguments = _typed(value, key, "regularizer", {kind: ("coeff",) for kind in REGULARIZERS})
    coeff = config_number(f"{key}.coeff", arguments.get("coeff", 0.0))
    if coeff < 0:
        raise ConfigError(f"{key}.coeff must not be negative, not {coeff:g}.")
    return Regularizer(kind, coeff)


def _typed(value: Any, key: str, what: str, takes: Mapping[str, tuple[str, ...]]) -> tuple[str, dict[str, Any]]:
    """A ``{type: ..., **arguments}`` mapping whose type is one of ``takes`` (type -> the arguments it takes): the type
    and the arguments, each checked by name and value.

    Raises:
        ConfigError: For a value that is not a mapping, an unknown type, or an argument the type does not take.
    """
    types = tuple(takes)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping with a type ({', '.join(types)}), not {value!r}.")
    arguments = dict(value)
    kind = str(arguments.pop("type", ""))
    if kind not in takes:
        raise ConfigError(f"{key}.type '{kind}' is not a Paddle {what}{did_you_mean(kind, types)}; "
                          f"supported: {', '.join(types)}.")  # fmt: skip
    check_arguments(key, kind, arguments, takes[kind])
    return kind, arguments

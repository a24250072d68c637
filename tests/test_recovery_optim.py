"""ACT's TrainConfig optimizer and learning-rate blocks mapped to PyTorch: every Paddle schedule gives Paddle's learning
rate at every iteration (formulas from paddle.optimizer.lr, written out here), every optimizer Paddle's defaults, and
what has no counterpart is refused naming the key."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from analysis.errors import ConfigError
from analysis.recovery.gradients import GradClip, GradientRules
from analysis.recovery.optim import (
    OPTIMIZERS,
    SCHEDULES,
    build_optimizer,
    build_schedule,
    parse_optimizer,
    parse_schedule,
)

STEPS = 12


def rates(learning_rate: Any, steps: int = STEPS) -> list[float]:
    """The learning rate of iterations 0..steps-1, the schedule stepped after every optimizer step (as ACT does)."""
    spec = parse_schedule(learning_rate)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([weight], parse_optimizer(None), spec.initial_lr)
    schedule = build_schedule(optimizer, spec)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(1)
        optimizer.step()
        schedule.step()
    return seen


PADDLE: list[tuple[dict[str, Any] | float | str, Callable[[int], float]]] = [
    (0.1, lambda t: 0.1),
    ("1e-4", lambda t: 1e-4),  # YAML 1.1 reads 1e-4 as a string
    ({"type": "CosineAnnealingDecay", "learning_rate": 0.1, "T_max": 10},
     lambda t: 0.1 * (1 + math.cos(math.pi * t / 10)) / 2 if t <= 10 else None),
    ({"type": "PiecewiseDecay", "boundaries": [3, 6], "values": [0.1, 0.01, 0.001]},
     lambda t: 0.1 if t < 3 else 0.01 if t < 6 else 0.001),
    ({"type": "LinearWarmup", "learning_rate": 0.1, "warmup_steps": 4, "start_lr": 0.0, "end_lr": 0.1},
     lambda t: 0.1 * t / 4 if t < 4 else 0.1),
    ({"type": "ExponentialDecay", "learning_rate": 0.1, "gamma": 0.9}, lambda t: 0.1 * 0.9**t),
    ({"type": "NaturalExpDecay", "learning_rate": 0.1, "gamma": 0.5}, lambda t: 0.1 * math.exp(-0.5 * t)),
    ({"type": "InverseTimeDecay", "learning_rate": 0.1, "gamma": 0.5}, lambda t: 0.1 / (1 + 0.5 * t)),
    ({"type": "PolynomialDecay", "learning_rate": 0.1, "decay_steps": 5, "end_lr": 0.001, "power": 2.0},
     lambda t: (0.1 - 0.001) * (1 - min(t, 5) / 5) ** 2 + 0.001),
    ({"type": "PolynomialDecay", "learning_rate": 0.1, "decay_steps": 4, "cycle": True},
     lambda t: (0.1 - 1e-4) * (1 - t / (4 * max(1, math.ceil(t / 4)))) + 1e-4),
    ({"type": "StepDecay", "learning_rate": 0.1, "step_size": 3, "gamma": 0.5}, lambda t: 0.1 * 0.5 ** (t // 3)),
    ({"type": "MultiStepDecay", "learning_rate": 0.1, "milestones": [2, 5]},
     lambda t: 0.1 * 0.1 ** sum(m <= t for m in (2, 5))),
    ({"type": "LinearLR", "learning_rate": 0.1, "total_steps": 4, "start_factor": 0.25},
     lambda t: 0.1 * (0.25 + 0.75 * min(t, 4) / 4)),
    ({"type": "CosineAnnealingWarmRestarts", "learning_rate": 0.1, "T_0": 3},
     lambda t: 0.1 * (1 + math.cos(math.pi * (t % 3) / 3)) / 2),
    ({"type": "NoamDecay", "d_model": 16, "warmup_steps": 4, "learning_rate": 1.0},
     lambda t: 16**-0.5 * min(t**-0.5, t * 4**-1.5) if t else 0.0),
]  # fmt: skip


@pytest.mark.parametrize(("learning_rate", "paddle"), PADDLE, ids=lambda v: v["type"] if isinstance(v, dict) else None)
def test_each_paddle_schedule_gives_paddles_learning_rate_every_iteration(
    learning_rate: Any, paddle: Callable[[int], float | None]
) -> None:
    for t, found in enumerate(rates(learning_rate)):
        expected = paddle(t)
        if expected is not None:
            assert found == pytest.approx(expected, rel=1e-6, abs=1e-12), t


def test_every_supported_schedule_is_checked_against_paddle() -> None:
    checked = {spec["type"] for spec, _ in PADDLE if isinstance(spec, dict)} | {"OneCycleLR"}
    assert checked == set(SCHEDULES)


def test_one_cycle_starts_at_the_peak_over_the_divide_factor_and_ends_at_the_end_rate() -> None:
    """Paddle gives the final rate itself where PyTorch asks for a divisor; momentum is not cycled (Paddle has none)."""
    found = rates({"type": "OneCycleLR", "max_learning_rate": 0.1, "total_steps": 10, "end_learning_rate": 1e-4}, 10)
    assert found[0] == pytest.approx(0.1 / 25) and max(found) == pytest.approx(0.1, rel=0.05)
    assert found[-1] == pytest.approx(1e-4, rel=1e-6)


@pytest.mark.parametrize(
    ("builder", "kind", "expected"),
    [
        (None, torch.optim.SGD, {"momentum": 0.0, "weight_decay": 0.0}),  # ACT's default: SGD
        ({"optimizer": {"type": "Momentum"}, "weight_decay": 4e-5}, torch.optim.SGD,
         {"momentum": 0.9, "nesterov": False, "weight_decay": 4e-5}),  # Paddle's Momentum defaults to 0.9
        ({"optimizer": {"type": "Momentum", "momentum": 0.8, "use_nesterov": True}}, torch.optim.SGD,
         {"momentum": 0.8, "nesterov": True}),
        ({"optimizer": {"type": "Adam", "beta1": 0.8, "epsilon": 1e-7}}, torch.optim.Adam,
         {"betas": (0.8, 0.999), "eps": 1e-7}),
        ({"optimizer": {"type": "AdamW"}}, torch.optim.AdamW, {"weight_decay": 0.01}),  # Paddle's AdamW default
        ({"optimizer": {"type": "AdamW"}, "weight_decay": "1e-4"}, torch.optim.AdamW, {"weight_decay": 1e-4}),
        ({"optimizer": {"type": "RMSProp"}}, torch.optim.RMSprop, {"alpha": 0.95, "eps": 1e-6, "centered": False}),
        ({"optimizer": {"type": "Adagrad", "multi_precision": True}}, torch.optim.Adagrad, {"eps": 1e-6}),
        ({"optimizer": {"type": "Adamax"}}, torch.optim.Adamax, {"betas": (0.9, 0.999)}),
    ],
)  # fmt: skip
def test_each_paddle_optimizer_maps_to_torch_with_paddles_defaults(
    builder: dict[str, Any] | None, kind: type, expected: dict[str, Any]
) -> None:
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], parse_optimizer(builder), 0.01)
    assert type(optimizer) is kind and optimizer.param_groups[0]["lr"] == 0.01
    group = optimizer.param_groups[0]
    for name, value in expected.items():
        assert group[name] == (pytest.approx(value) if not isinstance(value, tuple) else value), name


def test_every_supported_optimizer_builds() -> None:
    for kind in OPTIMIZERS:
        assert build_optimizer([torch.nn.Parameter(torch.zeros(1))], parse_optimizer({"optimizer": {"type": kind}}), 1)


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (parse_schedule, {"type": "CosineDecay", "learning_rate": 0.1},
         r"^TrainConfig\.learning_rate\.type 'CosineDecay' is not a Paddle .* supported: CosineAnnealingDecay, "),
        (parse_schedule, {"type": "ReduceOnPlateau", "learning_rate": 0.1},
         r"^TrainConfig\.learning_rate\.type 'ReduceOnPlateau' cannot be given in a config file \(it needs a metric"),
        (parse_schedule, {"type": "LambdaDecay", "learning_rate": 0.1}, r"needs a Python function"),
        (parse_schedule, {"type": "StepDecay", "learning_rate": 0.1},
         r"^TrainConfig\.learning_rate\.step_size is missing: the StepDecay schedule needs learning_rate, step_size"),
        (parse_schedule, {"type": "StepDecay", "learning_rate": 0.1, "step_size": 3, "gama": 0.5},
         r"^TrainConfig\.learning_rate\.gama is not an argument of StepDecay \(did you mean 'gamma'\?\); it takes"),
        (parse_schedule, "fast", r"^TrainConfig\.learning_rate must be a number, not 'fast'\.$"),
        (parse_schedule, {"type": "MultiStepDecay", "learning_rate": 0.1, "milestones": [2, "x"]},
         r"^TrainConfig\.learning_rate\.milestones must be a number, not 'x'\.$"),
        (parse_optimizer, {"optimizer": {"type": "Lamb"}},
         r"^TrainConfig\.optimizer_builder\.optimizer\.type 'Lamb' has no PyTorch counterpart here; supported: SGD"),
        (parse_optimizer, {"optimizer": {"type": "Momentum", "momentun": 0.9}},
         r"optimizer_builder\.optimizer\.momentun is not an argument of Momentum \(did you mean 'momentum'"),
        (parse_optimizer, {"optimizer": {"type": "SGD"}, "weight_decay": "much"},
         r"^TrainConfig\.optimizer_builder\.weight_decay must be a number, not 'much'\.$"),
        (parse_optimizer, {"optimiser": {"type": "SGD"}},
         r"^TrainConfig\.optimizer_builder\.optimiser is not an optimizer_builder key \(did you mean 'optimizer'\?\)"),
        (parse_optimizer, {"grad_clip": {"type": "ClipGradByGlobalNom", "clip_norm": 1.0}},
         r"^TrainConfig\.optimizer_builder\.grad_clip\.type 'ClipGradByGlobalNom' is not a Paddle gradient clip "
         r"\(did you mean 'ClipGradByGlobalNorm'\?\); supported: ClipGradByGlobalNorm, ClipGradByNorm, "
         r"ClipGradByValue\.$"),
        (parse_optimizer, {"grad_clip": {"type": "ClipGradByNorm"}},
         r"^TrainConfig\.optimizer_builder\.grad_clip\.clip_norm is missing: ClipGradByNorm needs clip_norm\.$"),
        (parse_optimizer, {"grad_clip": {"type": "ClipGradByGlobalNorm", "clip_norm": 0}},
         r"^TrainConfig\.optimizer_builder\.grad_clip\.clip_norm must be positive, not 0\.$"),
        (parse_optimizer, {"grad_clip": {"type": "ClipGradByValue", "max": 1.0, "min": 2.0}},
         r"^TrainConfig\.optimizer_builder\.grad_clip\.min 2 is above "
         r"TrainConfig\.optimizer_builder\.grad_clip\.max 1\.$"),
        (parse_optimizer, {"grad_clip": {"type": "ClipGradByValue", "max": -1.0}},
         r"^TrainConfig\.optimizer_builder\.grad_clip\.max must be positive when min is not given"),
        (parse_optimizer, {"grad_clip": 5.0},
         r"^TrainConfig\.optimizer_builder\.grad_clip must be a mapping with a type \(ClipGradByGlobalNorm, "),
        (parse_optimizer, {"regularizer": {"type": "L3Decay", "coeff": 1e-4}},
         r"^TrainConfig\.optimizer_builder\.regularizer\.type 'L3Decay' is not a Paddle regularizer .*supported: "
         r"L2Decay, L1Decay\.$"),
        (parse_optimizer, {"regularizer": {"type": "L2Decay", "factor": 1e-4}},
         r"^TrainConfig\.optimizer_builder\.regularizer\.factor is not an argument of L2Decay; it takes coeff\.$"),
        (parse_optimizer, {"optimizer": {"type": "AdamW"}, "regularizer": {"type": "L2Decay", "coeff": 1e-4}},
         r"^TrainConfig\.optimizer_builder\.regularizer cannot be given with AdamW, whose decay is decoupled"),
    ],
)  # fmt: skip
def test_what_has_no_counterpart_is_refused_in_one_sentence_naming_the_key(
    parse: Callable[[Any], Any], value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(value)


def _grads(*values: list[float]) -> list[torch.nn.Parameter]:
    """Parameters of zeros whose gradients are ``values``."""
    parameters = []
    for value in values:
        weight = torch.nn.Parameter(torch.zeros(len(value)))
        weight.grad = torch.tensor(value)
        parameters.append(weight)
    return parameters


@pytest.mark.parametrize(
    ("grad_clip", "grads", "clipped"),
    [
        # the global norm of (3, 0, 0, 4) is 5: every gradient times 1 / 5
        ({"type": "ClipGradByGlobalNorm", "clip_norm": 1.0}, ([3.0, 0.0], [0.0, 4.0]), ([0.6, 0.0], [0.0, 0.8])),
        ({"type": "ClipGradByGlobalNorm", "clip_norm": 10.0}, ([3.0, 0.0], [0.0, 4.0]), ([3.0, 0.0], [0.0, 4.0])),
        # each gradient by its own norm: (3, 4) has 5, (0.6, 0.8) has 1
        ({"type": "ClipGradByNorm", "clip_norm": 2.0}, ([3.0, 4.0], [0.6, 0.8]), ([1.2, 1.6], [0.6, 0.8])),
        ({"type": "ClipGradByValue", "max": 0.5}, ([-1.0, 0.2, 3.0],), ([-0.5, 0.2, 0.5],)),  # min is -max
        ({"type": "ClipGradByValue", "max": 1.0, "min": 0.0}, ([-1.0, 0.2, 3.0],), ([0.0, 0.2, 1.0],)),
    ],
)  # fmt: skip
def test_each_gradient_clip_computes_paddles_clip(
    grad_clip: dict[str, Any], grads: tuple[list[float], ...], clipped: tuple[list[float], ...]
) -> None:
    spec = parse_optimizer({"grad_clip": grad_clip})
    parameters = _grads(*grads)
    spec.gradients.apply(parameters)
    for weight, expected in zip(parameters, clipped, strict=True):
        assert weight.grad is not None and torch.allclose(weight.grad, torch.tensor(expected)), grad_clip


def test_a_regularizer_takes_the_place_of_weight_decay_and_l1_follows_the_clip() -> None:
    l2 = parse_optimizer({"optimizer": {"type": "Momentum"}, "regularizer": {"type": "L2Decay", "coeff": 3e-4},
                          "weight_decay": 1e-2})  # fmt: skip
    assert (l2.weight_decay, l2.gradients) == (3e-4, GradientRules())  # the optimizer's own (coupled) L2 decay
    assert build_optimizer([torch.nn.Parameter(torch.zeros(1))], l2, 0.1).defaults["weight_decay"] == 3e-4
    l1 = parse_optimizer({"regularizer": {"type": "L1Decay", "coeff": 0.1},
                          "grad_clip": {"type": "ClipGradByValue", "max": 0.5}})  # fmt: skip
    assert l1.weight_decay is None and l1.gradients == GradientRules(
        GradClip("ClipGradByValue", low=-0.5, high=0.5), 0.1
    )
    weight = torch.nn.Parameter(torch.tensor([2.0, -3.0, 0.0]))
    weight.grad = torch.tensor([4.0, 0.25, -1.0])
    l1.gradients.apply([weight])
    assert torch.allclose(weight.grad, torch.tensor([0.5 + 0.1, 0.25 - 0.1, -0.5]))  # clipped, then 0.1 * sign(w)
    assert l1.describe() == "SGD, L1 decay 0.1, gradients clipped by ClipGradByValue [-0.5, 0.5]"  # the log says so
    assert l2.describe() == "Momentum, weight decay 0.0003"
    assert parse_optimizer({"regularizer": {"type": "L2Decay"}}).weight_decay == 0.0  # Paddle's default coeff

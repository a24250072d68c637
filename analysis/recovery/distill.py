"""Knowledge distillation from the dense model: the losses of ``paddleslim.dist`` that ACT configs name, and the
capture of the module outputs ``Distillation.node`` compares.

Each loss takes the teacher's tensor and the student's, as ACT calls them, with Paddle's default arguments (a config
cannot set a temperature): ``l2`` is the mean squared error over every element, ``soft_label`` the cross-entropy of
the student's softmax against the teacher's over the last axis (no T² factor), ``dkd`` decoupled distillation with
the teacher's top class as the target, ``skd`` the cross-entropy of layer-normalised logits scaled by the teacher's
standard deviation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from analysis.errors import ConfigError, did_you_mean, printable
from analysis.recovery.act import DISTILL_LOSSES, DistillSettings

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

OUTPUT = ""
"""The name standing for the model's own output (its logits)."""


def l2(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``paddleslim.dist.l2``: the mean over every element of the squared difference."""
    return F.mse_loss(student, teacher)


def soft_label(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``paddleslim.dist.soft_label`` at temperature 1: the mean over the other axes of -sum(p_t * log p_s) over the
    last axis."""
    return -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1).mean()


def dkd(teacher: torch.Tensor, student: torch.Tensor, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """``paddleslim.dist.dkd`` at temperature 1: a target-class and a non-target-class term, the target being the
    teacher's top class. Paddle passes probabilities where ``kl_div`` expects log-probabilities; that is kept, so the
    loss is the one ACT optimises."""
    top = (teacher == teacher.max(dim=-1, keepdim=True).values).to(teacher.dtype)

    def split(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inside = (top * logits.softmax(-1)).sum(1, keepdim=True)
        return torch.cat([inside, 1 - inside], dim=1), (logits - 100000 * top).softmax(-1)

    (student_target, student_rest), (teacher_target, teacher_rest) = split(student), split(teacher)
    return alpha * _kl_mean(student_target, teacher_target) + beta * _kl_mean(student_rest, teacher_rest)


def _kl_mean(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Paddle's ``kl_div(input, label, reduction='mean')``: the mean over every element of
    ``label * (log(label) - input)``, 0 where the label is 0 (PyTorch's ``mean``, without its warning)."""
    return F.kl_div(inputs, target, reduction="sum") / inputs.numel()


def skd(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``paddleslim.dist.skd``: logits layer-normalised (eps 1e-7, no affine) and scaled by the teacher's standard
    deviation per sample, then the soft-label cross-entropy over axis 1."""
    scale = teacher.std(dim=1, keepdim=True)

    def normalised(logits: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(logits, logits.shape[1:], eps=1e-7) * scale

    return -(normalised(teacher).softmax(1) * normalised(student).log_softmax(1)).sum(1).mean()


LOSSES: dict[str, LossFunction] = dict(zip(DISTILL_LOSSES, (l2, soft_label, dkd, skd), strict=True))
"""The loss of each name ``Distillation.loss`` accepts (:data:`~analysis.recovery.act.DISTILL_LOSSES`, in its
order: a name added there without a function here fails at import)."""


def check_nodes(model: nn.Module, settings: DistillSettings) -> None:
    """Refuse a ``Distillation.node`` that names no module of the model, with the closest names.

    Raises:
        ConfigError: Naming the node; Paddle variable names (``softmax_0.tmp_0``) do not carry over.
    """
    names = dict(model.named_modules())
    for name in settings.modules:
        if name != OUTPUT and name not in names:
            raise ConfigError(
                f"Distillation.node '{printable(name)}' is no module of the model{did_you_mean(name, list(names))}; "
                "name modules as model.named_modules() does (Paddle variable names such as softmax_0.tmp_0 do not "
                "carry over), or leave node empty to distil the model's outputs."
            )


@contextmanager
def captured(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Record the output of each named module on every forward pass (the model's own output is stored by the
    caller under :data:`OUTPUT`); a module's latest output replaces the former one."""
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in names:
        if name == OUTPUT:
            continue

        def hook(_module: nn.Module, _inputs: object, output: object, name: str = name) -> None:
            if not isinstance(output, torch.Tensor):
                raise ConfigError(f"Distillation.node '{printable(name)}' returns a {type(output).__name__}, not a "
                                  "tensor; name a module that returns one.")  # fmt: skip
            outputs[name] = output

        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def distillation_loss(
    settings: DistillSettings, teacher: dict[str, torch.Tensor], student: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The weighted sum of every term, in float32 (the terms are computed from autocast outputs upcast)."""
    terms = []
    for pair in settings.pairs:
        t, s = teacher[pair.teacher].float(), student[pair.student].float()
        if t.shape != s.shape:
            name = pair.student or "the output"
            raise ConfigError(f"Distillation.node {printable(name)}: the pruned model's output has shape "
                              f"{tuple(s.shape)} and the dense model's {tuple(t.shape)}; name a module whose channels "
                              "are not pruned (the logits, or a layer before the classifier).")  # fmt: skip
        terms.append(pair.alpha * LOSSES[pair.loss](t.detach(), s))
    return torch.stack(terms).sum()

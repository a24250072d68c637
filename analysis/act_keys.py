"""The keys of ACT's ``TrainConfig`` and ``Distillation`` blocks that ``run.py compress`` reads: their type, ACT's
default and what they mean here. One table for the reader (:mod:`analysis.recovery.act`) and the generated
configuration reference (:mod:`analysis.config_reference`), so the two cannot drift; no torch is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActKey:
    """One key of an ACT block, as the configuration reference shows it."""

    type: str
    default: str
    meaning: str


TRAIN_CONFIG_KEYS: dict[str, ActKey] = {
    "epochs": ActKey(
        "int or null",
        "`null`",
        "passes over the training images; with `train_iter`, the first bound "
        "reached ends training; with neither, 100 epochs (ACT's rule)",
    ),
    "train_iter": ActKey("int or null", "`null`", "optimizer steps at most"),
    "learning_rate": ActKey(
        "float or mapping",
        "`0.02`",
        "a constant, or a Paddle schedule: `type` (`CosineAnnealingDecay`, `PiecewiseDecay`, `LinearWarmup`, "
        "`ExponentialDecay`, `NaturalExpDecay`, `InverseTimeDecay`, `PolynomialDecay`, `StepDecay`, `MultiStepDecay`, "
        "`LinearLR`, `CosineAnnealingWarmRestarts`, `OneCycleLR`, `NoamDecay`) and its Paddle arguments, stepped "
        "every iteration as ACT steps it; `CosineAnnealingDecay` without `T_max` anneals over the whole training",
    ),
    "optimizer_builder": ActKey(
        "mapping",
        "`{optimizer: {type: SGD}}`",
        "`optimizer` (`type`: `SGD`, `Momentum` (momentum 0.9 by default, as Paddle's), `Adam`, `AdamW`, `Adamax`, "
        "`RMSProp`, `Adagrad`, with Paddle's argument names), `weight_decay` beside it (L2; decoupled for AdamW), "
        "`grad_clip` (`type`: `ClipGradByGlobalNorm` or `ClipGradByNorm` with `clip_norm`, `ClipGradByValue` with "
        "`max` and `min`, -max by default) and `regularizer` (`type`: `L2Decay` or `L1Decay`, `coeff`; in place of "
        "`weight_decay`, as in ACT)",
    ),
    "eval_iter": ActKey(
        "int",
        "`1000`",
        "evaluate, keep the best weights (`best.pt`) and write the checkpoint "
        "(`last.pt`) every this many steps, and at the end",
    ),
    "logging_iter": ActKey(
        "int", "`10`", "log the loss every this many batches of an epoch (to the terminal and `train.log`)"
    ),
    "origin_metric": ActKey(
        "float or null",
        "`null`",
        "the dense model's top1 you expect: training is refused when "
        "the measured one differs by more than 0.05 (a wrong data set or preprocessing), and stops "
        "once the best recovered top1 is within 0.5% of the dense model's",
    ),
    "target_metric": ActKey("float or null", "`null`", "stop once an evaluation's top1 exceeds it"),
}
"""``TrainConfig`` keys this tool maps to PyTorch."""

IGNORED_TRAIN_KEYS = {
    "amp_config": "Paddle's static-graph mixed precision; Recovery.precision sets ours",
    "recompute_config": "Paddle fleet's activation recomputation",
    "sharding_config": "Paddle fleet's optimizer sharding",
    "use_fleet": "Paddle fleet; torchrun scales this tool out",
    "sparse_model": "unstructured sparsity, which channel pruning does not produce",
}
"""``TrainConfig`` keys that only steer Paddle, accepted and ignored, with why."""

DISTILLATION_KEYS: dict[str, ActKey] = {
    "loss": ActKey(
        "str or list of str",
        "`l2`",
        "the `paddleslim.dist` loss: `l2` (mean squared error), "
        "`soft_label` (soft cross-entropy), `dkd` or `skd`, with Paddle's defaults; a list gives one loss "
        "per group of `node`",
    ),
    "node": ActKey(
        "list of str (or of lists)",
        "`[]`",
        "modules of the model whose outputs are compared, dense "
        "(teacher) with pruned (student), named as `model.named_modules()` names them; empty: the model's "
        "outputs (the logits). Paddle variable names do not carry over",
    ),
    "alpha": ActKey("float or list of float", "`1.0`", "the weight of each loss"),
    "teacher_model_dir": ActKey(
        "null",
        "`null`",
        "the teacher is the dense model of `Global` (ACT's default when unset); another teacher is refused",
    ),
    "teacher_model_filename": ActKey("null", "`null`", "as `teacher_model_dir`"),
    "teacher_params_filename": ActKey("null", "`null`", "as `teacher_model_dir`"),
}
"""``Distillation`` keys this tool reads."""

LEGACY_TRAIN_KEYS = ("optimizer", "optim_args")
"""PaddleSlim 2.3's names, read as ``optimizer_builder``."""
LEGACY_DISTILL_KEYS = {"distill_loss": "loss", "distill_node_pair": "node", "distill_lambda": "alpha"}
"""PaddleSlim 2.3's names of ``Distillation`` keys."""

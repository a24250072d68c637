"""Recovery of a pruned model: fine-tuning and distillation as ACT's ``TrainConfig`` and ``Distillation`` blocks
describe them, mapped to PyTorch."""

"""Small models for tests, loaded by path as ``tests/tiny_models.py:<name>`` (like a user's own model file)."""

from __future__ import annotations

from torch import nn


def tiny_cnn(num_classes: int = 10, width: int = 8) -> nn.Module:
    """conv-BN-ReLU x2, global pool, linear: enough structure to load, run and evaluate quickly."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


class NotAModel:
    """A callable that returns something other than an nn.Module."""

    def __call__(self) -> str:
        return "not a model"


def not_a_model() -> str:
    """Returns a string, which the loader must refuse."""
    return "not a model"

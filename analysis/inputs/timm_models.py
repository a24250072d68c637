"""timm models: ``Global.arch: timm/<model name>`` builds ``timm.create_model(name, pretrained=False)``; weights come
from ``Global.model_dir`` (a ``state_dict`` file, or ``model.safetensors`` as the Hugging Face hub stores it).

timm and safetensors are an optional extra (``pip install -e ".[timm]"``); nothing here downloads.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from analysis.errors import ModelError, did_you_mean

TIMM_PREFIX = "timm/"
HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""What a Hugging Face hub folder holds the weights in, in the order they are looked for."""
INSTALL_HINT = 'pip install -e ".[timm]"'


def is_timm_arch(arch: str | None) -> bool:
    """Whether ``Global.arch`` names a timm model (``timm/<name>``)."""
    return arch is not None and arch.startswith(TIMM_PREFIX)


def optional_module(name: str, what: str) -> ModuleType:
    """Import an optional dependency, or say in one sentence how to install it.

    Raises:
        ModelError: The module is not installed.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ModelError(f"{what} needs the {name} package, which is not installed; {INSTALL_HINT}.") from None


def timm_model_name(arch: str) -> str:
    """The timm name of a ``timm/<name>`` arch (with its pretrained tag, e.g. ``resnet50.a1_in1k``).

    Raises:
        ModelError: timm is missing or has no such model.
    """
    name = arch.removeprefix(TIMM_PREFIX)
    timm = optional_module("timm", f"Global.arch {arch}")
    if not timm.is_model(name):
        architecture = name.partition(".")[0]
        raise ModelError(
            f"Global.arch {arch}: timm {timm.__version__} has no model '{name}'"
            f"{did_you_mean(architecture, timm.list_models())}; see timm.list_models()."
        )
    return name


def create_timm_model(arch: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build ``timm/<name>`` with random weights (``pretrained=False``) and ``kwargs`` (e.g. ``num_classes``).

    Raises:
        ModelError: timm is missing, has no such model, or ``kwargs`` do not fit it.
    """
    name = timm_model_name(arch)
    timm = optional_module("timm", f"Global.arch {arch}")
    try:
        model: nn.Module = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as error:
        raise ModelError(f"Global.arch_kwargs do not fit {arch}: {error}.") from None
    return model


def hub_weights(folder: Path) -> Path | None:
    """The weights file of a Hugging Face hub folder (``model.safetensors``, else ``pytorch_model.bin``), if any."""
    return next((folder / name for name in HUB_WEIGHT_FILES if (folder / name).is_file()), None)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file (a format that holds tensors only, never code).

    Raises:
        ModelError: safetensors is missing or the file is not a valid safetensors file.
    """
    safetensors_torch = optional_module("safetensors.torch", f"Reading {path}")
    try:
        tensors: dict[str, torch.Tensor] = safetensors_torch.load_file(str(path), device="cpu")
    except Exception as error:  # the library raises its own SafetensorError for damaged files
        raise ModelError(f"{path} is not a readable safetensors file ({type(error).__name__}: {error}).") from None
    return tensors

"""Pick the torch device named by ``Global.device``."""

from __future__ import annotations

import torch
from torch import nn

from analysis.errors import ConfigError


def resolve_device(spec: str = "auto") -> torch.device:
    """Return the device for ``auto`` (first GPU if any, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

    Raises:
        ConfigError: If the requested accelerator is not available on this machine.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"Global.device is '{spec}' but no CUDA GPU is available; use Global.device=auto or cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"Global.device is '{spec}' but only {torch.cuda.device_count()} GPU(s) are visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})."
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("Global.device is 'mps' but Apple's MPS backend is not available; use auto or cpu.")
    return device


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model without tensors."""
    tensor: torch.Tensor | None = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def is_out_of_memory(error: BaseException) -> bool:
    """True for a failed allocation (CPU or GPU): the machine's limit, which says nothing about the model's units."""
    text = str(error)
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)
    )

"""Content fingerprints: which model weights, data and preprocessing an analysis file's numbers came from."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of every tensor in the state_dict."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def json_fingerprint(value: Any) -> str:
    """SHA-256 of a JSON-serialisable description (sorted keys), e.g. the evaluated samples and preprocessing."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()

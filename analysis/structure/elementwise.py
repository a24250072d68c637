"""Element-wise (fine-grained) sensitivity, Distiller's ``--sense=element``: zero a fraction of one weight's
individual elements, the smallest in magnitude, and leave everything else untouched.

Any 2D or 4D parameter is a candidate (conv kernels of every kind, linear layers including the classifier). At
ratio ``r`` the ``min(N - 1, round(N * r))`` elements of smallest ``|w|`` are zeroed (ties: lower flat index
first), so the count is exact; Distiller's threshold rule zeroes every element tied with the threshold as well,
which differs only when weights repeat. Zeroing is the operation itself, so the masked model is the pruned model.
"""

from __future__ import annotations

import torch
from torch import nn

from analysis.structure.criteria import channels_to_remove
from analysis.structure.groups import PrunableUnit
from analysis.structure.masking import Slice

ELEMENT_DIMS = (2, 4)


def element_params(model: nn.Module) -> list[PrunableUnit]:
    """Every 2D/4D parameter of ``model`` (``named_parameters`` order), as element-wise pruning candidates."""
    params = []
    for name, weight in model.named_parameters():
        if weight.dim() not in ELEMENT_DIMS:
            continue
        module_name = name.rpartition(".")[0]
        reason = None if weight.numel() > 1 else "has a single element"
        kind = "linear" if weight.dim() == 2 else "conv"
        params.append(PrunableUnit(name, module_name, tuple(weight.shape), reason, kind=kind))
    return params


def weights_to_zero(numel: int, ratio: float) -> int:
    """How many elements ratio ``ratio`` zeroes: ``min(N - 1, round(N * r))``, as for channels."""
    return channels_to_remove(numel, ratio)


def magnitude_order(weight: torch.Tensor) -> torch.Tensor:
    """Flat indices of ``weight`` by increasing ``|w|`` (stable: ties keep index order), on the CPU."""
    return torch.argsort(weight.detach().abs().flatten().float().cpu(), stable=True)


def element_slices(weight: torch.Tensor, flat_indices: torch.Tensor) -> list[Slice]:
    """The ``(tensor, index)`` slice zeroing ``flat_indices`` of ``weight``, for
    :func:`analysis.structure.masking.zeroed`."""
    index = torch.unravel_index(flat_indices.to(weight.device), tuple(weight.shape))
    return [(weight.data, index)]

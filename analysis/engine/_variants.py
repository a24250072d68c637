"""A param made ready to evaluate: its layer, the channels (or weights) each ratio removes, how they are removed,
and the slices a variant zeroes; one preparation per granularity (filters of a coupled group, or single weights)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch_pruning as tp
from torch import nn

from analysis.engine._modes import ModeCheck
from analysis.engine.batchnorm import BatchNorm
from analysis.structure.elementwise import element_slices, magnitude_order, weights_to_zero
from analysis.structure.flops import CostSummary
from analysis.structure.groups import PrunableUnit, full_group, removal_group
from analysis.structure.masking import Slice, zeroed, zeroed_slices


@dataclass
class Prepared:
    """A param ready to evaluate: its layer, the channels each ratio removes, how (mask/physical/element), and the
    names its results are recorded under (several when coupled params share the evaluation).

    With ``granularity: element`` the layer is the weight's module, ``removal[ratio]`` is ``range(k)`` and the
    weights zeroed are the first ``k`` of ``element_order`` (ascending magnitude)."""

    param: PrunableUnit
    conv: nn.Module
    removal: dict[float, Sequence[int]]
    mode: str
    names: list[str]
    check: ModeCheck
    costs: dict[float, CostSummary] = field(default_factory=dict)
    element_order: torch.Tensor | None = None
    batchnorms: list[BatchNorm] = field(default_factory=list)

    @property
    def element(self) -> bool:
        """Whether single weights (not channels) are removed."""
        return self.element_order is not None

    @property
    def size(self) -> int:
        """What a ratio is a fraction of: the param's output channels, or its weights (element-wise)."""
        return math.prod(self.param.shape) if self.element else self.param.channels


def prepare_elements(
    model: nn.Module, param: PrunableUnit, ratios: Sequence[float], check_input: torch.Tensor
) -> Prepared:
    """Element-wise: order the weights by magnitude; zeroing them is the operation itself, so it is exact."""
    module = model.get_submodule(param.module_name)
    weight = model.get_parameter(param.name)
    order = magnitude_order(weight)
    removal: dict[float, Sequence[int]] = {r: range(weights_to_zero(weight.numel(), r)) for r in ratios}
    largest = max(removal.values(), key=len)
    with zeroed(element_slices(weight, order[: len(largest)])), torch.inference_mode():
        masked_logits = model(check_input)
    check = ModeCheck("element", 0.0, largest, masked_logits)
    return Prepared(param, module, removal, "element", [param.name], check, element_order=order)


def variant_slices(model: nn.Module, graph: tp.DependencyGraph, prepared: Prepared, ratio: float) -> list[Slice]:
    """The ``(tensor, index)`` slices zeroed by one variant (a channel group, or the smallest weights)."""
    if prepared.element_order is not None:
        weight = model.get_parameter(prepared.param.name)
        return element_slices(weight, prepared.element_order[: len(prepared.removal[ratio])])
    return zeroed_slices(graph, removal_group(graph, prepared.conv, prepared.removal[ratio]))


def changed_layers(
    model: nn.Module, graph: tp.DependencyGraph, prepared: Prepared
) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """The modules and bare parameters a variant of ``prepared`` changes (where the fast engine's suffix starts)."""
    if prepared.element_order is not None:
        return [prepared.conv], [model.get_parameter(prepared.param.name)]
    members = [item.dep.target.module for item in full_group(graph, prepared.conv)]
    return [m for m in members if isinstance(m, nn.Module)], [m for m in members if isinstance(m, nn.Parameter)]

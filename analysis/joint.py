"""Measuring a whole plan: every planned group removed at once, BatchNorm re-estimated, the model evaluated.

Single-layer sensitivities predict a plan's loss by adding them up, which is wrong in both directions once many
layers are pruned together. :class:`JointEvaluator` measures instead: it zeroes the slices of every planned group
at once (masking equals removal for BatchNorm CNNs, as for single groups; with a channel-normalising layer in any
analysed group it prunes a physical copy instead), re-estimates the statistics of the BatchNorm layers the removals
change on calibration images (:mod:`analysis.batchnorm`), evaluates, and restores the model bit-exactly. Removal
slices, affected layers and exact joint costs are cached per (group, channel count), so a search that evaluates
many neighbouring plans pays for the forward passes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from analysis.batchnorm import changed_sources, downstream_batchnorms, recalibrate_copy, reestimated
from analysis.flops import Cost
from analysis.groups import removal_group
from analysis.masking import zeroed, zeroed_slices
from analysis.physical import jointly_pruned_copy

Pick = tuple[str, int]
"""How one group is pruned: the member whose criterion ranks the channels, and how many channels it removes."""
Selection = Mapping[str, Pick]
"""A plan as the search sees it: group key (its first member) -> pick (count 0: not pruned)."""


@dataclass(frozen=True)
class JointScore:
    """What one joint evaluation measured: the metrics of the jointly pruned model and its exact cost."""

    metrics: dict[str, float]
    macs: int
    params: int
    seconds: float


class JointEvaluator:
    """Evaluates selections of per-group picks jointly, with BatchNorm re-estimation when calibration batches are
    given.

    Args:
        planner: The :class:`~analysis.plan.Planner` of the model (graph, costs, channel rankings).
        evaluate: Metrics of a model on the scoring data.
        calibration: Batches for BatchNorm re-estimation (None: the dense model's statistics are kept).
        physical: Prune physical copies instead of masking (some analysed group needs it).
    """

    def __init__(
        self,
        planner: Any,
        evaluate: Callable[[nn.Module], Mapping[str, float]],
        calibration: Iterable[Any] | None,
        physical: bool = False,
    ) -> None:
        self.planner = planner
        self.evaluate = evaluate
        self.calibration = calibration
        self.physical = physical
        self._groups: dict[Pick, Any] = {}
        self._slices: dict[Pick, list[tuple[torch.Tensor, Any]]] = {}
        self._sources: dict[Pick, list[Any]] = {}

    def removals(self, selection: Selection) -> list[tuple[str, list[int]]]:
        """``(conv module name, channels)`` of every pruned group of ``selection``, for physical pruning."""
        return [
            (self.planner.by_name[param].module_name, self.planner.removed(param, count))
            for param, count in selection.values()
            if count
        ]

    def cost(self, selection: Selection) -> Cost:
        """The exact cost of the model with every group of ``selection`` pruned at once."""
        return self.planner.picks_cost(selection.values())

    def score(self, selection: Selection) -> JointScore:
        """Evaluate the model with every group of ``selection`` pruned at once (BatchNorm re-estimated)."""
        start = time.perf_counter()
        pruned = [pick for pick in selection.values() if pick[1]]
        model = self.planner.model
        if self.physical:
            copy = jointly_pruned_copy(model, self.removals(selection), self.planner.example_input)
            if self.calibration is not None:
                recalibrate_copy(model, copy, self.removals(selection), self.planner.example_input, self.calibration)
            metrics = dict(self.evaluate(copy))
        else:
            slices = [piece for pick in pruned for piece in self._slices_of(pick)]
            sources: list[Any] = []
            for pick in pruned:
                sources.extend(m for m in self._sources_of(pick) if m not in sources)
            layers = downstream_batchnorms(self.planner.graph, sources) if self.calibration is not None else []
            with zeroed(slices), reestimated(model, layers, self.calibration or ()):
                metrics = dict(self.evaluate(model))
        cost = self.cost(selection)
        return JointScore(metrics, cost.macs, cost.params, time.perf_counter() - start)

    def _group(self, pick: Pick) -> Any:
        if pick not in self._groups:
            param, count = pick
            conv = self.planner.model.get_submodule(self.planner.by_name[param].module_name)
            self._groups[pick] = removal_group(self.planner.graph, conv, self.planner.removed(param, count))
        return self._groups[pick]

    def _slices_of(self, pick: Pick) -> list[tuple[torch.Tensor, Any]]:
        if pick not in self._slices:
            self._slices[pick] = zeroed_slices(self.planner.graph, self._group(pick))
        return self._slices[pick]

    def _sources_of(self, pick: Pick) -> list[Any]:
        if pick not in self._sources:
            self._sources[pick] = changed_sources(self.planner.graph, self._group(pick))
        return self._sources[pick]

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from analysis.batchnorm import changed_sources, downstream_batchnorms, recalibrate_copy, reestimated
from analysis.flops import Cost
from analysis.groups import removal_group
from analysis.masking import zeroed, zeroed_slices
from analysis.physical import jointly_pruned_copy
from analysis.ratios import Choice, GroupOptions

Selection = Mapping[str, int]
"""Channels removed per group: group key (its first member) -> count (0: not pruned)."""


@dataclass(frozen=True)
class JointScore:
    """What one joint evaluation measured: the metrics of the jointly pruned model and its exact cost."""

    metrics: dict[str, float]
    macs: int
    params: int
    seconds: float


class JointEvaluator:
    """Evaluates selections of per-group channel counts jointly, with BatchNorm re-estimation when calibration
    batches are given.

    Args:
        planner: The :class:`~analysis.plan.Planner` of the model (graph, costs, channel rankings).
        options: The groups and their choices (which member ranks the channels at each count).
        evaluate: Metrics of a model on the scoring data.
        calibration: Batches for BatchNorm re-estimation (None: the dense model's statistics are kept).
        physical: Prune physical copies instead of masking (some analysed group needs it).
    """

    def __init__(
        self,
        planner: Any,
        options: Sequence[GroupOptions],
        evaluate: Callable[[nn.Module], Mapping[str, float]],
        calibration: Iterable[Any] | None,
        physical: bool = False,
    ) -> None:
        self.planner = planner
        self.options = {group.key: group for group in options}
        self.evaluate = evaluate
        self.calibration = calibration
        self.physical = physical
        self._choices = {key: {choice.count: choice for choice in group.choices} for key, group in self.options.items()}
        self._groups: dict[tuple[str, int], Any] = {}
        self._slices: dict[tuple[str, int], list[tuple[torch.Tensor, Any]]] = {}
        self._sources: dict[tuple[str, int], list[Any]] = {}
        self._costs: dict[tuple[tuple[str, int], ...], Cost] = {}

    def choice(self, key: str, count: int) -> Choice:
        """The option of group ``key`` that removes ``count`` channels."""
        return self._choices[key][count]

    def removals(self, selection: Selection) -> list[tuple[str, list[int]]]:
        """``(conv module name, channels)`` of every pruned group of ``selection``, for physical pruning."""
        pruned = []
        for key, count in selection.items():
            if count:
                choice = self.choice(key, count)
                module = self.planner.by_name[choice.param].module_name
                pruned.append((module, self.planner.removed(choice.param, count)))
        return pruned

    def cost(self, selection: Selection) -> Cost:
        """The exact cost of the model with every group of ``selection`` pruned at once."""
        pruned = tuple(sorted((key, count) for key, count in selection.items() if count))
        if pruned not in self._costs:
            items = [item for key, count in pruned for item in self._group(key, count)]
            self._costs[pruned] = self.planner.costs.group_cost(self.planner.graph, items)
        return self._costs[pruned]

    def score(self, selection: Selection) -> JointScore:
        """Evaluate the model with every group of ``selection`` pruned at once (BatchNorm re-estimated)."""
        start = time.perf_counter()
        pruned = [(key, count) for key, count in selection.items() if count]
        model = self.planner.model
        if self.physical:
            copy = jointly_pruned_copy(model, self.removals(selection), self.planner.example_input)
            if self.calibration is not None:
                recalibrate_copy(model, copy, self.removals(selection), self.planner.example_input, self.calibration)
            metrics = dict(self.evaluate(copy))
        else:
            slices = [piece for key, count in pruned for piece in self._slices_of(key, count)]
            sources: list[Any] = []
            for key, count in pruned:
                sources.extend(m for m in self._sources_of(key, count) if m not in sources)
            layers = downstream_batchnorms(self.planner.graph, sources) if self.calibration is not None else []
            with zeroed(slices), reestimated(model, layers, self.calibration or ()):
                metrics = dict(self.evaluate(model))
        cost = self.cost(selection)
        return JointScore(metrics, cost.macs, cost.params, time.perf_counter() - start)

    def _group(self, key: str, count: int) -> Any:
        if (key, count) not in self._groups:
            choice = self.choice(key, count)
            conv = self.planner.model.get_submodule(self.planner.by_name[choice.param].module_name)
            self._groups[(key, count)] = removal_group(
                self.planner.graph, conv, self.planner.removed(choice.param, count)
            )
        return self._groups[(key, count)]

    def _slices_of(self, key: str, count: int) -> list[tuple[torch.Tensor, Any]]:
        if (key, count) not in self._slices:
            self._slices[(key, count)] = zeroed_slices(self.planner.graph, self._group(key, count))
        return self._slices[(key, count)]

    def _sources_of(self, key: str, count: int) -> list[Any]:
        if (key, count) not in self._sources:
            self._sources[(key, count)] = changed_sources(self.planner.graph, self._group(key, count))
        return self._sources[(key, count)]

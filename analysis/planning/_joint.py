"""Measuring a whole plan: every planned group removed at once, BatchNorm re-estimated, the model evaluated.

Single-layer sensitivities predict a plan's loss by adding them up, which is wrong in both directions once many
layers are pruned together. :class:`JointEvaluator` measures instead: it zeroes the slices of every planned group
at once (masking equals removal for BatchNorm CNNs, as for single groups; with a channel-normalising layer in any
analysed group it prunes a physical copy instead), re-estimates the statistics of the BatchNorm layers the removals
change on calibration images (:mod:`analysis.engine.batchnorm`), evaluates, and restores the model bit-exactly.

A search evaluates plans that differ from its current plan in two groups. Everything before the first layer those
groups touch computes exactly what it computed for the current plan (same weights, same inputs, the same
re-estimated statistics, which depend only on their inputs), so the evaluator keeps the current plan's values at
the graph's cut points (nodes every path runs through, :meth:`~analysis.engine.partition.GraphRunner.cut_points`) for
every calibration and scoring batch, within a memory budget, and runs a candidate from the latest cut point before
its first change. The numbers are bit-identical to a full run (tested). Removal slices, affected layers and exact
joint costs are cached per (group, channel count).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from analysis.engine.batchnorm import (
    batch_images,
    changed_sources,
    count_images,
    downstream_batchnorms,
    estimation_pass,
    recalibrate_copy,
    reestimated,
)
from analysis.engine.evaluate import MetricSums, evaluate
from analysis.engine.partition import GraphRunner, UntraceableModel
from analysis.io.search_log import JointScore, Pick
from analysis.structure.flops import Cost
from analysis.structure.groups import full_group, removal_group
from analysis.structure.masking import zeroed, zeroed_slices
from analysis.structure.physical import jointly_pruned_copy

if TYPE_CHECKING:
    from analysis.planning.plan import Planner

logger = logging.getLogger(__name__)

PlanSelection = Mapping[str, Pick]
"""A plan as the search sees it: group key (its first member) -> pick (count 0: not pruned)."""
Batches = Sequence[Any]

PREFIX_CACHE_BYTES = 2 * 1024**3  # activations kept per plan (the current plan and the last one measured)


@dataclass
class _Values:
    """A plan's values at the kept cut points: per pass (``calibration``, ``data``), per cut point, per batch."""

    selection: dict[str, Pick]
    start: fx.Node | None
    passes: dict[str, dict[fx.Node, list[Any]]] = field(default_factory=dict)


class JointEvaluator:
    """Evaluates selections of per-group picks jointly, with BatchNorm re-estimation when calibration batches are
    given.

    Args:
        planner: The :class:`~analysis.planning.plan.Planner` of the model (graph, costs, channel rankings).
        groups: The group keys (each group's first member) selections use.
        data: The scoring batches ``(images, labels)``, iterated in the same order every time.
        calibration: Batches for BatchNorm re-estimation (None: the dense model's statistics are kept).
        physical: Prune physical copies instead of masking (some analysed group needs it); no prefix reuse.
        cache_bytes: Memory for kept activations per plan (0: always run the whole network).
    """

    def __init__(
        self,
        planner: Planner,
        groups: Sequence[str],
        data: Iterable[Any],
        calibration: Iterable[Any] | None,
        physical: bool = False,
        cache_bytes: int = PREFIX_CACHE_BYTES,
    ) -> None:
        self.planner = planner
        self.groups = list(groups)
        self.data = data
        self.calibration = calibration
        self.physical = physical
        self._groups: dict[Pick, Any] = {}
        self._slices: dict[Pick, list[tuple[torch.Tensor, Any]]] = {}
        self._sources: dict[Pick, list[Any]] = {}
        self.runner = None if physical or cache_bytes <= 0 else _runner(planner.model)
        self.cuts: list[fx.Node] = []
        self._first_change: dict[str, int] = {}
        self.anchor: _Values | None = None  # the plan later candidates start from
        self.last: _Values | None = None  # the last plan measured (it may become the anchor)
        self.cache_bytes = cache_bytes

    # ------------------------------------------------------------------------------------------------- costs

    def removals(self, selection: PlanSelection) -> list[tuple[str, list[int]]]:
        """``(conv module name, channels)`` of every pruned group of ``selection``, for physical pruning."""
        return self.planner.removals(selection.values())

    def cost(self, selection: PlanSelection) -> Cost:
        """The exact cost of the model with every group of ``selection`` pruned at once."""
        return self.planner.picks_cost(selection.values())

    # --------------------------------------------------------------------------------------------- evaluation

    def score(self, selection: PlanSelection) -> JointScore:
        """Evaluate the model with every group of ``selection`` pruned at once (BatchNorm re-estimated)."""
        start = time.perf_counter()
        if self.physical:
            metrics = self._score_physical(selection)
        elif self.runner is None:
            metrics = self._score_masked(selection)
        else:
            metrics = self._score_from_cut(selection)
        cost = self.cost(selection)
        return JointScore(metrics, cost.macs, cost.params, time.perf_counter() - start)

    def adopt(self, selection: PlanSelection) -> None:
        """Make ``selection`` the plan later candidates start from (its values are kept when it was the last plan
        measured; otherwise they are computed at the next evaluation)."""
        if self.runner is None:
            return
        if self.last is not None and self.last.selection == dict(selection):
            self.anchor = self._merged(self.last)
        else:
            self.anchor = _Values(dict(selection), None)  # values missing: the next score fills them first

    def _score_physical(self, selection: PlanSelection) -> dict[str, float]:
        model, example = self.planner.model, self.planner.example_input
        copy = jointly_pruned_copy(model, self.removals(selection), example)
        if self.calibration is not None:
            recalibrate_copy(model, copy, self.removals(selection), example, self.calibration)
        return evaluate(copy, self.data, progress=False).metrics()

    def _score_masked(self, selection: PlanSelection) -> dict[str, float]:
        """The whole network, for every batch (no graph to start from a cut point)."""
        slices, layers = self._masks(selection)
        with zeroed(slices), reestimated(self.planner.model, layers, self.calibration or ()):
            return evaluate(self.planner.model, self.data, progress=False).metrics()

    def _score_from_cut(self, selection: PlanSelection) -> dict[str, float]:
        assert self.runner is not None
        if not self.cuts:
            self._choose_cuts()
        if self.anchor is not None and self.anchor.start is None and not self.anchor.passes:
            anchor = self.anchor.selection  # adopted without values: measure it once to keep them
            self._run(anchor, self.runner.nodes[0])
            self.anchor = self._merged(self.last) if self.last is not None else None
        return self._run(dict(selection), self._start(selection))

    def _run(self, selection: dict[str, Pick], cut: fx.Node) -> dict[str, float]:
        """Run ``selection`` from ``cut`` for every calibration and scoring batch, keeping the later cut values."""
        assert self.runner is not None
        runner, plan = self.runner, self.runner.tail(cut)
        later = [c for c in self.cuts if runner.index[c] > runner.index[cut]]
        values = _Values(selection, cut, {"calibration": {c: [] for c in later}, "data": {c: [] for c in later}})
        slices, layers = self._masks(selection)
        sums = MetricSums()
        with zeroed(slices), estimation_pass(layers) as finish, torch.no_grad():
            for index, batch in enumerate(self.calibration or ()):
                runner.run_suffix(plan, {cut: self._value("calibration", cut, index, batch_images(batch))},
                                  values.passes["calibration"])  # fmt: skip
            finish()
            for index, (images, labels) in enumerate(self.data):
                logits = runner.run_suffix(plan, {cut: self._value("data", cut, index, images)}, values.passes["data"])
                sums.add(logits, labels)
        self.last = values
        return sums.result().metrics()

    def _value(self, kind: str, cut: fx.Node, index: int, images: torch.Tensor) -> Any:
        if cut.op == "placeholder":
            return images
        assert self.anchor is not None
        return self.anchor.passes[kind][cut][index]

    def _start(self, selection: PlanSelection) -> fx.Node:
        """The latest kept cut point before the first layer ``selection`` changes against the anchor."""
        assert self.runner is not None
        anchor = self.anchor
        if anchor is None or not anchor.passes:
            return self.runner.nodes[0]
        changed = [key for key in set(selection) | set(anchor.selection)
                   if selection.get(key, (key, 0)) != anchor.selection.get(key, (key, 0))]  # fmt: skip
        first = min((self._first_change[key] for key in changed), default=len(self.runner.nodes))
        usable = [cut for cut in self.cuts if self.runner.index[cut] < first and cut in anchor.passes["data"]]
        return usable[-1] if usable else self.runner.nodes[0]

    def _merged(self, values: _Values) -> _Values:
        """``values`` completed with the anchor's values before its start (identical there)."""
        passes = {kind: dict(cuts) for kind, cuts in values.passes.items()}
        if self.anchor is not None and values.start is not None and values.start.op != "placeholder":
            assert self.runner is not None
            for kind in passes:
                for cut, kept in self.anchor.passes.get(kind, {}).items():
                    if self.runner.index[cut] <= self.runner.index[values.start]:
                        passes[kind][cut] = kept
        return _Values(values.selection, values.start, passes)

    def _choose_cuts(self) -> None:
        """Keep, within the memory budget, the latest cut point before each group's first layer (the later ones
        first: they are smaller and save more)."""
        assert self.runner is not None
        runner, graph, model = self.runner, self.planner.graph, self.planner.model
        for key in self.groups:
            conv = model.get_submodule(self.planner.by_name[key].module_name)
            members = [item.dep.target.module for item in full_group(graph, conv)]
            plan = runner.plan([m for m in members if isinstance(m, nn.Module)],
                               [m for m in members if isinstance(m, nn.Parameter)])  # fmt: skip
            self._first_change[key] = runner.index[plan.nodes[0]] if plan is not None else len(runner.nodes)
        cuts = runner.cut_points()[1:]
        latest = (max((c for c in cuts if runner.index[c] < first), key=runner.index.__getitem__, default=None)
                  for first in self._first_change.values())  # fmt: skip
        wanted = {cut for cut in latest if cut is not None}
        sizes = _bytes_per_image(runner, self.planner.example_input[:1], wanted)
        images = count_images(self.calibration) + count_images(self.data)
        budget, kept = self.cache_bytes, []
        for cut in sorted(wanted, key=runner.index.__getitem__, reverse=True):
            if sizes[cut] * images <= budget:
                kept.append(cut)
                budget -= sizes[cut] * images
        self.cuts = sorted(kept, key=runner.index.__getitem__)
        logger.debug("Joint evaluations keep values at %d cut point(s).", len(self.cuts))

    def _masks(self, selection: PlanSelection) -> tuple[list[tuple[torch.Tensor, Any]], list[Any]]:
        """The slices to zero and the BatchNorm layers to re-estimate for ``selection``."""
        pruned = [pick for pick in selection.values() if pick[1]]
        slices = [piece for pick in pruned for piece in self._slices_of(pick)]
        if self.calibration is None:
            return slices, []
        sources: list[Any] = []
        for pick in pruned:
            sources.extend(m for m in self._sources_of(pick) if m not in sources)
        return slices, downstream_batchnorms(self.planner.graph, sources)

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


def _runner(model: nn.Module) -> GraphRunner | None:
    try:
        return GraphRunner(model)
    except UntraceableModel as error:
        logger.info("torch.fx cannot trace this model (%s); joint evaluations run the whole network.", error)
        return None


def _bytes_per_image(runner: GraphRunner, example: torch.Tensor, nodes: set[fx.Node]) -> dict[fx.Node, int]:
    """The memory one image's value takes at each of ``nodes`` (one pass over ``example``)."""
    sizes: dict[fx.Node, int] = {}
    capture: dict[fx.Node, list[Any]] = {node: [] for node in nodes}
    with torch.inference_mode():
        runner.run_suffix(runner.tail(runner.nodes[0]), {runner.nodes[0]: example}, capture)
    for node, values in capture.items():
        tensor = values[0] if values else None
        sizes[node] = tensor.numel() * tensor.element_size() // len(example) if isinstance(tensor, torch.Tensor) else 0
    return sizes

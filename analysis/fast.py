"""The fast engine: same variants and numbers as the reference engine, far fewer computations.

Per batch, the unmodified model runs once (as a torch.fx graph) just far enough to produce every analysed param's
frontier; each (param, ratio) variant then runs only the part of the graph its removal can change (see
:mod:`analysis.partition`). Params are processed in chunks of a few minutes of work, each chunk one pass over the
(cached) data, and every chunk's results are saved before the next starts. Before that, every param's split is
run on a few images and compared with a full masked forward pass; a param whose logits are not bit-identical
(the graph split would not reproduce eager execution) is evaluated by the reference path instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from tqdm.auto import tqdm

from analysis.engine import EngineReport, EngineSettings, Evaluator, Prepared, SensitivityEngine
from analysis.evaluate import MetricSums
from analysis.groups import PrunableParam, full_group, removal_group
from analysis.masking import zeroed, zeroed_slices
from analysis.partition import GraphRunner, SuffixPlan, UntraceableModel
from analysis.store import AnalysisStore

logger = logging.getLogger(__name__)

CHUNK_SECONDS = 300.0  # estimated work per pass over the data; results are saved after each pass


@dataclass
class Variant:
    """One (param, ratio) in flight: the slices to zero and the metric sums gathered over batches."""

    ratio: float
    slices: list[tuple[torch.Tensor, Any]]
    sums: MetricSums = field(default_factory=MetricSums)


@dataclass
class Job:
    """A prepared param with its suffix plan and its pending variants."""

    prepared: Prepared
    plan: SuffixPlan
    variants: list[Variant]


class FastSensitivityEngine(SensitivityEngine):
    """Evaluates variants on graph suffixes; needs the data as re-iterable ``(images, labels)`` batches."""

    def __init__(
        self,
        model: nn.Module,
        evaluate: Evaluator,
        example_input: torch.Tensor,
        graph: tp.DependencyGraph,
        settings: EngineSettings,
        store: AnalysisStore,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        super().__init__(model, evaluate, example_input, graph, settings, store)
        self.batches = batches
        self.runner: GraphRunner | None = None

    def run(self, params: Sequence[PrunableParam]) -> EngineReport:
        """Like :meth:`SensitivityEngine.run`; falls back to it for a model torch.fx cannot trace."""
        try:
            self.runner = GraphRunner(self.model)
        except UntraceableModel as error:
            logger.info("torch.fx cannot trace this model (%s); using the reference engine.", error)
            return super().run(params)
        return super().run(params)

    def _run_params(self, params: Sequence[PrunableParam], pending: dict[str, list[float]], baseline: dict,
                    report: EngineReport, bar: tqdm) -> None:  # fmt: skip
        if self.runner is None:
            super()._run_params(params, pending, baseline, report, bar)
            return
        self.runner.profile(self.check_input, repeats=1)
        jobs: list[Job] = []
        for param in params:
            ratios = [r for r in pending[param.name] if not self.store.has(param.name, r)]
            bar.update(len(pending[param.name]) - len(ratios))  # units filled in by a coupled param
            if not ratios:
                continue
            prepared = self._prepare(param, ratios, report, bar)
            if prepared is None:
                continue
            job = self._job(prepared, ratios, baseline, report, bar)
            if job is not None:
                jobs.append(job)
        for chunk in self._chunks(jobs, float(baseline.get("seconds", 1.0))):
            self._run_chunk(chunk, baseline, report, bar)

    def _job(self, prepared: Prepared, ratios: Sequence[float], baseline: dict, report: EngineReport,
             bar: tqdm) -> Job | None:  # fmt: skip
        """Plan a masked param's suffix; physical params and variants removing nothing are done right away."""
        assert self.runner is not None
        if prepared.mode != "mask":
            self._evaluate_ratios(prepared, ratios, baseline, report, bar)
            return None
        members = [item.dep.target.module for item in full_group(self.graph, prepared.conv)]
        plan = self.runner.plan(
            [m for m in members if isinstance(m, nn.Module)], [m for m in members if isinstance(m, nn.Parameter)]
        )
        if plan is None:
            self._evaluate_ratios(prepared, ratios, baseline, report, bar)
            return None
        variants: list[Variant] = []
        for ratio in ratios:
            channels = prepared.removal[ratio]
            if not channels:
                self._record(prepared, ratio, {k: v for k, v in baseline.items() if k != "seconds"}, baseline, 0.0,
                             report, bar)  # fmt: skip
                continue
            slices = zeroed_slices(self.graph, removal_group(self.graph, prepared.conv, channels))
            variants.append(Variant(ratio, slices))
        checked = next((v for v in variants if prepared.removal[v.ratio] == prepared.check.channels), None)
        if checked is not None and not self._split_matches_eager(plan, checked, prepared):
            logger.info("%s: the graph split differs from eager execution; using the reference path for it.",
                        prepared.param.name)  # fmt: skip
            self._evaluate_ratios(prepared, [v.ratio for v in variants], baseline, report, bar)
            return None
        return Job(prepared, plan, variants) if variants else None

    def _split_matches_eager(self, plan: SuffixPlan, variant: Variant, prepared: Prepared) -> bool:
        """Whether the suffix run gives bit-identical logits to the full masked forward pass of the mode check."""
        assert self.runner is not None and prepared.check.masked_logits is not None
        runner, logits = self.runner, {}

        def visit(plan: SuffixPlan, frontier: dict) -> None:
            with zeroed(variant.slices):
                logits["suffix"] = runner.run_suffix(plan, frontier)

        with torch.inference_mode():
            runner.walk(self.check_input, runner.schedule([plan]), visit)
        return torch.equal(logits["suffix"], prepared.check.masked_logits)

    def _evaluate_ratios(self, prepared: Prepared, ratios: Sequence[float], baseline: dict, report: EngineReport,
                         bar: tqdm) -> None:  # fmt: skip
        """The reference path for one prepared param (physical mode, or a split that did not reproduce eager)."""
        for ratio in ratios:
            if self.store.has(prepared.param.name, ratio):
                continue
            start = time.perf_counter()
            channels = prepared.removal[ratio]
            metrics = self._evaluate_variant(prepared.param, prepared.conv, channels, prepared.mode)
            self._record(prepared, ratio, metrics, baseline, time.perf_counter() - start, report, bar)

    def _chunks(self, jobs: list[Job], baseline_seconds: float) -> list[list[Job]]:
        """Group jobs (in model order) so that each pass over the data is about ``CHUNK_SECONDS`` of work."""
        assert self.runner is not None
        total = sum(self.runner.node_cost.values()) or 1.0
        chunks: list[list[Job]] = [[]]
        estimate = 0.0
        for job in jobs:
            cost = baseline_seconds * len(job.variants) * job.plan.cost / total
            if chunks[-1] and estimate + cost > CHUNK_SECONDS:
                chunks.append([])
                estimate = 0.0
            chunks[-1].append(job)
            estimate += cost
        return [chunk for chunk in chunks if chunk]

    def _run_chunk(self, chunk: list[Job], baseline: dict, report: EngineReport, bar: tqdm) -> None:
        """One pass over the data for a chunk of jobs: walk each batch once, run every variant's suffix on it."""
        assert self.runner is not None
        runner = self.runner
        by_plan = {id(job.plan): job for job in chunk}
        schedule = runner.schedule([job.plan for job in chunk])
        start = time.perf_counter()
        disable = self._progress_disabled()
        total = getattr(self.batches, "num_samples", None)
        with tqdm(total=total, desc=f"{len(chunk)} conv(s)", unit="img", disable=disable, leave=False) as inner:
            for batch_images, batch_labels in self.batches:
                images = batch_images.to(self.device, non_blocking=True)
                labels = batch_labels.to(self.device, non_blocking=True)

                def visit(plan: SuffixPlan, frontier: dict, labels: torch.Tensor = labels) -> None:
                    for variant in by_plan[id(plan)].variants:
                        with zeroed(variant.slices):
                            logits = runner.run_suffix(plan, frontier)
                        variant.sums.add(logits, labels)

                with torch.inference_mode():
                    runner.walk(images, schedule, visit)
                inner.update(int(labels.numel()))
        seconds = time.perf_counter() - start
        variants = sum(len(job.variants) for job in chunk)
        for job in chunk:
            for variant in job.variants:
                metrics = variant.sums.result().metrics()
                self._record(job.prepared, variant.ratio, metrics, baseline, seconds / variants, report, bar)
        logger.debug("Chunk of %d conv(s): %d variants in %.1f s.", len(chunk), variants, seconds)

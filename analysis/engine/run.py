"""The engine a run asks for, and what a run produced (the workflow, :mod:`analysis.workflow.analyse`, runs it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch_pruning as tp
from torch import nn

from analysis.engine.executors import SuffixExecutor
from analysis.engine.partition import GraphRunner, UntraceableModel
from analysis.engine.samplers import make_sampler
from analysis.engine.sensitivity import EngineReport, SensitivityEngine
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.io.results import Sensitivities
from analysis.io.sidecar import NumericsRecord
from analysis.io.store import AnalysisStore
from analysis.structure.groups import PrunableUnit

logger = logging.getLogger(__name__)


@dataclass
class AnalysisOutcome:
    """Everything a caller may want to show after a run."""

    analysis_file: Path
    sensitivities: Sensitivities
    params: list[PrunableUnit]
    analysed: list[PrunableUnit]
    report: EngineReport
    ratios: dict[str, float] = field(default_factory=dict)
    ratios_file: Path | None = None
    early_stopped: dict[str, float] = field(default_factory=dict)
    estimated: dict[str, set[float]] = field(default_factory=dict)
    """Per unit, the ratios whose loss is an estimate (adaptive precision, decision-driven sampling)."""
    numerics: NumericsRecord | None = None
    """How the numbers were computed (their arithmetic and machines; how far a speed mode moves them)."""

    @property
    def unprunable(self) -> dict[str, str]:
        """Units that were not analysed, with the reason (structural or found while running)."""
        reasons = {p.name: p.reason for p in self.params if p.reason}
        reasons.update(self.report.skipped)
        return reasons


def make_engine(
    model: nn.Module, data: AnalysisData, graph: tp.DependencyGraph, settings: EngineSettings, store: AnalysisStore
) -> SensitivityEngine:
    """The engine ``settings`` ask for: its sampler, and with ``engine: fast`` the torch.fx suffix executor (which
    needs the data as batches and a model torch.fx can trace; otherwise every unit runs eagerly)."""
    suffix = None
    if settings.engine == "fast" and data.batches is None:
        logger.info("The fast engine needs the data as batches (not an eval function); using the reference engine.")
    elif settings.engine == "fast":
        try:
            suffix = SuffixExecutor(GraphRunner(model), data.example_input.device)
        except UntraceableModel as error:
            logger.info("torch.fx cannot trace this model (%s); using the reference engine.", error)
    sampler = make_sampler(settings, data.batches)
    return SensitivityEngine(model, data, graph, settings, store, sampler=sampler, suffix=suffix)

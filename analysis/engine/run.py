"""One whole analysis: find the prunable convs, resume the analysis file, run the engine, derive ratios.

Shared by the command line (:mod:`analysis.cli.main`) and the Python API
(:func:`analysis.compat.paddleslim.analysis_prune`), so both
write the same files: the pickle, its JSON sidecar and, with a ``target_loss``, the ratios YAML.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from analysis.engine.fast import FastSensitivityEngine
from analysis.engine.reference import EngineReport, EngineSettings, Evaluator, SensitivityEngine
from analysis.io._fingerprint import model_fingerprint
from analysis.io._lock import exclusive
from analysis.io._store import AnalysisStore, Fingerprint
from analysis.io.results import Sensitivities, ratios_path
from analysis.planning.ratios import get_ratios_by_loss, save_ratios_yaml
from analysis.scale._shards import ShardSpec, shard_params
from analysis.structure.elementwise import element_params
from analysis.structure.flops import CostModel
from analysis.structure.groups import (
    PrunableParam,
    build_dependency_graph,
    conv_execution_order,
    describe_convs,
    eval_mode,
    select_params,
)

logger = logging.getLogger(__name__)


@dataclass
class AnalysisOutcome:
    """Everything a caller may want to show after a run."""

    analysis_file: Path
    sensitivities: Sensitivities
    params: list[PrunableParam]
    analysed: list[PrunableParam]
    report: EngineReport
    ratios: dict[str, float] = field(default_factory=dict)
    ratios_file: Path | None = None
    early_stopped: dict[str, float] = field(default_factory=dict)

    @property
    def unprunable(self) -> dict[str, str]:
        """Conv weights that were not analysed, with the reason (structural or found while running)."""
        reasons = {p.name: p.reason for p in self.params if p.reason}
        reasons.update(self.report.skipped)
        return reasons  # type: ignore[return-value]


def run_analysis(
    model: nn.Module,
    evaluate: Evaluator,
    example_input: torch.Tensor,
    analysis_file: str | Path,
    settings: EngineSettings,
    prune_params: Sequence[str] | None = None,
    skip_params: Sequence[str] = (),
    target_loss: float | None = None,
    data_fingerprint: str | None = None,
    config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    names_key: str = "SensitivityAnalysis.prune_params_name",
    skip_key: str = "SensitivityAnalysis.skip_params",
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
    shard: ShardSpec | None = None,
    baseline_only: bool = False,
    baseline: Mapping[str, float] | None = None,
    calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
    calibration_fingerprint: str | None = None,
) -> AnalysisOutcome:
    """Analyse ``model`` and write the analysis file (resuming it), its sidecar and, with ``target_loss``, ratios.

    Args:
        model: The model, on the device of ``example_input`` (analysed in eval mode; its flags are restored).
        evaluate: Returns the metrics of a model, including ``settings.metric``.
        example_input: An input batch for tracing and for checking masking against physical pruning.
        analysis_file: The pickle to resume and write.
        settings: Ratios, criterion, metric and how losses are computed.
        prune_params: Conv weights to analyse (default: every prunable one).
        skip_params: Conv weights to leave out.
        target_loss: Derive per-layer ratios keeping each layer's loss under this.
        data_fingerprint: Identifies the evaluation data and preprocessing (None when unknown, e.g. a callable).
        config: The resolved configuration, stored in the sidecar.
        overwrite: Replace an existing analysis file instead of resuming it.
        names_key: How to name ``prune_params`` in error messages.
        skip_key: How to name ``skip_params`` in error messages.
        batches: The evaluation data as re-iterable batches, which the fast engine needs (``evaluate`` must compute
            its metrics over exactly these batches); without them the reference engine runs.
        shard: Analyse only this deterministic share of the params (see :mod:`analysis.scale._shards`).
        baseline_only: Measure (or reuse) the baseline and save the file, evaluating no variant.
        baseline: The unpruned model's metrics when the caller has just measured them (used unless the file holds
            a baseline already), so the engine does not evaluate it again.
        calibration: Batches of calibration images (``settings.adaptive_bn`` re-estimates BatchNorm statistics on
            them before evaluating each variant).
        calibration_fingerprint: Identifies those images and their preprocessing (part of the resume fingerprint).
    """
    with eval_mode(model), exclusive(analysis_file):  # training flags restored; one writer per analysis file
        graph = build_dependency_graph(model, example_input)
        order = conv_execution_order(model, example_input)
        element = settings.granularity == "element"
        params = element_params(model) if element else describe_convs(model, graph, order)
        analysed = select_params(params, prune_params, skip_params, key=names_key, skip_key=skip_key)
        if shard is not None:
            analysed = shard_params(analysed, CostModel(model, example_input).dense.per_module, order, shard)
        fingerprint = Fingerprint(
            model=model_fingerprint(model),
            data=data_fingerprint,
            settings={
                "criterion": settings.criterion,
                "group_reduction": settings.group_reduction,
                "metric": settings.metric,
                "metric_mode": settings.metric_mode,
                # exact and estimated losses never mix in one file
                "precision": None if settings.precision is None else [settings.precision, settings.seed],
                **({"granularity": "element"} if element else {}),  # filter files from earlier versions resume
                **({"round_to": settings.round_to} if settings.round_to > 1 else {}),
                **({"adaptive_bn": True, "calibration": calibration_fingerprint} if settings.adaptive_bn else {}),
            },
        )
        store = AnalysisStore(analysis_file, fingerprint, [p.name for p in params], overwrite=overwrite, config=config)
        if baseline is not None and store.baseline is None:
            store.set_baseline(baseline)
        for param in params:
            if param.reason:
                store.mark_unprunable(param.name, param.reason)
        logger.info(
            "%d conv weight(s): %d prunable, %d analysed; ratios %s; criterion %s.",
            len(params),
            sum(p.prunable for p in params),
            len(analysed),
            ", ".join(f"{r:g}" for r in settings.ratios),
            settings.criterion,
        )
        engine = make_engine(model, evaluate, example_input, graph, settings, store, batches, calibration)
        report = engine.run([] if baseline_only else analysed)
        store.save()  # also when nothing was evaluated: the sidecar then records the baseline and every reason
        outcome = AnalysisOutcome(Path(analysis_file), store.ordered(), params, analysed, report)
        outcome.early_stopped = {
            name: float(info["early_stop"]["ratio"])
            for name, info in store.sidecar["params"].items()
            if isinstance(info.get("early_stop"), dict)
        }
        if target_loss is not None:
            derive_ratios(outcome, target_loss, settings.criterion, settings.granularity)
        return outcome


def make_engine(
    model: nn.Module,
    evaluate: Evaluator,
    example_input: torch.Tensor,
    graph: tp.DependencyGraph,
    settings: EngineSettings,
    store: AnalysisStore,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None,
    calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> SensitivityEngine:
    """The engine ``settings.engine`` asks for; the fast one needs the data as batches."""
    if settings.engine == "fast":
        if batches is not None:
            return FastSensitivityEngine(model, evaluate, example_input, graph, settings, store, batches, calibration)
        logger.info("The fast engine needs the data as batches (not an eval function); using the reference engine.")
    return SensitivityEngine(model, evaluate, example_input, graph, settings, store, calibration)


def derive_ratios(outcome: AnalysisOutcome, target_loss: float, criterion: str, granularity: str = "filter") -> None:
    """Apply PaddleSlim's per-layer rule to the analysed params and save the ``ChannelPrune`` YAML."""
    wanted = {p.name for p in outcome.analysed}
    curves = {name: curve for name, curve in outcome.sensitivities.items() if name in wanted}
    outcome.ratios = get_ratios_by_loss(curves, target_loss)
    outcome.ratios_file = ratios_path(outcome.analysis_file)
    order = [p.name for p in outcome.params]
    save_ratios_yaml(outcome.ratios_file, outcome.ratios, order, criterion, target_loss, granularity)

"""One whole analysis: find the units, resume the analysis file, run the engine, derive the ``target_loss`` ratios.

Shared by the command line, torchrun ranks and the Python APIs (:func:`analysis.compat.paddleslim.analysis_prune`,
NNI's ``SensitivityAnalysis``), so all of them write the same files: the pickle, its JSON sidecar and, with a
``target_loss``, the ratios YAML.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.config import UNIT_KINDS
from analysis.engine.run import AnalysisOutcome, make_engine
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.inputs.numerics import machine_record, numerics
from analysis.io.fingerprint import model_fingerprint
from analysis.io.lock import exclusive
from analysis.io.ratios_yaml import save_ratios_yaml
from analysis.io.results import ratios_path
from analysis.io.store import AnalysisStore, Fingerprint
from analysis.planning.ratios import get_ratios_by_loss
from analysis.scale.shards import ShardSpec, shard_params
from analysis.structure.elementwise import element_params
from analysis.structure.flops import CostModel
from analysis.structure.groups import (
    PrunableUnit,
    build_dependency_graph,
    describe_units,
    eval_mode,
    execution_order,
    select_params,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Selection:
    """Which params a run analyses, and how to name the keys that chose them in error messages.

    Attributes:
        prune_params: Conv weights to analyse (default: every prunable one).
        skip_params: Conv weights to leave out.
        names_key: How to name ``prune_params`` in error messages.
        skip_key: How to name ``skip_params`` in error messages.
        shard: Analyse only this deterministic share of the params (see :mod:`analysis.scale.shards`).
        units: The kinds of unit analysed by default (``conv``, ``linear``, ``heads``; None: every kind).
        units_key: How to name ``units`` in error messages.
    """

    prune_params: Sequence[str] | None = None
    skip_params: Sequence[str] = ()
    names_key: str = "SensitivityAnalysis.prune_params_name"
    skip_key: str = "SensitivityAnalysis.skip_params"
    shard: ShardSpec | None = None
    units: Sequence[str] | None = None
    units_key: str = "SensitivityAnalysis.units"


def run_analysis(
    model: nn.Module,
    data: AnalysisData,
    analysis_file: str | Path,
    settings: EngineSettings,
    *,
    selection: Selection = Selection(),
    target_loss: float | None = None,
    config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    baseline_only: bool = False,
    baseline: Mapping[str, float] | None = None,
) -> AnalysisOutcome:
    """Analyse ``model`` and write the analysis file (resuming it), its sidecar and, with ``target_loss``, ratios.

    Args:
        model: The model, on the device of ``data.example_input`` (analysed in eval mode; its flags are restored).
        data: What variants are evaluated on (with ``data.batches`` the fast engine can run).
        analysis_file: The pickle to resume and write.
        settings: Ratios, criterion, metric and how losses are computed.
        selection: Which params to analyse.
        target_loss: Derive per-layer ratios keeping each layer's loss under this.
        config: The resolved configuration, stored in the sidecar.
        overwrite: Replace an existing analysis file instead of resuming it.
        baseline_only: Measure (or reuse) the baseline and save the file, evaluating no variant.
        baseline: The unpruned model's metrics when the caller has just measured them (used unless the file holds
            a baseline already), so the engine does not evaluate it again.
    """
    example_input = data.example_input
    # tracing and counting run in exact float32; the analysis's evaluations run in the settings' mode (below)
    with eval_mode(model), numerics("exact", example_input.device):  # training flags and backend flags restored
        graph = build_dependency_graph(model, example_input)
        order = execution_order(model, example_input)
        element = settings.granularity == "element"
        params = element_params(model) if element else describe_units(model, graph, order)
        analysed = select_params(
            params,
            selection.prune_params,
            selection.skip_params,
            key=selection.names_key,
            skip_key=selection.skip_key,
            units=selection.units,
            units_key=selection.units_key,
        )
        if settings.decision is not None:  # the error is split over every variant of the analysis, on every rank
            family = replace(settings.decision, variants=len(analysed) * len(settings.ratios))
            settings = replace(settings, decision=family)
        if selection.shard is not None:
            per_module = CostModel(model, example_input).dense.per_module
            analysed = shard_params(analysed, per_module, order, selection.shard)
        fingerprint = Fingerprint(
            model=model_fingerprint(model),
            data=data.fingerprint,
            settings=settings.fingerprint(calibration=data.calibration_fingerprint),
        )
        with exclusive(analysis_file):  # one writer per analysis file; taken once the selection is valid
            store = AnalysisStore(
                analysis_file, fingerprint, [p.name for p in params], overwrite=overwrite, config=config
            )
            if baseline is not None and store.baseline is None:
                store.set_baseline(baseline)
            for param in params:
                if param.reason:
                    store.mark_unprunable(param.name, param.reason)
            logger.info(
                "%d unit(s) (%s): %d prunable, %d analysed; ratios %s; criterion %s.",
                len(params),
                _count_kinds(params),
                sum(p.prunable for p in params),
                len(analysed),
                ", ".join(f"{r:g}" for r in settings.ratios),
                settings.criterion,
            )
            _record_machine(store, settings.numerics, example_input.device)
            with numerics(settings.numerics, example_input.device):
                report = make_engine(model, data, graph, settings, store).run([] if baseline_only else analysed)
            store.save()  # also when nothing was evaluated: the sidecar then records the baseline and every reason
            outcome = AnalysisOutcome(Path(analysis_file), store.ordered(), params, analysed, report)
            outcome.early_stopped = store.early_stops()
            outcome.estimated = store.estimated()
            outcome.numerics = store.numerics
            if target_loss is not None:
                derive_ratios(outcome, target_loss, settings.criterion, settings.granularity)
            return outcome


def _record_machine(store: AnalysisStore, mode: str, device: torch.device) -> None:
    """Record the machine that adds numbers to the file now, and warn when earlier numbers came from another."""
    machine = machine_record(device)
    others = store.record_machine(mode, machine)
    if others:
        logger.warning(
            "%s holds numbers computed on %s; this run adds numbers computed on %s, so the file mixes both "
            "machines' rounding (use a new SensitivityAnalysis.analysis_file to keep them apart).",
            store.path, "; ".join(other.describe() for other in others), machine.describe(),
        )  # fmt: skip


def derive_ratios(outcome: AnalysisOutcome, target_loss: float, criterion: str, granularity: str = "filter") -> None:
    """Apply PaddleSlim's per-layer rule to the analysed params and save the ``ChannelPrune`` YAML."""
    wanted = {p.name for p in outcome.analysed}
    curves = {name: curve for name, curve in outcome.sensitivities.items() if name in wanted}
    outcome.ratios = get_ratios_by_loss(curves, target_loss)
    outcome.ratios_file = ratios_path(outcome.analysis_file)
    order = [p.name for p in outcome.params]
    save_ratios_yaml(outcome.ratios_file, outcome.ratios, order, criterion, target_loss, granularity)


def _count_kinds(params: Sequence[PrunableUnit]) -> str:
    """``"52 conv, 2 linear"``: how many units of each kind (in :data:`UNIT_KINDS` order)."""
    counts = Counter(p.kind for p in params)
    return ", ".join(f"{counts[kind]} {kind}" for kind in UNIT_KINDS if counts[kind]) or "none"

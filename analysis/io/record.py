"""One record of an analysis: the pickle's losses and the JSON sidecar, read once and handed to every later step.

The report, the plan step (knapsack and measured plans, verify's baseline), the tables, the merge of shards and the
CLI all read the same things: the losses, the baseline, each unit's facts and variants, the settings and the resolved
config, and what is partial (unprunable units, early stops, estimated losses). :func:`load_record` reads both files
with one handling of what can be missing: no analysis file is a user error naming it, no sidecar gives a record whose
sidecar is None and whose sidecar parts are empty, and a partial analysis is read as it is. Steps that take a path
from a user build the record with :func:`as_record` at that one entry, so only :mod:`analysis.io` opens these files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from analysis.errors import AnalysisFileError
from analysis.io import sidecar as schema
from analysis.io.results import Sensitivities, load_sensitivities
from analysis.io.sidecar import (
    ConfigRecord,
    CostRecord,
    FingerprintRecord,
    Metrics,
    ParamRecord,
    PlanRecord,
    SettingsRecord,
    Sidecar,
    VariantRecord,
)
from analysis.ratio import normalise_ratio


@dataclass(frozen=True)
class AnalysisRecord:
    """An analysis file and its sidecar as every later step reads them. Treat it as immutable: steps share it.

    Attributes:
        path: The analysis pickle.
        sensitivities: ``{param: {ratio: loss}}`` as the pickle holds it (file order, ratios normalised and sorted);
            a param may lack ratios (a partial or early-stopped analysis) or have none at all.
        sidecar: The validated JSON sidecar, or None when the file has none (a PaddleSlim pickle, a file copied
            alone); the properties below then give empty parts.
    """

    path: Path
    sensitivities: Sensitivities
    sidecar: Sidecar | None = None

    # --------------------------------------------------------------------------------- the sidecar's parts

    @property
    def baseline(self) -> Metrics:
        """The dense model's metrics (``top1``, ``top5``, ``ce``...); empty when not recorded."""
        found = self.sidecar.baseline if self.sidecar is not None else None
        return found if found is not None else {}

    @property
    def settings(self) -> SettingsRecord:
        """The settings the losses depend on (criterion, metric, sampling...); empty when not recorded."""
        return self.sidecar.settings if self.sidecar is not None else SettingsRecord()

    @property
    def fingerprint(self) -> FingerprintRecord | None:
        """The model, data and settings the losses were computed on (None: unknown)."""
        return self.sidecar.fingerprint if self.sidecar is not None else None

    @property
    def config(self) -> ConfigRecord | None:
        """The resolved config of the run that wrote the file (None: not recorded)."""
        return self.sidecar.config if self.sidecar is not None else None

    @property
    def cost(self) -> CostRecord | None:
        """The dense model's MACs and params (None: not recorded)."""
        return self.sidecar.cost if self.sidecar is not None else None

    @property
    def plan(self) -> PlanRecord | None:
        """The latest plan recorded with the file (None: no plan yet)."""
        return self.sidecar.plan if self.sidecar is not None else None

    @property
    def model_order(self) -> list[str]:
        """Every prunable param of the model in model order, as the sidecar records it (empty: not recorded)."""
        found = self.sidecar.model_order if self.sidecar is not None else None
        return found if found is not None else []

    @property
    def params(self) -> dict[str, ParamRecord]:
        """Each analysed unit's facts (module, kind, group, mode...) with its variants, in the file's order."""
        return self.sidecar.param_records() if self.sidecar is not None else {}

    def param(self, name: str) -> ParamRecord | None:
        """The facts of unit ``name``, if recorded."""
        return self.sidecar.param(name) if self.sidecar is not None else None

    def variant(self, name: str, ratio: float) -> VariantRecord | None:
        """The record (metrics, costs, interval...) of ``name`` pruned at ``ratio``, if recorded."""
        return self.sidecar.variant(name, ratio) if self.sidecar is not None else None

    def variants(self) -> Iterator[tuple[str, float, VariantRecord]]:
        """``(param, ratio, variant)`` of every recorded variant."""
        if self.sidecar is not None:
            yield from self.sidecar.variants()

    # ------------------------------------------------------------------------------------- what is partial

    @property
    def unprunable(self) -> dict[str, str]:
        """The units that cannot be pruned, each with its reason (never recorded as a loss of 0)."""
        found = self.sidecar.unprunable if self.sidecar is not None else None
        return found if found is not None else {}

    @property
    def early_stops(self) -> dict[str, float]:
        """The ratio each early-stopped unit stopped at: its larger ratios were not evaluated."""
        return self.sidecar.early_stops() if self.sidecar is not None else {}

    @property
    def estimates(self) -> frozenset[tuple[str, float]]:
        """``(param, ratio)`` of every loss that is an estimate from part of the images (adaptive precision,
        decision-driven sampling); the other losses are exact."""
        return frozenset((name, normalise_ratio(ratio)) for name, ratio, v in self.variants() if v.estimated)

    @property
    def ratios(self) -> tuple[float, ...]:
        """Every ratio measured for some param, ascending."""
        return tuple(sorted({ratio for curve in self.sensitivities.values() for ratio in curve}))

    def missing_ratios(self) -> dict[str, tuple[float, ...]]:
        """Per param with at least one loss, the measured ratios (:attr:`ratios`) it lacks; params lacking none are
        left out (an early stop or an interrupted run leaves such gaps)."""
        everywhere = self.ratios
        gaps = {name: tuple(r for r in everywhere if r not in curve) for name, curve in self.sensitivities.items()}
        return {name: missing for name, missing in gaps.items() if missing and self.sensitivities[name]}

    def measured(self) -> AnalysisRecord:
        """This record without the params that have no loss at all (what a report or a table can draw)."""
        kept = {name: curve for name, curve in self.sensitivities.items() if curve}
        return self if len(kept) == len(self.sensitivities) else dataclasses.replace(self, sensitivities=kept)


AnalysisSource: TypeAlias = AnalysisRecord | str | os.PathLike[str]
"""What a step that users call from Python accepts: a record, or the path of an analysis file (:func:`as_record`)."""


def load_record(path: str | os.PathLike[str], *, missing_ok: bool = False) -> AnalysisRecord:
    """Read an analysis file and its sidecar once into an :class:`AnalysisRecord`.

    Args:
        path: The analysis pickle (this tool's or PaddleSlim's); its sidecar is ``<path>.json``.
        missing_ok: Read a missing pickle as no losses (its sidecar is still read), as a resumed or sharded run
            that has not saved yet; by default a missing file is an error.

    Raises:
        AnalysisFileError: The file does not exist (unless ``missing_ok``), or the pickle or the sidecar is
            unreadable, damaged, holds code or has the wrong structure.
    """
    path = Path(path)
    if not missing_ok and not path.exists():
        raise AnalysisFileError(
            f"Analysis file {path} does not exist; pass the .pkl a sensitivity run wrote (or run the analysis first)."
        )
    sensitivities = load_sensitivities(path)  # the pickle first: the store writes it last, after its sidecar
    return AnalysisRecord(path, sensitivities, schema.load(path))


def analysis_path(analysis: AnalysisSource) -> Path:
    """The analysis file ``analysis`` is the record of, or names; nothing is read (e.g. to lock it first)."""
    return analysis.path if isinstance(analysis, AnalysisRecord) else Path(analysis)


def as_record(analysis: AnalysisSource) -> AnalysisRecord:
    """``analysis`` itself when it is a record, else the record of the analysis file it names (:func:`load_record`);
    the one place where a step that accepts a path reads it."""
    return analysis if isinstance(analysis, AnalysisRecord) else load_record(analysis)

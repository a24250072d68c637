"""The analysis file while a run is in progress: resume, same-model checks, and a durable save after every unit.

The pickle (PaddleSlim's format) is the source of truth for which (param, ratio) pairs are done; the JSON sidecar
(:mod:`analysis.io.sidecar`) holds everything else (baseline, per-variant metrics, groups, fingerprints, the resolved
config). After each finished unit the sidecar is written first and the pickle second, both atomically, so a crash at
any moment leaves a loadable pickle whose every entry has been measured.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis import __version__
from analysis.errors import AnalysisFileError
from analysis.io import sidecar as schema
from analysis.io.atomic import remove_stale_temporaries
from analysis.io.results import Sensitivities, load_sensitivities, save_sensitivities, sidecar_path
from analysis.io.sidecar import (
    ConfigRecord,
    CostRecord,
    EarlyStopRecord,
    FingerprintRecord,
    MachineRecord,
    NumericsRecord,
    ParamRecord,
    Sidecar,
    ToolRecord,
    VariantRecord,
    variant_key,
)
from analysis.ratio import normalise_ratio

logger = logging.getLogger(__name__)


# Settings a fingerprint leaves out when they have their default (so files of earlier versions still resume).
IMPLIED_SETTINGS = {
    "granularity": "filter",
    "round_to": 1,
    "adaptive_bn": False,
    "calibration": None,
    "decision": None,
    "numerics": "exact",
}


@dataclass
class Fingerprint:
    """What an analysis file's numbers depend on; a resumed run must match every part that is known."""

    model: str | None
    data: str | None
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON form stored in the sidecar."""
        return {"model": self.model, "data": self.data, "settings": self.settings}

    def record(self) -> FingerprintRecord:
        """The sidecar's record of this fingerprint."""
        return FingerprintRecord.from_json(self.as_dict(), "fingerprint")

    @classmethod
    def of(cls, record: FingerprintRecord | None) -> Fingerprint:
        """The fingerprint a sidecar records (parts it lacks are unknown)."""
        if record is None:
            return cls(None, None)
        settings = record.settings.to_json() if record.settings is not None else {}
        return cls(model=record.model, data=record.data, settings=settings)


class AnalysisStore:
    """In-memory sensitivities and sidecar of one analysis file, saved after every recorded unit.

    Args:
        path: The analysis pickle.
        fingerprint: What the numbers about to be added depend on.
        model_order: Parameter names in model order; the file lists them first, in this order, then any names
            the model lacks (kept from an earlier file), so resumed and uninterrupted runs write identical bytes.
        overwrite: Start afresh even if the file exists.
        config: The resolved configuration, stored in the sidecar (default: the one the file holds).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fingerprint: Fingerprint,
        model_order: Sequence[str],
        overwrite: bool = False,
        config: Mapping[str, Any] | ConfigRecord | None = None,
    ) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.model_order = list(model_order)
        for path in (self.path, sidecar_path(self.path)):
            for temp in remove_stale_temporaries(path):
                logger.info("Removed %s, left by an interrupted save.", temp.name)
        self.sensitivities: Sensitivities = {} if overwrite else load_sensitivities(self.path)
        stored = None if overwrite else schema.load(self.path)
        if stored is not None:
            self._check_fingerprint(Fingerprint.of(stored.fingerprint))
        elif self.sensitivities:
            logger.warning(
                "%s has no sidecar (%s), so it cannot be checked against this model and data; resuming anyway.",
                self.path,
                sidecar_path(self.path).name,
            )
        self.sidecar: Sidecar = stored or Sidecar()
        self.sidecar.tool = ToolRecord(name="prune-sensitivity", version=__version__)
        self.sidecar.fingerprint = fingerprint.record()
        self.sidecar.config = _config_record(config) or self.sidecar.config or ConfigRecord()
        if self.sidecar.params is None:
            self.sidecar.params = {}
        if self.sidecar.unprunable is None:
            self.sidecar.unprunable = {}
        self.sidecar.model_order = self.model_order  # lets merging files restore model order without the model
        self.foreign_names = [name for name in self.sensitivities if name not in set(self.model_order)]
        if self.foreign_names:
            logger.warning(
                "%s holds %d parameter(s) this model does not have; they are kept and not evaluated: %s",
                self.path,
                len(self.foreign_names),
                ", ".join(self.foreign_names[:5]) + (", ..." if len(self.foreign_names) > 5 else ""),
            )

    def _check_fingerprint(self, stored: Fingerprint) -> None:
        checks = [
            ("model", "another model (its weights differ)"),
            ("data", "other data or preprocessing"),
        ]
        for key, what in checks:
            old, new = getattr(stored, key), getattr(self.fingerprint, key)
            if old is not None and new is not None and old != new:
                self._refuse(what)
        old_settings = {**IMPLIED_SETTINGS, **stored.settings}
        new_settings = {**IMPLIED_SETTINGS, **self.fingerprint.settings}
        for key, value in new_settings.items():
            if key in old_settings and old_settings[key] != value:
                self._refuse(f"{key} {old_settings[key]!r} (this run uses {value!r})")

    def _refuse(self, what: str) -> None:
        raise AnalysisFileError(
            f"Analysis file {self.path} was computed with {what}; use a new SensitivityAnalysis.analysis_file or "
            "pass --overwrite to replace it."
        )

    def has(self, name: str, ratio: float) -> bool:
        """True when (name, ratio) is already in the file."""
        return normalise_ratio(ratio) in self.sensitivities.get(name, {})

    # The sidecar, typed
    def param(self, name: str) -> ParamRecord | None:
        """The sidecar's record of param ``name``, if any."""
        return self.sidecar.param(name)

    def variant(self, name: str, ratio: float) -> VariantRecord | None:
        """The recorded variant of ``name`` at ``ratio``, if any."""
        return self.sidecar.variant(name, ratio)

    def _param(self, name: str) -> ParamRecord:
        params = self.sidecar.params
        assert params is not None  # set in __init__
        return params.setdefault(name, ParamRecord())

    @property
    def baseline(self) -> dict[str, Any] | None:
        """The stored baseline metrics, valid for this run (the fingerprint matched), or None."""
        return self.sidecar.baseline

    def set_baseline(self, metrics: Mapping[str, Any]) -> None:
        """Store the baseline metrics (saved with the next unit, or by :meth:`save`)."""
        self.sidecar.baseline = dict(metrics)

    @property
    def numerics(self) -> NumericsRecord:
        """How the file's numbers are computed (its arithmetic, machines, and a speed mode's measured noise)."""
        if self.sidecar.numerics is None:
            self.sidecar.numerics = NumericsRecord()
        return self.sidecar.numerics

    def record_machine(self, mode: str, machine: MachineRecord) -> list[MachineRecord]:
        """Note that numbers are now computed under ``mode`` on ``machine``; return the other machines that computed
        numbers in this file before (the fingerprint already refused another mode)."""
        numerics = self.numerics
        numerics.mode = mode  # a file of another mode was refused by the fingerprint; older files lack the key
        machines = numerics.machines if numerics.machines is not None else []
        others = [known for known in machines if known.to_json() != machine.to_json()]
        if len(others) == len(machines):
            numerics.machines = [*machines, machine]
        return others

    def set_cost(self, cost: Mapping[str, Any] | CostRecord) -> None:
        """Store the dense model's MACs and params (with their counting convention)."""
        self.sidecar.cost = cost if isinstance(cost, CostRecord) else CostRecord.from_json(dict(cost), "cost")

    def describe(self, name: str, facts: ParamRecord) -> None:
        """Store static facts about a param (shape, group members, masking mode...): the keys ``facts`` sets
        replace the stored ones, in place; new ones go last."""
        self._param(name).update_json(facts.to_json(), f'params["{name}"]')

    def mark_unprunable(self, name: str, reason: str) -> None:
        """Record why a unit was not analysed."""
        unprunable = self.sidecar.unprunable
        assert unprunable is not None  # set in __init__
        unprunable[name] = reason

    # Early stops (kept by the engine's StopLedger)
    def mark_early_stop(self, name: str, ratio: float, condition: str) -> None:
        """Record that ``name`` stopped at ``ratio`` under ``condition``."""
        self._param(name).early_stop = EarlyStopRecord(ratio=ratio, condition=condition)

    def clear_early_stop(self, name: str) -> None:
        """Forget a recorded early stop of ``name`` (the current rule does not stop it)."""
        param = self.sidecar.param(name)
        if param is not None:
            param.early_stop = None

    def early_stops(self) -> dict[str, float]:
        """The ratio each early-stopped param stopped at."""
        return self.sidecar.early_stops()

    def estimated(self) -> dict[str, set[float]]:
        """Per param, the ratios whose recorded loss is an estimate (an interval of non-zero width)."""
        found: dict[str, set[float]] = {}
        for name, ratio, variant in self.sidecar.variants():
            if variant.estimated:
                found.setdefault(name, set()).add(normalise_ratio(ratio))
        return found

    def variant_metric(self, name: str, ratio: float, metric: str) -> float | None:
        """The recorded ``metric`` of ``name`` at ``ratio`` (None when not recorded)."""
        variant = self.sidecar.variant(name, ratio)
        value = None if variant is None else variant.metric(metric)
        return None if value is None else float(value)

    def record_variant(self, names: Sequence[str], ratio: float, variant: VariantRecord) -> None:
        """Add one measured variant under every name in ``names`` (several when coupled params share it; they share
        the record), then save the sidecar and the pickle atomically."""
        assert variant.loss is not None, "a variant without a loss"
        key = normalise_ratio(ratio)
        for name in names:
            self.sensitivities.setdefault(name, {})[key] = float(variant.loss)
            param = self._param(name)
            if param.variants is None:
                param.variants = {}
            param.variants[variant_key(key)] = variant
        self.save()

    def absorb(self, sensitivities: Mapping[str, Mapping[float, float]], sidecar: Sidecar | None) -> None:
        """Take in another file's results of the same analysis (a shard); its values win for the same pairs.

        Nothing is saved until :meth:`save`.
        """
        for name, curve in sensitivities.items():
            self.sensitivities.setdefault(name, {}).update({normalise_ratio(r): float(v) for r, v in curve.items()})
            if name not in self.model_order and name not in self.foreign_names:
                self.foreign_names.append(name)
        if sidecar is not None:
            self.sidecar.absorb(sidecar)

    def ordered(self) -> Sensitivities:
        """The sensitivities in canonical order: model order first, then names the model lacks."""
        names = [n for n in self.model_order if n in self.sensitivities] + self.foreign_names
        return {name: self.sensitivities[name] for name in names}

    def save(self) -> None:
        """Write the sidecar, then the pickle (the pickle decides what is done, so it goes last)."""
        self.sidecar.saved_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        schema.save(self.path, self.sidecar)
        save_sensitivities(self.path, self.ordered())


def _config_record(config: Mapping[str, Any] | ConfigRecord | None) -> ConfigRecord | None:
    """A fresh record of ``config``; None when it is missing or empty."""
    if not config:
        return None
    data = config.to_json() if isinstance(config, ConfigRecord) else dict(config)
    return ConfigRecord.from_json(data, "config") if data else None

"""The analysis file while a run is in progress: resume, same-model checks, and a durable save after every unit.

The pickle (PaddleSlim's format) is the source of truth for which (param, ratio) pairs are done; the JSON sidecar
holds everything else (baseline, per-variant metrics, groups, fingerprints, the resolved config). After each
finished unit the sidecar is written first and the pickle second, both atomically, so a crash at any moment
leaves a loadable pickle whose every entry has been measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis import __version__
from analysis.errors import AnalysisFileError
from analysis.io.results import (
    Sensitivities,
    load_sensitivities,
    load_sidecar,
    normalise_ratio,
    remove_stale_temporaries,
    save_sensitivities,
    save_sidecar,
    sidecar_path,
)

logger = logging.getLogger(__name__)


# Settings a fingerprint leaves out when they have their default (so files of earlier versions still resume).
IMPLIED_SETTINGS = {"granularity": "filter", "round_to": 1, "adaptive_bn": False, "calibration": None}


@dataclass
class Fingerprint:
    """What an analysis file's numbers depend on; a resumed run must match every part that is known."""

    model: str | None
    data: str | None
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON form stored in the sidecar."""
        return {"model": self.model, "data": self.data, "settings": self.settings}


class AnalysisStore:
    """In-memory sensitivities and sidecar of one analysis file, saved after every recorded unit.

    Args:
        path: The analysis pickle.
        fingerprint: What the numbers about to be added depend on.
        model_order: Parameter names in model order; the file lists them first, in this order, then any names
            the model lacks (kept from an earlier file), so resumed and uninterrupted runs write identical bytes.
        overwrite: Start afresh even if the file exists.
        config: The resolved configuration, stored in the sidecar.
    """

    def __init__(
        self,
        path: str | Path,
        fingerprint: Fingerprint,
        model_order: Sequence[str],
        overwrite: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.model_order = list(model_order)
        for path in (self.path, sidecar_path(self.path)):
            for temp in remove_stale_temporaries(path):
                logger.info("Removed %s, left by an interrupted save.", temp.name)
        self.sensitivities: Sensitivities = {} if overwrite else load_sensitivities(self.path)
        sidecar = None if overwrite else load_sidecar(self.path)
        if sidecar is not None:
            self._check_fingerprint(sidecar.get("fingerprint") or {})
        elif self.sensitivities:
            logger.warning(
                "%s has no sidecar (%s), so it cannot be checked against this model and data; resuming anyway.",
                self.path,
                sidecar_path(self.path).name,
            )
        self.sidecar: dict[str, Any] = sidecar or {}
        self.sidecar.update(
            tool={"name": "prune-sensitivity", "version": __version__},
            fingerprint=fingerprint.as_dict(),
            config=dict(config or self.sidecar.get("config") or {}),
        )
        self.sidecar.setdefault("params", {})
        self.sidecar.setdefault("unprunable", {})
        self.sidecar["model_order"] = self.model_order  # lets merging files restore model order without the model
        self.foreign_names = [name for name in self.sensitivities if name not in set(self.model_order)]
        if self.foreign_names:
            logger.warning(
                "%s holds %d parameter(s) this model does not have; they are kept and not evaluated: %s",
                self.path,
                len(self.foreign_names),
                ", ".join(self.foreign_names[:5]) + (", ..." if len(self.foreign_names) > 5 else ""),
            )

    def _check_fingerprint(self, stored: Mapping[str, Any]) -> None:
        checks = [
            ("model", "another model (its weights differ)"),
            ("data", "other data or preprocessing"),
        ]
        for key, what in checks:
            old, new = stored.get(key), getattr(self.fingerprint, key)
            if old is not None and new is not None and old != new:
                self._refuse(what)
        old_settings = {**IMPLIED_SETTINGS, **(stored.get("settings") or {})}
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

    @property
    def baseline(self) -> dict[str, Any] | None:
        """The stored baseline metrics, valid for this run (the fingerprint matched), or None."""
        return self.sidecar.get("baseline")

    def set_baseline(self, metrics: Mapping[str, Any]) -> None:
        """Store the baseline metrics (saved with the next unit, or by :meth:`save`)."""
        self.sidecar["baseline"] = dict(metrics)

    def set_cost(self, cost: Mapping[str, Any]) -> None:
        """Store the dense model's MACs and params (with their counting convention)."""
        self.sidecar["cost"] = dict(cost)

    def describe_param(self, name: str, info: Mapping[str, Any]) -> None:
        """Store static facts about a param (shape, group members, masking mode...)."""
        self.sidecar["params"].setdefault(name, {}).update(info)

    def mark_unprunable(self, name: str, reason: str) -> None:
        """Record why a conv was not analysed."""
        self.sidecar["unprunable"][name] = reason

    def record(self, names: Sequence[str], ratio: float, loss: float, details: Mapping[str, Any]) -> None:
        """Add one measured variant under every name in ``names`` (several when coupled params share it), then
        save the sidecar and the pickle atomically."""
        key = normalise_ratio(ratio)
        for name in names:
            self.sensitivities.setdefault(name, {})[key] = float(loss)
            variants = self.sidecar["params"].setdefault(name, {}).setdefault("variants", {})
            variants[f"{key:g}"] = {"loss": float(loss), **details}
        self.save()

    def absorb(self, sensitivities: Mapping[str, Mapping[float, float]], sidecar: Mapping[str, Any]) -> None:
        """Take in another file's results of the same analysis (a shard); its values win for the same pairs.

        Nothing is saved until :meth:`save`.
        """
        for name, curve in sensitivities.items():
            self.sensitivities.setdefault(name, {}).update({normalise_ratio(r): float(v) for r, v in curve.items()})
            if name not in self.model_order and name not in self.foreign_names:
                self.foreign_names.append(name)
        for name, info in (sidecar.get("params") or {}).items():
            mine = self.sidecar["params"].setdefault(name, {})
            variants = {**(mine.get("variants") or {}), **(info.get("variants") or {})}
            mine.update({**info, "variants": variants})
        self.sidecar["unprunable"].update(sidecar.get("unprunable") or {})
        for key in ("baseline", "cost"):
            if key not in self.sidecar and key in sidecar:
                self.sidecar[key] = sidecar[key]

    def ordered(self) -> Sensitivities:
        """The sensitivities in canonical order: model order first, then names the model lacks."""
        names = [n for n in self.model_order if n in self.sensitivities] + self.foreign_names
        return {name: self.sensitivities[name] for name in names}

    def save(self) -> None:
        """Write the sidecar, then the pickle (the pickle decides what is done, so it goes last)."""
        self.sidecar["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save_sidecar(self.path, self.sidecar)
        save_sensitivities(self.path, self.ordered())

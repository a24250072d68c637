"""CSV exports of an analysis file: ``wide`` (one row per param, one column per ratio, NNI's layout) and ``long``
(one row per measured variant, with its metrics and costs from the sidecar)."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.errors import AnalysisFileError
from analysis.io.atomic import atomic_write_text
from analysis.io.record import AnalysisSource, as_record
from analysis.io.results import Sensitivities, sidecar_path
from analysis.io.sidecar import Sidecar
from analysis.metrics import LABEL_FREE_METRICS

if TYPE_CHECKING:
    from analysis.io.sidecar import VariantRecord


CSV_STYLES = ("wide", "long")


SAMPLED_COLUMNS = ("images", "interval_low", "interval_high")
"""Long-CSV columns of a sampled analysis (adaptive precision, decision-driven sampling): the images a variant's loss
was estimated on and its interval; a decision-driven one adds ``settled``."""

LONG_COLUMNS = ("parameter", "sparsity", "top1", "top5", "loss", "relative_loss", "macs", "params",
                "macs_reduction", "params_reduction")  # fmt: skip


def csv_path(analysis_file: str | os.PathLike[str], style: str) -> Path:
    """Return the CSV export path of an analysis file: ``s.pkl`` -> ``s.wide.csv`` / ``s.long.csv``."""
    path = Path(analysis_file)
    return path.with_name(f"{path.stem}.{style}.csv")


def export_csv(analysis: AnalysisSource, path: str | os.PathLike[str] | None = None, style: str = "wide") -> Path:
    """Export an analysis (its record, or an analysis file and its sidecar, read once) as CSV, atomically; returns
    the path written (default :func:`csv_path` beside the analysis file).

    ``wide`` is NNI's ``SensitivityAnalysis.export`` format: a header ``layername,<ratio>,...`` and one row per
    conv (module name) holding the evaluated metric (``top1`` by default) at each ratio; it needs the sidecar.
    ``long`` is Distiller's ``sensitivities_to_csv`` format, ``parameter,sparsity,top1,top5,loss`` with top1/top5
    in percent, ``loss`` the cross-entropy and a 0.0 row holding the baseline for each parameter, followed by our
    ``relative_loss`` (the number in the analysis file) and the variant's MACs and params after physical removal
    with their reductions (empty when the sidecar lacks them). Parameters follow the file's (model) order and
    ratios ascend, so equal inputs give byte-identical files. With adaptive BN (BatchNorm statistics re-estimated
    per variant) the metric columns are suffixed ``_adaptive_bn`` (``layername_adaptive_bn``, ``top1_adaptive_bn``);
    computed in a speed mode (``Global.numerics: tf32|bf16``) they are suffixed ``_approx_<mode>``
    (``top1_approx_bf16``).
    A label-free analysis (``metric: agreement`` or ``kl``) adds its metric as a column (agreement in percent, KL in
    nats); top1/top5/loss are then empty where no labels exist. A sampled analysis (``precision``) adds each variant's
    ``images``, ``interval_low``/``interval_high`` and, decision-driven, ``settled`` (:data:`SAMPLED_COLUMNS`).

    Raises:
        AnalysisFileError: The analysis file or its sidecar cannot be read, or ``wide`` is asked without a sidecar.
        ValueError: ``style`` is not ``wide`` or ``long``.
    """
    if style not in CSV_STYLES:
        raise ValueError(f"style must be one of {CSV_STYLES}, got {style!r}")
    record = as_record(analysis)
    sensitivities, sidecar = record.sensitivities, record.sidecar
    if style == "wide":
        if sidecar is None:
            raise AnalysisFileError(
                f"The wide (NNI) CSV holds metric values, which live in the sidecar {sidecar_path(record.path)}; "
                "it is missing, so export style='long' instead."
            )
        rows = _wide_rows(sensitivities, sidecar)
    else:
        rows = _long_rows(sensitivities, sidecar or Sidecar())
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    target = Path(path) if path is not None else csv_path(record.path, style)
    atomic_write_text(target, buffer.getvalue())
    return target


def _wide_rows(sensitivities: Sensitivities, sidecar: Sidecar) -> list[list[Any]]:
    metric = sidecar.settings.metric_name
    ratios = sorted({ratio for curve in sensitivities.values() for ratio in curve})
    rows: list[list[Any]] = [[_marked("layername", sidecar), *ratios]]
    for name, curve in sensitivities.items():
        values = [_value(sidecar.variant(name, ratio), metric) if ratio in curve else "" for ratio in ratios]
        rows.append([name.removesuffix(".weight"), *values])
    return rows


def _value(variant: VariantRecord | None, metric: str) -> Any:
    return _blank(None if variant is None else variant.metric(metric))


ADAPTIVE_BN_SUFFIX = "_adaptive_bn"
APPROXIMATE_SUFFIX = "_approx_"


def _marked(column: str, sidecar: Sidecar) -> str:
    """A metric column's name, suffixed when the analysis re-estimated BatchNorm per variant (adaptive BN) and when
    it ran in a speed mode (``_approx_bf16``), so its numbers are never mistaken for plain or exact ones."""
    column = column + ADAPTIVE_BN_SUFFIX if sidecar.settings.adaptive_bn else column
    numerics = sidecar.numerics
    return f"{column}{APPROXIMATE_SUFFIX}{numerics.mode}" if numerics is not None and numerics.approximate else column


def _long_rows(sensitivities: Sensitivities, sidecar: Sidecar) -> list[list[Any]]:
    dense = sidecar.cost
    dense_costs = (dense.macs, dense.params, 0.0, 0.0) if dense is not None and dense.macs is not None else ()
    label_free = sidecar.settings.metric_name if sidecar.settings.metric_name in LABEL_FREE_METRICS else None
    measured = ("top1", "top5", "loss", "relative_loss", label_free)  # after BatchNorm re-estimation with adaptive BN
    columns = [*LONG_COLUMNS, label_free] if label_free else list(LONG_COLUMNS)
    sampled = any(variant.samples is not None for _, _, variant in sidecar.variants())
    decided = any(variant.settled is not None for _, _, variant in sidecar.variants())
    columns += [*SAMPLED_COLUMNS, *(["settled"] if decided else [])] if sampled else []
    rows: list[list[Any]] = [[_marked(c, sidecar) if c in measured else c for c in columns]]

    def row(
        name: str,
        ratio: float,
        metrics: Mapping[str, float],
        loss: float,
        costs: Sequence[float | None],
        variant: VariantRecord | None = None,
    ) -> list[Any]:
        cells = _long_row(name, ratio, metrics, loss, costs)
        if label_free:
            value = metrics.get(label_free)
            cells.append(_blank(None if value is None else 100.0 * value if label_free == "agreement" else value))
        if sampled:
            interval = variant.interval if variant is not None and variant.interval else [None, None]
            cells += [_blank(None if variant is None else variant.samples), *map(_blank, interval)]
        if decided:
            cells.append(_blank(None if variant is None else variant.settled))
        return cells

    for name, curve in sensitivities.items():
        rows.append(row(name, 0.0, sidecar.baseline or {}, 0.0, dense_costs))
        for ratio, loss in curve.items():
            variant = sidecar.variant(name, ratio)
            if variant is None:
                rows.append(row(name, ratio, {}, loss, ()))
                continue
            costs = (variant.macs, variant.params, variant.macs_reduction, variant.params_reduction)
            rows.append(row(name, ratio, variant.metrics, loss, costs, variant))
    return rows


def _long_row(
    name: str, sparsity: float, metrics: Mapping[str, float], loss: float, costs: Sequence[float | None]
) -> list[Any]:
    def percent(value: float | None) -> Any:
        return "" if value is None else round(100.0 * value, 10)

    cost_cells = [_blank(value) for value in costs] or [""] * 4
    return [name, sparsity, percent(metrics.get("top1")), percent(metrics.get("top5")), _blank(metrics.get("ce")),
            loss, *cost_cells]  # fmt: skip


def _blank(value: Any) -> Any:
    """A CSV cell: empty for a missing value."""
    return "" if value is None else value

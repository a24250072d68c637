"""The report step: the CSV exports, the plots and the HTML report of an analysis file, checked before writing."""

from __future__ import annotations

import logging
from pathlib import Path

from analysis.io.atomic import writable_folder
from analysis.io.record import AnalysisSource, as_record
from analysis.io.results import sidecar_path
from analysis.io.tables import CSV_STYLES, csv_path, export_csv

logger = logging.getLogger(__name__)


def write_report_files(
    analysis: AnalysisSource,
    target_loss: float | None = None,
    ratio: float | None = None,
    out_dir: str | Path | None = None,
) -> list[Path]:
    """Write the CSV exports, the plots and the HTML report of ``analysis``; returns the paths written.

    ``analysis`` is the record of an analysis, or an analysis file read here once (with its sidecar); the record and
    ``ratio`` and ``out_dir`` are checked before the first file is written, so a bad argument leaves nothing
    half-done. Without a sidecar the wide CSV (metric values, which only the sidecar holds) is skipped with a warning
    and the rest is built from the pickle alone.
    """
    from analysis.reporting.plots import resolve_ratio
    from analysis.reporting.report import load_analysis, write_report  # matplotlib only when reports are written

    record = as_record(analysis)
    data = load_analysis(record)
    resolve_ratio(data.sensitivities, ratio, str(data.path))
    directory = writable_folder(out_dir if out_dir is not None else record.path.parent)
    styles: tuple[str, ...] = CSV_STYLES
    if record.sidecar is None:
        styles = tuple(style for style in CSV_STYLES if style != "wide")
        logger.warning(
            "%s has no sidecar %s: the wide CSV (metric values) is skipped and the report shows the losses alone.",
            record.path, sidecar_path(record.path).name,
        )  # fmt: skip
    written = [export_csv(record, csv_path(directory / record.path.name, style), style) for style in styles]
    files = write_report(data, out_dir=directory, target_loss=target_loss, ratio=ratio)
    return [*written, files.curves, files.heatmap, files.savings, files.html]

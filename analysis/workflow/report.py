"""The report step: the CSV exports, the plots and the HTML report of an analysis file, checked before writing."""

from __future__ import annotations

import logging
from pathlib import Path

from analysis.io.atomic import writable_folder
from analysis.io.results import sidecar_path
from analysis.io.tables import CSV_STYLES, csv_path, export_csv

logger = logging.getLogger(__name__)


def write_report_files(
    analysis_file: str | Path,
    target_loss: float | None = None,
    ratio: float | None = None,
    out_dir: str | Path | None = None,
) -> list[Path]:
    """Write the CSV exports, the plots and the HTML report of ``analysis_file``; returns the paths written.

    The analysis file and its sidecar are read and ``ratio`` and ``out_dir`` checked before the first file is
    written, so a bad argument leaves nothing half-done. Without a sidecar the wide CSV (metric values, which only
    the sidecar holds) is skipped with a warning and the rest is built from the pickle alone.
    """
    from analysis.reporting.plots import resolve_ratio
    from analysis.reporting.report import load_analysis, write_report  # matplotlib only when reports are written

    data = load_analysis(analysis_file)
    resolve_ratio(data.sensitivities, ratio, str(data.path))
    directory = writable_folder(out_dir if out_dir is not None else Path(analysis_file).parent)
    styles: tuple[str, ...] = CSV_STYLES
    if data.sidecar is None:
        styles = tuple(style for style in CSV_STYLES if style != "wide")
        logger.warning(
            "%s has no sidecar %s: the wide CSV (metric values) is skipped and the report shows the losses alone.",
            analysis_file, sidecar_path(analysis_file).name,
        )  # fmt: skip
    written = [export_csv(analysis_file, csv_path(directory / Path(analysis_file).name, style), style)
               for style in styles]  # fmt: skip
    files = write_report(analysis_file, out_dir=directory, target_loss=target_loss, ratio=ratio)
    return [*written, files.curves, files.heatmap, files.savings, files.html]

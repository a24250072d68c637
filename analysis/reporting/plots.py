"""The report's three plots as PNGs, drawn so that the same analysis always gives the same image, byte for byte.

- ``<stem>.curves.png``: loss against ratio, one line per parameter, at most :data:`LINES_PER_PANEL` lines per
  panel in model order, with the target loss and each parameter's derived ratio marked.
- ``<stem>.heatmap.png``: parameters x ratios, coloured by loss (white 0, red loss, blue gain), values written
  in the cells when there are few enough.
- ``<stem>.savings.png``: the loss at one ratio next to the share of the dense model's MACs (and params) that
  pruning the layer alone saves; the second panel holds a note instead when the sidecar has no MACs.

Why they are drawn this way: figures live on Matplotlib's Agg canvas (no pyplot, so no global figure state, no GUI
backend and safe on headless machines), under Matplotlib's default style whatever the user's matplotlibrc says, at
a fixed :data:`DPI` and without ``bbox_inches="tight"``. Their pixel sizes therefore depend only on the analysis
(:func:`curves_size`, :func:`heatmap_size`, :func:`savings_size`), so the HTML report can state them and tests can
check them; and with no timestamp or software metadata, rewriting a plot gives identical bytes.

This module also holds the small helpers the HTML report shares with the plots (:func:`analysed_ratios`,
:func:`resolve_ratio`, :func:`short_name`, :func:`loss_colouring`, :func:`is_dark`); it never imports
:mod:`analysis.reporting.report`.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import matplotlib.style
import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap, ListedColormap, Normalize
from matplotlib.figure import Figure

from analysis.errors import ConfigError
from analysis.io.atomic import atomic_write_bytes
from analysis.planning.ratios import TargetRatios
from analysis.ratio import normalise_ratio

DPI = 100
"""Every PNG is rendered at this resolution; figure sizes are whole multiples of 0.25 inch (25 pixels)."""

LINES_PER_PANEL = 8
"""At most this many parameters share one panel of the curves plot."""

CURVES_PANEL_PX = (750, 400)
"""Width and height of one curves panel (legend included); panels are laid out two per row."""

ANNOTATE_MAX_CELLS = 800
"""The heatmap writes each loss in its cell when it has at most this many cells."""

_TITLE_PX = 50
_ROW_PX = 25
_DENSE_ROW_PX = 12.5
_DENSE_ROWS = 120
_GRID = 25
_MISSING_COLOUR = "#d9d9d9"

# ------------------------------------------------------------------------------------------------------- ratios


def analysed_ratios(sensitivities: Mapping[str, Mapping[float, float]]) -> list[float]:
    """Every ratio measured for at least one parameter, ascending."""
    return sorted({normalise_ratio(r) for curve in sensitivities.values() for r in curve})


def resolve_ratio(sensitivities: Mapping[str, Mapping[float, float]], ratio: float | None, source: str = "") -> float:
    """Return ``ratio`` normalised, or the largest analysed ratio when it is ``None``.

    Raises:
        ConfigError: ``ratio`` was not analysed for any parameter.
    """
    ratios = analysed_ratios(sensitivities)
    if ratio is None:
        return ratios[-1]
    key = normalise_ratio(ratio)
    if key not in ratios:
        where = f" in {source}" if source else ""
        raise ConfigError(
            f"Ratio {ratio:g} was not analysed{where}; choose one of {', '.join(f'{r:g}' for r in ratios)}."
        )
    return key


def short_name(name: str) -> str:
    """A parameter name without its trailing ``.weight``, for legends and axis labels."""
    return name.removesuffix(".weight")


# ----------------------------------------------------------------------------------------------------- colours


def loss_colouring(values: Sequence[float]) -> tuple[Colormap, Normalize]:
    """Colours for losses: white at 0, red for losses, blue for gains (negative losses).

    Without negative values only the white-to-red half of the colormap is used, so the whole range shows losses;
    with them the scale is symmetric around 0 so that equal magnitudes look equally strong.
    """
    finite = [v for v in values if math.isfinite(v)]
    low, high = min(finite, default=0.0), max(finite, default=0.0)
    diverging = colormaps["RdBu_r"]
    if low < 0:
        bound = max(-low, high)
        return diverging, Normalize(-bound, bound)
    half = ListedColormap(diverging(np.linspace(0.5, 1.0, 256)), name="loss")
    return half, Normalize(0.0, high if high > 0 else 1.0)


def is_dark(rgba: Sequence[float]) -> bool:
    """Whether white text reads better than black on this colour (relative luminance below about 0.45)."""
    red, green, blue = rgba[:3]
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.45


# ------------------------------------------------------------------------------------------------------- sizes


def _grid(pixels: float) -> int:
    """Round a size up to the 25-pixel grid, so that inches * DPI is exact and the PNG has exactly this size."""
    return math.ceil(pixels / _GRID - 1e-9) * _GRID


def _row_px(rows: int) -> float:
    return _ROW_PX if rows <= _DENSE_ROWS else _DENSE_ROW_PX


def _name_fontsize(rows: int) -> int:
    """Font size of the parameter names (and heatmap values): smaller when rows are dense."""
    return 7 if rows <= _DENSE_ROWS else 5


def curves_size(n_params: int) -> tuple[int, int]:
    """Pixel size of the curves plot: panels of 750 x 400 px, two per row (one when there is a single panel),
    plus a 50 px title band."""
    panels = max(1, math.ceil(n_params / LINES_PER_PANEL))
    columns = min(2, panels)
    rows = math.ceil(panels / columns)
    return CURVES_PANEL_PX[0] * columns, CURVES_PANEL_PX[1] * rows + _TITLE_PX


def heatmap_size(n_params: int, n_ratios: int) -> tuple[int, int]:
    """Pixel size of the heatmap: 75 px per ratio plus 375 px for names and colour bar (at least 650 px wide);
    25 px per parameter (12.5 px beyond 120 parameters) plus 150 px, at least 300 px high; both rounded up to
    a multiple of 25 px."""
    width = max(650, _grid(375 + 75 * n_ratios))
    height = max(300, _grid(150 + _row_px(n_params) * n_params))
    return width, height


def savings_size(n_params: int) -> tuple[int, int]:
    """Pixel size of the savings plot: 1200 px wide; 25 px per parameter (12.5 px beyond 120) plus 175 px, at
    least 400 px high, rounded up to a multiple of 25 px."""
    return 1200, max(400, _grid(175 + _row_px(n_params) * n_params))


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height stored in a PNG's header."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


# ------------------------------------------------------------------------------------------------- figure helpers


@contextmanager
def _default_style() -> Iterator[None]:
    """Matplotlib's default style whatever the user's matplotlibrc says, and never a tight bounding box."""
    with matplotlib.style.context("default"), matplotlib.rc_context({"savefig.bbox": "standard"}):
        yield


def _new_figure(size: tuple[int, int]) -> Figure:
    figure = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI, layout="constrained", facecolor="white")
    FigureCanvasAgg(figure)
    return figure


def _save_png(figure: Figure, path: str | os.PathLike[str]) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, facecolor="white", metadata={"Software": None})
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def _measured(sensitivities: Mapping[str, Mapping[float, float]]) -> dict[str, dict[float, float]]:
    measured = {name: dict(sorted(curve.items())) for name, curve in sensitivities.items() if curve}
    if not measured:
        raise ValueError("there are no measured losses to plot")
    return measured


# ------------------------------------------------------------------------------------------------------- plots


def plot_curves(
    sensitivities: Mapping[str, Mapping[float, float]],
    path: str | os.PathLike[str],
    target: TargetRatios | None = None,
    label: str = "loss",
) -> Path:
    """Plot loss against pruned ratio, one line per parameter, in panels of at most eight in model order.

    Args:
        sensitivities: ``{param: {ratio: loss}}`` in model order.
        path: The PNG to write (size: :func:`curves_size`).
        target: Draws the target loss as a dashed line and marks each parameter's derived ratio on it, also given
            in the legend.
        label: What the loss is, for the y axis.

    Raises:
        ValueError: No parameter has a measured loss.
    """
    measured = _measured(sensitivities)
    names = list(measured)
    derived = target.ratios if target is not None else {}
    target_loss = target.loss if target is not None else None
    chunks = [names[i : i + LINES_PER_PANEL] for i in range(0, len(names), LINES_PER_PANEL)]
    size = curves_size(len(names))
    columns = min(2, len(chunks))
    rows = math.ceil(len(chunks) / columns)
    all_ratios = analysed_ratios(measured)
    colours = colormaps["tab10"].colors  # type: ignore[attr-defined]  # tab10 is a ListedColormap
    with _default_style():
        figure = _new_figure(size)
        axes = figure.subplots(rows, columns, squeeze=False).ravel()
        title = f"{label} per pruned ratio (each layer pruned alone)"
        if target_loss is not None:
            title += f"; target {target_loss:g} and derived ratio marked"
        figure.suptitle(title, fontsize=12)
        for index, ax in enumerate(axes):
            if index >= len(chunks):
                ax.set_axis_off()
                continue
            chunk = chunks[index]
            first = index * LINES_PER_PANEL + 1
            ax.set_title(f"parameters {first}-{first + len(chunk) - 1} of {len(names)} (model order)", fontsize=9)
            ax.axhline(0.0, color="#999999", linewidth=0.6)
            for number, name in enumerate(chunk):
                colour = colours[number % len(colours)]
                curve = measured[name]
                legend = short_name(name)
                if name in derived:
                    legend += f" (ratio {derived[name]:.3f})"
                ax.plot(list(curve), list(curve.values()), marker="o", markersize=3.5, color=colour, label=legend)
                if name in derived:
                    ax.plot(
                        [derived[name]], [target_loss], marker="v", markersize=8, color=colour,
                        markeredgecolor="black", markeredgewidth=0.6, linestyle="none",
                    )  # fmt: skip
            if target_loss is not None:
                ax.axhline(target_loss, color="black", linestyle="--", linewidth=1.0, label=f"target {target_loss:g}")
            ax.set_xlim(0.0, all_ratios[-1] * 1.05 if all_ratios[-1] > 0 else 1.0)
            ax.set_xlabel("pruned ratio (fraction of the unit's channels removed)", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, color="#e5e5e5", linewidth=0.5)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
        return _save_png(figure, path)


def plot_heatmap(
    sensitivities: Mapping[str, Mapping[float, float]],
    path: str | os.PathLike[str],
    label: str = "loss",
) -> Path:
    """Plot the losses as a parameters x ratios heatmap in model order, annotated when it has few enough cells.

    Args:
        sensitivities: ``{param: {ratio: loss}}`` in model order; ratios a parameter lacks are grey.
        path: The PNG to write (size: :func:`heatmap_size`).
        label: What the loss is, for the colour bar.

    Raises:
        ValueError: No parameter has a measured loss.
    """
    measured = _measured(sensitivities)
    names = list(measured)
    ratios = analysed_ratios(measured)
    matrix = np.array([[measured[n].get(r, np.nan) for r in ratios] for n in names], dtype=float)
    cmap, norm = loss_colouring(matrix[np.isfinite(matrix)].tolist())
    cmap = cmap.with_extremes(bad=_MISSING_COLOUR)
    fontsize = _name_fontsize(len(names))
    with _default_style():
        figure = _new_figure(heatmap_size(len(names), len(ratios)))
        ax = figure.subplots()
        image = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios], fontsize=8)
        ax.set_yticks(range(len(names)), [short_name(n) for n in names], fontsize=fontsize)
        ax.set_xlabel("pruned ratio", fontsize=9)
        ax.set_title(f"{label} per layer and pruned ratio (model order, top to bottom)", fontsize=10)
        ax.tick_params(length=0)
        if matrix.size <= ANNOTATE_MAX_CELLS:
            for row, column in np.ndindex(matrix.shape):
                value = matrix[row, column]
                if math.isfinite(value):
                    colour = "white" if is_dark(cmap(norm(value))) else "black"
                    ax.text(column, row, f"{value:.3f}", ha="center", va="center", fontsize=fontsize, color=colour)
        colourbar = figure.colorbar(image, ax=ax, fraction=0.08, pad=0.02)
        colourbar.set_label(f"{label} (white: none, red: loss, blue: gain)", fontsize=8)
        colourbar.ax.tick_params(labelsize=7)
        return _save_png(figure, path)


def plot_savings(
    sensitivities: Mapping[str, Mapping[float, float]],
    path: str | os.PathLike[str],
    ratio: float | None = None,
    macs_saved: Mapping[str, float] | None = None,
    params_saved: Mapping[str, float] | None = None,
    label: str = "loss",
) -> Path:
    """Plot each layer's loss at one ratio beside the share of the dense model's MACs its pruning saves.

    Args:
        sensitivities: ``{param: {ratio: loss}}`` in model order.
        path: The PNG to write (size: :func:`savings_size`).
        ratio: The ratio to compare at; default the largest analysed one.
        macs_saved: ``{param: fraction of dense MACs removed}`` at ``ratio``; when ``None`` or empty the second
            panel holds a note that the analysis file records no MACs.
        params_saved: ``{param: fraction of dense parameters removed}``, drawn as markers over the MACs bars.
        label: What the loss is, for the axis.

    Raises:
        ValueError: No parameter has a measured loss.
        ConfigError: ``ratio`` was not analysed.
    """
    measured = _measured(sensitivities)
    names = list(measured)
    ratio = resolve_ratio(measured, ratio)
    losses = np.array([measured[n].get(ratio, np.nan) for n in names], dtype=float)
    positions = np.arange(len(names))
    cmap, norm = loss_colouring(losses[np.isfinite(losses)].tolist())
    fontsize = _name_fontsize(len(names))
    with _default_style():
        figure = _new_figure(savings_size(len(names)))
        loss_ax, cost_ax = figure.subplots(1, 2, sharey=True, width_ratios=[1.0, 1.0])
        figure.suptitle(f"Each layer pruned alone at ratio {ratio:g}: {label} against the compute it saves")
        bar_colours = [cmap(norm(v)) if math.isfinite(v) else _MISSING_COLOUR for v in losses]
        loss_ax.barh(positions, np.nan_to_num(losses), color=bar_colours, edgecolor="#555555", linewidth=0.4)
        loss_ax.axvline(0.0, color="#555555", linewidth=0.6)
        loss_ax.set_yticks(positions, [short_name(n) for n in names], fontsize=fontsize)
        loss_ax.set_ylim(len(names) - 0.5, -0.5)  # model order from the top, no empty margin rows
        loss_ax.set_xlabel(f"{label} at ratio {ratio:g}", fontsize=8)
        loss_ax.set_title("cost: loss (lower is better)", fontsize=9)
        loss_ax.grid(True, axis="x", color="#e5e5e5", linewidth=0.5)
        loss_ax.tick_params(axis="x", labelsize=7)
        if macs_saved:
            macs = np.array([100.0 * macs_saved.get(n, np.nan) for n in names], dtype=float)
            cost_ax.barh(positions, np.nan_to_num(macs), color="#4c9a6a", label="MACs saved")
            if params_saved:
                share = np.array([100.0 * params_saved.get(n, np.nan) for n in names], dtype=float)
                cost_ax.plot(share, positions, "D", color="#333333", markersize=3.5, label="params saved")
            cost_ax.set_xlabel("% of the dense model's MACs (bars) and params (markers) saved", fontsize=8)
            cost_ax.set_title("benefit: compute saved (higher is better)", fontsize=9)
            cost_ax.grid(True, axis="x", color="#e5e5e5", linewidth=0.5)
            cost_ax.tick_params(axis="x", labelsize=7)
            cost_ax.tick_params(axis="y", left=False)
            cost_ax.legend(fontsize=7, loc="lower right")
        else:
            cost_ax.set_axis_off()
            cost_ax.text(
                0.5, 0.5,
                "MACs saved: not available.\nThis analysis file's sidecar records no MACs per variant\n"
                "(written by an older version, or missing); rerun the analysis to add them.",
                ha="center", va="center", fontsize=10, color="#555555", transform=cost_ax.transAxes, wrap=True,
            )  # fmt: skip
        return _save_png(figure, path)

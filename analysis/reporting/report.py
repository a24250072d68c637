"""The self-contained HTML report of an analysis file, and the driver that writes it with its plots.

:func:`write_report` loads the analysis file and its JSON sidecar (:func:`load_analysis`), draws the three PNGs
(:mod:`analysis.reporting.plots`) and writes ``<stem>.report.html``: run summary, loss table, unprunable convs, the
plots
and the config. The HTML embeds the PNGs as data URIs and needs no network, script or other file.
"""

from __future__ import annotations

import base64
import html
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from analysis.errors import AnalysisFileError
from analysis.io.results import (
    Sensitivities,
    atomic_write_text,
    load_sensitivities,
    load_sidecar,
    normalise_ratio,
    sidecar_path,
)
from analysis.planning.ratios import explain_target_loss, get_ratios_by_loss
from analysis.reporting.plots import (
    LINES_PER_PANEL,
    analysed_ratios,
    is_dark,
    loss_colouring,
    plot_curves,
    plot_heatmap,
    plot_savings,
    png_size,
    resolve_ratio,
)


@dataclass(frozen=True)
class ReportFiles:
    """The files :func:`write_report` wrote."""

    curves: Path
    heatmap: Path
    savings: Path
    html: Path


@dataclass(frozen=True)
class AnalysisData:
    """An analysis file as the report reads it: the measured losses and, when present, the JSON sidecar."""

    path: Path
    sensitivities: Sensitivities
    sidecar: Mapping[str, Any] | None


# ------------------------------------------------------------------------------------------------------ loading


def load_analysis(analysis_file: str | os.PathLike[str]) -> AnalysisData:
    """Load an analysis file and its sidecar for reporting; parameters without any measured ratio are left out.

    Raises:
        AnalysisFileError: The file is missing, unreadable, or holds no measured loss.
    """
    path = Path(analysis_file)
    if not path.is_file():
        raise AnalysisFileError(f"Analysis file {path} does not exist; pass the analysis_file a sensitivity run wrote.")
    sensitivities = {name: curve for name, curve in load_sensitivities(path).items() if curve}
    if not sensitivities:
        raise AnalysisFileError(
            f"Analysis file {path} holds no measured losses, so there is nothing to report; run the analysis (at "
            "least one layer and ratio) first."
        )
    return AnalysisData(path, sensitivities, load_sidecar(path))


def _dict(value: Any, *keys: str) -> dict[str, Any]:
    """``value[keys[0]][keys[1]]...`` when it and every level on the way are dicts, else an empty dict (sidecars
    from older versions lack some sections)."""
    found = value if isinstance(value, dict) else {}
    for key in keys:
        found = found.get(key)
        found = found if isinstance(found, dict) else {}
    return found


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (bools excluded), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def loss_label(sidecar: Mapping[str, Any] | None) -> str:
    """Say what the stored loss is, e.g. ``"relative top1 loss"``, from the sidecar's fingerprint settings."""
    settings = _dict(sidecar, "fingerprint", "settings")
    metric = settings.get("metric")
    if not isinstance(metric, str):
        return "loss"
    mode = settings.get("metric_mode")
    return f"{mode} {metric} loss" if isinstance(mode, str) else f"{metric} loss"


def variant(sidecar: Mapping[str, Any] | None, name: str, ratio: float) -> dict[str, Any]:
    """The sidecar's record of ``name`` pruned at ``ratio`` (metrics, channels, MACs...), or an empty dict."""
    variants = _dict(sidecar, "params", name, "variants")
    found = variants.get(f"{normalise_ratio(ratio):g}")
    if found is None:  # keys written by another formatting
        for key, value in variants.items():
            try:
                if normalise_ratio(float(key)) == normalise_ratio(ratio):
                    found = value
                    break
            except ValueError:
                continue
    return _dict(found)


def savings_at(data: AnalysisData, ratio: float, key: str = "macs_reduction") -> dict[str, float] | None:
    """Per parameter, the fraction of the dense model's MACs (or ``key``) saved by pruning it alone at ``ratio``.

    Returns:
        ``{param: fraction}`` for the parameters whose variant records ``key``; ``None`` when none does (a
        sidecar written before costs were recorded, or no sidecar).
    """
    found = {}
    for name in data.sensitivities:
        value = _number(variant(data.sidecar, name, ratio).get(key))
        if value is not None:
            found[name] = value
    return found or None


def default_target_loss(sidecar: Mapping[str, Any] | None) -> float | None:
    """The ``target_loss`` of the run's config (``SensitivityAnalysis.target_loss``, or the API's), if any."""
    config = _dict(sidecar, "config")
    return _number(_dict(config.get("SensitivityAnalysis")).get("target_loss", config.get("target_loss")))


# -------------------------------------------------------------------------------------------------------- HTML

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #222;
       margin: 24px auto; max-width: 1560px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
p.note { color: #555; margin: 4px 0 10px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 8px; vertical-align: top; }
th { background: #f3f3f3; text-align: left; }
table.summary th { width: 220px; }
table.losses td.num, table.losses th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.losses td.name { font-family: ui-monospace, "DejaVu Sans Mono", monospace; white-space: nowrap; }
td.missing { background: #d9d9d9; color: #666; text-align: center; }
.scroll { overflow-x: auto; }
figure { margin: 16px 0; } figcaption { color: #555; margin-top: 4px; }
figure img { max-width: 100%; height: auto; border: 1px solid #e0e0e0; }
pre { background: #f7f7f7; border: 1px solid #e0e0e0; padding: 10px; overflow-x: auto; font-size: 12px; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
""".strip()


def _hex(rgba: Sequence[float]) -> str:
    return "#" + "".join(f"{round(channel * 255):02x}" for channel in rgba[:3])


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, spec: str = ".4f") -> str:
    number = _number(value)
    return "-" if number is None else format(number, spec)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100.0 * fraction:.2f}%"


def _count(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "-"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= limit:
            return f"{number / limit:.3g}{suffix} ({int(number):,})"
    return f"{int(number):,}"


def _table(rows: Sequence[tuple[str, str]], css_class: str = "summary") -> str:
    """A two-column table; cells are already-escaped HTML."""
    body = "".join(f"<tr><th>{key}</th><td>{value}</td></tr>" for key, value in rows)
    return f'<table class="{css_class}">{body}</table>'


def _model_description(config: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> tuple[str, str]:
    """(model, data) as escaped HTML, from the CLI's ``Global`` block or the Python API's config."""
    glob = _dict(config.get("Global"))
    model_hash = fingerprint.get("model")
    data_hash = fingerprint.get("data")
    hash_note = f' <span class="note">(fingerprint {_e(str(model_hash)[:12])})</span>' if model_hash else ""
    if glob:
        parts = []
        if glob.get("arch"):
            kwargs = _dict(glob.get("arch_kwargs"))
            call = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            parts.append(f"<code>{_e(glob['arch'])}({_e(call)})</code>")
        files = [glob.get(k) for k in ("model_filename", "params_filename") if glob.get(k)]
        location = glob.get("model_dir")
        if files or location:
            shown = [str(Path(str(location)) / str(f)) if location else str(f) for f in files] or [str(location)]
            parts.append("files " + ", ".join(f"<code>{_e(f)}</code>" for f in shown))
        if glob.get("weights"):
            parts.append(f"weights <code>{_e(glob['weights'])}</code>")
        model = "; ".join(parts) or "-"
        data_dir = glob.get("data_dir")
        data = f"<code>{_e(data_dir)}</code>" if data_dir else "-"
        if glob.get("val_list") and data_dir:
            data += f" (list <code>{_e(glob['val_list'])}</code>)"
        if glob.get("max_samples"):
            data += f", at most {_e(glob['max_samples'])} images"
        return model + hash_note, data
    if config.get("api"):
        data = "batches passed to the Python API" if data_hash else "an evaluation function passed to the Python API"
        return f"passed to the Python API (<code>{_e(config['api'])}</code>){hash_note}", data
    return ("not recorded" + hash_note if model_hash else "not recorded"), "not recorded"


def _evaluation_seconds(data: AnalysisData) -> float | None:
    """Seconds spent evaluating variants, each shared variant (coupled parameters) counted once."""
    params = _dict(data.sidecar, "params")
    seen: set[tuple[tuple[str, ...], float]] = set()
    total, found = 0.0, False
    for name, curve in data.sensitivities.items():
        coupled = _dict(params.get(name)).get("coupled_params")
        members = tuple(sorted({name, *(coupled if isinstance(coupled, list) else [])}))
        for ratio in curve:
            seconds = _number(variant(data.sidecar, name, ratio).get("seconds"))
            if seconds is None or (members, ratio) in seen:
                continue
            seen.add((members, ratio))
            total += seconds
            found = True
    return total if found else None


def _loss_definition(sidecar: Mapping[str, Any] | None, label: str) -> str:
    """How the stored loss was computed from the metric (engine.relative_loss); positive means worse."""
    settings = _dict(sidecar, "fingerprint", "settings")
    metric = settings.get("metric")
    if not isinstance(metric, str):
        return "as stored in the analysis file (no sidecar says which metric); positive means worse"
    worse = f"pruned {metric} - baseline {metric}" if metric == "ce" else f"baseline {metric} - pruned {metric}"
    if settings.get("metric_mode") == "absolute":
        return f"{label} = {worse}; positive means worse"
    return f"{label} = ({worse}) / |baseline {metric}|; positive means worse"


def _summary(data: AnalysisData, target_loss: float | None, label: str) -> str:
    sidecar = _dict(data.sidecar)
    config = _dict(sidecar.get("config"))
    fingerprint = _dict(sidecar.get("fingerprint"))
    settings = _dict(fingerprint.get("settings"))
    baseline = _dict(sidecar.get("baseline"))
    tool = _dict(sidecar.get("tool"))
    cost = _dict(sidecar.get("cost"))
    model, dataset = _model_description(config, fingerprint)
    ratios = analysed_ratios(data.sensitivities)
    rows = [
        ("analysis file", f"<code>{_e(data.path)}</code>"),
        ("model", model),
        ("data", dataset),
    ]
    if baseline:
        metrics = ", ".join(
            f"{key} {_fmt(baseline.get(key))}"
            for key in ("top1", "top5", "ce")
            if _number(baseline.get(key)) is not None
        )
        rows.append(("baseline", _e(metrics or "-")))
        rows.append(("images evaluated", _e(_count(baseline.get("images")))))
    rows.append(("loss", _e(_loss_definition(data.sidecar, label))))
    if settings.get("criterion"):
        reduction = f", group reduction {settings['group_reduction']}" if settings.get("group_reduction") else ""
        rows.append(("channel ranking", _e(f"{settings['criterion']}{reduction}")))
    if settings.get("round_to", 1) != 1:
        rows.append(("channel rounding", _e(f"every pruned group keeps a multiple of {settings['round_to']} channels")))
    if settings.get("adaptive_bn"):
        rows.append(
            (
                "adaptive BN",
                "yes: before each variant was evaluated, the BatchNorm statistics its removal "
                "changes were re-estimated on the calibration images (numbers differ from plain sensitivities)",
            )
        )
    precision = settings.get("precision")
    if isinstance(precision, list) and len(precision) == 2:
        rows.append(("adaptive precision", _e(f"+-{precision[0]} (95%), seed {precision[1]}")))
    rows.append(("ratios analysed", _e(", ".join(f"{r:g}" for r in ratios))))
    unprunable = _dict(sidecar.get("unprunable"))
    rows.append(("layers", _e(f"{len(data.sensitivities)} analysed, {len(unprunable)} not prunable")))
    if cost:
        convention = cost.get("convention") or "MACs"
        rows.append(("dense model", _e(f"{_count(cost.get('macs'))} MACs, {_count(cost.get('params'))} params")))
        rows.append(("MACs convention", _e(convention)))
    seconds = _evaluation_seconds(data)
    if seconds is not None:
        base = _number(baseline.get("seconds"))
        extra = f" (+ {base:.1f} s baseline)" if base is not None else ""
        rows.append(("evaluation time", _e(f"{seconds:.1f} s summed over variants{extra}")))
    if target_loss is not None:
        rows.append(("target loss", _e(explain_target_loss(target_loss))))
    if tool:
        rows.append(("tool", _e(f"{tool.get('name', '')} {tool.get('version', '')}".strip())))
    if sidecar.get("saved_at"):
        rows.append(("saved at", _e(sidecar["saved_at"])))
    if config.get("source"):
        rows.append(("config file", f"<code>{_e(config['source'])}</code>"))
    return _table(rows)


def _cell_title(record: Mapping[str, Any]) -> str:
    """Tooltip of a loss cell: the variant's metrics and what was removed."""
    parts = [f"{key} {_fmt(record.get(key))}" for key in ("top1", "top5", "ce") if _number(record.get(key)) is not None]
    if _number(record.get("channels_removed")) is not None:
        parts.append(f"{int(record['channels_removed'])}/{record.get('channels', '?')} channels removed")
    interval = record.get("interval")
    if isinstance(interval, list) and len(interval) == 2:
        parts.append(f"95% interval [{_fmt(interval[0])}, {_fmt(interval[1])}]")
    if _number(record.get("macs_reduction")) is not None:
        parts.append(f"MACs saved {_percent(record['macs_reduction'])}")
    if _number(record.get("params_reduction")) is not None:
        parts.append(f"params saved {_percent(record['params_reduction'])}")
    if record.get("mode"):
        parts.append(f"mode {record['mode']}")
    return "; ".join(parts)


def _loss_table(data: AnalysisData, target_loss: float | None, ratio: float, label: str) -> str:
    ratios = analysed_ratios(data.sensitivities)
    values = [loss for curve in data.sensitivities.values() for loss in curve.values()]
    cmap, norm = loss_colouring(values)
    derived = get_ratios_by_loss(data.sensitivities, target_loss) if target_loss is not None else {}
    macs = savings_at(data, ratio, "macs_reduction")
    params_saved = savings_at(data, ratio, "params_reduction")
    info = _dict(data.sidecar, "params")
    head = ['<th class="num">#</th>', "<th>parameter</th>", "<th>shape</th>"]
    names = list(data.sensitivities)
    extra: list[tuple[str, dict[str, str]]] = []  # (header, {param: cell text}) after the loss columns
    if derived:
        extra.append((f"ratio at target {target_loss:g}", {name: f"{derived[name]:.4f}" for name in names}))
    for key, saved in (("MACs", macs), ("params", params_saved)):
        if saved:
            extra.append((f"{key} saved at {ratio:g}", {name: _percent(saved.get(name)) for name in names}))
    head += [f'<th class="num">{_e(text)}</th>' for text in [f"{r:g}" for r in ratios] + [h for h, _ in extra]]
    rows = []
    for number, (name, curve) in enumerate(data.sensitivities.items(), start=1):
        shape = _dict(info.get(name)).get("shape")
        shape_text = "x".join(str(s) for s in shape) if isinstance(shape, list) else "-"
        cells = [f'<td class="num">{number}</td>', f'<td class="name">{_e(name)}</td>', f"<td>{_e(shape_text)}</td>"]
        for r in ratios:
            if r not in curve:
                cells.append('<td class="missing">-</td>')
                continue
            rgba = cmap(norm(curve[r]))
            style = f"background:{_hex(rgba)};color:{'#fff' if is_dark(rgba) else '#000'}"
            title = _cell_title(variant(data.sidecar, name, r))
            title_attr = f' title="{_e(title)}"' if title else ""
            cells.append(f'<td class="num" style="{style}"{title_attr}>{_e(f"{curve[r]:.4f}")}</td>')
        cells += [f'<td class="num">{_e(column[name])}</td>' for _, column in extra]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    notes = [
        f"Each cell is the {_e(label)} with that layer alone pruned at that ratio (white: no loss, red: loss, blue: "
        "gain); hover a cell for its metrics. Rows are in model order."
    ]
    if derived:
        notes.append(
            f"The ratio at target is PaddleSlim's <code>get_ratios_by_loss</code> rule for target {_e(target_loss)}."
        )
    if macs:
        convention = _dict(data.sidecar, "cost").get("convention") or "MACs of Conv and Linear layers"
        notes.append(f"MACs and params saved are shares of the dense model ({_e(convention)}).")
    table = f'<table class="losses"><thead><tr>{"".join(head)}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<p class="note">{" ".join(notes)}</p><div class="scroll">{table}</div>'


def _unprunable_table(sidecar: Mapping[str, Any] | None) -> str:
    unprunable = _dict(sidecar, "unprunable")
    if not unprunable:
        return '<p class="note">Every conv weight was prunable (or the sidecar does not say).</p>'
    rows = "".join(f'<tr><td class="name">{_e(n)}</td><td>{_e(r)}</td></tr>' for n, r in unprunable.items())
    return (
        f'<table class="losses"><thead><tr><th>parameter</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table>'
    )


def _prediction(plan: Mapping[str, Any]) -> str:
    """What a plan's predicted loss is."""
    if plan.get("method") == "measured":
        return "measured for this plan by the search, all groups pruned at once"
    return "sum of the single-layer losses"


def _plan_section(sidecar: Mapping[str, Any] | None) -> str:
    """The pruning plan (``run.py plan``/``verify``): its groups, predicted against measured loss, cost and speed."""
    plan = _dict(sidecar, "plan")
    if not plan:
        return ""
    verification = _dict(plan.get("verification"))
    target = _number(plan.get("target"))
    what = (f"budget: {_e(plan.get('measure'))} reduced by at least {_percent(target)}" if target is not None
            else f"ratios from <code>{_e(plan.get('source'))}</code>")  # fmt: skip
    rows = [("plan", what), ("method", _e(plan.get("method_description") or plan.get("method", "-"))),
            ("predicted loss", _e(f"{_fmt(plan.get('predicted_loss'))} ({_prediction(plan)})"))]  # fmt: skip
    if verification:
        measured, baseline, pruned = (_dict(verification.get(k)) for k in ("measured_loss", "baseline", "pruned"))
        reestimated = _dict(verification.get("reestimated"))
        again, after = _dict(reestimated.get("measured_loss")), _dict(reestimated.get("metrics"))
        for metric in ("top1", "top5"):
            if metric in measured:
                rows.append((f"measured {metric} loss, raw", _e(
                    f"{_fmt(measured[metric])} ({metric} {_fmt(baseline.get(metric))} -> {_fmt(pruned.get(metric))}, "
                    "all groups pruned at once, the dense model's BatchNorm statistics)")))  # fmt: skip
            if metric in again:
                rows.append((f"measured {metric} loss, BatchNorm re-estimated", _e(
                    f"{_fmt(again[metric])} ({metric} {_fmt(baseline.get(metric))} -> {_fmt(after.get(metric))}, "
                    f"statistics of {len(reestimated.get('batchnorm_layers') or [])} layers re-estimated on "
                    f"{reestimated.get('calibration_images')} calibration images)")))  # fmt: skip
        if not reestimated:
            rows.append(("BatchNorm re-estimated", "not measured (no calibration images; see Global.calib_list)"))
        for key in ("macs", "params", "checkpoint_bytes"):
            pair = _dict(verification.get(key))
            rows.append((key.replace("_", " "), _e(f"{_count(pair.get('dense'))} -> {_count(pair.get('pruned'))}")))
        for batch, times in _dict(verification.get("latency_ms")).items():
            dense, fast = _number(_dict(times).get("dense")), _number(_dict(times).get("pruned"))
            speedup = f", {dense / fast:.2f}x" if dense and fast else ""
            rows.append((f"latency {_e(batch.replace('_', ' '))}",
                         _e(f"{_fmt(dense, '.2f')} ms -> {_fmt(fast, '.2f')} ms{speedup} "
                            f"(median, {verification.get('device')})")))  # fmt: skip
    else:
        after = _dict(plan.get("pruned"))
        computed = f"{_count(after.get('macs'))}, {_count(after.get('params'))}"
        rows.append(("MACs, params after", _e(f"{computed} (computed; run.py verify measures the pruned model)")))
    groups = "".join(
        f'<tr><td class="name">{_e(", ".join(g.get("members", [])))}</td><td>{_fmt(g.get("ratio"))}</td>'
        f"<td>{_e(g.get('channels_removed'))}/{_e(g.get('channels'))}</td><td>{_fmt(g.get('predicted_loss'))}</td></tr>"
        for g in (plan.get("groups") or []) if isinstance(g, dict)
    )  # fmt: skip
    head = "<th>group (params sharing one ratio)</th><th>ratio</th><th>channels removed</th><th>predicted loss</th>"
    table = f'<table class="losses"><thead><tr>{head}</tr></thead><tbody>{groups}</tbody></table>'
    return "<h2>Pruning plan</h2>" + _table(rows) + f'<div class="scroll">{table}</div>'


def _figure(png: bytes, alt: str, caption: str) -> str:
    width, height = png_size(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img src="{uri}" width="{width}" height="{height}" alt="{_e(alt)}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def render_html(
    data: AnalysisData,
    curves_png: bytes,
    heatmap_png: bytes,
    savings_png: bytes,
    target_loss: float | None = None,
    ratio: float | None = None,
) -> str:
    """Return the self-contained HTML report: summary, loss table, unprunable convs, the plots and the config.

    Args:
        data: The analysis file and its sidecar (:func:`load_analysis`).
        curves_png: The curves plot, embedded as a data URI (likewise the next two).
        heatmap_png: The heatmap.
        savings_png: The savings plot.
        target_loss: Adds the derived ratios to the loss table and explains the target.
        ratio: The ratio of the MACs columns; default the largest analysed one.

    Raises:
        ConfigError: ``ratio`` was not analysed.
    """
    label = loss_label(data.sidecar)
    ratio = resolve_ratio(data.sensitivities, ratio, str(data.path))
    sidecar = _dict(data.sidecar)
    no_sidecar = (
        ""
        if data.sidecar is not None
        else f'<p class="note">No sidecar ({_e(sidecar_path(data.path).name)}) was found, so the model, data, '
        "baseline and per-variant details are not known; only the losses are shown.</p>"
    )
    if sidecar.get("config"):
        config_text = yaml.safe_dump(sidecar["config"], sort_keys=False, allow_unicode=True, width=110)
        config = f"<pre>{_e(config_text)}</pre>"
    else:
        config = '<p class="note">The configuration was not recorded.</p>'
    title = f"Sensitivity report: {data.path.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        no_sidecar,
        "<h2>Run</h2>",
        _summary(data, target_loss, label),
        "<h2>Losses</h2>",
        _loss_table(data, target_loss, ratio, label),
        "<h2>Plots</h2>",
        _figure(
            curves_png,
            "loss curves per layer",
            f"{label} against pruned ratio, in panels of {LINES_PER_PANEL} layers in model order"
            + (f"; dashed: target {target_loss:g}, triangles: derived ratios" if target_loss is not None else "."),
        ),
        _figure(heatmap_png, "loss heatmap", f"{label} per layer (rows, model order) and pruned ratio (columns)."),
        _figure(
            savings_png,
            "loss against MACs saved",
            f"{label} at ratio {ratio:g} beside the share of the dense model's MACs that pruning the layer saves.",
        ),
        _plan_section(data.sidecar),
        "<h2>Not prunable</h2>",
        _unprunable_table(data.sidecar),
        "<h2>Configuration</h2>",
        config,
        "</body></html>",
    ]
    return "\n".join(part for part in parts if part) + "\n"


# ------------------------------------------------------------------------------------------------------ driver


def report_paths(analysis_file: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> ReportFiles:
    """Where :func:`write_report` writes: ``<stem>.curves.png`` etc. in ``out_dir`` (default: beside the file)."""
    path = Path(analysis_file)
    directory = Path(out_dir) if out_dir is not None else path.parent
    stem = path.stem
    return ReportFiles(
        curves=directory / f"{stem}.curves.png",
        heatmap=directory / f"{stem}.heatmap.png",
        savings=directory / f"{stem}.savings.png",
        html=directory / f"{stem}.report.html",
    )


def write_report(
    analysis_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    target_loss: float | None = None,
    ratio: float | None = None,
) -> ReportFiles:
    """Write the three plots and the self-contained HTML report of an analysis file.

    Args:
        analysis_file: The analysis pickle; its sidecar (``<file>.json``) adds details when present.
        out_dir: Where to write (created if needed); default the analysis file's directory.
        target_loss: Marks the derived ratios; default the run's ``target_loss`` from the sidecar's config.
        ratio: The ratio at which the savings plot and table compare loss and MACs; default the largest analysed.

    Returns:
        The paths written (:func:`report_paths`).

    Raises:
        AnalysisFileError: The analysis file or its sidecar is missing, unreadable or holds no measured loss.
        ConfigError: ``ratio`` was not analysed.
    """
    data = load_analysis(analysis_file)
    if target_loss is None:
        target_loss = default_target_loss(data.sidecar)
    ratio = resolve_ratio(data.sensitivities, ratio, str(data.path))
    files = report_paths(analysis_file, out_dir)
    label = loss_label(data.sidecar)
    plot_curves(data.sensitivities, files.curves, target_loss, label)
    plot_heatmap(data.sensitivities, files.heatmap, label)
    plot_savings(
        data.sensitivities,
        files.savings,
        ratio,
        savings_at(data, ratio, "macs_reduction"),
        savings_at(data, ratio, "params_reduction"),
        label,
    )
    text = render_html(
        data,
        files.curves.read_bytes(),
        files.heatmap.read_bytes(),
        files.savings.read_bytes(),
        target_loss,
        ratio,
    )
    atomic_write_text(files.html, text)
    return files

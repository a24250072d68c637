"""The self-contained HTML report of an analysis file, and the driver that writes it with its plots.

:func:`write_report` takes the analysis record (the file and its JSON sidecar, :func:`load_analysis`), draws the
three PNGs (:mod:`analysis.reporting.plots`) and writes ``<stem>.report.html``: run summary, loss table, unprunable
convs, the plots and the config. The HTML embeds the PNGs as data URIs and needs no network, script or other file.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from analysis.config import SEARCHED_PLAN_METHODS
from analysis.errors import AnalysisFileError
from analysis.io.atomic import atomic_write_text
from analysis.io.record import AnalysisRecord, AnalysisSource, as_record
from analysis.io.results import sidecar_path
from analysis.io.sidecar import (
    RANDOM_WEIGHTS,
    ConfigRecord,
    FingerprintRecord,
    PlanRecord,
    RecoveryRecord,
    SettingsRecord,
    Sidecar,
    VariantRecord,
    VerificationRecord,
)
from analysis.planning.ratios import TargetRatios
from analysis.reporting._format import LABEL_FREE_LOSSES, loss_difference
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
from analysis.text import count, explain_target_loss, fixed, percent


@dataclass(frozen=True)
class ReportFiles:
    """The files :func:`write_report` wrote."""

    curves: Path
    heatmap: Path
    savings: Path
    html: Path


# ------------------------------------------------------------------------------------------------------ loading


def load_analysis(analysis: AnalysisSource) -> AnalysisRecord:
    """The record the report draws: ``analysis`` (a record, or an analysis file read once) without the parameters
    that have no measured ratio.

    Raises:
        AnalysisFileError: The file is missing, unreadable, or holds no measured loss.
    """
    record = as_record(analysis).measured()
    if not record.sensitivities:
        raise AnalysisFileError(
            f"Analysis file {record.path} holds no measured losses, so there is nothing to report; run the analysis "
            "(at least one layer and ratio) first."
        )
    return record


def _settings(sidecar: Sidecar | None) -> SettingsRecord:
    return sidecar.settings if sidecar is not None else SettingsRecord()


def loss_label(sidecar: Sidecar | None) -> str:
    """Say what the stored loss is, e.g. ``"relative top1 loss"``, from the sidecar's fingerprint settings."""
    settings = _settings(sidecar)
    if settings.metric is None:
        return "loss"
    if settings.metric in LABEL_FREE_LOSSES:  # the same number in both modes
        return f"{settings.metric} loss"
    mode = settings.metric_mode
    return f"{mode} {settings.metric} loss" if mode is not None else f"{settings.metric} loss"


def variant(sidecar: Sidecar | None, name: str, ratio: float) -> VariantRecord | None:
    """The sidecar's record of ``name`` pruned at ``ratio`` (metrics, channels, MACs...), if any."""
    return None if sidecar is None else sidecar.variant(name, ratio)


def savings_at(data: AnalysisRecord, ratio: float, measure: str = "macs") -> dict[str, float] | None:
    """Per parameter, the fraction of the dense model's MACs (or ``params``) saved by pruning it alone at ``ratio``.

    Returns:
        ``{param: fraction}`` for the parameters whose variant records it; ``None`` when none does (a sidecar
        written before costs were recorded, or no sidecar).
    """
    found = {}
    for name in data.sensitivities:
        record = variant(data.sidecar, name, ratio)
        value = None if record is None else record.reduction(measure)
        if value is not None:
            found[name] = float(value)
    return found or None


def default_target_loss(sidecar: Sidecar | None) -> float | None:
    """The ``target_loss`` of the run's config (``SensitivityAnalysis.target_loss``, or the API's), if any."""
    return None if sidecar is None or sidecar.config is None else sidecar.config.target_loss()


# -------------------------------------------------------------------------------------------------------- HTML

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #222;
       margin: 24px auto; max-width: 1560px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
p.note { color: #555; margin: 4px 0 10px; }
p.warning { color: #8a1c1c; background: #fdecea; border: 1px solid #f5c2c0; padding: 6px 10px; font-weight: 600; }
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


def _table(rows: Sequence[tuple[str, str]], css_class: str = "summary") -> str:
    """A two-column table; cells are already-escaped HTML."""
    body = "".join(f"<tr><th>{key}</th><td>{value}</td></tr>" for key, value in rows)
    return f'<table class="{css_class}">{body}</table>'


def _model_description(config: ConfigRecord, fingerprint: FingerprintRecord) -> tuple[str, str]:
    """(model, data) as escaped HTML, from the CLI's ``Global`` block or the Python API's config."""
    glob = config.Global
    model_hash = fingerprint.model
    hash_note = f' <span class="note">(fingerprint {_e(str(model_hash)[:12])})</span>' if model_hash else ""
    if glob is not None:
        parts = []
        if glob.arch:
            call = ", ".join(f"{k}={v!r}" for k, v in (glob.arch_kwargs or {}).items())
            parts.append(f"<code>{_e(glob.arch)}({_e(call)})</code>")
        files = [f for f in (glob.model_filename, glob.params_filename) if f]
        location = glob.model_dir
        if files or location:
            shown = [str(Path(str(location)) / str(f)) if location else str(f) for f in files] or [str(location)]
            parts.append("files " + ", ".join(f"<code>{_e(f)}</code>" for f in shown))
        if glob.weights:
            parts.append(f"weights <code>{_e(glob.weights)}</code>")
        model = "; ".join(parts) or "-"
        data = f"<code>{_e(glob.data_dir)}</code>" if glob.data_dir else "-"
        if glob.val_list and glob.data_dir:
            data += f" (list <code>{_e(glob.val_list)}</code>)"
        if glob.max_samples:
            data += f", at most {_e(glob.max_samples)} images"
        return model + hash_note, data
    if config.api:
        model = f"passed to the Python API (<code>{_e(config.api)}</code>){hash_note}"
        data = "batches" if fingerprint.data else "an evaluation function"
        return model, f"{data} passed to the Python API"
    return ("not recorded" + hash_note if model_hash else "not recorded"), "not recorded"


def _evaluation_seconds(data: AnalysisRecord) -> float | None:
    """Seconds spent evaluating variants, each shared variant (coupled parameters) counted once."""
    sidecar = data.sidecar
    if sidecar is None:
        return None
    seen: set[tuple[tuple[str, ...], float]] = set()
    total, found = 0.0, False
    for name, curve in data.sensitivities.items():
        param = sidecar.param(name)
        members = tuple(sorted({name, *((param.coupled_params if param is not None else None) or [])}))
        for ratio in curve:
            record = sidecar.variant(name, ratio)
            seconds = None if record is None else record.seconds
            if seconds is None or (members, ratio) in seen:
                continue
            seen.add((members, ratio))
            total += seconds
            found = True
    return total if found else None


def _loss_definition(sidecar: Sidecar | None, label: str) -> str:
    """How the stored loss was computed from the metric (engine.relative_loss); positive means worse."""
    settings = _settings(sidecar)
    metric = settings.metric
    if metric is None:
        return "as stored in the analysis file (no sidecar says which metric); positive means worse"
    if metric in LABEL_FREE_LOSSES:
        return f"{metric} loss = {LABEL_FREE_LOSSES[metric]}; positive means worse"
    worse = loss_difference(metric)
    if settings.metric_mode == "absolute":
        return f"{label} = {worse}; positive means worse"
    return f"{label} = ({worse}) / |baseline {metric}|; positive means worse"


def _summary(data: AnalysisRecord, target: TargetRatios | None, label: str) -> str:
    sidecar = data.sidecar or Sidecar()
    config = sidecar.config or ConfigRecord()
    fingerprint = sidecar.fingerprint or FingerprintRecord()
    settings = sidecar.settings
    baseline = sidecar.baseline or {}
    tool, cost = sidecar.tool, sidecar.cost
    model, dataset = _model_description(config, fingerprint)
    ratios = analysed_ratios(data.sensitivities)
    rows = [
        ("analysis file", f"<code>{_e(data.path)}</code>"),
        ("model", model),
        ("data", dataset),
    ]
    if baseline:
        metrics = ", ".join(
            f"{key} {fixed(baseline.get(key))}" for key in ("top1", "top5", "ce") if baseline.get(key) is not None
        )
        rows.append(("baseline", _e(metrics or "-")))
        rows.append(("images evaluated", _e(count(baseline.get("images")))))
    rows.append(("loss", _e(_loss_definition(data.sidecar, label))))
    if settings.criterion:
        reduction = f", group reduction {settings.group_reduction}" if settings.group_reduction else ""
        rows.append(("channel ranking", _e(f"{settings.criterion}{reduction}")))
    if settings.round_to is not None and settings.round_to != 1:
        rows.append(("channel rounding", _e(f"every pruned group keeps a multiple of {settings.round_to} channels")))
    if settings.adaptive_bn:
        rows.append(
            (
                "adaptive BN",
                "yes: before each variant was evaluated, the BatchNorm statistics its removal "
                "changes were re-estimated on the calibration images (numbers differ from plain sensitivities)",
            )
        )
    precision, decision = settings.precision, settings.decision
    if decision is not None and len(decision) == 3:
        extra = "" if precision is None else f", or within +-{precision[0]}"
        rows.append(
            (
                "decision-driven sampling",
                _e(
                    f"each variant evaluated until settled above or below target_loss {decision[0]:g}{extra} (chance "
                    f"of any wrong side <= {decision[1]:g}), ratios above one settled above skipped, the two the "
                    f"derived ratio interpolates between on every image; seed {decision[2]:g}"
                ),
            )
        )
    elif precision is not None and len(precision) == 2:
        rows.append(("adaptive precision", _e(f"+-{precision[0]} (95%), seed {precision[1]}")))
    if sidecar.numerics is not None:
        rows.append(("numerics", _e(sidecar.numerics.describe())))
    rows.append(("ratios analysed", _e(", ".join(f"{r:g}" for r in ratios))))
    unprunable = sidecar.unprunable or {}
    rows.append(("layers", _e(f"{len(data.sensitivities)} analysed, {len(unprunable)} not prunable")))
    if cost is not None:
        rows.append(("dense model", _e(f"{count(cost.macs)} MACs, {count(cost.params)} params")))
        rows.append(("MACs convention", _e(cost.convention or "MACs")))
    seconds = _evaluation_seconds(data)
    if seconds is not None:
        base = baseline.get("seconds")
        extra = f" (+ {base:.1f} s baseline)" if base is not None else ""
        rows.append(("evaluation time", _e(f"{seconds:.1f} s summed over variants{extra}")))
    if target is not None:
        rows.append(("target loss", _e(explain_target_loss(target.loss))))
    if tool is not None:
        rows.append(("tool", _e(f"{tool.name or ''} {tool.version or ''}".strip())))
    if sidecar.saved_at:
        rows.append(("saved at", _e(sidecar.saved_at)))
    if config.source:
        rows.append(("config file", f"<code>{_e(config.source)}</code>"))
    return _table(rows)


def _cell_title(record: VariantRecord | None) -> str:
    """Tooltip of a loss cell: the variant's metrics and what was removed."""
    if record is None:
        return ""
    parts = [f"{key} {fixed(record.metric(key))}" for key in ("top1", "top5", "ce") if record.metric(key) is not None]
    if record.channels_removed is not None:
        channels = "?" if record.channels is None else record.channels
        parts.append(f"{record.channels_removed}/{channels} channels removed")
    interval = record.interval
    if interval is not None and len(interval) == 2:
        bounds = f"[{fixed(interval[0])}, {fixed(interval[1])}]"
        decided = f"{record.settled} after {record.samples} images, interval " if record.settled else "95% interval "
        parts.append(decided + bounds)
    if record.macs_reduction is not None:
        parts.append(f"MACs saved {percent(record.macs_reduction)}")
    if record.params_reduction is not None:
        parts.append(f"params saved {percent(record.params_reduction)}")
    if record.mode:
        parts.append(f"mode {record.mode}")
    return "; ".join(parts)


def _loss_table(data: AnalysisRecord, target: TargetRatios | None, ratio: float, label: str) -> str:
    ratios = analysed_ratios(data.sensitivities)
    values = [loss for curve in data.sensitivities.values() for loss in curve.values()]
    cmap, norm = loss_colouring(values)
    derived = target.ratios if target is not None else {}
    macs = savings_at(data, ratio, "macs")
    params_saved = savings_at(data, ratio, "params")
    head = ['<th class="num">#</th>', "<th>parameter</th>", "<th>shape</th>"]
    names = list(data.sensitivities)
    extra: list[tuple[str, dict[str, str]]] = []  # (header, {param: cell text}) after the loss columns
    if derived:
        assert target is not None
        extra.append((f"ratio at target {target.loss:g}", {name: f"{derived[name]:.4f}" for name in names}))
    for key, saved in (("MACs", macs), ("params", params_saved)):
        if saved:
            extra.append((f"{key} saved at {ratio:g}", {name: percent(saved.get(name)) for name in names}))
    head += [f'<th class="num">{_e(text)}</th>' for text in [f"{r:g}" for r in ratios] + [h for h, _ in extra]]
    rows = []
    for number, (name, curve) in enumerate(data.sensitivities.items(), start=1):
        param = None if data.sidecar is None else data.sidecar.param(name)
        shape = None if param is None else param.shape
        shape_text = "-" if shape is None else "x".join(str(s) for s in shape)
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
    if target is not None and derived:
        notes.append(
            f"The ratio at target is PaddleSlim's <code>get_ratios_by_loss</code> rule for target {_e(target.loss)}."
        )
    if macs:
        cost = None if data.sidecar is None else data.sidecar.cost
        convention = (cost.convention if cost is not None else None) or "MACs of Conv and Linear layers"
        notes.append(f"MACs and params saved are shares of the dense model ({_e(convention)}).")
    table = f'<table class="losses"><thead><tr>{"".join(head)}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<p class="note">{" ".join(notes)}</p><div class="scroll">{table}</div>'


def _unprunable_table(sidecar: Sidecar | None) -> str:
    unprunable = (sidecar.unprunable if sidecar is not None else None) or {}
    if not unprunable:
        return '<p class="note">Every conv weight was prunable (or the sidecar does not say).</p>'
    rows = "".join(f'<tr><td class="name">{_e(n)}</td><td>{_e(r)}</td></tr>' for n, r in unprunable.items())
    return (
        f'<table class="losses"><thead><tr><th>parameter</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table>'
    )


def _prediction(plan: PlanRecord) -> str:
    """What a plan's predicted loss is."""
    if plan.method in SEARCHED_PLAN_METHODS:
        return "measured for this plan by the search, all groups pruned at once"
    return "sum of the single-layer losses"


def _latency_outcome(latency: Mapping[str, Any]) -> str:
    """A latency plan's last attempt, as the sidecar keeps it: measured beside the dense model, predicted, the goal."""
    attempts = latency.get("attempts") or [{}]
    chosen = latency.get("chosen", -1)
    last = attempts[chosen] if isinstance(chosen, int) and -len(attempts) <= chosen < len(attempts) else attempts[-1]
    reduction = latency.get("goal_reduction")
    goal = f"{percent(reduction)} less" if reduction is not None else f"{fixed(latency.get('goal_ms'), '.3f')} ms"
    return (f"{latency.get('runtime')} on {latency.get('device')}, batch {latency.get('batch')}: dense "
            f"{fixed(last.get('dense_ms'), '.3f')} ms -> {fixed(last.get('measured_ms'), '.3f')} ms measured side by "
            f"side, predicted {fixed(last.get('predicted_ms'), '.3f')} ms (table's dense "
            f"{fixed(latency.get('dense_ms'), '.3f')} ms); goal {goal}: {'met' if latency.get('met') else 'MISSED'} "
            f"after {len(attempts)} plan(s) measured")  # fmt: skip


def _plan_section(sidecar: Sidecar | None) -> str:
    """The pruning plan (``run.py plan``/``verify``): its groups, predicted against measured loss, cost and speed."""
    plan = sidecar.plan if sidecar is not None else None
    if plan is None:
        return ""
    verification = plan.verification
    target = plan.target
    what = (f"budget: {_e(plan.measure)} reduced by at least {percent(target)}" if target is not None
            else f"ratios from <code>{_e(plan.source)}</code>")  # fmt: skip
    if plan.budgets:
        what = "budgets: " + ", ".join(f"{_e(m)} reduced by at least {percent(r)}" for m, r in plan.budgets.items())
    check = verification.calibration_check if verification is not None else None
    unreliable = " UNRELIABLE: the calibration check failed (see above)." if check and check.reliable is False else ""
    warnings = []
    if plan.prediction_notice:
        warnings.append(f"Predicted loss: {plan.prediction_notice[0].upper()}{plan.prediction_notice[1:]}.")
    if unreliable and verification is not None:
        warnings.append(f"Calibration check failed: {_calibration_check(verification)}. The statistics these images "
                        "give do not fit the model even unpruned, so every BatchNorm re-estimated figure below is "
                        "unreliable, and so are exported statistics re-estimated on them; name calibration images "
                        "drawn like the evaluation data in Global.calib_list.")  # fmt: skip
    predicted = f"{fixed(plan.predicted_loss)} ({_prediction(plan)})"
    if plan.prediction_notice:
        predicted += " OUTSIDE ITS MEANINGFUL RANGE: it predicts nothing (see above)."
    elif plan.method in SEARCHED_PLAN_METHODS:
        predicted += unreliable
    rows = [("plan", what), ("method", _e(plan.method_description or plan.method or "-")),
            ("predicted loss", _e(predicted))]  # fmt: skip
    if plan.latency:
        rows.append(("latency plan", _e(_latency_outcome(plan.latency))))
    if verification is not None:
        measured, baseline, pruned = (verification.measured_loss or {}, verification.baseline or {},
                                      verification.pruned or {})  # fmt: skip
        reestimated = verification.reestimated
        again = (reestimated.measured_loss if reestimated is not None else None) or {}
        after = (reestimated.metrics if reestimated is not None else None) or {}
        for metric in ("top1", "top5", "agreement", "kl"):
            if metric in measured:
                rows.append((f"measured {metric} loss, raw", _e(
                    f"{fixed(measured[metric])} ({metric} {fixed(baseline.get(metric))} -> "
                    f"{fixed(pruned.get(metric))}, all groups pruned at once, the dense model's BatchNorm "
                    "statistics)")))  # fmt: skip
            if metric in again and reestimated is not None:
                rows.append((f"measured {metric} loss, BatchNorm re-estimated", _e(
                    f"{fixed(again[metric])} ({metric} {fixed(baseline.get(metric))} -> {fixed(after.get(metric))}, "
                    f"statistics of {len(reestimated.batchnorm_layers or [])} layers re-estimated on "
                    f"{reestimated.calibration_images} calibration images){unreliable}")))  # fmt: skip
        if reestimated is None:
            rows.append(("BatchNorm re-estimated", "not measured (no calibration images; see Global.calib_list)"))
        if check is not None:
            verdict = "passed" if check.reliable else "FAILED"
            rows.append(("calibration check", _e(f"{verdict}: {_calibration_check(verification)}")))
        for key, pair in (("macs", verification.macs), ("params", verification.params),
                          ("checkpoint bytes", verification.checkpoint_bytes)):  # fmt: skip
            dense, smaller = (None, None) if pair is None else (pair.dense, pair.pruned)
            rows.append((key, _e(f"{count(dense)} -> {count(smaller)}")))
        for batch, times in (verification.latency_ms or {}).items():
            dense, fast = times.dense, times.pruned
            speedup = f", {dense / fast:.2f}x" if dense and fast else ""
            rows.append((f"latency {_e(batch.replace('_', ' '))}",
                         _e(f"{fixed(dense, '.2f')} ms -> {fixed(fast, '.2f')} ms{speedup} "
                            f"(median, {verification.device})")))  # fmt: skip
        timed = verification.runtime_latency
        if timed is not None:
            predicted = "" if timed.predicted_ms is None else f", predicted {fixed(timed.predicted_ms, '.3f')} ms"
            interval = (
                ""
                if timed.interval is None
                else (
                    f", {1 - (timed.pruned_ms or 0) / (timed.dense_ms or 1):.1%} faster ({timed.interval[0]:.1%} to "
                    f"{timed.interval[1]:.1%}{'' if timed.steady is not False else ', machine too noisy to judge'})"
                )
            )
            rows.append((f"latency batch {timed.batch} on {_e(timed.runtime)}",
                         _e(f"{fixed(timed.dense_ms, '.3f')} ms -> {fixed(timed.pruned_ms, '.3f')} ms{interval}"
                            f"{predicted} ({timed.device})")))  # fmt: skip
    elif plan.recovery is None:
        after_cost = plan.pruned
        macs, params = (None, None) if after_cost is None else (after_cost.macs, after_cost.params)
        rows.append(("MACs, params after", _e(f"{count(macs)}, {count(params)} (computed; run.py verify measures the "
                                              "pruned model)")))  # fmt: skip
    if plan.recovery is not None:
        rows += _recovery_rows(plan.recovery)
    groups = "".join(
        f'<tr><td class="name">{_e(", ".join(g.members or []))}</td><td>{fixed(g.ratio)}</td>'
        f"<td>{_e(g.channels_removed)}/{_e(g.channels)}</td><td>{fixed(g.predicted_loss)}</td></tr>"
        for g in plan.groups or []
    )  # fmt: skip
    head = "<th>group (params sharing one ratio)</th><th>ratio</th><th>channels removed</th><th>predicted loss</th>"
    table = f'<table class="losses"><thead><tr>{head}</tr></thead><tbody>{groups}</tbody></table>'
    shown = "".join(f'<p class="warning">{_e(text)}</p>' for text in warnings)
    return "<h2>Pruning plan</h2>" + shown + _table(rows) + f'<div class="scroll">{table}</div>'


def _recovery_rows(recovery: RecoveryRecord) -> list[tuple[str, str]]:
    """``run.py compress``'s recovery of the plan: top1 at each stage, how training went, the recipe."""
    stages = [("dense", recovery.dense), ("pruned at once", recovery.one_shot),
              ("BatchNorm re-estimated", recovery.reestimated), ("recovered", recovery.recovered)]  # fmt: skip
    path = " -> ".join(f"{name} {fixed((metrics or {}).get('top1'))}" for name, metrics in stages if metrics)
    recipe = recovery.recipe or {}
    optimizer, schedule = recipe.get("optimizer") or {}, recipe.get("learning_rate") or {}
    trained = (f"{recovery.steps}/{recovery.total_steps} steps ({recovery.stopped}), best at step "
               f"{recovery.best_step}, {recovery.train_images} training images, {recovery.processes} process(es), "
               f"{recovery.precision}, {fixed(recovery.images_per_second, '.0f')} images/s")  # fmt: skip
    how = (f"{optimizer.get('type')} (weight decay {optimizer.get('weight_decay')}), learning rate "
           f"{schedule.get('type')} from {schedule.get('learning_rate', schedule.get('values'))}; distillation "
           + ", ".join(f"{pair['loss']} on {pair['student']} x {pair['alpha']}"
                       for pair in (recovery.distillation or {}).get("pairs", [])))  # fmt: skip
    return [("top1 (run.py compress)", _e(path)), ("recovery", _e(trained)), ("recipe", _e(how)),
            ("recovered model", _e(", ".join((recovery.exported or {}).values()) or "-"))]  # fmt: skip


def _calibration_check(verification: VerificationRecord) -> str:
    """The calibration check of a verification, with its numbers (plain text)."""
    check = verification.calibration_check
    assert check is not None
    metric = check.metric or "top1"
    before = (verification.baseline or {}).get(metric)
    after = (check.dense_reestimated or {}).get(metric)
    reestimated = verification.reestimated
    layers = len(reestimated.batchnorm_layers or []) if reestimated is not None else 0
    images = reestimated.calibration_images if reestimated is not None else None
    verdict = "within" if check.reliable else "more than"
    return (f"re-estimating the same {layers} BatchNorm layers of the dense model on the {images} calibration images "
            f"changes its {metric} from {fixed(before)} to {fixed(after)} (relative loss {fixed(check.loss, '+.4f')}, "
            f"{verdict} the tolerance {fixed(check.tolerance, 'g')})")  # fmt: skip


def _figure(png: bytes, alt: str, caption: str) -> str:
    width, height = png_size(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img src="{uri}" width="{width}" height="{height}" alt="{_e(alt)}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def render_html(
    data: AnalysisRecord,
    curves_png: bytes,
    heatmap_png: bytes,
    savings_png: bytes,
    target: TargetRatios | None = None,
    ratio: float | None = None,
) -> str:
    """Return the self-contained HTML report: summary, loss table, unprunable units, the plots and the config.

    Args:
        data: The analysis record as the report draws it (:func:`load_analysis`).
        curves_png: The curves plot, embedded as a data URI (likewise the next two).
        heatmap_png: The heatmap.
        savings_png: The savings plot.
        target: Adds the derived ratios to the loss table and explains the target.
        ratio: The ratio of the MACs columns; default the largest analysed one.

    Raises:
        ConfigError: ``ratio`` was not analysed.
    """
    label = loss_label(data.sidecar)
    ratio = resolve_ratio(data.sensitivities, ratio, str(data.path))
    no_sidecar = (
        ""
        if data.sidecar is not None
        else f'<p class="note">No sidecar ({_e(sidecar_path(data.path).name)}) was found, so the model, data, '
        "baseline and per-variant details are not known; only the losses are shown.</p>"
    )
    stored_config = data.sidecar.config if data.sidecar is not None else None
    random_weights = (
        f'<p class="warning">{_e(RANDOM_WEIGHTS[0].upper() + RANDOM_WEIGHTS[1:])}: the model was built from '
        f"{_e(stored_config.Global.arch if stored_config.Global else 'its arch')} with no weights.</p>"
        if stored_config is not None and stored_config.random_weights
        else ""
    )
    notice = data.sidecar.numerics.notice() if data.sidecar is not None and data.sidecar.numerics else None
    approximate = f'<p class="warning">{_e(notice[0].upper() + notice[1:])}.</p>' if notice else ""
    if stored_config is not None and stored_config.to_json():
        config_text = yaml.safe_dump(stored_config.to_json(), sort_keys=False, allow_unicode=True, width=110)
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
        random_weights,
        approximate,
        no_sidecar,
        "<h2>Run</h2>",
        _summary(data, target, label),
        "<h2>Losses</h2>",
        _loss_table(data, target, ratio, label),
        "<h2>Plots</h2>",
        _figure(
            curves_png,
            "loss curves per layer",
            f"{label} against pruned ratio, in panels of {LINES_PER_PANEL} layers in model order"
            + (f"; dashed: target {target.loss:g}, triangles: derived ratios" if target is not None else "."),
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
    analysis: AnalysisSource,
    out_dir: str | os.PathLike[str] | None = None,
    target_loss: float | None = None,
    ratio: float | None = None,
) -> ReportFiles:
    """Write the three plots and the self-contained HTML report of an analysis.

    Args:
        analysis: The analysis record, or the analysis pickle to read (:func:`load_analysis`); its sidecar
            (``<file>.json``) adds details when present.
        out_dir: Where to write (created if needed); default the analysis file's directory.
        target_loss: Marks the derived ratios; default the run's ``target_loss`` from the sidecar's config.
        ratio: The ratio at which the savings plot and table compare loss and MACs; default the largest analysed.

    Returns:
        The paths written (:func:`report_paths`).

    Raises:
        AnalysisFileError: The analysis file or its sidecar is missing, unreadable or holds no measured loss.
        ConfigError: ``ratio`` was not analysed.
    """
    data = load_analysis(analysis)
    if target_loss is None:
        target_loss = default_target_loss(data.sidecar)
    ratio = resolve_ratio(data.sensitivities, ratio, str(data.path))
    files = report_paths(data.path, out_dir)
    label = loss_label(data.sidecar)
    target = TargetRatios.derive(data.sensitivities, target_loss) if target_loss is not None else None
    plot_curves(data.sensitivities, files.curves, target, label)
    plot_heatmap(data.sensitivities, files.heatmap, label)
    plot_savings(
        data.sensitivities,
        files.savings,
        ratio,
        savings_at(data, ratio, "macs"),
        savings_at(data, ratio, "params"),
        label,
    )
    text = render_html(
        data,
        files.curves.read_bytes(),
        files.heatmap.read_bytes(),
        files.savings.read_bytes(),
        target,
        ratio,
    )
    atomic_write_text(files.html, text)
    return files

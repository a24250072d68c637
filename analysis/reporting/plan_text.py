"""The plan step's result as the terminal prints it: the plan's groups and totals, and its verification next to the
prediction (with the calibration check's warning where the re-estimated numbers cannot be trusted)."""

from __future__ import annotations

import math

from analysis.config import SEARCHED_PLAN_METHODS
from analysis.metrics import LABEL_FREE_METRICS
from analysis.planning.latency import LatencyOutcome
from analysis.planning.result import PlanResult
from analysis.structure.flops import format_count


def format_plan(result: PlanResult) -> str:
    """The plan's groups and totals, and the verification next to the prediction."""
    plan = result.plan
    check = result.calibration_check
    unreliable = " [UNRELIABLE: calibration check failed]" if check is not None and not check.reliable else ""
    lines = [f"plan ({plan.source}): {len(plan.groups)} group(s) pruned"]
    width = max([len(g.members[0]) for g in plan.groups] + [5])
    for group in plan.groups:
        coupled = f" +{len(group.members) - 1} coupled" if len(group.members) > 1 else ""
        removed = f"{len(group.removed):>4}/{group.channels:<4} channels"
        lines.append(f"  {group.members[0]:<{width}}  ratio {group.ratio:.4f}  {removed}  predicted loss "
                     f"{_loss(group.predicted_loss)}{coupled}")  # fmt: skip
    beyond = [g.members[0] for g in plan.groups if math.isnan(g.predicted_loss)]
    if beyond:
        named = ", ".join(beyond[:3]) + (", ..." if len(beyond) > 3 else "")
        measured = "the verification below measures the plan" if result.verification else "verify measures it"
        lines.append(f"note: {len(beyond)} group(s) ({named}) have a ratio above the largest analysed one, so their "
                     f"loss and the plan's are unknown (no curve reaches there); {measured}.")  # fmt: skip
    dense, pruned = plan.dense, plan.pruned
    if plan.method in SEARCHED_PLAN_METHODS and plan.search is not None:
        search = plan.search
        budget_of = f" of {search['budget']}" if search.get("budget") is not None else ""  # older sidecars lack it
        ended = "; the search ended early: no untried plan was left" if search.get("exhausted") else ""
        lines.append(
            f"predicted loss (measured by the search, all groups pruned at once): {plan.predicted_loss:+.4f}; "
            f"{search['evaluations']}{budget_of} evaluations ({search['from_earlier_runs']} taken from earlier runs' "
            f"log, {search['repeated_plans']} trades passed over as repeats of measured plans), "
            f"{search['accepted_trades']} trades kept{ended}{unreliable}"
        )
        finalists = ", ".join(f"{f['name']} {f['top1']:.4f}" for f in search["finalists"])
        chosen = f"; chosen: {search['chosen']}" if "probed" not in search else ""
        lines.append(f"finalists (top1, every calibration image): {finalists}{chosen}")
        if "probed" in search:
            probed = ", ".join(f"{f['name']} {f['top1']:.4f}" for f in search["probed"])
            steps = search.get("probe_steps", "?")
            lines.append(f"after {steps} recovery steps each (top1): {probed}; chosen: {search['chosen']}")
    else:
        lines.append(
            f"predicted loss (sum of single-layer losses): {_loss(plan.predicted_loss)}"
            + (f" (within {plan.gap:.4f} of the smallest summed predicted loss any plan meeting the budget can have)"
               if plan.source == "budget" else "")
        )  # fmt: skip
        if plan.notice is not None:
            lines.append(f"note: {plan.notice}.")
    lines.append(f"MACs {format_count(dense.macs)} -> {format_count(pruned.macs)} "
                 f"(-{1 - pruned.macs / dense.macs:.1%}), params {format_count(dense.params)} -> "
                 f"{format_count(pruned.params)} (-{1 - pruned.params / dense.params:.1%})")  # fmt: skip
    latency = plan.latency
    if latency is not None:
        last = latency.last
        low, high = last.measured.interval
        verdict = {"met": "met", "missed": "MISSED", "noisy": "NOT JUDGED: machine too noisy"}[latency.verdict]
        lines.append(
            f"latency on {latency.device} (batch {latency.batch}): measured {last.measured.reduction:.1%} faster "
            f"({low:.1%} to {high:.1%} over {len(last.measured.candidate_ms)} timings; {last.dense_ms:.3f} -> "
            f"{last.measured_ms:.3f} ms, the dense model timed around it), predicted {last.predicted_reduction:.1%} "
            f"({last.predicted_ms:.3f} ms); goal {latency.goal_text()}: {verdict}; {len(latency.attempts)} plan(s) "
            f"measured{_chosen(latency)}; table {latency.table_seconds:.1f} s, {latency.table_file}"
        )
        if latency.verdict == "noisy":
            lines.append(f"WARNING: {latency.noisy_sentence()}.")
    if result.ratios_file is not None:
        lines.append(f"ratios as an ACT ChannelPrune block: {result.ratios_file}")
    verification = result.verification
    if result.estimates is not None:
        how = "; the verification below measures it" if verification is not None else (
            "; measure it: python run.py verify --config_path <config> (or SensitivityAnalysis.verify: true)"
        )  # fmt: skip
        lines.append(f"note: {result.estimates}{how}.")
    if check is not None and not check.reliable:
        lines.append(f"WARNING: {check.warning()}")
    if verification is not None:
        losses = verification.losses()
        shown = next(m for m in (*LABEL_FREE_METRICS, "top1") if m in verification.baseline)  # the analysis metric
        also = "top5" if "top5" in losses else None
        predicted = _loss(plan.predicted_loss) + (", outside its meaningful range (see note)" if plan.notice else "")
        if plan.method in SEARCHED_PLAN_METHODS:
            predicted += unreliable
        lines.append(
            f"verified (all groups pruned at once, predicted loss {predicted}): {shown} "
            f"{verification.baseline[shown]:.4f} ->"
        )
        lines.append(
            f"  raw (dense BatchNorm statistics):   {shown} {verification.pruned[shown]:.4f} (measured loss "
            f"{losses[shown]:+.4f})" + (f", {also} loss {losses[also]:+.4f}" if also else "")
        )
        recalibrated = verification.recalibrated
        if recalibrated is None:
            lines.append("  BatchNorm re-estimated: not measured (no calibration images; see Global.calib_list)")
        elif not recalibrated.layers:
            lines.append(
                "  BatchNorm re-estimated: the same model (no BatchNorm layer follows a layer the plan changes)"
            )
        else:
            again = verification.losses(reestimated=True)
            lines.append(
                f"  BatchNorm re-estimated ({len(recalibrated.layers)} layers, {recalibrated.images} calibration "
                f"images): {shown} {recalibrated.metrics[shown]:.4f} (measured loss {again[shown]:+.4f})"
                + (f", {also} loss {again[also]:+.4f}" if also else "")
                + unreliable
            )
        if check is not None:
            lines.append(f"  calibration check passed: {check.describe()}" if check.reliable else
                         "  calibration check FAILED: see the warning above")  # fmt: skip
        v = verification
        lines.append(f"measured MACs {format_count(v.dense_cost['macs'])} -> {format_count(v.pruned_cost['macs'])}, "
                     f"params {format_count(v.dense_cost['params'])} -> {format_count(v.pruned_cost['params'])}, "
                     f"checkpoint {v.checkpoint_bytes['dense'] / 1e6:.2f} MB -> "
                     f"{v.checkpoint_bytes['pruned'] / 1e6:.2f} MB")  # fmt: skip
        for batch, times in v.latency_ms.items():
            lines.append(f"latency {batch.replace('_', ' ')} on {v.device}: {times['dense']:.2f} ms -> "
                         f"{times['pruned']:.2f} ms ({times['dense'] / times['pruned']:.2f}x, median)")  # fmt: skip
        timed = v.runtime_latency
        if timed is not None:
            predicted = "" if timed.predicted_reduction is None else (
                f"; the plan predicted {timed.predicted_reduction:.1%} faster")  # fmt: skip
            low, high = timed.measured.interval
            noisy = "" if timed.steady else (f"; NOT JUDGED: the dense timings around it were "
                                             f"{timed.measured.drift:.1%} apart, beyond the tolerance")  # fmt: skip
            lines.append(f"latency batch {timed.batch} on {timed.runtime} ({timed.device}): {timed.dense_ms:.3f} ms -> "
                         f"{timed.pruned_ms:.3f} ms, {timed.measured.reduction:.1%} faster ({low:.1%} to {high:.1%}, "
                         f"timed between dense timings){predicted}{noisy}")  # fmt: skip
    if result.exported is not None:
        if result.verification is None and check is not None:
            lines.append(f"calibration check of the exported statistics: {check.describe()}")
        statistics = (" (its BatchNorm statistics re-estimated on calibration images that failed the calibration "
                      "check: unreliable)") if unreliable else ""  # fmt: skip
        lines.append(f"exported: {', '.join(str(p) for p in result.exported.values())}{statistics}")
        onnx = result.onnx_check
        if onnx is not None:
            lines.append(
                f"ONNX ({onnx.file}, opset {onnx.opset}): ONNX Runtime equals PyTorch within {onnx.tolerance:.2g} on "
                f"{onnx.images} images (max difference {onnx.max_abs_diff:.2g})"
            )
    return "\n".join(lines)


def _loss(value: float) -> str:
    """A predicted loss as printed: signed, or ``unknown`` (NaN) where a ratio lies beyond the analysed ones."""
    return "unknown" if math.isnan(value) else f"{value:+.4f}"


def _chosen(latency: LatencyOutcome) -> str:
    """Which measured plan was kept, when it is not the last one (a smaller plan tried after it missed)."""
    index = latency.chosen % len(latency.attempts)
    if index == len(latency.attempts) - 1:
        return ""
    return f", plan {index + 1} kept (the smaller plan tried after it missed the goal)"

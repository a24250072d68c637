"""From measured sensitivities to per-layer pruning ratios, and the ACT ``ChannelPrune`` YAML that lists them.

The ratios follow PaddleSlim's ``get_ratios_by_loss`` rule exactly, so the same analysis file gives the same
ratios in both tools. Every loss was measured with one layer pruned alone; the YAML says so, because pruning
several layers at once generally costs more than any single layer did.
"""

from __future__ import annotations

import logging
import math
import os
import textwrap
from collections.abc import Mapping, Sequence

import yaml

from analysis.config import RATIO_DECIMALS
from analysis.results import atomic_write_text

logger = logging.getLogger(__name__)


def get_ratios_by_loss(sensitivities: Mapping[str, Mapping[float, float]], loss: float) -> dict[str, float]:
    """Return, per parameter, the largest pruning ratio whose own measured loss stays within ``loss``.

    PaddleSlim's rule: sort a parameter's (ratio, loss) points by ratio and scan from the largest ratio down; the
    first point with loss <= ``loss`` wins. If it is the largest ratio, that ratio is the answer; otherwise the
    answer is interpolated linearly between it and the next larger ratio (whose loss exceeds the target, so the
    answer lies between the two). When no point qualifies the answer is 0.0 (do not prune).

    Args:
        sensitivities: ``{param: {ratio: relative loss}}`` as stored in an analysis file.
        loss: The target relative loss, e.g. 0.02 for 2%.

    Returns:
        ``{param: ratio}`` in the input's parameter order; parameters without any measured point are left out.

    Raises:
        ValueError: ``loss`` is not a finite number.
    """
    if not math.isfinite(loss):
        raise ValueError(f"target loss must be a finite number, got {loss!r}")
    ratios: dict[str, float] = {}
    for param, curve in sensitivities.items():
        points = sorted((float(ratio), float(value)) for ratio, value in curve.items())
        if not points:
            logger.debug("%s has no measured ratios; it gets no pruning ratio.", param)
            continue
        ratios[param] = _ratio_for(points, loss)
    return ratios


def _ratio_for(points: list[tuple[float, float]], target: float) -> float:
    """Apply the scan-down-and-interpolate rule to one parameter's points, sorted by ratio."""
    last = len(points) - 1
    for index in range(last, -1, -1):
        r0, l0 = points[index]
        if l0 <= target:
            if index == last:
                return r0
            # The next larger point failed (l1 > target >= l0), so l1 - l0 > 0 and the result lies in [r0, r1).
            r1, l1 = points[index + 1]
            return r0 + (target - l0) * (r1 - r0) / (l1 - l0)
    return 0.0


def explain_target_loss(loss: float) -> str:
    """Return one line saying what ``target_loss`` means, for logs and the ratios YAML header."""
    return (
        f"target_loss {loss:g}: each layer gets the largest ratio whose own measured loss stays <= {_percent(loss)} "
        "when it alone is pruned; losses of several pruned layers are not additive, so verify the combined model."
    )


def _percent(fraction: float) -> str:
    text = f"{fraction * 100:.4g}"
    return f"{text}.0%" if text.lstrip("-").isdigit() else f"{text}%"


def channel_prune_yaml(
    ratios: Mapping[str, float],
    order: Sequence[str],
    criterion: str,
    target_loss: float | None = None,
) -> str:
    """Return a YAML document with an ACT ``ChannelPrune`` block listing the per-layer ratios.

    Args:
        ratios: ``{param: ratio}``, e.g. from :func:`get_ratios_by_loss`.
        order: Parameter names in model order; names of ``ratios`` missing from it follow in their own order.
        criterion: The channel-ranking criterion the sensitivities were measured with (e.g. ``l1_norm``).
        target_loss: The target the ratios were derived from, stated in the header; ``None`` if not from one.

    Returns:
        The document: a comment header, a comment naming parameters left unpruned (ratio 0.0), then
        ``ChannelPrune`` with ``criterion``, ``prune_params_name`` and ``pruned_ratio`` (rounded to 6 decimals);
        the two lists are index-aligned.
    """
    ordered = [name for name in dict.fromkeys(order) if name in ratios]
    listed = set(ordered)
    ordered += [name for name in ratios if name not in listed]
    names: list[str] = []
    values: list[float] = []
    skipped: list[str] = []
    for name in ordered:
        value = round(float(ratios[name]), RATIO_DECIMALS)
        if value <= 0.0:
            skipped.append(name)
        else:
            names.append(name)
            values.append(value)

    header = ["Per-layer channel pruning ratios from a sensitivity analysis."]
    if target_loss is None:
        header.append(
            "Each loss behind these ratios was measured with that layer alone pruned; losses of several pruned "
            "layers are not additive, so verify the combined model."
        )
    else:
        header.append(explain_target_loss(target_loss))
    if skipped:
        reason = "ratio 0.0" if target_loss is None else f"no ratio meets target_loss {target_loss:g}"
        header.append(f"not pruned ({reason}): " + ", ".join(_printable(name) for name in skipped))
    lines = [comment for text in header for comment in _comment_lines(text)]
    block = {"ChannelPrune": {"criterion": criterion, "prune_params_name": names, "pruned_ratio": values}}
    body = yaml.safe_dump(block, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return "\n".join(lines) + "\n" + body


def save_ratios_yaml(
    path: str | os.PathLike[str],
    ratios: Mapping[str, float],
    order: Sequence[str],
    criterion: str,
    target_loss: float | None = None,
) -> None:
    """Write :func:`channel_prune_yaml` to ``path`` atomically."""
    atomic_write_text(path, channel_prune_yaml(ratios, order, criterion, target_loss))


def _comment_lines(text: str) -> list[str]:
    """Wrap ``text`` into ``# ``-prefixed lines of at most 120 columns."""
    return textwrap.wrap(
        text, width=120, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False
    )


def _printable(name: str) -> str:
    """Keep a parameter name from ending the YAML comment it is listed in."""
    return name if name.isprintable() else repr(name)

"""From measured sensitivities to per-layer pruning ratios, and the ACT ``ChannelPrune`` YAML that lists them.

Two rules: ``target_loss`` follows PaddleSlim's ``get_ratios_by_loss`` exactly, so the same analysis file gives
the same ratios in both tools; a MACs or params budget is met by :func:`allocate` (a multiple-choice knapsack over
each group's interpolated curve, solved by the convex-hull greedy, with a bound on its distance to the optimum).
Every loss was measured with one layer pruned alone; the YAML says so, because pruning several layers at once
generally costs more than the sum of single layers suggests.
"""

from __future__ import annotations

import logging
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import yaml

from analysis.config import RATIO_DECIMALS
from analysis.errors import UserError
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
    granularity: str = "filter",
    note: str | None = None,
) -> str:
    """Return a YAML document with an ACT ``ChannelPrune`` block listing the per-layer ratios.

    ``note`` replaces the header's sentence on how the ratios were derived (e.g. for a budget plan).

    With ``granularity="element"`` the block is ``ElementPrune`` (criterion ``magnitude``): per-weight element
    sparsities, which no ACT block takes per layer, so it is written for the user's own pruning schedule.

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

    element = granularity == "element"
    header = [
        "Per-weight element sparsities from an element-wise sensitivity analysis (ElementPrune is not an ACT block)."
        if element
        else "Per-layer channel pruning ratios from a sensitivity analysis."
    ]
    if note is not None:
        header.append(note)
    elif target_loss is None:
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
    block_name, criterion = ("ElementPrune", "magnitude") if element else ("ChannelPrune", criterion)
    block = {block_name: {"criterion": criterion, "prune_params_name": names, "pruned_ratio": values}}
    body = yaml.safe_dump(block, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return "\n".join(lines) + "\n" + body


def save_ratios_yaml(
    path: str | os.PathLike[str],
    ratios: Mapping[str, float],
    order: Sequence[str],
    criterion: str,
    target_loss: float | None = None,
    granularity: str = "filter",
    note: str | None = None,
) -> None:
    """Write :func:`channel_prune_yaml` to ``path`` atomically."""
    atomic_write_text(path, channel_prune_yaml(ratios, order, criterion, target_loss, granularity, note))


def load_ratios_yaml(path: str | os.PathLike[str]) -> dict[str, float]:
    """Read ``{param: ratio}`` from a YAML with a ``ChannelPrune`` block (``prune_params_name`` with a
    ``pruned_ratio`` list in the same order, or one ratio for all), as this tool and ACT write it.

    Raises:
        UserError: If the file is unreadable or the block is missing or malformed.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"Cannot read the ratios file {path}: {str(error).splitlines()[0]}") from None
    block = data.get("ChannelPrune") if isinstance(data, dict) else None
    names = block.get("prune_params_name") if isinstance(block, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{path} has no ChannelPrune.prune_params_name list; pass a ratios YAML this tool wrote.")
    ratios = block.get("pruned_ratio")
    if isinstance(ratios, (int, float)):
        ratios = [ratios] * len(names)
    if (
        not isinstance(ratios, list)
        or len(ratios) != len(names)
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios)
    ):
        raise UserError(f"{path}: ChannelPrune.pruned_ratio must be a number or a list as long as prune_params_name.")
    return {name: float(ratio) for name, ratio in zip(names, ratios, strict=True)}


def _comment_lines(text: str) -> list[str]:
    """Wrap ``text`` into ``# ``-prefixed lines of at most 120 columns."""
    return textwrap.wrap(
        text, width=120, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False
    )


def _printable(name: str) -> str:
    """Keep a parameter name from ending the YAML comment it is listed in."""
    return name if name.isprintable() else repr(name)


# ------------------------------------------------------------------------------------------ budget allocation


@dataclass(frozen=True)
class Choice:
    """One way to prune a group of coupled params: remove ``count`` channels, ranked by ``param``'s criterion.

    Attributes:
        count: Channels removed from the group (0 = not pruned).
        ratio: ``count / channels`` (what the ratios YAML lists).
        param: The param whose channel ranking picks the channels (and whose measured curve predicts the loss).
        loss: Predicted loss: the param's measured curve, interpolated linearly in ``count`` (0 at 0).
        saved: Predicted MACs (or params) saved when this group alone is pruned so.
    """

    count: int
    ratio: float
    param: str
    loss: float
    saved: float


@dataclass
class GroupOptions:
    """The choices for one group of coupled params; ``choices[0]`` is "do not prune" (count 0, loss 0, saved 0)."""

    members: list[str]
    channels: int
    choices: list[Choice]

    @property
    def key(self) -> str:
        """The group's first member in model order."""
        return self.members[0]


@dataclass
class Allocation:
    """Per-group choices reaching a saving target with the smallest summed predicted loss found.

    Attributes:
        choices: Group key -> choice (groups left unpruned are included with their count-0 choice).
        predicted_loss: Sum of the chosen predicted losses.
        predicted_saved: Sum of the chosen predicted savings (the exact joint saving is at most this).
        lower_bound: No allocation reaching the target has a smaller summed predicted loss (the LP relaxation's
            optimum), so ``predicted_loss - lower_bound`` bounds how far from optimal this one can be.
        target: The saving asked for.
    """

    choices: dict[str, Choice]
    predicted_loss: float
    predicted_saved: float
    lower_bound: float
    target: float

    @property
    def gap(self) -> float:
        """Upper bound on the distance to the optimal summed predicted loss."""
        return max(0.0, self.predicted_loss - self.lower_bound)


class BudgetUnreachable(ValueError):
    """Even the largest measured ratio of every analysed group does not save enough."""


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear value at ``x`` through ``points`` (sorted by x); never extrapolates past the last point.

    Raises:
        ValueError: If ``x`` lies outside the points' range.
    """
    if not points or x < points[0][0] or x > points[-1][0]:
        raise ValueError(f"{x} is outside the measured range")
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def hull_steps(options: Sequence[GroupOptions]) -> list[tuple[str, Choice, float]]:
    """Every group's lower convex hull of (saved, loss) from "do not prune", as steps ``(group key, choice after
    the step, slope)``, all groups merged by increasing slope (loss added per unit saved).

    Taking steps in this order is the greedy that solves the linear relaxation of the multiple-choice knapsack
    exactly (Sinha and Zoltners, 1979): choices off a hull are never better than a mix of hull neighbours.
    """
    steps: list[tuple[str, Choice, float]] = []
    for group in options:
        slope = -math.inf
        for before, after in pairwise(_lower_hull(group.choices)):
            # hull slopes never decrease; max() keeps rounding (0.3 - 0.2 < 0.1) from reordering a group's steps
            slope = max(slope, (after.loss - before.loss) / (after.saved - before.saved))
            steps.append((group.key, after, slope))
    return sorted(steps, key=lambda step: step[2])  # stable: a group's equal-slope steps keep their order


def _lower_hull(choices: Sequence[Choice]) -> list[Choice]:
    """The lower convex hull of the choices' (saved, loss) points, from the count-0 choice rightwards."""
    best: dict[float, Choice] = {}
    for choice in choices:  # for equal savings only the smallest loss can be on the hull
        if choice.saved not in best or choice.loss < best[choice.saved].loss:
            best[choice.saved] = choice
    start = choices[0]
    points = sorted((c for c in best.values() if c.saved > start.saved), key=lambda c: c.saved)
    hull = [start]
    for point in points:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) < 0:  # collinear points stay: finer steps
            hull.pop()
        hull.append(point)
    return hull


def _cross(a: Choice, b: Choice, c: Choice) -> float:
    """< 0 when b lies above the segment a-c (so it is not on the lower hull); collinear points give 0, also when
    rounding makes them differ in the last bits (0.1, 0.2, 0.3 stay in a line)."""
    left = (b.saved - a.saved) * (c.loss - a.loss)
    right = (b.loss - a.loss) * (c.saved - a.saved)
    return 0.0 if math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-15) else left - right


def allocate(
    options: Sequence[GroupOptions],
    target: float,
    joint_saved: Callable[[Mapping[str, Choice]], float] | None = None,
) -> Allocation:
    """Choose one option per group so the saving reaches ``target`` with the smallest summed predicted loss.

    The method: merge the groups' convex-hull steps by slope and take the shortest prefix whose saving reaches
    the target. Its predicted loss is within one step of the linear relaxation's optimum (:attr:`Allocation.gap`
    says how far at most); when the target falls on a hull vertex the result is optimal. Savings of several groups
    are not additive (a conv losing input channels to one group and filters to another is counted twice), so
    ``joint_saved`` (the exact saving of a selection) decides when the target is reached; the prefix only grows.

    Args:
        options: The groups and their choices.
        target: The saving to reach (same units as :attr:`Choice.saved`).
        joint_saved: Exact saving of a selection (default: the sum of the predicted savings).

    Raises:
        BudgetUnreachable: If taking every step still saves less than ``target``.
    """
    steps = hull_steps(options)
    empty = {group.key: group.choices[0] for group in options}

    def selection(taken: int) -> dict[str, Choice]:
        chosen = dict(empty)
        for key, choice, _ in steps[:taken]:
            chosen[key] = choice
        return chosen

    def additive(chosen: Mapping[str, Choice]) -> float:
        return sum(choice.saved for choice in chosen.values())

    exact = joint_saved or additive
    if exact(selection(len(steps))) < target:
        best = exact(selection(len(steps)))
        raise BudgetUnreachable(f"the largest measured ratios save {best:.6g}, less than the {target:.6g} asked for")
    low, high = 0, len(steps)  # smallest prefix reaching the target: exact saving grows with the prefix
    while low < high:
        middle = (low + high) // 2
        if exact(selection(middle)) >= target:
            high = middle
        else:
            low = middle + 1
    chosen = _refine_last_step(options, steps[:low], selection(low), target, exact)
    return Allocation(chosen, sum(c.loss for c in chosen.values()), additive(chosen), _lp_bound(steps, empty, target),
                      target)  # fmt: skip


def _refine_last_step(
    options: Sequence[GroupOptions],
    taken: Sequence[tuple[str, Choice, float]],
    chosen: dict[str, Choice],
    target: float,
    exact: Callable[[Mapping[str, Choice]], float],
) -> dict[str, Choice]:
    """The last hull step may jump over choices that lie above the hull but already reach the target: take the
    one among them with the smallest loss (only ever lowers the summed loss; the target stays met)."""
    if not taken:
        return chosen
    key, after, _ = taken[-1]
    before = next((choice for k, choice, _ in reversed(taken[:-1]) if k == key), None)
    group = next(g for g in options if g.key == key)
    start = before.count if before is not None else group.choices[0].count
    between = sorted((c for c in group.choices if start < c.count < after.count and c.loss < after.loss),
                     key=lambda c: (c.loss, c.count))  # fmt: skip
    for candidate in between:
        trial = {**chosen, key: candidate}
        if exact(trial) >= target:
            return trial
    return chosen


def _lp_bound(steps: Sequence[tuple[str, Choice, float]], empty: Mapping[str, Choice], target: float) -> float:
    """The linear relaxation's optimum: whole steps by slope, then the fraction of the next one the target needs."""
    current = dict(empty)
    saved = sum(c.saved for c in current.values())
    loss = sum(c.loss for c in current.values())
    for key, choice, slope in steps:
        if saved >= target:
            break
        step_saved = choice.saved - current[key].saved
        fraction = min(1.0, (target - saved) / step_saved)
        saved += fraction * step_saved
        loss += fraction * slope * step_saved
        current[key] = choice
    return loss

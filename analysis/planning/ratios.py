"""From measured sensitivities to per-layer pruning ratios, and the ACT ``ChannelPrune`` YAML that lists them.

Two rules: ``target_loss`` follows PaddleSlim's ``get_ratios_by_loss`` exactly, so the same analysis file gives
the same ratios in both tools; a MACs or params budget is met by :func:`allocate` (a multiple-choice knapsack over
each group's interpolated curve, solved by dynamic programming, with a certified bound on its distance to the
optimum).
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
from pathlib import Path
from typing import Concatenate, ParamSpec

import numpy as np
import yaml

from analysis.config import RATIO_DECIMALS
from analysis.errors import UserError
from analysis.io.results import atomic_write_text
from analysis.reporting._format import percent

logger = logging.getLogger(__name__)
P = ParamSpec("P")


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
    within = percent(loss, ".4g")
    return (
        f"target_loss {loss:g}: each layer gets the largest ratio whose own measured loss stays <= {within} "
        "when it alone is pruned; losses of several pruned layers are not additive, so verify the combined model."
    )


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
    body: str = yaml.safe_dump(block, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return "\n".join(lines) + "\n" + body


def _file_writer(render: Callable[P, str]) -> Callable[Concatenate[str | os.PathLike[str], P], None]:
    """A function writing ``render``'s text to a path atomically; it takes the path, then ``render``'s arguments."""

    def write(path: str | os.PathLike[str], /, *args: P.args, **kwargs: P.kwargs) -> None:
        atomic_write_text(path, render(*args, **kwargs))

    write.__doc__ = f"Write :func:`{render.__name__}` to ``path`` atomically (its arguments follow ``path``)."
    return write


save_ratios_yaml = _file_writer(channel_prune_yaml)


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
    assert isinstance(block, dict)  # names came from it
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
        lower_bound: No allocation reaching the target has a smaller summed predicted loss (the knapsack program
            with savings rounded up), so ``predicted_loss - lower_bound`` bounds how far from optimal this one is.
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


def allocate(
    options: Sequence[GroupOptions],
    target: float,
    joint_saved: Callable[[Mapping[str, Choice]], float] | None = None,
    resolution: int | None = None,
) -> Allocation:
    """Choose one option per group so the saving reaches ``target`` with the smallest summed predicted loss.

    The method: dynamic programming over the multiple-choice knapsack, with savings counted in units of
    ``target / RESOLUTION`` rounded up. Rounding up relaxes the problem, so the program's optimum is a lower bound no
    plan can beat (:attr:`Allocation.lower_bound`). Its choices are then checked without rounding, with
    ``joint_saved`` (the exact saving of a selection: savings of several groups are not additive, a conv losing
    input channels to one group and filters to another is counted twice), and the program's goal raised by any
    shortfall until the target is met; a local search then moves single groups to cheaper choices the surplus
    allows. ``predicted_loss - lower_bound`` (:attr:`Allocation.gap`) certifies how close to optimal the plan is.

    Args:
        options: The groups and their choices.
        target: The saving to reach (same units as :attr:`Choice.saved`).
        joint_saved: Exact saving of a selection (default: the sum of the predicted savings).
        resolution: Savings units per ``target`` (default :data:`RESOLUTION`, or finer for many groups); coarser is
            faster and loosens the bound.

    Raises:
        BudgetUnreachable: If every group at its largest choice still saves less than ``target``.
    """
    exact = joint_saved or _additive
    largest = {group.key: max(group.choices, key=lambda c: c.saved) for group in options}
    if exact(largest) < target:
        raise BudgetUnreachable(f"the largest measured ratios save {exact(largest):.6g}, less than the {target:.6g} "
                                "asked for")  # fmt: skip
    steps = resolution or max(RESOLUTION, 100 * len(options))  # by default rounding costs <= 1% of the target
    unit = target / steps if target > 0 else 1.0
    solved, bound = _knapsack(options, target, unit)  # savings rounded up: a relaxation, so ``bound`` is a bound
    goal, chosen = target, dict(largest)
    for _ in range(RESOLUTION):  # each round raises the goal by the last shortfall; it ends within a few rounds
        if solved is None:
            break  # even the raised goal is out of reach additively: keep the largest choices, which reach it
        if exact(solved) >= target:
            chosen = solved
            break
        goal += max(target - exact(solved), unit)
        solved, _ = _knapsack(options, goal, unit)
    chosen = _improve(options, chosen, target, exact)
    return Allocation(chosen, sum(c.loss for c in chosen.values()), _additive(chosen), bound, target)


RESOLUTION = 4000  # savings are counted in units of target / RESOLUTION (or finer, for many groups)


def _additive(chosen: Mapping[str, Choice]) -> float:
    return sum(choice.saved for choice in chosen.values())


def _knapsack(options: Sequence[GroupOptions], goal: float, unit: float) -> tuple[dict[str, Choice] | None, float]:
    """Smallest summed loss with one choice per group whose savings, in ``unit``s rounded up, add up to at least
    ``goal``: the choices (None if unreachable) and that loss (inf if unreachable). Rounding up relaxes the
    problem, so the loss is a lower bound for ``goal``; the caller checks the choices without rounding.

    ``best[s]`` is the smallest loss of the groups so far saving ``s`` units (the last state: ``goal`` or more).
    """
    states = max(1, math.ceil(goal / unit - 1e-9))
    best = np.full(states + 1, np.inf)
    best[0] = 0.0
    positions = np.arange(states + 1)
    picks: list[tuple[np.ndarray, np.ndarray]] = []  # per group: the choice index and previous state of each state
    for group in options:
        losses = np.array([choice.loss for choice in group.choices], dtype=float)
        shifts = np.array([min(states, max(0, math.ceil(c.saved / unit - 1e-9))) for c in group.choices], dtype=int)
        source = positions[None, :] - shifts[:, None]  # choices x states: the state each choice comes from
        candidate = np.where(source >= 0, best[np.clip(source, 0, states)], np.inf) + losses[:, None]
        tail_value, tail_state = _suffix_min(best)  # every state >= goal ends in the last one
        candidate[:, states] = tail_value[states - shifts] + losses
        source[:, states] = tail_state[states - shifts]
        choice = np.argmin(candidate, axis=0)  # ties: the first choice, as a strict "better" scan would keep
        best = candidate[choice, positions]
        picks.append((choice, source[choice, positions]))
    if not np.isfinite(best[states]):
        return None, math.inf
    chosen: dict[str, Choice] = {}
    state = states
    for group, (pick, previous) in zip(reversed(options), reversed(picks), strict=True):
        chosen[group.key] = group.choices[int(pick[state])]
        state = int(previous[state])
    return {group.key: chosen[group.key] for group in options}, float(best[states])


def _suffix_min(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every position t: the smallest of ``values[t:]`` and its first position."""
    reverse = values[::-1]
    running = np.minimum.accumulate(reverse)
    last = np.maximum.accumulate(np.where(reverse == running, np.arange(len(values)), 0))
    return running[::-1], (len(values) - 1 - last)[::-1]


def _improve(
    options: Sequence[GroupOptions],
    chosen: dict[str, Choice],
    target: float,
    exact: Callable[[Mapping[str, Choice]], float],
) -> dict[str, Choice]:
    """Local search after the knapsack: repeatedly move the one group to a cheaper choice that lowers the summed
    loss most while the saving stays on target (rounding and the raised goal can leave a surplus to spend).

    A move is only considered when the group's own saving drops by at most the current surplus; since savings of
    different groups overlap, the exact joint saving then drops by no more than that, so the target stays met (the
    final selection is checked exactly anyway, and the input is kept if the check ever failed).
    """
    current = dict(chosen)
    by_key = {group.key: group for group in options}
    for _ in range(10 * len(options)):
        surplus = exact(current) - target
        best: tuple[float, str, Choice] | None = None
        for key, now in current.items():
            cheaper = [c for c in by_key[key].choices if c.loss < now.loss and c.saved >= now.saved - surplus]
            if cheaper:
                candidate = min(cheaper, key=lambda c: (c.loss, -c.saved))
                if best is None or now.loss - candidate.loss > best[0]:
                    best = (now.loss - candidate.loss, key, candidate)
        if best is None:
            break
        current[best[1]] = best[2]
    return current if exact(current) >= target else chosen

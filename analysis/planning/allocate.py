"""A MACs or params budget met with the least predicted loss: a multiple-choice knapsack over each group's
interpolated loss curve, solved by dynamic programming, with a certified bound on its distance to the optimum."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Choice:
    """One way to prune a group of coupled params: remove ``count`` channels, ranked by ``param``'s criterion.

    Attributes:
        count: Channels removed from the group (0 = not pruned).
        param: The param whose channel ranking picks the channels (and whose measured curve predicts the loss).
        loss: Predicted loss: the param's measured curve, interpolated linearly in ``count`` (0 at 0).
        saved: Predicted MACs (or params) saved when this group alone is pruned so.
    """

    count: int
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


def largest_choices(options: Sequence[GroupOptions]) -> dict[str, Choice]:
    """Per group key, the choice removing the most channels: every group as far as the analysed ratios go."""
    return {group.key: max(group.choices, key=lambda choice: choice.count) for group in options}


@dataclass
class Allocation:
    """Per-group choices reaching a saving target with the smallest summed predicted loss found.

    Attributes:
        choices: Group key -> choice (groups left unpruned are included with their count-0 choice).
        predicted_loss: Sum of the chosen predicted losses.
        predicted_saved: Sum of the chosen predicted savings (the exact joint saving is at most this).
        lower_bound: No allocation reaching the target has a smaller summed predicted loss (the knapsack program
            with savings rounded up), so ``predicted_loss - lower_bound`` bounds how far from optimal this one is.
    """

    choices: dict[str, Choice]
    predicted_loss: float
    predicted_saved: float
    lower_bound: float

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
        ValueError: If ``target`` is not a positive saving (the callers check budgets before).
        BudgetUnreachable: If every group at its largest choice still saves less than ``target``.
    """
    if not target > 0:
        raise ValueError(f"the saving to reach must be positive, got {target}")
    exact = joint_saved or _additive
    largest = {group.key: max(group.choices, key=lambda c: c.saved) for group in options}
    if exact(largest) < target:
        raise BudgetUnreachable(f"the largest measured ratios save {exact(largest):.6g}, less than the {target:.6g} "
                                "asked for")  # fmt: skip
    steps = resolution or max(RESOLUTION, 100 * len(options))  # by default rounding costs <= 1% of the target
    unit = target / steps
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
    return Allocation(chosen, sum(c.loss for c in chosen.values()), _additive(chosen), bound)


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


@dataclass(frozen=True)
class Constraint:
    """One budget among several a plan must meet at once.

    Attributes:
        name: What it limits (``macs``, ``params``, ``latency``), for messages.
        savings: Per group key, what each of its choices saves alone (in the order of :attr:`GroupOptions.choices`).
        goal: The saving to reach.
        joint_saved: The exact saving of a selection (as :func:`allocate`'s ``joint_saved``).
    """

    name: str
    savings: Mapping[str, Sequence[float]]
    goal: float
    joint_saved: Callable[[Mapping[str, Choice]], float]

    def met_fraction(self, chosen: Mapping[str, Choice]) -> float:
        """How much of the goal ``chosen`` reaches (1 or more: met)."""
        return self.joint_saved(chosen) / self.goal


def allocate_all(
    options: Sequence[GroupOptions], constraints: Sequence[Constraint], resolution: int | None = None
) -> Allocation:
    """One choice per group meeting every constraint with the smallest summed predicted loss found.

    Several budgets make a multi-dimensional knapsack. Each is solved here as the one-dimensional knapsack of a
    weighted sum of the budgets' savings, each divided by its goal, with the goal 1: every selection meeting all the
    budgets reaches it, so each weighting's program bound (:func:`allocate`) bounds the optimum too. Its choices are
    checked exactly against every budget (the least met fraction must reach 1; :func:`allocate` raises its goal
    until it does). The weightings tried: each budget alone and all equally; the plan with the smallest summed loss
    wins, and the largest of their bounds is the plan's lower bound.

    Raises:
        BudgetUnreachable: If the largest measured ratios cannot meet every budget at once; its message names the
            budgets they miss.
    """
    if not constraints:
        raise ValueError("at least one budget is needed")
    if any(not c.goal > 0 for c in constraints):
        raise ValueError("every budget's saving to reach must be positive")
    by_count = {group.key: {(c.param, c.count): index for index, c in enumerate(group.choices)} for group in options}

    def original(chosen: Mapping[str, Choice]) -> dict[str, Choice]:
        return {key: group.choices[by_count[key][(c.param, c.count)]] for group in options
                for key, c in [(group.key, chosen[group.key])]}  # fmt: skip

    def least_met(chosen: Mapping[str, Choice]) -> float:
        return min(constraint.met_fraction(chosen) for constraint in constraints)

    count = len(constraints)
    weightings = [tuple(float(i == j) for j in range(count)) for i in range(count)]
    if count > 1:
        weightings.append(tuple(1.0 / count for _ in range(count)))
    best: Allocation | None = None
    bound = -math.inf
    for weights in weightings:
        scalar = [
            GroupOptions(group.members, group.channels, [
                Choice(c.count, c.param, c.loss, sum(w * k.savings[group.key][i] / k.goal
                                                     for w, k in zip(weights, constraints, strict=True)))
                for i, c in enumerate(group.choices)
            ])
            for group in options
        ]  # fmt: skip
        try:
            found = allocate(scalar, 1.0, least_met, resolution)
        except BudgetUnreachable:
            continue
        if least_met(found.choices) < 1.0:  # the raised goals ran out before every budget was met
            continue
        bound = max(bound, found.lower_bound)
        if best is None or found.predicted_loss < best.predicted_loss:
            best = found
    if best is None:
        largest = largest_choices(options)
        missed = [c.name for c in constraints if c.met_fraction(largest) < 1.0]
        which = " and ".join(missed) if missed else "budgets together"
        raise BudgetUnreachable(f"the largest measured ratios cannot meet the {which} budget")
    chosen = original(best.choices)
    return Allocation(chosen, best.predicted_loss, _additive(chosen), min(bound, best.predicted_loss))

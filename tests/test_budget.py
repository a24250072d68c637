"""Budget allocation: the multiple-choice knapsack over each group's curve, checked against brute force."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping

import pytest

from analysis.planning._curves import interpolate, isotonic, monotone_curve
from analysis.planning.allocate import BudgetUnreachable, Choice, GroupOptions, _improve, allocate


def group(name: str, points: list[tuple[float, float]]) -> GroupOptions:
    """A group whose choice k saves points[k][0] and loses points[k][1] (choice 0 must be (0, 0))."""
    choices = [Choice(k, name, loss, saved) for k, (saved, loss) in enumerate(points)]
    return GroupOptions([name], 10, choices)


def brute_force(groups: list[GroupOptions], target: float) -> float:
    """The smallest summed loss of any combination saving at least ``target`` (inf if none)."""
    best = float("inf")
    for combo in itertools.product(*[g.choices for g in groups]):
        if sum(c.saved for c in combo) >= target:
            best = min(best, sum(c.loss for c in combo))
    return best


def test_interpolate_never_extrapolates() -> None:
    points = [(0.0, 0.0), (2.0, 0.1), (4.0, 0.5)]
    assert interpolate(points, 1.0) == pytest.approx(0.05)
    assert interpolate(points, 3.0) == pytest.approx(0.3)
    assert interpolate(points, 4.0) == 0.5
    with pytest.raises(ValueError, match=r"^4\.5 is outside the measured range$"):
        interpolate(points, 4.5)
    with pytest.raises(ValueError, match=r"^-0\.5 is outside"):
        interpolate(points, -0.5)
    with pytest.raises(ValueError, match=r"^0\.5 is outside"):  # below the first count, which is not 0 here
        interpolate([(1.0, 0.2), (3.0, 0.4)], 0.5)
    with pytest.raises(ValueError, match=r"^0 is outside"):
        interpolate([], 0)


def isotonic_by_minimax(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit by its closed form: max over j <= i of min over k >= i of the mean of
    ``values[j..k]`` (an oracle independent of pooling adjacent violators)."""
    n = len(values)
    return [max(min(sum(values[j : k + 1]) / (k + 1 - j) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_isotonic_fit_equals_its_closed_form() -> None:
    for seed in range(300):
        rng = random.Random(seed)
        values = [rng.choice([rng.uniform(-0.2, 1.0), 0.5, 0.25]) for _ in range(rng.randint(1, 8))]  # ties too
        assert isotonic(values) == pytest.approx(isotonic_by_minimax(values), abs=1e-12), values


def test_monotone_curve_drops_count_zero_averages_equal_counts_and_floors_at_zero() -> None:
    points = [(0, 0.3), (1, 0.02), (3, 0.5), (3, 0.1), (2, -0.1), (4, 0.2)]
    # count 0 dropped; count 3 averaged to 0.3; the fit of 0.02, -0.1, 0.3, 0.2 pools (0.02, -0.1) and (0.3, 0.2)
    curve = monotone_curve(points)
    assert [count for count, _ in curve] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [loss for _, loss in curve] == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.25])
    assert monotone_curve([(2, 0.4), (1, 0.1)]) == [(0.0, 0.0), (1.0, 0.1), (2.0, 0.4)]  # sorted by count


def test_known_optimum_on_convex_curves() -> None:
    # a: cheap savings first, then steep; b: uniformly moderate; c: expensive. Saving 6 is best done as a=2 (loss
    # 0.02) + b=4 (loss 0.2): any use of c or of a's steep third step costs more.
    a = group("a", [(0, 0), (1, 0.01), (2, 0.02), (3, 0.5)])
    b = group("b", [(0, 0), (2, 0.1), (4, 0.2), (6, 0.3)])
    c = group("c", [(0, 0), (3, 0.4), (6, 0.8)])
    result = allocate([a, b, c], 6)
    assert {k: ch.saved for k, ch in result.choices.items()} == {"a": 2, "b": 4, "c": 0}
    assert result.predicted_loss == pytest.approx(0.22) == pytest.approx(brute_force([a, b, c], 6))
    assert result.gap == pytest.approx(0.0)


def test_non_convex_curve_knee_is_found() -> None:
    # a point above the convex hull (saved 1, loss 0.3) is never chosen; the knee (saved 2, loss 0.05) is
    a = group("a", [(0, 0), (1, 0.3), (2, 0.05), (3, 0.6)])
    b = group("b", [(0, 0), (2, 0.2)])
    result = allocate([a, b], 2)
    assert result.choices["a"].saved == 2 and result.choices["b"].saved == 0


def random_groups(rng: random.Random, count: int = 4) -> list[GroupOptions]:
    groups = []
    for index in range(count):
        saved, loss, points = 0.0, 0.0, [(0.0, 0.0)]
        for _ in range(rng.randint(1, 4)):
            saved += rng.uniform(0.5, 3.0)
            loss += rng.uniform(-0.05, 0.3)  # losses may dip: pruning sometimes helps; curves are not convex
            points.append((saved, loss))
        groups.append(group(f"g{index}", points))
    return groups


def test_random_instances_are_solved_optimally_within_the_certified_gap() -> None:
    optimal = 0
    for seed in range(100):
        rng = random.Random(seed)
        groups = random_groups(rng)
        target = rng.uniform(0.1, 0.95) * sum(g.choices[-1].saved for g in groups)
        result = allocate(groups, target)
        optimum = brute_force(groups, target)
        assert result.predicted_saved >= target  # the plan always meets the target
        assert result.lower_bound <= optimum + 1e-12  # the bound is a true lower bound
        assert optimum - 1e-12 <= result.predicted_loss <= optimum + result.gap + 1e-12
        optimal += result.predicted_loss <= optimum + 1e-12
    assert optimal >= 95  # the program is exact up to savings rounding (1/4000 of the target)


def test_exact_joint_saving_decides_when_the_target_is_met() -> None:
    a = group("a", [(0, 0), (2, 0.01), (4, 0.02)])
    b = group("b", [(0, 0), (2, 0.05), (4, 0.1)])

    def joint(selection) -> float:  # overlapping savings: pruning both saves 1 less than the sum
        chosen = [c for c in selection.values() if c.saved]
        return sum(c.saved for c in chosen) - (1.0 if len(chosen) == 2 else 0.0)

    additive = allocate([a, b], 5.5)
    exact = allocate([a, b], 5.5, joint)
    assert additive.predicted_saved == 6 and joint(additive.choices) == 5  # the additive count would fall short
    assert exact.predicted_saved == 8 and joint(exact.choices) >= 5.5  # one more step makes up for the overlap


def test_unreachable_target() -> None:
    with pytest.raises(BudgetUnreachable, match="save 3"):
        allocate([group("a", [(0, 0), (3, 0.1)])], 4)
    for nothing in (0.0, -1.0):
        with pytest.raises(ValueError, match="saving to reach must be positive"):
            allocate([group("a", [(0, 0), (3, 0.1)])], nothing)


def test_choices_off_the_convex_hull_are_used() -> None:
    # the convex hull jumps from 0 straight to saving 4; saving 2 (loss 0.09) reaches the target and costs less
    a = group("a", [(0, 0), (1, 0.08), (2, 0.09), (4, 0.1)])
    result = allocate([a], 2)
    assert result.choices["a"].saved == 2 and result.predicted_loss == pytest.approx(0.09)
    assert result.predicted_loss == pytest.approx(brute_force([a], 2))


def test_savings_that_only_just_add_up_are_not_lost_to_rounding() -> None:
    # three thirds that together save just over the target beat one expensive group; rounding each third's saving
    # to the nearest unit would make them fall short and the bound would exceed the optimum
    thirds = [group(name, [(0, 0), (0.33334, 0.01)]) for name in "abc"]
    expensive = group("d", [(0, 0), (1.0, 1.0)])
    result = allocate([*thirds, expensive], 1.0)
    assert result.predicted_loss == pytest.approx(0.03) and result.choices["d"].saved == 0
    assert result.lower_bound == pytest.approx(0.03) and result.gap == pytest.approx(0.0)


def test_surplus_is_spent_on_cheaper_choices() -> None:
    a = group("a", [(0, 0), (2, 0.01), (4, 0.05)])
    chosen = {"a": a.choices[2]}  # saves 4 where 2 is enough
    assert _improve([a], chosen, 2, lambda selection: sum(c.saved for c in selection.values()))["a"].saved == 2


def test_with_whole_unit_savings_the_bound_and_the_plan_are_the_optimum() -> None:
    # Savings in whole units of target / resolution make the rounded-up program the exact problem, so its optimum
    # (the lower bound) and the plan's loss must both equal brute force, not merely bracket it; groups with a
    # choice saving exactly what is missing are common here, which is where an off-by-one unit shows.
    checked = 0
    for seed in range(150):
        rng = random.Random(seed)
        groups = []
        for index in range(rng.randint(1, 4)):
            saved, loss, points = 0, 0.0, [(0.0, 0.0)]
            for _ in range(rng.randint(1, 4)):
                saved += rng.randint(1, 4)
                loss += rng.uniform(-0.05, 0.3)
                points.append((float(saved), loss))
            groups.append(group(f"g{index}", points))
        largest = sum(int(g.choices[-1].saved) for g in groups)
        target = rng.randint(1, largest)
        result = allocate(groups, target, resolution=target)  # one unit of saving = 1.0 exactly
        optimum = brute_force(groups, target)
        assert result.predicted_saved >= target
        assert result.lower_bound == pytest.approx(optimum, abs=1e-12)
        assert result.predicted_loss == pytest.approx(optimum, abs=1e-12)
        assert result.predicted_loss == pytest.approx(sum(c.loss for c in result.choices.values()), abs=1e-12)
        checked += 1
    assert checked == 150


def additive(selection: Mapping[str, Choice]) -> float:
    return sum(choice.saved for choice in selection.values())


def test_surplus_goes_first_to_the_move_that_lowers_the_loss_most_whatever_the_order() -> None:
    # one move fits the surplus: b's (gain 0.08) beats a's (gain 0.01), though a's losses are larger
    a = group("a", [(0, 0), (1, 0.49), (2, 0.5)])
    b = group("b", [(0, 0), (1, 0.02), (2, 0.1)])
    for order in ([a, b], [b, a]):
        chosen = {g.key: g.choices[2] for g in order}  # saves 4 where 3 is enough
        improved = _improve(order, chosen, 3, additive)
        assert {key: c.saved for key, c in improved.items()} == {"a": 2, "b": 1}


def test_among_equally_cheap_choices_the_one_saving_most_leaves_surplus_for_other_groups() -> None:
    a = group("a", [(0, 0), (2, 0.01), (3, 0.01), (4, 0.05)])
    b = group("b", [(0, 0), (1, 0.0), (2, 0.04)])
    improved = _improve([a, b], {"a": a.choices[3], "b": b.choices[2]}, 4, additive)
    # a moves first (equal gains: the first group) to the cheap choice saving 3, not 2, so b can still move
    assert {key: c.saved for key, c in improved.items()} == {"a": 3, "b": 1}
    assert sum(c.loss for c in improved.values()) == pytest.approx(0.01)


def test_equal_gains_move_the_first_group_and_equal_losses_keep_the_smaller_choice() -> None:
    a = group("a", [(0, 0), (1, 0.0), (2, 0.03)])
    b = group("b", [(0, 0), (1, 0.0), (2, 0.03)])
    improved = _improve([a, b], {"a": a.choices[2], "b": b.choices[2]}, 3, additive)
    assert {key: c.saved for key, c in improved.items()} == {"a": 1, "b": 2}  # one move fits: the first group's
    flat = group("flat", [(0, 0), (2, 0.1), (4, 0.1)])  # a flat curve: pruning more predicts no more loss
    assert allocate([flat], 2).choices["flat"].saved == 2  # at equal predicted loss the plan prunes less


def test_a_local_search_that_misses_the_exact_target_is_dropped() -> None:
    a = group("a", [(0, 0), (2, 0.01), (4, 0.05)])
    chosen = {"a": a.choices[2]}

    def only_the_input_meets_it(selection: Mapping[str, Choice]) -> float:  # savings that overlap unpredictably
        return 4.0 if selection == chosen else 0.0

    assert _improve([a], chosen, 2, only_the_input_meets_it) == chosen


def test_many_groups_get_a_finer_default_resolution() -> None:
    # 60 groups: the default unit is target / (100 x 60), so rounding costs at most 1% of the target (one unit per
    # group); with whole savings and target 6000 that unit is exactly 1 and the bound is the exact optimum
    rng = random.Random(0)
    groups = []
    for index in range(60):
        saved, loss, points = 0, 0.0, [(0.0, 0.0)]
        for _ in range(3):
            saved += rng.randint(37, 61)
            loss += rng.uniform(0.0, 0.3)
            points.append((float(saved), loss))
        groups.append(group(f"g{index}", points))
    default = allocate(groups, 6000)
    assert default.lower_bound == allocate(groups, 6000, resolution=6000).lower_bound
    for other in (4000, 6060):  # the fixed default, and one unit more per group: both round, so the bound differs
        assert default.lower_bound != pytest.approx(allocate(groups, 6000, resolution=other).lower_bound, abs=1e-9)

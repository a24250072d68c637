"""Which trade the measured search tries next, and how large: seeded random pairs, partly guided by a model fitted
to the trades measured so far.

A trade names two groups and a direction: the first group removes a step of its channels more (or fewer), the
second gives back (or takes) what the exact budget allows. Most picks (``GUIDED_SHARE``) take the untried trade
with the largest gain predicted by a ridge regression of every measured gain on two numbers per group, ``u`` (what
removing more from it is worth) and ``v`` (what giving channels back to it is worth): gain(i more, j fewer) is
``u_i + v_j``, gain(i fewer, j more) is ``v_i + u_j``. Observations made before later accepted trades count less
(``DECAY`` per acceptance), since the plan they were measured on has changed. The other picks are uniform, so every
pair keeps a chance. After ``patience`` failures per group, or once every trade failed at this size, the step
halves, down to ``min_step``, then starts over; a whole round of sizes without a single valid trade ends the search.
The caller decides what is valid: the measured search passes over a trade that would only repeat a plan it measured
already (it reports nothing back), so a round that finds no untried plan ends it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GUIDED_SHARE = 0.7
DECAY = 0.5
RIDGE = 1.0

Trade = tuple[str, str, bool]  # (first group, second group, whether the first removes more)


@dataclass(frozen=True)
class _Observation:
    trade: Trade
    gain: float
    accepted_before: int


class TradePicker:
    """The sequence of trades of one search (deterministic for a seed and the same measurements).

    Args:
        keys: The groups, in model order.
        step: First trade size, as a fraction of a group's channels.
        min_step: Smallest size before it starts over at ``step``.
        patience: Failed trades per group before the size halves.
        seed: Seed of the random picks.
    """

    def __init__(self, keys: Sequence[str], step: float, min_step: float, patience: int, seed: int) -> None:
        self.keys = list(keys)
        self.first_step, self.min_step = step, min_step
        self.step = step
        self.limit = max(1, patience * len(self.keys))
        self.trades = len(self.keys) * (len(self.keys) - 1) * 2
        self.rng = random.Random(seed)
        self.failures = 0
        self.accepted = 0
        self.tried: set[Trade] = set()
        self.observations: list[_Observation] = []
        self.measured_this_round = False  # a round: every size from ``step`` down to ``min_step``
        self.exhausted = len(self.keys) < 2
        self._fit: tuple[int, np.ndarray, np.ndarray] | None = None  # (observations, u, v) of the last regression

    def next(self) -> Trade | None:
        """The next trade to try at :attr:`step`; None once no valid trade is left (the search ends)."""
        while not self.exhausted:
            if len(self.tried) >= self.trades:
                self._shrink()
                continue
            trade = self._guided() if self.observations and self.rng.random() < GUIDED_SHARE else None
            if trade is None:
                first, second = self.rng.sample(self.keys, 2)
                trade = (first, second, self.rng.random() < 0.5)
            if trade not in self.tried:
                self.tried.add(trade)
                return trade
        return None

    def measured(self, trade: Trade, gain: float, accepted: bool) -> None:
        """Record a measured trade: its gain on the search objective, and whether it replaced the plan."""
        self.observations.append(_Observation(trade, gain, self.accepted))
        self.measured_this_round = True
        if accepted:
            self.accepted += 1
            self.failures, self.tried = 0, set()
            return
        self.failures += 1
        if self.failures >= self.limit:
            self._shrink()

    def _shrink(self) -> None:
        half = self.step / 2
        if half >= self.min_step:
            self.step = half
        else:
            if not self.measured_this_round:
                self.exhausted = True
            self.step, self.measured_this_round = self.first_step, False
        self.failures, self.tried = 0, set()

    def _guided(self) -> Trade | None:
        """The untried trade with the largest predicted gain (None when every trade was tried)."""
        index = {key: n for n, key in enumerate(self.keys)}
        more_worth, fewer_worth = self._worth(index)
        best: tuple[float, Trade] | None = None
        for first in self.keys:
            for second in self.keys:
                if first == second:
                    continue
                for more in (True, False):
                    if (first, second, more) in self.tried:
                        continue
                    gainer, giver = (first, second) if more else (second, first)
                    predicted = float(more_worth[index[gainer]] + fewer_worth[index[giver]])
                    if best is None or predicted > best[0]:
                        best = (predicted, (first, second, more))
        return None if best is None else best[1]

    def _worth(self, index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """``u`` and ``v`` of every group, fitted to the observations (fitted again only when there are new ones:
        trades passed over leave them as they are)."""
        if self._fit is not None and self._fit[0] == len(self.observations):
            return self._fit[1], self._fit[2]
        groups = len(self.keys)
        features = np.zeros((len(self.observations), 2 * groups))
        gains = np.zeros(len(self.observations))
        weights = np.zeros(len(self.observations))
        for row, observation in enumerate(self.observations):
            first, second, more = observation.trade
            gainer, giver = (first, second) if more else (second, first)
            features[row, index[gainer]] = 1.0  # u: the group that removes more
            features[row, groups + index[giver]] = 1.0  # v: the group that removes fewer
            gains[row] = observation.gain
            weights[row] = DECAY ** (self.accepted - observation.accepted_before)
        weighted = features * weights[:, None]
        coefficients = np.linalg.solve(features.T @ weighted + RIDGE * np.eye(2 * groups), weighted.T @ gains)
        self._fit = (len(self.observations), coefficients[:groups], coefficients[groups:])
        return self._fit[1], self._fit[2]

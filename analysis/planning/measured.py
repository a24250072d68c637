"""The measured plan method: knapsack plans as starting points, then a search that measures whole plans.

The knapsack plan minimises the sum of single-layer losses, and single-layer losses do not add up: pruned
together, layers interact, and a plan that looks cheap on paper can measure badly. This method spends a budget of
joint evaluations (every group pruned at once, BatchNorm statistics re-estimated, :mod:`analysis.planning._joint`):

1. **Starts.** The knapsack plan of the analysis file's losses, and knapsack plans of other views of the same
   measurements (the sidecar keeps every variant's top1 and cross-entropy): the relative increase of the
   cross-entropy, its logarithm, a blend with top1, each also with no group pruned beyond a ratio cap. Every start
   reaches the budget exactly and is measured.
2. **Trades.** From the best plan so far, two groups trade channels: one removes a step of its channels more (or
   fewer), the other gives back (or takes) as many as the exact budget allows, so every candidate still meets it.
   A candidate that measures better (cross-entropy on the scoring images, with the BatchNorm statistics
   re-estimated on a subset of the calibration images) replaces the plan. Which trade and how large:
   :mod:`analysis.planning._trades` (mostly the trade a model of the gains measured so far predicts best). A trade
   that leads to a plan the search measured already costs no evaluation and is passed over like an impossible one,
   so the search ends when its budget is spent or when a whole round of trade sizes finds no untried plan (then no
   larger budget could change its result), whichever comes first.
3. **Finalists.** The search's plan, the next best distinct plans, the best start and the knapsack plan are
   measured again with every calibration image; the best by the analysis's metric (top1, top5 or ce; top1 after a
   label-free analysis, see :attr:`analysis.metrics.Metric.ranked_by`; cross-entropy breaks ties) wins. The knapsack
   plan is always a finalist, so the result never measures below it.
4. **Probe** (the ``recovered`` method, when :attr:`PlanScoring.probe` is given): every finalist is also recovered
   briefly (the same training steps and batches for each, :class:`FinalistProbe`) and scored again; the best after
   that probe wins, as the accuracy a user keeps is the recovered one, which the re-estimated accuracy does not
   always rank the same way.

Every evaluation is appended to the search log as it finishes (:mod:`analysis.io.search_log`, under the analysis
file's lock). The search is deterministic, so a run that was killed retraces its steps and takes every evaluation
it already made from the log: a resumed search evaluates only what is missing and ends with the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from analysis.engine.loss import relative_loss
from analysis.errors import UserError
from analysis.inputs.data import EvalLoader
from analysis.io.fingerprint import json_fingerprint
from analysis.io.lock import exclusive
from analysis.io.record import AnalysisRecord, AnalysisSource, analysis_path, as_record
from analysis.io.search_log import Encoded, JointScore, Picks, SearchLog
from analysis.io.sidecar import Sidecar
from analysis.metrics import METRICS, Metric, metric_named
from analysis.planning._joint import JointEvaluator
from analysis.planning._trades import TradePicker
from analysis.planning.allocate import Choice, GroupOptions
from analysis.planning.plan import Plan, Planner, open_planner
from analysis.progress import progress_bar
from analysis.structure.groups import eval_mode

logger = logging.getLogger(__name__)

# Starting views besides the knapsack plan: (kind, ratio cap), solved at a coarser resolution (they are only starts).
START_CURVES: tuple[tuple[str, float | None], ...] = (
    ("ce", None),
    ("ce", 0.6),
    ("log_ce", None),
    ("log_ce", 0.6),
    ("blend", None),
    ("blend", 0.6),
    ("top1", None),
    ("top1", 0.6),
)
START_RESOLUTION = 1000
BLEND_CE_WEIGHT = 0.8  # blend = (1 - w) * relative top1 loss + w * relative CE increase / 10
IMPROVEMENT = 1e-4  # a trade must lower the search's cross-entropy by more than this to be kept
EVALUATIONS_PER_GROUP = 10  # the default budget


@dataclass(frozen=True)
class SearchSettings:
    """How much the measured method measures.

    Attributes:
        evaluations: Joint evaluations of distinct plans in the search setting (starts and trades), at most; None:
            ``EVALUATIONS_PER_GROUP`` per analysed group.
        seed: Seed of the trade sequence.
        calibration_images: Calibration images per search evaluation (a seeded class-balanced subset of the
            calibration set); finalists use every calibration image.
        step: First trade size, as a fraction of a group's channels.
        min_step: Smallest trade size before it starts over at ``step``.
        patience: Failed trades per group before the step halves.
        finalists_by_ce: Plans after the search's own, best by the search's cross-entropy, measured again with every
            calibration image.
        finalists_by_top1: Plans best by the search's top1 (cross-entropy breaks ties), measured again too (the best
            start and the knapsack plan always are).
    """

    evaluations: int | None = None
    seed: int = 0
    calibration_images: int = 256
    step: float = 1 / 16
    min_step: float = 1 / 64
    patience: int = 2
    finalists_by_ce: int = 3
    finalists_by_top1: int = 2


Removals = list[tuple[str, list[int]]]


class FinalistProbe(Protocol):
    """Scores a plan after a brief recovery (the ``recovered`` method). Planning cannot train; the workflow, which
    can, passes one in."""

    @property
    def setting(self) -> str:
        """The search log's setting name of its scores: identifies the probe's recipe, data and length, so a score is
        reused only by the same probe."""
        ...

    @property
    def steps(self) -> int:
        """The recovery steps each finalist trains (said in the plan's summary)."""
        ...

    def score(self, removals: Removals) -> dict[str, float]:
        """The metrics (``top1`` and ``ce`` at least) of the dense model with ``removals`` pruned physically,
        BatchNorm re-estimated and briefly recovered."""
        ...


class _ProbeEvaluator:
    """A probe as the search measures plans: by picks, with their exact cost."""

    def __init__(self, planner: Planner, probe: FinalistProbe) -> None:
        self.planner, self.probe = planner, probe

    def score(self, picks: Mapping[str, tuple[str, int]]) -> JointScore:
        start = time.perf_counter()
        removals = self.planner.removals(picks.values())
        metrics = self.probe.score([(name, list(channels)) for name, channels in removals])
        cost = self.planner.picks_cost(picks.values())
        return JointScore(metrics, cost.macs, cost.params, time.perf_counter() - start)


@dataclass
class Scored:
    """A plan and what it measured in one setting."""

    name: str
    picks: Picks
    score: JointScore
    ranked_by: Metric = METRICS["top1"]
    """What the final choice maximises (:attr:`analysis.metrics.Metric.ranked_by` of the analysis's metric)."""

    @property
    def search_key(self) -> tuple[float, ...]:
        """Larger is better: minus the cross-entropy (continuous, so small improvements are visible)."""
        return (-self.score.metrics["ce"],)

    @property
    def final_key(self) -> tuple[float, ...]:
        """Larger is better: the ranking metric (top1 unless the analysis measured top5 or ce), then minus the
        cross-entropy."""
        return (self.ranked_by.better_first(self.score.metrics[self.ranked_by.name]), -self.score.metrics["ce"])


@dataclass
class SearchResult:
    """The chosen plan, the knapsack plan's measurement, and what the search did."""

    best: Scored
    knapsack: Scored
    finalists: list[Scored]
    evaluations: int
    reused: int
    accepted: int
    summary: dict[str, Any] = field(default_factory=dict)
    probed: list[Scored] = field(default_factory=list)
    """The finalists after the probe's brief recovery (the ``recovered`` method), in the finalists' order."""


class MeasuredSearch:
    """One measured search for a budget (see the module docstring).

    Args:
        planner: The :class:`~analysis.planning.plan.Planner` (graph, costs, channel rankings, knapsack).
        options: Every analysed group's options from the analysis file's losses.
        starts: Start plans by name (``knapsack`` first), each reaching the target.
        target: The reduction of ``planner.measure`` to reach (other budgets: :attr:`Planner.also`).
        search: Evaluates plans in the search setting (calibration subset).
        full: Evaluates plans in the full setting (every calibration image).
        probe: Recovers each finalist briefly and scores it (the ``recovered`` method); None: the finalists' full
            setting decides.
        log: Where evaluations are stored and found again.
        settings: Budget and step sizes.
        progress: Show a progress bar (None: on a terminal).
    """

    def __init__(
        self,
        planner: Planner,
        options: Sequence[GroupOptions],
        starts: Mapping[str, Picks],
        target: float,
        search: JointEvaluator,
        full: JointEvaluator,
        log: SearchLog,
        settings: SearchSettings,
        progress: bool | None = None,
        ranked_by: Metric = METRICS["top1"],
        probe: FinalistProbe | None = None,
    ) -> None:
        self.planner, self.target, self.settings, self.ranked_by = planner, target, settings, ranked_by
        self.options = {group.key: group for group in options}
        self.keys = list(self.options)
        self.starts = dict(starts)
        self.evaluators: dict[str, Any] = {"search": search, "full": full}
        self.probe_setting = None if probe is None else probe.setting
        self.probe_steps = None if probe is None else probe.steps
        if probe is not None:
            self.evaluators["probe"] = _ProbeEvaluator(planner, probe)
        self.log = log
        self.progress = progress
        self.counts = {key: [choice.count for choice in group.choices] for key, group in self.options.items()}
        self.default_param = {
            key: {choice.count: choice.param for choice in group.choices} for key, group in self.options.items()
        }
        self.evaluations = settings.evaluations or EVALUATIONS_PER_GROUP * len(self.keys)
        self.evaluated = 0  # evaluations in the search setting, including those found in the log
        self.reused = 0  # measurements taken from earlier runs' log
        self.repeated = 0  # trades that led to a plan this search had measured already (skipped, no evaluation)
        self.exhausted = False  # the search ended because no untried plan was left
        self.measured_plans: set[Encoded] = set()  # every plan this search measured in the search setting

    # ---------------------------------------------------------------------------------------------- evaluation

    def measure(self, name: str, picks: Picks, setting: str = "search") -> Scored:
        """Measure ``picks`` in ``setting`` (``search``, ``full`` or ``probe``; or take the stored measurement)."""
        logged = self.probe_setting if setting == "probe" else setting
        assert logged is not None
        score = self.log.get(logged, picks)
        if score is None:
            score = self.evaluators[setting].score(picks)
            self.log.add(logged, picks, score)
        elif self.log.from_earlier_run(logged, picks):
            self.reused += 1
        if setting == "search":
            self.evaluated += 1
            self.measured_plans.add(SearchLog.plan(picks))
        return Scored(name, dict(picks), score, self.ranked_by)

    def meets(self, picks: Picks) -> bool:
        """Whether ``picks`` (every group pruned at once) meets the budget, and every other the planner requires."""
        return self.planner.meets({key: Choice(count, param, 0.0, 0.0) for key, (param, count) in picks.items()},
                                  self.target)  # fmt: skip

    # ------------------------------------------------------------------------------------------------- search

    def run(self) -> SearchResult:
        """Measure the starts, trade channels until the budget is spent or no untried plan is left, and pick among
        the finalists."""
        with progress_bar(self.progress, total=self.evaluations, desc="measured plan", unit="eval") as bar:
            starts = self._measure_starts(bar)
            current = max(starts, key=lambda s: s.search_key)
            self.evaluators["search"].adopt(current.picks)
            archive = list(starts)
            picker = TradePicker(self.keys, self.settings.step, self.settings.min_step, self.settings.patience,
                                 self.settings.seed)  # fmt: skip
            while self.evaluated < self.evaluations:
                trade = picker.next()
                if trade is None:
                    self.exhausted = True
                    logger.info("The measured search ends after %d of %d evaluations: no untried plan is left.",
                                self.evaluated, self.evaluations)  # fmt: skip
                    bar.total = self.evaluated
                    bar.refresh()
                    break
                picks = self._trade(current.picks, *trade, picker.step)
                if picks is None:
                    continue
                if SearchLog.plan(picks) in self.measured_plans:  # nothing new to learn: passed over, not counted
                    self.repeated += 1
                    continue
                candidate = self.measure(f"trade {self.evaluated}", picks)
                bar.update(1)
                archive.append(candidate)
                gain = candidate.search_key[0] - current.search_key[0]
                accepted = gain > IMPROVEMENT
                picker.measured(trade, gain, accepted)
                if accepted:
                    current = candidate
                    self.evaluators["search"].adopt(current.picks)
                    bar.set_postfix(ce=f"{-current.search_key[0]:.4f}", refresh=False)
        finalists = self._finalists(current, starts, archive)
        best = max(finalists, key=lambda s: s.final_key)
        probed = self._probe(finalists)
        if probed:
            chosen = SearchLog.plan(max(probed, key=lambda s: s.final_key).picks)
            best = next(s for s in finalists if SearchLog.plan(s.picks) == chosen)
        knapsack_plan = SearchLog.plan(self.starts["knapsack"])
        knapsack = next(s for s in finalists if SearchLog.plan(s.picks) == knapsack_plan)
        result = SearchResult(best, knapsack, finalists, self.evaluated, self.reused, picker.accepted, probed=probed)
        result.summary = self._summary(result)
        return result

    def _probe(self, finalists: Sequence[Scored]) -> list[Scored]:
        """Every finalist after the probe's brief recovery (none without a probe)."""
        if self.probe_setting is None:
            return []
        probed = []
        with progress_bar(self.progress, total=len(finalists), desc="recovery probes", unit="plan") as bar:
            for finalist in finalists:
                probed.append(self.measure(finalist.name, finalist.picks, setting="probe"))
                bar.update(1)
                bar.set_postfix(top1=f"{probed[-1].score.metrics['top1']:.4f}", refresh=False)
        return probed

    def _measure_starts(self, bar: tqdm) -> list[Scored]:
        """Measure every distinct start (the knapsack plan always, the others while the budget lasts)."""
        scored: list[Scored] = []
        seen: set[Encoded] = set()
        for name, picks in self.starts.items():
            encoded = SearchLog.plan(picks)
            if encoded in seen or (self.evaluated >= self.evaluations and name != "knapsack"):
                continue
            seen.add(encoded)
            scored.append(self.measure(name, picks))
            bar.update(1)
        return scored

    def _trade(self, picks: Picks, first: str, second: str, more: bool, step: float) -> Picks | None:
        """``first`` removes a step more (``more``) or fewer channels; ``second`` gives back or takes as many as the
        exact target allows. None when either move is impossible or would change nothing."""
        moved = self._shift(picks, first, step, up=more)
        if moved is None:
            return None
        partner = self._lowest_meeting(moved, second) if more else self._raise_until_met(moved, second)
        if partner is None or partner[second][1] == picks[second][1]:
            return None
        return partner

    def _shift(self, picks: Picks, key: str, step: float, up: bool) -> Picks | None:
        counts = self.counts[key]
        channels = self.options[key].channels
        now = picks[key][1]
        delta = max(1, round(channels * step))
        wanted = now + delta if up else now - delta
        allowed = [c for c in counts if (c > now and c <= max(wanted, now)) or (c < now and c >= min(wanted, now))]
        if not allowed:
            beyond = [c for c in counts if c > now] if up else [c for c in counts if c < now]
            if not beyond:
                return None
            allowed = [min(beyond)] if up else [max(beyond)]
        count = max(allowed) if up else min(allowed)
        return self._with(picks, key, count)

    def _with(self, picks: Picks, key: str, count: int) -> Picks:
        """``picks`` with group ``key`` at ``count`` (its ranking param kept, or the default one when it starts)."""
        param = picks[key][0] if picks[key][1] and count else self.default_param[key][count]
        return {**picks, key: (param, count)}

    def _lowest_meeting(self, picks: Picks, key: str) -> Picks | None:
        """Lower group ``key`` as far as the target allows (None if even its current count misses it)."""
        if not self.meets(picks):
            return None
        return self._smallest_meeting(picks, key, [c for c in self.counts[key] if c <= picks[key][1]])

    def _raise_until_met(self, picks: Picks, key: str) -> Picks | None:
        """Raise group ``key`` just enough to meet the target (None if it cannot)."""
        higher = [c for c in self.counts[key] if c >= picks[key][1]]
        if not self.meets(self._with(picks, key, higher[-1])):
            return None
        return self._smallest_meeting(picks, key, higher)

    def _smallest_meeting(self, picks: Picks, key: str, counts: Sequence[int]) -> Picks:
        """``picks`` with group ``key`` at the smallest of ``counts`` (ascending, the last meeting the target) that
        meets the target; a group's saving grows with its count, so a bisection finds it."""
        low, high = 0, len(counts) - 1
        while low < high:
            middle = (low + high) // 2
            if self.meets(self._with(picks, key, counts[middle])):
                high = middle
            else:
                low = middle + 1
        return self._with(picks, key, counts[low])

    def _finalists(self, current: Scored, starts: Sequence[Scored], archive: Sequence[Scored]) -> list[Scored]:
        """The search's plan, the next best distinct plans by the search's cross-entropy, the best by its top1, the
        best start and the knapsack plan, measured again with every calibration image."""
        by_ce = sorted(archive, key=lambda s: s.search_key, reverse=True)
        by_top1 = sorted(archive, key=lambda s: s.final_key, reverse=True)
        knapsack = next(s for s in starts if s.name == "knapsack")
        best_start = max(starts, key=lambda s: s.search_key)
        chosen: list[Scored] = []
        seen: set[Encoded] = set()

        def add(candidates: Sequence[Scored], count: int) -> None:
            for candidate in candidates:
                if count == 0:
                    return
                encoded = SearchLog.plan(candidate.picks)
                if encoded not in seen:
                    seen.add(encoded)
                    chosen.append(candidate)
                    count -= 1

        add([current], 1)
        add(by_ce, self.settings.finalists_by_ce)
        add(by_top1, self.settings.finalists_by_top1)
        add([best_start, knapsack], 2)
        return [self.measure(s.name, s.picks, setting="full") for s in chosen]

    def _summary(self, result: SearchResult) -> dict[str, Any]:
        def brief(scored: Scored) -> dict[str, Any]:
            return {"name": scored.name, **{k: scored.score.metrics[k] for k in ("top1", "top5", "ce")
                                            if k in scored.score.metrics}}  # fmt: skip

        probe = {"probed": [brief(s) for s in result.probed], "probe": self.probe_setting,
                 "probe_steps": self.probe_steps}  # fmt: skip
        return {
            "evaluations": result.evaluations,
            "budget": self.evaluations,
            "exhausted": self.exhausted,
            "from_earlier_runs": result.reused,
            "repeated_plans": self.repeated,
            "accepted_trades": result.accepted,
            "starts": list(self.starts),
            "finalists": [brief(s) for s in result.finalists],
            **(probe if result.probed else {}),
            "chosen": result.best.name,
            "knapsack": brief(result.knapsack),
            "settings": {**dataclasses.asdict(self.settings), "evaluations": self.evaluations},
        }


def curve_sensitivities(sidecar: Sidecar, kind: str, cap: float | None) -> dict[str, dict[float, float]]:
    """Losses of another view of the analysis's measurements (from the sidecar's per-variant metrics), for a
    starting plan: ``top1`` or ``ce`` relative change against the baseline, ``log_ce`` = log(1 + max(0, ce)),
    ``blend`` of top1 and ce; ratios above ``cap`` left out."""
    baseline = sidecar.baseline or {}
    top1_0, ce_0 = float(baseline.get("top1") or 0.0), float(baseline.get("ce") or 0.0)
    curves: dict[str, dict[float, float]] = {}
    for name, ratio, variant in sidecar.variants():
        measured_top1, measured_ce = variant.metric("top1"), variant.metric("ce")
        if (cap is not None and ratio > cap + 1e-9) or measured_top1 is None or measured_ce is None:
            continue
        top1 = (top1_0 - measured_top1) / top1_0 if top1_0 else 0.0
        ce = (measured_ce - ce_0) / ce_0 if ce_0 else 0.0
        loss = {"top1": top1, "ce": ce, "log_ce": math.log1p(max(0.0, ce)),
                "blend": (1 - BLEND_CE_WEIGHT) * top1 + BLEND_CE_WEIGHT * ce / 10}[kind]  # fmt: skip
        curves.setdefault(name, {})[ratio] = loss
    return curves


def start_views(
    planner: Planner,
    sensitivities: Mapping[str, Mapping[float, float]],
    sidecar: Sidecar,
    allocate: Callable[[Sequence[GroupOptions]], Any],
) -> dict[str, dict[str, Choice]]:
    """The knapsack choices of the other views of the measurements (:data:`START_CURVES`), by name; views the
    sidecar cannot give (no per-variant cross-entropy) or that cannot reach the target are left out."""
    views: dict[str, dict[str, Choice]] = {}
    for kind, cap in START_CURVES:
        view = {name: curve for name, curve in curve_sensitivities(sidecar, kind, cap).items() if name in sensitivities}
        if not view:
            continue
        try:
            allocation = allocate(planner.options(view))
        except UserError:  # this view cannot reach the target (its ratio cap is too low): the other starts remain
            continue
        views[f"{kind}{'' if cap is None else f' (ratios <= {cap:g})'}"] = allocation.choices
    return views


def _picks(options: Sequence[GroupOptions], choices: Mapping[str, Choice]) -> Picks:
    """One pick per group of ``options`` from choices keyed by any member of the group (unpruned when absent)."""
    picks: Picks = {}
    for group in options:
        choice = next((choices[member] for member in group.members if member in choices), None)
        picks[group.key] = (choice.param, choice.count) if choice is not None and choice.count else (group.key, 0)
    return picks


@dataclass
class PlanScoring:
    """How the measured method scores plans: on which images, with which calibration images.

    Attributes:
        data: The scoring batches ``(images, labels)`` (the evaluation data), iterated in the same order each time.
        data_fingerprint: Identifies those images and their preprocessing (evaluations are reused only on them).
        calibration: Calibration batches of the finalists; None keeps the dense model's BatchNorm statistics.
        search_calibration: Calibration batches of the search (a subset of ``calibration``).
        calibration_fingerprint: Identifies both calibration sets (evaluations are reused only with them).
        probe: Recovers every finalist briefly, and the best after that is chosen (the ``recovered`` method).
    """

    data: Iterable[Any]
    data_fingerprint: str | None
    calibration: Iterable[Any] | None = None
    search_calibration: Iterable[Any] | None = None
    calibration_fingerprint: str | None = None
    probe: FinalistProbe | None = None

    @classmethod
    def from_loaders(
        cls, data: EvalLoader, calibration: EvalLoader | None, search_images: int, seed: int
    ) -> PlanScoring:
        """Score on ``data``; the search re-estimates on a seeded class-balanced subset of ``search_images`` of the
        calibration images, the finalists on all of them."""
        if calibration is None:
            return cls(data, data.fingerprint())
        subset = calibration.subset(search_images, seed)
        fingerprint = json_fingerprint({"all": calibration.fingerprint(), "search": subset.fingerprint()})
        return cls(data, data.fingerprint(), calibration, subset, fingerprint)


def build_measured_plan(
    model: nn.Module,
    example_input: torch.Tensor,
    analysis: AnalysisSource,
    target: float,
    scoring: PlanScoring,
    measure: str = "macs",
    settings: SearchSettings | None = None,
    progress: bool | None = None,
    also: Mapping[str, float] | None = None,
) -> Plan:
    """A plan for ``target`` (a reduction of ``measure``, and of every measure in ``also`` by its reduction) chosen by
    measuring whole plans (see the module docstring), from ``analysis`` (its record, or the analysis file to read
    under the file's lock).

    Raises:
        AnalysisFileError: As :func:`~analysis.planning.plan.build_plan`.
        UserError: If the target is outside (0, 1) or not reachable with the measured ratios.
    """
    settings = settings or SearchSettings()
    if not 0.0 < target < 1.0:
        raise UserError(f"target_{measure}_reduction must be between 0 and 1 (0.4 = 40% fewer), got {target}.")
    if scoring.calibration is None:
        logger.warning("No calibration images: the measured plan's joint evaluations keep the dense model's "
                       "BatchNorm statistics (name training images in Global.calib_list).")  # fmt: skip
    analysis_file = analysis_path(analysis)
    with eval_mode(model), exclusive(analysis_file):
        record = as_record(analysis)
        planner, options = open_planner(model, example_input, record, measure)
        for other, reduction in (also or {}).items():
            planner.require(other, reduction)
        return search_plan(planner, options, record, target, scoring, settings, progress)


def search_plan(
    planner: Planner,
    options: Sequence[GroupOptions],
    record: AnalysisRecord,
    target: float,
    scoring: PlanScoring,
    settings: SearchSettings,
    progress: bool | None = None,
) -> Plan:
    """The measured method on an open planner (its budgets, MACs, params or a latency model, are the plan's): call
    in eval mode, holding the analysis file's lock (the search log is written beside it)."""
    sensitivities = record.sensitivities
    sidecar = record.sidecar or Sidecar()
    knapsack = planner.allocate(options, target)
    starts = {"knapsack": _picks(options, knapsack.choices)}
    views = start_views(planner, sensitivities, sidecar, lambda o: planner.allocate(o, target, START_RESOLUTION))
    starts.update({name: _picks(options, choices) for name, choices in views.items()})
    physical = any(param.mode == "physical" for param in sidecar.param_records().values())
    keys = [group.key for group in options]
    search = JointEvaluator(planner, keys, scoring.data, scoring.search_calibration, physical)
    full = JointEvaluator(planner, keys, scoring.data, scoring.calibration, physical, cache_bytes=0)
    key = {
        "model": sidecar.fingerprint.model if sidecar.fingerprint is not None else None,
        "data": scoring.data_fingerprint,
        "calibration": scoring.calibration_fingerprint,
        "ranking": dict(planner.settings),
        "physical": physical,
        "measure": planner.measure,
        **({"also": dict(planner.also)} if planner.also else {}),
    }
    log = SearchLog(record.path, key)
    metric = sidecar.settings.metric_name
    ranked_by = METRICS[metric_named(metric).ranked_by] if metric in METRICS else METRICS["top1"]
    measured_search = MeasuredSearch(planner, options, starts, target, search, full, log, settings, progress,
                                     ranked_by, scoring.probe)  # fmt: skip
    result = measured_search.run()
    log.copy_to_sidecar()
    baseline = sidecar.baseline or {}
    measured = result.best.score.metrics
    predicted = (
        relative_loss(float(baseline[metric]), float(measured[metric]), metric)
        if metric in baseline and metric in measured
        else float("nan")
    )
    choices = {
        group.key: Choice(count, param, planner.member_loss(sensitivities, param, count) if count else 0.0, 0.0)
        for group in options
        for param, count in [result.best.picks[group.key]]
    }  # fmt: skip
    method = "measured" if scoring.probe is None else "recovered"
    return planner.plan(options, choices, target, predicted, knapsack.lower_bound, method=method,
                        search=result.summary)  # fmt: skip

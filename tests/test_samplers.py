"""The samplers: which images each variant gets, when it stops and what is recorded, on a fake executor with known
logits; make_sampler's choice; and the composition with the executors in whole analyses."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import analysis.engine.run
from analysis.config import SensitivityConfig
from analysis.engine._adaptive import MIN_SAMPLES
from analysis.engine._decision import DecisionRule
from analysis.engine._variants import Prepared
from analysis.engine.batchnorm import CalibrationBatch
from analysis.engine.executors import Executor, Job, Variant, VariantExecutor, Visit, Wanted
from analysis.engine.fidelity import PassMetrics
from analysis.engine.loss import relative_loss
from analysis.engine.partition import UntraceableModel
from analysis.engine.samplers import (
    AdaptiveSampler,
    DecisionSampler,
    ExactSampler,
    PairedBaseline,
    Passes,
    Sampler,
    StagedSampler,
    make_sampler,
    ordered_batches,
)
from analysis.engine.settings import EngineSettings
from analysis.io.results import load_sensitivities, load_sidecar

import engine_models
from helpers import analyse_recorded, batches, pseudo_labelled, randomize, variant_executors

CPU = torch.device("cpu")
CLASSES = 10
SCORING = PassMetrics("top1", labelled=True)

# ---- a fake executor and a recorder stub ---------------------------------------------------------------------------


def unit(name: str) -> Prepared:
    """A stand-in for a prepared unit: samplers only pass it on (the stub recorder reads its name)."""
    return cast(Prepared, SimpleNamespace(name=name))


def job(name: str, ratios: Sequence[float]) -> Job:
    return Job(unit(name), [Variant(ratio, [], SCORING.sums(None)) for ratio in ratios])


def key(job: Job, variant: Variant) -> tuple[str, float]:
    return job.prepared.name, variant.ratio  # type: ignore[attr-defined]


class TableExecutor(VariantExecutor):
    """Gives each ``(unit, ratio)`` fixed logits per image (row ``i`` of its table for the image numbered ``i``: the
    images are ``(n, 1)`` tensors holding their numbers) and records which images each variant saw."""

    kind = Executor.EAGER

    def __init__(self, tables: Mapping[tuple[str, float], torch.Tensor]) -> None:
        self.tables = tables
        self.seen: dict[tuple[str, float], list[int]] = {}
        self.passes: list[list[tuple[str, float]]] = []  # per forward call, the variants it ran
        self.calibrated: list[tuple[list[tuple[str, float]], list[CalibrationBatch]]] = []
        self.released: list[list[str]] = []
        self.applied_models: list[tuple[str, float]] = []

    def forward(self, chunk: Sequence[Job], images: torch.Tensor, wanted: Wanted, visit: Visit) -> None:
        ids = images[:, 0].long()
        ran = []
        for job in chunk:
            for variant in job.variants:
                if wanted(variant):
                    ran.append(key(job, variant))
                    self.seen.setdefault(key(job, variant), []).extend(ids.tolist())
                    visit(variant, self.tables[key(job, variant)][ids])
        self.passes.append(ran)

    def calibrate(self, chunk: Sequence[Job], batches: Iterable[CalibrationBatch], progress: bool | None) -> None:
        self.calibrated.append(([key(j, v) for j in chunk for v in j.variants], list(batches)))

    @contextmanager
    def applied(self, job: Job, variant: Variant) -> Iterator[nn.Module]:
        self.applied_models.append(key(job, variant))
        model = nn.Identity()
        model.variant = key(job, variant)  # type: ignore[assignment]
        yield model

    def release(self, chunk: Sequence[Job]) -> None:
        self.released.append([j.prepared.name for j in chunk])  # type: ignore[attr-defined]


@dataclass
class StubRecorder:
    """Records what samplers report; a unit stops at the ratio ``stop_at`` names for it."""

    baseline: float
    stop_at: dict[str, float] = field(default_factory=dict)
    recorded: dict[str, Mapping[float, float]] = field(default_factory=dict)
    records: list[tuple[str, float, dict[str, float], Executor, str | None]] = field(default_factory=list)
    skips: list[int] = field(default_factory=list)
    stopped_units: set[str] = field(default_factory=set)

    def record(
        self, job: Job, variant: Variant, metrics: dict[str, float], seconds: float, executor: Executor,
        settled: str | None,
    ) -> bool:  # fmt: skip
        name = job.prepared.name  # type: ignore[attr-defined]
        assert seconds >= 0
        self.records.append((name, variant.ratio, dict(metrics), executor, settled))
        stops = variant.ratio >= self.stop_at.get(name, math.inf)
        if stops:
            self.stopped_units.add(name)
        return stops

    def skipped(self, count: int) -> None:
        self.skips.append(count)

    def stopped(self, job: Job) -> bool:
        return job.prepared.name in self.stopped_units  # type: ignore[attr-defined]

    def recorded_losses(self, job: Job) -> Mapping[float, float]:
        return self.recorded.get(job.prepared.name, {})  # type: ignore[attr-defined]

    def loss(self, metrics: Mapping[str, float]) -> float:
        return relative_loss(self.baseline, metrics["top1"], "top1")


@dataclass
class Data:
    """Numbered images with labels in batches, the baseline's logits (right on ``right`` of the images) and helpers
    to make variants' logits."""

    population: int
    size: int
    right: float = 0.8
    labels: torch.Tensor = field(init=False)
    baseline: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        generator = torch.Generator().manual_seed(4)
        self.labels = torch.randint(0, CLASSES, (self.population,), generator=generator)
        wrong = torch.rand(self.population, generator=generator) >= self.right
        self.baseline = self.logits((self.labels + wrong.long()) % CLASSES, generator)

    def logits(self, predicted: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Random logits whose argmax is ``predicted``."""
        values = torch.rand(len(predicted), CLASSES, generator=generator)
        values[torch.arange(len(predicted)), predicted] = 2.0
        return values

    def noisy(self, seed: int) -> torch.Tensor:
        """Logits that predict a random class."""
        generator = torch.Generator().manual_seed(seed)
        return self.logits(torch.randint(0, CLASSES, (self.population,), generator=generator), generator)

    def all_wrong(self, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return self.logits((self.labels + 1) % CLASSES, generator)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        numbers = torch.arange(self.population, dtype=torch.float32).unsqueeze(1)
        return [(numbers[s : s + self.size], self.labels[s : s + self.size])
                for s in range(0, self.population, self.size)]  # fmt: skip

    def right_per_image(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits.argmax(dim=1) == self.labels).double()

    def top1(self) -> float:
        return float(self.right_per_image(self.baseline).mean())

    def paired(self, seed: int = 0) -> PairedBaseline:
        order = torch.randperm(self.population, generator=torch.Generator().manual_seed(seed))
        return PairedBaseline(order, "top1", per_image={"top1": self.right_per_image(self.baseline)})

    def passes(self, calibration: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Passes:
        return Passes(self.batches(), unused_evaluator, CPU, calibration, progress=False)


def unused_evaluator(model: nn.Module) -> dict[str, float]:
    raise AssertionError("a sampler given batches evaluated a whole model")


def assert_metrics_of(metrics: Mapping[str, float], logits: torch.Tensor, labels: torch.Tensor) -> None:
    """``metrics`` are top1, top5 and mean cross-entropy of ``logits`` on exactly these images, computed directly
    (the engine sums cross-entropy in float32)."""
    top5 = logits.topk(5, dim=1).indices.eq(labels.unsqueeze(1)).any(dim=1)
    assert dict(metrics) == {
        "top1": float((logits.argmax(dim=1) == labels).double().mean()),
        "top5": float(top5.double().mean()),
        "ce": pytest.approx(float(F.cross_entropy(logits.double(), labels)), rel=1e-6),
        "images": len(labels),
    }


# ---- ExactSampler -------------------------------------------------------------------------------------------------

RATIOS = (0.25, 0.5, 0.75)


def exact_setup(data: Data) -> tuple[list[Job], TableExecutor]:
    keys = [(name, ratio) for name in "ab" for ratio in RATIOS]
    return [job("a", RATIOS), job("b", RATIOS)], TableExecutor({k: data.noisy(seed) for seed, k in enumerate(keys)})


def test_the_exact_sampler_records_every_variant_on_every_image_in_ratio_order() -> None:
    data = Data(population=30, size=8)  # a last batch of 6
    jobs, executor = exact_setup(data)
    recorder = StubRecorder(data.top1())
    calibration = [(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))]
    ExactSampler().run(jobs, executor, data.passes(calibration), recorder)
    assert executor.calibrated == [([(j, r) for j in "ab" for r in RATIOS], calibration)]  # before the pass
    assert len(executor.passes) == 4 and all(len(p) == 6 for p in executor.passes)  # one pass: every variant a batch
    assert [(name, ratio) for name, ratio, *_ in recorder.records] == [(j, r) for j in "ab" for r in RATIOS]
    for name, ratio, metrics, kind, settled in recorder.records:
        assert executor.seen[name, ratio] == list(range(data.population))
        assert_metrics_of(metrics, executor.tables[name, ratio], data.labels)
        assert kind is Executor.EAGER and settled is None
    assert recorder.skips == []


def test_the_exact_sampler_stops_recording_a_unit_at_the_variant_that_stops_it() -> None:
    data = Data(population=16, size=8)
    jobs, executor = exact_setup(data)
    recorder = StubRecorder(data.top1(), stop_at={"a": 0.5})
    ExactSampler().run(jobs, executor, data.passes(), recorder)
    assert [(name, ratio) for name, ratio, *_ in recorder.records] == [("a", 0.25), ("a", 0.5),
                                                                       *(("b", r) for r in RATIOS)]  # fmt: skip
    assert recorder.skips == [1]  # a at 0.75


def test_without_batches_each_variants_model_goes_to_the_eval_function_until_one_stops_its_unit() -> None:
    jobs, executor = exact_setup(Data(population=8, size=8))
    scores = {("a", 0.25): 0.9, ("a", 0.5): 0.7, ("a", 0.75): 0.2, ("b", 0.25): 0.8, ("b", 0.5): 0.6}
    evaluated: list[tuple[str, float]] = []

    def evaluate(model: nn.Module) -> dict[str, float]:
        evaluated.append(model.variant)  # type: ignore[arg-type]
        return {"top1": scores[model.variant]}  # type: ignore[index]

    recorder = StubRecorder(1.0, stop_at={"b": 0.5})
    ExactSampler().run(jobs, executor, Passes(None, evaluate, CPU, None, progress=False), recorder)
    assert executor.passes == []  # no batch was run
    assert evaluated == executor.applied_models == [*(("a", r) for r in RATIOS), ("b", 0.25), ("b", 0.5)]
    assert [(name, ratio, metrics) for name, ratio, metrics, *_ in recorder.records] == [
        (name, ratio, {"top1": scores[name, ratio]}) for name, ratio in evaluated
    ]
    assert recorder.skips == [1]  # b at 0.75 was not evaluated


# ---- AdaptiveSampler ----------------------------------------------------------------------------------------------


def test_the_adaptive_sampler_stops_a_variant_once_precise_and_follows_the_paired_order() -> None:
    data = Data(population=1000, size=50)
    paired = data.paired(seed=3)
    sampler = AdaptiveSampler(paired, precision=0.05, relative=True)
    # two units in one chunk (as on the suffix executor): the first agrees with the baseline everywhere, the second
    # agrees at 0.25 and predicts noise at 0.5
    tables = {("a", 0.25): data.baseline, ("b", 0.25): data.baseline, ("b", 0.5): data.noisy(7)}
    chunk = [job("a", (0.25,)), job("b", (0.25, 0.5))]
    baseline = data.top1()
    for variant in (v for j in chunk for v in j.variants):
        sampler.track(variant, {"top1": baseline})
    executor = TableExecutor(tables)
    recorder = StubRecorder(baseline)
    sampler.run(chunk, executor, data.passes(), recorder)

    (first,), (same, noisy) = (j.variants for j in chunk)
    for variant in (first, same, noisy):
        assert variant.estimate is not None and variant.done
    assert first.estimate is not None and same.estimate is not None and noisy.estimate is not None
    assert MIN_SAMPLES <= first.estimate.count == same.estimate.count < data.population  # agree: stop once precise
    assert noisy.estimate.count > same.estimate.count  # disagrees often: needs more images
    assert noisy.estimate.count < data.population  # so that the pass could go on: it ends once every variant stopped
    assert len(executor.passes) == noisy.estimate.count // data.size and all(executor.passes)
    counts = {("a", 0.25): first.estimate.count, ("b", 0.25): same.estimate.count, ("b", 0.5): noisy.estimate.count}
    for (name, ratio), variant in zip(counts, (first, same, noisy), strict=True):
        assert variant.estimate is not None
        seen = executor.seen[name, ratio]
        assert seen == paired.order[: counts[name, ratio]].tolist()  # the paired baseline's order, each image once
        index = torch.tensor(seen)
        worse = paired.per_image["top1"][index] - data.right_per_image(tables[name, ratio])[index]
        assert variant.estimate.loss() == pytest.approx(float(worse.mean()) / baseline, abs=1e-12)
        assert variant.estimate.half_width() <= 0.05
    assert same.estimate.loss() == 0.0 and noisy.estimate.loss() > 0.3
    assert [(name, ratio, metrics["images"]) for name, ratio, metrics, *_ in recorder.records] == [
        (name, ratio, count) for (name, ratio), count in counts.items()
    ]  # in ratio order per unit, each with the images it saw
    index = torch.tensor(executor.seen["b", 0.5])
    assert_metrics_of(recorder.records[-1][2], data.noisy(7)[index], data.labels[index])  # its sums: those images


def test_ordered_batches_follow_the_order_in_batches_of_the_first_batchs_size() -> None:
    data = Data(population=30, size=8)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(2))
    got = list(ordered_batches(data.batches(), order))
    assert [len(index) for _, _, index in got] == [8, 8, 8, 6]
    assert torch.equal(torch.cat([index for _, _, index in got]), order)
    for images, labels, index in got:
        assert torch.equal(images[:, 0].long(), index) and torch.equal(labels, data.labels[index])


# ---- StagedSampler ------------------------------------------------------------------------------------------------


def test_the_staged_sampler_runs_stage_by_stage_and_not_the_larger_ratios_of_a_stopped_unit() -> None:
    data = Data(population=16, size=8)
    jobs, executor = exact_setup(data)
    jobs.append(job("c", RATIOS[:1]))  # a unit with one ratio ends after the first stage
    executor.tables = {**executor.tables, ("c", 0.25): data.noisy(99)}
    recorder = StubRecorder(data.top1(), stop_at={"a": 0.25})
    StagedSampler(ExactSampler()).run(jobs, executor, data.passes(), recorder)
    # stage k is one pass over the two batches with every active unit's k-th ratio
    assert executor.passes == [[("a", 0.25), ("b", 0.25), ("c", 0.25)]] * 2 + [[("b", 0.5)]] * 2 + [[("b", 0.75)]] * 2
    assert [(name, ratio) for name, ratio, *_ in recorder.records] == [("a", 0.25), ("b", 0.25), ("c", 0.25),
                                                                       ("b", 0.5), ("b", 0.75)]  # fmt: skip
    assert sum(recorder.skips) == 2  # a at 0.5 and 0.75, once each
    assert executor.released == [["a", "b", "c"], ["b"], ["b"]]  # each stage's copies are freed after it
    for name, ratio, metrics, *_ in recorder.records:
        assert_metrics_of(metrics, executor.tables[name, ratio], data.labels)


def test_the_staged_sampler_passes_tracking_and_pairing_to_its_inner_sampler() -> None:
    data = Data(population=300, size=50)
    inner = AdaptiveSampler(data.paired(), precision=0.05, relative=True)
    staged = StagedSampler(inner)
    assert staged.paired is inner.paired and staged.note() == inner.note() == " (adaptive precision +-0.05)"
    variant = Variant(0.5, [], SCORING.sums(None))
    staged.track(variant, {"top1": 0.8})
    assert variant.estimate is not None and variant.estimate.population == 300 and variant.estimate.baseline == 0.8


# ---- DecisionSampler ----------------------------------------------------------------------------------------------

TARGET = 0.1


def decision_run(
    recorded: Mapping[float, float] | None = None,
) -> tuple[Data, DecisionSampler, Job, TableExecutor, StubRecorder]:
    """One unit at 0.1 and 0.2 (agreeing with the baseline: loss 0, below the target) and 0.3 and 0.4 (wrong on
    every image: loss 1, above)."""
    data = Data(population=1000, size=50)
    ratios = (0.1, 0.2, 0.3, 0.4)
    rule = DecisionRule.build(TARGET, 0.05, data.population, len(ratios))
    sampler = DecisionSampler(data.paired(), rule, relative=True, error=0.05, variants=len(ratios))
    tables = {("a", 0.1): data.baseline, ("a", 0.2): data.baseline, ("a", 0.3): data.all_wrong(1),
              ("a", 0.4): data.all_wrong(2)}  # fmt: skip
    chunk = job("a", ratios)
    baseline = data.top1()
    for variant in chunk.variants:
        sampler.track(variant, {"top1": baseline})
    executor = TableExecutor(tables)
    recorder = StubRecorder(baseline, recorded={"a": recorded or {}})
    sampler.run([chunk], executor, data.passes(), recorder)
    return data, sampler, chunk, executor, recorder


def test_the_decision_sampler_records_the_kept_variants_and_skips_the_dropped() -> None:
    data, sampler, chunk, executor, recorder = decision_run()
    first_look = sampler.rule.looks[0]
    records = {ratio: (metrics, settled) for _, ratio, metrics, _, settled in recorder.records}
    # 0.1 settles below at the first look; 0.2 and 0.3, the pair the rule interpolates between, run on every image;
    # 0.4 is above the smallest ratio settled above: dropped, after the images of its first look
    assert list(records) == [0.1, 0.2, 0.3]
    assert [settled for _, settled in records.values()] == ["below", "exact", "exact"]
    assert recorder.skips == [1]
    seen = {ratio: len(executor.seen["a", ratio]) for ratio in (0.1, 0.2, 0.3, 0.4)}
    assert seen == {0.1: first_look, 0.2: data.population, 0.3: data.population, 0.4: first_look}
    order = sampler.paired.order.tolist()
    assert all(executor.seen["a", r] == order[: seen[r]] for r in seen)  # the paired order, each image once
    assert_metrics_of(records[0.3][0], executor.tables["a", 0.3], data.labels)
    assert records[0.3][0]["top1"] == 0.0 and records[0.1][0]["images"] == first_look
    middle = chunk.variants[1].candidate
    assert middle is not None and middle.exact_loss == recorder.loss(records[0.2][0]) == 0.0  # exact: the recorder's


def test_a_ratio_already_recorded_above_the_target_drops_the_larger_ones_unrun() -> None:
    _, _, _, executor, recorder = decision_run(recorded={0.05: 0.5})
    assert recorder.records == [] and recorder.skips == [4] and executor.passes == []


def test_a_ratio_recorded_below_the_target_leaves_the_decisions_to_the_evaluated_ones() -> None:
    _, _, _, executor, recorder = decision_run(recorded={0.05: 0.0})
    assert [(ratio, settled) for _, ratio, _, _, settled in recorder.records] == [
        (0.1, "below"), (0.2, "exact"), (0.3, "exact")]  # fmt: skip
    assert recorder.skips == [1] and executor.seen["a", 0.4]


# ---- make_sampler -------------------------------------------------------------------------------------------------


def settings(**section: Any) -> EngineSettings:
    return EngineSettings.from_section(SensitivityConfig(**section), progress=False)


def test_make_sampler_picks_the_sampler_the_settings_ask_for() -> None:
    data = batches(count=3, size=8)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(5))

    exact = make_sampler(settings(), data)
    assert type(exact) is ExactSampler and exact.paired is None and exact.note() == ""

    adaptive = make_sampler(EngineSettings.from_section(SensitivityConfig(precision=0.05), seed=5), data)
    assert isinstance(adaptive, AdaptiveSampler) and adaptive.precision == 0.05 and adaptive.relative
    assert torch.equal(adaptive.paired.order, order) and adaptive.paired.population == 24
    assert adaptive.paired.metric == "top1"
    other_seed = make_sampler(EngineSettings.from_section(SensitivityConfig(precision=0.05), seed=6), data)
    assert other_seed.paired is not None and not torch.equal(other_seed.paired.order, order)
    absolute = make_sampler(settings(precision=0.05, metric_mode="absolute"), data)
    assert isinstance(absolute, AdaptiveSampler) and not absolute.relative
    ce = make_sampler(settings(precision=0.05, metric="ce"), data)
    assert isinstance(ce, AdaptiveSampler) and ce.paired.metric == "ce"

    decision = make_sampler(settings(precision="decision", target_loss=0.02, decision_error=0.1), data)
    assert isinstance(decision, DecisionSampler)
    assert decision.rule == DecisionRule.build(0.02, 0.1, 24, 1) and decision.error == 0.1
    within = make_sampler(settings(precision="decision", target_loss=0.02, decision_precision=0.03), data)
    assert isinstance(within, DecisionSampler) and within.rule.precision == 0.03

    stop = {"early_stop_mode": "dropped", "early_stop_value": 0.1}
    staged = make_sampler(settings(**stop), data)
    assert isinstance(staged, StagedSampler) and type(staged.inner) is ExactSampler and staged.paired is None
    staged_adaptive = make_sampler(settings(precision=0.05, **stop), data)
    assert isinstance(staged_adaptive, StagedSampler) and isinstance(staged_adaptive.inner, AdaptiveSampler)
    assert staged_adaptive.paired is staged_adaptive.inner.paired is not None


def test_make_sampler_counts_the_images_of_any_iterable_and_uses_the_variants_of_the_decision() -> None:
    data = batches(count=2, size=8)
    decision = settings(precision="decision", target_loss=0.02)
    assert decision.decision is not None
    with_variants = EngineSettings.from_section(
        SensitivityConfig(precision="decision", target_loss=0.02),
        decision=type(decision.decision)(0.02, 0.05, variants=40),
    )
    sampler = make_sampler(with_variants, iter(data))  # an iterator: its images counted by a pass
    assert isinstance(sampler, DecisionSampler) and sampler.paired.population == 16 and sampler.variants == 40
    assert sampler.rule == DecisionRule.build(0.02, 0.05, 16, 40)


@pytest.mark.parametrize(
    "section",
    [{"precision": 0.05}, {"precision": "decision", "target_loss": 0.02},
     {"precision": 0.05, "early_stop_mode": "dropped", "early_stop_value": 0.1}],
)  # fmt: skip
def test_without_batches_every_variant_sees_every_image(section: dict[str, Any]) -> None:
    sampler: Sampler = make_sampler(settings(**section), None)
    inner = sampler.inner if isinstance(sampler, StagedSampler) else sampler
    assert type(inner) is ExactSampler and sampler.paired is None


# ---- composition with the executors in whole analyses ------------------------------------------------------------


def untraceable(model: nn.Module) -> Any:
    raise UntraceableModel("every unit runs eagerly in this test")


@pytest.mark.parametrize(
    "sampling",
    [{"precision": 0.1}, {"precision": "decision", "target_loss": 0.1},
     {"precision": 0.1, "early_stop_mode": "dropped", "early_stop_value": 0.3}],
    ids=["adaptive", "decision", "adaptive-early-stop"],
)  # fmt: skip
def test_a_sampled_analysis_is_the_same_on_the_suffix_and_the_eager_executor(
    sampling: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=12, size=50))  # 600 images: variants can stop before the end
    kwargs = {"pruned_ratios": (0.25, 0.5, 0.75), "progress": False, "seed": 1, **sampling}
    fast = variant_executors(analyse_recorded(model, data, tmp_path / "fast.pkl", **kwargs))
    with monkeypatch.context() as patch:
        patch.setattr(analysis.engine.run, "GraphRunner", untraceable)
        eager = variant_executors(analyse_recorded(model, data, tmp_path / "eager.pkl", **kwargs))
    assert set(fast.values()) == {Executor.FX_SUFFIX} and set(eager.values()) == {Executor.EAGER}
    assert fast.keys() == eager.keys()
    assert (tmp_path / "fast.pkl").read_bytes() == (tmp_path / "eager.pkl").read_bytes()
    assert load_sensitivities(tmp_path / "fast.pkl") == load_sensitivities(tmp_path / "eager.pkl")

    def sampled(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
        sidecar = load_sidecar(path)
        assert sidecar is not None
        return {(name, ratio): {k: v for k, v in variant.items() if k != "seconds"}
                for name, info in sidecar["params"].items()
                for ratio, variant in info["variants"].items()}  # fmt: skip

    records = sampled(tmp_path / "fast.pkl")
    assert records == sampled(tmp_path / "eager.pkl")  # losses, metrics, intervals, images seen, settled sides
    assert any(record["samples"] < 600 for record in records.values())  # some variant stopped early: not vacuous
    if "early_stop_mode" in sampling or sampling["precision"] == "decision":
        assert len(records) < 3 * 3  # some larger ratios were skipped

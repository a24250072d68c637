"""The executors: eager, physical and fx-suffix forward passes of a variant compute the same logits, honour what the
sampler wants, re-estimate BatchNorm statistics as adaptive BN does, and group jobs into passes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch_pruning as tp
from torch import nn

import analysis.engine.executors
from analysis.engine._modes import ModeCheck
from analysis.engine._variants import Prepared, changed_layers, variant_slices
from analysis.engine.batchnorm import (
    BatchNorm,
    Estimation,
    batchnorm_names,
    batchnorms_named,
    buffers_of,
    changed_sources,
    downstream_batchnorms,
    layers_in_copy,
    reestimate,
)
from analysis.engine.executors import (
    EagerExecutor,
    Executor,
    Job,
    PhysicalExecutor,
    SuffixExecutor,
    Variant,
    VariantExecutor,
)
from analysis.engine.fidelity import PassMetrics
from analysis.engine.partition import GraphRunner, SuffixPlan
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.groups import PrunableUnit, build_dependency_graph, find_prunable, full_group
from analysis.structure.masking import Slice
from analysis.structure.physical import pruned_copy

from bn_models import conv_bn_chain
from helpers import batches, calibration_batches, randomize
from tiny_models import tiny_resnet

CPU = torch.device("cpu")
RATIOS = (0.25, 0.5)
SCORING = PassMetrics("top1", labelled=True)

# (model, unit): a plain conv-BN chain, and the stem of a ResNet, coupled to a block's conv2 by the residual add
UNITS = {"chain": (conv_bn_chain, "conv1.weight"), "residual": (tiny_resnet, "conv1.weight")}


def prepare(model: nn.Module, graph: tp.DependencyGraph, param: PrunableUnit, adaptive_bn: bool = False) -> Prepared:
    """``param`` ready to evaluate by masking at :data:`RATIOS` (l1-norm ranking), as the engine prepares it; with
    ``adaptive_bn``, with the BatchNorm layers its variants re-estimate."""
    conv = model.get_submodule(param.module_name)
    scores = l1_norm(model.get_parameter(param.name))
    removal: dict[float, Sequence[int]] = {r: select_channels(scores, r) for r in RATIOS}
    layers = downstream_batchnorms(graph, changed_sources(graph, full_group(graph, conv))) if adaptive_bn else []
    check = ModeCheck("mask", 0.0, list(removal[max(RATIOS)]))
    return Prepared(param, conv, removal, "mask", [param.name], check, batchnorms=layers)


class Unit:
    """One prepared unit of a small random BN model, with what building its jobs needs."""

    def __init__(self, kind: str, adaptive_bn: bool = False) -> None:
        factory, name = UNITS[kind]
        self.model = randomize(factory())
        self.images = batches(count=1)[0][0]
        self.graph = build_dependency_graph(self.model, self.images)
        param = next(p for p in find_prunable(self.model, self.images) if p.name == name)
        self.prepared = prepare(self.model, self.graph, param, adaptive_bn)
        self.adaptive_bn = adaptive_bn

    def job(self, physical: bool = False) -> Job:
        """A job of every ratio; a physical one zeroes no slices (its variants run on pruned copies)."""
        variants = [
            Variant(
                ratio,
                [] if physical else variant_slices(self.model, self.graph, self.prepared, ratio),
                SCORING.sums(None),
                batchnorm=Estimation(self.prepared.batchnorms) if self.adaptive_bn and not physical else None,
            )
            for ratio in RATIOS
        ]
        return Job(self.prepared, variants)

    def suffix(self) -> tuple[SuffixExecutor, Job]:
        """The suffix executor of the model and a job with its plan."""
        executor = SuffixExecutor(GraphRunner(self.model), CPU)
        job = self.job()
        plan = executor.plan(self.prepared, *changed_layers(self.model, self.graph, self.prepared))
        assert isinstance(plan, SuffixPlan), plan
        job.plan = plan
        return executor, job

    def pruned(self, ratio: float) -> nn.Module:
        """A physically pruned copy of the model at ``ratio`` (traced with autograd on, also in inference mode)."""
        with torch.inference_mode(False), torch.enable_grad():
            return pruned_copy(self.model, self.prepared.param.module_name, self.prepared.removal[ratio], self.images)


def zeroed_copy(model: nn.Module, slices: Sequence[Slice]) -> nn.Module:
    """A deep copy of ``model`` with the slices (tensors of ``model``) zeroed in the copy's own parameters."""
    names = {parameter.data_ptr(): name for name, parameter in model.named_parameters()}
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for tensor, index in slices:
            clone.get_parameter(names[tensor.data_ptr()])[index] = 0
    return clone


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer."""
    return {name: value.clone() for name, value in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    changed = [name for name, value in before.items() if not torch.equal(after[name], value)]
    assert not changed, f"changed: {changed}"


def logits_of(
    executor: VariantExecutor, job: Job, images: torch.Tensor, wanted: Callable[[Variant], bool] = lambda _: True
) -> dict[float, torch.Tensor]:
    """``ratio -> logits`` of every variant ``forward`` visits (in inference mode, as the samplers call it)."""
    seen: dict[float, torch.Tensor] = {}

    def visit(variant: Variant, logits: torch.Tensor) -> None:
        assert variant.ratio not in seen  # one visit per variant and batch
        seen[variant.ratio] = logits.clone()

    with torch.inference_mode():
        executor.forward([job], images, wanted, visit)
    return seen


# ---- forward ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(UNITS))
def test_the_three_executors_compute_the_variant_and_leave_the_model_as_it_was(kind: str) -> None:
    unit = Unit(kind)
    model, images = unit.model, unit.images
    before = state(model)
    with torch.inference_mode():
        dense = model(images)
    eager_job = unit.job()
    eager = logits_of(EagerExecutor(model, CPU), eager_job, images)
    assert_same_state(model, before)
    suffix_executor, suffix_job = unit.suffix()
    suffix = logits_of(suffix_executor, suffix_job, images)
    assert_same_state(model, before)
    physical = logits_of(PhysicalExecutor(model, images, CPU), unit.job(physical=True), images)
    assert_same_state(model, before)
    assert sorted(eager) == sorted(suffix) == sorted(physical) == list(RATIOS)
    for variant in eager_job.variants:
        ratio = variant.ratio
        with torch.inference_mode():
            expected = zeroed_copy(model, variant.slices)(images)
            smaller = unit.pruned(ratio)(images)
        assert torch.equal(eager[ratio], expected)
        assert not torch.allclose(eager[ratio], dense, atol=1e-3)  # the variant changes the logits: not vacuous
        assert torch.equal(suffix[ratio], eager[ratio])
        assert torch.equal(physical[ratio], smaller)
        assert torch.allclose(physical[ratio], eager[ratio], atol=1e-4, rtol=0)


@pytest.mark.parametrize("executor_kind", list(Executor)[:3])
def test_a_variant_the_sampler_does_not_want_is_not_run(executor_kind: Executor) -> None:
    unit = Unit("residual")
    executor: VariantExecutor
    if executor_kind is Executor.FX_SUFFIX:
        executor, job = unit.suffix()
    elif executor_kind is Executor.EAGER:
        executor, job = EagerExecutor(unit.model, CPU), unit.job()
    else:
        executor, job = PhysicalExecutor(unit.model, unit.images, CPU), unit.job(physical=True)
    assert executor.kind is executor_kind
    every = logits_of(executor, job, unit.images)
    assert logits_of(executor, job, unit.images, lambda _: False) == {}
    for ratio in RATIOS:

        def wanted(variant: Variant, ratio: float = ratio) -> bool:
            return variant.ratio == ratio

        only = logits_of(executor, job, unit.images, wanted)
        assert list(only) == [ratio]
        assert torch.equal(only[ratio], every[ratio])  # the other variant's absence changes nothing


def test_a_physical_copy_is_made_only_for_a_wanted_variant_and_released_with_its_chunk() -> None:
    unit = Unit("chain")
    executor, job = PhysicalExecutor(unit.model, unit.images, CPU), unit.job(physical=True)
    logits_of(executor, job, unit.images, lambda variant: variant.ratio == 0.5)
    small, large = job.variants
    assert small.copy is None and large.copy is not None
    held = large.copy
    logits_of(executor, job, unit.images)
    assert large.copy is held  # made once, kept across batches of the chunk
    assert small.copy is not None
    executor.release([job])
    assert small.copy is None and large.copy is None


def test_applied_gives_a_model_that_computes_the_variant() -> None:
    unit = Unit("residual")
    model, images = unit.model, unit.images
    before = state(model)
    physical_executor, physical_job = PhysicalExecutor(model, images, CPU), unit.job(physical=True)
    eager_executor, eager_job = EagerExecutor(model, CPU), unit.job()
    for physical, eager in zip(physical_job.variants, eager_job.variants, strict=True):
        with physical_executor.applied(physical_job, physical) as pruned, torch.inference_mode():
            assert pruned is not model
            assert torch.equal(pruned(images), unit.pruned(physical.ratio)(images))
        assert physical.copy is None  # dropped after the block
        with eager_executor.applied(eager_job, eager) as masked, torch.inference_mode():
            assert torch.equal(masked(images), zeroed_copy(model, eager.slices)(images))
        assert_same_state(model, before)
    suffix_executor, suffix_job = unit.suffix()
    applied = suffix_executor.applied(suffix_job, suffix_job.variants[0])
    with pytest.raises(NotImplementedError, match="fx suffix executor evaluates batches only"), applied:
        pass


def test_the_suffix_check_compares_with_the_mode_checks_masked_logits_bit_for_bit() -> None:
    unit = Unit("residual")
    executor, job = unit.suffix()
    variant = job.variants[-1]  # the mode check's channels: the largest ratio's
    check_images = unit.images[:4]
    with torch.inference_mode():
        exact = zeroed_copy(unit.model, variant.slices)(check_images)
    unit.prepared.check.masked_logits = exact
    assert executor.matches([(job, variant)], check_images) == {id(job): True}
    unit.prepared.check.masked_logits = exact + 1e-6
    assert executor.matches([(job, variant)], check_images) == {id(job): False}
    assert executor.matches([], check_images) == {}


# ---- adaptive BN --------------------------------------------------------------------------------------------------


def reestimated_copy(model: nn.Module, slices: Sequence[Slice], layers: Sequence[BatchNorm]) -> nn.Module:
    """The zeroed copy of ``model`` with ``layers`` (of ``model``) re-estimated by :func:`reestimate`."""
    clone = zeroed_copy(model, slices)
    reestimate(clone, batchnorms_named(clone, batchnorm_names(model, layers)), calibration_batches())
    return clone


def assert_same_statistics(layers: Sequence[BatchNorm], expected: Sequence[BatchNorm]) -> None:
    assert len(layers) == len(expected) > 0
    for layer, reference in zip(layers, expected, strict=True):
        for value, wanted in zip(buffers_of(layer), buffers_of(reference), strict=True):
            assert torch.equal(value, wanted)


@pytest.mark.parametrize("kind", list(UNITS))
@pytest.mark.parametrize("executor_kind", [Executor.EAGER, Executor.FX_SUFFIX])
def test_calibrate_reestimates_each_variants_statistics_as_adaptive_bn_does(kind: str, executor_kind: Executor) -> None:
    unit = Unit(kind, adaptive_bn=True)
    model, images, layers = unit.model, unit.images, unit.prepared.batchnorms
    dense_means = [buffers_of(layer)[0] for layer in layers]
    executor: VariantExecutor
    if executor_kind is Executor.EAGER:
        executor, job = EagerExecutor(model, CPU), unit.job()
    else:
        executor, job = unit.suffix()
    before = state(model)
    executor.calibrate([job], calibration_batches(), progress=False)
    assert_same_state(model, before)  # the model keeps its own statistics
    calibrated = logits_of(executor, job, images)
    assert_same_state(model, before)
    for variant in job.variants:
        assert variant.batchnorm is not None and variant.batchnorm.images == 16
        expected = reestimated_copy(model, variant.slices, layers)
        with variant.statistics():
            assert_same_statistics(layers, batchnorms_named(expected, batchnorm_names(model, layers)))
            assert not torch.equal(buffers_of(layers[-1])[0], dense_means[-1])  # re-estimated: not vacuous
        with torch.inference_mode():
            assert torch.equal(calibrated[variant.ratio], expected(images))  # forward uses the variant's statistics


def test_physical_calibration_reestimates_the_affected_layers_of_each_copy() -> None:
    unit = Unit("residual", adaptive_bn=True)
    model, images, layers = unit.model, unit.images, unit.prepared.batchnorms
    executor, job = PhysicalExecutor(model, images, CPU), unit.job(physical=True)
    before = state(model)
    executor.calibrate([job], calibration_batches(), progress=False)
    assert_same_state(model, before)
    calibrated = logits_of(executor, job, images)
    for variant in job.variants:
        expected = unit.pruned(variant.ratio)
        reestimate(expected, layers_in_copy(model, expected, layers), calibration_batches())
        assert variant.copy is not None
        assert_same_statistics(layers_in_copy(model, variant.copy, layers), layers_in_copy(model, expected, layers))
        with torch.inference_mode():
            assert torch.equal(calibrated[variant.ratio], expected(images))
            assert not torch.allclose(calibrated[variant.ratio], unit.pruned(variant.ratio)(images))


# ---- chunks -------------------------------------------------------------------------------------------------------


def test_the_suffix_executor_groups_jobs_by_their_estimated_work(monkeypatch: pytest.MonkeyPatch) -> None:
    model = randomize(conv_bn_chain())
    images = batches(count=1)[0][0]
    graph = build_dependency_graph(model, images)
    executor = SuffixExecutor(GraphRunner(model), CPU)
    jobs = []
    for param in [p for p in find_prunable(model, images) if p.prunable]:
        prepared = prepare(model, graph, param)
        job = Job(prepared, [Variant(r, [], SCORING.sums(None)) for r in RATIOS])
        plan = executor.plan(prepared, *changed_layers(model, graph, prepared))
        assert isinstance(plan, SuffixPlan)
        job.plan = plan
        jobs.append(job)
    assert len(jobs) == 4
    baseline_seconds = 2.0
    total = sum(executor.runner.node_cost.values())
    costs = [baseline_seconds * len(job.variants) * job.plan.cost / total for job in jobs]  # type: ignore[union-attr]
    assert all(cost > 0 for cost in costs) and costs == sorted(costs, reverse=True)  # later units: shorter suffixes

    monkeypatch.setattr(analysis.engine.executors, "CHUNK_SECONDS", 1e9)
    assert executor.chunks(jobs, baseline_seconds) == [jobs]
    monkeypatch.setattr(analysis.engine.executors, "CHUNK_SECONDS", 0.0)
    assert executor.chunks(jobs, baseline_seconds) == [[job] for job in jobs]
    monkeypatch.setattr(analysis.engine.executors, "CHUNK_SECONDS", costs[0] + costs[1])
    assert executor.chunks(jobs, baseline_seconds) == [jobs[:2], jobs[2:]]
    monkeypatch.setattr(analysis.engine.executors, "CHUNK_SECONDS", costs[0] / 2)  # a job over the limit: alone
    assert executor.chunks(jobs, baseline_seconds)[0] == [jobs[0]]
    assert executor.chunks([], baseline_seconds) == []

    eager = EagerExecutor(model, CPU)
    monkeypatch.setattr(analysis.engine.executors, "CHUNK_SECONDS", 1e9)
    assert eager.chunks(jobs, baseline_seconds) == [[job] for job in jobs]  # full passes share nothing
    assert PhysicalExecutor(model, images, CPU).chunks(jobs, baseline_seconds) == [[job] for job in jobs]

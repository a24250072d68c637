"""Adaptive precision: the intervals cover the exact losses at the stated rate, and far fewer images are used."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from analysis import analysis_prune
from analysis.engine._adaptive import MIN_SAMPLES, PairedEstimate
from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.results import load_sensitivities, load_sidecar

import engine_models
from helpers import batches, pseudo_labelled, randomize


def sequential_trial(
    population: torch.Tensor, precision: float, generator: torch.Generator, baseline: float = 0.8, batch: int = 50
) -> tuple[bool, int]:
    """Draw a population of paired differences in random order until precise enough; does the interval cover?"""
    exact = float(population.mean()) / baseline
    order = torch.randperm(len(population), generator=generator)
    estimate = PairedEstimate(len(population), baseline)
    for start in range(0, len(population), batch):
        estimate.add(population[order[start : start + batch]])
        if estimate.precise_enough(precision):
            break
    low, high = estimate.interval()
    return low - 1e-12 <= exact <= high + 1e-12, estimate.count


@pytest.mark.parametrize(("worse", "better"), [(0.002, 0.001), (0.01, 0.005), (0.05, 0.01), (0.2, 0.05)])
def test_intervals_cover_the_exact_loss_at_the_stated_rate(worse: float, better: float) -> None:
    generator = torch.Generator().manual_seed(7)
    trials, covered = 200, 0
    for _ in range(trials):
        draw = torch.rand(5000, generator=generator)
        population = (draw < worse).double() - ((draw >= worse) & (draw < worse + better)).double()
        covered += sequential_trial(population, 0.005, generator)[0]
    # 95% intervals: with 200 trials, 3 standard deviations below 0.95 is 0.904
    assert covered / trials >= 0.904


def test_few_disagreements_need_few_images() -> None:
    generator = torch.Generator().manual_seed(3)
    draw = torch.rand(5000, generator=generator)
    population = (draw < 0.002).double()
    counts = [sequential_trial(population, 0.005, generator)[1] for _ in range(20)]
    assert max(counts) <= 5000 / 3  # at least 3x fewer images than the exact pass
    assert min(counts) >= MIN_SAMPLES


def test_an_estimate_that_agrees_so_far_is_not_certain_yet() -> None:
    estimate = PairedEstimate(population=5000, baseline=0.9)
    estimate.add(torch.zeros(100))
    assert estimate.half_width() > 0.005 and not estimate.precise_enough(0.005)  # no zero-width interval
    estimate.add(torch.zeros(4900))
    assert estimate.half_width() == 0.0 and estimate.precise_enough(0.005)  # the whole set: exact


def test_finite_population_correction_and_continuous_differences() -> None:
    values = torch.tensor([0.1, -0.2, 0.3, 0.05] * 50, dtype=torch.float64)
    infinite = PairedEstimate(population=10**9, baseline=2.0, discrete=False)
    finite = PairedEstimate(population=400, baseline=2.0, discrete=False)
    infinite.add(values)
    finite.add(values)
    variance = float(values.var())  # unbiased, as the estimate uses
    assert infinite.half_width() == pytest.approx(1.959963984540054 * math.sqrt(variance / 200) / 2.0, rel=1e-6)
    assert finite.half_width() == pytest.approx(infinite.half_width() * math.sqrt(1 - 200 / 400), rel=1e-6)
    assert finite.loss() == pytest.approx(float(values.mean()) / 2.0)


def test_engine_records_intervals_that_cover_the_exact_losses(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=40, size=25))  # 1000 images, baseline top1 = 1
    ratios = (0.2, 0.4, 0.6, 0.8)
    analysis_prune(model, data, tmp_path / "exact.pkl", pruned_ratios=ratios, progress=False)
    analysis_prune(model, data, tmp_path / "adaptive.pkl", pruned_ratios=ratios, precision=0.05, progress=False)
    exact = load_sensitivities(tmp_path / "exact.pkl")
    adaptive = load_sensitivities(tmp_path / "adaptive.pkl")
    sidecar = load_sidecar(tmp_path / "adaptive.pkl")
    used, covered, total = 0, 0, 0
    for name, info in sidecar["params"].items():
        for ratio, variant in info["variants"].items():
            low, high = variant["interval"]
            assert low <= adaptive[name][float(ratio)] <= high and variant["precision"] == 0.05
            covered += low - 1e-9 <= exact[name][float(ratio)] <= high + 1e-9
            used += variant["samples"]
            total += 1
    assert total == 12 and covered >= 10  # 95% intervals: 12 variants, at most 2 misses
    assert used < 0.8 * total * 1000  # some variants stopped early
    assert sidecar["baseline"]["images"] == 1000


def test_precision_needs_the_fast_engine(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"precision needs engine: fast"):
        analysis_prune(torch.nn.Linear(1, 1), [], tmp_path / "s.pkl", precision=0.01, engine="reference")


def test_exact_and_estimated_losses_never_mix_in_one_file(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=4, size=25))
    target = tmp_path / "s.pkl"
    analysis_prune(model, data, target, pruned_ratios=(0.5,), progress=False)
    before = target.read_bytes()
    with pytest.raises(AnalysisFileError, match=r"precision None \(this run uses \[0.05, 0\]\)"):
        analysis_prune(model, data, target, pruned_ratios=(0.5, 0.7), precision=0.05, progress=False)
    assert target.read_bytes() == before

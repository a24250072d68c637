"""Decision-driven sampling: the error rate of its decisions, its bookkeeping, and the same derived ratios as the
exact run on a demo model."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path
from statistics import NormalDist

import pytest
import torch

from analysis import analysis_prune, find_prunable
from analysis.config import derive, load_config
from analysis.engine import executors
from analysis.engine._adaptive import PairedEstimate
from analysis.engine._decision import Candidate, DecisionRule, ParamDecision, look_schedule
from analysis.errors import AnalysisFileError, ConfigError
from analysis.inputs.data import apply_data_cache, build_eval_loader
from analysis.inputs.models import build_model
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.io.store import AnalysisStore
from analysis.io.tables import export_csv
from analysis.planning.estimates import estimate_notice
from analysis.planning.plan import build_plan
from analysis.planning.ratios import get_ratios_by_loss
from analysis.planning.result import PlanResult
from analysis.reporting.plan_text import format_plan

import engine_models
from helpers import REPO, batches, pseudo_labelled, randomize

TARGET = 0.02


def population(worse: int, better: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Paired differences of ``size`` images: ``worse`` of them +1 (the variant got it wrong), ``better`` -1."""
    values = torch.zeros(size, dtype=torch.float64)
    values[:worse] = 1.0
    values[worse : worse + better] = -1.0
    return values[torch.randperm(size, generator=generator)]


def wrong_decisions(rule: DecisionRule, family: list[torch.Tensor], baseline: float, batch: int) -> int:
    """Run every variant of a family until it settles (or the set ends); count sides that differ from the side of
    its loss on the whole set."""
    wrong = 0
    for values in family:
        exact = float(values.sum()) / len(values) / baseline
        candidate = Candidate(0.5, PairedEstimate(len(values), baseline, z=rule.z))
        for start in range(0, len(values), batch):
            candidate.estimate.add(values[start : start + batch])
            candidate.look(rule)
            if candidate.side is not None:
                break
        if candidate.side is not None:
            wrong += candidate.side != ("above" if exact > rule.target else "below")
    return wrong


def family_error_rate(z: float | None, error: float, families: int = 150, variants: int = 10) -> float:
    """Share of families (runs) with at least one wrong decision; every variant's loss on the whole set lies close
    to the target (losses 0.008 to 0.032 around 0.02), where wrong decisions happen."""
    size, baseline, batch = 2000, 0.9, 50
    rule = DecisionRule.build(TARGET, error, size, variants)
    if z is not None:
        rule = DecisionRule(TARGET, z, rule.looks)
    generator = torch.Generator().manual_seed(11)
    failures = 0
    for _ in range(families):
        family = []
        for k in range(variants):
            loss = TARGET + (k - variants / 2) * 0.0024
            net = round(loss * baseline * size)
            family.append(population(net + 12, 12, size, generator))
        failures += wrong_decisions(rule, family, baseline, batch) > 0
    return failures / families


def test_the_chance_of_any_wrong_decision_stays_under_the_error_rate() -> None:
    error = 0.2
    rate = family_error_rate(None, error)
    # 150 simulated runs of 10 variants each near the target: the rate is below 0.2 up to 3 standard deviations
    assert rate <= error + 3 * (error * (1 - error) / 150) ** 0.5
    # the same looks at a per-look one-sided level of 0.2 (no split over variants and looks) go wrong far more often:
    # the split is what keeps the rate down, and the simulation can see it
    unsplit = family_error_rate(NormalDist().inv_cdf(1 - error), error)
    assert unsplit > error + 0.1 and unsplit > 2 * rate


def test_the_error_is_split_over_variants_and_looks() -> None:
    assert look_schedule(5000) == (200, 300, 450, 675, 1013, 1520, 2280, 3420)
    assert look_schedule(150) == ()  # fewer images than the first look: every variant runs to the end
    rule = DecisionRule.build(0.02, 0.05, 5000, 140)
    assert rule.z == pytest.approx(NormalDist().inv_cdf(1 - 0.05 / (140 * 8)))
    assert DecisionRule.build(0.02, 0.05, 5000, 1400).z > rule.z  # more variants, wider intervals


def candidate(ratio: float, worse: int, size: int = 1000, seen: int = 1000) -> Candidate:
    """A candidate that saw ``seen`` images, ``worse`` of them wrong where the baseline was right (baseline 1)."""
    result = Candidate(ratio, PairedEstimate(size, 1.0, z=3.0))
    values = torch.zeros(seen, dtype=torch.float64)
    values[:worse] = 1.0
    result.estimate.add(values)
    return result


def test_larger_ratios_than_one_settled_above_are_dropped_and_the_interpolated_pair_completed() -> None:
    rule = DecisionRule(TARGET, 3.0, (200,))
    low, middle, high, top = (candidate(r, w, seen=200) for r, w in ((0.1, 0), (0.2, 0), (0.3, 40), (0.4, 80)))
    decision = ParamDecision(rule, [top, high, middle, low])
    decision.look()
    assert (low.side, middle.side, high.side, top.side) == ("below", "below", "above", "above")
    assert decision.kept() == [low, middle, high] and decision.dropped() == [top]
    # PaddleSlim's rule interpolates between 0.2 and 0.3: those two run on, the others are done
    assert decision.needing() == [middle, high]
    for c in (middle, high):
        c.estimate.add(torch.zeros(800, dtype=torch.float64))
        c.exact_loss = c.estimate.loss()
    assert decision.needing() == [] and [c.settled() for c in decision.kept()] == ["below", "exact", "exact"]


def test_no_loss_enters_the_rule_when_the_first_ratio_is_above_or_the_last_below() -> None:
    rule = DecisionRule(TARGET, 3.0, (200,))
    all_above = ParamDecision(rule, [candidate(0.1, 40, seen=200), candidate(0.2, 80, seen=200)])
    all_above.look()
    assert [c.ratio for c in all_above.kept()] == [0.1] and all_above.needing() == []
    all_below = ParamDecision(rule, [candidate(0.1, 0, seen=200), candidate(0.2, 0, seen=200)])
    all_below.look()
    assert all_below.needing() == [] and [c.settled() for c in all_below.kept()] == ["below", "below"]


def test_an_undecided_variant_blocks_the_pair_and_a_recorded_ratio_counts() -> None:
    rule = DecisionRule(TARGET, 3.0, (200,))
    open_ = candidate(0.2, 4, seen=200)  # loss 0.02: on neither side yet
    above = candidate(0.3, 60, seen=200)
    decision = ParamDecision(rule, [open_, above], recorded={0.1: "below"})
    decision.look()
    assert open_.side is None and decision.needing() == [open_]  # the pair is not known until 0.2 settles
    settled_above = ParamDecision(rule, [candidate(0.2, 60, seen=200)], recorded={0.1: "below"})
    settled_above.look()
    assert settled_above.needing() == settled_above.kept()  # paired with the recorded 0.1: completed


def test_a_decision_the_whole_set_overturns_sends_the_scan_on() -> None:
    rule = DecisionRule(TARGET, 3.0, (200,))
    low, middle, high = candidate(0.1, 0, seen=200), candidate(0.2, 40, seen=200), candidate(0.3, 6, seen=200)
    decision = ParamDecision(rule, [low, middle, high])
    decision.look()
    assert middle.side == "above" and high.side is None and decision.dropped() == [high]
    assert decision.needing() == [low, middle]  # the pair 0.1/0.2 is completed on every image
    low.estimate.add(torch.zeros(800, dtype=torch.float64))
    middle.estimate.add(torch.zeros(800, dtype=torch.float64))
    low.exact_loss, middle.exact_loss = 0.0, 0.01  # the whole set puts 0.2 below the target after all
    assert decision.dropped() == [] and decision.needing() == [high]  # 0.3 is needed again, from where it stopped


def test_a_precision_stops_the_interpolated_pair_early() -> None:
    rule = DecisionRule(TARGET, 3.0, (200,), precision=0.1)
    low, high = candidate(0.1, 0, seen=400), candidate(0.2, 100, seen=400)
    decision = ParamDecision(rule, [low, high])
    decision.look()
    assert decision.needing() == []  # both within +-0.1 already
    assert [c.settled() for c in decision.kept()] == ["below", "above"]


# The engine


@pytest.fixture(scope="module")
def digits() -> tuple[torch.nn.Module, object]:
    """The demo MobileNetV2 and the shipped digits validation set (450 images)."""
    digits = REPO / "datasets" / "digits"
    given = {"Global.data_dir": str(digits), "Global.model_dir": str(digits / "weights")}
    config = derive(load_config(REPO / "configs" / "demo" / "digits_mobilenet.yaml"), given).Global
    loader = build_eval_loader(config, torch.device("cpu"))
    apply_data_cache(loader, "ram", None, progress=False)  # decoded once for the many passes
    return build_model(config), loader


RATIOS = (0.1, 0.2, 0.3, 0.4)


def test_decision_mode_gives_the_exact_runs_derived_ratios_on_a_demo_model(tmp_path: Path, digits) -> None:
    model, loader = digits
    exact = analysis_prune(model, loader, tmp_path / "exact.pkl", pruned_ratios=RATIOS, target_loss=TARGET,
                           progress=False)  # fmt: skip
    decided = analysis_prune(model, loader, tmp_path / "decision.pkl", pruned_ratios=RATIOS, target_loss=TARGET,
                             precision="decision", progress=False)  # fmt: skip
    assert decided == exact and len(exact) == 35
    sidecar = load_sidecar(tmp_path / "decision.pkl")
    losses = load_sensitivities(tmp_path / "decision.pkl")
    exact_losses = load_sensitivities(tmp_path / "exact.pkl")
    assert get_ratios_by_loss(losses, TARGET) == exact
    used = evaluated = 0
    fewest = 450
    settled: set[str] = set()
    for name, info in sidecar["params"].items():
        variants = info["variants"]
        for key, variant in variants.items():
            ratio = float(key)
            settled.add(variant["settled"])
            low, high = variant["interval"]
            if variant["settled"] == "above":
                assert low > TARGET and exact_losses[name][ratio] > TARGET
            if variant["settled"] == "below":
                assert high < TARGET and exact_losses[name][ratio] <= TARGET
            if variant["settled"] == "exact":
                assert losses[name][ratio] == exact_losses[name][ratio] and variant["samples"] == 450
            used += variant["samples"]
            fewest = min(fewest, variant["samples"])
            evaluated += 1
        # ratios above one decided above the target are skipped, and the sidecar says where and why
        above = [float(k) for k, v in variants.items() if v["settled"] == "above" or losses[name][float(k)] > TARGET]
        if above and min(above) < max(RATIOS):
            assert info["early_stop"]["ratio"] == min(above) and "target_loss" in info["early_stop"]["condition"]
            assert max(float(k) for k in variants) == min(above)
    assert {"above", "below", "exact"} <= settled
    assert evaluated < len(RATIOS) * 35 and used < evaluated * 450 and fewest < 450  # fewer variants and images

    again = analysis_prune(model, loader, tmp_path / "decision.pkl", pruned_ratios=RATIOS, target_loss=TARGET,
                           precision="decision", progress=False)  # fmt: skip
    assert again == exact and load_sensitivities(tmp_path / "decision.pkl") == losses  # skipped ratios stay skipped


def test_a_killed_decision_run_resumes_to_the_same_file(tmp_path: Path, digits, monkeypatch) -> None:
    model, loader = digits
    images = next(iter(loader))[0]
    names = [p.name for p in find_prunable(model, images) if p.prunable][4:14]  # ten convs keep it short
    kwargs = {"pruned_ratios": RATIOS, "target_loss": TARGET, "precision": "decision", "progress": False,
              "prune_params": names}  # fmt: skip
    analysis_prune(model, loader, tmp_path / "whole.pkl", **kwargs)
    monkeypatch.setattr(executors, "CHUNK_SECONDS", 0.0)  # one unit per pass: the kill lands between two units' saves
    record, calls = AnalysisStore.record_variant, []

    def killed_after_some(self, names, ratio, variant):
        calls.append(ratio)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return record(self, names, ratio, variant)

    monkeypatch.setattr(AnalysisStore, "record_variant", killed_after_some)
    with pytest.raises(KeyboardInterrupt):
        analysis_prune(model, loader, tmp_path / "resumed.pkl", **kwargs)
    monkeypatch.setattr(AnalysisStore, "record_variant", record)
    partial = load_sensitivities(tmp_path / "resumed.pkl")
    assert 0 < sum(map(len, partial.values())) < sum(map(len, load_sensitivities(tmp_path / "whole.pkl").values()))
    analysis_prune(model, loader, tmp_path / "resumed.pkl", **kwargs)
    assert (tmp_path / "resumed.pkl").read_bytes() == (tmp_path / "whole.pkl").read_bytes()


def test_the_resume_fingerprint_separates_exact_adaptive_and_decision_files(tmp_path: Path) -> None:
    model = randomize(engine_models.slow_cnn(delay=0.0))
    data = pseudo_labelled(model, batches(count=4, size=25))
    runs = {
        "exact": {},
        "adaptive": {"precision": 0.05},
        "decision": {"precision": "decision"},
        "decision at another target": {"precision": "decision", "target_loss": 0.05},
    }
    for name, kwargs in runs.items():
        target = tmp_path / f"{name}.pkl"
        analysis_prune(model, data, target, pruned_ratios=(0.5,), **{"target_loss": 0.02, **kwargs}, progress=False)
        before = target.read_bytes()
        for other, other_kwargs in runs.items():
            if other == name:
                continue
            with pytest.raises(AnalysisFileError, match=r"(precision|decision) .* \(this run uses"):
                analysis_prune(model, data, target, pruned_ratios=(0.5, 0.7),
                               **{"target_loss": 0.02, **other_kwargs}, progress=False)  # fmt: skip
            assert target.read_bytes() == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "decision"}, r"precision: decision settles each variant on its side of target_loss"),
        ({"precision": "decision", "target_loss": 0.02, "early_stop_mode": "dropped", "early_stop_value": 0.1},
         r"remove early_stop_mode"),
        ({"precision": "decisive", "target_loss": 0.02}, r"precision must be a number between 0 and 1 .* or decision"),
        ({"precision": "decision", "target_loss": 0.02, "decision_error": 1.5}, r"decision_error must be between"),
        ({"precision": 0.01, "decision_precision": 0.01}, r"decision_precision applies to precision: decision"),
        ({"precision": "decision", "target_loss": 0.02, "engine": "reference"}, r"precision needs engine: fast"),
    ],
)  # fmt: skip
def test_bad_decision_settings_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        analysis_prune(torch.nn.Linear(1, 1), [], tmp_path / "s.pkl", **kwargs)


def test_a_plan_and_the_csv_of_decision_driven_losses_say_they_are_estimates(tmp_path: Path, digits) -> None:
    model, loader = digits
    names = [p.name for p in find_prunable(model, next(iter(loader))[0]) if p.prunable][:6]
    kwargs = {"pruned_ratios": RATIOS, "target_loss": TARGET, "prune_params": names, "progress": False}
    analysis_prune(model, loader, tmp_path / "exact.pkl", **kwargs)
    analysis_prune(model, loader, tmp_path / "decision.pkl", precision="decision", **kwargs)
    assert estimate_notice(tmp_path / "exact.pkl") is None
    notice = estimate_notice(tmp_path / "decision.pkl")
    sidecar = load_sidecar(tmp_path / "decision.pkl")
    variants = [v for info in sidecar["params"].values() for v in info["variants"].values()]
    estimated = sum(v["settled"] in ("above", "below") for v in variants)
    skipped = sum("early_stop" in info for info in sidecar["params"].values())
    assert estimated and skipped
    assert notice == (
        f"{estimated} of {len(variants)} losses in decision.pkl are estimates (decision-driven sampling settled each "
        f"only as above or below target_loss 0.02); {skipped} param(s) lack the ratios above one settled above "
        "target_loss 0.02 (not evaluated by decision-driven sampling), which the plan cannot choose, so the plan's "
        "predicted loss is approximate"
    )
    example = next(iter(loader))[0]
    plan = build_plan(model, example, tmp_path / "decision.pkl", 0.05, "macs")
    shown = format_plan(PlanResult(plan, None, estimates=notice))
    assert f"note: {notice}; measure it: python run.py verify" in shown

    with export_csv(tmp_path / "decision.pkl", style="long").open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[-4:] == ["images", "interval_low", "interval_high", "settled"]
    for row in rows[1:]:
        if float(row["sparsity"]) > 0:
            variant = sidecar["params"][row["parameter"]]["variants"][f"{float(row['sparsity']):g}"]
            assert (int(row["images"]), row["settled"]) == (variant["samples"], variant["settled"])
            assert [float(row["interval_low"]), float(row["interval_high"])] == variant["interval"]
    with export_csv(tmp_path / "exact.pkl", style="long").open() as handle:
        header = next(csv.reader(handle))
    assert "settled" not in header and "images" not in header  # an exact file has no sampling columns


def test_the_terminal_table_marks_estimated_losses(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the demo config's paths are relative to the repository
    config = Path("configs") / "demo" / "digits_mobilenet.yaml"
    result = cli("--config_path", config, "--analysis_file", tmp_path / "s.pkl", "--no_report",
                 "SensitivityAnalysis.precision=decision")  # fmt: skip
    assert result.code == 0, result.err
    assert "('~' = estimated on part of the images, see the sidecar's interval)" in result.out
    sidecar = load_sidecar(tmp_path / "s.pkl")
    marked = 0
    for name, info in sidecar["params"].items():
        row = next(line for line in result.out.splitlines() if line.startswith(name + " "))
        for variant in info["variants"].values():
            shown = f"{variant['loss']:+.4f}"
            low, high = variant["interval"]
            assert ("~" + shown in row) == (low != high) and shown in row
            marked += low != high
    assert marked  # some losses are estimates, and only those carry the mark


# ---- decision_error down to the smallest float (issue 26) ---------------------------------------------------------

TINY_ERRORS = (1e-17, 1e-100, 5e-324)


# z at these errors split over 140 variants x 8 looks (5,000 images), solved with mpmath at 60 digits
REFERENCE_Z = {1e-17: 9.2744298994593306283, 1e-100: 21.60026930476204017, 5e-324: 38.649373047185854327}


def log_upper_tail(z: float) -> float:
    """``log P(Z > z)`` for a standard normal ``Z``, from Laplace's continued fraction of the Mills ratio: a method
    independent of the code's, and in logarithms, so that it holds where the tail itself underflows."""
    fraction = z
    for k in range(400, 0, -1):
        fraction = z + k / fraction
    return -0.5 * z * z - 0.5 * math.log(2 * math.pi) - math.log(fraction)


@pytest.mark.parametrize("error", TINY_ERRORS)
def test_a_tiny_decision_error_gives_the_exact_quantile(error: float) -> None:
    rule = DecisionRule.build(0.05, error, population=5000, variants=140)
    tests = 140 * len(rule.looks)
    assert len(rule.looks) == 8 and math.isfinite(rule.z)
    assert rule.z == pytest.approx(REFERENCE_Z[error], rel=1e-14)
    assert log_upper_tail(rule.z) == pytest.approx(math.log(error) - math.log(tests), abs=1e-9)  # tail to rel 1e-9
    if error / tests > 1e-300:  # where the tail is a float, check it directly too
        assert math.erfc(rule.z / math.sqrt(2)) / 2 == pytest.approx(error / tests, rel=1e-9)


def test_the_quantile_grows_as_the_error_shrinks_down_to_the_smallest_float() -> None:
    errors = [0.5, 0.05, *(10.0**-k for k in range(3, 324)), 5e-324]
    for variants in (1, 140, 10**9):  # the split underflows to 0 for the smallest errors
        z = [DecisionRule.build(0.05, error, 5000, variants).z for error in errors]
        assert all(math.isfinite(value) for value in z)
        assert all(b > a for a, b in itertools.pairwise(z)), variants

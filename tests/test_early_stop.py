"""Early stop in the analysis pipeline: NNI's four modes on the chosen metric, same file from both engines and
after a resume, and the config keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import analysis_prune
from analysis.early_stop import EarlyStop
from analysis.engine.partition import GraphRunner
from analysis.io.results import load_sensitivities, load_sidecar

from helpers import analyse_both, batches, pseudo_labelled, randomize, tiny_global, write_config
from tiny_models import tiny_resnet

RATIOS = (0.125, 0.25, 0.5, 0.75)


@pytest.mark.parametrize(
    ("mode", "value", "baseline", "metric", "expected"),
    [
        ("minimize", 0.5, 0.9, 0.49, True),
        ("minimize", 0.5, 0.9, 0.5, False),  # strict, as in NNI
        ("maximize", 2.0, 1.0, 2.01, True),
        ("maximize", 2.0, 1.0, 2.0, False),
        ("dropped", 0.1, 0.9, 0.79, True),
        ("dropped", 0.1, 0.9, 0.81, False),
        ("raised", 0.5, 1.0, 1.51, True),
        ("raised", 0.5, 1.0, 1.49, False),
    ],
)
def test_tripped(mode: str, value: float, baseline: float, metric: float, expected: bool) -> None:
    assert EarlyStop(mode, value).tripped(baseline, metric) is expected


def stopped_data():
    model = randomize(tiny_resnet())
    return model, pseudo_labelled(model, batches(count=2))


def check_prefixes(sidecar: dict, stop: EarlyStop) -> int:
    """Every param's recorded ratios are a prefix of RATIOS that ends at the first tripping one; returns how many
    params stopped early."""
    baseline = sidecar["baseline"]["top1"]
    stopped = 0
    for name, info in sidecar["params"].items():
        variants = info["variants"]
        recorded = [r for r in RATIOS if f"{r:g}" in variants]
        assert recorded == list(RATIOS[: len(recorded)]), name
        trips = [stop.tripped(baseline, variants[f"{r:g}"]["top1"]) for r in recorded]
        assert not any(trips[:-1]), name
        if len(recorded) < len(RATIOS):
            assert trips[-1] and info["early_stop"]["ratio"] == recorded[-1], name
            stopped += 1
    return stopped


def test_both_engines_stop_at_the_same_variant(tmp_path: Path) -> None:
    model, data = stopped_data()
    stop = EarlyStop("dropped", 0.2)
    reference, fast = analyse_both(
        model, data, tmp_path, pruned_ratios=RATIOS, early_stop_mode="dropped", early_stop_value=0.2
    )
    stopped = check_prefixes(reference, stop)
    assert 0 < stopped < len(reference["params"])  # the test only means something if some stop and some do not
    assert check_prefixes(fast, stop) == stopped


def test_resume_skips_what_an_uninterrupted_run_skips(tmp_path: Path) -> None:
    model, data = stopped_data()
    kwargs = dict(pruned_ratios=RATIOS, early_stop_mode="dropped", early_stop_value=0.2, progress=False)
    analysis_prune(model, data, tmp_path / "whole.pkl", **kwargs)
    names = list(load_sensitivities(tmp_path / "whole.pkl"))
    analysis_prune(model, data, tmp_path / "resumed.pkl", prune_params=names[:3], **kwargs)  # "interrupted"
    analysis_prune(model, data, tmp_path / "resumed.pkl", **kwargs)
    assert (tmp_path / "resumed.pkl").read_bytes() == (tmp_path / "whole.pkl").read_bytes()

    counted = CountedBatches(data)
    analysis_prune(model, counted, tmp_path / "whole.pkl", **kwargs)
    assert counted.passes == 1  # only the first batch, read to fingerprint the data: stopped ratios are not pending


class CountedBatches(list):
    """A list of batches that counts how often it is iterated."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def test_yaml_keys(tmp_path: Path, cli, list_data: Path) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.25, 0.5, 0.75],
                                "early_stop_mode": "maximize", "early_stop_value": -1.0},
    })  # fmt: skip
    result = cli("--config_path", config, "--no_report")
    assert result.code == 0, result.err
    sidecar = load_sidecar(tmp_path / "s.pkl")
    assert all(list(info["variants"]) == ["0.25"] for info in sidecar["params"].values())  # top1 > -1 always
    assert "'stop' = skipped after an early stop" in result.out

    bad = write_config(tmp_path / "bad.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "b.pkl"), "early_stop_mode": "dropped"},
    })  # fmt: skip
    result = cli("--config_path", bad)
    assert result.code == 2
    assert "SensitivityAnalysis.early_stop_value" in result.err and not (tmp_path / "b.pkl").exists()


def test_fast_engine_does_not_evaluate_the_skipped_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = stopped_data()
    runs = []
    original = GraphRunner.run_suffix

    def counted(self, plan, frontier):
        runs.append(1)
        return original(self, plan, frontier)

    monkeypatch.setattr(GraphRunner, "run_suffix", counted)
    kwargs = dict(pruned_ratios=RATIOS, engine="fast", progress=False)
    analysis_prune(model, data, tmp_path / "stop.pkl", early_stop_mode="dropped", early_stop_value=0.2, **kwargs)
    with_stop = len(runs)
    runs.clear()
    analysis_prune(model, data, tmp_path / "all.pkl", **kwargs)
    skipped = sum(len(RATIOS) - len(curve) for curve in load_sensitivities(tmp_path / "stop.pkl").values())
    assert skipped > 0
    assert len(runs) - with_stop == skipped * len(data)  # one suffix run per batch saved for every skipped variant

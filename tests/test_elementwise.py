"""Element-wise (fine-grained) sensitivity: the smallest weights of one 2D/4D parameter zeroed, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from analysis import analysis_prune
from analysis.config import load_config
from analysis.engine.evaluate import evaluate
from analysis.engine.loss import relative_loss
from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.results import load_sensitivities, load_sidecar, ratios_path
from analysis.structure.elementwise import element_params, element_slices, magnitude_order, weights_to_zero
from analysis.structure.masking import zeroed

from helpers import analyse_both, batches, pseudo_labelled, randomize, tiny_global, write_config
from tiny_models import tiny_resnet


def test_counts_order_and_slices() -> None:
    assert [weights_to_zero(160, r) for r in (0.1, 0.5, 0.55, 0.999)] == [16, 80, 88, 159]
    assert weights_to_zero(10, 0.25) == 2  # round half to even: 2.5 -> 2
    weight = torch.tensor([[3.0, -1.0], [1.0, 0.5]])
    order = magnitude_order(weight)
    assert order.tolist() == [3, 1, 2, 0]  # |w| ascending, ties (-1, 1) in index order
    with zeroed(element_slices(weight, order[:2])):
        assert weight.tolist() == [[3.0, 0.0], [1.0, 0.0]]
    assert weight.tolist() == [[3.0, -1.0], [1.0, 0.5]]


def test_candidates_are_every_2d_and_4d_weight() -> None:
    names = [p.name for p in element_params(tiny_resnet())]
    assert names[0] == "conv1.weight" and names[-1] == "fc.weight"
    assert "layer2.downsample.0.weight" in names
    assert not any("bn" in name or name.endswith("bias") for name in names)


def test_engines_agree_and_losses_are_the_zeroed_model(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches(count=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference, _ = analyse_both(model, data, tmp_path, pruned_ratios=(0.5, 0.9), granularity="element",
                                target_loss=0.05)  # fmt: skip
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    losses = load_sensitivities(tmp_path / "reference.pkl")
    assert list(losses) == [p.name for p in element_params(model)]
    baseline = evaluate(model, data).metrics()["top1"]
    for name in ("fc.weight", "layer1.conv2.weight"):
        weight = model.get_parameter(name)
        with zeroed(element_slices(weight, magnitude_order(weight)[: weights_to_zero(weight.numel(), 0.9)])):
            top1 = evaluate(model, data).metrics()["top1"]
        assert losses[name][0.9] == relative_loss(baseline, top1, "top1")
        variant = reference["params"][name]["variants"]["0.9"]
        assert variant["weights_zeroed"] == weights_to_zero(weight.numel(), 0.9) and variant["mode"] == "element"
    plan = yaml.safe_load(ratios_path(tmp_path / "reference.pkl").read_text())
    assert plan["ElementPrune"]["criterion"] == "magnitude"


def test_config_and_fingerprint(tmp_path: Path, list_data: Path, cli) -> None:
    path = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"granularity": "element", "criterion": "geometry_median"},
    })  # fmt: skip
    with pytest.raises(ConfigError, match="granularity: element zeroes the smallest weights by magnitude"):
        load_config(path)
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches(count=1))
    analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), progress=False)
    with pytest.raises(AnalysisFileError, match="granularity"):  # filter and element losses never mix in one file
        analysis_prune(model, data, tmp_path / "s.pkl", pruned_ratios=(0.5,), granularity="element")
    assert load_sidecar(tmp_path / "s.pkl")["fingerprint"]["settings"].get("granularity") is None

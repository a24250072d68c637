"""The typed sidecar schema: byte-identical round trips of real files, old files, unknown keys, validation errors
naming the file and the key, the one variant key, and the key order the store writes."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from analysis.compat.paddleslim import analysis_prune
from analysis.errors import AnalysisFileError
from analysis.io import sidecar as schema
from analysis.io.results import load_sensitivities, save_sensitivities, sidecar_path
from analysis.io.sidecar import (
    CostRecord,
    EarlyStopRecord,
    FingerprintRecord,
    ParamRecord,
    PlanGroupRecord,
    Sidecar,
    VariantRecord,
    variant_key,
)
from analysis.io.store import AnalysisStore, Fingerprint
from analysis.io.tables import export_csv

# A sidecar as the demo (digits_mobilenet, tool 0.1.0) wrote it after a measured plan, cut down to two params,
# two variants each, one plan group and one search evaluation; every section and value type is the real one.
CONVENTION = (
    "multiply-accumulates of Conv1d/2d/3d, ConvTranspose and Linear layers only, per sample (conv: "
    "output elements x in_channels/groups x kernel elements; bias and other ops not counted)"
)
MEASURED_METHOD = (
    "measured: started from the knapsack plan, improved with 30 joint evaluations (all groups pruned at "
    "once, BatchNorm re-estimated); predicted loss = the loss measured for this plan"
)
DEMO_SIDECAR: dict[str, Any] = {
    "tool": {"name": "prune-sensitivity", "version": "0.1.0"},
    "fingerprint": {
        "model": "b99fade8d164ac47489ccb8c10ae67a9aae9bb41103a4ce44834c0df2fb31821",
        "data": "d569ed9ff249d7aebbd475d92725aec0dd68a888c801d327fd3646abd495e6bb",
        "settings": {
            "criterion": "l1_norm",
            "group_reduction": "self",
            "metric": "top1",
            "metric_mode": "relative",
            "precision": None,
        },
    },
    "config": {
        "Global": {
            "model_dir": "datasets/digits/weights",
            "model_filename": None,
            "params_filename": "digits_mobilenet_v2.pth",
            "arch": "mobilenet_v2",
            "arch_kwargs": {"num_classes": 10, "width_mult": 0.5},
            "weights": None,
            "trust_model_file": False,
            "data_dir": "datasets/digits",
            "val_list": "val_list.txt",
            "batch_size": 128,
            "img_size": 28,
            "resize_size": 32,
            "interpolation": "bilinear",
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            "num_workers": 0,
            "data_cache": "auto",
            "cache_max_gb": None,
            "device": "auto",
            "max_samples": None,
            "seed": 0,
            "calib_list": None,
            "calib_samples": 1024,
            "calib_resize_size": None,
            "calib_img_size": None,
        },
        "SensitivityAnalysis": {
            "analysis_file": "outputs/demo/digits_mobilenet/sensitivity.pkl",
            "pruned_ratios": [0.1, 0.2, 0.3, 0.4],
            "target_loss": 0.02,
            "criterion": "l1_norm",
            "prune_params_name": None,
            "skip_params": [],
            "metric": "top1",
            "metric_mode": "relative",
            "group_reduction": "self",
            "engine": "fast",
            "precision": None,
            "granularity": "filter",
            "early_stop_mode": None,
            "early_stop_value": None,
            "adaptive_bn": False,
            "round_to": 1,
            "target_macs_reduction": None,
            "target_params_reduction": None,
            "plan_method": "knapsack",
            "eval_budget": None,
            "verify": False,
            "export_dir": None,
            "report": True,
        },
        "source": "configs/demo/digits_mobilenet.yaml",
        "ignored_blocks": [],
    },
    "params": {
        "features.0.0.weight": {
            "module": "features.0.0",
            "shape": [16, 3, 3, 3],
            "group": ["features.0.0 (Conv2d, out)", "features.0.1 (BatchNorm2d, out)"],
            "coupled_params": [],
            "conv_groups": 1,
            "mode": "mask",
            "mask_vs_physical_max_abs_diff": 0.0,
            "variants": {
                "0.1": {
                    "loss": 0.029279279279279355,
                    "top1": 0.9577777777777777,
                    "top5": 1.0,
                    "ce": 0.18766609827677408,
                    "images": 450,
                    "channels_removed": 2,
                    "channels": 16,
                    "mode": "mask",
                    "seconds": 0.023,
                    "macs": 1786352,
                    "params": 700394,
                    "macs_reduction": 0.009563096030161899,
                    "params_reduction": 0.00013704692429585005,
                },
                "0.2": {
                    "loss": 0.24324324324324323,
                    "top1": 0.7466666666666667,
                    "top5": 0.94,
                    "ce": 0.9596666293674045,
                    "images": 450,
                    "channels_removed": 3,
                    "channels": 16,
                    "mode": "mask",
                    "seconds": 0.023,
                    "macs": 1777728,
                    "params": 700346,
                    "macs_reduction": 0.014344644045242848,
                    "params_reduction": 0.00020557038644377506,
                },
            },
        },
        "features.1.conv.1.weight": {
            "module": "features.1.conv.1",
            "shape": [8, 16, 1, 1],
            "group": ["features.1.conv.1 (Conv2d, out)", "features.1.conv.2 (BatchNorm2d, out)"],
            "coupled_params": [],
            "conv_groups": 1,
            "mode": "mask",
            "mask_vs_physical_max_abs_diff": 0.0,
            "variants": {
                "0.1": {
                    "loss": 0.0022522522522522665,
                    "top1": 0.9844444444444445,
                    "top5": 1.0,
                    "ce": 0.09239519966973199,
                    "images": 450,
                    "channels_removed": 1,
                    "channels": 8,
                    "mode": "mask",
                    "seconds": 0.023,
                    "macs": 1791056,
                    "params": 700424,
                    "macs_reduction": 0.006954978931026835,
                    "params_reduction": 9.421976045339691e-05,
                },
                "0.2": {
                    "loss": 0.015765765765765754,
                    "top1": 0.9711111111111111,
                    "top5": 1.0,
                    "ce": 0.12445497724745008,
                    "images": 450,
                    "channels_removed": 2,
                    "channels": 8,
                    "mode": "mask",
                    "seconds": 0.023,
                    "macs": 1778512,
                    "params": 700358,
                    "macs_reduction": 0.01390995786205367,
                    "params_reduction": 0.00018843952090679382,
                },
            },
        },
    },
    "unprunable": {
        "features.1.conv.0.0.weight": "depthwise conv: pruned together with the conv that produces its input channels"
    },
    "model_order": ["features.0.0.weight", "features.1.conv.0.0.weight", "features.1.conv.1.weight"],
    "baseline": {"top1": 0.9866666666666667, "top5": 1.0, "ce": 0.09342329449123807, "images": 450, "seconds": 0.092},
    "cost": {
        "convention": CONVENTION,
        "mode": "macs",
        "macs": 1803600,
        "params": 700490,
    },
    "saved_at": "2026-11-23T21:25:16+0000",
    "plan": {
        "measure": "macs",
        "target": 0.4,
        "source": "budget",
        "method": "measured",
        "method_description": MEASURED_METHOD,
        "predicted_loss": 0.04054054054054058,
        "lower_bound": 0.05102127990059045,
        "dense": {
            "convention": CONVENTION,
            "mode": "macs",
            "macs": 1803600,
            "params": 700490,
        },
        "pruned": {"macs": 1082141, "params": 359705},
        "macs_reduction": 0.4000105344865824,
        "params_reduction": 0.48649516766834644,
        "settings": {"criterion": "l1_norm", "group_reduction": "self", "round_to": 1},
        "groups": [
            {
                "members": ["features.1.conv.1.weight"],
                "ranking_param": "features.1.conv.1.weight",
                "ratio": 0.125,
                "channels": 8,
                "channels_removed": 1,
                "predicted_loss": 0.0022522522522522665,
            }
        ],
        "search": {
            "evaluations": 30,
            "from_earlier_runs": 0,
            "repeated_plans": 0,
            "accepted_trades": 10,
            "starts": ["knapsack", "ce"],
            "finalists": [{"name": "trade 28", "top1": 0.9222222222222223, "top5": 1.0, "ce": 0.3689266798231337}],
            "chosen": "log_ce",
            "knapsack": {
                "name": "knapsack",
                "top1": 0.8977777777777778,
                "top5": 0.9955555555555555,
                "ce": 0.8414036983913845,
            },
            "settings": {
                "evaluations": 30,
                "seed": 0,
                "calibration_images": 256,
                "step": 0.0625,
                "min_step": 0.015625,
                "patience": 2,
                "finalists_by_ce": 3,
                "finalists_by_top1": 2,
            },
        },
        "ratios_file": "outputs/demo/digits_mobilenet/sensitivity.pkl.plan.yaml",
    },
    "plan_search": {
        "e5cc08aaf08a8ea557ba133ea9f9a3ea868ecb64c0351a075ad06d9f8a0e4269": {
            "key": {
                "model": "b99fade8d164ac47489ccb8c10ae67a9aae9bb41103a4ce44834c0df2fb31821",
                "data": "d569ed9ff249d7aebbd475d92725aec0dd68a888c801d327fd3646abd495e6bb",
                "calibration": "d2f0a114123f26a60002bde9daff09c3de47ddbd388c465253cbf158bda85660",
                "ranking": {"criterion": "l1_norm", "group_reduction": "self", "round_to": 1},
                "physical": False,
                "measure": "macs",
            },
            "evaluations": [
                {
                    "setting": "search",
                    "picks": [
                        ["features.1.conv.1.weight", "features.1.conv.1.weight", 1],
                        ["features.10.conv.0.0.weight", "features.10.conv.0.0.weight", 77],
                    ],
                    "metrics": {
                        "top1": 0.9044444444444445,
                        "top5": 0.9955555555555555,
                        "ce": 0.8525475735134549,
                        "images": 450,
                    },
                    "macs": 1082087,
                    "params": 301913,
                    "seconds": 0.176,
                }
            ],
        }
    },
}

# A whole sidecar as the writer before the typed schema wrote it (the tree at fc79f16^, tool 0.1.0): run.py on
# tests/tiny_models.py:tiny_resnet with 32 digits at 16x16, batch_size 32, pruned_ratios [0.5] and target_loss 0.1
# (analysis_file out/sensitivity.pkl), then run.py plan --target_macs_reduction 0.3 with the same config.
OLD_WRITER_FILE = Path(__file__).parent / "fixtures" / "sidecar_0.1.0_tiny_resnet.pkl.json"


def tool_text(data: Any) -> str:
    """JSON text exactly as this tool writes a sidecar."""
    return json.dumps(data, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def write_sidecar(path: Path, data: Any) -> Path:
    """Write ``data`` as the sidecar of the analysis file ``path``; returns the sidecar's path."""
    sidecar_path(path).write_text(tool_text(data), encoding="utf-8")
    return sidecar_path(path)


# ------------------------------------------------------------------------------------------------- variant key


@pytest.mark.parametrize(
    ("ratio", "key"),
    [(0.1 + 0.2, "0.3"), (1e-7, "0"), (0.30000000000000004, "0.3"), (0.1, "0.1"), (0.5, "0.5"), (1 / 3, "0.333333"),
     (0.123456789, "0.123457"), (2.5e-6, "3e-06"), (0.9, "0.9")],
)  # fmt: skip
def test_variant_key_is_the_historical_format(ratio: float, key: str) -> None:
    """Rounded to 6 decimals, then ``%g`` (the float 2.5e-6 lies just above the half, so it rounds up)."""
    assert variant_key(ratio) == key


def test_variant_key_merges_float_noise() -> None:
    assert variant_key(0.1 + 0.2) == variant_key(0.30000000000000004) == variant_key(0.3) == "0.3"
    assert variant_key(1e-7) == "0" and variant_key(1 / 3) == "0.333333"


# ------------------------------------------------------------------------------------------------- round trips


def test_demo_sidecar_round_trips_byte_identical_and_reads_typed(tmp_path: Path) -> None:
    path = tmp_path / "sensitivity.pkl"
    text = write_sidecar(path, DEMO_SIDECAR).read_text(encoding="utf-8")
    sidecar = schema.load(path)
    assert sidecar is not None and schema.dump(sidecar) == text
    schema.save(path, sidecar)
    assert sidecar_path(path).read_text(encoding="utf-8") == text
    first = next(iter(DEMO_SIDECAR["params"]))
    variant = sidecar.variant(first, 0.1)
    assert variant is not None and variant.loss == DEMO_SIDECAR["params"][first]["variants"]["0.1"]["loss"]
    assert variant.metric("top1") == DEMO_SIDECAR["params"][first]["variants"]["0.1"]["top1"]
    assert variant.channels_removed == 2 and variant.macs == 1786352 and variant.mode == "mask"
    assert sidecar.settings.metric_name == "top1" and sidecar.settings.ranking() == DEMO_SIDECAR["plan"]["settings"]
    assert sidecar.plan is not None and sidecar.plan.groups is not None
    assert sidecar.plan.groups[0].ranking_param == "features.1.conv.1.weight"
    assert sidecar.cost is not None and sidecar.cost.macs == 1803600
    assert sidecar.config is not None and sidecar.config.target_loss() == 0.02
    assert sidecar.config.Global is not None and sidecar.config.Global.arch == "mobilenet_v2"


def test_a_sidecar_of_the_writer_before_the_typed_schema_round_trips_byte_identical(tmp_path: Path) -> None:
    shutil.copy(OLD_WRITER_FILE, tmp_path / "s.pkl.json")
    sidecar = schema.load(tmp_path / "s.pkl")
    assert sidecar is not None and schema.dump(sidecar) == OLD_WRITER_FILE.read_text(encoding="utf-8")
    variant = sidecar.variant("layer1.conv2.weight", 0.5)
    assert variant is not None and (variant.channels_removed, variant.macs, variant.mode) == (4, 363680, "mask")
    assert sidecar.model_order is not None and len(sidecar.model_order) == 6  # the classifier is not listed
    assert sidecar.cost is not None and (sidecar.cost.macs, sidecar.cost.params) == (579744, 5266)
    assert sidecar.plan is not None and sidecar.plan.groups is not None
    assert [g.members for g in sidecar.plan.groups] == [["conv1.weight", "layer1.conv2.weight"]]  # the residual chain


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def labelled_batches(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random images labelled with the model's own predictions (baseline top1 = 1, so pruning shows)."""
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(8, 3, 12, 12, generator=generator) for _ in range(3)]
    with torch.inference_mode():
        return [(batch, model(batch).argmax(dim=1)) for batch in images]


def test_a_generated_sidecar_round_trips_and_matches_the_pickle(tmp_path: Path) -> None:
    model = tiny_model()
    path = tmp_path / "s.pkl"
    analysis_prune(model, labelled_batches(model), path, pruned_ratios=[0.25, 0.5, 0.75], precision=0.5,
                   early_stop_mode="minimize", early_stop_value=2.0, progress=False)  # fmt: skip
    text = sidecar_path(path).read_text(encoding="utf-8")
    sidecar = schema.load(path)
    assert sidecar is not None and schema.dump(sidecar) == text
    losses = load_sensitivities(path)
    assert losses and sidecar.model_order == ["0.weight", "3.weight", "8.weight"]  # the classifier, with its reason
    for name, curve in losses.items():
        for ratio, loss in curve.items():
            variant = sidecar.variant(name, ratio)
            assert variant is not None and variant.loss == loss  # the pickle's number is the sidecar's
            assert variant.interval is not None and len(variant.interval) == 2 and variant.precision == 0.5
            assert variant.metric("images") == 24 and variant.macs is not None
    # top1 < 2 always holds, so each param stops at its first ratio and nothing after it is evaluated
    assert sidecar.early_stops() == {"0.weight": 0.25, "3.weight": 0.25}
    assert all(list(curve) == [0.25] for curve in losses.values())
    assert sidecar.baseline is not None and sidecar.baseline["top1"] == 1.0


# ------------------------------------------------------------------------------------------ old and newer files


OLD_SIDECAR: dict[str, Any] = {  # an early version's file: no cost, model_order, plan, early_stop or costs
    "tool": {"name": "prune-sensitivity", "version": "0.0.1"},
    "fingerprint": {"model": "ab" * 32, "data": None, "settings": {"criterion": "l1_norm", "metric": "top1"}},
    "config": {"api": "analysis_prune", "pruned_ratios": [0.5], "criterion": "l1_norm", "metric": "top1"},
    "params": {"a.weight": {"module": "a", "shape": [4, 3, 3, 3], "variants": {"0.5": {"loss": 0.25, "top1": 0.6}}}},
    "unprunable": {},
    "baseline": {"top1": 0.8, "images": 10},
    "saved_at": "2025-01-01T00:00:00+0000",
}


def test_an_old_sidecar_reads_exports_and_resumes_in_dict_order(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"a.weight": {0.5: 0.25}})
    write_sidecar(path, OLD_SIDECAR)
    sidecar = schema.load(path)
    assert sidecar is not None and sidecar.cost is None and sidecar.plan is None and sidecar.model_order is None
    assert sidecar.early_stops() == {} and sidecar.settings.round_to is None
    assert schema.dump(sidecar) == tool_text(OLD_SIDECAR)
    rows = export_csv(path, style="long").read_text().splitlines()
    assert rows[1:] == ["a.weight,0.0,80.0,,,0.0,,,,", "a.weight,0.5,60.0,,,0.25,,,,"]

    fingerprint = Fingerprint("ab" * 32, None, {"criterion": "l1_norm", "metric": "top1"})
    store = AnalysisStore(path, fingerprint, ["a.weight", "b.weight"])
    store.set_cost({"convention": "MACs", "mode": "macs", "macs": 100, "params": 10})
    store.save()
    written = json.loads(sidecar_path(path).read_text())
    # as a dict updated in place would: known keys where they were, new ones (model_order, then cost) at the end
    assert list(written) == [*OLD_SIDECAR, "model_order", "cost"]
    assert written["params"] == OLD_SIDECAR["params"] and written["config"] == OLD_SIDECAR["config"]


def test_unknown_keys_of_other_versions_are_kept_where_they_were(tmp_path: Path) -> None:
    data = json.loads(json.dumps(OLD_SIDECAR))
    data = {"future_block": {"x": [1, 2]}, **data}
    data["params"]["a.weight"] = {"new_fact": "kept", **data["params"]["a.weight"], "zeta": None}
    data["params"]["a.weight"]["variants"]["0.5"].update(latency_ms=1.5, note="warm")
    data["baseline"]["energy_j"] = 3
    path = tmp_path / "s.pkl"
    write_sidecar(path, data)
    sidecar = schema.load(path)
    assert sidecar is not None and schema.dump(sidecar) == tool_text(data)
    param = sidecar.param("a.weight")
    assert param is not None and param.extra == {"new_fact": "kept", "zeta": None}
    variant = param.variant(0.5)
    assert variant is not None and variant.metric("latency_ms") == 1.5 and variant.extra == {"note": "warm"}

    param.variants = {**(param.variants or {}), "0.75": VariantRecord(loss=0.5, metrics={"top1": 0.4}, mode="mask")}
    sidecar.saved_at = "2026-01-01T00:00:00+0000"
    rewritten = json.loads(schema.dump(sidecar))
    assert list(rewritten) == list(data) and rewritten["future_block"] == {"x": [1, 2]}
    assert list(rewritten["params"]["a.weight"]) == ["new_fact", "module", "shape", "variants", "zeta"]
    assert rewritten["params"]["a.weight"]["variants"]["0.75"] == {"loss": 0.5, "top1": 0.4, "mode": "mask"}
    assert rewritten["params"]["a.weight"]["variants"]["0.5"] == data["params"]["a.weight"]["variants"]["0.5"]


def test_null_is_kept_apart_from_absent() -> None:
    written = FingerprintRecord(data="d").to_json()
    assert written == {"model": None, "data": "d"}  # always written, as the store always has
    group = PlanGroupRecord(members=["a"], predicted_loss=None).to_json()
    assert group == {"members": ["a"], "predicted_loss": None}
    assert VariantRecord(loss=0.1).to_json() == {"loss": 0.1}
    read = Sidecar.from_json({"cost": None, "saved_at": "t"})
    assert read.cost is None and read.to_json() == {"cost": None, "saved_at": "t"}


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"params": []}, r"params should be an object, not \[\]"),
        (
            {"params": {"a.weight": {"variants": {"0.1": {"loss": "x"}}}}},
            r'params\["a\.weight"\]\.variants\["0\.1"\]\.loss should be a number, not "x"',
        ),
        (
            {"params": {"a.weight": {"variants": {"half": {"loss": 0.1}}}}},
            r'params\["a\.weight"\]\.variants\["half"\] should be keyed by a ratio such as 0\.3, not "half"',
        ),
        ({"params": {"a.weight": {"shape": [4, 3.5]}}}, r'params\["a\.weight"\]\.shape\[1\] should be an integer'),
        ({"baseline": {"top1": "high"}}, r'baseline\["top1"\] should be a number, not "high"'),
        ({"model_order": ["a", 3]}, r"model_order\[1\] should be a string, not 3"),
        (
            {"fingerprint": {"settings": {"adaptive_bn": 1}}},
            r"fingerprint\.settings\.adaptive_bn should be true or false",
        ),
        ({"plan": {"groups": [{"channels": True}]}}, r"plan\.groups\[0\]\.channels should be an integer, not true"),
        ({"unprunable": {"a.weight": 7}}, r'unprunable\["a\.weight"\] should be a string'),
    ],
)
def test_a_structurally_wrong_sidecar_names_the_file_and_the_key(data: Any, where: str, tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    write_sidecar(path, data)
    with pytest.raises(AnalysisFileError, match=rf"Sidecar file .*s\.pkl\.json has the wrong structure: {where}"):
        schema.load(path)


def test_users_meet_the_validation_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"a.weight": {0.5: 0.25}})
    write_sidecar(path, {"params": {"a.weight": {"variants": {"0.5": {"loss": [0.25]}}}}})
    with pytest.raises(AnalysisFileError, match=r'variants\["0\.5"\]\.loss should be a number.*delete it'):
        export_csv(path, style="long")
    with pytest.raises(AnalysisFileError, match=r"loss should be a number"):
        AnalysisStore(path, Fingerprint(None, None), ["a.weight"])


# --------------------------------------------------------------------------------------------- the store's order


def test_the_store_writes_keys_in_the_order_a_dict_would(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    store = AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight", "b.weight"])
    store.set_baseline({"top1": 1.0, "images": 8})
    # b shares a's evaluation (coupled params): its variants come before anything describes it
    variant = VariantRecord(loss=0.25, metrics={"top1": 0.75}, channels_removed=2, mode="mask")
    store.record_variant(["a.weight", "b.weight"], 0.5, variant)
    store.describe("b.weight", ParamRecord(module="b", shape=[4, 4, 1, 1]))
    store.describe(
        "a.weight", ParamRecord(module="a", shape=[4, 3, 3, 3], early_stop=EarlyStopRecord(ratio=0.5, condition="c"))
    )
    store.clear_early_stop("a.weight")
    store.mark_early_stop("a.weight", 0.5, "metric < baseline - 0")
    store.save()
    written = json.loads(sidecar_path(path).read_text())
    assert written["params"]["a.weight"]["early_stop"] == {"ratio": 0.5, "condition": "metric < baseline - 0"}
    assert list(written) == ["tool", "fingerprint", "config", "params", "unprunable", "model_order", "baseline",
                             "saved_at"]  # fmt: skip
    assert list(written["params"]["b.weight"]) == ["variants", "module", "shape"]
    assert list(written["params"]["a.weight"]) == ["variants", "module", "shape", "early_stop"]
    assert written["params"]["a.weight"]["variants"]["0.5"] == {"loss": 0.25, "top1": 0.75, "channels_removed": 2,
                                                                "mode": "mask"}  # fmt: skip
    assert store.early_stops() == {"a.weight": 0.5} and store.variant_metric("b.weight", 0.5, "top1") == 0.75
    assert schema.load(path) == store.sidecar


def saved_store(path: Path) -> Path:
    """An analysis file of one param (``a.weight``, loss 0.25 at ratio 0.5) saved by a store fingerprinted as model
    ``m``, data ``d``, metric top1."""
    store = AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight"])
    store.record_variant(["a.weight"], 0.5, VariantRecord(loss=0.25, metrics={"top1": 0.75}, mode="mask"))
    store.save()
    return path


@pytest.mark.parametrize(
    ("model", "data", "refusal"),
    [
        ("m2", "d", r"s\.pkl was computed with another model \(its weights differ\); use a new "),
        ("m", "d2", r"s\.pkl was computed with other data or preprocessing; use a new "),
    ],
)
def test_resuming_with_another_model_or_data_is_refused(tmp_path: Path, model: str, data: str, refusal: str) -> None:
    path = saved_store(tmp_path / "s.pkl")
    with pytest.raises(AnalysisFileError, match=refusal):
        AnalysisStore(path, Fingerprint(model, data, {"metric": "top1"}), ["a.weight"])
    with pytest.raises(AnalysisFileError, match=r"computed with metric 'top1' \(this run uses 'top5'\)"):
        AnalysisStore(path, Fingerprint("m", "d", {"metric": "top5"}), ["a.weight"])
    # a part this run does not know (None) is not compared; the same fingerprint resumes with what was recorded
    for unknown in (Fingerprint(None, "d", {"metric": "top1"}), Fingerprint("m", None, {"metric": "top1"})):
        assert AnalysisStore(path, unknown, ["a.weight"]).sensitivities == {"a.weight": {0.5: 0.25}}


def test_a_stored_fingerprint_without_settings_resumes(tmp_path: Path) -> None:
    path = saved_store(tmp_path / "s.pkl")
    data = json.loads(sidecar_path(path).read_text())
    data["fingerprint"] = {"model": "m", "data": "d"}  # as files written before settings were fingerprinted
    write_sidecar(path, data)
    resumed = AnalysisStore(path, Fingerprint("m", "d", {"metric": "top5"}), ["a.weight"])
    assert resumed.sensitivities == {"a.weight": {0.5: 0.25}}
    with pytest.raises(AnalysisFileError, match="another model"):
        data["fingerprint"] = {"model": "other", "data": "d"}
        write_sidecar(path, data)
        AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight"])


def test_a_variant_is_found_under_a_key_written_with_other_formatting() -> None:
    half, quarter = VariantRecord(loss=0.5, mode="mask"), VariantRecord(loss=0.25, mode="mask")
    record = ParamRecord(module="a", variants={"0.50": half, "0.25": quarter})  # "0.50": as another tool wrote it
    assert record.variant(0.5) is half and record.variant(0.50000000000000001) is half
    assert record.variant(0.25) is quarter and record.variant(0.75) is None
    assert ParamRecord(module="a").variant(0.5) is None
    sidecar = schema.Sidecar(params={"a.weight": record})
    assert sidecar.variant("a.weight", 0.5) is half and sidecar.variant("b.weight", 0.5) is None
    assert list(sidecar.variants()) == [("a.weight", 0.5, half), ("a.weight", 0.25, quarter)]


def test_a_store_records_the_tool_the_config_and_when_it_saved(tmp_path: Path) -> None:
    from analysis import __version__

    path = tmp_path / "s.pkl"
    store = AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight"], config={"api": "test"})
    store.set_cost(CostRecord(convention="MACs", mode="macs", macs=100, params=10))  # a typed record as it is
    store.record_variant(["a.weight"], 0.5, VariantRecord(loss=0.25, metrics={"top1": 0.75}, mode="mask"))
    store.mark_early_stop("a.weight", 0.5, "c")
    store.clear_early_stop("a.weight")
    store.save()
    written = json.loads(sidecar_path(path).read_text())
    assert written["tool"] == {"name": "prune-sensitivity", "version": __version__}
    assert written["config"] == {"api": "test"} and written["cost"]["macs"] == 100
    assert "early_stop" not in written["params"]["a.weight"] and store.early_stops() == {}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", written["saved_at"])
    # resuming without a config keeps the stored one
    assert (
        AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight"]).sidecar.config
        == store.sidecar.config
    )


def test_overwrite_starts_afresh_and_a_resume_says_what_it_cannot_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = saved_store(tmp_path / "s.pkl")
    fresh = AnalysisStore(path, Fingerprint("other", "d", {"metric": "top1"}), ["a.weight"], overwrite=True)
    assert fresh.sensitivities == {} and fresh.sidecar.param("a.weight") is None  # nothing kept, nothing refused

    sidecar_path(path).unlink()
    save_sensitivities(path, {name: {0.5: 0.1} for name in ["a.weight", *[f"gone{i}.weight" for i in range(6)]]})
    with caplog.at_level(logging.WARNING, logger="analysis"):
        AnalysisStore(path, Fingerprint("m", "d", {"metric": "top1"}), ["a.weight"])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{path} has no sidecar (s.pkl.json), so it cannot be checked against this model and data; resuming anyway.",
        f"{path} holds 6 parameter(s) this model does not have; they are kept and not evaluated: gone0.weight, "
        "gone1.weight, gone2.weight, gone3.weight, gone4.weight, ...",
    ]


def test_the_store_takes_costs_and_configs_as_records_or_mappings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.pkl"
    store = AnalysisStore(
        path, Fingerprint("m", "d", {}), ["a.weight"], config=schema.ConfigRecord.from_json({"api": "x"})
    )
    store.set_cost({"convention": "MACs", "mode": "macs", "macs": 100, "params": 10})
    assert isinstance(store.sidecar.cost, CostRecord) and store.sidecar.cost.macs == 100
    store.save()
    reopened = AnalysisStore(path, Fingerprint("m", "d", {}), ["a.weight"], config=schema.ConfigRecord())
    assert reopened.sidecar.config is not None and reopened.sidecar.config.to_json() == {"api": "x"}  # empty: kept

    save_sensitivities(path, {name: {0.5: 0.1} for name in ["a.weight", *[f"gone{i}.weight" for i in range(5)]]})
    with caplog.at_level(logging.WARNING, logger="analysis"):
        AnalysisStore(path, Fingerprint("m", "d", {}), ["a.weight"])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{path} holds 5 parameter(s) this model does not have; they are kept and not evaluated: gone0.weight, "
        "gone1.weight, gone2.weight, gone3.weight, gone4.weight"
    ]

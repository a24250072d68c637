"""Label-free sensitivity: ``metric: agreement`` and ``metric: kl`` against the dense model's own predictions, with
and without labels (``Global.labels: none``), on both engines, with adaptive precision, shards and resume."""

from __future__ import annotations

import csv
import html
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from analysis.config import GlobalConfig, SensitivityConfig
from analysis.engine.fidelity import DenseRecorder, Scores
from analysis.engine.loss import check_baseline, relative_loss
from analysis.engine.settings import AnalysisData, EngineSettings
from analysis.errors import UserError
from analysis.inputs.calibration import CalibrationSource, read_calibration_samples
from analysis.inputs.data import UNLABELLED, EvalLoader, build_eval_loader, read_sample_list
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.io.tables import export_csv
from analysis.structure.criteria import l1_norm, select_channels
from analysis.structure.physical import pruned_copy
from analysis.workflow.analyse import run_analysis

import tiny_models
from helpers import CliResult, assert_user_error, randomize, tiny_global, write_config

Cli = Callable[..., CliResult]
RATIOS = (0.25, 0.5)
PARAMS = ("0.weight", "3.weight")  # the two convs of tiny_models.tiny_cnn
IMAGES = 24
MODEL_SEED = 1  # random weights whose predictions differ between images, so pruning flips some of them


def write_colour_images(root: Path, labelled: bool = True) -> Path:
    """``IMAGES`` noisy PNGs of random colours (random noise alone gives every image the same prediction), listed in
    ``root/val_list.txt`` with labels 0..9 or as paths alone."""
    rng = np.random.default_rng(0)
    lines = []
    for index in range(IMAGES):
        colour = rng.integers(0, 256, 3)
        pixels = np.clip(colour + rng.normal(0, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
        relative = f"val/img_{index:02d}.png"
        (root / "val").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / relative)
        lines.append(f"{relative} {index % 10}" if labelled else relative)
    (root / "val_list.txt").write_text("\n".join(lines) + "\n")
    return root


def dense_model() -> torch.nn.Module:
    """The analysed network: tiny_cnn with seeded random weights and BatchNorm statistics (the same on every call)."""
    torch.manual_seed(MODEL_SEED)
    return randomize(tiny_models.tiny_cnn(), seed=MODEL_SEED)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """The analysed network's state_dict, loaded by the CLI through Global.model_dir/params_filename."""
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save(dense_model().state_dict(), folder / "weights.pt")
    return folder


def config(tmp_path: Path, data: Path, weights: Path, name: str = "a", labels: str = "none", **section: Any) -> Path:
    """A config analysing the tiny network at ``RATIOS`` on ``data`` into ``tmp_path/<name>/s.pkl``."""
    block = tiny_global(data, model_dir=str(weights), params_filename="weights.pt", labels=labels)
    analysis = {"analysis_file": str(tmp_path / name / "s.pkl"), "pruned_ratios": list(RATIOS), **section}
    return write_config(tmp_path / f"{name}.yaml", {"Global": block, "SensitivityAnalysis": analysis})


def analyse(cli: Cli, path: Path) -> dict[str, Any]:
    """Run the CLI on ``path`` (must succeed); return the analysis file's sidecar, the pickle's losses in ``losses``."""
    result = cli("--config_path", path, "--quiet", "--no_report")
    assert result.code == 0, result.err
    analysis_file = path.parent / path.stem / "s.pkl"
    return load_sidecar(analysis_file) | {"losses": load_sensitivities(analysis_file)}


def evaluation_images(data: Path, val_list: str = "val_list.txt") -> torch.Tensor:
    """The preprocessed evaluation images, as the CLI sees them, in list order (or those of another list file)."""
    block = GlobalConfig(data_dir=str(data), val_list=val_list, batch_size=8, img_size=16, resize_size=16,
                         num_workers=0, labels="none")  # fmt: skip
    return torch.cat([images for images, _ in build_eval_loader(block, torch.device("cpu"))])


# The BatchNorm layers whose statistics removing a param's channels changes in tiny_cnn: the one after the conv that
# loses input channels (removing conv 3's channels changes no BatchNorm: only the classifier follows).
REESTIMATED = {"0.weight": ["4"], "3.weight": []}


def by_hand(data: Path, calibration: torch.Tensor | None = None) -> dict[tuple[str, float], dict[str, float]]:
    """Agreement, KL (float64) and top1 of every variant, from physically pruned copies: what the numbers mean.

    With ``calibration`` (one batch of preprocessed images), each copy's :data:`REESTIMATED` layers first get the
    mean and unbiased variance of their inputs on those images (adaptive BatchNorm); the dense model keeps its own."""
    model, images = dense_model(), evaluation_images(data)
    labels = torch.arange(IMAGES) % 10
    with torch.inference_mode():
        dense = model(images).double()
    p_dense = dense.softmax(dim=1)
    expected = {}
    for name in PARAMS:
        conv = model.get_submodule(conv_name(name))
        for ratio in RATIOS:
            smaller = pruned_copy(model, conv_name(name), select_channels(l1_norm(conv.weight), ratio), images[:4])
            if calibration is not None:
                for layer in (smaller.get_submodule(bn) for bn in REESTIMATED[name]):
                    layer.reset_running_stats()
                    layer.momentum = None  # a cumulative average: over the one batch, its statistics exactly
                    layer.train()
                with torch.no_grad():
                    smaller(calibration)
                smaller.eval()
            with torch.inference_mode():
                pruned = smaller(images).double()
            kl = (p_dense * (p_dense.log() - pruned.log_softmax(dim=1))).sum(dim=1).mean()
            expected[name, ratio] = {
                "agreement": float((pruned.argmax(dim=1) == dense.argmax(dim=1)).double().mean()),
                "kl": float(kl),
                "top1": float((pruned.argmax(dim=1) == labels).double().mean()),
            }
    return expected


def conv_name(param: str) -> str:
    """The module of a conv weight: ``3.weight`` -> ``3``."""
    return param.removesuffix(".weight")


def variants(sidecar: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
    """``(param, ratio) -> variant record`` of a sidecar."""
    return {
        (name, float(ratio)): record
        for name, info in sidecar["params"].items()
        for ratio, record in info.get("variants", {}).items()
    }


# ---- semantics ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("labelled", [False, True], ids=["no-labels", "labels"])
@pytest.mark.parametrize("metric", ["agreement", "kl"])
def test_recorded_values_equal_a_hand_computation(
    cli: Cli, tmp_path: Path, weights: Path, metric: str, labelled: bool
) -> None:
    data = write_colour_images(tmp_path / "data", labelled=labelled)
    sidecar = analyse(cli, config(tmp_path, data, weights, labels="required" if labelled else "none", metric=metric))
    expected = by_hand(data)
    labelled_keys = {"top1", "top5", "ce"}
    baseline = sidecar["baseline"]
    assert baseline["agreement"] == 1.0 and baseline["images"] == IMAGES
    assert ("kl" in baseline) == (metric == "kl") and baseline.get("kl", 0.0) == 0.0
    assert (labelled_keys <= set(baseline)) == labelled and (labelled_keys & set(baseline) == set()) != labelled
    recorded = variants(sidecar)
    assert set(recorded) == set(expected)
    for key, record in recorded.items():
        hand = expected[key]
        assert record["agreement"] == pytest.approx(hand["agreement"], abs=1e-12)
        if metric == "kl":
            assert record["kl"] == pytest.approx(hand["kl"], abs=1e-6)
        else:
            assert "kl" not in record  # agreement keeps only the dense argmax
        if labelled:
            assert record["top1"] == pytest.approx(hand["top1"], abs=1e-12)
        else:
            assert not labelled_keys & set(record)
        loss = 1.0 - hand["agreement"] if metric == "agreement" else hand["kl"]
        assert record["loss"] == pytest.approx(loss, abs=1e-6)
        assert sidecar["losses"][key[0]][key[1]] == record["loss"]
    assert min(expected[key]["agreement"] for key in expected) < 0.75  # pruning flips predictions: not a tautology
    assert min(expected[key]["kl"] for key in expected) > 1e-4
    rows = list(csv.DictReader(export_csv(tmp_path / "a" / "s.pkl", style="long").open()))
    assert {row["sparsity"] for row in rows} == {"0.0", *(str(r) for r in RATIOS)}  # the baseline row, each ratio
    for row in rows:  # the label-free metric is a column of the long CSV: percent agreement, or KL in nats
        key = (row["parameter"], float(row["sparsity"]))
        value = 1.0 if metric == "agreement" else 0.0
        if key[1]:
            value = recorded[key][metric]
        assert float(row[metric]) == pytest.approx(100.0 * value if metric == "agreement" else value, abs=1e-9)
        assert (row["top1"] != "") == labelled


def test_losses_follow_the_loss_conventions_in_both_modes() -> None:
    # agreement: the dense model agrees with itself (baseline 1), so relative and absolute losses are 1 - agreement
    assert relative_loss(1.0, 0.75, "agreement", "relative") == 0.25
    assert relative_loss(1.0, 0.75, "agreement", "absolute") == 0.25
    # kl: lower is better and the baseline is 0; both modes record the divergence itself, never a division by 0
    check_baseline(0.0, "kl", "relative")
    assert relative_loss(0.0, 0.3, "kl", "relative") == 0.3
    assert relative_loss(0.0, 0.3, "kl", "absolute") == 0.3
    with pytest.raises(UserError, match="baseline top1 is 0"):
        check_baseline(0.0, "top1", "relative")


def test_kl_is_the_same_in_relative_and_absolute_mode(cli: Cli, tmp_path: Path, weights: Path) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    relative = analyse(cli, config(tmp_path, data, weights, "relative", metric="kl"))
    absolute = analyse(cli, config(tmp_path, data, weights, "absolute", metric="kl", metric_mode="absolute"))
    assert relative["losses"] == absolute["losses"]
    assert all(record["loss"] == record["kl"] > 0 for record in variants(relative).values())


# ---- engines and passes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["agreement", "kl"])
def test_fast_engine_equals_reference_engine(cli: Cli, tmp_path: Path, weights: Path, metric: str) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    runs = {
        engine: analyse(cli, config(tmp_path, data, weights, engine, metric=metric, engine=engine))
        for engine in ("reference", "fast")
    }
    assert (tmp_path / "fast" / "s.pkl").read_bytes() == (tmp_path / "reference" / "s.pkl").read_bytes()
    fast, reference = (
        {key: {k: v for k, v in record.items() if k in ("agreement", "kl", "images")} for key, record in
         variants(runs[engine]).items()}
        for engine in ("fast", "reference")
    )  # fmt: skip
    assert fast == reference and len(fast) == len(PARAMS) * len(RATIOS)


@pytest.mark.parametrize("metric", ["agreement", "kl"])
def test_adaptive_precision_compares_each_image_with_its_own_reference(
    cli: Cli, tmp_path: Path, weights: Path, metric: str
) -> None:
    # Fewer images than adaptive precision's minimum: every variant sees them all, in a seeded random order, so its
    # paired estimate must equal the exact loss only if each image meets the dense output of the same image.
    data = write_colour_images(tmp_path / "data", labelled=False)
    exact = analyse(cli, config(tmp_path, data, weights, "exact", metric=metric))
    adaptive = analyse(cli, config(tmp_path, data, weights, "adaptive", metric=metric, precision=0.001))
    assert set(variants(adaptive)) == {(name, ratio) for name in PARAMS for ratio in RATIOS}
    for key, record in variants(adaptive).items():
        assert record["samples"] == IMAGES
        assert record["loss"] == pytest.approx(exact["losses"][key[0]][key[1]], rel=1e-5, abs=1e-9)
        assert record[metric] == pytest.approx(variants(exact)[key][metric], rel=1e-5, abs=1e-9)


def test_shards_of_a_label_free_run_merge_into_the_whole_run(cli: Cli, tmp_path: Path, weights: Path) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    path = config(tmp_path, data, weights, metric="kl")
    whole = tmp_path / "whole.pkl"
    assert cli("--config_path", path, "--analysis_file", whole, "--quiet", "--no_report").code == 0
    shards = []
    for index in (1, 2):
        assert cli("--config_path", path, "--shard", f"{index}/2", "--quiet", "--no_report").code == 0
        shards.append(tmp_path / "a" / f"s.shard{index}of2.pkl")
    merged = tmp_path / "merged.pkl"
    result = cli("merge", merged, *shards)
    assert result.code == 0, result.err
    assert merged.read_bytes() == whole.read_bytes()


# ---- configuration and data --------------------------------------------------------------------------------------


BAD = {
    "labels none, metric top1": ("none", {}, r"Global\.labels is none, so SensitivityAnalysis\.metric must be "
                                 r"agreement or kl \(top1, top5 and ce need labels\), got 'top1'"),
    "unknown labels mode": ("maybe", {"metric": "kl"}, r"Global\.labels must be one of required, none, got 'maybe'"),
    "labels none, measured plan": ("none", {"metric": "kl", "target_macs_reduction": 0.3, "plan_method": "measured"},
                                   r"SensitivityAnalysis\.plan_method: measured scores plans .*Global\.labels: none"),
    "unknown metric": ("none", {"metric": "kld"}, r"SensitivityAnalysis\.metric must be one of top1, top5, ce, "
                       r"agreement, kl, got 'kld'"),
}  # fmt: skip


@pytest.mark.parametrize(("labels", "section", "message"), BAD.values(), ids=BAD.keys())
def test_bad_combinations_are_one_sentence_errors(
    cli: Cli, tmp_path: Path, weights: Path, labels: str, section: dict, message: str
) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    assert_user_error(cli("--config_path", config(tmp_path, data, weights, labels=labels, **section)), message)


def test_labels_stay_required_by_default(cli: Cli, tmp_path: Path, weights: Path) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    block = tiny_global(data, model_dir=str(weights), params_filename="weights.pt")
    path = write_config(tmp_path / "a.yaml", {"Global": block, "SensitivityAnalysis": {"metric": "agreement"}})
    assert_user_error(cli("--config_path", path), r"val_list\.txt line 1: 'val/img_00\.png' has no label")


def test_a_different_metric_does_not_resume_the_file(cli: Cli, tmp_path: Path, weights: Path) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    analyse(cli, config(tmp_path, data, weights, metric="kl"))
    before = (tmp_path / "a" / "s.pkl").read_bytes()
    other = config(tmp_path, data, weights, metric="agreement")  # same analysis file
    result = cli("--config_path", other, "--quiet", "--no_report")
    assert_user_error(result, r"was computed with metric 'kl' \(this run uses 'agreement'\)")
    assert (tmp_path / "a" / "s.pkl").read_bytes() == before
    settings = EngineSettings.from_section(SensitivityConfig(metric="kl"))
    assert settings.fingerprint()["metric"] == "kl"


def test_image_folder_labels_are_ignored(cli: Cli, tmp_path: Path, weights: Path) -> None:
    # 12 class folders and a 10-class model: with labels the last classes are an error, without them nothing reads them
    data = tmp_path / "data"
    rng = np.random.default_rng(3)
    for index in range(12):
        folder = data / "val" / f"class_{index:02d}"
        folder.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / "img.png")
    labelled = config(tmp_path, data, weights, "labelled", labels="required", metric="agreement")
    assert_user_error(cli("--config_path", labelled), r"label 10 is outside the model's 10 classes")
    sidecar = analyse(cli, config(tmp_path, data, weights, metric="agreement"))
    assert sidecar["baseline"]["images"] == 12 and "top1" not in sidecar["baseline"]


def test_unlabelled_calibration_list_is_read_and_used(cli: Cli, tmp_path: Path, weights: Path) -> None:
    data = write_colour_images(tmp_path / "data", labelled=False)
    rng = np.random.default_rng(7)
    names = [f"train/t_{index}.png" for index in range(8)]
    (data / "train").mkdir()
    for name in names:
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(data / name)
    (data / "train_list.txt").write_text("\n".join(names) + "\n")
    samples = read_calibration_samples(CalibrationSource(data / "train_list.txt", "list", explicit=False), data)
    assert [s.label for s in samples] == [UNLABELLED] * 8
    plain = analyse(cli, config(tmp_path, data, weights, "plain", metric="kl"))
    adaptive = analyse(cli, config(tmp_path, data, weights, "adaptive", metric="kl", adaptive_bn=True))
    assert adaptive["losses"] != plain["losses"]  # the statistics were re-estimated on the calibration images
    expected = by_hand(data, calibration=evaluation_images(data, "train_list.txt"))
    assert {key: record["kl"] for key, record in variants(adaptive).items()} == pytest.approx(
        {key: values["kl"] for key, values in expected.items()}, abs=1e-6
    )
    assert all(adaptive["losses"][name][ratio] == variants(adaptive)[name, ratio]["loss"] for name, ratio in expected)
    assert plain["losses"]["3.weight"] == adaptive["losses"]["3.weight"]  # no BatchNorm follows conv 3


@pytest.mark.parametrize("known", [True, False], ids=["count-known", "count-unknown"])
def test_dense_outputs_are_kept_by_sample_index(known: bool) -> None:
    logits = torch.randn(10, 5, generator=torch.Generator().manual_seed(0))
    order = torch.tensor([7, 2, 9, 0, 4, 1, 8, 3, 6, 5])
    recorder = DenseRecorder(10 if known else None, log_probs=True)
    for start in range(0, 10, 4):  # batches in a shuffled order, as adaptive precision passes them
        index = order[start : start + 4]
        recorder.add(logits[index], index)
    dense = recorder.result()
    assert torch.equal(dense.argmax, logits.argmax(dim=1))
    assert dense.log_probs is not None and torch.equal(dense.log_probs, torch.log_softmax(logits, dim=1))
    scores = Scores(None, dense)
    scores.add(logits[:6], torch.zeros(6, dtype=torch.long), torch.arange(6))  # the dense model against itself
    assert scores.metrics() == {"agreement": 1.0, "kl": 0.0, "images": 6}


def test_list_lines_without_labels(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nwith space.png\nb.png 3\n# comment\n")
    samples = read_sample_list(tmp_path, listing, require_labels=False)
    assert [(Path(s.path).name, s.label) for s in samples] == [("a.png", -1), ("with space.png", -1), ("b.png", 3)]


def test_label_free_metric_needs_batches(tmp_path: Path) -> None:
    model = dense_model()
    data = AnalysisData(evaluate=lambda m: {"top1": 1.0}, example_input=torch.randn(4, 3, 16, 16))
    settings = EngineSettings.from_section(SensitivityConfig(metric="kl", pruned_ratios=[0.5]), progress=False)
    with pytest.raises(UserError, match=r"metric kl compares each image .* needs the evaluation data as batches"):
        run_analysis(model, data, tmp_path / "s.pkl", settings)


def test_top1_evaluation_of_unlabelled_data_is_refused(tmp_path: Path) -> None:
    from analysis.engine.evaluate import evaluate
    from analysis.inputs.data import Preprocess, Sample

    loader = EvalLoader([Sample("x.png", UNLABELLED, "x")], "x", Preprocess(), 1, 0, torch.device("cpu"), False)
    with pytest.raises(UserError, match=r"top1, top5 and ce need labels .*Global\.labels: none"):
        evaluate(dense_model(), loader)


DEFINED = {"kl": "kl loss = mean KL(p_unpruned || p_pruned) in nats", "agreement": "agreement loss = 1 - agreement"}


@pytest.mark.parametrize(("metric", "defined"), list(DEFINED.items()))
def test_the_report_says_what_a_label_free_loss_is(
    cli: Cli, tmp_path: Path, weights: Path, metric: str, defined: str
) -> None:
    from analysis.reporting.report import load_analysis, loss_label, render_html

    data = write_colour_images(tmp_path / "data", labelled=False)
    analyse(cli, config(tmp_path, data, weights, "r", metric=metric))
    analysis = load_analysis(tmp_path / "r" / "s.pkl")
    assert loss_label(analysis.sidecar) == f"{metric} loss"  # not "relative kl loss": both modes give one number
    png = io.BytesIO()
    Image.new("RGB", (1, 1)).save(png, format="PNG")
    assert html.escape(defined) in render_html(analysis, png.getvalue(), png.getvalue(), png.getvalue())


@pytest.mark.parametrize("metric", ["agreement", "kl"])
def test_a_plan_from_a_label_free_analysis_is_verified_on_that_metric(
    cli: Cli, tmp_path: Path, weights: Path, metric: str
) -> None:
    """Without labels the verification compares the pruned model with the dense one, as the analysis did."""
    data = write_colour_images(tmp_path / "data", labelled=False)
    path = config(tmp_path, data, weights, metric=metric, target_macs_reduction=0.2, verify=True,
                  export_dir=str(tmp_path / "export"))  # fmt: skip
    result = cli("--config_path", path, "--no_report")
    assert result.code == 0, result.err
    verification = load_sidecar(tmp_path / "a" / "s.pkl")["plan"]["verification"]
    images = evaluation_images(data)
    exported = torch.load(tmp_path / "export" / "pruned_model.pt", weights_only=False)  # holds what was measured
    with torch.inference_mode():
        dense, pruned = dense_model()(images).double(), exported(images).double()
    agreement = float((pruned.argmax(dim=1) == dense.argmax(dim=1)).double().mean())
    p_dense = dense.softmax(dim=1)
    kl = float((p_dense * (p_dense.log() - pruned.log_softmax(dim=1))).sum(dim=1).mean())
    expected = 1.0 - agreement if metric == "agreement" else kl
    assert verification["measured_loss"][metric] == pytest.approx(expected, abs=1e-6)
    assert "top1" not in verification["baseline"]  # no labels, no accuracy
    assert f"{metric} " in result.out and "measured loss" in result.out

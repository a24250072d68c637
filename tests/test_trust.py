"""Numbers the tool must not print without saying they are unreliable (issue 27, part 2): BatchNorm statistics
re-estimated on calibration images that change the dense model itself, and a summed predicted loss outside the range
where such a sum means anything."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from analysis.io.results import load_sidecar, save_sensitivities, save_sidecar
from analysis.planning import verify
from analysis.planning.plan import prediction_notice
from analysis.reporting.report import load_analysis, render_html

from helpers import REPO, CliResult, tiny_global, write_config

DEMO = REPO / "configs" / "demo" / "digits_resnet.yaml"
PARAM = "layer1.0.conv1.weight"  # its removal changes 13 BatchNorm layers downstream: the check re-estimates them


@pytest.fixture
def demo(cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., CliResult]:
    """Run a command on the demo ResNet (one param analysed at 0.5 on 50 images; no latency timing, which these
    tests do not check and which dominates their time)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(verify, "eager_latency", lambda *args: {"dense": 1.0, "pruned": 1.0})
    analysis = [f"SensitivityAnalysis.analysis_file={tmp_path / 's.pkl'}", "Global.max_samples=50",
                f"SensitivityAnalysis.prune_params_name=[{PARAM}]", "SensitivityAnalysis.pruned_ratios=[0.5]",
                "SensitivityAnalysis.report=false"]  # fmt: skip
    (tmp_path / "r.yaml").write_text(f"ChannelPrune:\n  prune_params_name: [{PARAM}]\n  pruned_ratio: [0.5]\n")

    def run(command: str, *overrides: str) -> CliResult:
        if command == "analyse":
            result = cli("--config_path", DEMO, *analysis, *overrides)
        else:  # verify the one-param plan, with the config stored in the sidecar
            result = cli("verify", tmp_path / "s.pkl", "--ratios", tmp_path / "r.yaml", "--no_report", *overrides)
        assert result.code == 0, result.err
        return result

    return run


def one_image_repeated(tmp_path: Path, copies: int = 16) -> Path:
    """A calibration list of ``copies`` copies of one training image: nothing like the evaluation data."""
    folder = tmp_path / "calib"
    folder.mkdir()
    for index in range(copies):
        shutil.copyfile(REPO / "datasets" / "digits" / "train" / "00000.png", folder / f"copy_{index}.png")
    (folder / "list.txt").write_text("".join(f"{folder / f'copy_{index}.png'}\n" for index in range(copies)))
    return folder / "list.txt"


def report_html(analysis_file: Path) -> str:
    """The HTML report of ``analysis_file`` (blank plots: only the text is checked)."""
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2)).save(buffer, format="PNG")
    png = buffer.getvalue()
    return render_html(load_analysis(analysis_file), png, png, png)


def test_unrepresentative_calibration_images_make_reestimated_figures_unreliable(
    demo: Callable[..., CliResult], tmp_path: Path
) -> None:
    bad = f"Global.calib_list={one_image_repeated(tmp_path)}"
    # the main run exports the target_loss ratios without verifying them: the exported statistics are checked too
    exported = demo("analyse", bad, f"SensitivityAnalysis.export_dir={tmp_path / 'export'}")
    assert "calibration check of the exported statistics: re-estimating the same 13 BatchNorm layers" in exported.out
    assert "re-estimated on calibration images that failed the calibration check: unreliable)" in exported.out
    note = json.loads((tmp_path / "export" / "pruned_channels.json").read_text())["batchnorm"]
    assert note["reestimated"] is True and note["reliable"] is False
    assert note["calibration_check"]["reliable"] is False and "Calibration check failed" in note["warning"]

    result = demo("verify", bad)
    record = load_sidecar(tmp_path / "s.pkl")["plan"]["verification"]
    check, baseline = record["calibration_check"], record["baseline"]["top1"]
    dense_reestimated = check["dense_reestimated"]["top1"]
    assert check["metric"] == "top1" and check["tolerance"] == 0.02 and check["reliable"] is False
    assert check["loss"] == pytest.approx((baseline - dense_reestimated) / baseline)
    assert check["loss"] > 0.05  # measured +0.10: the dense model itself loses a tenth of its top1
    assert record["reestimated"]["reliable"] is False
    shown = (f"changes its top1 from {baseline:.4f} to {dense_reestimated:.4f} (relative loss {check['loss']:+.4f}, "
             "more than the tolerance 0.02)")  # fmt: skip
    warned = "WARNING: Calibration check failed: re-estimating the same 13 BatchNorm layers of the dense model on the "
    assert f"{warned}16 calibration images {shown}" in result.out
    assert "warning: Calibration check failed: re-estimating" in result.err  # the log says it as it happens
    reestimated_line = next(line for line in result.out.splitlines() if line.startswith("  BatchNorm re-estimated ("))
    assert reestimated_line.endswith("[UNRELIABLE: calibration check failed]")
    assert "  calibration check FAILED: see the warning above" in result.out

    html = report_html(tmp_path / "s.pkl")
    assert '<p class="warning">Calibration check failed: re-estimating the same 13 BatchNorm layers' in html
    assert "UNRELIABLE: the calibration check failed (see above)." in html
    assert "<th>calibration check</th><td>FAILED: re-estimating" in html


def test_representative_calibration_images_pass_the_check(demo: Callable[..., CliResult], tmp_path: Path) -> None:
    demo("analyse")
    result = demo("verify", "Global.calib_samples=128")  # the demo's own training images (train_list.txt)
    record = load_sidecar(tmp_path / "s.pkl")["plan"]["verification"]
    check = record["calibration_check"]
    assert check["reliable"] is True and record["reestimated"]["reliable"] is True
    assert abs(check["loss"]) <= 0.02
    assert "  calibration check passed: re-estimating the same 13 BatchNorm layers" in result.out
    assert "WARNING" not in result.out and "UNRELIABLE" not in result.out and "Calibration check" not in result.err
    html = report_html(tmp_path / "s.pkl")
    assert "<th>calibration check</th><td>passed: re-estimating" in html and "UNRELIABLE" not in html


def tiny_analysis(tmp_path: Path, cli: Callable[..., CliResult], target: float) -> CliResult:
    """Plan the tiny CNN for ``target`` fewer MACs from written single-layer losses: 60% fewer MACs needs both convs
    pruned so far that every such plan sums to more than 1; 10% needs one conv a little."""
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(tmp_path / "data"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "report": False},
    })  # fmt: skip
    (tmp_path / "data").mkdir(exist_ok=True)
    Image.new("RGB", (16, 16)).save(tmp_path / "data" / "a.png")
    (tmp_path / "data" / "val_list.txt").write_text("a.png 0\n")
    save_sensitivities(tmp_path / "s.pkl", {"0.weight": {0.25: 0.4, 0.5: 0.8},
                                            "3.weight": {0.25: 0.3, 0.5: 0.7, 0.75: 0.9}})  # fmt: skip
    save_sidecar(tmp_path / "s.pkl", {"fingerprint": {"settings": {"metric": "top1"}}, "baseline": {"top1": 1.0}})
    result = cli("plan", "--config_path", config, "--target_macs_reduction", str(target))
    assert result.code == 0, result.err
    return result


def test_summed_prediction_above_one_says_it_predicts_nothing(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    result = tiny_analysis(tmp_path, cli, 0.6)
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    assert plan["predicted_loss"] > 1
    notice = plan["prediction_notice"]
    assert f"the predicted loss {plan['predicted_loss']:+.4f} (a sum of single-layer losses) lies outside" in notice
    assert "a relative top1 loss cannot exceed 1 (top1 0)" in notice and "--verify" in notice
    assert "--method measured" in notice
    assert f"note: {notice}." in result.out
    assert "of the smallest summed predicted loss any plan meeting the budget can have)" in result.out
    assert "above the optimum" not in result.out
    html = report_html(tmp_path / "s.pkl")
    assert '<p class="warning">Predicted loss: The predicted loss' in html and "OUTSIDE ITS MEANINGFUL RANGE" in html


def test_summed_prediction_in_range_has_no_notice(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    result = tiny_analysis(tmp_path, cli, 0.1)
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    assert 0 < plan["predicted_loss"] < 1 and "prediction_notice" not in plan
    assert "of the smallest summed predicted loss any plan meeting the budget can have)" in result.out
    assert "outside the range" not in result.out and "OUTSIDE" not in report_html(tmp_path / "s.pkl")


@pytest.mark.parametrize(
    ("predicted", "metric", "mode", "baseline", "largest", "why"),
    [
        (1.2, "top5", "relative", 0.9, 0.5, "a relative top5 loss cannot exceed 1 (top5 0)"),
        (1.0, "top1", "relative", 0.9, 0.5, None),  # 1 is possible: top1 0
        (0.85, "top1", "absolute", 0.8, 0.9, "an absolute top1 loss cannot exceed the baseline 0.8000 (top1 0)"),
        (0.75, "top1", "absolute", 0.8, 0.9, None),
        (1.01, "agreement", "relative", 1.0, 0.5, "a relative agreement loss cannot exceed 1"),
        (2.5, "ce", "relative", 0.2, 1.7, "ce has no upper bound, but no single layer pruned alone measured"),
        (1.5, "ce", "relative", 0.2, 1.7, None),  # unbounded: beyond 1 is possible, and measured for one layer
        (0.4, "kl", "relative", 0.0, 0.3, "kl has no upper bound"),
        (float("nan"), "top1", "relative", 1.0, 0.5, None),  # unknown: said by the note on unanalysed ratios
    ],
)
def test_the_range_of_a_summed_prediction_follows_its_metric(
    predicted: float, metric: str, mode: str, baseline: float, largest: float, why: str | None
) -> None:
    notice = prediction_notice(predicted, metric, mode, baseline, largest)
    if why is None:
        assert notice is None
    else:
        assert notice is not None and why in notice and f"{predicted:+.4f}" in notice

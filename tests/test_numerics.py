"""The numerics policy (``Global.numerics``): flags set for a job and restored, autocast, the masked-versus-physical
tolerance of a speed mode, what the files record, and no resume across modes."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis.compat.paddleslim import analysis_prune
from analysis.engine import approximation
from analysis.errors import AnalysisFileError, ConfigError
from analysis.inputs.numerics import EXACT_FLAGS, FAST_FLAGS, BackendFlags, machine_record, numerics
from analysis.io.results import load_sidecar
from analysis.io.sidecar import NumericsRecord
from analysis.io.tables import export_csv

from helpers import batches, pseudo_labelled, randomize, run_cli, tiny_global, write_config, write_images
from tiny_models import tiny_layernorm, tiny_resnet

# Flags unlike both the exact ones and PyTorch's defaults, so that a restore to either would show.
CALLER_FLAGS = BackendFlags(
    cudnn_tf32=True, matmul_tf32=True, matmul_precision="medium", deterministic=False, benchmark=True
)


@pytest.fixture
def caller_flags() -> Iterator[BackendFlags]:
    """The process runs with :data:`CALLER_FLAGS` during the test, and with its own flags again after it."""
    saved = BackendFlags.current()
    CALLER_FLAGS.apply()
    try:
        yield CALLER_FLAGS
    finally:
        saved.apply()


class FlagProbe(nn.Module):
    """Wraps a model and records, at every forward pass, the backend flags and whether CPU autocast is on."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[tuple[BackendFlags, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((BackendFlags.current(), torch.is_autocast_enabled("cpu")))
        return self.model(x)


def test_exact_sets_the_flags_and_restores_the_callers(caller_flags: BackendFlags) -> None:
    with numerics("exact", "cpu"):
        assert BackendFlags.current() == EXACT_FLAGS
        assert not torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.deterministic
    assert BackendFlags.current() == caller_flags


def test_flags_are_restored_when_the_block_raises(caller_flags: BackendFlags) -> None:
    with pytest.raises(RuntimeError, match="boom"), numerics("bf16", "cpu"):
        raise RuntimeError("boom")
    assert BackendFlags.current() == caller_flags
    assert not torch.is_autocast_enabled("cpu")


def test_bf16_autocasts_and_exact_turns_a_callers_autocast_off() -> None:
    conv, image = nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8)
    with numerics("bf16", "cpu"):
        assert conv(image).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), numerics("exact", "cpu"):
        assert conv(image).dtype == torch.float32  # exact means float32 even inside the caller's autocast
    with numerics("tf32", "cpu"):
        assert conv(image).dtype == torch.float32


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8"), numerics("fp8", "cpu"):
        pass


@pytest.mark.parametrize("mode", ["exact", "bf16"])
def test_the_python_api_runs_in_the_mode_and_leaves_the_callers_flags(
    tmp_path: Path, caller_flags: BackendFlags, mode: str
) -> None:
    probe = FlagProbe(randomize(tiny_resnet()))
    data = pseudo_labelled(probe, batches())
    probe.seen.clear()
    analysis_prune(probe, data, tmp_path / "a.pkl", pruned_ratios=[0.5], progress=False, numerics=mode)
    evaluations = [flags for flags, autocast in probe.seen]
    autocast_seen = [autocast for _, autocast in probe.seen]
    mode_flags = EXACT_FLAGS if mode == "exact" else FAST_FLAGS
    # tracing and the exact reference passes run exact; every other pass runs in the mode, none in the caller's
    assert set(evaluations) == {EXACT_FLAGS, mode_flags}
    assert any(autocast_seen) is (mode == "bf16")
    assert all(autocast for flags, autocast in probe.seen if flags == FAST_FLAGS)
    assert BackendFlags.current() == caller_flags  # nothing leaked into the caller's process
    assert not torch.is_autocast_enabled("cpu")


def test_the_api_refuses_an_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="numerics must be one of exact, tf32, bf16"):
        analysis_prune(randomize(tiny_resnet()), batches(), tmp_path / "a.pkl", numerics="fp16")
    assert not (tmp_path / "a.pkl").exists()


def test_a_file_does_not_resume_across_modes(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches())
    path = tmp_path / "a.pkl"
    analysis_prune(model, data, path, pruned_ratios=[0.5], progress=False)
    before = path.read_bytes()
    with pytest.raises(AnalysisFileError, match="numerics 'exact' \\(this run uses 'bf16'\\)"):
        analysis_prune(model, data, path, pruned_ratios=[0.5], progress=False, numerics="bf16")
    assert path.read_bytes() == before
    bf16 = tmp_path / "b.pkl"
    analysis_prune(model, data, bf16, pruned_ratios=[0.5], progress=False, numerics="bf16")
    with pytest.raises(AnalysisFileError, match="numerics 'bf16' \\(this run uses 'tf32'\\)"):
        analysis_prune(model, data, bf16, pruned_ratios=[0.5], progress=False, numerics="tf32")


def test_an_exact_file_records_its_machine_and_no_noise(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    path = tmp_path / "a.pkl"
    analysis_prune(model, pseudo_labelled(model, batches()), path, pruned_ratios=[0.5], progress=False)
    sidecar = load_sidecar(path)
    assert sidecar["numerics"] == {"mode": "exact", "machines": [machine_record("cpu").to_json()]}
    assert sidecar["numerics"]["machines"][0]["torch"] == torch.__version__
    assert "numerics" not in sidecar["fingerprint"]["settings"]  # exact files keep the fingerprint earlier ones have


def test_bf16_records_how_far_it_moves_the_numbers(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches())
    path = tmp_path / "a.pkl"
    analysis_prune(model, data, path, pruned_ratios=[0.5], progress=False, numerics="bf16")
    record = load_sidecar(path)["numerics"]
    with torch.inference_mode():
        exact = torch.cat([model(images) for images, _ in data])
        with numerics("bf16", "cpu"):
            approximate = torch.cat([model(images) for images, _ in data]).float()
    images = data[0][0][:4]
    with torch.inference_mode():
        expected_noise = float((model(images) - _bf16(model, images)).abs().max()) / max(
            1.0, float(model(images).abs().max())
        )
    assert record["logit_noise"] == pytest.approx(expected_noise)
    assert record["logit_noise"] > 1e-4  # bfloat16 really ran: far above float32 rounding
    exact_top1 = float((exact.argmax(1) == torch.cat([labels for _, labels in data])).float().mean())
    bf16_top1 = float((approximate.argmax(1) == torch.cat([labels for _, labels in data])).float().mean())
    assert record["exact_baseline"]["top1"] == pytest.approx(exact_top1) == 1.0
    assert record["loss_shift"] == pytest.approx((exact_top1 - bf16_top1) / exact_top1)
    assert load_sidecar(path)["fingerprint"]["settings"]["numerics"] == "bf16"


def _bf16(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    with numerics("bf16", "cpu"):
        return model(images).float()


class ChannelMean(nn.Module):
    """conv -> BN -> relu -> minus ``share`` x the mean over channels -> conv -> pool -> fc. The mean counts a zeroed
    channel that removal drops, so masking conv1 differs from removing its channels by an amount set by ``share``."""

    def __init__(self, share: float) -> None:
        super().__init__()
        self.share = share
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = x - self.share * x.mean(dim=1, keepdim=True)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.conv2(x), 1), 1))


@pytest.mark.parametrize("tolerance, expected", [(approximation.EXACT_TOLERANCE, "physical"), (0.05, "mask")])
def test_the_check_uses_its_tolerance(tolerance: float, expected: str) -> None:
    """A difference between the exact tolerance and a speed mode's is removal under exact arithmetic and masking
    under the wider tolerance: the check reads the tolerance it is given."""
    from analysis.engine._modes import MaskCheck
    from analysis.structure.groups import build_dependency_graph, describe_units, execution_order

    model = randomize(ChannelMean(share=1e-2))
    images = batches(count=1)[0][0]
    graph = build_dependency_graph(model, images)
    unit = next(u for u in describe_units(model, graph, execution_order(model, images)) if u.name == "conv1.weight")
    check = MaskCheck(model, graph, images)
    check.tolerance = tolerance
    result = check.choose(unit, [0, 1, 2], None)
    with torch.inference_mode():
        scale = max(1.0, float(model(images[:4]).abs().max()))
    assert approximation.EXACT_TOLERANCE * scale * 3 < float(result.difference) < 0.05 * scale / 3  # between the two
    assert result.mode == expected


def test_a_speed_mode_checks_masking_within_its_measured_noise(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches())
    analysis_prune(model, data, tmp_path / "a.pkl", pruned_ratios=[0.5], progress=False, numerics="bf16")
    record = load_sidecar(tmp_path / "a.pkl")["numerics"]
    assert (
        record["mask_tolerance"] == approximation.mask_tolerance(record["logit_noise"]) > approximation.EXACT_TOLERANCE
    )
    modes = {
        name: param["mode"] for name, param in load_sidecar(tmp_path / "a.pkl")["params"].items() if "mode" in param
    }
    assert modes and set(modes.values()) == {"mask"}  # BatchNorm groups: masking equals removal in bf16 too


def test_a_speed_mode_still_sends_a_channel_normalising_group_to_physical_pruning(tmp_path: Path) -> None:
    model = randomize(tiny_layernorm())
    data = pseudo_labelled(model, batches())
    analysis_prune(model, data, tmp_path / "a.pkl", pruned_ratios=[0.5], progress=False, numerics="bf16")
    params = load_sidecar(tmp_path / "a.pkl")["params"]
    assert params["conv1.weight"]["mode"] == "physical"


def test_mask_tolerance_is_exact_without_noise_and_a_margin_above_it() -> None:
    assert approximation.mask_tolerance(None) == approximation.EXACT_TOLERANCE
    assert approximation.mask_tolerance(0.0) == approximation.EXACT_TOLERANCE
    assert approximation.mask_tolerance(0.01) == pytest.approx(approximation.NOISE_MARGIN * 0.01)


def test_the_notice_says_approximate_only_for_a_speed_mode() -> None:
    assert NumericsRecord(mode="exact").notice() is None
    notice = NumericsRecord(mode="bf16", loss_shift=0.0125, logit_noise=0.004).notice()
    assert notice is not None and "approximate" in notice and "+0.0125" in notice and "0.004" in notice


def test_the_command_line_marks_csv_report_and_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "data"
    write_images(data_dir, "list", [0, 1, 2, 0, 1, 2])
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5], "metric": "ce"}
    config = write_config(tmp_path / "a.yaml", {"Global": tiny_global(data_dir), "SensitivityAnalysis": section})
    assert run_cli(["--config_path", str(config), "Global.numerics=bf16"]) == 0
    out = capsys.readouterr()
    analysis_file = next(tmp_path.glob("**/*.pkl"))
    wide = analysis_file.with_name(f"{analysis_file.stem}.wide.csv")
    assert next(csv.reader(wide.open()))[0] == "layername_approx_bf16"
    long_header = next(csv.reader(export_csv(analysis_file, style="long").open()))
    assert "relative_loss_approx_bf16" in long_header and "top1_approx_bf16" in long_header
    report = next(tmp_path.glob("**/*.report.html")).read_text()
    assert "Losses are approximate (Global.numerics: bf16)" in report
    assert "Losses are approximate" in out.out + out.err
    assert json.loads(Path(f"{analysis_file}.json").read_text())["numerics"]["mode"] == "bf16"


def test_resuming_on_another_machine_is_warned_and_both_are_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = randomize(tiny_resnet())
    data = pseudo_labelled(model, batches())
    path = tmp_path / "a.pkl"
    analysis_prune(model, data, path, pruned_ratios=[0.5], progress=False)
    sidecar_file = Path(f"{path}.json")
    sidecar = json.loads(sidecar_file.read_text())
    other = {"device": "cuda", "name": "Some GPU", "torch": "2.0.0", "cuda": "12.1", "cudnn": "8900"}
    sidecar["numerics"]["machines"] = [other]
    sidecar_file.write_text(json.dumps(sidecar))
    analysis_prune(model, data, path, pruned_ratios=[0.5, 0.7], progress=False)
    assert "holds numbers computed on cuda (Some GPU), torch 2.0.0, CUDA 12.1, cuDNN 8900" in caplog.text
    assert load_sidecar(path)["numerics"]["machines"] == [other, machine_record("cpu").to_json()]
    caplog.clear()
    analysis_prune(model, data, path, pruned_ratios=[0.5, 0.7], progress=False)  # both known now: recorded once
    assert load_sidecar(path)["numerics"]["machines"] == [other, machine_record("cpu").to_json()]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("Global.numerics=fp16", "Global.numerics must be one of exact, tf32, bf16, got 'fp16'"),
        ("Global.device_cache_share=1.5", "Global.device_cache_share must be a share of the free GPU memory"),
    ],
)
def test_bad_numerics_keys_exit_2_naming_the_key(
    override: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    write_images(data_dir, "list", [0, 1])
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl")}
    config = write_config(tmp_path / "a.yaml", {"Global": tiny_global(data_dir), "SensitivityAnalysis": section})
    assert run_cli(["--config_path", str(config), override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_verify_runs_in_the_mode_but_times_latency_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Accuracy is verified in the run's arithmetic; latency is the deployed float32 model's."""
    from analysis.planning import verify

    timed: list[bool] = []
    evaluated: list[bool] = []
    real_latency, real_measure = verify.eager_latency, verify.measure_pruned

    def latency(*args: object, **kwargs: object) -> object:
        timed.append(torch.is_autocast_enabled("cpu"))
        return real_latency(*args, **kwargs)  # type: ignore[arg-type]

    def measure(*args: object, **kwargs: object) -> object:
        evaluated.append(torch.is_autocast_enabled("cpu"))
        return real_measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verify, "eager_latency", latency)
    monkeypatch.setattr(verify, "measure_pruned", measure)
    data_dir = tmp_path / "data"
    write_images(data_dir, "list", [0, 1, 2, 0, 1, 2])
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5], "metric": "ce",
               "target_macs_reduction": 0.1, "verify": True}  # fmt: skip
    config = write_config(
        tmp_path / "a.yaml", {"Global": tiny_global(data_dir, calib_samples=0), "SensitivityAnalysis": section}
    )
    assert run_cli(["--config_path", str(config), "Global.numerics=bf16"]) == 0
    capsys.readouterr()
    assert timed and not any(timed)
    assert evaluated and all(evaluated)

"""The runtime settings a deployment chooses reach the runtime that times the model (read back from the session or
from torch), are part of the latency table's key and the sidecar, and bad values are refused when the config is read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
import torch
from torch import nn

from analysis.config import load_config
from analysis.errors import ConfigError
from analysis.planning.probes import table_key
from analysis.runtimes.runtime import OnnxRuntime, TorchRuntime, make_runtime
from analysis.runtimes.settings import RuntimeSettings
from analysis.runtimes.timing import TimingPlan
from analysis.workflow.latency import latency_runtime

import tiny_models
from helpers import CliResult, analysis_config, randomize, tiny_global, write_config

SHAPE = (3, 16, 16)
FAST = TimingPlan(warmup=1, repeats=3, min_repeats=2, budget_seconds=0.2)


def model() -> nn.Module:
    return randomize(tiny_models.tiny_resnet()).eval()


@pytest.mark.parametrize(("level", "member"), [("disable", "ORT_DISABLE_ALL"), ("basic", "ORT_ENABLE_BASIC"),
                                                ("all", "ORT_ENABLE_ALL")])  # fmt: skip
def test_onnxruntime_sessions_get_the_threads_and_the_graph_optimisation_set(level: str, member: str) -> None:
    settings = RuntimeSettings(threads=1, inter_op_threads=2, graph_optimization=level)
    runtime = OnnxRuntime(torch.device("cpu"), FAST, settings)
    with runtime.prepare(model(), SHAPE) as prepared:
        session = prepared.session  # type: ignore[attr-defined]
        options = session.get_session_options()
        assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 2
        assert options.graph_optimization_level == getattr(ort.GraphOptimizationLevel, member)
        assert session.get_providers() == ["CPUExecutionProvider"]
        assert prepared.time(2).median_ms > 0
    key = runtime.settings()
    assert (key["threads"], key["inter_op_threads"], key["graph_optimization"]) == (1, 2, level)
    assert key["providers"] == ["CPUExecutionProvider"] and "torchscript first" in str(key["exporter"])


def test_one_session_serves_every_timing_of_a_prepared_model(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[object] = []
    real = ort.InferenceSession

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counting)
    runtime = OnnxRuntime(torch.device("cpu"), FAST)
    with runtime.prepare(model(), SHAPE) as prepared:
        for batch in (1, 2, 1):
            prepared.time(batch)
    assert len(made) == 1


def test_an_unknown_provider_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"runtime_provider 'CUDAExecutionProviderX' is not an installed .*CPU"):
        OnnxRuntime(torch.device("cpu"), settings=RuntimeSettings(provider="CUDAExecutionProviderX"))


def test_the_exporter_of_the_shipped_file_writes_the_timed_file_too() -> None:
    runtime = OnnxRuntime(torch.device("cpu"), FAST, RuntimeSettings(exporter="dynamo"))
    with runtime.prepare(model(), SHAPE) as prepared:
        assert prepared.exporter == "dynamo"
    with OnnxRuntime(torch.device("cpu"), FAST).prepare(model(), SHAPE) as prepared:
        assert prepared.exporter == "torchscript"


def test_torch_times_with_its_threads_and_deployment_flags_and_restores_the_callers() -> None:
    before = (torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
              torch.backends.cuda.matmul.allow_tf32)  # fmt: skip
    seen: list[tuple[int, bool, bool, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                         torch.backends.cuda.matmul.allow_tf32))  # fmt: skip
            return x

    threads = 1 if before[0] != 1 else 2
    runtime = TorchRuntime(torch.device("cpu"), FAST, RuntimeSettings(threads=threads))
    runtime.measure(Probe(), SHAPE, 1)
    assert seen and all(s[0] == threads for s in seen)
    assert runtime.settings()["threads"] == threads and "cudnn_benchmark" not in runtime.settings()
    cuda = TorchRuntime(torch.device("cuda"), FAST, RuntimeSettings(cudnn_benchmark=True, tf32=False))
    torch.backends.cudnn.benchmark = False
    with cuda.deployed():  # the flags only: no CUDA call is made
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
    assert (cuda.settings()["cudnn_benchmark"], cuda.settings()["tf32"]) == (True, False)
    torch.backends.cudnn.benchmark = before[1]
    assert (torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32) == before  # fmt: skip


def test_the_settings_are_part_of_the_table_key() -> None:
    net = model()
    keys = [table_key(make_runtime("onnxruntime", torch.device("cpu"), settings=s), net, SHAPE, 1)
            for s in (RuntimeSettings(), RuntimeSettings(threads=1), RuntimeSettings(graph_optimization="basic"),
                      RuntimeSettings(exporter="dynamo"))]  # fmt: skip
    assert len({str(sorted(k.items())) for k in keys}) == 4


def test_the_config_keys_reach_the_runtime(tmp_path: Path, list_data: Path) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data, arch="tests/tiny_models.py:tiny_cnn"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5],
                                "target_latency_reduction": 0.2, "latency_runtime": "onnxruntime",
                                "runtime_threads": 1, "runtime_inter_op_threads": 1,
                                "runtime_graph_optimization": "extended", "onnx_exporter": "dynamo"},
    })  # fmt: skip
    runtime = latency_runtime(load_config(config), torch.device("cpu"))
    assert isinstance(runtime, OnnxRuntime)
    assert runtime.runtime_settings == RuntimeSettings(threads=1, inter_op_threads=1, graph_optimization="extended",
                                                       exporter="dynamo")  # fmt: skip
    options = runtime.session_options()
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"runtime_threads": -1}, "runtime_threads must be a thread count"),
        ({"runtime_inter_op_threads": 5000}, "runtime_inter_op_threads must be a thread count"),
        ({"runtime_graph_optimization": "max"}, "runtime_graph_optimization"),
        ({"onnx_exporter": "tflite"}, "onnx_exporter"),
        ({"latency_tolerance": 0.0}, "latency_tolerance must be a fraction"),
        ({"latency_tolerance": float("nan")}, "latency_tolerance must be a fraction"),
        ({"runtime_provider": "NoSuchExecutionProvider", "latency_runtime": "onnxruntime"}, "runtime_provider"),
    ],
)
def test_bad_runtime_settings_exit_2_before_any_work(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult], settings: dict[str, Any], message: str
) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data, arch="tests/tiny_models.py:tiny_cnn"),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5],
                                "target_latency_reduction": 0.3, **settings},
    })  # fmt: skip
    result = cli("plan", "--config_path", config)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err
    assert not (tmp_path / "s.pkl").exists()  # refused before the analysis


def test_a_setting_of_another_runtime_on_the_command_line_is_refused(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult]
) -> None:
    config = analysis_config(tmp_path, list_data, "slow_cnn", {"pruned_ratios": [0.5]}, arch_kwargs={"delay": 0.0})
    result = cli("plan", "--config_path", config, "--target_latency_reduction", "0.3", "--runtime", "torch",
                 "SensitivityAnalysis.runtime_graph_optimization=basic")  # fmt: skip
    assert result.code == 2 and "runtime_graph_optimization" in result.err and "onnxruntime" in result.err
    assert "Traceback" not in result.err

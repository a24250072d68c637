"""Latency runtimes (torch, onnxruntime, a user's command) and the ONNX export they read, checked against PyTorch."""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime
import pytest
import torch
from torch import nn

from analysis.errors import ConfigError, UserError
from analysis.runtimes import timing
from analysis.runtimes.onnx_export import TOLERANCE, check_onnx, export_onnx, failed_operator
from analysis.runtimes.runtime import CommandRuntime, OnnxRuntime, TorchRuntime, make_runtime
from analysis.runtimes.timing import TimingPlan, time_calls

import tiny_models
from helpers import randomize

SHAPE = (3, 16, 16)
FAST = TimingPlan(warmup=1, repeats=4, min_repeats=2, budget_seconds=0.5)


def model() -> nn.Module:
    return randomize(tiny_models.tiny_resnet()).eval()


def latency_script(tmp_path: Path, body: str) -> str:
    """A command template running a Python script that receives the ONNX file and the batch size."""
    script = tmp_path / "bench.py"
    script.write_text("import sys\nonnx, batch = sys.argv[1], int(sys.argv[2])\n" + body)
    return f"{sys.executable} {script} {{onnx}} {{batch}}"


def test_time_calls_warms_up_then_times_until_the_budget_or_the_cap() -> None:
    calls: list[int] = []
    plan = TimingPlan(warmup=3, repeats=7, min_repeats=2, block_seconds=0.0, steady=-1.0)
    median, spread, repeats = time_calls(lambda: calls.append(1), plan)
    assert len(calls) == 3 + 7 and repeats == 7 and median >= 0 and spread >= 0
    calls.clear()
    plan = TimingPlan(warmup=1, repeats=50, min_repeats=4, budget_seconds=0.0, block_seconds=0.0, steady=-1.0)
    _, _, repeats = time_calls(lambda: calls.append(1), plan)
    assert repeats == 4 and len(calls) == 1 + 4  # no budget left: the minimum only


def test_fast_calls_are_timed_in_blocks() -> None:
    calls: list[int] = []
    _, _, repeats = time_calls(lambda: calls.append(1), TimingPlan(warmup=1, repeats=3, min_repeats=3,
                                                                   block_seconds=0.001, steady=-1.0))  # fmt: skip
    assert repeats == 3 and len(calls) > 1 + 3 * 10  # an append takes far less than a tenth of a millisecond


class FakeClock:
    """``time.perf_counter`` for a call taking ``durations[i]`` seconds on its i-th call (cycling)."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.calls = 0.0, durations, 0

    def call(self) -> None:
        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("durations", "blocks", "median_ms"), [([0.01], 4, 10.0), ([0.01, 0.02, 0.01, 0.03, 0.015], 12, 15.0)]
)
def test_timing_stops_once_steady_and_goes_on_while_noisy(
    monkeypatch: pytest.MonkeyPatch, durations: list[float], blocks: int, median_ms: float
) -> None:
    clock = FakeClock(durations)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    plan = TimingPlan(warmup=1, repeats=12, min_repeats=3, budget_seconds=100.0, block_seconds=0.0)
    median, _, repeats = time_calls(clock.call, plan)
    assert repeats == blocks  # steady: 4 blocks (the quartiles need 4); noisy: every block up to the cap
    assert median == pytest.approx(median_ms)


@pytest.mark.parametrize(("seconds", "warmups", "blocks"), [(0.35, 2, 3), (0.01, 3, 12)])
def test_long_calls_are_timed_by_time_not_by_count(
    monkeypatch: pytest.MonkeyPatch, seconds: float, warmups: int, blocks: int
) -> None:
    """A batch-32 call of a third of a second: two warm-up calls and three timed ones, not three and five or more (a
    large batch's latency table cost more than its analysis); short calls keep the counts."""
    clock = FakeClock([seconds, seconds * 1.2, seconds * 0.9])  # never steady: only the time rule stops it early
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    median, _, repeats = time_calls(clock.call, TimingPlan(warmup=3, repeats=12, min_repeats=5, block_seconds=0.0))
    assert (clock.calls - repeats, repeats) == (warmups, blocks)
    assert median == pytest.approx(seconds * 1000, rel=0.25)


def test_the_torch_runtime_times_the_model_at_the_batch_size() -> None:
    seen: list[tuple[int, ...]] = []
    net = model()
    net.register_forward_hook(lambda _m, inputs, _o: seen.append(tuple(inputs[0].shape)))
    latency = TorchRuntime(torch.device("cpu"), FAST).measure(net, SHAPE, 3)
    assert latency.runtime == "torch" and latency.batch == 3 and latency.median_ms > 0 and latency.repeats >= 2
    assert set(seen) == {(3, *SHAPE)}


def test_onnx_runtime_measures_the_exported_model() -> None:
    latency = OnnxRuntime(torch.device("cpu"), FAST).measure(model(), SHAPE, 2)
    assert latency.runtime == "onnxruntime" and latency.device == "onnxruntime cpu" and latency.median_ms > 0


def test_a_command_gets_the_onnx_file_and_the_batch_and_its_number_is_the_latency(tmp_path: Path) -> None:
    template = latency_script(tmp_path, (
        "import onnxruntime\n"
        "session = onnxruntime.InferenceSession(onnx, providers=['CPUExecutionProvider'])\n"
        "shape = session.get_inputs()[0].shape\n"
        "print('warm-up 3 runs, 12 threads')\n"
        "print(f'latency: {7.5 * batch} ms')\n"
    ))  # fmt: skip
    latency = make_runtime("command", torch.device("cpu"), template).measure(model(), SHAPE, 4)
    assert latency.runtime == "command" and latency.median_ms == 30.0 and latency.repeats == 1


def test_a_command_pattern_picks_the_number(tmp_path: Path) -> None:
    template = latency_script(tmp_path, "print('median = 4.25 ms, p99 = 9.0 ms')\n")
    runtime = CommandRuntime(template, pattern=r"median = ([\d.]+) ms")
    assert runtime.measure(model(), SHAPE, 1).median_ms == 4.25


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("sys.exit(3)\n", "failed with exit code 3"),
        ("print('done')\n", "printed no latency"),
        ("print('latency: -1 ms')\n", "printed no latency"),
    ],
)
def test_a_failing_or_silent_command_is_one_sentence(tmp_path: Path, body: str, message: str) -> None:
    runtime = CommandRuntime(latency_script(tmp_path, body))
    with pytest.raises(UserError, match=message):
        runtime.measure(model(), SHAPE, 1)


@pytest.mark.parametrize(
    ("name", "command", "message"),
    [
        ("onnxrt", None, "did you mean 'onnxruntime'"),
        ("command", None, "needs runtime_command"),
        ("command", "trtexec --model=model.onnx", "must pass the model as {onnx}"),
        ("command", "bench {onnx} {threads}", "has the placeholder {threads}; only {onnx}, {batch} and {shape}"),
    ],
)
def test_bad_runtime_settings_are_refused(name: str, command: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("{", r"\{").replace("}", r"\}")):
        make_runtime(name, torch.device("cpu"), command)


def test_the_onnx_export_equals_pytorch_on_other_batch_sizes(tmp_path: Path) -> None:
    net = model()
    path = tmp_path / "m.onnx"
    exporter = export_onnx(net, torch.randn(2, *SHAPE), path)
    images = [torch.randn(5, *SHAPE), torch.randn(1, *SHAPE)]
    check = check_onnx(path, net, [(batch, torch.zeros(len(batch))) for batch in images], exporter)
    assert check.images == 6 and check.max_abs_diff <= check.tolerance and check.opset >= 17
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        expected = net(images[0])
    (logits,) = session.run(["logits"], {"images": images[0].numpy()})
    assert (torch.from_numpy(logits) - expected).abs().max() <= TOLERANCE * max(1.0, float(expected.abs().max()))


def test_an_export_that_computes_something_else_is_refused_and_removed(tmp_path: Path) -> None:
    net, other = model(), randomize(tiny_models.tiny_resnet(), seed=1).eval()
    path = tmp_path / "m.onnx"
    exporter = export_onnx(other, torch.randn(2, *SHAPE), path)
    with pytest.raises(UserError, match="differs from PyTorch"):
        check_onnx(path, net, [torch.randn(4, *SHAPE)], exporter)
    assert not path.exists()


class Unexportable(nn.Module):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.linalg.svd(images.flatten(1))[0]


def test_an_unsupported_operator_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"cannot be exported to ONNX .*operator aten::_?linalg_svd"):
        export_onnx(Unexportable(), torch.randn(2, *SHAPE), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_failed_operator_reads_the_exporters_messages() -> None:
    inner = RuntimeError("No ONNX function found for <OpOverload(op='aten.roll', overload='default')>")
    outer = RuntimeError("Failed to convert the exported program to an ONNX model.")
    outer.__cause__ = inner
    assert failed_operator(outer) == "operator aten::roll is not supported"
    assert failed_operator(ValueError("shape mismatch\nmore")) == "ValueError: shape mismatch"

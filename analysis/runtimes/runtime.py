"""Runtimes that measure a model's latency: ``torch`` (eager on the analysis device), ``onnxruntime`` (its CPU
execution provider, or CUDA's on a GPU), and ``command`` (any shell command given the ONNX file, e.g.
``trtexec --onnx={onnx}`` or a script that benchmarks on a phone, printing a latency in ms).

A runtime takes the model, the shape of one input sample and a batch size and returns a :class:`Latency`; the ONNX
runtimes export the model first (:mod:`analysis.runtimes.onnx_export`) into a temporary file.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from analysis.command_template import CommandTemplate, compile_pattern
from analysis.config import LATENCY_RUNTIMES
from analysis.errors import ConfigError, UserError, did_you_mean
from analysis.runtimes.onnx_export import INPUT_NAME, OUTPUT_NAME, export_onnx, require_extra
from analysis.runtimes.timing import Latency, TimingPlan, time_calls

RUNTIMES = tuple(name for name in LATENCY_RUNTIMES if name != "auto")
"""The runtimes a latency can be measured on (the config's choices but ``auto``, which picks one of them)."""

NUMBER = re.compile(r"[-+]?(?:(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:inf(?:inity)?|nan)\b)", re.IGNORECASE)
"""A number in a command's output; ``inf`` and ``nan`` are numbers too, so a command printing one is refused rather
than read as whatever digits it printed before (a shape, a temporary path)."""

COMMAND_TIMEOUT_SECONDS = 1800.0


class Runtime(ABC):
    """Measures a model's latency at one batch size.

    Attributes:
        name: The runtime's name (:data:`RUNTIMES`).
        device: Where it runs, for records and cache keys.
        version: The runtime library's version (empty for a command, whose template is in :attr:`device`).
    """

    name: str
    device: str
    version: str = ""

    @abstractmethod
    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        """The latency of one call of ``model`` on ``batch`` inputs of ``sample_shape`` (C, H, W)."""

    def settings(self) -> dict[str, object]:
        """What its latencies depend on besides the model, the input shape and the batch (a latency table's cache
        key holds it, so a table measured with other settings is not reused)."""
        return {"runtime": self.name, "version": self.version, "device": self.device}


class TorchRuntime(Runtime):
    """Eager PyTorch on ``device`` under inference mode; CUDA work is synchronised before each clock read."""

    name = "torch"

    def __init__(self, device: torch.device, plan: TimingPlan | None = None) -> None:
        self.torch_device, self.plan = device, plan or TimingPlan()
        self.device, self.version = str(device), torch.__version__

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        inputs = _inputs(sample_shape, batch).to(self.torch_device)
        model = model.to(self.torch_device).eval()

        def call() -> None:
            with torch.inference_mode():
                model(inputs)
            if self.torch_device.type == "cuda":
                torch.cuda.synchronize(self.torch_device)

        median, spread, repeats = time_calls(call, self.plan)
        return Latency(self.name, self.device, batch, median, spread, repeats)

    def settings(self) -> dict[str, object]:
        """Eager PyTorch on a CPU runs on ``torch.get_num_threads()`` threads (``OMP_NUM_THREADS``)."""
        return {**super().settings(), "threads": torch.get_num_threads()}


class OnnxRuntime(Runtime):
    """ONNX Runtime with the CUDA execution provider when the analysis runs on a GPU and it is available, else the
    CPU provider (its default threads: one per physical core)."""

    name = "onnxruntime"

    def __init__(self, device: torch.device, plan: TimingPlan | None = None) -> None:
        require_extra("The onnxruntime runtime")
        import onnxruntime as ort  # the optional extra

        cuda = device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
        self.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        self.device, self.version = f"onnxruntime {'cuda' if cuda else 'cpu'}", str(ort.__version__)
        self.plan = plan or TimingPlan()

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        import onnxruntime as ort  # the optional extra

        with _exported(model, sample_shape) as path:
            session = ort.InferenceSession(str(path), providers=self.providers)
        feed = {INPUT_NAME: _inputs(sample_shape, batch).numpy()}
        median, spread, repeats = time_calls(lambda: session.run([OUTPUT_NAME], feed), self.plan)
        return Latency(self.name, self.device, batch, median, spread, repeats)

    def settings(self) -> dict[str, object]:
        """The file it runs comes from this torch's ONNX exporter."""
        return {**super().settings(), "exporter": f"torch {torch.__version__}"}


class CommandRuntime(Runtime):
    """A user's command, run once per measurement on the exported ONNX file.

    The template (:class:`~analysis.command_template.CommandTemplate`) is split like a shell command line (no shell:
    use ``sh -c '...'`` for pipes) and may use ``{onnx}`` (the file), ``{batch}`` and ``{shape}`` (``1x3x224x224``),
    filled in per argument (quoted inside a ``sh -c`` script). The command must exit 0 and print the latency in ms:
    the last number it prints (``inf`` and ``nan`` count as numbers, and are refused), or the first group of
    ``pattern`` (a regular expression) where given.

    Raises:
        ConfigError: For a template without ``{onnx}``, an unknown placeholder, or a pattern without one group.
    """

    name = "command"

    def __init__(self, template: str, pattern: str | None = None, key: str = "runtime_command") -> None:
        require_extra("The command runtime")
        self.key = key
        self.command = CommandTemplate.parse(template, key)
        self.template, self.device = template, f"command: {template}"
        self.pattern = None if pattern is None else compile_pattern(pattern)

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        with _exported(model, sample_shape) as path:
            shape = "x".join(str(n) for n in (batch, *sample_shape))
            command = self.command.render({"onnx": str(path), "batch": str(batch), "shape": shape})
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_SECONDS)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise UserError(f"{self.key} '{self.template}' could not run: {error}.") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise UserError(
                f"{self.key} '{self.template}' failed with exit code {done.returncode}"
                f"{': ' + said[-1][:200] if said else ''}; run it by hand on an ONNX file to see why."
            )
        return Latency(self.name, self.device, batch, self._latency(done.stdout), 0.0, 1)

    def settings(self) -> dict[str, object]:
        """The command (in :attr:`device`), the pattern its latency is read with, and the exporter of its file."""
        pattern = None if self.pattern is None else self.pattern.pattern
        return {**super().settings(), "pattern": pattern, "exporter": f"torch {torch.__version__}"}

    def _latency(self, output: str) -> float:
        """The latency in ms the command printed."""
        if self.pattern is not None:
            matches = self.pattern.findall(output)
            text = matches[-1] if matches else None
        else:
            numbers = NUMBER.findall(output)
            text = numbers[-1] if numbers else None
        try:
            value = float(text) if text is not None else None
        except ValueError:
            value = None
        if value is None or not (value > 0 and math.isfinite(value)):
            shown = output.strip().splitlines()[-1][:200] if output.strip() else "nothing"
            raise UserError(
                f"{self.key} '{self.template}' printed no latency (a positive, finite number of ms) as "
                f"{'the pattern asks' if self.pattern is not None else 'its last number'}; its output ended with: "
                f"{shown}."
            )
        return value


PAIRED_ROUNDS = 2
"""Rounds of :func:`measure_pair`: in the order A B, B A, so a machine that speeds up or slows down steadily hits
both alike."""


def measure_pair(
    runtime: Runtime, first: nn.Module, second: nn.Module, sample_shape: Sequence[int], batch: int
) -> tuple[float, float]:
    """The latency of two models measured side by side (:data:`PAIRED_ROUNDS` rounds, order alternating), each the
    lowest of its medians: what a comparison of two models on a shared machine should rest on."""
    times: tuple[list[float], list[float]] = ([], [])
    for round_index in range(PAIRED_ROUNDS):
        order = (0, 1) if round_index % 2 == 0 else (1, 0)
        for index in order:
            times[index].append(runtime.measure((first, second)[index].eval(), sample_shape, batch).median_ms)
    return min(times[0]), min(times[1])


def make_runtime(
    name: str, device: torch.device, command: str | None = None, pattern: str | None = None, key: str = "runtime"
) -> Runtime:
    """The runtime called ``name`` (:data:`RUNTIMES`).

    Raises:
        ConfigError: For an unknown name, or ``command`` without a command template.
    """
    if name == "torch":
        return TorchRuntime(device)
    if name == "onnxruntime":
        return OnnxRuntime(device)
    if name == "command":
        if not command:
            raise ConfigError(f"{key}: command needs runtime_command, e.g. 'trtexec --onnx={{onnx}}'.")
        return CommandRuntime(command, pattern)
    raise ConfigError(f"{key} must be one of {', '.join(RUNTIMES)}, got '{name}'{did_you_mean(name, RUNTIMES)}.")


@contextmanager
def _exported(model: nn.Module, sample_shape: Sequence[int]) -> Iterator[Path]:
    """``model`` exported to a temporary ONNX file (removed after the block), for the runtimes that read one."""
    with tempfile.TemporaryDirectory(prefix="latency-") as folder:
        path = Path(folder) / "model.onnx"
        export_onnx(model, _inputs(sample_shape, 2), path, fast=True)
        yield path


def _inputs(sample_shape: Sequence[int], batch: int) -> torch.Tensor:
    """Seeded random inputs (a runtime's speed does not depend on the values of dense float inputs)."""
    return torch.randn((batch, *sample_shape), generator=torch.Generator().manual_seed(0))

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
from typing import Any

import torch
from torch import nn

from analysis.command_template import CommandTemplate, compile_pattern
from analysis.config import LATENCY_RUNTIMES
from analysis.errors import ConfigError, UserError, did_you_mean
from analysis.runtimes.onnx_export import INPUT_NAME, OPSET, OUTPUT_NAME, export_onnx, require_extra
from analysis.runtimes.settings import RuntimeSettings
from analysis.runtimes.timing import Latency, TimingPlan, time_calls

RUNTIMES = tuple(name for name in LATENCY_RUNTIMES if name != "auto")
"""The runtimes a latency can be measured on (the config's choices but ``auto``, which picks one of them)."""

NUMBER = re.compile(r"[-+]?(?:(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:inf(?:inity)?|nan)\b)", re.IGNORECASE)
"""A number in a command's output; ``inf`` and ``nan`` are numbers too, so a command printing one is refused rather
than read as whatever digits it printed before (a shape, a temporary path)."""

COMMAND_TIMEOUT_SECONDS = 1800.0


class Prepared(ABC):
    """A model made ready to run on a runtime (moved to its device, or exported and loaded once), timed as often as
    asked: the dense model of a latency table is prepared once for all its probes.

    Attributes:
        exporter: The ONNX exporter that wrote the file it runs (None for torch eager).
    """

    exporter: str | None = None

    @abstractmethod
    def time(self, batch: int) -> Latency:
        """The latency of one call on ``batch`` inputs."""

    @abstractmethod
    def close(self) -> None:
        """Release what it holds (a session, a temporary file)."""

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Runtime:
    """Measures a model's latency with the settings a deployment runs it with (:class:`RuntimeSettings`).

    Attributes:
        name: The runtime's name (:data:`RUNTIMES`).
        device: Where it runs, for records and cache keys.
        version: The runtime library's version (empty for a command, whose template is in :attr:`device`).
        runtime_settings: How it runs the model.
        plan: How each latency is measured (warm-up, repeats, time budget).
        on_cpu: Whether it runs the model on a CPU (False where unknown: a user's command).
    """

    name: str
    device: str
    version: str = ""
    on_cpu: bool = False
    runtime_settings: RuntimeSettings = RuntimeSettings()
    plan: TimingPlan = TimingPlan()

    def prepare(self, model: nn.Module, sample_shape: Sequence[int]) -> Prepared:
        """``model`` (eval mode) ready to be timed on inputs of ``sample_shape`` (C, H, W); a runtime that only
        overrides :meth:`measure` gets one that measures the model afresh at each timing."""
        if type(self).measure is Runtime.measure:
            raise NotImplementedError(f"{type(self).__name__} overrides neither prepare nor measure")
        return _Remeasured(self, model, tuple(sample_shape))

    def measure(self, model: nn.Module, sample_shape: Sequence[int], batch: int) -> Latency:
        """The latency of one call of ``model`` on ``batch`` inputs of ``sample_shape`` (C, H, W)."""
        with self.prepare(model, sample_shape) as prepared:
            return prepared.time(batch)

    def settings(self) -> dict[str, object]:
        """What its latencies depend on besides the model, the input shape and the batch (a latency table's cache
        key and the sidecar hold it, so a table measured with other settings is not reused)."""
        return {"runtime": self.name, "version": self.version, "device": self.device}


class _Remeasured(Prepared):
    """A model timed by its runtime's :meth:`Runtime.measure` at each timing (nothing kept between them)."""

    def __init__(self, runtime: Runtime, model: nn.Module, sample_shape: tuple[int, ...]) -> None:
        self.runtime, self.model, self.sample_shape = runtime, model, sample_shape

    def time(self, batch: int) -> Latency:
        return self.runtime.measure(self.model, self.sample_shape, batch)

    def close(self) -> None:
        """Nothing to release."""


class TorchRuntime(Runtime):
    """Eager PyTorch on ``device`` under inference mode, with :attr:`runtime_settings`' threads (and, on CUDA, cuDNN's
    benchmark mode and TF32) while timing, the caller's flags restored after; CUDA work is synchronised before each
    clock read."""

    name = "torch"

    def __init__(
        self, device: torch.device, plan: TimingPlan | None = None, settings: RuntimeSettings | None = None
    ) -> None:
        self.torch_device, self.plan = device, plan or TimingPlan()
        self.runtime_settings = settings or RuntimeSettings()
        self.device, self.version = str(device), torch.__version__
        self.on_cpu = device.type == "cpu"

    def prepare(self, model: nn.Module, sample_shape: Sequence[int]) -> Prepared:
        return _TorchPrepared(self, model.to(self.torch_device).eval(), tuple(sample_shape))

    @contextmanager
    def deployed(self) -> Iterator[None]:
        """Torch's threads, cuDNN benchmark mode and TF32 as :attr:`runtime_settings` deploy them, then as before."""
        threads = torch.get_num_threads()
        flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        try:
            if self.runtime_settings.threads:
                torch.set_num_threads(self.runtime_settings.threads)
            if self.torch_device.type == "cuda":
                torch.backends.cudnn.benchmark = self.runtime_settings.cudnn_benchmark
                torch.backends.cudnn.allow_tf32 = self.runtime_settings.tf32
                torch.backends.cuda.matmul.allow_tf32 = self.runtime_settings.tf32
            yield
        finally:
            torch.set_num_threads(threads)
            (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32) = flags  # fmt: skip

    def settings(self) -> dict[str, object]:
        """Its threads (``torch.get_num_threads()`` when not set), and on CUDA cuDNN's benchmark mode and TF32."""
        chosen: dict[str, object] = {"threads": self.runtime_settings.threads or torch.get_num_threads()}
        if self.torch_device.type == "cuda":
            chosen.update(cudnn_benchmark=self.runtime_settings.cudnn_benchmark, tf32=self.runtime_settings.tf32)
        return {**super().settings(), **chosen}


class _TorchPrepared(Prepared):
    """A model on the torch runtime's device."""

    def __init__(self, runtime: TorchRuntime, model: nn.Module, sample_shape: tuple[int, ...]) -> None:
        self.runtime, self.model, self.sample_shape = runtime, model, sample_shape

    def time(self, batch: int) -> Latency:
        runtime = self.runtime
        inputs = _inputs(self.sample_shape, batch).to(runtime.torch_device)
        model = self.model

        def call() -> None:
            with torch.inference_mode():
                model(inputs)
            if runtime.torch_device.type == "cuda":
                torch.cuda.synchronize(runtime.torch_device)

        with runtime.deployed():
            median, spread, repeats = time_calls(call, runtime.plan)
        return Latency(runtime.name, runtime.device, batch, median, spread, repeats)

    def close(self) -> None:
        """Nothing to release: the model is the caller's."""


GRAPH_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                "all": "ORT_ENABLE_ALL"}  # fmt: skip
"""ONNX Runtime's ``GraphOptimizationLevel`` member of each ``graph_optimization`` value."""


class OnnxRuntime(Runtime):
    """ONNX Runtime with :attr:`runtime_settings`' execution provider (``auto``: CUDA's when the analysis runs on a GPU
    and it is available, else the CPU's), threads and graph optimisation level; each model is exported once (with
    the exporter the shipped file uses) and gets one session, reused for every timing of it.

    Raises:
        ConfigError: For a provider that is not installed.
    """

    name = "onnxruntime"

    def __init__(
        self, device: torch.device, plan: TimingPlan | None = None, settings: RuntimeSettings | None = None
    ) -> None:
        require_extra("The onnxruntime runtime")
        import onnxruntime as ort  # the optional extra

        self.runtime_settings = settings or RuntimeSettings()
        available = ort.get_available_providers()
        provider = self.runtime_settings.provider
        if provider == "auto":
            provider = "CUDAExecutionProvider" if device.type == "cuda" and "CUDAExecutionProvider" in available else (
                "CPUExecutionProvider")  # fmt: skip
        elif provider not in available:
            raise ConfigError(
                f"SensitivityAnalysis.runtime_provider '{provider}' is not an installed ONNX Runtime execution "
                f"provider{did_you_mean(provider, available)}; installed: {', '.join(available)}."
            )
        self.providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
        short = provider.removesuffix("ExecutionProvider").lower()
        self.device, self.version = f"onnxruntime {short}", str(ort.__version__)
        self.on_cpu = provider == "CPUExecutionProvider"
        self.plan = plan or TimingPlan()

    def session_options(self) -> Any:
        """The ``SessionOptions`` every session gets: threads and graph optimisation level as set."""
        import onnxruntime as ort  # the optional extra

        options = ort.SessionOptions()
        chosen = self.runtime_settings
        options.intra_op_num_threads = chosen.threads
        options.inter_op_num_threads = chosen.inter_op_threads
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[chosen.graph_optimization])
        options.log_severity_level = 3  # errors only: its warnings about unused initialisers are not the user's
        return options

    def prepare(self, model: nn.Module, sample_shape: Sequence[int]) -> Prepared:
        import onnxruntime as ort  # the optional extra

        with _exported(model, sample_shape, self.runtime_settings.exporter) as (path, exporter):
            session = ort.InferenceSession(str(path), self.session_options(), providers=self.providers)
        return _SessionPrepared(self, session, tuple(sample_shape), exporter)

    def settings(self) -> dict[str, object]:
        """Its execution providers, threads, graph optimisation level, and the exporter of its files."""
        chosen = self.runtime_settings
        return {**super().settings(), "providers": list(self.providers), "threads": chosen.threads,
                "inter_op_threads": chosen.inter_op_threads, "graph_optimization": chosen.graph_optimization,
                "exporter": f"{chosen.exporter} first, torch {torch.__version__}, opset {OPSET}"}  # fmt: skip


class _SessionPrepared(Prepared):
    """One ONNX Runtime session of an exported model."""

    def __init__(self, runtime: OnnxRuntime, session: Any, sample_shape: tuple[int, ...], exporter: str) -> None:
        self.runtime, self.session, self.sample_shape, self.exporter = runtime, session, sample_shape, exporter

    def time(self, batch: int) -> Latency:
        feed = {INPUT_NAME: _inputs(self.sample_shape, batch).numpy()}
        session = self.session
        median, spread, repeats = time_calls(lambda: session.run([OUTPUT_NAME], feed), self.runtime.plan)
        return Latency(self.runtime.name, self.runtime.device, batch, median, spread, repeats)

    def close(self) -> None:
        self.session = None


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

    def __init__(
        self, template: str, pattern: str | None = None, key: str = "runtime_command",
        settings: RuntimeSettings | None = None,
    ) -> None:  # fmt: skip
        require_extra("The command runtime")
        self.key, self.runtime_settings = key, settings or RuntimeSettings()
        self.command = CommandTemplate.parse(template, key)
        self.template, self.device = template, f"command: {template}"
        self.pattern = None if pattern is None else compile_pattern(pattern)

    def prepare(self, model: nn.Module, sample_shape: Sequence[int]) -> Prepared:
        return _CommandPrepared(self, model, tuple(sample_shape))

    def run(self, path: Path, sample_shape: Sequence[int], batch: int) -> Latency:
        """The latency the command prints for the ONNX file at ``path``."""
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
        exporter = f"{self.runtime_settings.exporter} first, torch {torch.__version__}, opset {OPSET}"
        return {**super().settings(), "pattern": pattern, "exporter": exporter}

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


class _CommandPrepared(Prepared):
    """A model exported once to a temporary ONNX file (removed on :meth:`close`) that the command runs."""

    def __init__(self, runtime: CommandRuntime, model: nn.Module, sample_shape: tuple[int, ...]) -> None:
        self.runtime, self.sample_shape = runtime, sample_shape
        self.folder = tempfile.TemporaryDirectory(prefix="latency-")
        self.path = Path(self.folder.name) / "model.onnx"
        self.exporter = export_onnx(model, _inputs(sample_shape, 2), self.path, runtime.runtime_settings.exporter)

    def time(self, batch: int) -> Latency:
        return self.runtime.run(self.path, self.sample_shape, batch)

    def close(self) -> None:
        self.folder.cleanup()


def make_runtime(
    name: str,
    device: torch.device,
    command: str | None = None,
    pattern: str | None = None,
    key: str = "runtime",
    settings: RuntimeSettings | None = None,
) -> Runtime:
    """The runtime called ``name`` (:data:`RUNTIMES`).

    Raises:
        ConfigError: For an unknown name, or ``command`` without a command template.
    """
    if name == "torch":
        return TorchRuntime(device, settings=settings)
    if name == "onnxruntime":
        return OnnxRuntime(device, settings=settings)
    if name == "command":
        if not command:
            raise ConfigError(f"{key}: command needs runtime_command, e.g. 'trtexec --onnx={{onnx}}'.")
        return CommandRuntime(command, pattern, settings=settings)
    raise ConfigError(f"{key} must be one of {', '.join(RUNTIMES)}, got '{name}'{did_you_mean(name, RUNTIMES)}.")


@contextmanager
def _exported(model: nn.Module, sample_shape: Sequence[int], first: str) -> Iterator[tuple[Path, str]]:
    """``model`` exported to a temporary ONNX file (removed after the block) with ``first`` tried first, and the
    exporter that wrote it."""
    with tempfile.TemporaryDirectory(prefix="latency-") as folder:
        path = Path(folder) / "model.onnx"
        exporter = export_onnx(model, _inputs(sample_shape, 2), path, first)
        yield path, exporter


def _inputs(sample_shape: Sequence[int], batch: int) -> torch.Tensor:
    """Seeded random inputs (a runtime's speed does not depend on the values of dense float inputs)."""
    return torch.randn((batch, *sample_shape), generator=torch.Generator().manual_seed(0))

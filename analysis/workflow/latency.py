"""The latency runtime a config names, and the latency ``verify`` reports: the dense and the pruned model timed on
it the way a latency plan's verdict is measured (:func:`~analysis.runtimes.compare.bracket`)."""

from __future__ import annotations

import torch
from torch import nn

from analysis.config import Config, runtime_timed_by_verify
from analysis.planning.plan import Plan
from analysis.planning.verify import RuntimeLatency
from analysis.runtimes.compare import ROUNDS, bracket
from analysis.runtimes.onnx_export import missing_modules
from analysis.runtimes.runtime import Runtime, make_runtime
from analysis.runtimes.settings import RuntimeSettings


def latency_runtime(config: Config, device: torch.device) -> Runtime:
    """The runtime ``SensitivityAnalysis.latency_runtime`` names, with the config's runtime settings; ``auto`` is
    ONNX Runtime when the onnx extra is installed (what most deployments run, and the format every other runtime
    takes), else torch eager."""
    s = config.SensitivityAnalysis
    name = s.latency_runtime
    if name == "auto":
        name = "onnxruntime" if not missing_modules() else "torch"
    return make_runtime(name, device, s.runtime_command, s.runtime_pattern, key="SensitivityAnalysis.latency_runtime",
                        settings=RuntimeSettings.from_config(s))  # fmt: skip


def check_runtime(config: Config) -> None:
    """Refuse, before any work, a latency runtime that cannot be made as configured (a provider ONNX Runtime does not
    have, a missing onnx extra), when something will be timed on it.

    Raises:
        UserError: Naming the key.
    """
    s = config.SensitivityAnalysis
    target = s.target_latency_reduction is not None or s.target_latency_ms is not None
    if target or (s.verify and runtime_timed_by_verify(config)):
        latency_runtime(config, torch.device("cpu"))  # the device decides only ``auto``'s provider


def wants_runtime_latency(config: Config, plan: Plan) -> bool:
    """Whether ``verify`` also times the plan on the latency runtime: for a latency plan, and whenever the config
    names a runtime or a batch for it (:func:`~analysis.config.runtime_timed_by_verify`)."""
    return plan.latency is not None or runtime_timed_by_verify(config)


def runtime_latency(
    config: Config, plan: Plan, model: nn.Module, pruned: nn.Module, example_input: torch.Tensor
) -> RuntimeLatency:
    """The pruned model timed between timings of the dense model on the config's latency runtime at
    ``latency_batch``, with the plan's prediction (on the dense model measured now) when it was planned on that
    runtime and batch."""
    runtime = latency_runtime(config, example_input.device)
    s = config.SensitivityAnalysis
    sample_shape = tuple(example_input.shape[1:])
    with runtime.prepare(model, sample_shape) as dense, runtime.prepare(pruned, sample_shape) as candidate:
        measured = bracket(dense, candidate, s.latency_batch, ROUNDS, s.latency_tolerance)
    outcome = plan.latency
    same = outcome is not None and (outcome.runtime, outcome.device, outcome.batch) == (
        runtime.name, runtime.device, s.latency_batch)  # fmt: skip
    predicted = outcome.predicted_reduction if same and outcome is not None else None
    return RuntimeLatency(runtime.name, runtime.device, s.latency_batch, measured, predicted, s.latency_tolerance,
                          runtime.settings())  # fmt: skip

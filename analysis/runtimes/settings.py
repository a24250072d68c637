"""How a runtime runs a model when it is timed: the settings a deployment chooses (threads, ONNX Runtime's graph
optimisation and execution provider, cuDNN's benchmark mode and TF32 on CUDA, the ONNX exporter), as one record that
the runtimes apply, the latency table's cache key holds and the sidecar records."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from analysis.config import GRAPH_OPTIMIZATIONS, ONNX_EXPORTERS, SensitivityConfig
from analysis.errors import ConfigError


@dataclass(frozen=True)
class RuntimeSettings:
    """The settings a latency is measured with.

    Attributes:
        threads: Threads one inference uses (ONNX Runtime's intra-op threads, torch's ``set_num_threads``); 0: the
            runtime's own default.
        inter_op_threads: ONNX Runtime's inter-op threads; 0: its default.
        graph_optimization: ONNX Runtime's graph optimisation level (:data:`~analysis.config.GRAPH_OPTIMIZATIONS`).
        provider: ONNX Runtime's execution provider by name, or ``auto`` (CUDA's on a GPU when installed, else the
            CPU's).
        cudnn_benchmark: Torch on CUDA: cuDNN's benchmark mode while timing.
        tf32: Torch on CUDA: TF32 allowed in convolutions and matmuls while timing.
        exporter: The ONNX exporter tried first (:data:`~analysis.config.ONNX_EXPORTERS`), as for the shipped file.
    """

    threads: int = 0
    inter_op_threads: int = 0
    graph_optimization: str = "all"
    provider: str = "auto"
    cudnn_benchmark: bool = True
    tf32: bool = True
    exporter: str = "torchscript"

    def __post_init__(self) -> None:
        if self.threads < 0 or self.inter_op_threads < 0:
            raise ConfigError(f"runtime threads must be 0 (the runtime's default) or more, got {self.threads} and "
                              f"{self.inter_op_threads}.")  # fmt: skip
        if self.graph_optimization not in GRAPH_OPTIMIZATIONS:
            raise ConfigError(f"graph_optimization must be one of {', '.join(GRAPH_OPTIMIZATIONS)}, got "
                              f"'{self.graph_optimization}'.")  # fmt: skip
        if self.exporter not in ONNX_EXPORTERS:
            raise ConfigError(f"exporter must be one of {', '.join(ONNX_EXPORTERS)}, got '{self.exporter}'.")

    @classmethod
    def from_config(cls, s: SensitivityConfig) -> RuntimeSettings:
        """The settings the ``SensitivityAnalysis`` block gives (``runtime_*`` and ``onnx_exporter``)."""
        return cls(
            threads=s.runtime_threads,
            inter_op_threads=s.runtime_inter_op_threads,
            graph_optimization=s.runtime_graph_optimization,
            provider=s.runtime_provider,
            cudnn_benchmark=s.runtime_cudnn_benchmark,
            tf32=s.runtime_tf32,
            exporter=s.onnx_exporter,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

"""The arithmetic of every forward pass (``Global.numerics``), set for one job and restored after it.

PyTorch's defaults are not exact on a GPU: ``cudnn.allow_tf32`` is on (cuDNN convolutions may run in TF32 on Ampere
and newer) and ``cudnn.deterministic`` off (non-deterministic algorithms may be chosen), so two runs need not agree
to the bit. This tool's product is exact
numbers, so ``exact`` (the default) turns TF32 off for cuDNN and matmuls, asks for deterministic cuDNN algorithms
and turns benchmarking off; ``tf32`` and ``bf16`` are opt-in speed modes (``bf16`` runs the forward passes under
bfloat16 autocast). Algorithms stay deterministic in every mode, so the fast engine still gives the reference
engine's numbers and a resumed run an uninterrupted run's within a mode.

:func:`numerics` sets the flags (and autocast) for the duration of a ``with`` block and restores the caller's
flags afterwards, so the Python APIs never leave a changed flag in the user's process. :func:`machine_record` says
which device and library versions produced an analysis file's numbers.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from analysis.config import NUMERICS_MODES
from analysis.io.sidecar import MachineRecord

APPROXIMATE_MODES = tuple(mode for mode in NUMERICS_MODES if mode != "exact")
"""The speed modes: their losses are approximate (the sidecar, the report and the CSV headers say so)."""


@dataclass(frozen=True)
class BackendFlags:
    """The process-wide flags that decide how float32 convolutions and matmuls are computed.

    Attributes:
        cudnn_tf32: ``torch.backends.cudnn.allow_tf32``: cuDNN convolutions may use TF32 (default True).
        matmul_tf32: ``torch.backends.cuda.matmul.allow_tf32``: CUDA matmuls may use TF32.
        matmul_precision: ``torch.get_float32_matmul_precision()`` (``highest``, ``high`` or ``medium``).
        deterministic: ``torch.backends.cudnn.deterministic``: only deterministic cuDNN algorithms.
        benchmark: ``torch.backends.cudnn.benchmark``: cuDNN picks algorithms by timing them.
    """

    cudnn_tf32: bool
    matmul_tf32: bool
    matmul_precision: str
    deterministic: bool
    benchmark: bool

    @classmethod
    def current(cls) -> BackendFlags:
        """The flags as the process has them now."""
        return cls(
            cudnn_tf32=torch.backends.cudnn.allow_tf32,
            matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
            matmul_precision=torch.get_float32_matmul_precision(),
            deterministic=torch.backends.cudnn.deterministic,
            benchmark=torch.backends.cudnn.benchmark,
        )

    def apply(self) -> None:
        """Set these flags process-wide."""
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cudnn.deterministic = self.deterministic
        torch.backends.cudnn.benchmark = self.benchmark


EXACT_FLAGS = BackendFlags(
    cudnn_tf32=False, matmul_tf32=False, matmul_precision="highest", deterministic=True, benchmark=False
)
FAST_FLAGS = BackendFlags(
    cudnn_tf32=True, matmul_tf32=True, matmul_precision="high", deterministic=True, benchmark=False
)
MODE_FLAGS = {"exact": EXACT_FLAGS, "tf32": FAST_FLAGS, "bf16": FAST_FLAGS}
"""The flags of each mode; ``bf16`` computes what autocast leaves in float32 with TF32 too."""


@contextmanager
def numerics(mode: str, device: torch.device | str) -> Iterator[None]:
    """Run the block under ``mode``'s arithmetic on ``device``, then restore the caller's flags (also on errors).

    ``exact`` and ``tf32`` turn off any autocast the caller had on (their forward passes are float32); ``bf16``
    turns on bfloat16 autocast for ``device``'s type.

    Raises:
        ValueError: For a mode that is not one of :data:`analysis.config.NUMERICS_MODES` (the config checks it first).
    """
    if mode not in MODE_FLAGS:
        raise ValueError(f"unknown numerics mode {mode!r}")
    device_type = torch.device(device).type
    saved = BackendFlags.current()
    MODE_FLAGS[mode].apply()
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=mode == "bf16"):
            yield
    finally:
        saved.apply()


def is_approximate(mode: str) -> bool:
    """Whether losses computed under ``mode`` are approximate (a speed mode)."""
    return mode in APPROXIMATE_MODES


def machine_record(device: torch.device | str) -> MachineRecord:
    """The device and library versions that produce numbers on ``device``: its type and name (the GPU's, or the
    processor's), and the torch, CUDA and cuDNN versions (CUDA and cuDNN only for a CUDA device)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else _processor_name()
    cudnn = torch.backends.cudnn.version() if cuda else None  # type: ignore[no-untyped-call]  # untyped in torch
    return MachineRecord(
        device=device.type,
        name=name or None,
        torch=torch.__version__,
        cuda=torch.version.cuda if cuda else None,
        cudnn=str(cudnn) if cudnn is not None else None,
    )


def _processor_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

"""The record of an ONNX export's check (written into ``pruned_channels.json`` and kept with a plan's result): how
ONNX Runtime's logits compared with PyTorch's on real images (:mod:`analysis.runtimes.onnx_export` makes it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class OnnxCheck:
    """How the exported file compared with PyTorch on real images.

    Attributes:
        file: The ONNX file's name in the export folder.
        images: Images compared.
        max_abs_diff: Largest absolute logit difference.
        tolerance: Largest accepted difference.
        opset: The file's opset.
        exporter: ``dynamo`` (torch.export-based) or ``torchscript``.
    """

    file: str
    images: int
    max_abs_diff: float
    tolerance: float
    opset: int
    exporter: str

    def as_dict(self) -> dict[str, Any]:
        """The check as JSON-ready data."""
        return asdict(self)

"""What the plan step produced: the plan, where its ratios went, its verification and the exported files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from analysis.io.onnx_check import OnnxCheck
from analysis.planning.plan import Plan
from analysis.planning.verify import CalibrationCheck, Verification


@dataclass
class PlanResult:
    """A plan, where its ratios went, and (when asked for) its verification and exported files."""

    plan: Plan
    ratios_file: Path | None
    verification: Verification | None = None
    exported: dict[str, Path] | None = None
    estimates: str | None = None
    export_check: CalibrationCheck | None = None  # the calibration check of an export without verification
    onnx_check: OnnxCheck | None = None  # the exported ONNX file compared with PyTorch (with the onnx extra)

    @property
    def calibration_check(self) -> CalibrationCheck | None:
        """The check of the calibration images the verified or exported statistics were re-estimated on."""
        return self.verification.calibration_check if self.verification is not None else self.export_check

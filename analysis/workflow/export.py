"""The export step: the pruned model's files (PyTorch, its state dict, the changed shapes, the applied ratios and,
with the onnx extra, ONNX checked against PyTorch) written into the export folder all at once.

Every file is staged under a temporary name first (:class:`~analysis.io.staged.StagedFiles`) and renamed into place
only when all are ready, so a failure (an operator the ONNX exporter cannot convert, an ONNX file that computes
something else, a full disk) leaves the folder byte-identical to before; a finished export removes the files of an
older export that it did not write (e.g. ``pruned_model.onnx`` when this one has no ONNX), so the folder never mixes
two exports.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.inputs.numerics import numerics
from analysis.io.export_files import EXPORT_FILES, ONNX_FILE, RATIOS_FILE
from analysis.io.onnx_check import OnnxCheck
from analysis.io.staged import StagedFiles
from analysis.planning.export import FILE_KINDS, pruned_files
from analysis.runtimes.onnx_export import check_onnx, export_onnx, missing_modules

logger = logging.getLogger(__name__)

ONNX_REMEDY = (
    "export without ONNX with SensitivityAnalysis.export_onnx: false (the PyTorch files need no converter), or "
    "replace that operator in the model"
)
"""What a user can do when the pruned model cannot be exported to ONNX."""
CHECK_REMEDY = "export without ONNX with SensitivityAnalysis.export_onnx: false, and report the model"
"""What a user can do when the ONNX file computes something else than PyTorch."""


def write_export(
    folder: str | Path,
    pruned: nn.Module,
    dense: nn.Module,
    example: torch.Tensor,
    images: Iterable[Any],
    extra: Mapping[str, Any],
    ratios_yaml: bytes,
    onnx: bool,
    exporter: str = "torchscript",
) -> tuple[dict[str, Path], OnnxCheck | None]:
    """Export ``pruned`` into ``folder``, all files at once or none.

    Args:
        folder: The export folder (created when missing).
        pruned: The pruned model.
        dense: The model it was pruned from (``pruned_channels.json`` lists the layers whose shape differs).
        example: An input batch, for the ONNX export.
        images: Batches the ONNX file is checked on against PyTorch.
        extra: What ``pruned_channels.json`` carries besides the shapes (plan, arch, BatchNorm note).
        ratios_yaml: The applied ratios' YAML, written as ``channel_prune.yaml``.
        onnx: Also write ``pruned_model.onnx`` (skipped with a notice without the onnx extra).
        exporter: The ONNX exporter tried first (``SensitivityAnalysis.onnx_exporter``; latency runtimes use it too).

    Returns:
        The written files by kind (``model``, ``state_dict``, ``channels``, ``onnx`` when written, ``ratios``) and
        the ONNX check (None without ONNX).

    Raises:
        UserError: If the ONNX export fails or differs from PyTorch; the folder is then as it was.
    """
    details = dict(extra)
    with StagedFiles(folder) as staged:
        check = None
        if onnx:
            with numerics("exact", example.device):
                check = _stage_onnx(staged, pruned, example, images, exporter)
            if check is not None:
                details["onnx"] = check.as_dict()
        for name, data in pruned_files(pruned, dense, details).items():
            staged.write_bytes(name, data)
        staged.write_bytes(RATIOS_FILE, ratios_yaml)
        placed = staged.commit(replaces=EXPORT_FILES)
    exported = {kind: placed[name] for kind, name in FILE_KINDS.items()}
    if check is not None:
        exported["onnx"] = placed[ONNX_FILE]
        logger.info(
            "ONNX export: %s (opset %d, %s exporter); ONNX Runtime equals PyTorch within %.2g on %d images (max "
            "difference %.2g).", placed[ONNX_FILE], check.opset, check.exporter, check.tolerance, check.images,
            check.max_abs_diff,
        )  # fmt: skip
    exported["ratios"] = placed[RATIOS_FILE]
    return exported, check


def _stage_onnx(
    staged: StagedFiles, pruned: nn.Module, example: torch.Tensor, images: Iterable[Any], first: str
) -> OnnxCheck | None:
    """Export the pruned model as ONNX to a staged file and check it against PyTorch on evaluation images; None (with
    a notice) without the onnx extra."""
    missing = missing_modules()
    if missing:
        logger.info(
            "No ONNX export: %s not installed (pip install -e \".[onnx]\"; SensitivityAnalysis.export_onnx: false "
            "silences this).", ", ".join(missing),
        )  # fmt: skip
        return None
    path = staged.temporary(ONNX_FILE)
    exporter = export_onnx(pruned, example, path, first, remedy=ONNX_REMEDY)
    return dataclasses.replace(check_onnx(path, pruned, images, exporter, remedy=CHECK_REMEDY), file=ONNX_FILE)

"""ONNX export of a (pruned) model, and the check that ONNX Runtime computes what PyTorch computes.

The model is exported with ``torch.onnx.export`` (the torch.export-based exporter, the maintained one; the
TorchScript exporter is tried when it fails) at opset :data:`OPSET`, one input ``images`` with a dynamic batch
dimension and one output ``logits``. The check runs the file in ONNX Runtime on real batches and compares the logits
with the PyTorch model's: they must agree within :data:`TOLERANCE` (relative to the logits' scale), else the export
is refused. Needs the ``onnx`` extra (``pip install -e ".[onnx]"``: onnx, onnxruntime, onnxscript).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import os
import re
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.engine.batchnorm import batch_images
from analysis.errors import UserError
from analysis.io.onnx_check import OnnxCheck

logger = logging.getLogger(__name__)

OPSET = 18
"""The ONNX opset the export targets (supported by ONNX Runtime 1.16 and later, TensorRT 10)."""

TOLERANCE = 1e-4
"""Largest accepted difference of ONNX Runtime's logits from PyTorch's, relative to the largest PyTorch logit (at
least 1). Bit equality is not asked: ONNX Runtime's logits of a 64-px resnet18 differed from PyTorch's by 9.5e-7 on
this project's 2-core CPU VM, and a model with other weights differs far beyond the tolerance (tested)."""

INPUT_NAME, OUTPUT_NAME = "images", "logits"
EXPORTERS = ("torchscript", "dynamo")
EXTRA_MODULES = ("onnx", "onnxruntime", "onnxscript")


def missing_modules() -> list[str]:
    """The modules of the ``onnx`` extra that are not installed (empty: ONNX export and ONNX Runtime work)."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def require_extra(what: str) -> None:
    """Refuse ``what`` without the ``onnx`` extra.

    Raises:
        UserError: Naming the missing modules and the install command.
    """
    missing = missing_modules()
    if missing:
        raise UserError(
            f'{what} needs {", ".join(missing)} (the onnx extra); install it with pip install -e ".[onnx]".'
        )


def export_onnx(
    model: nn.Module,
    example_input: torch.Tensor,
    path: str | Path,
    first: str = "torchscript",
    remedy: str = "replace that operator in the model",
) -> str:
    """Write ``model`` (in eval mode) as ONNX to ``path``; return the exporter that succeeded.

    ``first`` (``SensitivityAnalysis.onnx_exporter``) is tried first, the other when it fails; the shipped file and
    every file a latency runtime times go through here with the same ``first``, so what is timed is what is deployed.
    The TorchScript exporter is the fast one (MobileNetV2 at 224 px on the 2-core CPU VM: 0.75 s against 20 s for
    the torch.export-based one), which matters for the many files a latency table exports.
    The exporters write a temporary file beside ``path``, renamed to it once one succeeded: a failed export leaves
    a file already at ``path`` as it was.

    Raises:
        UserError: If neither exporter can convert the model, naming the operator that failed where it is known and
            ending with ``remedy`` (what the caller's user can do instead).
    """
    require_extra("ONNX export")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.tmp{path.suffix}")
    example = example_input[:2].detach().cpu()
    model = on_cpu(model)
    errors: dict[str, Exception] = {}
    try:
        for exporter in sorted(EXPORTERS, key=lambda name: name != first):
            try:
                with _quiet():
                    _export(exporter, model, example, temp)
            except Exception as error:  # the exporters raise many types; all mean "cannot convert"
                logger.debug("The %s ONNX exporter failed.", exporter, exc_info=True)
                errors[exporter] = error
                temp.unlink(missing_ok=True)
                continue
            os.replace(temp, path)
            return exporter
    finally:
        temp.unlink(missing_ok=True)
    named = errors["dynamo"]  # its messages name the operator
    raise UserError(
        f"The model cannot be exported to ONNX (opset {OPSET}): {failed_operator(named)}; {remedy}."
    ) from named


def _export(exporter: str, model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """One exporter's export, with a dynamic batch dimension."""
    if exporter == "dynamo":
        batch = torch.export.Dim("batch", min=1)
        torch.onnx.export(
            model, (example,), str(path), dynamo=True, opset_version=OPSET, input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},), external_data=False, verbose=False,
        )  # fmt: skip
        return
    torch.onnx.export(
        model, (example,), str(path), dynamo=False, opset_version=OPSET, input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME], dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
    )  # fmt: skip


def failed_operator(error: BaseException) -> str:
    """The operator an export failed on, as ``operator aten::_linalg_svd is not supported``, or the error's first
    line when no operator is named."""
    texts = []
    cause: BaseException | None = error
    while cause is not None:
        texts.append(str(cause))
        cause = cause.__cause__
    joined = "\n".join(texts)
    match = re.search(r"op='([\w.]+)'", joined) or re.search(r"torch\.ops\.([\w]+\.[\w]+)", joined)
    if match is None:
        match = re.search(r"(aten::\w+|prim::\w+)", joined)
    if match is not None:
        operator = (
            match.group(1).replace("aten.", "aten::", 1) if match.group(1).startswith("aten.") else match.group(1)
        )
        return f"operator {operator} is not supported"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def check_onnx(
    path: str | Path,
    model: nn.Module,
    batches: Iterable[Any],
    exporter: str,
    max_images: int = 64,
    remedy: str = "report the model, or deploy the PyTorch export",
) -> OnnxCheck:
    """Compare ONNX Runtime's logits on ``batches`` (``(images, labels)`` or images) with ``model``'s.

    Raises:
        UserError: If they differ by more than the tolerance (the export is wrong; the file is removed), ending with
            ``remedy``.
    """
    import onnx  # the optional extra: loaded only when exporting
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = on_cpu(model)
    images = 0
    difference, scale = 0.0, 1.0
    with torch.inference_mode():
        for batch in batches:
            inputs = batch_images(batch)[: max_images - images].cpu()
            reference = model(inputs).float()
            (output,) = session.run([OUTPUT_NAME], {INPUT_NAME: inputs.numpy()})
            difference = max(difference, float((torch.from_numpy(output).float() - reference).abs().max()))
            scale = max(scale, float(reference.abs().max()))
            images += len(inputs)
            if images >= max_images:
                break
    opset = next((o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx")), OPSET)
    check = OnnxCheck(Path(path).name, images, difference, TOLERANCE * scale, int(opset), exporter)
    if images == 0 or difference > check.tolerance:
        Path(path).unlink(missing_ok=True)
        raise UserError(
            f"The ONNX export of the model differs from PyTorch by {difference:.3g} on {images} images (tolerance "
            f"{check.tolerance:.3g}); the file was not kept: {remedy}."
        )
    return check


def on_cpu(model: nn.Module) -> nn.Module:
    """``model`` if it is on the CPU, else a CPU copy of it (the caller's model stays where it is)."""
    if all(tensor.device.type == "cpu" for tensor in [*model.parameters(), *model.buffers()]):
        return model
    return copy.deepcopy(model).cpu()


@contextlib.contextmanager
def _quiet() -> Any:
    """Keep the exporters' progress lines, graph dumps and deprecation warnings out of the user's output (a failure
    is reported by the exception, with the exporters' own text in the debug log)."""
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield

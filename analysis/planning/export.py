"""Export a pruned model three ways, and rebuild it from the safe two without unpickling code.

- ``pruned_model.pt``: the whole pruned ``nn.Module``, pickled (``torch.save(model)``). Loading it runs
  ``torch.load(path, weights_only=False)``, which executes code from the file and needs the model's classes
  importable: convenient, but only for files you trust.
- ``pruned_state_dict.pt``: the weights alone (``torch.load(..., weights_only=True)`` reads it safely).
- ``pruned_channels.json``: the shape of every layer the pruning changed (conv, batch norm, linear, ...), so that
  :func:`load_pruned` can shrink a freshly built dense model to the pruned architecture and load the weights.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.errors import ModelError
from analysis.inputs.device import model_device
from analysis.inputs.models import PRIVATE_MODULE_PREFIX
from analysis.io.export_files import CHANNELS_FILE, MODEL_FILE, STATE_DICT_FILE
from analysis.io.staged import StagedFiles
from analysis.structure.attention_stream import sync_stored_widths
from analysis.structure.custom_layers import customized_pruners
from analysis.structure.heads import PrunedMultiheadAttention, is_attention, with_heads

FORMAT_VERSION = 1

logger = logging.getLogger(__name__)


def layer_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The size-defining attributes of every conv, linear and norm layer and every customised layer (see
    :mod:`analysis.structure.custom_layers`), by module name."""
    shapes: dict[str, dict[str, Any]] = {}
    custom = customized_pruners()
    for name, module in model.named_modules():
        if isinstance(module, PrunedMultiheadAttention):  # attention modules before their customised pruners
            shapes[name] = {"type": "PrunedMultiheadAttention", **module.sizes()}
        elif is_attention(module):
            shapes[name] = {"type": type(module).__name__, "num_heads": module.num_heads}
        elif type(module) in custom:
            shapes[name] = {"type": type(module).__name__, "channels": custom[type(module)].channels(module)}
        elif isinstance(module, nn.modules.conv._ConvNd):
            shapes[name] = {"type": type(module).__name__, "in_channels": module.in_channels,
                            "out_channels": module.out_channels, "groups": module.groups}  # fmt: skip
        elif isinstance(module, nn.Linear):
            shapes[name] = {"type": "Linear", "in_features": module.in_features, "out_features": module.out_features}
        elif isinstance(module, nn.modules.batchnorm._NormBase):
            shapes[name] = {"type": type(module).__name__, "num_features": module.num_features}
        elif isinstance(module, nn.GroupNorm):
            shapes[name] = {"type": "GroupNorm", "num_channels": module.num_channels, "num_groups": module.num_groups}
        elif isinstance(module, nn.LayerNorm):
            shapes[name] = {"type": "LayerNorm", "normalized_shape": list(module.normalized_shape)}
        elif isinstance(module, nn.PReLU):
            shapes[name] = {"type": "PReLU", "num_parameters": module.num_parameters}
    return shapes


def export_pruned(
    pruned: nn.Module, dense: nn.Module, export_dir: str | Path, extra: Mapping[str, Any] | None = None
) -> dict[str, Path]:
    """Write the three files of ``pruned`` to ``export_dir`` (all replaced at once: an error leaves the old ones);
    the JSON lists the layers whose shape differs from ``dense`` and carries ``extra`` (e.g. the plan). Returns the
    paths by kind."""
    with StagedFiles(export_dir) as staged:
        for name, data in pruned_files(pruned, dense, extra).items():
            staged.write_bytes(name, data)
        placed = staged.commit()
    return {kind: placed[name] for kind, name in FILE_KINDS.items()}


FILE_KINDS = {"model": MODEL_FILE, "state_dict": STATE_DICT_FILE, "channels": CHANNELS_FILE}
"""The files :func:`pruned_files` makes, by kind (as a plan's record lists them)."""


def pruned_files(pruned: nn.Module, dense: nn.Module, extra: Mapping[str, Any] | None = None) -> dict[str, bytes]:
    """The content of the three files of ``pruned``, by file name: the pickled module, its state dict, and the JSON
    listing the layers whose shape differs from ``dense``, with ``extra`` (e.g. the plan) in it."""
    before, after = layer_shapes(dense), layer_shapes(pruned)
    changed = {name: shape for name, shape in after.items() if before.get(name) != shape}
    description: dict[str, Any] = {"format": FORMAT_VERSION, "changed_layers": changed}
    parameters = bare_parameter_shapes(pruned, dense, after)
    if parameters:
        description["changed_parameters"] = parameters
    description.update(extra or {})
    how_to_load = loading_note(pruned)
    if how_to_load is not None:
        description["loading"] = how_to_load
        logger.warning("%s: %s", MODEL_FILE, how_to_load)
    return {
        MODEL_FILE: saved_bytes(pruned),
        STATE_DICT_FILE: saved_bytes(pruned.state_dict()),
        CHANNELS_FILE: (json.dumps(description, indent=1) + "\n").encode("utf-8"),
    }


def bare_parameter_shapes(pruned: nn.Module, dense: nn.Module, layers: Mapping[str, Any]) -> dict[str, list[int]]:
    """The shapes of the parameters outside the ``layers`` :func:`layer_shapes` lists whose shape the pruning changed
    (a ViT's class token and position embedding on its residual stream), by parameter name."""
    before = dict(dense.named_parameters())
    return {
        name: list(param.shape)
        for name, param in pruned.named_parameters()
        if name.rpartition(".")[0] not in layers and name in before and before[name].shape != param.shape
    }


def loading_note(model: nn.Module) -> str | None:
    """How to load the pickled ``model`` in a new process when its classes come from a model file no dotted name
    reaches (imported under a private name, see :func:`~analysis.inputs.models.model_module_name`); None otherwise."""
    files = sorted({
        str(getattr(sys.modules.get(type(module).__module__), "__file__", type(module).__module__))
        for module in model.modules()
        if type(module).__module__.startswith(PRIVATE_MODULE_PREFIX)
    })  # fmt: skip
    if not files:
        return None
    imports = "; ".join(f"import_model_file({path!r})" for path in files)
    return (
        f"its classes come from {', '.join(files)}, outside the folders Python imports from, so torch.load needs "
        f"them imported first: from analysis.inputs.models import import_model_file; {imports}; or rebuild the "
        f"model without unpickling with analysis.planning.export.load_pruned(dense_model, export_dir)"
    )


def saved_bytes(obj: Any) -> bytes:
    """What ``torch.save(obj, file)`` writes, in memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def shrink_to(model: nn.Module, changed_layers: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Replace the layers of a dense ``model`` (in place) by empty layers of the sizes in ``changed_layers``.

    Raises:
        ModelError: If a listed layer is missing or of another type (the JSON belongs to another model).
    """
    for name, shape in changed_layers.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ModelError(f"{CHANNELS_FILE} lists layer '{name}', which this model does not have.") from None
        if type(old).__name__ != shape.get("type") and not _replaced_attention(old, shape):
            raise ModelError(f"{CHANNELS_FILE}: layer '{name}' is a {shape.get('type')} there, a "
                             f"{type(old).__name__} in this model; build the model the plan was made for.")  # fmt: skip
        new = _resized(old, shape)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def _replaced_attention(old: nn.Module, shape: Mapping[str, Any]) -> bool:
    """A MultiheadAttention whose heads were removed is a :class:`PrunedMultiheadAttention` in the export."""
    return isinstance(old, nn.MultiheadAttention) and shape.get("type") == "PrunedMultiheadAttention"


def _resized(old: nn.Module, shape: Mapping[str, Any]) -> nn.Module:
    device = model_device(old)
    if shape.get("type") == "PrunedMultiheadAttention":  # heads or stream channels removed (a new module)
        sizes = {k: shape[k] for k in ("embed_dim", "num_heads", "head_dim", "bias", "batch_first", "dropout")}
        return PrunedMultiheadAttention(**sizes).to(device)
    custom = customized_pruners().get(type(old))
    if custom is not None:  # its own pruner shrinks it (the state dict then brings the values)
        custom.remove(old, list(range(shape["channels"], custom.channels(old))))
        return old
    if is_attention(old):
        return with_heads(old, shape["num_heads"])  # its qkv/proj layers are listed and resized on their own
    if isinstance(old, nn.modules.conv._ConvNd):
        kwargs = {"stride": old.stride, "padding": old.padding, "dilation": old.dilation, "groups": shape["groups"],
                  "bias": old.bias is not None, "padding_mode": old.padding_mode}  # fmt: skip
        if old.transposed:
            kwargs["output_padding"] = old.output_padding
        return type(old)(shape["in_channels"], shape["out_channels"], old.kernel_size, **kwargs).to(device)
    if isinstance(old, nn.Linear):
        return nn.Linear(shape["in_features"], shape["out_features"], bias=old.bias is not None).to(device)
    if isinstance(old, nn.modules.batchnorm._NormBase):
        return type(old)(shape["num_features"], eps=old.eps, momentum=old.momentum, affine=old.affine,
                         track_running_stats=old.track_running_stats).to(device)  # fmt: skip
    if isinstance(old, nn.GroupNorm):
        return nn.GroupNorm(shape["num_groups"], shape["num_channels"], eps=old.eps, affine=old.affine).to(device)
    if isinstance(old, nn.LayerNorm):
        return nn.LayerNorm(shape["normalized_shape"], eps=old.eps, elementwise_affine=old.elementwise_affine,
                            bias=old.bias is not None).to(device)  # fmt: skip
    if isinstance(old, nn.PReLU):
        return nn.PReLU(shape["num_parameters"]).to(device)
    raise ModelError(f"cannot resize a {type(old).__name__}")


def load_pruned(dense: nn.Module, export_dir: str | Path) -> nn.Module:
    """Rebuild the exported pruned model from a freshly built dense ``dense`` (same architecture), the JSON and the
    state_dict, without unpickling code; returns ``dense`` shrunk, with the pruned weights, in eval mode.

    Raises:
        ModelError: If the files are missing or do not match ``dense``.
    """
    directory = Path(export_dir)
    try:
        description = json.loads((directory / CHANNELS_FILE).read_text())
        state = torch.load(directory / STATE_DICT_FILE, map_location="cpu", weights_only=True)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot read the exported pruned model in {directory}: {error}") from None
    model = shrink_to(dense, description.get("changed_layers") or {})
    for name, shape in (description.get("changed_parameters") or {}).items():
        owner_name, _, attr = name.rpartition(".")
        try:
            old = model.get_parameter(name)
        except AttributeError:
            raise ModelError(f"{CHANNELS_FILE} lists parameter '{name}', which this model does not have.") from None
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, nn.Parameter(old.data.new_empty(shape), requires_grad=old.requires_grad))
    sync_stored_widths(model)
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if len(str(error).splitlines()) > 1 else str(error)
        raise ModelError(f"{STATE_DICT_FILE} does not fit the rebuilt model ({first}).") from None
    return model.eval()

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
from collections.abc import Iterable, Mapping, Sequence
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
from analysis.structure.custom_layers import ChannelPruner, customized_pruners
from analysis.structure.cuts import sizes_attribute
from analysis.structure.heads import PrunedMultiheadAttention, is_attention, with_heads

FORMAT_VERSION = 1

logger = logging.getLogger(__name__)


def layer_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The size-defining attributes of every conv, linear and norm layer and every customised layer (see
    :mod:`analysis.structure.custom_layers`), by module name."""
    shapes: dict[str, dict[str, Any]] = {}
    custom = customized_pruners()
    for name, module in model.named_modules():
        kind = type(module).__name__  # a subclass by its own name: loading resizes the layer as it is built
        if isinstance(module, PrunedMultiheadAttention):  # attention modules before their customised pruners
            shapes[name] = {"type": "PrunedMultiheadAttention", **module.sizes()}
        elif is_attention(module):
            shapes[name] = {"type": kind, "num_heads": module.num_heads}
        elif isinstance(pruner := custom.get(type(module)), ChannelPruner):  # a fixed-width layer keeps its width
            shapes[name] = {"type": kind, "channels": pruner.channels(module)}
        elif isinstance(module, nn.modules.conv._ConvNd):
            shapes[name] = {"type": kind, "in_channels": module.in_channels,
                            "out_channels": module.out_channels, "groups": module.groups}  # fmt: skip
        elif isinstance(module, nn.Linear):
            shapes[name] = {"type": kind, "in_features": module.in_features, "out_features": module.out_features}
        elif isinstance(module, nn.modules.batchnorm._NormBase):
            shapes[name] = {"type": kind, "num_features": module.num_features}
        elif isinstance(module, nn.GroupNorm):
            shapes[name] = {"type": kind, "num_channels": module.num_channels, "num_groups": module.num_groups}
        elif isinstance(module, nn.LayerNorm):
            shapes[name] = {"type": kind, "normalized_shape": list(module.normalized_shape)}
        elif isinstance(module, nn.PReLU):
            shapes[name] = {"type": kind, "num_parameters": module.num_parameters}
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
    sizes = stored_cut_sizes(pruned, dense)
    if sizes:
        description["changed_sizes"] = sizes
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


def stored_cut_sizes(pruned: nn.Module, dense: nn.Module) -> dict[str, dict[str, Any]]:
    """The sizes modules store to cut their channels with (:data:`analysis.structure.cuts.STORED_SIZES`: timm's
    ReXNet ``in_channels``, MixNet ``splits``, ...) where the pruning changed them, by module name: a fresh dense
    model would cut the narrower tensors at its own sizes."""
    before = dict(dense.named_modules())
    changed: dict[str, dict[str, Any]] = {}
    for name, module in pruned.named_modules():
        attribute = sizes_attribute(module)
        if attribute is not None and name in before and getattr(module, attribute) != getattr(before[name], attribute):
            changed[name] = {attribute: getattr(module, attribute)}
    return changed


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
        if not _same_type(old, shape) and not _replaced_attention(old, shape):
            raise ModelError(f"{CHANNELS_FILE}: layer '{name}' is a {shape.get('type')} there, a "
                             f"{type(old).__name__} in this model; build the model the plan was made for.")  # fmt: skip
        new = _resized(old, shape)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def _same_type(old: nn.Module, shape: Mapping[str, Any]) -> bool:
    """``old`` is of the type the export records, or of a subclass of it (exports written before layer subclasses
    were recorded by their own name list timm's ``LayerNorm2d`` as a ``LayerNorm``)."""
    return shape.get("type") in {kind.__name__ for kind in type(old).__mro__ if issubclass(kind, nn.Module)}


def _replaced_attention(old: nn.Module, shape: Mapping[str, Any]) -> bool:
    """A MultiheadAttention whose heads were removed is a :class:`PrunedMultiheadAttention` in the export."""
    return isinstance(old, nn.MultiheadAttention) and shape.get("type") == "PrunedMultiheadAttention"


def _resized(old: nn.Module, shape: Mapping[str, Any]) -> nn.Module:
    """``old`` at the sizes of ``shape`` (empty tensors; the state dict brings the values). Conv, linear and norm
    layers are resized in place rather than built anew: a subclass keeps what its own constructor set (timm's
    ``BatchNormAct2d`` its activation, ``Conv2dSame`` its padding, ``LayerNorm2d`` its layout), which a new layer of
    the same type, built from the base class's arguments, would lose or fail on."""
    device = model_device(old)
    if shape.get("type") == "PrunedMultiheadAttention":  # heads or stream channels removed (a new module)
        sizes = {k: shape[k] for k in ("embed_dim", "num_heads", "head_dim", "bias", "batch_first", "dropout")}
        return PrunedMultiheadAttention(**sizes).to(device)
    custom = customized_pruners().get(type(old))
    if isinstance(custom, ChannelPruner):  # its own pruner shrinks it (the state dict then brings the values)
        custom.remove(old, list(range(shape["channels"], custom.channels(old))))
        return old
    if is_attention(old):
        return with_heads(old, shape["num_heads"])  # its qkv/proj layers are listed and resized on their own
    if isinstance(old, nn.modules.conv._ConvNd):
        old.in_channels, old.out_channels, old.groups = shape["in_channels"], shape["out_channels"], shape["groups"]
        per_group = (old.out_channels if old.transposed else old.in_channels) // old.groups
        rows = old.in_channels if old.transposed else old.out_channels
        return _with_empty(old, weight=(rows, per_group, *old.kernel_size), bias=(old.out_channels,))
    if isinstance(old, nn.Linear):
        old.in_features, old.out_features = shape["in_features"], shape["out_features"]
        return _with_empty(old, weight=(old.out_features, old.in_features), bias=(old.out_features,))
    if isinstance(old, nn.modules.batchnorm._NormBase):
        old.num_features = width = shape["num_features"]
        return _with_empty(old, weight=(width,), bias=(width,), running_mean=(width,), running_var=(width,))
    if isinstance(old, nn.GroupNorm):
        old.num_groups, old.num_channels = shape["num_groups"], shape["num_channels"]
        return _with_empty(old, weight=(old.num_channels,), bias=(old.num_channels,))
    if isinstance(old, nn.LayerNorm):
        old.normalized_shape = tuple(shape["normalized_shape"])
        return _with_empty(old, weight=old.normalized_shape, bias=old.normalized_shape)
    if isinstance(old, nn.PReLU):
        old.num_parameters = shape["num_parameters"]
        return _with_empty(old, weight=(old.num_parameters,))
    raise ModelError(f"cannot resize a {type(old).__name__}")


def _listed(model: nn.Module, name: str) -> nn.Module:
    """``model``'s module ``name``, which the export lists (an error naming it when this model has none)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ModelError(f"{CHANNELS_FILE} lists layer '{name}', which this model does not have.") from None


def _with_empty(module: nn.Module, **shapes: tuple[int, ...]) -> nn.Module:
    """``module`` with each of its tensors named in ``shapes`` (those it has) replaced by an empty one of that shape,
    of the same kind (parameter or buffer), dtype and device."""
    for name, size in shapes.items():
        old = getattr(module, name, None)
        if isinstance(old, torch.Tensor):
            setattr(module, name, _empty_like(old, size))
    return module


def _empty_like(old: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    new = old.data.new_empty(tuple(size))
    return nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new


def _fit_extras(model: nn.Module, layers: Iterable[str], state: Mapping[str, torch.Tensor]) -> None:
    """Give every other tensor of the resized ``layers`` the shape it has in ``state``: per-channel tensors a layer
    subclass holds besides its standard ones (timm's ``ScaledStdConv2d.gain``), which removal sliced too."""
    for layer in layers:
        module = model.get_submodule(layer)
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            saved = state.get(f"{layer}.{name}" if layer else name)
            if saved is not None and saved.shape != tensor.shape and saved.dim() == tensor.dim():
                setattr(module, name, _empty_like(tensor, saved.shape))


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
    changed = description.get("changed_layers") or {}
    model = shrink_to(dense, changed)
    _fit_extras(model, changed, state)
    for name, shape in (description.get("changed_parameters") or {}).items():
        owner_name, _, attr = name.rpartition(".")
        try:
            old = model.get_parameter(name)
        except AttributeError:
            raise ModelError(f"{CHANNELS_FILE} lists parameter '{name}', which this model does not have.") from None
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, nn.Parameter(old.data.new_empty(shape), requires_grad=old.requires_grad))
    for name, sizes in (description.get("changed_sizes") or {}).items():
        module = _listed(model, name)
        for attribute, value in sizes.items():
            if sizes_attribute(module) != attribute:
                kind = type(module).__name__
                raise ModelError(f"{CHANNELS_FILE} lists cut sizes '{attribute}' of '{name}', which this model's "
                                 f"{kind} does not cut with; build the model the plan was made for.")  # fmt: skip
            setattr(module, attribute, value)
    sync_stored_widths(model)
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if len(str(error).splitlines()) > 1 else str(error)
        raise ModelError(f"{STATE_DICT_FILE} does not fit the rebuilt model ({first}).") from None
    return model.eval()

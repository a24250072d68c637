"""Build the model to analyse from the ``Global`` block.

Ways to describe a model, in order of preference:

1. ``arch`` = a torchvision model name (``resnet50``), built with ``torchvision.models.get_model`` and
   ``arch_kwargs``; weights from ``model_dir/params_filename`` (or ``model_filename``), or ``weights`` = a
   torchvision weights name (downloads; never used in tests).
2. ``arch`` = ``package.module:callable`` or ``path/to/file.py:callable``, called with ``arch_kwargs``: a model
   class or a function annotated to return one, unless ``trust_arch`` (:mod:`analysis.trust`).
3. No ``arch``: ``model_filename`` is a whole pickled ``nn.Module``. Unpickling can run arbitrary code, so it is
   loaded only with ``trust_model_file: true`` (from the command line, :mod:`analysis.trust`).

Checkpoints are read with ``torch.load(weights_only=True)``. TorchScript archives are refused: their graph is
frozen, so channels cannot be removed from them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import keyword
import logging
import pickle
import sys
import traceback
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torchvision
from torch import nn

from analysis.config import GlobalConfig
from analysis.errors import ModelError, UserCodeError, did_you_mean, first_line
from analysis.inputs.timm_models import create_timm_model, hub_weights, is_timm_arch, read_safetensors
from analysis.io.sidecar import RANDOM_WEIGHTS
from analysis.trust import arch_refusal, arch_target_problem, check_model_factory, is_model_file

logger = logging.getLogger(__name__)

STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model")
KEY_PREFIXES = ("module.", "_orig_mod.")
EXPORT_HINT = "export the weights with torch.save(model.state_dict(), path) and set Global.arch"


def build_model(cfg: GlobalConfig) -> nn.Module:
    """Build the model described by ``cfg``, load its weights, and return it in eval mode on the CPU."""
    checkpoint = resolve_checkpoint_path(cfg)
    if cfg.arch:
        model = create_architecture(cfg.arch, cfg.arch_kwargs, cfg.weights, trusted=cfg.trust_arch)
        if checkpoint is not None:
            load_weights(model, checkpoint, cfg.arch)
    elif checkpoint is None:
        raise ModelError("Global has no model: set Global.arch, or Global.model_dir and Global.model_filename.")
    else:
        model = load_pickled_module(checkpoint, cfg.trust_model_file)
    return model.eval()


def random_weights_warning(cfg: GlobalConfig) -> str | None:
    """The warning for a model built from ``Global.arch`` with no weights (no checkpoint, no ``Global.weights``),
    None when weights are given. Losses of an untrained network say nothing about the trained one, so this must never
    go unnoticed. A ``module:callable`` may load weights itself, which the warning allows for."""
    if not cfg.arch or cfg.weights or resolve_checkpoint_path(cfg) is not None:
        return None
    fix = "set Global.model_dir + params_filename (a state_dict) or Global.weights"
    if ":" in cfg.arch:
        return f"Global.arch {cfg.arch} gets no weights: unless it loads them itself, {RANDOM_WEIGHTS}; {fix}."
    return f"Global.arch {cfg.arch} gets no weights, so it has {RANDOM_WEIGHTS}; {fix}."


def resolve_checkpoint_path(cfg: GlobalConfig) -> Path | None:
    """Return the checkpoint file named by ``model_dir`` + ``params_filename``/``model_filename``, if any.

    With ``arch`` set, ``params_filename`` holds the weights (ACT's meaning) and ``model_filename`` is used only
    when ``params_filename`` is absent. ``model_dir`` alone may name the file itself.

    Raises:
        ModelError: If the named file does not exist.
    """
    order = ("params_filename", "model_filename") if cfg.arch else ("model_filename", "params_filename")
    key = next((k for k in order if getattr(cfg, k)), None)
    if cfg.arch and cfg.params_filename and cfg.model_filename:
        logger.warning("Global.model_filename is ignored: Global.arch and Global.params_filename define the model.")
    if key is not None:
        filename = getattr(cfg, key)
        path = Path(cfg.model_dir) / filename if cfg.model_dir else Path(filename)
    elif cfg.model_dir is not None:
        path, key = Path(cfg.model_dir), "model_dir"
        hub_file = hub_weights(path) if is_timm_arch(cfg.arch) and path.is_dir() else None
        if hub_file is not None:
            return hub_file
        if path.is_dir():
            raise ModelError(
                f"Global.model_dir {path} is a folder but no file in it is named; set Global.params_filename "
                "(weights for Global.arch) or Global.model_filename."
            )
    else:
        return None
    if not path.is_file():
        raise ModelError(f"Checkpoint {path} does not exist; check Global.model_dir and Global.{key}.")
    return path


def create_architecture(
    arch: str, kwargs: Mapping[str, Any], weights: str | None = None, *, trusted: bool = False
) -> nn.Module:
    """Instantiate ``arch`` (torchvision name, ``timm/<name>`` or ``module:callable``) with ``kwargs``.

    Args:
        arch: The model's name or ``module:callable``.
        kwargs: Keyword arguments of the model's constructor or function.
        weights: A torchvision weights name.
        trusted: Call any callable ``arch`` names (``Global.trust_arch``); else only a model class or a function
            annotated to return one, outside the standard library (:mod:`analysis.trust`), checked before it runs.

    Raises:
        ModelError: If the name is unknown or refused, the callable cannot be imported, or it does not return a
            module.
    """
    if is_timm_arch(arch):
        if weights:
            raise ModelError(
                f"Global.weights only applies to torchvision model names; for {arch} put the weights in "
                "Global.model_dir (a state_dict file or a hub folder with model.safetensors)."
            )
        return create_timm_model(arch, kwargs)
    if ":" in arch:
        if weights:
            raise ModelError("Global.weights only applies to torchvision model names, not to module:callable archs.")
        factory = _import_callable(arch, trusted)
        label = arch
    else:
        names = torchvision.models.list_models()
        if arch not in names:
            raise ModelError(
                f"Global.arch '{arch}' is not a torchvision model{did_you_mean(arch, names)}; use a name from "
                "torchvision.models.list_models() or 'package.module:callable' / 'path/to/file.py:callable'."
            )
        factory = _torchvision_factory(arch, weights)
        label = f"torchvision {arch}"
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        raise ModelError(f"Global.arch_kwargs do not fit {label}: {error}.") from None
    except ValueError:
        pass  # builtins without a signature: let the call itself decide
    try:
        model = factory(**kwargs)
    except TypeError as error:
        binding = error.__traceback__ is not None and error.__traceback__.tb_next is None  # raised at our call
        if binding or ":" not in arch:  # torchvision passes arch_kwargs on to the model class
            raise ModelError(f"Global.arch_kwargs do not fit {label}: {error}.") from None
        raise _user_code_error(f"Global.arch {label} raised", error) from None
    except Exception as error:
        if ":" not in arch:
            raise
        raise _user_code_error(f"Global.arch {label} raised", error) from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"Global.arch {arch} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def _torchvision_factory(arch: str, weights: str | None) -> Callable[..., nn.Module]:
    if weights is None:
        return lambda **kwargs: torchvision.models.get_model(arch, weights=None, **kwargs)
    try:
        resolved = torchvision.models.get_weight(weights) if "." in weights else weights
    except (ValueError, KeyError, AttributeError) as error:
        raise ModelError(f"Global.weights '{weights}' is not a torchvision weights name ({error}).") from None
    logger.info("Using torchvision weights %s (downloaded to the torch hub cache if missing).", weights)
    return lambda **kwargs: torchvision.models.get_model(arch, weights=resolved, **kwargs)


def _import_callable(spec: str, trusted: bool) -> Callable[..., Any]:
    """Resolve ``package.module:attr`` or ``path/to/file.py:attr`` to the object it names; unless ``trusted``, only
    what :mod:`analysis.trust` allows is imported and returned."""
    target, _, attr_path = spec.rpartition(":")
    if not target or not attr_path:
        raise ModelError(f"Global.arch '{spec}' must look like 'package.module:callable' or 'file.py:callable'.")
    problem = None if trusted else arch_target_problem(spec)
    if problem is not None:
        raise ModelError(arch_refusal(spec, problem))
    if is_model_file(target):
        module = _import_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ModelError(f"Global.arch: cannot import module '{target}' ({error}).") from None
    obj: object = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = [name for name in dir(obj) if not name.startswith("_")]
            raise ModelError(f"Global.arch: '{target}' has no attribute '{part}'{did_you_mean(part, public)}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"Global.arch: '{spec}' is not callable.")
    return obj if trusted else check_model_factory(obj, spec)


PRIVATE_MODULE_PREFIX = "_arch_"
"""Model files that no dotted name reaches are imported under ``_arch_<stem>_<hash of the path>``."""


def import_model_file(path: str | Path) -> ModuleType:
    """Import a model file (``arch: path/to/net.py:callable``) under the name this tool gives it.

    A pickled model (``pruned_model.pt``) refers to its classes by that name: call this before ``torch.load`` in a
    new process when the file lies outside the folder the process starts in (see :func:`model_module_name`).

    Raises:
        ModelError: The file does not exist or cannot be imported.
        UserCodeError: Importing it raised.
    """
    return _import_file(Path(path))


def model_module_name(resolved: Path) -> str:
    """The module name of a model file: its dotted path from the first ``sys.path`` entry that holds it when every
    part is an identifier, else a private name.

    ``python run.py`` puts the project root on ``sys.path``, so a model file inside it gets the name a new process
    started there (``python -c``, a script in the root) imports it by, and a pickled model of it loads there. A dotted
    name already taken by another file falls back to the private name, so two files never share one.
    """
    for root in (Path(entry or ".").resolve() for entry in sys.path):
        try:
            parts = resolved.with_suffix("").relative_to(root).parts
        except ValueError:
            continue
        if parts and all(part.isidentifier() and not keyword.iskeyword(part) for part in parts):
            name = ".".join(parts)
            taken = sys.modules.get(name)
            if taken is None or _module_file(taken) == resolved:
                return name
    return f"{PRIVATE_MODULE_PREFIX}{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"


def _module_file(module: ModuleType) -> Path | None:
    location = getattr(module, "__file__", None)
    return Path(location).resolve() if location else None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ModelError(f"Global.arch: model file {path} does not exist (relative paths start at the current folder).")
    resolved = path.resolve()
    # One name per file: the same file imported twice is one module, and its classes stay picklable.
    name = model_module_name(resolved)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ModelError(f"Global.arch: {path} cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise _user_code_error(f"Global.arch: importing {path} raised", error) from None
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _user_code_error(what: str, error: Exception) -> UserCodeError:
    """A one-sentence error for an exception raised by the user's model code, keeping their traceback (without
    this module's frame) for the CLI to show."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # the first frame is our call into their code
    shown = "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                     *traceback.format_exception_only(type(error), error)])  # fmt: skip
    return UserCodeError(f"{what} {type(error).__name__}: {first_line(error)} (traceback above); fix the model code.",
                         shown)  # fmt: skip


def read_checkpoint(path: Path) -> Any:
    """Load a checkpoint with ``weights_only=True``, refusing TorchScript and full pickled modules.

    Raises:
        ModelError: If the file is TorchScript, needs full unpickling, or is not a PyTorch checkpoint at all.
    """
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    _refuse_torchscript(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise ModelError(
                f"{path} contains pickled Python objects (e.g. a whole nn.Module), which can run arbitrary code "
                f"when loaded; {EXPORT_HINT}, or pass Global.trust_model_file=true on the command line if you trust "
                "this file."
            ) from None
        raise ModelError(f"{path} is not a readable PyTorch checkpoint ({_error_text(error)}).") from None
    except Exception as error:  # any unpickling failure here comes from the file's content, not from our code
        raise ModelError(f"{path} is not a readable PyTorch checkpoint ({_error_text(error)}).") from None


def _refuse_torchscript(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as archive:
        if any(name == "constants.pkl" or name.endswith("/constants.pkl") for name in archive.namelist()):
            raise ModelError(
                f"{path} is a TorchScript archive, whose frozen graph cannot be pruned; provide the Python model "
                f"instead: {EXPORT_HINT} (or Global.model_filename with a pickled nn.Module)."
            )


def extract_state_dict(checkpoint: Any, path: Path) -> dict[str, torch.Tensor]:
    """Unwrap common checkpoint wrappers and strip ``module.``/``_orig_mod.`` prefixes."""
    state = checkpoint
    while isinstance(state, Mapping) and not _is_state_dict(state):
        inner = next((state[k] for k in STATE_DICT_WRAPPERS if k in state), None)
        if inner is None:
            keys = ", ".join(map(str, list(state)[:5]))
            raise ModelError(
                f"{path} holds a dict without tensors or a state_dict/model/model_state_dict entry (keys: {keys})."
            )
        state = inner
    if isinstance(state, nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise ModelError(f"{path} holds a {type(state).__name__}, not a state_dict.")
    cleaned = {}
    for key, value in state.items():
        for prefix in KEY_PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        cleaned[key] = value
    return cleaned


def _is_state_dict(mapping: Mapping[Any, Any]) -> bool:
    return bool(mapping) and all(isinstance(v, torch.Tensor) for v in mapping.values())


def load_weights(model: nn.Module, path: Path, arch: str) -> None:
    """Load the state_dict in ``path`` into ``model``; any key or shape mismatch is an error listing examples.

    Only BatchNorm's ``num_batches_tracked`` counters may be absent (old checkpoints lack them; eval ignores them).
    """
    state = extract_state_dict(read_checkpoint(path), path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    reshaped = [
        f"{k} {list(v.shape)} vs {list(expected[k].shape)}"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({_preview(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected ({_preview(unexpected)})")
    if reshaped:
        problems.append(f"{len(reshaped)} with another shape ({_preview(reshaped)})")
    if problems:
        raise ModelError(
            f"Checkpoint {path} does not match Global.arch {arch}: keys "
            + "; ".join(problems)
            + "; check Global.arch and Global.arch_kwargs (e.g. num_classes)."
        )
    model.load_state_dict(state, strict=False)


def _preview(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (", ..." if len(items) > limit else "")


def load_pickled_module(path: Path, trusted: bool) -> nn.Module:
    """Load a whole pickled ``nn.Module`` (only when the user trusts the file)."""
    if not trusted:
        checkpoint = read_checkpoint(path)  # refuses modules and TorchScript with a clear message
        kind = "a state_dict" if isinstance(checkpoint, Mapping) else f"a {type(checkpoint).__name__}"
        raise ModelError(f"{path} holds {kind}, not a model; set Global.arch to the architecture it belongs to.")
    _refuse_torchscript(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except (ModuleNotFoundError, AttributeError) as error:
        raise ModelError(
            f"{path} needs the Python class it was saved from ({error}); make its package importable "
            "(e.g. PYTHONPATH) or export a state_dict and set Global.arch."
        ) from None
    except Exception as error:  # the file's content is at fault, see read_checkpoint
        raise ModelError(f"{path} is not a readable PyTorch file ({_error_text(error)}).") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), nn.Module):
        obj = obj["model"]
    if not isinstance(obj, nn.Module):
        raise ModelError(
            f"{path} holds a {type(obj).__name__}, not an nn.Module; set Global.arch to build the model and "
            "Global.params_filename to load these weights."
        )
    return obj


def _error_text(error: BaseException) -> str:
    """``Type: first line`` of ``error``, quoted in a one-line message."""
    return f"{type(error).__name__}: {first_line(error)}"


def count_outputs(model: nn.Module, img_size: int, device: torch.device) -> int:
    """Run one dummy image through the model and return the number of logits (classes) it produces.

    Raises:
        ModelError: If the model cannot run on a (1, 3, img_size, img_size) input or returns no 2-D logits.
    """
    dummy = torch.zeros(1, 3, img_size, img_size, device=device)
    try:
        with torch.inference_mode():
            output = model(dummy)
    except RuntimeError as error:
        raise ModelError(
            f"The model cannot run on a 3x{img_size}x{img_size} image ({first_line(error)}); "
            "check Global.img_size and the architecture."
        ) from None
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        kind = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ModelError(f"The model must return (batch, classes) logits, got {kind}.")
    return int(output.shape[1])

"""What a config file may make the tool run, and the opt-ins for the rest (docs/security.md has the threat model).

A config file is data: configs are shared and downloaded, and the docs invite running them as they are. Three settings
make the tool run code of someone's choosing, so none of them is honoured from a file alone:

- ``SensitivityAnalysis.runtime_command``: a command line, run to time the model;
- ``Global.trust_model_file``: unpickling a whole model, which can run any code the pickle names;
- ``Global.trust_arch``: calling whatever ``Global.arch`` names, not only a model.

Each counts when the command line gives it (a flag or a dotted override) or the caller's Python code does
(``load_config(..., overrides=[...])``), or when the user vouches for the whole file with ``--trust_config``
(``trust_config=True``); from a file alone (a config, or the config an analysis file's sidecar recorded) it is
refused before any work, naming the key.

Without ``trust_arch``, a ``module:callable`` or ``file.py:callable`` in ``Global.arch`` must name a model: a
``torch.nn.Module`` subclass, or a function whose return annotation is one. Modules of the standard library, the
builtins and ``__main__`` are refused before anything is imported (importing some of them acts, e.g.
``antigravity``), as are model files inside the Python installation (stdlib and site-packages: name installed code by
its dotted name, so the same rule applies) and dunder attributes. The rule is PyTorch's ``weights_only`` and Hugging
Face's ``trust_remote_code`` applied to a config: loading is safe by default, and running code is the user's explicit
choice where they run the tool, never the file's.
"""

from __future__ import annotations

import inspect
import site
import sys
import sysconfig
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.errors import ConfigError, ModelError, printable

TRUST_FLAG = "--trust_config"
"""The command-line flag that lets a config file run what it names."""


@dataclass(frozen=True)
class CodeSetting:
    """A setting that makes the tool run code, and how to give it where it counts."""

    key: str  # "Section.key"
    does: str  # what it makes the tool do, for the refusal
    command_line: str  # how to give it on the command line

    def active(self, value: Any) -> bool:
        """Whether ``value`` turns the setting on (a command template, or true)."""
        return value is True or (isinstance(value, str) and bool(value.strip()))


CODE_SETTINGS = (
    CodeSetting(
        "SensitivityAnalysis.runtime_command",
        "runs a command",
        "run.py plan --runtime_command '...', or SensitivityAnalysis.runtime_command='...'",
    ),
    CodeSetting(
        "Global.trust_model_file",
        "unpickles a whole model, which can run any code the file names",
        "Global.trust_model_file=true",
    ),
    CodeSetting(
        "Global.trust_arch",
        "lets Global.arch call any callable, not only a model",
        "Global.trust_arch=true",
    ),
)


def check_file_settings(values: Mapping[str, Any], command_line: Collection[str], source: str, trusted: bool) -> None:
    """Refuse a :data:`CODE_SETTINGS` setting that only a file turns on.

    Args:
        values: The resolved value of each code setting's key.
        command_line: The ``Section.key`` names a flag or an override gave (their values are the user's own).
        source: The file the other values came from, for the message.
        trusted: ``--trust_config`` was given: the file's settings count as the user's.

    Raises:
        ConfigError: Naming the first such key, the file, and both ways to give it.
    """
    if trusted:
        return
    for setting in CODE_SETTINGS:
        if setting.key in command_line or not setting.active(values.get(setting.key)):
            continue
        raise ConfigError(
            f"{setting.key} in {source} {setting.does}, which a config file cannot ask for on its own; give it on the "
            f"command line ({setting.command_line}), or add {TRUST_FLAG} if you trust this file."
        )


# ---- Global.arch ---------------------------------------------------------------------------------------------------

REFUSED_MODULES = frozenset({*sys.stdlib_module_names, *sys.builtin_module_names, "__main__"})
"""Top-level modules ``Global.arch`` may not name without ``trust_arch``: the standard library and the builtins hold
no models, and hold ``os.system``, ``eval``, ``subprocess.run`` and modules that act when imported."""


def arch_target_problem(spec: str) -> str | None:
    """Why ``spec`` (``package.module:callable`` or ``file.py:callable``) may not be imported without
    ``trust_arch``, judged on its text alone before anything is imported; None when it may."""
    target, _, attribute = spec.rpartition(":")
    if any(part.startswith("__") for part in attribute.split(".")):
        return f"'{attribute}' is a dunder attribute, not a model"
    if is_model_file(target):
        path = Path(target).expanduser()
        if path.suffix != ".py":
            return f"{target} is not a .py file"
        folder = installation_folder(path)
        if folder is not None:
            return f"{target} lies in the Python installation ({folder}); name installed code by its dotted name"
        return None
    parts = target.split(".")
    if parts[0] in REFUSED_MODULES or "__main__" in parts:
        return f"'{target}' is part of Python's standard library or builtins, which hold no models"
    return None


def arch_refusal(spec: str, problem: str) -> str:
    """The sentence refusing ``Global.arch`` ``spec`` for ``problem`` (:func:`arch_target_problem`)."""
    return (
        f"Global.arch '{printable(spec)}' is refused: {printable(problem)}; a config may only name a model (a "
        "torch.nn.Module subclass or a function annotated to return one). Pass Global.trust_arch=true on the command "
        "line if you trust this config."
    )


def is_model_file(target: str) -> bool:
    """Whether the part of ``Global.arch`` before the colon names a file rather than a dotted module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def installation_folder(path: Path) -> Path | None:
    """The folder of the Python installation (stdlib, site-packages) that holds ``path``, if one does."""
    resolved = path.resolve()
    for folder in python_folders():
        if resolved.is_relative_to(folder):
            return folder
    return None


def python_folders() -> list[Path]:
    """The folders of the running Python's own code: its standard library and its site-packages (a virtual
    environment's and the base installation's)."""
    folders: set[str] = set()
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars)
        folders.update(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths)
    folders.update(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user_site, str):
        folders.add(user_site)
    return [Path(folder).resolve() for folder in sorted(folders) if folder]


def check_model_factory(factory: object, spec: str) -> Callable[..., Any]:
    """``factory`` when it builds a model: a ``torch.nn.Module`` subclass, or a function (or a class's static or
    class method) whose return annotation is one; checked before it is called.

    Raises:
        ModelError: For anything else (a builtin, a function returning something else or not saying what it returns,
            a callable object), naming ``Global.arch`` and the two ways out.
    """
    from torch import nn  # torch only here: `import analysis.config` stays cheap

    if inspect.isclass(factory):
        if issubclass(factory, nn.Module):
            return factory
        what = f"the class {factory.__qualname__}, not a torch.nn.Module subclass"
    elif inspect.isfunction(factory) or (inspect.ismethod(factory) and inspect.isclass(factory.__self__)):
        returned = _return_class(factory)
        if returned is not None and issubclass(returned, nn.Module):
            return factory
        what = "a function whose return annotation is not a torch.nn.Module class"
    else:
        what = f"a {type(factory).__name__}, not a model class or a function"
    raise ModelError(
        f"Global.arch '{spec}' is {what}; a config may only name a model: a torch.nn.Module subclass, or a function "
        "annotated to return one (def build(...) -> nn.Module). Annotate it, or pass Global.trust_arch=true on the "
        "command line if you trust this config."
    )


def _return_class(function: Any) -> type | None:
    """The class ``function``'s return annotation names, or None (none, not a class, or not resolvable). String
    annotations are resolved as dotted names in the function's module, never evaluated."""
    try:
        annotation = inspect.signature(function).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, str):
        annotation = _dotted_name(annotation, getattr(inspect.unwrap(function), "__globals__", {}))
    return annotation if inspect.isclass(annotation) else None


def _dotted_name(text: str, namespace: Mapping[str, Any]) -> object:
    """What ``a.b.C`` names in ``namespace`` (attribute lookups only), or None."""
    parts = text.strip().split(".")
    if not all(part.isidentifier() for part in parts) or parts[0] not in namespace:
        return None
    value = namespace[parts[0]]
    for part in parts[1:]:
        value = getattr(value, part, None)
    return value

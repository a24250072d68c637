"""NNI 2.x's ``count_flops_params``: FLOPs and parameters of a model with a per-module breakdown, under NNI's name.

NNI 3.0 removed ``count_flops_params`` (``nni.compression.pytorch.utils``); this module offers the same call on top of
this package's cost counting (:mod:`analysis.structure.flops`). Where the results differ from NNI 2.10, the function's
docstring says how and why.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from analysis.inputs.device import model_device
from analysis.structure.flops import LAYER_TYPES, count_cost, format_count
from analysis.structure.groups import eval_mode

__all__ = ["count_flops_params"]

logger = logging.getLogger(__name__)

COUNT_MODES = ("default", "full")

CustomOp = Callable[[nn.Module, tuple[Any, ...], Any], Any]


def count_flops_params(
    model: nn.Module,
    x: torch.Tensor | Sequence[int] | Sequence[torch.Tensor],
    custom_ops: Mapping[type[nn.Module], CustomOp] | None = None,
    verbose: bool = True,
    mode: str = "default",
) -> tuple[int, int, list[dict[str, Any]]]:
    """NNI's ``count_flops_params``: FLOPs and parameters of ``model``, per sample, with a per-module breakdown.

    ``mode="default"`` counts like NNI: multiply-accumulates of every conv (1-3d, transposed) and linear layer,
    biases excluded, and the parameters of those layers, biases included. torchvision's ResNet-50 at 1x3x224x224
    gives 4,089,184,256 FLOPs and 25,503,912 parameters, as in NNI 2.10. FLOPs equal
    ``count_cost(model, x).macs`` (:data:`analysis.structure.flops.CONVENTIONS` ``"macs"``). Two deliberate differences
    from NNI: a linear layer applied to more than 2-D input counts every row (NNI counts one), and a transposed conv
    counts its input positions (NNI counts output positions, stride^d times too many). NNI also counts RNN layers;
    they are not counted here (a warning says so) unless ``custom_ops`` covers them. Pruning masks held by NNI's
    wrappers are not looked at: remove the channels physically before counting.

    ``mode="full"`` returns ``count_cost(model, x, mode="full")``: every op the forward pass runs (conv and matmul
    MACs plus biases, norms, activations, element-wise adds, pooling; see ``CONVENTIONS["full"]``) and all the
    model's parameters. torchvision's ResNet-50 at 1x3x224x224 gives 4,128,447,976 (NNI 2.10's full mode gives
    4,111,515,624: it counts conv biases, batch norm and pooling, but not ReLU, max pooling or the residual adds).
    Its ``results`` have one entry per module that runs ops itself (the innermost module running each op;
    ``""`` is the model), with that module's own parameters.

    Args:
        model: The network. It runs once in eval mode without gradients; every module's training flag is restored
            and the model stays on its device.
        x: An input tensor, an input size such as ``(1, 3, 224, 224)`` (a random input is made on the model's
            device), or a tuple of input tensors for models with several inputs (``mode="default"`` only).
        custom_ops: ``{module type: fn(module, inputs, output)}`` returning the per-sample FLOPs of one call (it
            sees the whole batch), or NNI's dict ``{"flops": ..., "params": ..., "weight_shape": ...}``. It
            replaces the default rule for that type (subclasses included, the most specific type wins) or adds a
            type; in ``"full"`` mode it replaces the count of the module and everything inside it.
        verbose: Print a per-module table and the totals, as NNI does.
        mode: ``"default"`` or ``"full"``.

    Returns:
        ``(flops, params, results)``: ``results`` is a list of dicts with NNI's keys ``name``, ``module_type``,
        ``weight_shape`` (0 when the module has no weight), ``flops``, ``params``, ``input_size`` and
        ``output_size``; in ``"default"`` mode one per call of a counted module, in forward order. ``params`` in
        ``"default"`` mode counts each counted module once.

    Raises:
        ValueError: For an unknown ``mode``, or several input tensors in ``"full"`` mode.
        TypeError: When ``x`` is neither a tensor, a size nor a tuple of tensors.
    """
    if mode not in COUNT_MODES:
        raise ValueError(f"unknown mode '{mode}'; use one of {list(COUNT_MODES)}")
    inputs = _count_inputs(model, x)
    ops = dict(custom_ops or {})
    if mode == "default":
        _warn_uncounted(model, ops)
        results = _default_results(model, inputs, ops)
        params = sum({entry["name"]: entry["params"] for entry in results}.values())
    else:
        if len(inputs) != 1:
            raise ValueError("mode='full' takes one input tensor or an input size, not several input tensors")
        cost = count_cost(model, inputs[0], mode="full")
        results = _full_results(model, inputs, cost.per_module, ops)
        params = cost.params
    flops = sum(entry["flops"] for entry in results)
    if verbose:
        print(_format_table(results))
        print(f"FLOPs total: {flops} ({format_count(flops)})")
        print(f"#Params total: {params} ({format_count(params)})")
    return flops, params, results


def _count_inputs(model: nn.Module, x: Any) -> tuple[torch.Tensor, ...]:
    """The positional inputs to run, on the model's device."""
    device = model_device(model)
    if isinstance(x, torch.Tensor):
        return (x.to(device),)
    if isinstance(x, (tuple, list)) and x and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        floating = next((p for p in model.parameters() if p.is_floating_point()), None)
        dtype = floating.dtype if floating is not None else torch.get_default_dtype()
        generator = torch.Generator().manual_seed(0)  # leaves the global random state alone
        return (torch.randn(tuple(x), generator=generator, dtype=dtype).to(device),)
    if isinstance(x, (tuple, list)) and x and all(isinstance(v, torch.Tensor) for v in x):
        return tuple(v.to(device) for v in x)
    raise TypeError(
        f"x must be an input tensor, an input size such as (1, 3, 224, 224), or a tuple of input tensors, got {x!r}"
    )


def _custom_op(module: nn.Module, ops: Mapping[type[nn.Module], CustomOp]) -> CustomOp | None:
    """The custom rule of the most specific class of ``module`` that has one."""
    return next((ops[cls] for cls in type(module).__mro__ if cls in ops), None)


def _warn_uncounted(model: nn.Module, ops: Mapping[type[nn.Module], CustomOp]) -> None:
    rnns = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, (nn.RNNBase, nn.RNNCellBase)) and _custom_op(m, ops) is None
        }
    )
    if rnns:
        logger.warning("%s layers are not counted (NNI counts them); pass custom_ops for them", ", ".join(rnns))


def _layer_macs(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> int:
    """Per-sample MACs of one call of a conv or linear layer, bias excluded."""
    if isinstance(module, nn.Linear):
        rows = math.prod(output.shape[1:-1]) if output.dim() > 2 else 1
        return rows * module.weight.numel()
    assert isinstance(module, nn.modules.conv._ConvNd)  # the other LAYER_TYPES
    spatial = len(module.kernel_size)
    positions = inputs[0] if module.transposed else output
    return math.prod(positions.shape[-spatial:]) * module.weight.numel()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, Mapping):
        return next((t for t in map(_first_tensor, value.values()) if t is not None), None)
    return None


def _size(value: Any) -> tuple[int, ...]:
    tensor = _first_tensor(value)
    return tuple(tensor.shape) if tensor is not None else ()


def _entry(name: str, module: nn.Module, flops: Any, params: int, inputs: Any, output: Any) -> dict[str, Any]:
    weight = getattr(module, "weight", None)
    return {
        "name": name,
        "module_type": type(module).__name__,
        "weight_shape": tuple(weight.shape) if isinstance(weight, torch.Tensor) else 0,
        "flops": int(flops),
        "params": params,
        "input_size": _size(inputs),
        "output_size": _size(output),
    }


def _custom_entry(rule: CustomOp, name: str, module: nn.Module, inputs: Any, output: Any) -> dict[str, Any]:
    """Run a custom op; a dict result (NNI's style) overrides the entry's fields."""
    value = rule(module, inputs, output)
    params = sum(p.numel() for p in module.parameters())
    if isinstance(value, Mapping):
        entry = _entry(name, module, value.get("flops", 0), params, inputs, output)
        entry.update({key: value[key] for key in ("params", "weight_shape") if key in value})
        return entry
    return _entry(name, module, value, params, inputs, output)


@dataclass
class _Calls:
    """What the hooks record: per-call entries (default mode), or first sizes and custom counts (full mode)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    order: dict[str, None] = field(default_factory=dict)  # modules by first call
    sizes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    custom: dict[str, dict[str, Any]] = field(default_factory=dict)


def _run_hooked(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    modules: Sequence[tuple[str, nn.Module]],
    hook: Callable[[str, nn.Module, tuple[Any, ...], Any], None],
    pre_hook: Callable[[str], None] | None = None,
) -> None:
    """Run ``model(*inputs)`` in eval mode without gradients, calling ``hook`` after each call of ``modules``."""
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_hook(lambda m, i, o, name=name: hook(name, m, i, o)))
        if pre_hook is not None:
            handles.append(module.register_forward_pre_hook(lambda m, i, name=name: pre_hook(name)))
    try:
        with eval_mode(model), torch.inference_mode():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def _default_results(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], ops: Mapping[type[nn.Module], CustomOp]
) -> list[dict[str, Any]]:
    calls = _Calls()
    counted = [(n, m) for n, m in model.named_modules() if _custom_op(m, ops) or isinstance(m, LAYER_TYPES)]

    def hook(name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        rule = _custom_op(module, ops)
        if rule is not None:
            calls.entries.append(_custom_entry(rule, name, module, args, output))
        else:
            params = sum(p.numel() for p in module.parameters())
            calls.entries.append(_entry(name, module, _layer_macs(module, args, output), params, args, output))

    _run_hooked(model, inputs, counted, hook)
    return calls.entries


def _full_results(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    per_module: Mapping[str, int],
    ops: Mapping[type[nn.Module], CustomOp],
) -> list[dict[str, Any]]:
    """One entry per module that ran ops (``count_cost`` full attribution), custom ops replacing subtrees."""
    calls = _Calls()

    def pre_hook(name: str) -> None:
        calls.order.setdefault(name, None)

    def hook(name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls.sizes.setdefault(name, (_size(args), _size(output)))
        rule = _custom_op(module, ops)
        if rule is not None:
            entry = _custom_entry(rule, name, module, args, output)
            if name in calls.custom:
                calls.custom[name]["flops"] += entry["flops"]
            else:
                calls.custom[name] = entry

    _run_hooked(model, inputs, list(model.named_modules()), hook, pre_hook)
    flops = dict(per_module)
    replaced: list[str] = []
    for name in sorted(calls.custom, key=lambda n: (n.count(".") + bool(n), n)):  # outermost first
        if any(_inside(name, outer) for outer in replaced):
            continue
        replaced.append(name)
        flops = {key: value for key, value in flops.items() if not _inside(key, name)}
        flops[name] = calls.custom[name]["flops"]
    modules = dict(model.named_modules())
    results = []
    for name in calls.order:
        if name not in flops:
            continue
        if name in calls.custom and name in replaced:
            results.append(calls.custom[name])
            continue
        module = modules[name]
        params = sum(p.numel() for p in module.parameters(recurse=False))
        entry = _entry(name, module, flops[name], params, None, None)
        entry["input_size"], entry["output_size"] = calls.sizes[name]
        results.append(entry)
    return results


def _inside(name: str, outer: str) -> bool:
    """True when module ``name`` is ``outer`` or inside it (``""`` is the model)."""
    return outer == "" or name == outer or name.startswith(f"{outer}.")


def _format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`count_flops_params` results, with NNI's columns (``#Call`` for reused layers)."""
    names = [entry["name"] for entry in results]
    reused = len(set(names)) < len(names)
    headers = ["Index", "Name", "Type", "Weight Shape", "Input Size", "Output Size", "FLOPs", "#Params"]
    headers += ["#Call"] if reused else []
    calls: dict[str, int] = defaultdict(int)
    rows = []
    for index, entry in enumerate(results):
        calls[entry["name"]] += 1
        row = [index, entry["name"], entry["module_type"], entry["weight_shape"], entry["input_size"]]
        row += [entry["output_size"], entry["flops"], entry["params"]]
        rows.append([str(value) for value in row] + ([str(calls[entry["name"]])] if reused else []))
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    numeric = {0, 6, 7, 8}

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in pairs).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])

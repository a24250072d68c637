"""The ACT ``ChannelPrune`` YAML of per-layer ratios: written ready to paste into a compression config, read back
by ``run.py plan``/``verify``. Its comments say how the ratios were derived and that every loss behind them was
measured with one layer pruned alone."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec

import yaml

from analysis.config import RATIO_DECIMALS
from analysis.errors import UserError
from analysis.io.atomic import atomic_write_text
from analysis.planning.ratios import explain_target_loss

P = ParamSpec("P")


def channel_prune_yaml(
    ratios: Mapping[str, float],
    order: Sequence[str],
    criterion: str,
    target_loss: float | None = None,
    granularity: str = "filter",
    note: str | None = None,
) -> str:
    """Return a YAML document with an ACT ``ChannelPrune`` block listing the per-layer ratios.

    ``note`` replaces the header's sentence on how the ratios were derived (e.g. for a budget plan).

    With ``granularity="element"`` the block is ``ElementPrune`` (criterion ``magnitude``): per-weight element
    sparsities, which no ACT block takes per layer, so it is written for the user's own pruning schedule.

    Args:
        ratios: ``{param: ratio}``, e.g. from :func:`get_ratios_by_loss`.
        order: Parameter names in model order; names of ``ratios`` missing from it follow in their own order.
        criterion: The channel-ranking criterion the sensitivities were measured with (e.g. ``l1_norm``).
        target_loss: The target the ratios were derived from, stated in the header; ``None`` if not from one.

    Returns:
        The document: a comment header, a comment naming parameters left unpruned (ratio 0.0), then
        ``ChannelPrune`` with ``criterion``, ``prune_params_name`` and ``pruned_ratio`` (rounded to 6 decimals);
        the two lists are index-aligned.
    """
    ordered = [name for name in dict.fromkeys(order) if name in ratios]
    listed = set(ordered)
    ordered += [name for name in ratios if name not in listed]
    names: list[str] = []
    values: list[float] = []
    skipped: list[str] = []
    for name in ordered:
        value = round(float(ratios[name]), RATIO_DECIMALS)
        if value <= 0.0:
            skipped.append(name)
        else:
            names.append(name)
            values.append(value)

    element = granularity == "element"
    header = [
        "Per-weight element sparsities from an element-wise sensitivity analysis (ElementPrune is not an ACT block)."
        if element
        else "Per-layer channel pruning ratios from a sensitivity analysis."
    ]
    if note is not None:
        header.append(note)
    elif target_loss is None:
        header.append(
            "Each loss behind these ratios was measured with that layer alone pruned; losses of several pruned "
            "layers are not additive, so verify the combined model."
        )
    else:
        header.append(explain_target_loss(target_loss))
    if skipped:
        reason = "ratio 0.0" if target_loss is None else f"no ratio meets target_loss {target_loss:g}"
        header.append(f"not pruned ({reason}): " + ", ".join(_printable(name) for name in skipped))
    lines = [comment for text in header for comment in _comment_lines(text)]
    block_name, criterion = ("ElementPrune", "magnitude") if element else ("ChannelPrune", criterion)
    block = {block_name: {"criterion": criterion, "prune_params_name": names, "pruned_ratio": values}}
    body: str = yaml.safe_dump(block, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return "\n".join(lines) + "\n" + body


def _file_writer(render: Callable[P, str]) -> Callable[Concatenate[str | os.PathLike[str], P], None]:
    """A function writing ``render``'s text to a path atomically; it takes the path, then ``render``'s arguments."""

    def write(path: str | os.PathLike[str], /, *args: P.args, **kwargs: P.kwargs) -> None:
        atomic_write_text(path, render(*args, **kwargs))

    write.__doc__ = f"Write :func:`{render.__name__}` to ``path`` atomically (its arguments follow ``path``)."
    return write


save_ratios_yaml = _file_writer(channel_prune_yaml)


def load_ratios_yaml(path: str | os.PathLike[str]) -> dict[str, float]:
    """Read ``{param: ratio}`` from a YAML with a ``ChannelPrune`` block (``prune_params_name`` with a
    ``pruned_ratio`` list in the same order, or one ratio for all), as this tool and ACT write it.

    Raises:
        UserError: If the file is unreadable or the block is missing or malformed.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"Cannot read the ratios file {path}: {str(error).splitlines()[0]}") from None
    block = data.get("ChannelPrune") if isinstance(data, dict) else None
    names = block.get("prune_params_name") if isinstance(block, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{path} has no ChannelPrune.prune_params_name list; pass a ratios YAML this tool wrote.")
    assert isinstance(block, dict)  # names came from it
    ratios = block.get("pruned_ratio")
    if isinstance(ratios, (int, float)):
        ratios = [ratios] * len(names)
    if (
        not isinstance(ratios, list)
        or len(ratios) != len(names)
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios)
    ):
        raise UserError(f"{path}: ChannelPrune.pruned_ratio must be a number or a list as long as prune_params_name.")
    return {name: float(ratio) for name, ratio in zip(names, ratios, strict=True)}


def _comment_lines(text: str) -> list[str]:
    """Wrap ``text`` into ``# ``-prefixed lines of at most 120 columns."""
    return textwrap.wrap(
        text, width=120, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False
    )


def _printable(name: str) -> str:
    """Keep a parameter name from ending the YAML comment it is listed in."""
    return name if name.isprintable() else repr(name)

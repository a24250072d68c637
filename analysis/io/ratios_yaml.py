"""The ACT ``ChannelPrune`` YAML of per-layer ratios: written ready to paste into a compression config, read back
by ``run.py plan``/``verify``. Its comments say how the ratios were derived and that every loss behind them was
measured with one layer pruned alone."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

import yaml

from analysis.config import UNHOLDABLE, UniqueKeyLoader, unholdable, yaml_problem
from analysis.errors import AnalysisFileError, did_you_mean, first_line, printable
from analysis.io.atomic import atomic_write_text
from analysis.ratio import RATIO_DECIMALS, normalise_ratio, ratio_problem
from analysis.text import explain_target_loss

P = ParamSpec("P")
_BLOCK, _NAMES, _RATIOS = "ChannelPrune", "prune_params_name", "pruned_ratio"
_STR_TAG = "tag:yaml.org,2002:str"


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
        value = normalise_ratio(ratios[name])
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
    body: str = yaml.dump(
        block, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000
    )
    return "\n".join(lines) + "\n" + body


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no type information
    """PyYAML's safe dumper, writing text that holds a character Python does not print double-quoted with escapes:
    PyYAML may write it raw in single quotes, where a line break such as ``\\x85`` reads back as a space."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    """``text`` as a YAML scalar, double-quoted when it holds a character that is not printable."""
    return dumper.represent_scalar(_STR_TAG, text, style=None if text.isprintable() else '"')


_Dumper.add_representer(str, _represent_str)


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

    What YAML or a dict would resolve silently is refused instead: a block, key or param written twice (the last
    would win), a ratio that is not a number in [0, 1) (0 leaves the param unpruned), a name that is not text.

    Raises:
        AnalysisFileError: One sentence naming the file, with the line at fault where there is one.
    """
    source = Path(path)
    root, data = _read_yaml(source)
    if not isinstance(data, dict) or _BLOCK not in data:
        found = "is empty" if data is None else f"has no {_BLOCK} block"
        raise AnalysisFileError(
            f"Ratios file {source} {found}; pass a ratios YAML this tool wrote (a {_BLOCK} block with {_NAMES} and "
            f"{_RATIOS}, e.g. <analysis_file>.plan.yaml)."
        )
    block, block_node = data[_BLOCK], _value_node(root, _BLOCK)
    if not isinstance(block, dict):
        problem = f"{_BLOCK} must be a mapping with {_NAMES} and {_RATIOS}, not {_shown(block)}."
        raise _refusal(source, block_node, problem)
    for key in (_NAMES, _RATIOS):
        if key not in block:
            raise _refusal(
                source, block_node,
                f"{_BLOCK} has no {key}{did_you_mean(key, map(str, block))}; a ratios file lists the params in "
                f"{_NAMES} and their ratios, in the same order, in {_RATIOS}.",
            )  # fmt: skip
    names, names_node = block[_NAMES], _value_node(block_node, _NAMES)
    if not isinstance(names, list):
        raise _refusal(source, names_node, f"{_BLOCK}.{_NAMES} must be a list of param names, not {_shown(names)}.")
    name_nodes = _item_nodes(names_node, len(names))
    first: dict[str, int] = {}
    for index, name in enumerate(names):
        if not isinstance(name, str):
            raise _refusal(
                source, name_nodes[index],
                f"{_BLOCK}.{_NAMES} item {index + 1} is {_shown(name)}, not a param name; write each name as text, "
                "quoted where YAML would read a number (e.g. '0.weight').",
            )  # fmt: skip
        if name in first:
            where = _places(name_nodes[first[name]], name_nodes[index], first[name], index)
            raise _refusal(
                source, name_nodes[index],
                f"'{printable(name)}' is listed twice in {_BLOCK}.{_NAMES} ({where}); list each param once.",
            )  # fmt: skip
        first[name] = index
    ratios, ratios_node = block[_RATIOS], _value_node(block_node, _RATIOS)
    if not isinstance(ratios, list):  # one ratio for all
        ratio = _checked_ratio(source, ratios_node, f"{_BLOCK}.{_RATIOS}", ratios)
        return dict.fromkeys(names, ratio)
    if len(ratios) != len(names):
        raise _refusal(
            source, ratios_node,
            f"{_BLOCK}.{_RATIOS} lists {len(ratios)} ratios for the {len(names)} names of {_NAMES}; give one ratio per "
            "name, in the same order (or one number for all).",
        )  # fmt: skip
    ratio_nodes = _item_nodes(ratios_node, len(ratios))
    return {
        name: _checked_ratio(source, node, f"{_BLOCK}.{_RATIOS} of '{printable(name)}'", ratio)
        for name, ratio, node in zip(names, ratios, ratio_nodes, strict=True)
    }


def _read_yaml(source: Path) -> tuple[Any, Any]:
    """The file's YAML node tree (for line numbers; ``None`` when empty) and its value, read with the config loader's
    limits (a key written twice, aliases that expand past ``MAX_YAML_NODES``); a tag such as ``!!python/object``
    is refused as by any safe loader."""
    if source.is_dir():
        raise AnalysisFileError(
            f"Ratios file {source} is a folder; pass a ratios YAML file (a ChannelPrune block, e.g. the "
            "<analysis_file>.plan.yaml a plan wrote)."
        )
    try:
        raw = source.read_bytes()
    except FileNotFoundError:
        raise AnalysisFileError(
            f"Ratios file {source} does not exist; pass an existing ratios YAML (e.g. the <analysis_file>.plan.yaml a "
            "plan wrote)."
        ) from None
    except OSError as error:
        raise AnalysisFileError(
            f"Cannot read the ratios file {source}: {error.strerror or first_line(error)}; pass a readable ratios "
            "YAML file."
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise AnalysisFileError(
            f"Ratios file {source} line {line}: byte {error.start} (0x{raw[error.start]:02x}) is not UTF-8; save the "
            "file as UTF-8."
        ) from None
    loader = None
    try:
        loader = UniqueKeyLoader(text)
        root = loader.get_single_node()
        _refuse_repeated_keys(source, root)
        return root, None if root is None else loader.construct_document(root)
    except yaml.reader.ReaderError as error:  # a character YAML does not allow
        line = text.count("\n", 0, error.position) + 1
        raise AnalysisFileError(
            f"Ratios file {source} line {line}: YAML does not allow the character #x{error.character:04x}; remove it."
        ) from None
    except yaml.MarkedYAMLError as error:
        raise AnalysisFileError(f"Ratios file {source}{_yaml_problem(error)}.") from None
    except yaml.YAMLError as error:
        raise AnalysisFileError(f"Ratios file {source} is not valid YAML ({printable(first_line(error))}).") from None
    except UNHOLDABLE as error:  # YAML that PyYAML parses but Python cannot hold: 2001-02-30, 5000 digits, deep nesting
        raise AnalysisFileError(
            f"Ratios file {source} holds a value Python cannot hold ({printable(unholdable(error))}); a ratios file "
            f"is a {_BLOCK} block of param names and ratios."
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_problem(error: yaml.MarkedYAMLError) -> str:
    """The config loader's :func:`~analysis.config.yaml_problem`, with a hint where the problem is a tag."""
    hint = (
        "; remove the tag: a ratios file holds plain names and numbers" if "for the tag" in str(error.problem) else ""
    )
    return yaml_problem(error) + hint


def _refuse_repeated_keys(source: Path, root: Any) -> None:
    """Refuse a top-level key or a ``ChannelPrune`` key written twice, naming both lines (the loader refuses deeper
    ones); YAML would keep the last silently."""
    for node, where in ((root, "at the top level"), (_value_node(root, _BLOCK), f"in {_BLOCK}")):
        seen: dict[tuple[str, str], Any] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                lines = f"lines {_line(seen[key])} and {_line(key_node)}"
                raise _refusal(
                    source, key_node,
                    f"'{printable(key_node.value)}' is written twice {where} ({lines}); keep one (YAML would use the "
                    "last alone).",
                )  # fmt: skip
            seen[key] = key_node


def _value_node(node: Any, key: str) -> Any:
    """The node of ``key``'s value in the mapping ``node`` (the last one, as constructed), or ``None``."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in reversed(node.value):
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STR_TAG and key_node.value == key:
            return value_node
    return None


def _item_nodes(node: Any, count: int) -> list[Any]:
    """The nodes of a list's ``count`` items (for their lines), or the list's own node for each."""
    if isinstance(node, yaml.SequenceNode) and len(node.value) == count:
        return list(node.value)
    return [node] * count


def _line(node: Any) -> int:
    """The 1-based line a YAML node starts on."""
    return int(node.start_mark.line) + 1


def _places(first: Any, second: Any, first_index: int, second_index: int) -> str:
    """``lines 3 and 5``, or ``items 1 and 2`` when both are on one line (a flow list)."""
    if first is not None and second is not None and _line(first) != _line(second):
        return f"lines {_line(first)} and {_line(second)}"
    return f"items {first_index + 1} and {second_index + 1}"


def _refusal(source: Path, node: Any, problem: str) -> AnalysisFileError:
    """The error for ``problem`` in the ratios file, at ``node``'s line where it has one."""
    line = f" line {_line(node)}" if node is not None else ""
    return AnalysisFileError(f"Ratios file {source}{line}: {problem}")


def _checked_ratio(source: Path, node: Any, what: str, value: Any) -> float:
    """``value`` as a float if it is a ratio in [0, 1) that stays below 1 at the 6 decimals ratios are stored with."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problem = f"is {_shown(value)}, not a number"
    elif not 0.0 <= value < 1.0:  # nan fails too; an int of any size compares without overflow
        problem = f"is {_shown(value)}, outside [0, 1)"
    elif ratio_problem(value, zero_allowed=True) is not None:
        problem = f"is {value!r}, which rounds to 1.0 at the {RATIO_DECIMALS} decimals ratios are stored with"
    else:
        return float(value)
    raise _refusal(
        source, node, f"{what} {problem}; a ratio is a number from 0 (not pruned) up to, not including, 1 (e.g. 0.3)."
    )


def _shown(value: Any) -> str:
    """A short, one-line description of a YAML value for a message."""
    if value is None:
        return "empty (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int) and abs(value) >= 10**20:  # str() of an int past 4300 digits raises
        return "a number of more than 20 digits"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = printable(value)
        return f"the text '{text if len(text) <= 40 else text[:37] + '...'}'"
    kinds: dict[type, str] = {list: "a list", dict: "a mapping"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _comment_lines(text: str) -> list[str]:
    """Wrap ``text`` into ``# ``-prefixed lines of at most 120 columns."""
    return textwrap.wrap(
        text, width=120, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False, break_long_words=False
    )


def _printable(name: str) -> str:
    """Keep a parameter name from ending the YAML comment it is listed in."""
    return name if name.isprintable() else repr(name)

"""The configuration reference of the docs, generated from the schema in :mod:`analysis.config`.

Every key's type and default come from its dataclass field and its meaning from the field's ``doc`` (see
:func:`analysis.config.setting`), so the page cannot drift from what the loader accepts. A key without a description
is an error here, which fails the docs build (and ``tests/test_config_reference.py``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from analysis import act_keys, config

TITLE = "Configuration reference"

_TYPE_NAMES: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool", type(None): "null", Any: "any"}
# Plain scalars YAML would read as something else than the string: written quoted.
_YAML_WORDS = re.compile(r"(?i)null|~|true|false|yes|no|on|off|[-+.\d].*|")


def undescribed_keys(sections: Mapping[str, type] | None = None) -> list[str]:
    """``Section.key`` of every field without a description (no ``doc``, or a blank one), in schema order.

    Args:
        sections: Section name -> dataclass; default :data:`analysis.config.SECTIONS` (read at call time).
    """
    missing = []
    for name, cls in _sections(sections).items():
        for item in dataclasses.fields(cls):
            doc = item.metadata.get("doc")
            if not isinstance(doc, str) or not doc.strip():
                missing.append(f"{name}.{item.name}")
    return missing


def config_reference_markdown(sections: Mapping[str, type] | None = None) -> str:
    """The Markdown of the configuration reference page: an intro, then per section a table of every key with its
    type, default and meaning. Links are relative to a page in ``docs/reference/``.

    Args:
        sections: Section name -> dataclass; default :data:`analysis.config.SECTIONS` (read at call time).

    Raises:
        ValueError: When a key has no description, naming every such key, so that the docs build fails.
    """
    chosen = _sections(sections)
    missing = undescribed_keys(chosen)
    if missing:
        raise ValueError(
            f"config keys without a description in analysis/config.py: {', '.join(missing)}; give each a doc=..."
        )
    lines = [f"# {TITLE}", "", *_intro()]
    for name, cls in chosen.items():
        lines += ["", f"## `{name}`", ""]
        summary = _summary(cls)
        if summary:
            lines += [summary, ""]
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            cells = (f"`{item.name}`", _type_text(hints[item.name]), _default_text(item), _meaning(name, item))
            lines.append("| " + " | ".join(_cell(text) for text in cells) + " |")
    lines += _act_tables()
    return "\n".join(lines) + "\n"


def _act_tables() -> list[str]:
    """The keys of ACT's ``TrainConfig`` and ``Distillation`` that ``run.py compress`` reads, from
    :mod:`analysis.act_keys`."""
    ignored = _join([f"`{key}`" for key in act_keys.IGNORED_TRAIN_KEYS])
    legacy = _join([f"`{old}`" for old in (*act_keys.LEGACY_TRAIN_KEYS, *act_keys.LEGACY_DISTILL_KEYS)])
    notes = {
        "TrainConfig": f"ACT's training block, read by `run.py compress` only. {ignored} steer Paddle alone and are "
        "accepted and ignored (named in the log); any other key is an error, as in ACT.",
        "Distillation": "ACT's distillation block, read by `run.py compress` only; the teacher is the dense model. "
        f"PaddleSlim 2.3's names ({legacy}) are read too.",
    }
    lines = []
    for name, keys in (("TrainConfig", act_keys.TRAIN_CONFIG_KEYS), ("Distillation", act_keys.DISTILLATION_KEYS)):
        lines += ["", f"## `{name}`", "", notes[name], "", "| key | type | default | meaning |"]
        lines.append("| --- | --- | --- | --- |")
        for key, item in keys.items():
            cells = (f"`{key}`", item.type, item.default, item.meaning)
            lines.append("| " + " | ".join(_cell(text) for text in cells) + " |")
    return lines


def _sections(sections: Mapping[str, type] | None) -> Mapping[str, type]:
    return config.SECTIONS if sections is None else sections


def _intro() -> list[str]:
    """What the tables do not show, from the constants the loader uses: ACT blocks, ChannelPrune's defaults,
    aliases and ignored keys."""
    lent = _join([f"`ChannelPrune.{key}`" for key in config.CHANNEL_PRUNE_DEFAULTS])
    aliases = [f"`{alias}` for `{key}`" for alias, key in config.GLOBAL_ALIASES.items()]
    ignored = [f"`{key}`" for key in config.IGNORED_GLOBAL_KEYS]
    extra = [f"the alias{'es' if len(aliases) > 1 else ''} {_join(aliases)}"] if aliases else []
    extra += [f"the Paddle-only ACT keys {_join(ignored)}, which are ignored"] if ignored else []
    return [
        "<!-- Generated from analysis/config.py by analysis.config_reference: edit the descriptions there. -->",
        "",
        "A config is an ACT-style YAML file with a `Global` block and optional `SensitivityAnalysis` and `Recovery` "
        "blocks. Existing ACT compression configs load unchanged: the analysis accepts the blocks "
        f"{_join([f'`{block}`' for block in config.ACT_BLOCKS])} and lists them as ignored, except that {lent} "
        "become defaults of `SensitivityAnalysis` (a key the `SensitivityAnalysis` block sets itself wins); "
        f"`run.py compress` reads {_join([f'`{block}`' for block in config.COMPRESS_BLOCKS])} (their keys are at the "
        "end of this page). Any other top-level block is a warning. An unknown or mistyped key inside `Global`, "
        "`SensitivityAnalysis` or `Recovery` is an error that names the full key and suggests the closest valid one. "
        "See `configs/act/` for an ACT config that runs as is.",
        "",
        *([f"`Global` also accepts {_join(extra)}.", ""] if extra else []),
        "`null` leaves a key unset; a default written in words is worked out when the run starts.",
    ]


def _summary(cls: type) -> str:
    """The first line of the class docstring, in Markdown (reST's double backticks made single)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses writes for a class without a docstring
        return ""
    return doc.strip().split("\n\n")[0].replace("``", "`")


def _meaning(section: str, item: dataclasses.Field[Any]) -> str:
    text = str(item.metadata["doc"]).strip()
    if section == "Global":
        aliases = [f"`{alias}`" for alias, key in config.GLOBAL_ALIASES.items() if key == item.name]
        if aliases:
            text += f"; {_join(aliases)} {'is' if len(aliases) == 1 else 'are'} accepted as an alias"
    return text


def _type_text(hint: Any) -> str:
    """An annotation in words: ``int``, ``float or null``, ``list of float``, ``mapping``, ``float, int, str or
    null``."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _join([_type_text(arg) for arg in typing.get_args(hint)], "or")
    if origin is list:
        args = typing.get_args(hint)
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin is dict or hint is dict:
        return "mapping"
    if hint in _TYPE_NAMES:
        return _TYPE_NAMES[hint]
    return str(getattr(hint, "__name__", hint))


def _default_text(item: dataclasses.Field[Any]) -> str:
    """``shown_default`` when the field has one, else the literal default in YAML spelling and backticks."""
    shown = item.metadata.get("shown_default")
    if shown:
        return str(shown)
    if item.default is not dataclasses.MISSING:
        return f"`{_yaml(item.default)}`"
    if item.default_factory is not dataclasses.MISSING:
        return f"`{_yaml(item.default_factory())}`"
    return "required"


def _yaml(value: Any) -> str:
    """``value`` as a YAML flow value: ``null``, ``true``, ``0.5``, ``auto``, ``[0.1, 0.2]``, ``{}``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = _YAML_WORDS.fullmatch(value) is None and not re.search(r"[:#\[\]{},&*!|>'\"%@`]|^\s|\s$", value)
        return value if plain else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_yaml(k)}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _cell(text: str) -> str:
    """One table cell: on one line, with ``|`` escaped so it does not end the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _join(items: Iterable[str], word: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c`` (no Oxford comma, like the rest of the docs); ``""`` for none."""
    parts = list(items)
    if len(parts) < 2:
        return "".join(parts)
    return f"{', '.join(parts[:-1])} {word} {parts[-1]}"

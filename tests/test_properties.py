"""Properties (Hypothesis) of the readers of user text: the config loader, the list-file reader, the ratios YAML reader
and the measured plan's search log.

What they guarantee, for any input:

* a config key holding any YAML value, a dotted override holding any text, and a config file holding any text or bytes
  either load to a :class:`~analysis.config.Config` or raise :class:`~analysis.errors.ConfigError`;
* a list file holding any bytes or lines is either read as one sample per line that is neither blank nor a ``#``
  comment, with the label written on it, or raises :class:`~analysis.errors.DataError`;
* a ratios YAML holding any bytes or document either loads to exactly the (name, ratio) pairs it lists, each ratio
  in [0, 1), or raises a :class:`~analysis.errors.UserError` naming the file (a param, key or block written twice is
  refused, never resolved); what :func:`~analysis.io.ratios_yaml.channel_prune_yaml` writes reads back;
* the error is one line of printable text ending a sentence and names the key, override or file (and the list line
  at fault); no other exception escapes;
* through the CLI the same inputs exit 0 or 2, a 2 with one ``error:`` line and no traceback.

The examples are derandomized (the same on every run, no example database), so CI is deterministic. Each explicit
``@example`` is an input that broke the property before the fix its comment names, or a corner worth always trying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from analysis.config import (
    SECTIONS,
    Config,
    GlobalConfig,
    SensitivityConfig,
    config_from_data,
    load_config,
    printable,
)
from analysis.errors import AnalysisFileError, ConfigError, DataError, UserError
from analysis.inputs.data import read_sample_list
from analysis.io.ratios_yaml import channel_prune_yaml, load_ratios_yaml
from analysis.io.search_log import SearchLog, search_log_path

from helpers import (
    RATIOS_HEAD,
    SEARCH_DESCRIPTION,
    SEARCH_FIELDS,
    SEARCH_KEY,
    VALID_RATIOS,
    run_cli,
    search_record,
    tiny_global,
    write_config,
    write_images,
)


def property_settings(max_examples: int) -> settings:
    """Derandomized: every run tries the same ``max_examples`` examples, and nothing is stored between runs."""
    return settings(derandomize=True, database=None, deadline=None, max_examples=max_examples)


SECTION_KEYS = [(name, f.name) for name, cls in (("Global", GlobalConfig), ("SensitivityAnalysis", SensitivityConfig))
                for f in dataclasses.fields(cls)]  # fmt: skip
# Keys the CLI property leaves alone: sizes and worker counts that a valid but huge value turns into hours of work or
# gigabytes of memory, the model (arbitrary modules and kwargs), torchvision weights (a download) and output paths.
CLI_SKIPPED = {
    "img_size", "resize_size", "calib_img_size", "calib_resize_size", "num_workers", "arch", "arch_kwargs",
    "model_dir", "model_filename", "params_filename", "trust_model_file", "weights", "analysis_file", "export_dir",
}  # fmt: skip
CLI_KEYS = [(name, key) for name, key in SECTION_KEYS if key not in CLI_SKIPPED]
LABELS = 10  # the classes of tiny_cnn and of the images below

# ---- strategies ----------------------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats()  # nan and +-inf included
    | st.text()  # any characters, control characters and line breaks included
    | st.sampled_from(["auto", "cpu", "top5", "l2_norm", "0.5", "yes", "~", "", " "])
)
# Values a key may well accept, so that valid configs (and so whole runs) come up too.
plausible = (
    st.integers(-1, 40)
    | st.floats(0, 1)
    | st.lists(st.floats(0, 1), min_size=1, max_size=3)
    | st.sampled_from(["cpu", "auto", "cuda:0", "ram", "off", "top5", "ce", "absolute", "mean", "reference", "element"])
    | st.sampled_from(["l2_norm", "bn_scale", "dropped", "measured", "bicubic", "val_list.txt", "x.txt", "[]", "{}"])
)
yaml_values = plausible | st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip


def flow_yaml(value: Any) -> str:
    """``value`` as one line of YAML (what a user would type after ``Section.key=``)."""
    return (
        str(yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True))
        .removesuffix("\n...\n")
        .strip()
    )


override_values = st.text() | yaml_values.map(flow_yaml)
# Pieces of YAML syntax, so that whole-file text reaches the parser's corners (anchors, tags, flow, indentation).
yaml_soup = st.lists(
    st.sampled_from([
        "Global:", "SensitivityAnalysis:", "ChannelPrune:", "  data_dir: d", "  arch: a", "  batch_size: 8",
        "  pruned_ratios: [0.5]", "&a ", "*a", "<<: *a", "- ", ": ", "? ", "!!python/object:os.system ", "!!binary ",
        "{", "}", "[", "]", ",", "'", '"', "\\", "\n", "\r\n", "\t", "  ", "#", "%YAML 1.1\n", "---\n", "...\n",
        "\x00", "\x85", "\ufeff", "é", "1e309", ".nan",
    ]) | st.text(max_size=3),
    max_size=30,
).map("".join)  # fmt: skip
newlines = st.sampled_from(["\n", "\r\n", "\r"])
labels = st.integers() | st.integers(min_value=-(10**30), max_value=10**30) | st.integers(0, LABELS - 1)
list_lines = st.one_of(
    st.text(),
    st.builds("{} {}".format, st.text(), labels),
    st.builds("{}\t{}".format, st.sampled_from(["val/img_0000.png", "a b.png", "#x", "", " "]), st.text(max_size=4)),
    st.sampled_from(["", "   ", "# comment", "\t#", "\x00", "\ufeff", "x -1", "x +1", "x 1_0", "x ٣", "x 1e3"]),
)
# A path the reader must give back: no line break, nothing to strip at either end, and no comment mark in front.
# Inner whitespace is part of the path (the label is the last field), so spaces and tabs come up often.
path_characters = st.sampled_from(" \t\x0b\x85\u3000/._-#0") | st.characters(
    exclude_categories=("Cs",), exclude_characters="\r\n"
)
round_trip_paths = (
    st.lists(path_characters, min_size=1, max_size=20)  # a list keeps the bias that st.text's alphabet would merge away
    .map("".join)
    .filter(lambda path: path == path.strip() and not path.startswith(("#", "\ufeff")))
)

# ---- shared files: built once, since Hypothesis runs many examples in one test call -------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with 20 images in the PaddleSlim layout (labels 0..9 twice) under ``data``."""
    root = tmp_path_factory.mktemp("properties")
    write_images(root / "data", "list", [i % LABELS for i in range(20)])
    return root


def base_config(workdir: Path) -> dict[str, Any]:
    """A valid, fast config: the tiny CNN on the images of ``workdir``, one ratio, output under ``workdir``."""
    analysis = {"analysis_file": str(workdir / "out" / "s.pkl"), "pruned_ratios": [0.5]}
    return {"Global": tiny_global(workdir / "data"), "SensitivityAnalysis": analysis}


# ---- assertions ----------------------------------------------------------------------------------------------------


def assert_one_sentence(error: Exception, *names: str) -> None:
    """The message is one line of printable text ending a sentence and contains at least one of ``names``."""
    message = str(error)
    assert message.isprintable(), f"not one printable line: {message!r}"
    assert message.endswith((".", "?", ")")), f"no sentence end: {message!r}"
    assert any(name in message for name in names), f"names none of {names}: {message!r}"


def load_or_refuse(path: Path, overrides: list[str], *names: str) -> Config | None:
    """Load ``path``; a refusal must be a one-sentence ConfigError naming one of ``names`` (any other exception
    propagates and fails the test)."""
    try:
        config = load_config(path, overrides=overrides)
    except ConfigError as error:
        assert_one_sentence(error, *names)
        event("refused")
        return None
    event("loaded")
    return config


def assert_usable(config: Config, path: Path) -> None:
    """A loaded config is one the run can use as written: torch reads its device and seed unchanged, and written back
    as data (as a sidecar keeps it) it loads to the same config."""
    g = config.Global
    if g.device != "auto":
        assert str(torch.device(g.device)) == g.device
    torch.Generator().manual_seed(g.seed)
    raw = {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
    # a setting that runs code (trust_model_file...) came from the command line: written back as data it needs the
    # same opt-in (a recorded config is refused it otherwise, by design)
    assert config_from_data(raw, path, trust_config=True) == config


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Capture stdout and stderr (pytest's fixtures are per test, these per example)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def run_cli_checked(config: Path, *overrides: str) -> int:
    """Run the CLI on ``config``; it exits 0, or 2 with a last ``error:`` line that is one printable sentence."""
    with captured() as (_, err):
        code = run_cli(["--config_path", config, "--overwrite", "--no_report", "--quiet", *overrides])
    assert code in (0, 2), err.getvalue()
    event(f"exit code {code}")
    if code == 2:
        text = err.getvalue()
        assert "Traceback" not in text, text
        last = text.splitlines()[-1]
        assert last.startswith("error: ") and last.isprintable(), text
    return code


# ---- the config loader ---------------------------------------------------------------------------------------------

# Overrides each loader property also tries (as an @example, in its own form) that must load, with the value the loaded
# config then holds: a loader refusing everything would otherwise pass properties that allow a refusal.
MUST_LOAD = {
    "Global.batch_size=4": 4,
    "Global.device=cpu": "cpu",
    "SensitivityAnalysis.pruned_ratios=[0.5, 0.25, 0.5]": [0.25, 0.5],  # normalised: sorted, each once
    "SensitivityAnalysis.target_loss=0.05": 0.05,
}
# Whole config files that must load, with one value each sets: (section, key, value).
MUST_LOAD_TEXT = {
    "Global:\n  data_dir: d\n  arch: a\n  batch_size: 8": ("Global", "batch_size", 8),
    "Global: {arch: a, data_dir: d}\nSensitivityAnalysis: {pruned_ratios: [0.5]}\n": (
        "SensitivityAnalysis", "pruned_ratios", [0.5]
    ),
}  # fmt: skip


def assert_must_load(config: Config | None, item: str) -> None:
    """If ``item`` (``Section.key=value``) is one of :data:`MUST_LOAD`, ``config`` loaded and holds its value."""
    if item in MUST_LOAD:
        section, _, rest = item.partition(".")
        assert config is not None, f"{item} was refused"
        assert getattr(getattr(config, section), rest.partition("=")[0]) == MUST_LOAD[item]


def assert_must_load_text(config: Config | None, text: str) -> None:
    """If ``text`` is one of :data:`MUST_LOAD_TEXT`, ``config`` loaded and holds the value it lists."""
    if text in MUST_LOAD_TEXT:
        section, key, value = MUST_LOAD_TEXT[text]
        assert config is not None, f"{text!r} was refused"
        assert getattr(getattr(config, section), key) == value


@pytest.fixture(scope="module")
def base_loaded(workdir: Path) -> Config:
    """What :func:`base_config` loads to (as parsed data, so that the loader under test is not needed for it)."""
    return config_from_data(base_config(workdir), workdir / "base.yaml")


def assert_only_changed(config: Config, base: Config, section: str, name: str) -> None:
    """Every key of ``config`` but ``section.name`` holds what it holds in ``base``."""
    for part in ("Global", "SensitivityAnalysis"):
        for field in dataclasses.fields(getattr(config, part)):
            if (part, field.name) != (section, name):
                loaded, unchanged = getattr(getattr(config, part), field.name), getattr(getattr(base, part), field.name)
                assert loaded == unchanged, f"{section}.{name} changed {part}.{field.name}"


@property_settings(300)
@given(key=st.sampled_from(SECTION_KEYS), value=yaml_values)
@example(key=("Global", "mean"), value={})  # a mapping where a list belongs: OmegaConf's bare TypeError
@example(key=("Global", "arch_kwargs"), value=[])  # a list where a mapping belongs: the same
@example(key=("Global", "std"), value=[[1], 2, 3])  # a list in a list of numbers passed OmegaConf; then TypeError
@example(key=("SensitivityAnalysis", "skip_params"), value=[{"a": 1}])  # a mapping in a list of names passed
@example(key=("SensitivityAnalysis", "group_reduction"), value="se\x85lf")  # quoted raw: a line break in the message
@example(key=("SensitivityAnalysis", "early_stop_mode"), value="a\nb")  # quoted raw by early_stop_from
@example(key=("Global", "device"), value="cuda:\u0663")  # a non-ASCII digit matched \d; torch.device raised
@example(key=("Global", "seed"), value=2**64)  # accepted; torch.manual_seed raised ValueError in the run
@example(key=("Global", "batch_size"), value=4)  # these four must load (MUST_LOAD)
@example(key=("Global", "device"), value="cpu")
@example(key=("SensitivityAnalysis", "pruned_ratios"), value=[0.5, 0.25, 0.5])
@example(key=("SensitivityAnalysis", "target_loss"), value=0.05)
def test_any_yaml_value_for_any_key_loads_or_names_the_key(
    workdir: Path, base_loaded: Config, key: tuple[str, str], value: Any
) -> None:
    section, name = key
    data = base_config(workdir)
    data[section][name] = value
    path = workdir / "value.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    config = load_or_refuse(path, [], name)
    if config is not None:
        assert_usable(config, path)
        assert_only_changed(config, base_loaded, section, name)
    assert_must_load(config, f"{section}.{name}={flow_yaml(value)}")


@property_settings(300)
@given(key=st.sampled_from(SECTION_KEYS), text=override_values)
@example(key=("Global", "seed"), text="P\n:E\x14F")  # the override was quoted raw, line break and all
@example(key=("Global", "mean"), text="{a: 1}")  # OmegaConf's bare TypeError
@example(key=("Global", "arch_kwargs"), text="[1]")  # the same
@example(key=("Global", "device"), text="cuda:256")  # accepted; torch wraps the index: cuda:256 is cuda:0
@example(key=("Global", "batch_size"), text="4")  # these four must load (MUST_LOAD)
@example(key=("Global", "device"), text="cpu")
@example(key=("SensitivityAnalysis", "pruned_ratios"), text="[0.5, 0.25, 0.5]")
@example(key=("SensitivityAnalysis", "target_loss"), text="0.05")
def test_any_override_value_loads_or_names_the_key(
    workdir: Path, base_loaded: Config, key: tuple[str, str], text: str
) -> None:
    section, name = key
    path = write_config(workdir / "base.yaml", base_config(workdir))
    config = load_or_refuse(path, [f"{section}.{name}={text}"], name)
    if config is not None:
        assert_usable(config, path)
        assert_only_changed(config, base_loaded, section, name)
    assert_must_load(config, f"{section}.{name}={text}")


@property_settings(200)
@given(item=st.text() | st.builds("{}={}".format, st.text(max_size=30), st.text(max_size=10)))
@example(item="\x85=1")  # quoted raw, line break and all
@example(item="Global.batch_size=4")  # these four must load (MUST_LOAD)
@example(item="Global.device=cpu")
@example(item="SensitivityAnalysis.pruned_ratios=[0.5, 0.25, 0.5]")
@example(item="SensitivityAnalysis.target_loss=0.05")
def test_any_override_item_loads_or_names_the_override(workdir: Path, base_loaded: Config, item: str) -> None:
    path = write_config(workdir / "base.yaml", base_config(workdir))
    key = item.partition("=")[0].split(".")[1:2]  # Section.key.more=value: the key is checked first
    config = load_or_refuse(path, [item], "Override", *(printable(name) for name in key if name))
    if config is not None:  # it named a key of a section: only that key may have changed
        section, _, dotted = item.partition("=")[0].partition(".")
        assert_usable(config, path)
        assert_only_changed(config, base_loaded, section, dotted.partition(".")[0])
    assert_must_load(config, item)


@property_settings(200)
@given(text=st.text() | yaml_soup)
@example(text="Global:\n  data_dir: \x00")  # PyYAML's message about the character spans two lines
@example(text='Global: {"a\\nb": 1, "a\\nb": 2}')  # the repeated key was quoted raw, line break and all
@example(text="Global:\n  data_dir: d\n  arch: a\n  batch_size: 8")  # these two must load (MUST_LOAD_TEXT)
@example(text="Global: {arch: a, data_dir: d}\nSensitivityAnalysis: {pruned_ratios: [0.5]}\n")
def test_any_config_text_loads_or_names_the_file(workdir: Path, text: str) -> None:
    path = workdir / "text.yaml"
    path.write_text(text, encoding="utf-8", newline="")
    config = load_or_refuse(path, [], str(path), "Global", "SensitivityAnalysis")
    if config is not None:
        assert_usable(config, path)
    assert_must_load_text(config, text)


@property_settings(100)
@given(data=st.binary())
@example(data=b"\xc2\x9c")  # valid UTF-8 of a character YAML refuses: the same two-line message
@example(data=b"Global:\n  data_dir: d\n  arch: a\n  batch_size: 8")  # must load (MUST_LOAD_TEXT)
def test_any_config_bytes_load_or_name_the_file(workdir: Path, data: bytes) -> None:
    path = workdir / "bytes.yaml"
    path.write_bytes(data)
    config = load_or_refuse(path, [], str(path), "Global", "SensitivityAnalysis")
    if config is not None:
        assert_usable(config, path)
    assert_must_load_text(config, data.decode("utf-8", errors="replace"))


@property_settings(50)
@given(key=st.sampled_from(CLI_KEYS), value=yaml_values, as_override=st.booleans())
@example(key=("Global", "seed"), value=2**64, as_override=False)  # torch.manual_seed's ValueError: exit 1
@example(key=("Global", "val_list"), value="a\nb", as_override=False)  # the data error quoted it raw
@example(key=("Global", "device"), value="cuda:01", as_override=True)  # torch.device's RuntimeError: exit 1
# a budget this small overflowed the plan's units (OverflowError): exit 1
@example(key=("SensitivityAnalysis", "target_macs_reduction"), value=2.2250738585072014e-308, as_override=False)
@example(key=("Global", "batch_size"), value=4, as_override=True)  # must run (MUST_LOAD): exit 0
def test_cli_exits_0_or_2_for_any_value(workdir: Path, key: tuple[str, str], value: Any, as_override: bool) -> None:
    section, name = key
    data = base_config(workdir)
    overrides = [f"{section}.{name}={flow_yaml(value)}"] if as_override else []
    if not as_override:
        data[section][name] = value
    path = workdir / "cli.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    code = run_cli_checked(path, *overrides)
    if f"{section}.{name}={flow_yaml(value)}" in MUST_LOAD:
        assert code == 0


# ---- the list-file reader ------------------------------------------------------------------------------------------


def content_lines(text: str) -> list[tuple[int, str]]:
    """(line number, stripped text) of each line a list file's samples come from: universal newlines, blank lines
    and ``#`` comments skipped."""
    lines = [line.strip() for line in re.split(r"\r\n|\r|\n", text)]
    return [(number, line) for number, line in enumerate(lines, start=1) if line and not line.startswith("#")]


def first_fault(raw: bytes) -> int | None:
    """The number of the line a list file is refused for, or None when it is fine: the first line that is not UTF-8
    (the whole file is decoded first), else the first content line that is not '<path> <integer>'."""
    lines = re.split(rb"\r\n|\r|\n", raw.removeprefix(b"\xef\xbb\xbf"))
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return number
    for number, line in content_lines(b"\n".join(lines).decode("utf-8")):
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not is_int(parts[1]):
            return number
    return None


def is_int(text: str) -> bool:
    """Whether ``int(text)`` accepts ``text``."""
    try:
        int(text)
    except ValueError:
        return False
    return True


def check_list_file(workdir: Path, raw: bytes) -> None:
    """``raw`` as a list file reads to the samples of its content lines, or to a DataError naming the faulty line."""
    path = workdir / "list with space.txt"
    path.write_bytes(raw)
    fault = first_fault(raw)
    try:
        samples = read_sample_list(workdir, path)
    except DataError as error:
        assert_one_sentence(error, printable(path))
        assert fault is not None and f" line {fault}" in str(error), (fault, str(error))
        return
    assert fault is None
    expected = content_lines(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    assert [(s.label, s.source) for s in samples] == [
        (int(line.rsplit(maxsplit=1)[1]), f"{path} line {number}") for number, line in expected
    ]


@property_settings(300)
@given(raw=st.binary())
@example(raw=b"a 1\rb\xff 2")  # lines ended by \r alone: the undecodable byte was reported on line 1, not 2
def test_any_list_file_bytes_read_or_name_the_line(workdir: Path, raw: bytes) -> None:
    check_list_file(workdir, raw)


@property_settings(300)
@given(
    lines=st.lists(list_lines | st.binary(max_size=6).map(lambda b: b.decode("latin-1")), max_size=8),
    newline=newlines,
    bom=st.booleans(),
    latin1=st.booleans(),
)
def test_any_list_file_lines_read_or_name_the_line(
    workdir: Path, lines: list[str], newline: str, bom: bool, latin1: bool
) -> None:
    text = newline.join(lines)
    encoded = text.encode("latin-1", errors="replace") if latin1 else text.encode("utf-8")
    check_list_file(workdir, (b"\xef\xbb\xbf" if bom else b"") + encoded)


@property_settings(200)
@given(
    entries=st.lists(
        st.tuples(round_trip_paths, st.integers(0, 10**12), st.sampled_from([" ", "\t", "  ", " \t "])), max_size=6
    ),
    indent=st.sampled_from(["", " ", "\t"]),
    newline=newlines,
    bom=st.booleans(),
)
def test_listed_paths_and_labels_read_back_in_order(
    workdir: Path, entries: list[tuple[str, int, str]], indent: str, newline: str, bom: bool
) -> None:
    text = newline.join(f"{indent}{path}{gap}{label}{indent}" for path, label, gap in entries) + newline
    path = workdir / "round_trip.txt"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    samples = read_sample_list(workdir / "data", path)
    assert [(s.path, s.label) for s in samples] == [(str(workdir / "data" / p), label) for p, label, _ in entries]
    assert [s.source for s in samples] == [f"{path} line {n}" for n in range(1, len(entries) + 1)]


@property_settings(50)
@given(
    lines=st.lists(
        st.builds("val/img_{:04d}.png {}".format, st.integers(0, 19), labels) | list_lines, min_size=1, max_size=6
    ),
    newline=newlines,
)
@example(lines=["val/img_0000.png -1"], newline="\n")  # a negative label: read, then refused by the label check
@example(lines=["val/img_0000.png 3", "a\x0cb 1"], newline="\n")  # the missing image was quoted raw, form feed and all
@example(lines=["\ufeff"], newline="\n")  # only a byte-order mark: no images
@example(lines=["val/img_0000.png 1", "a\x00b 2"], newline="\r")  # a NUL in a missing image's path
def test_cli_exits_0_or_2_for_any_list_file(workdir: Path, lines: list[str], newline: str) -> None:
    text = newline.join(lines)
    (workdir / "data" / "cli_list.txt").write_text(text, encoding="utf-8", newline="")
    path = write_config(workdir / "list.yaml", base_config(workdir))
    # absolute losses: a random model on a few images may well have a baseline top1 of 0, which relative ones refuse
    code = run_cli_checked(path, "Global.val_list=cli_list.txt", "SensitivityAnalysis.metric_mode=absolute")
    images = {os.path.normpath(workdir / "data" / "val" / f"img_{i:04d}.png") for i in range(20)}
    body = text.removeprefix("\ufeff")  # a byte-order mark
    listed = [line.rsplit(maxsplit=1) for _, line in content_lines(body)] if first_fault(text.encode()) is None else []
    runs = bool(listed) and all(
        os.path.normpath(workdir / "data" / name) in images and 0 <= int(label) < LABELS for name, label in listed
    )
    assert (code == 0) == runs, text


# ---- the ratios YAML reader (run.py verify --ratios) ---------------------------------------------------------


@pytest.fixture(scope="module")
def ratios_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the examples of a property (Hypothesis runs many examples in one test call)."""
    return tmp_path_factory.mktemp("ratios")


ratio_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # nan and +-inf included
    | st.text(max_size=8)
)


ratio_values = st.recursive(
    ratio_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


ratio_names = (
    st.sampled_from(["0.weight", "1.weight", "layer1.0.conv1.weight", "fc", "", "yes", "0.5", "a: b"]) | st.text()
)


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` seven times in eight, else ``odd`` (one_of would give each strategy the same share)."""
    return st.integers(0, 7).flatmap(lambda pick: odd if pick == 0 else usual)


name_items = mostly(ratio_names, ratio_scalars)  # repeats are likely


ratio_items = mostly(
    st.floats(0, 1, exclude_max=True) | st.sampled_from([0, 0.0, -0.0, 0.999999, 1e-7]),
    st.sampled_from([1, 1.0, 0.9999996, math.nan, math.inf, -math.inf, -0.1, "0.5", True, False]) | ratio_scalars,
)


def is_ratio(value: Any) -> bool:
    """What the reader must accept as a ratio: a number (not a boolean) in [0, 1) still below 1 at 6 decimals."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < 1
        and round(float(value), 6) < 1
    )


@st.composite
def ratios_documents(draw: st.DrawFn) -> tuple[str, dict[str, float] | None]:
    """A YAML document around a ChannelPrune block, and the ratios it must load to (``None``: it must be refused).

    The block may repeat a param, a key or itself, miss a key, or hold ratios of another length or kind; other
    blocks of any YAML may stand around it."""
    count = draw(st.integers(0, 4))
    listed = draw(st.lists(name_items, min_size=count, max_size=count))
    aligned = draw(st.integers(0, 3)) > 0
    ratios = draw(st.lists(ratio_items, min_size=count, max_size=count) if aligned else ratio_items | ratio_values)
    pairs: list[tuple[str, Any]] = [("criterion", "l1_norm"), ("prune_params_name", listed), ("pruned_ratio", ratios)]
    pairs = list(draw(st.permutations(pairs)))
    change = draw(st.sampled_from(["none"] * 5 + ["repeat key", "drop key", "repeat block"]))
    if change == "repeat key":
        pairs.append((draw(st.sampled_from(pairs))[0], draw(ratio_values)))
    if change == "drop key":
        pairs.remove(draw(st.sampled_from(pairs)))
    block = "ChannelPrune:\n" + "".join(f"  {key}: {flow_yaml(value)}\n" for key, value in pairs)
    others = draw(st.dictionaries(st.sampled_from(["Global", "ElementPrune", "x"]), ratio_values, max_size=2))
    blocks = block * (2 if change == "repeat block" else 1)
    text = (yaml.safe_dump(others, allow_unicode=True) if others else "") + blocks
    keys = [key for key, _ in pairs]
    valid = (
        change != "repeat block"
        and len(set(keys)) == len(keys)
        and {"prune_params_name", "pruned_ratio"} <= set(keys)
        and all(isinstance(name, str) for name in listed)
        and len(set(listed)) == len(listed)
        and ((isinstance(ratios, list) and len(ratios) == count and all(map(is_ratio, ratios))) or is_ratio(ratios))
    )
    values = ratios if isinstance(ratios, list) else [ratios] * count
    return text, dict(zip(listed, map(float, values), strict=True)) if valid else None


def load_ratios_or_refuse(path: Path) -> dict[str, float] | None:
    """Load ``path``: a dict of names and finite ratios in [0, 1), or ``None`` for a one-sentence UserError naming
    the file (any other exception fails the test)."""
    try:
        ratios = load_ratios_yaml(path)
    except UserError as error:
        assert_one_sentence(error, str(path))
        event("refused")
        return None
    event("loaded")
    assert all(isinstance(name, str) and type(ratio) is float for name, ratio in ratios.items())
    assert all(0.0 <= ratio < 1.0 and math.isfinite(ratio) for ratio in ratios.values())
    return ratios


@property_settings(300)
@given(document=ratios_documents())
@example(document=(RATIOS_HEAD + "  prune_params_name: [a, a]\n  pruned_ratio: [0.1, 0.2]\n", None))  # the last won
@example(document=(VALID_RATIOS + VALID_RATIOS, None))  # the second block won
@example(document=(RATIOS_HEAD + "  prune_params_name: [a]\n  pruned_ratio: [.nan]\n", None))  # nan was loaded
@example(
    document=(RATIOS_HEAD + "  prune_params_name: [a, b]\n  pruned_ratio: 0\n", {"a": 0.0, "b": 0.0})
)  # 0: not pruned
def test_any_ratios_document_loads_its_listed_pairs_or_names_the_file(
    ratios_dir: Path, document: tuple[str, dict[str, float] | None]
) -> None:
    text, expected = document
    path = ratios_dir / "document.yaml"
    path.write_text(text)
    ratios = load_ratios_or_refuse(path)
    assert ratios == expected
    if ratios is not None:
        assert list(ratios) == list(expected or {})  # in the file's order


# Pieces of YAML syntax, so that whole-file bytes reach the parser's corners (anchors, tags, flow_yaml, indentation).
ratios_soup = st.lists(
    st.sampled_from([
        "ChannelPrune:", "  prune_params_name:", "  pruned_ratio:", "  - 0.weight", "  - 0.5", " [0.weight]", " [0.5]",
        "&a ", "*a", "<<: *a", "- ", ": ", "!!python/object:os.system ", "!!binary ", "!!set ", "{", "}", "[", "]",
        ",", "'", '"', "\n", "\r\n", "\t", "  ", "#", "---\n", "...\n", "\x00", "\x85", "\ufeff", ".nan", "1e309",
        "2001-02-30", "~", "yes",
    ]) | st.text(max_size=3),
    max_size=30,
).map(lambda pieces: "".join(pieces).encode("utf-8"))  # fmt: skip


@property_settings(300)
@given(data=st.binary() | ratios_soup)
@example(data=b"ChannelPrune: {prune_params_name: [\xff], pruned_ratio: 0.5}")  # UnicodeDecodeError
@example(data=b"ChannelPrune: 2001-02-30")  # PyYAML's date raised ValueError
@example(data=b"x: " + b"[" * 3000 + b"]" * 3000)  # RecursionError
def test_any_ratios_bytes_load_or_name_the_file(ratios_dir: Path, data: bytes) -> None:
    path = ratios_dir / "bytes.yaml"
    path.write_bytes(data)
    load_ratios_or_refuse(path)


@property_settings(200)
@given(
    ratios=st.dictionaries(st.text(), st.floats(0, 0.999999) | st.just(0.0), max_size=6),
    target=st.none() | st.floats(0, 1),
    ordered=st.integers(0, 6),
)
@example(ratios={"\x85": 0.5}, target=None, ordered=0)  # written raw in single quotes, it read back as " "
@example(ratios={"a": 1e-7, "b": 0.0, "c": 0.3}, target=0.02, ordered=1)  # rounds to 0: left out like 0
def test_written_ratios_read_back_rounded_without_the_unpruned(
    ratios_dir: Path, ratios: dict[str, float], target: float | None, ordered: int
) -> None:
    order = list(ratios)[::-1][:ordered]  # model order for some names; the rest follow in their own order
    path = ratios_dir / "written.yaml"
    path.write_text(channel_prune_yaml(ratios, order, "l1_norm", target))
    names = order + [name for name in ratios if name not in order]
    kept = {name: round(ratios[name], 6) for name in names if round(ratios[name], 6) > 0}
    read = load_ratios_yaml(path)
    assert read == kept
    assert list(read) == list(kept)


# ---- the measured plan's search log -------------------------------------------------------------------------

log_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats()  # nan and +-inf included: json.dumps writes them as NaN and Infinity tokens
    | st.text(max_size=6)
)


log_junk = st.recursive(
    log_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


log_groups = st.sampled_from(["0.weight", "3.weight", "layer1.conv1.weight"])


valid_picks = st.lists(
    st.tuples(log_groups, log_groups, st.integers(1, 64)).map(list), max_size=3, unique_by=lambda p: p[0]
)


valid_metrics = st.fixed_dictionaries(
    {"top1": st.floats(0, 1), "ce": st.floats(0, 20)},
    optional={"top5": st.floats(0, 1), "images": st.integers(0, 10**6)},
)


@st.composite
def log_records(draw: st.DrawFn) -> str:
    """A JSON line around a valid record: usually intact, else with fields removed, replaced, or added to."""
    data: dict[str, Any] = {
        "key": draw(st.sampled_from([SEARCH_KEY, SEARCH_KEY, "another search"])),
        "setting": draw(st.sampled_from(["search", "full"])),
        "picks": draw(valid_picks),
        "metrics": draw(valid_metrics),
        "macs": draw(st.integers(0, 10**12)),
        "params": draw(st.integers(0, 10**9)),
        "seconds": draw(st.floats(0, 1e4)),
    }
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        kind = draw(st.sampled_from(["remove", "replace", "metric", "pick", "add"]))
        if kind == "remove":
            data.pop(draw(st.sampled_from(SEARCH_FIELDS)), None)
        elif kind == "replace":
            data[draw(st.sampled_from(SEARCH_FIELDS))] = draw(log_junk)
        elif kind == "metric" and isinstance(data.get("metrics"), dict):
            data["metrics"][draw(st.sampled_from(["top1", "ce", "top5", "x"]))] = draw(log_junk)
        elif kind == "pick" and isinstance(data.get("picks"), list) and data["picks"]:
            pick = data["picks"][0]
            if isinstance(pick, list):
                pick[draw(st.integers(0, len(pick) - 1))] = draw(log_junk)
        else:
            data[draw(st.text(max_size=5))] = draw(log_junk)
    return json.dumps(data)


odd_lines = st.sampled_from(["", " ", "{}", "[]", "null", "NaN", "-Infinity", "[" * 3000, "1" * 5000, "\x00", "\ufeff"])


log_lines = st.lists(log_records(), min_size=1, max_size=4) | st.lists(
    log_records() | odd_lines | st.text(max_size=12), max_size=5
)


def check_log(workdir: Path, raw: bytes) -> None:
    """The log ``raw`` loads with every record well-typed (and its last partial line cut), or is refused by an
    AnalysisFileError naming the file and its first damaged line, the file left as it was."""
    analysis_file = workdir / "s.pkl"
    path = search_log_path(analysis_file)
    path.write_bytes(raw)
    complete = raw[: raw.rfind(b"\n") + 1]
    lines = complete.split(b"\n")[:-1]
    try:
        log = SearchLog(analysis_file, SEARCH_DESCRIPTION)
    except AnalysisFileError as error:
        message = str(error)
        assert message.isprintable() and message.endswith(".") and str(path) in message, message
        found = re.search(r" line (\d+) is damaged \(", message)
        assert found is not None, message
        number = int(found.group(1))
        assert 1 <= number <= len(lines) and path.read_bytes() == raw
        path.write_bytes(lines[number - 1] + b"\n")  # that line alone is refused too ...
        with pytest.raises(AnalysisFileError, match=" line 1 is damaged"):
            SearchLog(analysis_file, SEARCH_DESCRIPTION)
        path.write_bytes(b"".join(line + b"\n" for line in lines[: number - 1]))  # ... and the lines before it load
        SearchLog(analysis_file, SEARCH_DESCRIPTION)
        event("refused")
        return
    event(f"loaded with {'no' if not log.entries else 'some'} record(s) of this search")
    assert path.read_bytes() == complete
    assert len(log.entries) <= len(lines)
    for entry in log.entries:
        assert entry.key == SEARCH_KEY and isinstance(entry.setting, str)
        assert all(isinstance(group, str) and isinstance(param, str) and type(count) is int and count >= 1
                   for group, param, count in entry.picks)  # fmt: skip
        picks = {group: (param, count) for group, param, count in entry.picks}
        score = log.get(entry.setting, picks)
        assert score is not None and {"top1", "ce"} <= score.metrics.keys()
        assert all(type(value) in (int, float) and math.isfinite(value) for value in score.metrics.values())
        assert type(score.macs) is int and type(score.params) is int and score.macs >= 0 and score.params >= 0
        assert type(score.seconds) in (int, float) and math.isfinite(score.seconds)


@property_settings(300)
@given(lines=log_lines, ending=st.sampled_from([b"\n", b"", b'{"key": "cut']))
@example(lines=[json.dumps(search_record(metrics={"top1": "x", "ce": 1.0}))], ending=b"\n")  # TypeError in the search
@example(lines=[json.dumps(search_record(seconds=math.nan))], ending=b"\n")  # a NaN token Python's json accepted
@example(lines=[json.dumps(search_record(picks=[["a", "b", 1], [1, 2, 3]]))], ending=b"\n")  # sorted() raised TypeError
@example(lines=[json.dumps(search_record(picks="ab"))], ending=b"\n")  # a string passed as picks
@example(lines=["[" * 3000], ending=b"\n")  # RecursionError
@example(lines=[json.dumps(search_record(key="another search", macs="big"))], ending=b"\n")  # another search's record
def test_any_search_log_lines_load_well_typed_or_name_the_line(workdir: Path, lines: list[str], ending: bytes) -> None:
    check_log(workdir, "\n".join(lines).encode("utf-8") + ending)


@property_settings(200)
@given(raw=st.binary())
@example(raw=b"\xff\n")  # not UTF-8
@example(raw=b"NaN\n")
def test_any_search_log_bytes_load_or_name_the_line(workdir: Path, raw: bytes) -> None:
    check_log(workdir, raw)

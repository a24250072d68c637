"""The docs' configuration reference is generated from the schema: every key is described, listed once with its type
and default, a key without a description fails the build, and the described schema loads as before."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from analysis import config
from analysis.config import (
    ACT_BLOCKS,
    CHANNEL_PRUNE_DEFAULTS,
    GLOBAL_ALIASES,
    IGNORED_GLOBAL_KEYS,
    SECTIONS,
    Config,
    load_config,
    setting,
)
from analysis.config_reference import config_reference_markdown, undescribed_keys

ROOT = Path(__file__).resolve().parent.parent


def section_rows(markdown: str, section: str) -> list[list[str]]:
    """The table rows under ``## `section```, split into cells (an escaped ``\\|`` stays inside its cell)."""
    body = markdown.split(f"\n## `{section}`\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def row_of(markdown: str, section: str, key: str) -> list[str]:
    matches = [row for row in section_rows(markdown, section) if row[0] == f"`{key}`"]
    assert len(matches) == 1, f"{section}.{key} has {len(matches)} rows"
    return matches[0]


def test_every_key_of_every_section_has_a_description() -> None:
    assert undescribed_keys() == []
    for name, cls in SECTIONS.items():
        for item in dataclasses.fields(cls):
            doc = item.metadata.get("doc")
            assert isinstance(doc, str) and doc.strip(), f"{name}.{item.name} has no doc"


def test_the_reference_lists_every_key_once_with_its_type_default_and_meaning() -> None:
    markdown = config_reference_markdown()
    for name, cls in SECTIONS.items():
        rows = section_rows(markdown, name)
        assert [row[0] for row in rows] == [f"`{item.name}`" for item in dataclasses.fields(cls)]  # once, in order
        for item, row in zip(dataclasses.fields(cls), rows, strict=True):
            assert len(row) == 4, row
            shown = item.metadata["shown_default"]
            assert row[2] == shown if shown else re.fullmatch(r"`[^`]+`", row[2]), row
            assert " ".join(item.metadata["doc"].split()).replace("|", "\\|") in row[3]


@pytest.mark.parametrize(
    ("section", "key", "kind", "default"),
    [
        ("Global", "batch_size", "int", "`32`"),
        ("Global", "arch_kwargs", "mapping", "`{}`"),
        ("Global", "trust_model_file", "bool", "`false`"),
        ("Global", "device", "str", "`auto`"),
        ("Global", "device_cache_share", "float", "`0.5`"),
        ("Global", "max_image_pixels", "int or null", "`178956970` (Pillow's own refusal threshold)"),
        ("Global", "num_workers", "int or null", "cores (max 8)"),
        ("Global", "mean", "list of float", "ImageNet (`[0.485, 0.456, 0.406]`), or the model's own"),
        ("SensitivityAnalysis", "pruned_ratios", "list of float", "`[0.1, 0.2, 0.3, 0.4]`"),
        ("SensitivityAnalysis", "target_loss", "float or null", "`null`"),
        ("SensitivityAnalysis", "precision", "float, int, str or null", "`null`"),
        ("SensitivityAnalysis", "prune_params_name", "list of str or null", "all prunable"),
        ("SensitivityAnalysis", "skip_params", "list of str", "`[]`"),
        ("SensitivityAnalysis", "export_onnx", "bool", "`true`"),
        ("SensitivityAnalysis", "analysis_file", "str or null", "`outputs/<config name>/sensitivity.pkl`"),
        ("SensitivityAnalysis", "eval_budget", "int or null", "10 per group"),
    ],
)
def test_a_row_shows_the_type_and_the_default_in_yaml_spelling(section: str, key: str, kind: str, default: str) -> None:
    assert row_of(config_reference_markdown(), section, key)[1:3] == [kind, default]


def test_the_intro_comes_from_the_loader_constants_and_links_point_at_docs_pages() -> None:
    markdown = config_reference_markdown()
    intro = markdown.split("\n## ", 1)[0]
    for name in [*ACT_BLOCKS, *IGNORED_GLOBAL_KEYS, *GLOBAL_ALIASES, *GLOBAL_ALIASES.values()]:
        assert f"`{name}`" in intro
    for key in CHANNEL_PRUNE_DEFAULTS:
        assert f"`ChannelPrune.{key}`" in intro
    assert "`crop_size` is accepted as an alias" in row_of(markdown, "Global", "img_size")[3]
    assert "\\|\\|" in row_of(markdown, "SensitivityAnalysis", "metric")[3]  # KL(p || q), escaped in its cell
    assert "](#" not in markdown  # README anchors would be dead links on the docs site
    assert "](../configuration.md#models)" in row_of(markdown, "Global", "arch")[3]


@dataclass
class Toy:
    """A block for the test."""

    described: int = setting(1, doc="has one")
    bare: int = 2
    blank: list[str] = setting(factory=list, doc="  ")


def test_a_key_without_a_description_fails_the_generator_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert undescribed_keys({"Toy": Toy}) == ["Toy.bare", "Toy.blank"]
    with pytest.raises(ValueError, match=r"without a description.*: Toy\.bare, Toy\.blank; give each a doc="):
        config_reference_markdown({"Toy": Toy})
    monkeypatch.setattr(config, "SECTIONS", {**SECTIONS, "Toy": Toy})  # the docs build reads SECTIONS when it runs
    with pytest.raises(ValueError, match=r": Toy\.bare, Toy\.blank;"):
        config_reference_markdown()


def test_setting_builds_a_plain_dataclass_field() -> None:
    assert Toy().blank is not Toy().blank  # a factory, not one shared list
    with pytest.raises(TypeError, match="not both"):
        setting(1, factory=list, doc="x")


def test_the_generator_loads_no_torch() -> None:
    code = "import sys, analysis.config_reference; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"


def test_the_described_schema_loads_as_before() -> None:
    loaded = load_config(ROOT / "configs" / "demo" / "digits_mobilenet.yaml")
    g, s = loaded.Global, loaded.SensitivityAnalysis
    # from the YAML
    assert (g.arch, g.arch_kwargs, g.batch_size, g.resize_size, g.img_size, g.num_workers) == (
        "mobilenet_v2", {"num_classes": 10, "width_mult": 0.5}, 128, 32, 28, 0
    )  # fmt: skip
    assert (s.pruned_ratios, s.target_loss, s.analysis_file) == (
        [0.1, 0.2, 0.3, 0.4], 0.02, "outputs/demo/digits_mobilenet/sensitivity.pkl"
    )  # fmt: skip
    # defaults
    assert (g.interpolation, g.val_list, g.calib_samples, g.max_image_pixels, g.labels, g.seed) == (
        "bilinear", "val_list.txt", 1024, 178_956_970, "required", 0
    )  # fmt: skip
    assert g.mean == pytest.approx([0.485, 0.456, 0.406]) and g.std == pytest.approx([0.229, 0.224, 0.225])
    assert (s.engine, s.decision_error, s.skip_params, s.units, s.export_onnx, s.report) == (
        "fast", 0.05, [], None, True, True
    )  # fmt: skip
    assert OmegaConf.to_object(OmegaConf.structured(Config)) == Config()  # OmegaConf sees the same defaults

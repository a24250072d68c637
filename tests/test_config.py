"""Config loading: defaults, aliases, ACT blocks, precedence, and one clear sentence for every mistake."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from analysis.config import (
    ACT_BLOCKS,
    SensitivityConfig,
    derive,
    load_config,
    normalise_ratios,
    validate_section,
)
from analysis.errors import ConfigError

from helpers import write_config


def minimal(tmp_path: Path, **sections: dict) -> Path:
    data = {"Global": {"arch": "resnet18", "data_dir": str(tmp_path)}}
    for name, block in sections.items():
        data.setdefault(name, {}).update(block)
    return write_config(tmp_path / "cfg.yaml", data)


def test_defaults_match_the_documented_values(tmp_path: Path) -> None:
    config = load_config(minimal(tmp_path))
    g, s = config.Global, config.SensitivityAnalysis
    assert (g.img_size, g.resize_size, g.batch_size, g.val_list) == (224, 256, 32, "val_list.txt")
    assert g.interpolation == "bilinear" and g.device == "auto" and g.trust_model_file is False
    assert g.mean == pytest.approx([0.485, 0.456, 0.406]) and g.std == pytest.approx([0.229, 0.224, 0.225])
    assert s.pruned_ratios == [0.1, 0.2, 0.3, 0.4]
    assert (s.criterion, s.metric, s.target_loss, s.prune_params_name) == ("l1_norm", "top1", None, None)
    assert s.analysis_file == str(Path("outputs") / "cfg" / "sensitivity.pkl")


def test_crop_size_is_an_alias_of_img_size_and_paddle_reader_keys_are_ignored(tmp_path: Path) -> None:
    path = minimal(tmp_path, Global={"crop_size": 192, "input_name": "x", "reader_config": "reader.yml"})
    assert load_config(path).Global.img_size == 192


def test_conflicting_aliases_are_an_error(tmp_path: Path) -> None:
    path = minimal(tmp_path, Global={"crop_size": 192, "img_size": 224})
    with pytest.raises(ConfigError, match=r"Global\.img_size.*aliases"):
        load_config(path)


def test_act_blocks_are_listed_as_ignored_and_channel_prune_lends_defaults(tmp_path: Path) -> None:
    path = minimal(
        tmp_path,
        Distillation={"alpha": 1.0, "loss": "l2"},
        ChannelPrune={"pruned_ratio": 0.25, "criterion": "bn_scale", "prune_params_name": ["conv1.weight"]},
        TrainConfig={"epochs": 1},
        QuantAware={"weight_bits": 8},
    )
    config = load_config(path)
    assert config.ignored_blocks == ["Distillation", "ChannelPrune", "TrainConfig", "QuantAware"]
    assert config.SensitivityAnalysis.criterion == "bn_scale"
    assert config.SensitivityAnalysis.prune_params_name == ["conv1.weight"]


def test_analysis_block_wins_over_channel_prune(tmp_path: Path) -> None:
    path = minimal(
        tmp_path,
        ChannelPrune={"criterion": "bn_scale"},
        SensitivityAnalysis={"criterion": "l2_norm"},
    )
    assert load_config(path).SensitivityAnalysis.criterion == "l2_norm"


def test_every_act_block_is_accepted(tmp_path: Path) -> None:
    path = minimal(tmp_path, **{name: {"anything": 1} for name in ACT_BLOCKS})
    assert load_config(path).ignored_blocks == list(ACT_BLOCKS)


def test_unknown_top_level_block_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = minimal(tmp_path, Distilation={"alpha": 1})
    with caplog.at_level(logging.WARNING, logger="analysis"):
        config = load_config(path)
    assert "Distilation" in config.ignored_blocks
    assert "Unknown top-level block 'Distilation'" in caplog.text


def test_precedence_flag_over_override_over_yaml_over_default(tmp_path: Path) -> None:
    path = minimal(tmp_path, Global={"batch_size": 16}, SensitivityAnalysis={"target_loss": 0.1})
    config = load_config(
        path,
        overrides=["Global.batch_size=64", "SensitivityAnalysis.target_loss=0.2", "SensitivityAnalysis.metric=top5"],
        flags={"SensitivityAnalysis.target_loss": 0.3, "SensitivityAnalysis.analysis_file": None},
    )
    assert config.Global.batch_size == 64  # override beats YAML
    assert config.SensitivityAnalysis.target_loss == 0.3  # flag beats override
    assert config.SensitivityAnalysis.metric == "top5"  # override beats default
    assert config.Global.img_size == 224  # default survives


def test_overrides_reach_nested_mappings_and_lists(tmp_path: Path) -> None:
    path = minimal(tmp_path, Global={"arch_kwargs": {"num_classes": 10, "width_mult": 0.5}})
    config = load_config(path, overrides=["Global.arch_kwargs.num_classes=5", "SensitivityAnalysis.skip_params=[a,b]"])
    assert config.Global.arch_kwargs == {"num_classes": 5, "width_mult": 0.5}
    assert config.SensitivityAnalysis.skip_params == ["a", "b"]


def test_ratios_are_rounded_deduplicated_and_sorted() -> None:
    assert normalise_ratios([0.30000000000000004, 0.1, 0.3], "k") == [0.1, 0.3]


@pytest.mark.parametrize(
    ("sections", "overrides", "message"),
    [
        ({"Global": {"batch_sise": 8}}, [], r"Unknown key Global\.batch_sise \(did you mean 'batch_size'\?\)"),
        ({"SensitivityAnalysis": {"pruned_ratio": [0.1]}}, [], r"SensitivityAnalysis\.pruned_ratio .*'pruned_ratios'"),
        ({"Global": {"batch_size": "abc"}}, [], r"Global\.batch_size must be an integer, got 'abc'"),
        ({"Global": {"mean": ["a", 1, 2]}}, [], r"Global\.mean\[0\] must be a number"),
        ({"SensitivityAnalysis": {"pruned_ratios": [0.1, 1.5]}}, [], r"pruned_ratios must hold ratios strictly.*1\.5"),
        ({"SensitivityAnalysis": {"pruned_ratios": [0.0]}}, [], r"strictly between 0 and 1, got 0\.0"),
        ({"SensitivityAnalysis": {"pruned_ratios": []}}, [], r"pruned_ratios is empty"),
        ({"SensitivityAnalysis": {"criterion": "l1norm"}}, [], r"criterion must be one of .*did you mean 'l1_norm'"),
        ({"SensitivityAnalysis": {"metric": "acc"}}, [], r"metric must be one of top1, top5, ce"),
        ({"SensitivityAnalysis": {"target_loss": 2.0}}, [], r"target_loss must be a relative loss"),
        ({"Global": {"interpolation": "bilinaer"}}, [], r"interpolation .*did you mean 'bilinear'"),
        ({"Global": {"resize_size": 200}}, [], r"resize_size \(200\) is smaller than Global\.img_size \(224\)"),
        ({"Global": {"std": [0.2, 0.0, 0.2]}}, [], r"Global\.std values must be positive"),
        ({"Global": {"device": "gpu"}}, [], r"Global\.device must be auto, cpu, cuda or cuda:N"),
        ({}, ["Global.batch_size"], r"must look like Section\.key=value"),
        ({}, ["Globl.batch_size=3"], r"unknown section 'Globl' \(did you mean 'Global'\?\)"),
        ({}, ["Global.imgsize=3"], r"Unknown key Global\.imgsize \(did you mean 'img_size'\?\)"),
        ({}, ["Global.batch_size=0"], r"Global\.batch_size must be a positive integer"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, sections: dict, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(minimal(tmp_path, **sections), overrides=overrides)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("Global:\n  arch: resnet18\n  data_dir: [unclosed\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml line \d+, column \d+: invalid YAML"):
        load_config(path)


@pytest.mark.parametrize("text", ["Distillation:\n  alpha: 1\n", "Global:\n", "- a\n- b\n", ""])
def test_missing_or_malformed_global(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"no Global block|is empty|must be a mapping"):
        load_config(path)


def test_data_dir_and_model_are_required(tmp_path: Path) -> None:
    path = write_config(tmp_path / "a.yaml", {"Global": {"arch": "resnet18"}})
    with pytest.raises(ConfigError, match=r"Global\.data_dir is not set"):
        load_config(path)
    path = write_config(tmp_path / "b.yaml", {"Global": {"data_dir": "x"}})
    with pytest.raises(ConfigError, match=r"Global has no model"):
        load_config(path)


@pytest.mark.parametrize(
    ("analysis", "message"),
    [
        ({"precision": "decision"}, r"SensitivityAnalysis\.precision: decision .* set target_loss"),
        ({"precision": "exact"}, r"SensitivityAnalysis\.precision must be a number between 0 and 1 .* or decision"),
        ({"precision": 1}, r"SensitivityAnalysis\.precision must be between 0 and 1 .* got 1"),
        ({"precision": "decision", "target_loss": 0.02, "decision_error": 0}, r"SensitivityAnalysis\.decision_error"),
        ({"decision_precision": 0.01}, r"SensitivityAnalysis\.decision_precision is set but .*precision is not"),
    ],
)
def test_sampling_settings_are_checked_with_their_keys(tmp_path: Path, analysis: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(minimal(tmp_path, SensitivityAnalysis=analysis))


def test_decision_sampling_loads_with_its_target(tmp_path: Path) -> None:
    analysis = {"precision": "decision", "target_loss": 0.02, "decision_precision": 0.004}
    s = load_config(minimal(tmp_path, SensitivityAnalysis=analysis)).SensitivityAnalysis
    assert (s.precision, s.target_loss, s.decision_error, s.decision_precision) == ("decision", 0.02, 0.05, 0.004)


# One list of invalid analysis settings, given as YAML keys and as analysis_prune's keyword arguments (the same names);
# those NNI's SensitivityAnalysis takes too are also given to it, under its names (NNI_NAMES). Every entry runs the same
# validation, so each is refused by all of them with the same sentence (the YAML names the key with its section).
SHARED_REFUSALS: dict[str, dict[str, object]] = {
    "empty ratios": {"pruned_ratios": []},
    "ratio of 1": {"pruned_ratios": [0.5, 1.0]},
    "ratio that rounds to 0": {"pruned_ratios": [1e-7]},
    "target_loss above 1": {"target_loss": 1.5},
    "unknown criterion": {"criterion": "l3_norm"},
    "unknown metric": {"metric": "top3"},
    "unknown metric_mode": {"metric_mode": "ratio"},
    "unknown group_reduction": {"group_reduction": "max"},
    "unknown engine": {"engine": "turbo"},
    "unknown granularity": {"granularity": "kernel"},
    "precision above 1": {"precision": 2},
    "decision without target_loss": {"precision": "decision"},
    "decision_precision alone": {"decision_precision": 0.01},
    "unknown unit kind": {"units": ["conv", "kernels"]},
    "unknown early_stop_mode": {"early_stop_mode": "never", "early_stop_value": 0.1},
    "misspelt early_stop_mode": {"early_stop_mode": "dropd", "early_stop_value": 0.1},  # the YAML suggests 'dropped'
    "early_stop_value alone": {"early_stop_value": 0.1},
    "round_to 0": {"round_to": 0},
    "round_to with element granularity": {"round_to": 8, "granularity": "element"},  # the API used to accept it
    "ranking criterion with element granularity": {"criterion": "geometry_median", "granularity": "element"},
    "empty analysis_file": {"analysis_file": ""},  # NNI's class used to accept it
}
NNI_NAMES = {"pruned_ratios": "sparsities", "early_stop_mode": "early_stop_mode",
             "early_stop_value": "early_stop_value", "analysis_file": "analysis_file"}  # fmt: skip


@pytest.mark.parametrize("case", list(SHARED_REFUSALS))
def test_the_yaml_and_the_python_apis_refuse_the_same_settings(case: str, tmp_path: Path) -> None:
    from analysis import SensitivityAnalysis, analysis_prune

    from helpers import batches
    from tiny_models import tiny_cnn

    settings = SHARED_REFUSALS[case]
    config = write_config(tmp_path / "c.yaml", {
        "Global": {"arch": "resnet18", "data_dir": str(tmp_path)},
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "yaml.pkl"), **settings},
    })  # fmt: skip
    with pytest.raises(ConfigError) as from_yaml:
        load_config(config)
    expected = str(from_yaml.value).replace("SensitivityAnalysis.", "")
    api_settings = {"analysis_file": tmp_path / "api.pkl", **settings}
    with pytest.raises(ConfigError) as from_python:
        analysis_prune(tiny_cnn(), batches(1), **api_settings)  # type: ignore[arg-type]
    assert str(from_yaml.value).startswith("SensitivityAnalysis.")
    assert str(from_python.value) == expected
    if set(settings) <= set(NNI_NAMES):
        nni_settings = {NNI_NAMES[key]: value for key, value in settings.items()}
        with pytest.raises(ConfigError) as from_nni:
            SensitivityAnalysis(tiny_cnn(), lambda: 0.0, **nni_settings)  # type: ignore[arg-type]
        assert str(from_nni.value) == expected.replace("pruned_ratios", "sparsities")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["c.yaml"]  # refused before anything was written


# A loaded config is frozen: a step that needs another value derives a new, validated config


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("Global", "device", "cpu"), ("SensitivityAnalysis", "verify", True), (None, "command_line_keys", [])],
)
def test_a_loaded_config_refuses_assignment(tmp_path: Path, section: str | None, key: str, value: object) -> None:
    config = load_config(minimal(tmp_path))
    target = config if section is None else getattr(config, section)
    before = getattr(target, key)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(target, key, value)
    assert getattr(target, key) == before


def test_derive_returns_a_validated_copy_and_leaves_the_config_as_it_was(tmp_path: Path) -> None:
    config = load_config(minimal(tmp_path, SensitivityAnalysis={"target_loss": 0.02}))
    derived = derive(
        config, {"Global.batch_size": "64", "SensitivityAnalysis.pruned_ratios": [0.30000000000000004, 0.1]}
    )
    assert derived.Global.batch_size == 64  # converted like a YAML value
    assert derived.SensitivityAnalysis.pruned_ratios == [0.1, 0.3]  # normalised like a loaded config's ratios
    assert (config.Global.batch_size, config.SensitivityAnalysis.pruned_ratios) == (32, [0.1, 0.2, 0.3, 0.4])
    assert derive(config, {}) == config
    with pytest.raises(ConfigError, match=r"Global.batch_size must be a positive integer, got 0\."):
        derive(config, {"Global.batch_size": 0})
    with pytest.raises(ConfigError, match=r"Global.batch_size must be an integer, got 'many'\."):
        derive(config, {"Global.batch_size": "many"})
    with pytest.raises(KeyError, match=r"Global\.batchsize"):
        derive(config, {"Global.batchsize": 8})


def test_derived_values_count_as_command_line_only_when_they_carry_out_a_flag(tmp_path: Path) -> None:
    config = load_config(minimal(tmp_path), ["Global.seed=3"])
    assert config.command_line_keys == ["Global.seed"]
    flagged = derive(config, {"SensitivityAnalysis.target_macs_reduction": 0.4})
    assert flagged.command_line_keys == ["Global.seed", "SensitivityAnalysis.target_macs_reduction"]
    assert "SensitivityAnalysis.target_macs_reduction" in flagged.explicit_keys
    worked_out = derive(config, {"Global.device": "cpu"}, command_line=False)
    assert (worked_out.command_line_keys, worked_out.explicit_keys) == (config.command_line_keys, config.explicit_keys)
    with pytest.raises(ValueError, match=r"SensitivityAnalysis\.runtime_command runs a command"):
        derive(config, {"SensitivityAnalysis.runtime_command": "echo {onnx}"}, command_line=False)
    given = derive(config, {"SensitivityAnalysis.runtime_command": "echo {onnx}"})  # the user's flag: honoured
    assert given.SensitivityAnalysis.runtime_command == "echo {onnx}"


def test_verify_with_a_ratios_file_needs_no_target(tmp_path: Path) -> None:
    path = minimal(tmp_path)
    flags = {"SensitivityAnalysis.verify": True}
    with pytest.raises(ConfigError, match=r"SensitivityAnalysis\.verify needs ratios to apply"):
        load_config(path, flags=flags)
    config = load_config(path, flags=flags, ratios_from="plan.yaml")
    assert config.SensitivityAnalysis.verify is True and config.ratios_from == "plan.yaml"
    assert derive(config, {"Global.seed": 1}).ratios_from == "plan.yaml"  # kept: re-validating passes again


def test_validate_section_returns_the_normalised_section() -> None:
    section = SensitivityConfig(analysis_file="s.pkl", pruned_ratios=[0.4, 0.30000000000000004, 0.3])
    assert validate_section(section).pruned_ratios == [0.3, 0.4]
    assert section.pruned_ratios == [0.4, 0.30000000000000004, 0.3]  # frozen: the caller's section is untouched

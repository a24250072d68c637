"""Inputs that used to give wrong numbers with exit code 0 (issue 16): 16-bit images, ImageFolder link loops, ratios
that round to 0 or 1. Each must now give the right numbers, or exit 2 naming the culprit with nothing changed."""

from __future__ import annotations

import codecs
import csv
import errno
import json
import math
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from analysis import analysis_prune
from analysis.config import GlobalConfig, load_config, normalise_ratios
from analysis.errors import AnalysisFileError, ConfigError, DataError, UserError
from analysis.inputs import data as data_module
from analysis.inputs.build import build_inputs
from analysis.inputs.data import (
    Preprocess,
    build_eval_loader,
    load_image,
    read_sample_list,
    rgb_image,
    scan_image_folder,
)
from analysis.io.latency_table import LatencyTable, load_table, save_table, table_path
from analysis.io.lock import exclusive
from analysis.io.ratios_yaml import load_ratios_yaml
from analysis.io.record import load_record
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.io.search_log import SearchLog, search_log_path
from analysis.planning.measured import PlanScoring, SearchSettings, build_measured_plan
from analysis.planning.plan import Plan, Planner, open_planner
from analysis.planning.probes import measure_table, open_table, table_key
from analysis.planning.ratios import get_ratios_by_loss
from analysis.runtimes.runtime import CommandRuntime, Runtime, TorchRuntime
from analysis.workflow import plan as plan_workflow

import tiny_models
from helpers import (
    RATIOS_HEAD,
    SEARCH_DESCRIPTION,
    SEARCH_KEY,
    VALID_RATIOS,
    CliResult,
    assert_user_error,
    batches,
    calibration_batches,
    pseudo_labelled,
    randomize,
    run_cli,
    search_record,
    tiny_global,
    write_config,
    write_images,
    write_train_list,
)
from latency_fakes import MacsRuntime

Cli = Callable[..., CliResult]
PREPROCESS = Preprocess(img_size=8, resize_size=8)


def sixteen_bit(seed: int = 0) -> np.ndarray:
    """8x8 16-bit gray values covering the whole range (most of them far above 255)."""
    return np.random.default_rng(seed).integers(0, 65536, (8, 8), dtype=np.uint16)


def expected_rgb(values: np.ndarray) -> torch.Tensor:
    """The high byte of each 16-bit value on all three channels (torchvision's and OpenCV's 16 -> 8-bit rule)."""
    high = torch.from_numpy((values >> 8).astype(np.uint8))
    return high.expand(3, *high.shape)


# ---- image modes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "suffix"), [("I;16", ".png"), ("I;16", ".tif"), ("I;16B", ".tif")])
def test_16_bit_images_keep_their_high_byte_instead_of_turning_white(tmp_path: Path, mode: str, suffix: str) -> None:
    values = sixteen_bit()
    path = tmp_path / f"x{suffix}"
    raw = values.astype(">u2" if mode == "I;16B" else "<u2").tobytes()
    Image.frombytes(mode, (8, 8), raw).save(path)
    with Image.open(path) as opened:
        assert opened.mode == mode  # the file really opens in the mode under test
    assert torch.equal(load_image(str(path), PREPROCESS), expected_rgb(values))


def test_a_16_bit_png_opened_as_mode_i_is_16_bit_too() -> None:
    values = sixteen_bit(1)
    image = Image.fromarray(values.astype(np.int32), "I")
    image.format = "PNG"  # older Pillow versions open 16-bit PNGs as mode I
    assert torch.equal(torch.from_numpy(np.array(rgb_image(image))).permute(2, 0, 1), expected_rgb(values))


@pytest.mark.parametrize(("mode", "suffix"), [("I", ".tif"), ("F", ".tif")])
def test_32_bit_and_float_pixels_are_refused_by_name(tmp_path: Path, mode: str, suffix: str) -> None:
    path = tmp_path / f"x{suffix}"
    Image.new(mode, (8, 8), 3).save(path)
    with pytest.raises(ValueError, match=rf"Pillow mode {mode}\) have no defined 8-bit scale"):
        load_image(str(path), PREPROCESS)


# Every mode a file opens in with Pillow, and the file type that keeps it; 8-bit modes convert as Pillow does.
EIGHT_BIT_MODES = [("1", ".png"), ("L", ".png"), ("LA", ".png"), ("P", ".png"), ("PA", ".tif"), ("RGB", ".png"),
                   ("RGBA", ".png"), ("CMYK", ".tif"), ("YCbCr", ".tif"), ("LAB", ".tif")]  # fmt: skip


@pytest.mark.parametrize(("mode", "suffix"), EIGHT_BIT_MODES)
def test_every_8_bit_mode_converts_as_pillow_does(tmp_path: Path, mode: str, suffix: str) -> None:
    pixels = np.random.default_rng(2).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    path = tmp_path / f"x{suffix}"
    Image.fromarray(pixels).convert(mode).save(path)
    with Image.open(path) as opened:
        assert opened.mode == mode
        expected = torch.from_numpy(np.asarray(opened.convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(load_image(str(path), PREPROCESS), expected)


def test_a_16_bit_dataset_decodes_like_its_8_bit_high_bytes(tmp_path: Path) -> None:
    for name, bits in (("deep", 16), ("flat", 8)):
        root = tmp_path / name / "val"
        root.mkdir(parents=True)
        for index in range(4):
            values = sixteen_bit(index)
            Image.fromarray(values if bits == 16 else (values >> 8).astype(np.uint8)).save(root / f"{index}.png")
        (tmp_path / name / "val_list.txt").write_text("".join(f"val/{i}.png {i}\n" for i in range(4)))
    configs = [GlobalConfig(data_dir=str(tmp_path / n), img_size=8, resize_size=8, batch_size=4, num_workers=0)
               for n in ("deep", "flat")]  # fmt: skip
    loaders = [build_eval_loader(config, torch.device("cpu")) for config in configs]
    (deep, _), (flat, _) = (next(iter(loader)) for loader in loaders)
    assert torch.equal(deep, flat)


def test_an_unusable_image_mode_exits_2_naming_the_file(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    Image.new("F", (20, 16), 0.5).save(list_data / "val" / "img_0003.tif")
    lines = (list_data / "val_list.txt").read_text().replace("img_0003.png", "img_0003.tif")
    (list_data / "val_list.txt").write_text(lines)
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data),
                                                "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})  # fmt: skip
    assert_user_error(cli("--config_path", config), r"img_0003\.tif cannot be decoded .*Pillow mode F")
    assert not (tmp_path / "out").exists()


# ---- ImageFolder links -----------------------------------------------------------------------------------------------


def folder_data(tmp_path: Path) -> Path:
    write_images(tmp_path / "data", "folder", [0, 1, 2, 0, 1, 2])
    return tmp_path / "data"


def test_a_link_back_up_is_refused_instead_of_relabelling_images(tmp_path: Path) -> None:
    data = folder_data(tmp_path)
    os.symlink("..", data / "val" / "class_00" / "loop")  # class_00/loop/class_01/... would be labelled class 0
    with pytest.raises(DataError, match=r"class_00/loop leads to .*val, which is listed already"):
        scan_image_folder(data / "val")


def test_a_folder_linked_twice_is_refused(tmp_path: Path) -> None:
    data = folder_data(tmp_path)
    os.symlink(data / "val" / "class_00", data / "val" / "class_03")
    with pytest.raises(DataError, match=r"class_03 leads to .*class_00, which is listed already"):
        scan_image_folder(data / "val")


def test_an_image_linked_twice_is_refused(tmp_path: Path) -> None:
    data = folder_data(tmp_path)
    first = sorted((data / "val" / "class_00").iterdir())[0]
    os.symlink(first, data / "val" / "class_01" / "copy.png")
    with pytest.raises(DataError, match=rf"copy\.png and .*{first.name} are the same image file"):
        scan_image_folder(data / "val")


def test_links_to_other_folders_are_still_followed_like_torchvision(tmp_path: Path) -> None:
    data = folder_data(tmp_path)
    extra = tmp_path / "elsewhere"
    write_images(extra, "folder", [5, 5], seed=3)
    os.symlink(extra / "val" / "class_05", data / "val" / "class_02" / "more")
    samples = scan_image_folder(data / "val")
    assert [(Path(s.path).relative_to(data / "val").as_posix(), s.label) for s in samples] == [
        ("class_00/img_0000.png", 0), ("class_00/img_0003.png", 0), ("class_01/img_0001.png", 1),
        ("class_01/img_0004.png", 1), ("class_02/img_0002.png", 2), ("class_02/img_0005.png", 2),
        ("class_02/more/img_0000.png", 2), ("class_02/more/img_0001.png", 2),
    ]  # fmt: skip


def test_a_link_loop_exits_2_and_leaves_the_analysis_file_alone(cli: Cli, tmp_path: Path) -> None:
    data = folder_data(tmp_path)
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(data),
                                                "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})  # fmt: skip
    assert cli("--config_path", config, "--no_report").code == 0
    before = (tmp_path / "out" / "s.pkl").read_bytes()
    os.symlink("..", data / "val" / "class_01" / "loop")
    assert_user_error(cli("--config_path", config, "--no_report"), r"class_01/loop leads to .*listed already")
    assert (tmp_path / "out" / "s.pkl").read_bytes() == before


# ---- ratios that round to 0 or 1 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ratio", "rounded"), [(1e-7, "0.0"), (0.9999999, "1.0")])
def test_ratios_that_round_to_0_or_1_are_refused(ratio: float, rounded: str) -> None:
    with pytest.raises(ConfigError, match=rf"holds {ratio}, which rounds to {rounded} at the 6 decimals"):
        normalise_ratios([0.2, ratio], "SensitivityAnalysis.pruned_ratios")


def test_the_smallest_and_largest_storable_ratios_are_kept() -> None:
    assert normalise_ratios([1e-6, 0.999999], "k") == [1e-6, 0.999999]


@pytest.mark.parametrize("ratio", ["1e-7", "0.9999999"])
def test_a_ratio_that_rounds_away_exits_2_naming_the_key(cli: Cli, tmp_path: Path, list_data: Path, ratio: str) -> None:
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data),
                                                "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})  # fmt: skip
    assert_user_error(cli("--config_path", config, "--pruned_ratios", ratio), r"pruned_ratios holds .* which rounds to")
    assert not (tmp_path / "out").exists()


# ---- list files: encodings -------------------------------------------------------------------------------------------


def test_a_byte_order_mark_is_not_part_of_the_first_path(tmp_path: Path, list_data: Path) -> None:
    listed = (list_data / "val_list.txt").read_bytes()
    (list_data / "val_list.txt").write_bytes(codecs.BOM_UTF8 + listed)
    samples = read_sample_list(list_data, list_data / "val_list.txt")
    assert samples[0].path == str(list_data / "val" / "img_0000.png") and len(samples) == 20


def test_a_byte_that_is_not_utf8_names_the_file_and_line(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    lines = (list_data / "val_list.txt").read_bytes().split(b"\n")
    lines[6] = b"val/caf\xe9.png 3"  # Latin-1, not UTF-8
    (list_data / "val_list.txt").write_bytes(b"\n".join(lines))
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data),
                                                "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})  # fmt: skip
    assert_user_error(cli("--config_path", config), r"val_list\.txt line 7 is not UTF-8 text \(byte 0xe9\)")
    assert not (tmp_path / "out").exists()


# ---- non-finite numbers ----------------------------------------------------------------------------------------------

NON_FINITE = {
    "Global.cache_max_gb=.nan": r"Global\.cache_max_gb must be a positive number of GB .*got nan",
    "Global.cache_max_gb=.inf": r"Global\.cache_max_gb must be a positive number of GB .*got inf",
    "Global.mean=[.nan,0.4,0.4]": r"Global\.mean must hold finite numbers, got \[nan, 0\.4, 0\.4\]",
    "Global.std=[0.2,.inf,0.2]": r"Global\.std must hold finite numbers, got \[0\.2, inf, 0\.2\]",
    "SensitivityAnalysis.pruned_ratios=[0.2,.nan]": r"pruned_ratios must hold ratios strictly between 0 and 1, got nan",
    "SensitivityAnalysis.target_loss=.nan": r"SensitivityAnalysis\.target_loss must be .*got nan",
    "SensitivityAnalysis.target_loss=.inf": r"SensitivityAnalysis\.target_loss must be .*got inf",
    "SensitivityAnalysis.target_macs_reduction=.nan": r"target_macs_reduction must be between 0 and 1 .*got nan",
    "SensitivityAnalysis.precision=.inf": r"SensitivityAnalysis\.precision must be between 0 and 1 .*got inf",
}


@pytest.mark.parametrize("override", list(NON_FINITE))
def test_non_finite_numbers_are_refused_before_any_work(
    cli: Cli, tmp_path: Path, list_data: Path, override: str
) -> None:
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data),
                                                "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})  # fmt: skip
    result = cli("--config_path", config, override)
    assert_user_error(result, NON_FINITE[override])
    assert "Baseline" not in result.err and not (tmp_path / "out").exists()


# ---- locked analysis files -------------------------------------------------------------------------------------------


def test_a_locked_analysis_file_is_refused_before_the_model_and_data_load(cli: Cli, tmp_path: Path) -> None:
    """The model file and the data do not exist: the lock must be what the run reports, not those."""
    target = tmp_path / "out" / "s.pkl"
    target.parent.mkdir()
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(tmp_path / "no_data", arch=f"{tmp_path / 'no_model.py'}:build"),
        "SensitivityAnalysis": {"analysis_file": str(target)},
    })  # fmt: skip
    with exclusive(target):
        result = cli("--config_path", config)
    assert_user_error(result, r"s\.pkl is being written by process \d+ on ")
    assert not target.exists()


# ---- the user's own model code ---------------------------------------------------------------------------------------

MODEL_CODE = """
import torch


def build(num_classes=10, broken="") -> torch.nn.Module:
    if broken == "type":
        return helper(None)
    if broken == "value":
        raise ValueError("width must be even")
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))


def helper(value):
    return value + 1  # TypeError inside the user's code, not an argument mismatch
"""


@pytest.mark.parametrize(
    ("broken", "error"),
    [("type", r"TypeError: unsupported operand"), ("value", r"ValueError: width must be even")],
)
def test_an_exception_in_the_users_model_code_shows_their_traceback(
    cli: Cli, tmp_path: Path, list_data: Path, broken: str, error: str
) -> None:
    (tmp_path / "my_model.py").write_text(MODEL_CODE)
    block = tiny_global(list_data, arch=f"{tmp_path / 'my_model.py'}:build", arch_kwargs={"broken": broken})
    config = write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})
    result = cli("--config_path", config)
    assert_their_error(result, rf"Global\.arch .*my_model\.py:build raised {error}.* \(traceback above\)")


def test_arguments_that_do_not_fit_are_still_called_that(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    (tmp_path / "my_model.py").write_text(MODEL_CODE)
    block = tiny_global(list_data, arch=f"{tmp_path / 'my_model.py'}:build", arch_kwargs={"depth": 3})
    config = write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})
    assert_user_error(cli("--config_path", config), r"Global\.arch_kwargs do not fit .*unexpected keyword .*depth")


def test_a_model_file_that_fails_to_import_shows_its_traceback(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    (tmp_path / "my_model.py").write_text("import torch\nWIDTH = 1 / 0\n")
    block = tiny_global(list_data, arch=f"{tmp_path / 'my_model.py'}:build")
    config = write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": {"analysis_file": "out/s.pkl"}})
    result = cli("--config_path", config)
    assert_their_error(result, r"importing .*my_model\.py raised ZeroDivisionError: division by zero")
    assert "WIDTH = 1 / 0" in result.err


def assert_their_error(result: CliResult, pattern: str) -> None:
    """Exit 2, one ``error:`` line last, and above it the traceback of the user's code only (none of ours)."""
    assert result.code == 2, result.err
    shown, _, last = result.err.strip().rpartition("\n")
    assert re.search(pattern, last) and last.startswith("error: "), last
    assert "arch_kwargs do not fit" not in result.err
    assert 'my_model.py", line' in shown and "/analysis/" not in shown  # their frames, not ours
    assert shown.count("Traceback (most recent call last)") == 1


# ---- config files ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("Global:\n  arch: resnet18\n  batch_size: 8\n  batch_size: 16\n",
         r"c\.yaml line 4, column 3: invalid YAML \(key 'batch_size' on line 4 repeats the key on line 3, in the "
         r"mapping opened on line 2\)"),
        ("Global:\n  arch: resnet18\nSensitivityAnalysis: {}\nGlobal:\n  arch: resnet50\n",
         r"c\.yaml line 4, column 1: invalid YAML \(key 'Global' on line 4 repeats the key on line 1"),
    ],
)  # fmt: skip
def test_a_key_written_twice_names_both_lines(cli: Cli, tmp_path: Path, text: str, pattern: str) -> None:
    (tmp_path / "c.yaml").write_text(text)
    assert_user_error(cli("--config_path", tmp_path / "c.yaml"), pattern)


def test_anchors_and_merge_keys_still_load(tmp_path: Path, list_data: Path) -> None:
    block = "\n".join(f"  {k}: {v}" for k, v in tiny_global(list_data).items() if k != "arch_kwargs")
    text = f"base: &base\n{block}\nGlobal:\n  <<: *base\n  batch_size: 4\n  arch_kwargs: {{num_classes: 10}}\n"
    (tmp_path / "c.yaml").write_text(text + "SensitivityAnalysis:\n  analysis_file: out/s.pkl\n")
    config = load_config(tmp_path / "c.yaml")
    assert config.Global.batch_size == 4 and config.Global.img_size == 16


# ---- failures to write -----------------------------------------------------------------------------------------------


def plain_config(tmp_path: Path, data: Path, analysis_file: str) -> Path:
    return write_config(tmp_path / "c.yaml", {"Global": tiny_global(data),
                                              "SensitivityAnalysis": {"analysis_file": analysis_file}})  # fmt: skip


def test_a_path_component_that_is_a_file_names_the_path_and_reason(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    (tmp_path / "taken").write_text("a file, not a folder")
    result = cli("--config_path", plain_config(tmp_path, list_data, str(tmp_path / "taken" / "s.pkl")))
    pattern = r"Cannot write .*taken/s\.pkl \(SensitivityAnalysis\.analysis_file\): .*taken is a file, not a folder "
    assert_user_error(result, pattern + r"\(Not a directory \[ENOTDIR\]\); choose a writable location")


def test_a_full_disk_mid_run_keeps_the_finished_results(
    cli: Cli, tmp_path: Path, list_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up after some units are saved: exit 2 naming the file and the reason; what was saved stays
    loadable and a rerun (with space again) resumes to the same file as an uninterrupted run."""
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    assert cli("--config_path", config, "--no_report", "--analysis_file", "full/s.pkl").code == 0
    expected = (tmp_path / "full" / "s.pkl").read_bytes()
    real_fsync, calls = os.fsync, []

    def fsync_until_full(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 6:  # a few saves succeed, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    with monkeypatch.context() as patched:  # (monkeypatch.undo() would also undo the fixture's chdir)
        patched.setattr(os, "fsync", fsync_until_full)
        result = cli("--config_path", config, "--no_report")
    assert_user_error(
        result, r"Cannot write .*s\.pkl.*: No space left on device \[ENOSPC\]; choose a writable location"
    )
    partial = load_sensitivities(tmp_path / "out" / "s.pkl")
    assert 0 < sum(map(len, partial.values())) < sum(map(len, load_sensitivities(tmp_path / "full" / "s.pkl").values()))
    assert cli("--config_path", config, "--no_report").code == 0
    assert (tmp_path / "out" / "s.pkl").read_bytes() == expected


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        (
            "Global.batch_size=[1,",
            r"Override 'Global\.batch_size=\[1,' could not be parsed \(expected the node content",
        ),
        ("Global.batch_size={a: 1", r"could not be parsed \(expected ',' or '}'"),
        ("Global.batch_size=!!python/object:os.system ls", r"carries a YAML tag \(!\.\.\.\); write the plain value"),
        ("Global.mean=!!binary aGVsbG8=", r"Override 'Global\.mean=!!binary aGVsbG8=' carries a YAML tag"),
        ("Global.mean=[0.4, !!str 0.4, 0.4]", r"carries a YAML tag"),
        ("Global.seed=!!float 3", r"Override 'Global\.seed=!!float 3' carries a YAML tag"),
    ],
)
def test_a_malformed_or_tagged_override_names_it(
    cli: Cli, tmp_path: Path, list_data: Path, override: str, pattern: str
) -> None:
    assert_user_error(cli("--config_path", plain_config(tmp_path, list_data, "out/s.pkl"), override), pattern)
    assert not (tmp_path / "out").exists()


# ---- YAML aliases ----------------------------------------------------------------------------------------------------


def laughs(levels: int) -> list[str]:
    """YAML lines of nested aliases ("billion laughs"): ``l{levels}`` expands to 10**(levels+1) values."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return lines


def test_aliases_that_expand_past_the_limit_are_refused_before_anything_copies_them(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    """10**6 values from a 1 kB file: refused while loading, naming the file (it used to expand inside OmegaConf)."""
    block = yaml.safe_dump({"Global": tiny_global(list_data)}, sort_keys=False)
    text = "\n".join(laughs(5)) + "\n" + block + "SensitivityAnalysis:\n  skip_params: *l5\n"
    (tmp_path / "c.yaml").write_text(text)
    result = cli("--config_path", tmp_path / "c.yaml")
    assert_user_error(result, r"c\.yaml line \d+, column \d+: invalid YAML \(its aliases \(\*name\) expand to more "
                              r"than 100,000 values, the most a config may hold")  # fmt: skip


def test_an_alias_inside_its_own_anchor_is_refused(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    block = yaml.safe_dump({"Global": tiny_global(list_data)}, sort_keys=False)
    (tmp_path / "c.yaml").write_text(block + "SensitivityAnalysis:\n  skip_params: &a [conv, *a]\n")
    assert_user_error(cli("--config_path", tmp_path / "c.yaml"), r"c\.yaml line 12, column 16: .*used inside its own")


def test_an_override_is_held_to_the_same_alias_limit(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    levels = ["&a [x, x, x, x, x, x, x, x, x, x]"] + [f"&{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in
                                                       zip("abcd", "bcde", strict=True)]  # fmt: skip
    override = f"SensitivityAnalysis.skip_params=[{', '.join(levels)}, [{', '.join(['*e'] * 10)}]]"
    result = cli("--config_path", plain_config(tmp_path, list_data, "out/s.pkl"), override)
    assert_user_error(result, r"Override 'SensitivityAnalysis\.skip_params=.*could not be parsed \(its aliases")
    assert not (tmp_path / "out").exists()


def test_aliases_within_the_limit_still_expand(tmp_path: Path, list_data: Path) -> None:
    block = yaml.safe_dump({"Global": tiny_global(list_data)}, sort_keys=False)
    (tmp_path / "c.yaml").write_text("\n".join(laughs(3)) + "\n" + block.replace("arch_kwargs:", "arch_kwargs:\n  "
                                     "  widths: *l3"))  # fmt: skip
    assert str(load_config(tmp_path / "c.yaml").Global.arch_kwargs["widths"]).count("'x'") == 10_000


# ---- decompression bombs ---------------------------------------------------------------------------------------------


def test_a_decompression_bomb_names_the_file_and_its_list_line(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    """A 22 kB PNG that would decode to 179.6 million pixels (Pillow's own limit is 178,956,970): refused from its
    header, without decoding, naming the list line and the key that raises the limit."""
    Image.new("1", (13400, 13400)).save(list_data / "val" / "bomb.png")
    lines = (list_data / "val_list.txt").read_text().replace("img_0003.png", "bomb.png")
    (list_data / "val_list.txt").write_text(lines)
    result = cli("--config_path", plain_config(tmp_path, list_data, "out/s.pkl"))
    assert_user_error(result, r"val_list\.txt line 4: image .*bomb\.png cannot be decoded \(it has 13400 x 13400 = "
                              r"179,560,000 pixels, more than the 178,956,970 Global\.max_image_pixels allows .*raise "
                              r"that key if the image is genuine\)")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_the_pixel_limit_is_exact_and_leaves_pillows_own_setting_alone(tmp_path: Path) -> None:
    Image.new("RGB", (20, 16)).save(tmp_path / "x.png")
    pillow_limit = Image.MAX_IMAGE_PIXELS
    assert load_image(str(tmp_path / "x.png"), Preprocess(8, 8, max_image_pixels=320)).shape == (3, 8, 8)
    with pytest.raises(ValueError, match=r"20 x 16 = 320 pixels, more than the 319 Global\.max_image_pixels"):
        load_image(str(tmp_path / "x.png"), Preprocess(8, 8, max_image_pixels=319))
    assert pillow_limit == Image.MAX_IMAGE_PIXELS


def test_the_pixel_limit_is_not_part_of_the_data_fingerprint(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    """It changes no pixel: an analysis file made under one limit resumes under another, to the same bytes."""
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    assert cli("--config_path", config, "--no_report", "Global.max_image_pixels=320").code == 0
    before = (tmp_path / "out" / "s.pkl").read_bytes()
    result = cli("--config_path", config, "--no_report", "Global.max_image_pixels=null")
    assert result.code == 0, result.err
    assert (tmp_path / "out" / "s.pkl").read_bytes() == before
    assert_user_error(cli("--config_path", config, "Global.max_image_pixels=0"), r"Global\.max_image_pixels must be")


# ---- sidecars with the wrong structure, in every command -------------------------------------------------------------

WRONG_SIDECARS = {
    "params is a list": (lambda d: d.update(params=[]), r"params should be an object, not \[\]"),
    "a metric is text": (
        lambda d: next(iter(d["params"].values()))["variants"]["0.5"].update(top1="high"),
        r'params\["0\.weight"\]\.variants\["0\.5"\]\.top1 should be a number, not "high"',
    ),
    "the baseline is a number": (lambda d: d.update(baseline=5), r"baseline should be an object, not 5"),
}


def analysed(cli: Cli, tmp_path: Path, data: Path) -> tuple[Path, Path]:
    """A finished analysis of the tiny CNN at ratio 0.5 (no report): its config and analysis file."""
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(data), "SensitivityAnalysis": {
        "analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5]}})  # fmt: skip
    assert cli("--config_path", config, "--no_report").code == 0
    return config, tmp_path / "out" / "s.pkl"


@pytest.mark.parametrize("command", ["run", "report", "merge", "plan", "verify"])
@pytest.mark.parametrize("damage", list(WRONG_SIDECARS))
def test_a_sidecar_with_the_wrong_structure_exits_2_naming_file_and_key(
    cli: Cli, tmp_path: Path, list_data: Path, command: str, damage: str
) -> None:
    config, analysis_file = analysed(cli, tmp_path, list_data)
    sidecar = Path(f"{analysis_file}.json")
    data = json.loads(sidecar.read_text())
    change, key = WRONG_SIDECARS[damage]
    change(data)
    sidecar.write_text(json.dumps(data))
    (tmp_path / "r.yaml").write_text("ChannelPrune:\n  prune_params_name: [0.weight]\n  pruned_ratio: [0.5]\n")
    arguments = {
        "run": ["--config_path", config, "--pruned_ratios", "0.3", "0.5"],
        "report": ["report", analysis_file],
        "merge": ["merge", tmp_path / "merged.pkl", analysis_file],
        "plan": ["plan", "--config_path", config, "--target_macs_reduction", "0.2"],
        "verify": ["verify", analysis_file, "--ratios", tmp_path / "r.yaml", "--config_path", config],
    }[command]
    before = {path: path.read_bytes() for path in analysis_file.parent.iterdir()}
    assert_user_error(cli(*arguments), rf"Sidecar file .*s\.pkl\.json has the wrong structure: {key}")
    assert {path: path.read_bytes() for path in analysis_file.parent.iterdir()} == before
    assert not (tmp_path / "merged.pkl").exists()


# ---- run.py report ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "pattern"),
    [
        (["--target_loss", "nan"], r"--target_loss must be a relative loss between 0 and 1 .*got nan"),
        (["--target_loss", "inf"], r"--target_loss must be a relative loss between 0 and 1 .*got inf"),
        (["--target_loss", "-0.1"], r"--target_loss must be a relative loss between 0 and 1 .*got -0\.1"),
        (["--target_loss", "1.5"], r"--target_loss must be a relative loss between 0 and 1 .*got 1\.5"),
        (["--ratio", "0.3"], r"Ratio 0\.3 was not analysed in .*s\.pkl; choose one of 0\.5"),
        (["--ratio", "nan"], r"Ratio nan was not analysed in .*s\.pkl; choose one of 0\.5"),
        (["--out_dir", "taken/sub"], r"Cannot write .*taken.*(File exists|Not a directory)"),
    ],
)
def test_report_checks_every_argument_before_writing_anything(
    cli: Cli, tmp_path: Path, list_data: Path, arguments: list[str], pattern: str
) -> None:
    _, analysis_file = analysed(cli, tmp_path, list_data)
    (tmp_path / "taken").write_text("a file, not a folder")
    before = sorted(analysis_file.parent.iterdir())
    assert_user_error(cli("report", analysis_file, *arguments), pattern)
    assert sorted(analysis_file.parent.iterdir()) == before


def test_report_of_a_pickle_without_sidecar_writes_what_the_pickle_supports(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    _, analysis_file = analysed(cli, tmp_path, list_data)
    Path(f"{analysis_file}.json").unlink()
    result = cli("report", analysis_file)
    assert result.code == 0, result.err
    assert "has no sidecar s.pkl.json: the wide CSV (metric values) is skipped" in result.err
    written = {Path(line).name for line in result.out.split()}
    assert written == {"s.long.csv", "s.curves.png", "s.heatmap.png", "s.savings.png", "s.report.html"}
    losses = load_sensitivities(analysis_file)
    rows = list(csv.DictReader((analysis_file.parent / "s.long.csv").open()))
    measured = {(row["parameter"], float(row["sparsity"])): float(row["relative_loss"]) for row in rows[1::2]}
    assert measured == {(name, ratio): loss for name, curve in losses.items() for ratio, loss in curve.items()}
    assert not (analysis_file.parent / "s.wide.csv").exists()


# ---- the documentation's promises, against an existing analysis file -------------------------------------------------


@dataclass(frozen=True)
class Promise:
    """One bad input: ``damage`` changes a file of a finished analysis (tmp_path holds c.yaml, data/ and out/s.pkl)
    before the run with ``arguments`` (after ``--config_path c.yaml`` unless they name another); ``error`` is the
    pattern its one error line must match."""

    arguments: list[str]
    error: str
    damage: Callable[[Path], object] = lambda root: None


def relist(old: str, new: str) -> Callable[[Path], object]:
    """A damage that replaces ``old`` by ``new`` in the evaluation list."""
    return lambda root: (root / "data" / "val_list.txt").write_text(
        (root / "data" / "val_list.txt").read_text().replace(old, new, 1)
    )


def write(relative: str, content: bytes) -> Callable[[Path], object]:
    """A damage that writes ``content`` to ``tmp_path/relative``."""
    return lambda root: (root / relative).write_bytes(content)


def drop_last_image(root: Path) -> None:
    (root / "data" / "val" / "img_0019.png").unlink()
    relist("val/img_0019.png 9\n", "")(root)


PROMISES = {
    "unknown key": Promise(["Global.batch_sise=4"], r"Unknown key Global\.batch_sise \(did you mean 'batch_size'"),
    "missing config": Promise(["--config_path", "nope.yaml"], r"Config file nope\.yaml does not exist"),
    "empty config": Promise([], r"Config file .*c\.yaml is empty", write("c.yaml", b"")),
    "no Global block": Promise([], r"c\.yaml has no Global block", write("c.yaml", b"SensitivityAnalysis: {}\n")),
    "invalid YAML": Promise([], r"c\.yaml line 2, column 1: invalid YAML", write("c.yaml", b"Global: [\n")),
    "missing data_dir": Promise(["Global.data_dir=gone"], r"Global\.data_dir gone does not exist"),
    "missing image": Promise([], r"val_list\.txt line 6: image .*img_0005\.png does not exist",
                             lambda root: (root / "data" / "val" / "img_0005.png").unlink()),
    "undecodable image": Promise([], r"val_list\.txt line 6: image .*img_0005\.png cannot be decoded",
                                 write("data/val/img_0005.png", b"not a png")),
    "label too large": Promise([], r"val_list\.txt line 3: label 12 is outside the model's 10 classes",
                               relist("img_0002.png 2", "img_0002.png 12")),
    "label not a number": Promise([], r"val_list\.txt line 3: label 'x' is not an integer",
                                  relist("img_0002.png 2", "img_0002.png x")),
    "other weights": Promise(["Global.seed=1"], r"s\.pkl was computed with another model \(its weights differ\)"),
    "other data": Promise([], r"s\.pkl was computed with other data or preprocessing; use a new", drop_last_image),
    "other criterion": Promise(["SensitivityAnalysis.criterion=l2_norm"],
                               r"s\.pkl was computed with criterion 'l1_norm' \(this run uses 'l2_norm'\)"),
    "other metric": Promise(["SensitivityAnalysis.metric=top5"],
                            r"s\.pkl was computed with metric 'top1' \(this run uses 'top5'\)"),
    "a pickle of code": Promise(["--analysis_file", "evil.pkl"],
                                r"evil\.pkl holds code or unexpected types \(posix\.system\) and was not loaded",
                                write("evil.pkl", pickle.dumps(os.system))),
    "not a pickle": Promise(["--analysis_file", "text.pkl"], r"text\.pkl is not a pickle or is damaged",
                            write("text.pkl", b"hello")),
    "sidecar not JSON": Promise([], r"Sidecar file out/s\.pkl\.json is not valid JSON \(Expecting property name",
                                write("out/s.pkl.json", b"{")),
    "unknown arch": Promise(["Global.arch=resnet_9000"], r"Global\.arch 'resnet_9000' is not a torchvision model"),
    "crop larger than resize": Promise(["Global.img_size=32"], r"Global\.resize_size \(16\) is smaller than"),
    "batch size 0": Promise(["Global.batch_size=0"], r"Global\.batch_size must be a positive integer, got 0"),
    "bad device": Promise(["Global.device=tpu"], r"Global\.device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    "bad shard": Promise(["--shard", "3/2"], r"--shard must be I/N with 1 <= I <= N .*got '3/2'"),
    "ratio above 1": Promise(["--pruned_ratios", "0.5", "1.5"], r"pruned_ratios must hold ratios strictly between"),
    "unknown criterion": Promise(["SensitivityAnalysis.criterion=l3"],
                                 r"SensitivityAnalysis\.criterion must be one of l1_norm, .*got 'l3'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PROMISES))
def test_a_promised_bad_input_exits_2_and_leaves_the_analysis_file_alone(
    cli: Cli, tmp_path: Path, list_data: Path, case: str
) -> None:
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    assert cli("--config_path", config, "--no_report").code == 0
    promise = PROMISES[case]
    promise.damage(tmp_path)
    arguments = (
        promise.arguments if "--config_path" in promise.arguments else ["--config_path", config, *promise.arguments]
    )
    before = {path: path.read_bytes() for path in tmp_path.glob("**/*.pkl*")}
    assert_user_error(cli(*arguments, "--no_report"), promise.error)
    assert {path: path.read_bytes() for path in tmp_path.glob("**/*.pkl*")} == before


# ---- selections, plan outputs, verify, argument parsing (issue 26) ------------------------------------------------


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``: a snapshot to compare before and after a command."""
    return {path.relative_to(root).as_posix(): None if path.is_dir() else path.read_bytes()
            for path in sorted(root.rglob("*"))}  # fmt: skip


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("SensitivityAnalysis.units=[heads]", r"SensitivityAnalysis\.units is \['heads'\], but this model has no "
                                              r"prunable unit of that kind \(it has 2 conv\); add one"),
        ("SensitivityAnalysis.units=[linear]", r"units is \['linear'\], but this model has no prunable unit of that"),
        ("SensitivityAnalysis.skip_params=[0.weight,3.weight]",
         r"SensitivityAnalysis\.skip_params leaves out every prunable unit \(2 listed; the model has 2 conv\)"),
        ("SensitivityAnalysis.prune_params_name=[]", r"SensitivityAnalysis\.prune_params_name is an empty list"),
    ],
)  # fmt: skip
def test_a_selection_that_leaves_no_unit_exits_2_and_writes_nothing(
    cli: Cli, tmp_path: Path, list_data: Path, override: str, pattern: str
) -> None:
    """The tiny CNN's only Linear is its classifier: ``units: [linear]`` used to analyse nothing, exit 0, rewrite the
    sidecar and replace the ratios YAML with an empty block."""
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    assert cli("--config_path", config, "--no_report", "--target_loss", "0.5").code == 0
    before = tree(tmp_path)
    assert_user_error(cli("--config_path", config, "--target_loss", "0.5", override), pattern)
    assert tree(tmp_path) == before
    assert_user_error(cli("--config_path", config, "--analysis_file", "new/s.pkl", override), pattern)
    assert not (tmp_path / "new").exists()  # refused before the analysis file's folder is made


def analysed_with_ratios(cli: Cli, tmp_path: Path, data: Path, ratio: float = 0.5) -> tuple[Path, Path, Path]:
    """A finished analysis at ratio 0.5 (see :func:`analysed`) and a ratios YAML pruning ``0.weight`` at ``ratio``."""
    config, analysis_file = analysed(cli, tmp_path, data)
    ratios = tmp_path / "r.yaml"
    ratios.write_text(f"ChannelPrune:\n  prune_params_name: [0.weight]\n  pruned_ratio: [{ratio}]\n")
    return config, analysis_file, ratios


def test_plan_with_an_empty_export_dir_writes_nothing_in_the_current_folder(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    config, _ = analysed(cli, tmp_path, list_data)
    before = tree(tmp_path)
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.2", "--export_dir", "", "--no_report")
    assert_user_error(result, r"--export_dir is empty; name a folder \(\. for the current one\)")
    assert tree(tmp_path) == before
    override = cli("--config_path", config, "--target_loss", "0.5", "SensitivityAnalysis.export_dir=''")
    assert_user_error(override, r"SensitivityAnalysis\.export_dir is empty")
    assert tree(tmp_path) == before


def test_plan_checks_the_export_dir_before_it_replaces_the_plan_yaml(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    config, _ = analysed(cli, tmp_path, list_data)
    assert cli("plan", "--config_path", config, "--target_macs_reduction", "0.2", "--no_report").code == 0
    (tmp_path / "taken").write_text("a file, not a folder")
    before = tree(tmp_path)
    result = cli("plan", "--config_path", config, "--target_macs_reduction", "0.5", "--export_dir", "taken")
    assert_user_error(result, r"Cannot write taken \(--export_dir\): taken is a file, not a folder \(Not a directory")
    assert tree(tmp_path) == before  # the 0.2 plan's YAML and the sidecar are untouched
    assert "Baseline" not in result.err  # refused before the model and the data were loaded


@pytest.mark.parametrize("key", ["verify", "export_dir"])
def test_element_granularity_with_verify_or_export_is_refused_at_validation(
    cli: Cli, tmp_path: Path, list_data: Path, key: str
) -> None:
    value = "true" if key == "verify" else "exported"
    result = cli("--config_path", plain_config(tmp_path, list_data, "out/s.pkl"), "--target_loss", "0.5",
                 "SensitivityAnalysis.granularity=element", f"SensitivityAnalysis.{key}={value}")  # fmt: skip
    assert_user_error(result, rf"SensitivityAnalysis\.{key} prunes filters into a smaller model; it does not apply to "
                              r"granularity: element")  # fmt: skip
    assert not (tmp_path / "out").exists() and not (tmp_path / "exported").exists()


def test_verify_of_an_element_wise_analysis_is_refused_before_loading(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    arguments = ["--config_path", config, "--no_report", "SensitivityAnalysis.granularity=element"]
    assert cli(*arguments, "--pruned_ratios", "0.5").code == 0
    (tmp_path / "r.yaml").write_text("ChannelPrune:\n  prune_params_name: [0.weight]\n  pruned_ratio: [0.5]\n")
    before = tree(tmp_path)
    result = cli("verify", tmp_path / "out" / "s.pkl", "--ratios", tmp_path / "r.yaml")  # its stored config
    assert_user_error(result, r"SensitivityAnalysis\.verify prunes filters .* granularity: element")
    assert tree(tmp_path) == before


def test_verify_beyond_the_analysed_ratios_measures_and_calls_the_prediction_unknown(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    """0.weight was analysed at 0.5 only: 0.75 has no predicted loss. It used to crash writing NaN into the sidecar
    after the whole verification."""
    config, analysis_file, ratios = analysed_with_ratios(cli, tmp_path, list_data, ratio=0.75)
    result = cli("verify", analysis_file, "--ratios", ratios, "--config_path", config, "--no_report")
    assert result.code == 0, result.err
    assert "0.weight  ratio 0.7500     6/8    channels  predicted loss unknown" in result.out
    assert "predicted loss (sum of single-layer losses): unknown" in result.out
    assert "note: 1 group(s) (0.weight) have a ratio above the largest analysed one" in result.out
    record = json.loads(Path(f"{analysis_file}.json").read_text())["plan"]
    assert record["predicted_loss"] is None and record["verification"]["predicted_loss"] is None
    assert record["groups"][0]["predicted_loss"] is None
    assert set(record["verification"]["measured_loss"]) >= {"top1", "top5"}  # measured all the same


def test_verify_reads_the_ratios_file_before_the_model_and_the_data(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    """The data folder is gone too: the ratios file must be what the run reports, since it is read first."""
    config, analysis_file, ratios = analysed_with_ratios(cli, tmp_path, list_data)
    ratios.write_text(VALID_RATIOS + VALID_RATIOS)
    result = cli("verify", analysis_file, "--ratios", ratios, "--config_path", config, "Global.data_dir=gone")
    assert_user_error(result, r"Ratios file .*r\.yaml line 5: 'ChannelPrune' is written twice at the top level")


def test_verify_refuses_two_names_of_one_param(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    """``0`` (the module) and ``0.weight`` are one param: the second ratio used to be dropped without a word."""
    config, analysis_file, ratios = analysed_with_ratios(cli, tmp_path, list_data)
    ratios.write_text("ChannelPrune:\n  prune_params_name: ['0', 0.weight]\n  pruned_ratio: [0.25, 0.5]\n")
    before = tree(tmp_path)
    result = cli("verify", analysis_file, "--ratios", ratios, "--config_path", config)
    assert_user_error(result, r"ratios: '0' and '0\.weight' name the same param 0\.weight; list it once\.")
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            "Global: " + "[" * 3000 + "]" * 3000 + "\n",
            r"bad\.yaml holds a value Python cannot hold \(it nests too deeply\); fix it\.",
        ),
        ("Global:\n  seed: 2001-02-30\n", r"bad\.yaml holds a value Python cannot hold \(day is out of range"),
        ("Global:\n  seed: " + "9" * 5000 + "\n", r"bad\.yaml holds a value Python cannot hold \(Exceeds the limit"),
    ],
)
def test_yaml_values_python_cannot_hold_name_the_config_file(
    cli: Cli, tmp_path: Path, list_data: Path, text: str, pattern: str
) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    assert_user_error(cli("--config_path", tmp_path / "bad.yaml"), pattern)
    override = cli("--config_path", plain_config(tmp_path, list_data, "out/s.pkl"), "Global.seed=2001-02-30")
    assert_user_error(override, r"Override 'Global\.seed=2001-02-30' could not be parsed \(day is out of range")


def test_an_override_may_follow_any_flag(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    config = plain_config(tmp_path, list_data, "out/s.pkl")
    result = cli("--config_path", config, "Global.batch_size=4", "--no_report",
                 "SensitivityAnalysis.pruned_ratios=[0.5]", "--quiet", "Global.seed=3")  # fmt: skip
    assert result.code == 0, result.err
    assert list(next(iter(load_sensitivities(tmp_path / "out" / "s.pkl").values()))) == [0.5]
    stored = json.loads((tmp_path / "out" / "s.pkl.json").read_text())["config"]["Global"]
    assert (stored["batch_size"], stored["seed"]) == (4, 3)


@pytest.mark.parametrize(
    ("arguments", "pattern"),
    [
        (["verify"], r"run\.py verify: the following arguments are required: analysis_file, --ratios; see run\.py "
                     r"verify --help\.$"),
        (["plan"], r"run\.py plan: the following arguments are required: --config_path; see run\.py plan --help"),
        (["--config_path", "c.yaml", "--no_such_flag"], r"run\.py: unrecognized arguments: --no_such_flag"),
        (["--config_path", "c.yaml", "--target_loss", "low"], r"run\.py: argument --target_loss: invalid float value"),
        (["deps"], r"run\.py deps: the following arguments are required: --config_path"),
        (["merge", "out.pkl"], r"run\.py merge: the following arguments are required: inputs"),
    ],
)  # fmt: skip
def test_argument_errors_are_one_error_line_naming_only_what_is_missing(
    cli: Cli, tmp_path: Path, arguments: list[str], pattern: str
) -> None:
    result = cli(*arguments)
    assert_user_error(result, pattern)
    assert "Section.key=value" not in result.err.splitlines()[-1]  # the overrides are optional
    assert result.err.startswith("usage: run.py")
    assert tree(tmp_path) == {}


# ---- ratios YAML files given to run.py verify --ratios (issue 26) ----------------------------------------------

# Aliases that expand to 111,111 values (10 to the 5th leaves), past the 100,000 a config may hold.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 10)}]\n" for previous, name in zip("abcd", "bcde", strict=True)
)


# name -> (the file's text or bytes, a pattern its error must match after "Ratios file <path>")
BAD_RATIOS: dict[str, tuple[str | bytes, str]] = {
    "a param listed twice with one ratio": (
        RATIOS_HEAD + "  prune_params_name:\n  - 0.weight\n  - 1.weight\n  - 0.weight\n  pruned_ratio: 0.5\n",
        r" line 6: '0\.weight' is listed twice in ChannelPrune\.prune_params_name \(lines 4 and 6\); list each param "
        r"once\.",
    ),
    "a param listed twice with two ratios": (
        RATIOS_HEAD + "  prune_params_name: [0.weight, 0.weight]\n  pruned_ratio: [0.5, 0.3]\n",
        r" line 3: '0\.weight' is listed twice in ChannelPrune\.prune_params_name \(items 1 and 2\)",
    ),
    "the block written twice": (
        VALID_RATIOS + VALID_RATIOS.replace("0.5", "0.3"),
        r" line 5: 'ChannelPrune' is written twice at the top level \(lines 1 and 5\); keep one",
    ),
    "pruned_ratio written twice": (
        VALID_RATIOS + "  pruned_ratio: [0.3]\n",
        r" line 5: 'pruned_ratio' is written twice in ChannelPrune \(lines 4 and 5\); keep one",
    ),
    "prune_params_name written twice": (
        VALID_RATIOS + "  prune_params_name: [1.weight]\n",
        r" line 5: 'prune_params_name' is written twice in ChannelPrune \(lines 3 and 5\); keep one",
    ),
    "a key written twice deeper down": (
        VALID_RATIOS + "Global:\n  arch_kwargs: {num_classes: 10, num_classes: 100}\n",
        r" line 6, column \d+: invalid YAML \(key 'num_classes' on line 6 repeats the key on line 6\)",
    ),
    "a nan ratio": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [.nan]\n",
        r" line 4: ChannelPrune\.pruned_ratio of '0\.weight' is nan, outside \[0, 1\); a ratio is a number from 0",
    ),
    "an infinite ratio for all": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: .inf\n",
        r" line 4: ChannelPrune\.pruned_ratio is inf, outside \[0, 1\)",
    ),
    "a negative ratio": (
        RATIOS_HEAD + "  prune_params_name:\n  - 0.weight\n  pruned_ratio:\n  - -0.1\n",
        r" line 6: ChannelPrune\.pruned_ratio of '0\.weight' is -0\.1, outside \[0, 1\)",
    ),
    "a ratio of 1": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [1]\n",
        r" line 4: ChannelPrune\.pruned_ratio of '0\.weight' is 1, outside \[0, 1\)",
    ),
    "a ratio that rounds to 1": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [0.9999996]\n",
        r" line 4: .* is 0\.9999996, which rounds to 1\.0 at the 6 decimals ratios are stored with",
    ),
    "a boolean ratio": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [yes]\n",
        r" line 4: ChannelPrune\.pruned_ratio of '0\.weight' is true \(a boolean\), not a number",
    ),
    "a ratio of 400 digits": (
        RATIOS_HEAD + f"  prune_params_name: [0.weight]\n  pruned_ratio: [{10**400}]\n",
        r" line 4: .* is a number of more than 20 digits, outside \[0, 1\)",
    ),
    "a ratio of 5000 digits": (
        RATIOS_HEAD + f"  prune_params_name: [0.weight]\n  pruned_ratio: [{'9' * 5000}]\n",
        r" holds a value Python cannot hold \(Exceeds the limit",
    ),
    "a number as a name": (
        RATIOS_HEAD + "  prune_params_name: [0.weight, 12]\n  pruned_ratio: [0.5, 0.5]\n",
        r" line 3: ChannelPrune\.prune_params_name item 2 is 12, not a param name; write each name as text",
    ),
    "an empty name": (
        RATIOS_HEAD + "  prune_params_name:\n  -\n  pruned_ratio: [0.5]\n",
        r" line 4: ChannelPrune\.prune_params_name item 1 is empty \(null\), not a param name",
    ),
    "ratios of another length": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratio: [0.5, 0.3]\n",
        r" line 4: ChannelPrune\.pruned_ratio lists 2 ratios for the 1 names of prune_params_name",
    ),
    "a misspelt key": (
        RATIOS_HEAD + "  prune_params_name: [0.weight]\n  pruned_ratios: [0.5]\n",
        r" line 2: ChannelPrune has no pruned_ratio \(did you mean 'pruned_ratios'\?\)",
    ),
    "an empty file": ("", r" is empty; pass a ratios YAML this tool wrote"),
    "a null document": ("~\n", r" is empty; pass a ratios YAML this tool wrote"),
    "a list": ("- 0.weight\n- 0.5\n", r" has no ChannelPrune block; pass a ratios YAML this tool wrote"),
    "an alias bomb": (
        ALIAS_BOMB + VALID_RATIOS,
        r" line 1, column 1: invalid YAML \(its aliases \(\*name\) expand to more than 100,000 values",
    ),
    "an alias inside its own anchor": (
        "x: &a [*a]\n" + VALID_RATIOS,
        r" line 1, column \d+: invalid YAML \(an alias \(\*name\) is used inside its own anchor",
    ),
    "a python tag": (
        "!!python/object/apply:os.system [echo]\n",
        r" line 1, column 1: invalid YAML \(could not determine a constructor for the tag .*\); remove the tag",
    ),
    "nesting too deep": (
        "x: " + "[" * 3000 + "]" * 3000 + "\n" + VALID_RATIOS,
        r" holds a value Python cannot hold \(it nests too deeply\)",
    ),
    "not UTF-8": (
        VALID_RATIOS.replace("0.weight", "0.w\xe9ight").encode("latin-1"),
        r" line 3: byte 60 \(0xe9\) is not UTF-8; save the file as UTF-8\.",
    ),
}


def write_ratios(path: Path, content: str | bytes) -> Path:
    """Write a ratios file as given (text as UTF-8 with ``\\n`` line ends) and return its path."""
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def assert_names_file(error: UserError, path: Path) -> None:
    """The message is one printable sentence that names the ratios file."""
    message = str(error)
    assert message.isprintable(), f"not one printable line: {message!r}"
    assert message.endswith((".", ")")), f"no sentence end: {message!r}"
    assert str(path) in message, f"does not name {path}: {message!r}"


@pytest.mark.parametrize("case", list(BAD_RATIOS))
def test_a_bad_ratios_file_is_refused_naming_file_and_line(tmp_path: Path, case: str) -> None:
    content, pattern = BAD_RATIOS[case]
    path = write_ratios(tmp_path / "r.yaml", content)
    with pytest.raises(UserError) as raised:
        load_ratios_yaml(path)
    assert re.match(re.escape(f"Ratios file {path}") + pattern, str(raised.value)), str(raised.value)
    assert_names_file(raised.value, path)


def test_a_folder_or_a_missing_file_is_refused_as_such(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").mkdir()
    with pytest.raises(UserError, match=r"^Ratios file \S+r\.yaml is a folder; pass a ratios YAML file"):
        load_ratios_yaml(tmp_path / "r.yaml")
    with pytest.raises(UserError, match=r"^Ratios file \S+missing\.yaml does not exist; pass an existing ratios YAML"):
        load_ratios_yaml(tmp_path / "missing.yaml")


RATIOS_CLI_CASES = [
    "a param listed twice with two ratios",
    "the block written twice",
    "pruned_ratio written twice",
    "a nan ratio",
    "a ratio of 1",
    "a boolean ratio",
    "a number as a name",
    "an empty file",
    "an alias bomb",
    "a python tag",
    "not UTF-8",
]


@pytest.mark.parametrize("case", [*RATIOS_CLI_CASES, "a folder"])
def test_verify_with_a_bad_ratios_file_exits_2_and_writes_nothing(
    cli: Cli, tmp_path: Path, list_data: Path, case: str
) -> None:
    config, analysis_file = analysed(cli, tmp_path, list_data)
    ratios = tmp_path / "r.yaml"
    if case == "a folder":
        ratios.mkdir()
        pattern = r" is a folder; pass a ratios YAML file"
    else:
        content, pattern = BAD_RATIOS[case]
        write_ratios(ratios, content)
    before = tree(tmp_path)
    result = cli("verify", analysis_file, "--ratios", ratios, "--config_path", config)
    assert_user_error(result, re.escape(f"error: Ratios file {ratios}") + pattern)
    assert tree(tmp_path) == before


# ---- a tiny decision_error; image sizes that cannot fit in memory (issue 26) --------------------------------------


def test_a_tiny_decision_error_runs_and_decides_like_the_exact_run(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    ratios = ["0.25", "0.5", "0.75"]
    section = {"pruned_ratios": [float(r) for r in ratios]}
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data), "SensitivityAnalysis": section})
    common = ("--config_path", config, "--no_report", "SensitivityAnalysis.target_loss=0.05")
    exact = cli(*common, "--analysis_file", tmp_path / "exact.pkl")
    assert exact.code == 0, exact.err
    decided = cli(*common, "--analysis_file", tmp_path / "decision.pkl", "SensitivityAnalysis.precision=decision",
                  "SensitivityAnalysis.decision_error=1e-20")  # fmt: skip
    assert decided.code == 0, decided.err
    exact_losses = pickle.loads((tmp_path / "exact.pkl").read_bytes())
    losses = pickle.loads((tmp_path / "decision.pkl").read_bytes())
    # every variant saw every image, so each loss is the exact run's; only ratios above one exceeding the target are
    # skipped, which cannot change a derived ratio
    assert losses.keys() == exact_losses.keys()
    for name, curve in losses.items():
        above = [r for r, loss in sorted(exact_losses[name].items()) if loss > 0.05]
        assert curve == {r: loss for r, loss in exact_losses[name].items() if not above or r <= above[0]}
    assert get_ratios_by_loss(losses, 0.05) == get_ratios_by_loss(exact_losses, 0.05)
    sidecar = load_sidecar(tmp_path / "decision.pkl")
    assert sidecar is not None
    variants = [variant for info in sidecar["params"].values() for variant in info["variants"].values()]
    assert variants and all(v["settled"] == "exact" and v["samples"] == 20 for v in variants)


HUGE = "1000000"  # 3 TB per decoded image: more than any machine has, whatever this one has


def sized_config(tmp_path: Path, data: Path, **analysis: object) -> Path:
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5], **analysis}
    return write_config(tmp_path / "c.yaml", {"Global": tiny_global(data), "SensitivityAnalysis": section})


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ((f"Global.img_size={HUGE}", f"Global.resize_size={HUGE}"),
         r"^error: Global\.img_size 1000000 makes one decoded image 3\.0 TB \(3 x 1000000 x 1000000 bytes\), and a "
         r"batch of 8 with its float32 normalised copy needs 120\.0 TB, more than the .* of memory this machine has "
         r"available; use a smaller Global\.img_size"),
        ((f"Global.resize_size={HUGE}",),
         r"^error: Global\.resize_size 1000000 makes each image at least 4\.0 TB while it is resized .*use a smaller "
         r"Global\.resize_size\.$"),
    ],
)  # fmt: skip
def test_an_image_size_that_cannot_fit_exits_2_naming_the_key(
    cli: Cli, tmp_path: Path, list_data: Path, overrides: tuple[str, ...], pattern: str
) -> None:
    assert_user_error(cli("--config_path", sized_config(tmp_path, list_data), *overrides), pattern)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ((f"Global.calib_img_size={HUGE}", f"Global.calib_resize_size={HUGE}"),
         r"^error: Global\.calib_img_size 1000000 makes one decoded calibration image 3\.0 TB .*, and the 10 "
         r"calibration images decoded once into RAM and a batch of 8 with its float32 normalised copy need 150\.0 TB, "
         r".*use a smaller Global\.calib_img_size \(or fewer Global\.calib_samples\)\.$"),
        ((f"Global.calib_resize_size={HUGE}",),
         r"^error: Global\.calib_resize_size 1000000 makes each calibration image at least 4\.0 TB while it is "
         r"resized .*use a smaller Global\.calib_resize_size\.$"),
    ],
)  # fmt: skip
def test_a_calibration_size_that_cannot_fit_exits_2_naming_the_key(
    cli: Cli, tmp_path: Path, list_data: Path, overrides: tuple[str, ...], pattern: str
) -> None:
    write_train_list(list_data, 10)  # the default calibration images, read for adaptive BN
    config = sized_config(tmp_path, list_data, adaptive_bn=True)
    assert_user_error(cli("--config_path", config, *overrides), pattern)
    assert not (tmp_path / "out").exists()


def test_a_ram_cache_that_cannot_fit_exits_2_and_auto_streams_instead(
    cli: Cli, tmp_path: Path, list_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 20 images of 3 x 16 x 16 bytes need 15,360 bytes; one batch of 1 (with its float copy) and its resize 4,864
    monkeypatch.setattr(data_module, "available_memory_bytes", lambda: 10_000)
    config = sized_config(tmp_path, list_data)
    ram = cli("--config_path", config, "Global.batch_size=1", "Global.data_cache=ram")
    assert_user_error(ram, r"^error: Global\.data_cache is ram but the 20 decoded images need 15\.4 kB .*auto")
    assert not (tmp_path / "out").exists()
    streamed = cli("--config_path", config, "--no_report", "Global.batch_size=1", "Global.cache_max_gb=100")
    assert streamed.code == 0, streamed.err
    assert "more than the 0.00 GB of memory available" in streamed.err


# ---- the measured plan: its search log and a budget it cannot use (issue 26) ----------------------------------


def write_log(analysis_file: Path, *lines: str) -> Path:
    """A search log of ``lines`` (each ended by a newline)."""
    path = search_log_path(analysis_file)
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    return path


def log_line(**fields: Any) -> str:
    """A log line: the valid record with ``fields`` changed."""
    return json.dumps(search_record(**fields))


# What each damaged line holds, and what the error says about it (inside "line 2 is damaged (...)").
DAMAGED_RECORDS = {
    "a metric is text": (log_line(metrics={"top1": "x", "ce": 1.0}), r'metrics\["top1"\] is "x", not a number'),
    "a metric is true": (log_line(metrics={"top1": 1.0, "ce": True}), r'metrics\["ce"\] is true, not a number'),
    "metrics is a list": (log_line(metrics=[0.5]), r"metrics is \[0\.5\], not an object"),
    "metrics lacks ce": (log_line(metrics={"top1": 0.5}), r"metrics has no ce"),
    "macs is text": (log_line(macs="big"), r'macs is "big", not a whole number >= 0'),
    "params is a float": (log_line(params=1.5), r"params is 1\.5, not a whole number >= 0"),
    "seconds is a NaN token": (log_line(seconds=math.nan), r"NaN is not a JSON number"),
    "a metric is an Infinity token": (
        log_line(metrics={"top1": 0.5, "ce": -math.inf}),
        r"-Infinity is not a JSON number",
    ),
    "a metric overflows": (log_line().replace("1.25", "1e999"), r'metrics\["ce"\] is Infinity, not a finite number'),
    "a huge integer metric": (
        log_line(metrics={"top1": 10**400, "ce": 1}),
        r'metrics\["top1"\] is 1000.*, not a finite',
    ),
    "picks is an object": (log_line(picks={"a": 1}), r'picks is \{"a": 1\}, not a list of \[group, param, count\]'),
    "a pick has two fields": (log_line(picks=[["a", 2]]), r'picks\[0\] is \["a", 2\], not \[group, param, count\]'),
    "a pick's param is a number": (log_line(picks=[["a", 3, 2]]), r'picks\[0\] is \["a", 3, 2\], not \[group'),
    "a pick's count is text": (log_line(picks=[["a", "a", "2"]]), r'picks\[0\] removes "2" channels, not a whole'),
    "a group is picked twice": (log_line(picks=[["a", "a", 1], ["a", "b", 2]]), r'picks names group "a" twice'),
    "setting is a number": (log_line(setting=1), r"setting is 1, not a string"),
    "key is null": (log_line(key=None), r"key is null, not a string"),
    "a field is missing": (log_line().replace('"macs"', '"MACs"'), r"no macs: not an evaluation record"),
    "a list, not a record": ("[1, 2]", r"a JSON array, not an evaluation record"),
    "a blank line": ("", r"Expecting value"),
    "nested too deeply": ("[" * 100_000, r"JSON nested too deeply"),
    "an integer too long": ("1" * 5000, r"an integer with more than \d+ digits"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_RECORDS))
@pytest.mark.parametrize("key", [SEARCH_KEY, "another search"])
def test_a_damaged_record_is_refused_naming_the_line(tmp_path: Path, damage: str, key: str) -> None:
    log_line, pattern = DAMAGED_RECORDS[damage]
    if key != SEARCH_KEY and log_line.startswith("{"):  # a record of another search is checked just the same
        log_line = log_line.replace(json.dumps(SEARCH_KEY), json.dumps(key))
    path = write_log(tmp_path / "s.pkl", json.dumps(search_record()), log_line)
    with path.open("ab") as log:
        log.write(b'{"key": "cut off by a ki')  # the partial last line of a kill stays until the log is sound
    before = path.read_bytes()
    with pytest.raises(AnalysisFileError) as refused:
        SearchLog(tmp_path / "s.pkl", SEARCH_DESCRIPTION)
    message = str(refused.value)
    assert re.fullmatch(rf"Search log .*s\.pkl\.search\.jsonl line 2 is damaged \({pattern}.*\); delete the file to "
                        r"search afresh\.", message), message  # fmt: skip
    assert message.isprintable()
    assert path.read_bytes() == before


def test_records_of_other_searches_are_kept_but_not_used(tmp_path: Path) -> None:
    other = search_record(key="another search", metrics={"top1": 0.1, "ce": 9.0})
    path = write_log(tmp_path / "s.pkl", json.dumps(other), json.dumps(search_record()))
    log = SearchLog(tmp_path / "s.pkl", SEARCH_DESCRIPTION)
    picks = {"0.weight": ("0.weight", 2)}
    score = log.get("search", picks)
    assert (
        score is not None and score.metrics == search_record()["metrics"] and (score.macs, score.params) == (1000, 100)
    )
    assert [entry.key for entry in log.entries] == [SEARCH_KEY]
    assert log.get("full", picks) is None and log.from_earlier_run("search", picks)
    assert path.read_text().splitlines()[0] == json.dumps(other)  # the other search's record stays


@pytest.fixture
def plan_config(tmp_path: Path, list_data: Path) -> Path:
    """The tiny CNN with calibration images, analysed into ``tmp_path/out/s.pkl`` at three ratios."""
    write_train_list(list_data, 24)
    return write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data), "SensitivityAnalysis": {
        "analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.25, 0.5, 0.75]}})  # fmt: skip


def measured_plan(cli: Cli, config: Path, budget: int) -> CliResult:
    """``run.py plan`` of ``config`` by the measured method, 20% fewer MACs."""
    return cli("plan", "--config_path", config, "--target_macs_reduction", "0.2", "--method", "measured",
               "--eval_budget", str(budget), "--no_report")  # fmt: skip


# Damage done to the second line of a real search log, and what the error says about it.
LOG_DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "a metric is text": (lambda r: r["metrics"].update(top1="x"), r'metrics\["top1"\] is "x", not a number'),
    "seconds is NaN": (lambda r: r.update(seconds=math.nan), r"NaN is not a JSON number"),
    "picks is text": (lambda r: r.update(picks="0.weight"), r'picks is "0\.weight", not a list'),
}


@pytest.mark.parametrize("damage", list(LOG_DAMAGES))
def test_a_damaged_search_log_exits_2_naming_the_line_and_changes_nothing(
    cli: Cli, tmp_path: Path, plan_config: Path, damage: str
) -> None:
    change, pattern = LOG_DAMAGES[damage]
    assert measured_plan(cli, plan_config, 3).code == 0
    log = search_log_path(tmp_path / "out" / "s.pkl")
    lines = log.read_text().splitlines()
    damaged = json.loads(lines[1])
    change(damaged)
    lines[1] = json.dumps(damaged)
    log.write_text("\n".join(lines) + "\n")
    before = tree(tmp_path / "out")
    pattern = rf"Search log .*s\.pkl\.search\.jsonl line 2 is damaged \({pattern}.*\); delete the file"
    assert_user_error(measured_plan(cli, plan_config, 3), pattern)
    assert tree(tmp_path / "out") == before


def test_a_huge_eval_budget_ends_when_no_untried_plan_is_left(cli: Cli, tmp_path: Path, plan_config: Path) -> None:
    result = measured_plan(cli, plan_config, 100_000)
    assert result.code == 0, result.err
    sidecar = load_sidecar(tmp_path / "out" / "s.pkl")
    assert sidecar is not None
    search = sidecar["plan"]["search"]
    assert search["budget"] == 100_000 and search["exhausted"] is True
    assert 1 <= search["evaluations"] <= 50  # far below the budget: two groups leave few plans to measure
    logged = [json.loads(text) for text in search_log_path(tmp_path / "out" / "s.pkl").read_text().splitlines()]
    assert sum(r["setting"] == "search" for r in logged) == search["evaluations"]  # each a distinct plan
    assert len({json.dumps(r["picks"]) for r in logged if r["setting"] == "search"}) == search["evaluations"]


def test_a_budget_beyond_exhaustion_changes_nothing(tmp_path: Path) -> None:
    model = randomize(tiny_models.tiny_resnet())
    data = pseudo_labelled(model, batches(count=3))
    calibration = calibration_batches(count=2)
    scoring = PlanScoring(data, "data", calibration, calibration[:1], "calibration")
    plans: dict[int | None, Plan] = {}
    for budget in (100_000, None):  # None: exactly the evaluations the unlimited search used
        path = tmp_path / str(budget) / "s.pkl"
        path.parent.mkdir()
        analysis_prune(model, data, path, pruned_ratios=(0.25, 0.5, 0.75), progress=False)
        used = budget or (plans[100_000].search or {})["evaluations"]
        search = SearchSettings(evaluations=used, calibration_images=8)
        plans[budget] = build_measured_plan(model, data[0][0], path, 0.4, scoring, settings=search, progress=False)
    unlimited, exact = plans[100_000], plans[None]
    assert unlimited.search is not None and exact.search is not None
    assert unlimited.search["exhausted"] and unlimited.search["evaluations"] < 100
    assert exact.search["evaluations"] == unlimited.search["evaluations"]
    assert (exact.removals(), exact.predicted_loss) == (unlimited.removals(), unlimited.predicted_loss)
    assert exact.search["finalists"] == unlimited.search["finalists"]


# ---- no command writes anything on an error exit --------------------------------------------------------------------

BAD_OUTPUTS = {
    "run": (["--config_path", "c.yaml", "--target_loss", "0.5", "SensitivityAnalysis.export_dir=taken/model"],
            r"Cannot write taken/model \(SensitivityAnalysis\.export_dir\): taken is a file, not a folder"),
    "run, analysis file": (["--config_path", "c.yaml", "--analysis_file", "taken/s.pkl"],
                           r"Cannot write taken/s\.pkl \(SensitivityAnalysis\.analysis_file\): taken is a file"),
    "plan": (["plan", "--config_path", "c.yaml", "--target_macs_reduction", "0.3", "--export_dir", "taken"],
             r"Cannot write taken \(--export_dir\): taken is a file, not a folder"),
    "verify": (["verify", "out/s.pkl", "--ratios", "r.yaml", "--config_path", "c.yaml", "--export_dir", "taken/x"],
               r"Cannot write taken/x \(--export_dir\): taken is a file, not a folder"),
    "report": (["report", "out/s.pkl", "--out_dir", "taken/sub"], r"Cannot write taken/sub \(--out_dir\): taken is a"),
    "merge": (["merge", "taken/m.pkl", "out/s.pkl"], r"Cannot write taken/m\.pkl \(OUTPUT\): taken is a file"),
    "deps": (["deps", "--config_path", "c.yaml", "--output", "taken/d.csv"],
             r"Cannot write taken/d\.csv \(--output\): taken is a file, not a folder \(Not a directory \[ENOTDIR\]\)"),
    "export_dir in a read-only folder": (
        ["plan", "--config_path", "c.yaml", "--target_macs_reduction", "0.3", "--export_dir", "locked/model"],
        r"Cannot write locked/model \(--export_dir\): locked is a folder this user cannot write into"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_every_command_refuses_a_bad_output_path_before_writing_anything(
    cli: Cli, tmp_path: Path, list_data: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for every command: the paths it will write are checked first, so an error exit changes no file (the
    whole folder is compared, the analysis, its sidecar, plan, ratios and report included)."""
    analysed_with_ratios(cli, tmp_path, list_data)
    (tmp_path / "taken").write_text("a file, not a folder")
    (tmp_path / "locked").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path).name != "locked" and real_access(path, mode))
    arguments, pattern = BAD_OUTPUTS[case]
    before = tree(tmp_path)
    assert_user_error(cli(*arguments), pattern)
    assert tree(tmp_path) == before


# ---- round 4 (issue 41): latency tables, exports, output paths, commands ----


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a finished analysis of the tiny CNN at ratio 0.5 (``c.yaml``, ``data/``, ``out/s.pkl`` and its
    sidecar, relative paths throughout) and a ratios file ``r.yaml``: made once, copied by :func:`copy_of`."""
    root = tmp_path_factory.mktemp("finished")
    write_images(root / "data", "list", [i % 10 for i in range(20)])
    section = {"analysis_file": "out/s.pkl", "pruned_ratios": [0.5]}
    write_config(root / "c.yaml", {"Global": tiny_global(Path("data")), "SensitivityAnalysis": section})
    (root / "r.yaml").write_text(VALID_RATIOS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert run_cli(["--config_path", "c.yaml", "--no_report"]) == 0
    return root


def copy_of(folder: Path, into: Path) -> Path:
    """``folder``'s files copied into ``into`` (the test's current folder); returns ``into``."""
    shutil.copytree(folder, into, dirs_exist_ok=True)
    return into


def fake_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans measure latency on a deterministic fake runtime (latency concave in the MACs) instead of a real one."""
    runtime = MacsRuntime(torch.zeros(1, 3, 16, 16), power=0.5)
    monkeypatch.setattr(plan_workflow, "latency_runtime", lambda config, device: runtime)


@pytest.fixture(scope="module")
def latency_ready(finished: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Planner]:
    """:func:`finished` with the latency table of the fake runtime (:func:`fake_latency`) cached in ``out/``, measured
    as a latency plan measures it, and the planner of that model and analysis, which the plan step opens it with."""
    root = copy_of(finished, tmp_path_factory.mktemp("latency"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        inputs = build_inputs(load_config("c.yaml"), progress=False)
        record = load_record("out/s.pkl")
        planner, options = open_planner(inputs.model.eval(), inputs.example_input, record, "macs")
        counts = planner.probe_counts(options, record.sensitivities)
        measure_table(planner, counts, MacsRuntime(inputs.example_input, power=0.5), 1, "out/s.pkl", progress=False)
    return root, planner


def latency_table_file(root: Path) -> Path:
    """The one latency table cached beside ``root/out/s.pkl``."""
    (table,) = (root / "out").glob("s.pkl.latency-*.json")
    return table


def test_an_export_without_onnx_removes_the_older_exports_onnx_file(cli: Cli, tmp_path: Path, finished: Path) -> None:
    """Exporting again into the same folder without ONNX used to leave the previous plan's pruned_model.onnx beside
    the new plan's files, as if it were this plan's."""
    copy_of(finished, tmp_path)
    older = {name: f"older export: {name}".encode() for name in
             ("pruned_model.pt", "pruned_state_dict.pt", "pruned_channels.json", "channel_prune.yaml",
              "pruned_model.onnx")}  # fmt: skip
    (tmp_path / "exp").mkdir()
    for name, content in {**older, "notes.txt": b"the user's own file"}.items():
        (tmp_path / "exp" / name).write_bytes(content)
    result = cli("plan", "--config_path", "c.yaml", "--target_macs_reduction", "0.2", "--export_dir", "exp",
                 "--no_report", "SensitivityAnalysis.export_onnx=false")  # fmt: skip
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    assert "Removed exp/pruned_model.onnx: a file of an older export that this one does not write" in result.err
    files = tree(tmp_path / "exp")
    assert sorted(files) == ["channel_prune.yaml", "notes.txt", "pruned_channels.json", "pruned_model.pt",
                             "pruned_state_dict.pt"]  # fmt: skip
    assert files["notes.txt"] == b"the user's own file"  # not a file an export writes: left alone
    assert all(files[name] != content for name, content in older.items() if name in files)  # all of the new export
    assert "onnx" not in json.loads(files["pruned_channels.json"] or b"")


SVD_MODEL = '''
import torch
from torch import nn

import tiny_models


class SvdHead(nn.Sequential):
    """The tiny CNN (the same layers, so the same weights from the same seed) with a singular value decomposition of
    its logits, an operator no ONNX exporter converts."""

    def forward(self, images):
        logits = super().forward(images)
        return logits + 0 * torch.linalg.svdvals(logits).sum()


def build(num_classes=10) -> torch.nn.Module:
    return SvdHead(*tiny_models.tiny_cnn(num_classes))
'''


def test_a_failed_onnx_export_leaves_the_export_folder_and_the_plan_as_they_were(
    cli: Cli, tmp_path: Path, finished: Path
) -> None:
    """A failed ONNX export used to delete the pruned_model.onnx already in the folder (after the plan's YAML was
    replaced); now nothing changes, and the sentence names the way to export without ONNX."""
    copy_of(finished, tmp_path)
    (tmp_path / "svd_model.py").write_text(SVD_MODEL)
    (tmp_path / "out" / "s.pkl.plan.yaml").write_text(VALID_RATIOS)  # an earlier plan's ratios
    (tmp_path / "exp").mkdir()
    for name in ("pruned_model.pt", "pruned_state_dict.pt", "pruned_channels.json", "channel_prune.yaml",
                 "pruned_model.onnx"):  # fmt: skip
        (tmp_path / "exp" / name).write_bytes(f"earlier export: {name}".encode())
    before = tree(tmp_path)
    result = cli("plan", "--config_path", "c.yaml", "--target_macs_reduction", "0.2", "--export_dir", "exp",
                 "Global.arch=svd_model.py:build")  # fmt: skip
    pattern = (
        r"cannot be exported to ONNX \(opset \d+\): operator aten::_?linalg_svd.* is not supported; export "
        r"without ONNX with SensitivityAnalysis\.export_onnx: false"
    )
    assert_user_error(result, pattern)
    assert tree(tmp_path) == before  # no file changed, none added (no temporary left), none removed


@pytest.mark.parametrize("setting", ["runtime_pattern", "torch threads"])
def test_the_latency_table_key_holds_what_its_numbers_depend_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """The key used to leave out runtime_pattern: after fixing a wrong pattern, the old table was read again."""
    model = tiny_models.tiny_cnn()
    keys = []
    for value in (1, 2):
        if setting == "runtime_pattern":
            runtime: Runtime = CommandRuntime("bench {onnx}", ["took ([0-9.]+)", "median ([0-9.]+) ms"][value - 1])
        else:
            monkeypatch.setattr(torch, "get_num_threads", lambda value=value: value)
            runtime = TorchRuntime(torch.device("cpu"))
        keys.append(table_key(runtime, model, (3, 16, 16), 1))
    first, second = keys
    assert {k: v for k, v in first.items() if second.get(k) != v} == (
        {"pattern": "took ([0-9.]+)"} if setting == "runtime_pattern" else {"threads": 1}
    )
    save_table(table_path(tmp_path / "s.pkl", first), LatencyTable(first, 5.0, {"0.weight": {4: 3.0}}))
    assert table_path(tmp_path / "s.pkl", second) != table_path(tmp_path / "s.pkl", first)
    reread = load_table(table_path(tmp_path / "s.pkl", second), second)
    assert (reread.dense_ms, reread.probes) == (None, {})  # the other setting's numbers are not reused


def damage_probe(value: object) -> Callable[[dict[str, Any]], object]:
    """A damage that sets the first probe of the first group to ``value``."""

    def change(table: dict[str, Any]) -> None:
        counts = next(iter(table["probes"].values()))
        counts[next(iter(counts))] = value

    return change


DAMAGED_TABLES: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "a NaN probe": (damage_probe(math.nan), r'probes\["0\.weight"\]\["\d+"\] is NaN, not a finite positive number'),
    "a probe in text": (damage_probe("3.5"), r'probes\["0\.weight"\]\["\d+"\] is "3\.5", not a finite positive'),
    "a boolean probe": (damage_probe(True), r'probes\["0\.weight"\]\["\d+"\] is true, not a finite positive'),
    "a NaN dense latency": (lambda t: t.update(dense_ms=math.nan), r"dense_ms is NaN, not a finite positive number"),
    "a negative dense latency": (lambda t: t.update(dense_ms=-2.0), r"dense_ms is -2\.0, not a finite positive"),
    "an unknown group": (lambda t: t["probes"].update({"9.weight": {"1": 1.0}}),
                         r'probes\["9\.weight"\] names no prunable unit of this model'),
    "an unknown count": (lambda t: t["probes"]["0.weight"].update({"8": 1.0}),
                         r'probes\["0\.weight"\]\["8"\] is not a channel count a probe of 0\.weight can remove '
                         r"\(1 to 7\)"),
    "a damaged reference": (lambda t: t["references"].update({"0.weight@4": ["model", -1]}),
                            r'references\["0\.weight@4"\]\[1\] is -1, not a finite positive number'),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGED_TABLES))
def test_a_damaged_latency_table_is_refused_naming_the_file_and_the_entry(
    tmp_path: Path, latency_ready: tuple[Path, Planner], damage: str
) -> None:
    """A NaN probe used to end in a traceback, text and booleans became numbers, a NaN or negative dense latency was
    blamed on target_latency_ms, and unknown groups and counts were planned with. The table is opened as the plan
    step opens it (exit 2 from the command line)."""
    root, planner = latency_ready
    copy_of(root, tmp_path)
    table = latency_table_file(tmp_path)
    data = json.loads(table.read_text())
    change, entry = DAMAGED_TABLES[damage]
    change(data)
    table.write_text(json.dumps(data))
    before = tree(tmp_path)
    runtime = MacsRuntime(torch.zeros(1, 3, 16, 16), power=0.5)
    message = rf"Latency table out/s\.pkl\.latency-\w+\.json is damaged: {entry}.*; delete the file to measure"
    with pytest.raises(AnalysisFileError, match=message):
        open_table(planner, runtime, 1, "out/s.pkl")
    assert tree(tmp_path) == before


BAD_OUTPUT_PATHS = {
    "deps into the analysis file": (["deps", "--config_path", "c.yaml", "--output", "out/s.pkl"],
                                    r"Cannot write out/s\.pkl \(--output\): it is an analysis file"),
    "deps into the sidecar": (["deps", "--config_path", "c.yaml", "--output", "out/s.pkl.json"],
                              r"Cannot write out/s\.pkl\.json \(--output\): it is the sidecar of the analysis file "
                              r"out/s\.pkl"),
    "deps into the config": (["deps", "--config_path", "c.yaml", "--output", "c.yaml"],
                             r"Cannot write c\.yaml \(--output\): it is the config file, which this command reads"),
    "merge into an input's sidecar": (["merge", "out/s.pkl.json", "out/s.pkl"],
                                      r"Cannot write out/s\.pkl\.json \(OUTPUT\): it is the sidecar of the analysis "
                                      r"file out/s\.pkl"),
    "merge over a file that is no analysis": (["merge", "r.yaml", "out/s.pkl"],
                                              r"Cannot write r\.yaml \(OUTPUT\): it exists and is not an analysis "
                                              "file"),
    "an analysis file that is a sidecar": (["--config_path", "c.yaml", "--analysis_file", "out/s.pkl.json",
                                            "--overwrite"],
                                           r"Cannot write out/s\.pkl\.json \(SensitivityAnalysis\.analysis_file\): "
                                           r"it is the sidecar of the analysis file out/s\.pkl"),
    "an export over the model's weights": (["plan", "--config_path", "c.yaml", "--target_macs_reduction", "0.2",
                                            "--export_dir", "exp", "Global.model_dir=exp",
                                            "Global.params_filename=pruned_state_dict.pt"],
                                           r"Cannot write exp/pruned_state_dict\.pt \(--export_dir\): it is the "
                                           r"checkpoint of Global\.params_filename"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OUTPUT_PATHS))
def test_an_output_path_that_is_an_input_an_analysis_file_or_a_sidecar_exits_2(
    cli: Cli, tmp_path: Path, finished: Path, case: str
) -> None:
    """``deps --output`` naming the analysis file and ``merge`` into the sidecar used to overwrite them, exit 0."""
    copy_of(finished, tmp_path)
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "pruned_state_dict.pt").write_bytes(b"the weights a pruned model was exported with")
    arguments, pattern = BAD_OUTPUT_PATHS[case]
    before = tree(tmp_path)
    assert_user_error(cli(*arguments), pattern)
    assert tree(tmp_path) == before


def test_an_unreachable_latency_goal_in_ms_is_refused_in_ms(
    cli: Cli, tmp_path: Path, latency_ready: tuple[Path, Planner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--target_latency_ms`` used to be refused as the target_latency_reduction it corresponds to."""
    copy_of(latency_ready[0], tmp_path)
    fake_latency(monkeypatch)
    before = tree(tmp_path)
    result = cli("plan", "--config_path", "c.yaml", "--target_latency_ms", "1", "--no_report")
    assert_user_error(result, r"^error: The latency goal \(1\.000 ms on .*\) is not reachable within the analysed "
                              r"ratios: the largest plan they allow \(every group at its largest analysed ratio, "
                              r"keeping a multiple of 8 channels as latency_round_to asks\) "
                              r"measured .* \d+\.\d{3} ms, dense \d+\.\d{3} ms around it\); lower the "
                              r"target")  # fmt: skip
    assert "reduction" not in result.err.splitlines()[-1]
    assert tree(tmp_path) == before


def test_a_mistyped_command_is_named_with_a_suggestion(cli: Cli, tmp_path: Path) -> None:
    """``run.py plna`` used to be reported as a malformed override."""
    result = cli("plna", "--config_path", "c.yaml")
    assert_user_error(result, r"^error: unknown command 'plna' \(did you mean 'plan'\?\); the commands are plan, "
                              r"verify, compress, report, merge, deps")  # fmt: skip
    assert "Override" not in result.err
    assert tree(tmp_path) == {}

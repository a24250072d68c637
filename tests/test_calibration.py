"""Calibration images: where they are found, which subset is used, how they are preprocessed, and clear errors."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from analysis.config import GlobalConfig, load_config
from analysis.errors import DataError
from analysis.inputs.build import build_inputs
from analysis.inputs.calibration import CalibrationSet, build_calibration_set, resolve_calibration
from analysis.inputs.data import Sample, build_eval_loader, load_image, normalize_batch

from helpers import CliResult, tiny_global, write_config, write_images

CPU = torch.device("cpu")
Cli = Callable[..., CliResult]


@pytest.fixture(autouse=True)
def _analysis_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CLI run earlier in the session stops the package logger from propagating; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("analysis"), "propagate", True)


def write_split(
    root: Path, split: str, layout: str, labels: list[int], list_name: str | None = None, seed: int = 1
) -> list[str]:
    """Write random PNGs for ``labels`` under ``root/split``: as ``split/<class>/`` folders (``folder``) or flat
    with a PaddleSlim list ``list_name`` in ``root`` (``list``). Returns the image paths relative to ``root``."""
    rng = np.random.default_rng(seed)
    relatives, lines = [], []
    for index, label in enumerate(labels):
        folder = Path(split) / f"class_{label:02d}" if layout == "folder" else Path(split)
        relative = folder / f"{split}_{index:04d}.png"
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(root / relative)
        relatives.append(str(relative))
        lines.append(f"{relative} {label}")
    if layout == "list":
        (root / (list_name or f"{split}_list.txt")).write_text("\n".join(lines) + "\n")
    return relatives


def global_config(root: Path, **extra: Any) -> GlobalConfig:
    """A Global block reading ``root`` with 16x16 crops, batches of 8, no loader workers."""
    values: dict[str, Any] = {
        "data_dir": str(root),
        "batch_size": 8,
        "img_size": 16,
        "resize_size": 16,
        "num_workers": 0,
        "device": "cpu",
    }
    values.update(extra)
    return GlobalConfig(**values)


def calibrate(cfg: GlobalConfig) -> CalibrationSet | None:
    """Build the evaluation loader of ``cfg`` and its calibration set."""
    return build_calibration_set(cfg, CPU, build_eval_loader(cfg, CPU), progress=False)


def image_names(calibration: CalibrationSet) -> list[str]:
    return [Path(sample.path).name for sample in calibration.loader.samples]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """20 evaluation images in the PaddleSlim layout (val_list.txt, labels 0..9 twice), no training images."""
    root = tmp_path / "data"
    write_images(root, "list", [i % 10 for i in range(20)])
    return root


def test_default_train_list_beside_the_eval_list_is_found_and_cached(data: Path) -> None:
    labels = [0, 1, 2, 3] * 3
    write_split(data, "train", "list", labels)
    calibration = calibrate(global_config(data))
    assert calibration is not None
    assert calibration.path == str(data / "train_list.txt") and not calibration.explicit
    assert "train_list.txt (found by default), all 12 images" in calibration.source
    assert image_names(calibration) == [f"train_{i:04d}.png" for i in range(12)]
    assert calibration.loader.cached is not None  # decoded into RAM once
    batches = list(calibration.loader)
    assert [images.shape for images, _ in batches] == [(8, 3, 16, 16), (4, 3, 16, 16)]
    assert torch.cat([labels for _, labels in batches]).tolist() == labels
    first = load_image(str(data / "train" / "train_0000.png"), calibration.loader.preprocess)
    assert torch.equal(batches[0][0][0], normalize_batch(first.unsqueeze(0), calibration.loader.preprocess)[0])
    assert [torch.equal(a[0], b[0]) for a, b in zip(batches, calibration.loader, strict=True)] == [True, True]


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_calibration_batches_are_the_decoded_images_in_order(data: Path, share: float) -> None:
    write_split(data, "train", "list", [0, 1, 2, 3] * 5)
    calibration = calibrate(global_config(data, calib_samples=12, device_cache_share=share))
    assert calibration is not None
    loader = calibration.loader
    assert loader.cache_placement == "host"  # the CPU keeps them in RAM whatever the share

    def decoded(samples: list[Sample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        images = torch.stack([load_image(sample.path, loader.preprocess) for sample in samples])
        labels = torch.tensor([sample.label for sample in samples])
        size = loader.batch_size
        starts = range(0, len(samples), size)
        return [(normalize_batch(images[i : i + size], loader.preprocess), labels[i : i + size]) for i in starts]

    search = loader.subset(5, seed=1)  # what a measured plan searches on
    for got, samples in [(list(loader), loader.samples), (list(search), search.samples)]:
        expected = decoded(samples)
        assert len(got) == len(expected) == (2 if len(samples) == 12 else 1)
        for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    assert search.cache_placement == "host" and loader.staging_seconds > 0


def test_default_train_list_sits_beside_a_val_list_in_a_subfolder(data: Path) -> None:
    (data / "lists").mkdir()
    (data / "lists" / "val.txt").write_text((data / "val_list.txt").read_text())
    write_split(data, "train", "list", [0, 1, 2], list_name="lists/train_list.txt")
    write_split(data, "other", "list", [0, 1], list_name="train_list.txt")  # beside data_dir, not the eval list
    calibration = calibrate(global_config(data, val_list="lists/val.txt"))
    assert calibration is not None and calibration.path == str(data / "lists" / "train_list.txt")
    assert image_names(calibration) == ["train_0000.png", "train_0001.png", "train_0002.png"]


def test_default_image_folder_train_is_found(data: Path) -> None:
    write_split(data, "train", "folder", [2, 0, 1, 0, 2, 1])
    calibration = calibrate(global_config(data))
    assert calibration is not None
    assert calibration.path == str(data / "train") and not calibration.explicit
    assert calibration.source.startswith(f"ImageFolder {data / 'train'} (found by default)")
    assert [(Path(s.path).parent.name, s.label) for s in calibration.loader.samples] == [
        ("class_00", 0), ("class_00", 0), ("class_01", 1), ("class_01", 1), ("class_02", 2), ("class_02", 2),
    ]  # fmt: skip


def test_no_training_images_means_no_calibration(data: Path, caplog: pytest.LogCaptureFixture) -> None:
    (data / "train").mkdir()  # a train/ folder without class folders is not an ImageFolder root
    cfg = global_config(data)
    with caplog.at_level(logging.INFO, logger="analysis"):
        assert calibrate(cfg) is None
    assert resolve_calibration(cfg) is None
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("No calibration images found" in m and "Global.calib_list" in m for m in messages), messages


def test_calib_samples_zero_turns_calibration_off(data: Path) -> None:
    write_split(data, "train", "list", [0, 1])
    cfg = global_config(data, calib_samples=0)
    assert resolve_calibration(cfg) is None
    assert calibrate(cfg) is None
    assert calibrate(global_config(data)) is not None


@pytest.mark.parametrize("absolute", [False, True])
def test_explicit_list_wins_over_the_default(data: Path, absolute: bool) -> None:
    write_split(data, "train", "list", [0, 1, 2, 3])
    write_split(data, "calib", "list", [5, 6, 7], list_name="my_calib.txt")
    name = str(data / "my_calib.txt") if absolute else "my_calib.txt"
    calibration = calibrate(global_config(data, calib_list=name))
    assert calibration is not None and calibration.explicit
    assert calibration.path == str(data / "my_calib.txt")
    assert "(Global.calib_list), all 3 images" in calibration.source
    assert image_names(calibration) == ["calib_0000.png", "calib_0001.png", "calib_0002.png"]
    assert [s.label for s in calibration.loader.samples] == [5, 6, 7]


def test_explicit_folder_uses_the_image_folder_layout(data: Path, tmp_path: Path) -> None:
    write_split(tmp_path, "imgs", "folder", [1, 0, 1])
    calibration = calibrate(global_config(data, calib_list=str(tmp_path / "imgs")))
    assert calibration is not None and calibration.explicit and calibration.path == str(tmp_path / "imgs")
    assert [(Path(s.path).name, s.label) for s in calibration.loader.samples] == [
        ("imgs_0001.png", 0), ("imgs_0000.png", 1), ("imgs_0002.png", 1),
    ]  # fmt: skip
    assert next(iter(calibration.loader))[0].shape == (3, 3, 16, 16)


def test_subset_is_class_balanced_seeded_and_deterministic(data: Path) -> None:
    write_split(data, "train", "list", [0] * 10 + [1] * 10 + [2] * 2)
    calibration = calibrate(global_config(data, calib_samples=8, seed=3))
    assert calibration is not None and calibration.num_samples == 8
    assert Counter(s.label for s in calibration.loader.samples) == {0: 3, 1: 3, 2: 2}
    assert "class-balanced subset of 8 of 22 images, seed 3" in calibration.source
    again = calibrate(global_config(data, calib_samples=8, seed=3))
    assert again is not None and image_names(again) == image_names(calibration)
    assert again.fingerprint() == calibration.fingerprint()
    other = calibrate(global_config(data, calib_samples=8, seed=4))
    assert other is not None and image_names(other) != image_names(calibration)
    assert other.fingerprint() != calibration.fingerprint()
    everything = calibrate(global_config(data, calib_samples=100, seed=3))
    assert everything is not None and everything.num_samples == 22 and "all 22 images" in everything.source


def test_calibration_sizes_replace_the_evaluation_preprocessing(data: Path) -> None:
    write_split(data, "train", "list", [0, 1, 2])
    default = calibrate(global_config(data))
    cropped = calibrate(global_config(data, calib_img_size=8))
    resized = calibrate(global_config(data, calib_resize_size=24, calib_img_size=12))
    assert default is not None and cropped is not None and resized is not None
    assert next(iter(default.loader))[0].shape == (3, 3, 16, 16)
    assert next(iter(cropped.loader))[0].shape == (3, 3, 8, 8)
    assert (cropped.loader.preprocess.resize_size, cropped.loader.preprocess.img_size) == (16, 8)
    assert next(iter(resized.loader))[0].shape == (3, 3, 12, 12)
    assert (resized.loader.preprocess.resize_size, resized.loader.preprocess.img_size) == (24, 12)
    assert len({default.fingerprint(), cropped.fingerprint(), resized.fingerprint()}) == 3


def test_as_dict_is_json_for_the_sidecar(data: Path) -> None:
    write_split(data, "train", "list", [0, 1, 2])
    calibration = calibrate(global_config(data, calib_img_size=8))
    assert calibration is not None
    described = json.loads(json.dumps(calibration.as_dict()))
    assert described["path"] == str(data / "train_list.txt") and described["images"] == 3
    assert described["explicit"] is False and described["source"] == calibration.source
    assert described["preprocess"]["img_size"] == 8 and described["preprocess"]["mean"] == [0.485, 0.456, 0.406]
    assert described["fingerprint"] == calibration.fingerprint()
    assert calibration.source in calibration.describe() and "crop 8" in calibration.describe()


def _missing_list(root: Path) -> dict[str, Any]:
    return {"calib_list": "nowhere.txt"}


def _empty_list(root: Path) -> dict[str, Any]:
    (root / "calib.txt").write_text("# no samples\n\n")
    return {"calib_list": "calib.txt"}


def _not_text(root: Path) -> dict[str, Any]:
    (root / "calib.txt").write_bytes(b"\xff\xfe\x00\x01 binary")
    return {"calib_list": "calib.txt"}


def _missing_image(root: Path) -> dict[str, Any]:
    write_split(root, "train", "list", [0, 1, 2])
    (root / "train" / "train_0001.png").unlink()
    return {}


def _undecodable(root: Path) -> dict[str, Any]:
    write_split(root, "train", "list", [0, 1, 2])
    (root / "train" / "train_0002.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    return {"num_workers": 2}


def _folder_without_images(root: Path) -> dict[str, Any]:
    (root / "imgs" / "class_a").mkdir(parents=True)
    (root / "imgs" / "class_a" / "notes.txt").write_text("not an image")
    return {"calib_list": "imgs"}


def _folder_without_classes(root: Path) -> dict[str, Any]:
    (root / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(root / "imgs" / "a.png")
    return {"calib_list": "imgs"}


def _default_train_folder_without_images(root: Path) -> dict[str, Any]:
    (root / "train" / "class_a").mkdir(parents=True)
    return {}


def _default_list_is_the_eval_list(root: Path) -> dict[str, Any]:
    lines = (root / "val_list.txt").read_text().splitlines()
    (root / "train_list.txt").write_text("\n".join(lines[:5]) + "\n")
    return {}


BAD_INPUTS = [
    pytest.param(_missing_list, r"Global\.calib_list .*nowhere\.txt does not exist", id="missing_list"),
    pytest.param(_empty_list, r"Global\.calib_list .*calib\.txt lists no images", id="empty_list"),
    pytest.param(_not_text, r"Global\.calib_list .*calib\.txt line 1 is not UTF-8 text", id="not_text"),
    pytest.param(
        _missing_image,
        r"calibration list .*train_list\.txt line 2: image .*train_0001\.png does not exist",
        id="missing_image",
    ),
    pytest.param(
        _undecodable,
        r"calibration list .*train_list\.txt line 3: image .*train_0002\.png cannot be decoded",
        id="undecodable",
    ),
    pytest.param(
        _folder_without_images,
        r"Global\.calib_list .*imgs has no images in its class folders",
        id="folder_without_images",
    ),
    pytest.param(
        _folder_without_classes, r"Global\.calib_list .*imgs has no class folders", id="folder_without_classes"
    ),
    pytest.param(
        _default_train_folder_without_images,
        r"default calibration folder .*train has no images.*Global\.calib_list",
        id="default_train_folder_without_images",
    ),
    pytest.param(
        _default_list_is_the_eval_list,
        r"found by default in .*train_list\.txt share 5 of 5 images with the evaluation set.*Global\.calib_list",
        id="default_list_is_the_eval_list",
    ),
]


@pytest.mark.parametrize(("make", "message"), BAD_INPUTS)
def test_bad_calibration_data_names_the_file(data: Path, make: Callable[[Path], dict[str, Any]], message: str) -> None:
    cfg = global_config(data, **make(data))
    with pytest.raises(DataError, match=message):
        calibrate(cfg)


def test_explicit_overlap_with_the_eval_set_warns(data: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_split(data, "train", "list", [0, 1, 2, 3])
    lines = (data / "train_list.txt").read_text().splitlines() + (data / "val_list.txt").read_text().splitlines()[:6]
    (data / "mixed.txt").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="analysis"):
        calibration = calibrate(global_config(data, calib_list="mixed.txt"))
    assert calibration is not None and calibration.num_samples == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "6 of the 10 calibration images" in warnings[0] and "optimistic" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="analysis"):
        assert calibrate(global_config(data)) is not None  # the training list alone shares nothing
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_overlap_is_found_through_symlinks(data: Path, tmp_path: Path) -> None:
    (tmp_path / "linked").symlink_to(data / "val", target_is_directory=True)
    (data / "train_list.txt").write_text(f"{tmp_path / 'linked' / 'img_0003.png'} 3\n")
    with pytest.raises(DataError, match="share 1 of 1 images"):
        calibrate(global_config(data))


def job_config(tmp_path: Path, data: Path, **extra: Any) -> Path:
    analysis = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "adaptive_bn": True}
    return write_config(tmp_path / "cfg.yaml", {"Global": tiny_global(data, **extra), "SensitivityAnalysis": analysis})


def test_build_inputs_builds_calibration_only_when_asked(
    tmp_path: Path, data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_split(data, "train", "list", [0, 1, 2, 3, 4])
    config = load_config(job_config(tmp_path, data))
    assert build_inputs(config, progress=False).calibration is None
    with caplog.at_level(logging.INFO, logger="analysis"):
        inputs = build_inputs(config, progress=False, calibration=True)
    assert inputs.calibration is not None and inputs.calibration.num_samples == 5
    assert inputs.loader.cache_placement == inputs.calibration.loader.cache_placement == "host"  # decoded, on the CPU
    assert any(r.getMessage().startswith("calibration: PaddleSlim list") for r in caplog.records)
    os.remove(data / "train" / "train_0004.png")
    with pytest.raises(DataError, match=r"train_list\.txt line 5: image .*train_0004\.png does not exist"):
        build_inputs(config, progress=False, calibration=True)


@pytest.mark.parametrize(("make", "message"), BAD_INPUTS)
def test_cli_bad_calibration_data_exits_2_before_writing(
    cli: Cli, tmp_path: Path, data: Path, make: Callable[[Path], dict[str, Any]], message: str
) -> None:
    result = cli("--config_path", job_config(tmp_path, data, **make(data)), "--pruned_ratios", "0.5")
    assert result.code == 2, result.err
    last = result.err.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), last
    assert "Traceback" not in result.err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written

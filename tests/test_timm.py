"""timm models (issue 17): ``Global.arch: timm/<name>``, weights from a state_dict or ``model.safetensors``, and the
evaluation preprocessing resolved from the model's pretrained config, equal to timm's own transform bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from analysis.config import GlobalConfig, config_from_data
from analysis.errors import ModelError
from analysis.inputs.data import Preprocess, load_image, normalize_batch
from analysis.inputs.model_preprocessing import (
    model_preprocessing,
    resolve_model_preprocessing,
    with_model_preprocessing,
)
from analysis.inputs.models import build_model
from analysis.io.results import load_sidecar

from helpers import REPO, CliResult, tiny_global, write_config

timm = pytest.importorskip("timm")  # the optional extra; CI installs it
safetensors_torch = pytest.importorskip("safetensors.torch")

# Two pretrained configs that differ in every key: bicubic, crop_pct 0.9, mean/std 0.5 / bilinear, 0.875, ImageNet's.
MODELS = {
    "vit_tiny_patch16_224.augreg_in21k_ft_in1k": (224, 248, "bicubic", (0.5, 0.5, 0.5)),
    "resnet18.tv_in1k": (224, 256, "bilinear", (0.485, 0.456, 0.406)),
}


def images(tmp_path: Path) -> list[Path]:
    """A noisy photo-sized JPEG (the hardest case for resampling) and a shipped demo image (upscaled)."""
    noisy = tmp_path / "noisy.jpg"
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (301, 417, 3), dtype=np.uint8)).save(noisy, quality=92)
    return [noisy, REPO / "datasets" / "digits" / "train" / "00671.png"]


@pytest.mark.parametrize("name", list(MODELS))
def test_resolved_preprocessing_equals_timms_own_transform_bit_for_bit(tmp_path: Path, name: str) -> None:
    from timm.data import create_transform, resolve_data_config

    resolved = model_preprocessing(GlobalConfig(arch=f"timm/{name}"))
    assert resolved is not None
    assert (resolved.img_size, resolved.resize_size, resolved.interpolation, resolved.mean) == MODELS[name]
    transform = create_transform(**resolve_data_config({}, model=timm.create_model(name, pretrained=False)))
    ours = Preprocess(resolved.img_size, resolved.resize_size, resolved.interpolation, resolved.mean, resolved.std)
    for path in images(tmp_path):
        with Image.open(path) as image:
            expected = transform(image.convert("RGB"))
        assert torch.equal(normalize_batch(load_image(str(path), ours).unsqueeze(0), ours)[0], expected)


def test_keys_the_yaml_sets_win_over_the_models_own() -> None:
    block = {"arch": "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", "resize_size": 230, "interpolation": "bilinear"}
    config = config_from_data({"Global": {**block, "data_dir": "data"}}, "vit.yaml")
    resolved = resolve_model_preprocessing(config)
    assert resolved is not None and resolved.resize_size == 248
    g = with_model_preprocessing(config, resolved).Global
    assert (g.img_size, g.resize_size, g.interpolation, g.mean, g.std) == (224, 230, "bilinear", [0.5] * 3, [0.5] * 3)
    assert config.Global.mean == [0.485, 0.456, 0.406]  # derived: the loaded config is left as it was


def test_torchvision_weights_bring_their_own_transforms() -> None:
    resolved = model_preprocessing(GlobalConfig(arch="resnet50", weights="ResNet50_Weights.IMAGENET1K_V2"))
    assert resolved is not None
    assert (resolved.img_size, resolved.resize_size, resolved.interpolation) == (224, 232, "bilinear")
    assert model_preprocessing(GlobalConfig(arch="resnet50")) is None  # no weights: nothing published to follow


@pytest.mark.parametrize("file_name", ["model.safetensors", "weights.pth"])
def test_weights_load_from_safetensors_or_a_state_dict(tmp_path: Path, file_name: str) -> None:
    source = timm.create_model("resnet18", pretrained=False, num_classes=10)
    if file_name.endswith(".safetensors"):
        safetensors_torch.save_file(source.state_dict(), str(tmp_path / file_name))
        g = GlobalConfig(arch="timm/resnet18", arch_kwargs={"num_classes": 10}, model_dir=str(tmp_path))  # hub folder
    else:
        torch.save(source.state_dict(), tmp_path / file_name)
        g = GlobalConfig(arch="timm/resnet18", arch_kwargs={"num_classes": 10}, model_dir=str(tmp_path),
                         params_filename=file_name)  # fmt: skip
    loaded = build_model(g).state_dict()
    assert loaded.keys() == source.state_dict().keys()
    assert all(torch.equal(loaded[key], value) for key, value in source.state_dict().items())


@pytest.mark.parametrize(
    ("g", "pattern"),
    [
        (GlobalConfig(arch="timm/resnet_18"), r"timm .* has no model 'resnet_18' \(did you mean 'resnet18'\?\)"),
        (GlobalConfig(arch="timm/resnet18", arch_kwargs={"depth": 3}), r"Global\.arch_kwargs do not fit timm/resnet18"),
        (GlobalConfig(arch="timm/resnet18", weights="DEFAULT"), r"Global\.weights only applies to torchvision"),
    ],
)
def test_bad_timm_input_is_one_sentence(g: GlobalConfig, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern):
        build_model(g)


def test_a_damaged_safetensors_file_names_it(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match=r"model\.safetensors is not a readable safetensors file"):
        build_model(GlobalConfig(arch="timm/resnet18", model_dir=str(tmp_path)))


def test_a_run_prints_and_stores_the_resolved_preprocessing(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    """Keys the YAML leaves unset come from timm's pretrained config; the one it sets (resize_size) wins."""
    block = tiny_global(list_data, arch="timm/mobilenetv3_small_050.lamb_in1k", resize_size=240)
    for key in ("img_size", "interpolation"):
        block.pop(key, None)
    section = {
        "analysis_file": str(tmp_path / "s.pkl"),
        "pruned_ratios": [0.5],
        "prune_params_name": ["conv_stem.weight"],
    }
    config = write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": section})
    result = cli("--config_path", config, "--no_report")
    assert result.code == 0, result.err
    assert ("preprocessing from timm's pretrained config of mobilenetv3_small_050.lamb_in1k: img_size=224, "
            "resize_size=240 (YAML), interpolation=bicubic, mean=[0.485, 0.456, 0.406]") in result.err  # fmt: skip
    stored = load_sidecar(tmp_path / "s.pkl")["config"]
    assert stored["preprocessing_from"] == "timm's pretrained config of mobilenetv3_small_050.lamb_in1k"
    assert (stored["Global"]["img_size"], stored["Global"]["resize_size"], stored["Global"]["interpolation"]) == (
        224, 240, "bicubic")  # fmt: skip

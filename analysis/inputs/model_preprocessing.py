"""The evaluation preprocessing a model was published with: a timm model's pretrained config, or a torchvision
weights entry's ``transforms()``. It fills the ``Global`` keys the YAML leaves unset, so that a model is evaluated the
way its accuracy was measured (timm ViTs use bicubic resizing, crop_pct 0.9 and mean/std 0.5, not ImageNet's)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torchvision

from analysis.config import INTERPOLATIONS, Config, GlobalConfig, derive
from analysis.errors import ModelError
from analysis.inputs.timm_models import is_timm_arch, optional_module, timm_model_name

PREPROCESSING_KEYS = ("img_size", "resize_size", "interpolation", "mean", "std")
"""The ``Global`` keys a model's own preprocessing sets, unless the YAML sets them."""


@dataclass(frozen=True)
class ModelPreprocessing:
    """Square resize-then-center-crop preprocessing, as ``Global`` keys, and where it comes from."""

    img_size: int
    resize_size: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    def values(self) -> dict[str, object]:
        """The ``Global`` keys and their values (lists for mean and std, as the config holds them)."""
        return {key: list(value) if isinstance(value, tuple) else value
                for key, value in dataclasses.asdict(self).items() if key in PREPROCESSING_KEYS}  # fmt: skip


def model_preprocessing(g: GlobalConfig) -> ModelPreprocessing | None:
    """The preprocessing ``g``'s model was published with: from timm's pretrained config for ``timm/<name>``, from
    the weights' transforms for a torchvision name with ``Global.weights``; None for other models.

    Raises:
        ModelError: The model's preprocessing cannot be expressed with these keys (a non-square input, another crop
            mode or interpolation); the message says which keys to set instead.
    """
    if is_timm_arch(g.arch):
        assert g.arch is not None
        return _timm_preprocessing(g.arch)
    if g.arch and ":" not in g.arch and g.weights:
        return _torchvision_preprocessing(g.arch, g.weights)
    return None


def resolve_model_preprocessing(config: Config) -> ModelPreprocessing | None:
    """The model's own preprocessing when ``config`` leaves some of its keys unset (none set by the YAML, an
    override or a flag: ``Config.explicit_keys``); None when it sets them all or the model has none."""
    if all(f"Global.{key}" in config.explicit_keys for key in PREPROCESSING_KEYS):
        return None
    return model_preprocessing(config.Global)


def with_model_preprocessing(config: Config, preprocessing: ModelPreprocessing | None) -> Config:
    """``config`` with the preprocessing keys it leaves unset taken from ``preprocessing`` (the model's own), as a new
    validated config; ``config`` itself when ``preprocessing`` is None.

    Raises:
        ModelError: The keys so resolved make a resize smaller than the crop; the message says to set both.
    """
    if preprocessing is None:
        return config
    g = config.Global
    unset = {key: value for key, value in preprocessing.values().items() if f"Global.{key}" not in config.explicit_keys}
    resize_size, img_size = unset.get("resize_size", g.resize_size), unset.get("img_size", g.img_size)
    assert isinstance(resize_size, int) and isinstance(img_size, int)
    if resize_size < img_size:
        raise ModelError(
            f"Global.resize_size ({resize_size}) is smaller than Global.img_size ({img_size}) once "
            f"{preprocessing.source} fills the keys the YAML leaves unset; set both explicitly."
        )
    return derive(config, {f"Global.{key}": value for key, value in unset.items()}, command_line=False)


def _timm_preprocessing(arch: str) -> ModelPreprocessing | None:
    name = timm_model_name(arch)
    timm_data = optional_module("timm.data", f"Global.arch {arch}")
    timm_models = optional_module("timm.models", f"Global.arch {arch}")
    pretrained = timm_models.get_pretrained_cfg(name)
    if pretrained is None:
        return None
    config = timm_data.resolve_data_config({}, pretrained_cfg=pretrained.to_dict())
    source = f"timm's pretrained config of {name}"
    _, height, width = config["input_size"]
    if height != width or config.get("crop_mode", "center") != "center":
        raise ModelError(
            f"{source} asks for a {height}x{width} input with crop mode {config.get('crop_mode')}, which Global's "
            "square center crop cannot express; set Global.img_size, resize_size and interpolation explicitly."
        )
    return ModelPreprocessing(
        img_size=height,
        resize_size=math.floor(height / config["crop_pct"]),  # timm's transforms_imagenet_eval rule
        interpolation=_interpolation(config["interpolation"], source),
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
        source=source,
    )


def _torchvision_preprocessing(arch: str, weights: str) -> ModelPreprocessing:
    try:
        entry = (torchvision.models.get_weight(weights) if "." in weights
                 else torchvision.models.get_model_weights(arch)[weights])  # fmt: skip
    except (ValueError, KeyError, AttributeError) as error:
        raise ModelError(f"Global.weights '{weights}' is not a torchvision weights name of {arch} ({error}).") from None
    transforms = entry.transforms()
    source = f"the transforms of torchvision's {entry}"
    return ModelPreprocessing(
        img_size=_single(transforms.crop_size, source),
        resize_size=_single(transforms.resize_size, source),
        interpolation=_interpolation(transforms.interpolation.value, source),
        mean=tuple(transforms.mean),
        std=tuple(transforms.std),
        source=source,
    )


def _single(size: Sequence[int], source: str) -> int:
    if len(size) != 1:
        raise ModelError(f"{source} resize to {list(size)}, not a short side; set Global.img_size and resize_size.")
    return int(size[0])


def _interpolation(name: str, source: str) -> str:
    if name not in INTERPOLATIONS:
        raise ModelError(f"{source} resizes with {name}, which Global.interpolation does not offer; set it explicitly "
                         f"to one of {', '.join(INTERPOLATIONS)}.")  # fmt: skip
    return name

"""Every way of building and loading a model, and a clear refusal for every unsafe or mismatched file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from analysis.config import GlobalConfig
from analysis.errors import ModelError
from analysis.inputs.models import build_model, count_outputs, create_architecture

from helpers import TINY_MODELS

TINY = f"{TINY_MODELS}:tiny_cnn"


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def trained_tiny(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    model = create_architecture(TINY, {"num_classes": 10})
    model[1].running_mean.uniform_()  # buffers must round-trip too
    return model


def test_torchvision_name_with_kwargs_and_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = torchvision.models.get_model("mobilenet_v2", num_classes=7, width_mult=0.25)
    torch.save(reference.state_dict(), tmp_path / "w.pth")
    cfg = GlobalConfig(
        arch="mobilenet_v2",
        arch_kwargs={"num_classes": 7, "width_mult": 0.25},
        model_dir=str(tmp_path),
        params_filename="w.pth",
    )
    model = build_model(cfg)
    assert same_weights(model, reference)
    assert not model.training


def test_model_filename_is_the_weights_when_params_filename_is_absent(tmp_path: Path) -> None:
    reference = trained_tiny()
    torch.save(reference.state_dict(), tmp_path / "w.pt")
    model = build_model(GlobalConfig(arch=TINY, model_dir=str(tmp_path), model_filename="w.pt"))
    assert same_weights(model, reference)


def test_model_dir_may_name_the_checkpoint_file(tmp_path: Path) -> None:
    reference = trained_tiny()
    torch.save(reference.state_dict(), tmp_path / "w.pt")
    assert same_weights(build_model(GlobalConfig(arch=TINY, model_dir=str(tmp_path / "w.pt"))), reference)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: {"state_dict": sd, "epoch": 3},
        lambda sd: {"model": sd, "optimizer": {}},
        lambda sd: {"model_state_dict": sd},
        lambda sd: {f"module.{k}": v for k, v in sd.items()},
        lambda sd: {"state_dict": {f"_orig_mod.{k}": v for k, v in sd.items()}},
    ],
    ids=["state_dict", "model", "model_state_dict", "ddp-prefix", "compile-prefix"],
)
def test_checkpoint_wrappers_and_prefixes_are_unwrapped(tmp_path: Path, wrap) -> None:
    reference = trained_tiny()
    torch.save(wrap(reference.state_dict()), tmp_path / "w.pt")
    assert same_weights(build_model(GlobalConfig(arch=TINY, params_filename=str(tmp_path / "w.pt"))), reference)


def test_missing_num_batches_tracked_is_tolerated(tmp_path: Path) -> None:
    reference = trained_tiny()
    state = {k: v for k, v in reference.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "w.pt")
    model = build_model(GlobalConfig(arch=TINY, params_filename=str(tmp_path / "w.pt")))
    assert torch.equal(model[1].running_mean, reference[1].running_mean)


def test_file_callable_with_kwargs() -> None:
    model = build_model(GlobalConfig(arch=TINY, arch_kwargs={"num_classes": 4, "width": 5}))
    assert model[0].out_channels == 5 and model[-1].out_features == 4


def test_package_module_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(
        "from torch import nn\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self, classes=3):\n        super().__init__(nn.Flatten(), nn.LazyLinear(classes))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(GlobalConfig(arch="userpkg.nets:Net", arch_kwargs={"classes": 6}))
    assert type(model).__name__ == "Net" and model[1].out_features == 6
    assert isinstance(build_model(GlobalConfig(arch="torchvision.models:alexnet")), torchvision.models.AlexNet)
    sys.modules.pop("userpkg.nets", None)
    sys.modules.pop("userpkg", None)


def test_weights_name_is_resolved_and_passed_to_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_get_model(name: str, weights=None, **kwargs):  # no download in tests
        seen.update(name=name, weights=weights, kwargs=kwargs)
        return nn.Linear(1, 1)

    monkeypatch.setattr(torchvision.models, "get_model", fake_get_model)
    build_model(GlobalConfig(arch="resnet50", weights="ResNet50_Weights.IMAGENET1K_V2"))
    assert seen["name"] == "resnet50"
    assert seen["weights"] is torchvision.models.ResNet50_Weights.IMAGENET1K_V2


def test_unknown_weights_name() -> None:
    with pytest.raises(ModelError, match=r"Global\.weights 'ResNet50_Weights\.NOPE' is not a torchvision weights"):
        build_model(GlobalConfig(arch="resnet50", weights="ResNet50_Weights.NOPE"))


def test_trusted_pickled_module_loads(tmp_path: Path) -> None:
    reference = trained_tiny()
    torch.save(reference, tmp_path / "full.pt")
    model = build_model(GlobalConfig(model_dir=str(tmp_path), model_filename="full.pt", trust_model_file=True))
    assert same_weights(model, reference)


def test_untrusted_pickled_module_is_refused(tmp_path: Path) -> None:
    torch.save(trained_tiny(), tmp_path / "full.pt")
    with pytest.raises(
        ModelError, match=r"full\.pt contains pickled Python objects .*trust_model_file=true on the command line"
    ):
        build_model(GlobalConfig(model_dir=str(tmp_path), model_filename="full.pt"))


def test_pickled_module_whose_class_is_gone(tmp_path: Path) -> None:
    source = tmp_path / "gone_module.py"
    source.write_text("from torch import nn\n\nclass Gone(nn.Linear):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import gone_module

        torch.save(gone_module.Gone(2, 2), tmp_path / "full.pt")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_module", None)
    with pytest.raises(ModelError, match=r"needs the Python class it was saved from"):
        build_model(GlobalConfig(model_filename=str(tmp_path / "full.pt"), trust_model_file=True))


def test_state_dict_without_arch_asks_for_arch(tmp_path: Path) -> None:
    torch.save(trained_tiny().state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelError, match=r"holds a state_dict, not a model; set Global\.arch"):
        build_model(GlobalConfig(model_filename=str(tmp_path / "w.pt")))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("trusted", [False, True])
def test_torchscript_is_refused(tmp_path: Path, trusted: bool) -> None:
    torch.jit.script(trained_tiny()).save(str(tmp_path / "scripted.pt"))
    with pytest.raises(ModelError, match=r"scripted\.pt is a TorchScript archive"):
        build_model(GlobalConfig(model_filename=str(tmp_path / "scripted.pt"), trust_model_file=trusted))
    with pytest.raises(ModelError, match=r"TorchScript"):
        build_model(GlobalConfig(arch=TINY, params_filename=str(tmp_path / "scripted.pt")))


def test_checkpoint_not_found(tmp_path: Path) -> None:
    with pytest.raises(
        ModelError, match=r"Checkpoint .*w\.pt does not exist; check Global\.model_dir and Global\.params"
    ):
        build_model(GlobalConfig(arch=TINY, model_dir=str(tmp_path), params_filename="w.pt"))


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "w.pt").write_text("hello")
    with pytest.raises(ModelError, match=r"w\.pt is not a readable PyTorch checkpoint"):
        build_model(GlobalConfig(arch=TINY, params_filename=str(tmp_path / "w.pt")))


def test_key_mismatch_lists_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelError) as info:
        build_model(GlobalConfig(arch=TINY, params_filename=str(tmp_path / "w.pt")))
    message = str(info.value)
    assert "does not match Global.arch" in message
    assert "missing (0.weight, 1.weight, 1.bias, ...)" in message
    assert "unexpected (conv1.weight, bn1.weight, bn1.bias, ...)" in message


def test_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    torch.save(create_architecture(TINY, {"num_classes": 5}).state_dict(), tmp_path / "w.pt")
    with pytest.raises(
        ModelError, match=r"2 with another shape \(8\.weight \[5, 16\] vs \[10, 16\], 8\.bias .*num_classes"
    ):
        build_model(GlobalConfig(arch=TINY, arch_kwargs={"num_classes": 10}, params_filename=str(tmp_path / "w.pt")))


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("resnet81", {}, r"'resnet81' is not a torchvision model \(did you mean 'resnet18'\?\)"),
        ("resnet18", {"num_clases": 3}, r"arch_kwargs do not fit torchvision resnet18"),
        (f"{TINY_MODELS}:tiny_cnn", {"depth": 3}, r"arch_kwargs do not fit .*depth"),
        (f"{TINY_MODELS}:tiny_cn", {}, r"has no attribute 'tiny_cn' \(did you mean 'tiny_cnn'\?\)"),
        (f"{TINY_MODELS}:not_a_model", {}, r"return annotation is not a torch\.nn\.Module class"),
        ("nowhere/model.py:net", {}, r"model file nowhere/model\.py does not exist"),
        ("no_such_package_xyz.models:net", {}, r"cannot import module 'no_such_package_xyz\.models'"),
    ],
)
def test_bad_arch(arch: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        build_model(GlobalConfig(arch=arch, arch_kwargs=kwargs))


def test_count_outputs_and_bad_input_size() -> None:
    model = create_architecture(TINY, {"num_classes": 7})
    assert count_outputs(model.eval(), 16, torch.device("cpu")) == 7
    with pytest.raises(ModelError, match=r"cannot run on a 3x16x16 image"):
        count_outputs(nn.Sequential(nn.Flatten(), nn.Linear(10, 2)), 16, torch.device("cpu"))

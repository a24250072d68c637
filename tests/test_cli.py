"""The command line: a baseline run, and exit code 2 with one sentence for every kind of bad input."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import analysis.workflow.job
from analysis.inputs.models import create_architecture
from analysis.io.results import load_sensitivities, load_sidecar

from helpers import (
    REPO,
    TINY_MODELS,
    CliResult,
    analysis_config,
    assert_user_error,
    tiny_global,
    write_config,
    write_images,
)

Cli = Callable[..., CliResult]


def config_file(tmp_path: Path, data_dir: Path, **extra: object) -> Path:
    analysis = {"analysis_file": str(tmp_path / "out" / "s.pkl")}
    return write_config(
        tmp_path / "cfg.yaml", {"Global": tiny_global(data_dir, **extra), "SensitivityAnalysis": analysis}
    )


def test_baseline_run_prints_one_result_line(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    result = cli("--config_path", config_file(tmp_path, list_data))
    assert result.code == 0, result.err
    assert result.out.startswith("baseline: top1=") and "(20 images" in result.out
    assert "PaddleSlim list" in result.err and "Global: arch=" in result.err


def test_flags_and_overrides_reach_the_config(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = config_file(tmp_path, list_data)
    result = cli("--config_path", path, "--pruned_ratios", "0.5", "0.25,0.75", "Global.max_samples=10", "--quiet")
    assert result.code == 0, result.err
    assert "(10 images" in result.out
    # --quiet: no config dump, no progress; warnings stay (this tiny model has random weights)
    assert [line for line in result.err.splitlines() if "random weights" not in line] == []
    # both tokens of "0.25,0.75" and the separate 0.5 were analysed, sorted, for each of the two convs
    sidecar = load_sidecar(tmp_path / "out" / "s.pkl")
    assert sidecar["config"]["SensitivityAnalysis"]["pruned_ratios"] == [0.25, 0.5, 0.75]
    losses = load_sensitivities(tmp_path / "out" / "s.pkl")
    assert {name: sorted(curve) for name, curve in losses.items()} == {"0.weight": [0.25, 0.5, 0.75],
                                                                       "3.weight": [0.25, 0.5, 0.75]}  # fmt: skip


def test_baseline_matches_a_direct_evaluation(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    torch.manual_seed(5)
    model = create_architecture(f"{TINY_MODELS}:tiny_cnn", {"num_classes": 10})
    torch.save(model.state_dict(), tmp_path / "w.pt")
    result = cli("--config_path", config_file(tmp_path, list_data, params_filename=str(tmp_path / "w.pt")))
    from analysis.config import GlobalConfig
    from analysis.engine.evaluate import evaluate
    from analysis.inputs.data import build_eval_loader

    cfg = GlobalConfig(**tiny_global(list_data))
    expected = evaluate(model.eval(), build_eval_loader(cfg, torch.device("cpu")), progress=False)
    assert f"top1={expected.top1:.4f} top5={expected.top5:.4f} ce={expected.ce:.4f}" in result.out


def test_act_config_lists_its_ignored_blocks(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = write_config(
        tmp_path / "act.yaml",
        {
            "Global": tiny_global(list_data, input_name="x"),
            "Distillation": {"alpha": 1.0, "loss": "l2", "node": ["softmax_0.tmp_0"]},
            "ChannelPrune": {"pruned_ratio": 0.25, "criterion": "l1_norm", "prune_params_name": ["0.weight"]},
            "TrainConfig": {"epochs": 1, "learning_rate": {"type": "CosineAnnealingDecay", "learning_rate": 0.01}},
        },
    )
    result = cli("--config_path", path)
    assert result.code == 0, result.err
    assert "ignored blocks: Distillation, ChannelPrune, TrainConfig" in result.err


def bad_yaml(tmp_path: Path, data: Path) -> list[str]:
    path = tmp_path / "bad.yaml"
    path.write_text("Global:\n  arch: resnet18\n  data_dir: [x\n")
    return ["--config_path", str(path)]


def no_global(tmp_path: Path, data: Path) -> list[str]:
    return ["--config_path", str(write_config(tmp_path / "c.yaml", {"TrainConfig": {"epochs": 1}}))]


def with_global(**changes: object) -> Callable[[Path, Path], list[str]]:
    def make(tmp_path: Path, data: Path) -> list[str]:
        block = tiny_global(data)
        for key, value in changes.items():
            if value is None:
                block.pop(key, None)
            else:
                block[key] = value(tmp_path) if callable(value) else value
        analysis = {"analysis_file": str(tmp_path / "out" / "s.pkl")}
        return [
            "--config_path",
            str(write_config(tmp_path / "c.yaml", {"Global": block, "SensitivityAnalysis": analysis})),
        ]

    return make


def corrupt_image(tmp_path: Path, data: Path) -> list[str]:
    (data / "val" / "img_0003.png").write_bytes(b"not a png")
    return with_global()(tmp_path, data)


def missing_image(tmp_path: Path, data: Path) -> list[str]:
    (data / "val" / "img_0003.png").unlink()
    return with_global()(tmp_path, data)


def unlabeled_line(tmp_path: Path, data: Path) -> list[str]:
    with (data / "val_list.txt").open("a") as handle:
        handle.write("val/img_0001.png\n")
    return with_global()(tmp_path, data)


def no_layout(tmp_path: Path, data: Path) -> list[str]:
    empty = tmp_path / "empty"
    empty.mkdir()
    return with_global(data_dir=str(empty))(tmp_path, data)


def mismatched_checkpoint(tmp_path: Path, data: Path) -> list[str]:
    torch.save(create_architecture(f"{TINY_MODELS}:tiny_cnn", {"num_classes": 3}).state_dict(), tmp_path / "w.pt")
    return with_global(params_filename=str(tmp_path / "w.pt"))(tmp_path, data)


def untrusted_module(tmp_path: Path, data: Path) -> list[str]:
    torch.save(create_architecture(f"{TINY_MODELS}:tiny_cnn", {}), tmp_path / "full.pt")
    return with_global(arch=None, arch_kwargs=None, model_filename=str(tmp_path / "full.pt"))(tmp_path, data)


BAD_INPUTS = {
    "missing config file": (lambda t, d: ["--config_path", str(t / "nope.yaml")], r"nope\.yaml does not exist"),
    "yaml syntax error": (bad_yaml, r"bad\.yaml line 4, column 1: invalid YAML .*opened on line 3"),
    "missing Global": (no_global, r"has no Global block"),
    "unknown key in Global": (with_global(batchsize=3), r"Unknown key Global\.batchsize \(did you mean 'batch_size'"),
    "wrong type": (with_global(batch_size="abc"), r"Global\.batch_size must be an integer, got 'abc'"),
    "ratio outside (0, 1)": (
        lambda t, d: [*with_global()(t, d), "--pruned_ratios", "0.2", "1.2"],
        r"SensitivityAnalysis\.pruned_ratios must hold ratios strictly between 0 and 1, got 1\.2",
    ),
    "ratio not a number": (
        lambda t, d: [*with_global()(t, d), "--pruned_ratios", "0.2", "half"],
        r"--pruned_ratios: 'half' is not a number",
    ),
    "data_dir not set": (with_global(data_dir=None), r"Global\.data_dir is not set"),
    "data_dir missing": (with_global(data_dir=lambda t: str(t / "gone")), r"Global\.data_dir .*gone does not exist"),
    "no val_list and no ImageFolder": (no_layout, r"has neither val_list\.txt .* nor val/<class>/"),
    "val_list line without label": (unlabeled_line, r"val_list\.txt line 21: 'val/img_0001\.png' has no label"),
    "image does not exist": (missing_image, r"val_list\.txt line 4: image .*img_0003\.png does not exist"),
    "corrupt image": (corrupt_image, r"val_list\.txt line 4: image .*img_0003\.png cannot be decoded"),
    "label out of range": (
        with_global(arch_kwargs={"num_classes": 4}),
        r"line 5: label 4 is outside the model's 4 classes",
    ),
    "checkpoint not found": (
        with_global(model_dir=lambda t: str(t), params_filename="w.pt"),
        r"Checkpoint .*w\.pt does not exist; check Global\.model_dir and Global\.params_filename",
    ),
    "checkpoint keys mismatch": (mismatched_checkpoint, r"w\.pt does not match Global\.arch .*with another shape"),
    "untrusted pickled module": (untrusted_module, r"full\.pt contains pickled Python objects .*trust_model_file"),
    "unknown arch": (with_global(arch="resnet81"), r"Global\.arch 'resnet81' is not a torchvision model"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_sentence(cli: Cli, tmp_path: Path, list_data: Path, case: str) -> None:
    make_argv, pattern = BAD_INPUTS[case]
    assert_user_error(cli(*make_argv(tmp_path, list_data)), pattern)
    assert not (tmp_path / "out").exists()  # nothing written


def test_imagefolder_layout_end_to_end(cli: Cli, tmp_path: Path) -> None:
    root = tmp_path / "folder"
    write_images(root, "folder", [i % 10 for i in range(30)])
    result = cli("--config_path", config_file(tmp_path, root))
    assert result.code == 0, result.err
    assert "(30 images" in result.out and "ImageFolder" in result.err


def test_internal_bugs_keep_their_traceback(
    cli: Cli, tmp_path: Path, list_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(analysis.workflow.job, "evaluate", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli("--config_path", config_file(tmp_path, list_data))


def test_run_py_exits_2_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "run.py", "--config_path", str(tmp_path / "missing.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: Config file {tmp_path / 'missing.yaml'} does not exist; pass an existing "
        "YAML file with --config_path."
    )
    assert proc.stdout == ""


class Evil:
    """Unpickling this would create a marker file: the restricted unpickler must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def existing_file(kind: str, tmp_path: Path) -> bytes:
    path = tmp_path / "out" / "s.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        path.write_bytes(b"this is not a pickle\n")
    elif kind == "code":
        path.write_bytes(pickle.dumps({"features.0.weight": {0.5: Evil(tmp_path / "pwned")}}))
    return path.read_bytes()


@pytest.mark.parametrize(
    ("arch", "analysis", "existing", "pattern"),
    [
        ("slow_cnn", {"prune_params_name": ["features.3.weigth"]}, None,
         r"prune_params_name: 'features\.3\.weigth' is not a unit of this model .*did you mean 'features\.3\.weight'"),
        ("depthwise_cnn", {"prune_params_name": ["3.weight"]}, None,
         r"prune_params_name: '3\.weight' cannot be pruned: depthwise conv"),
        ("slow_cnn", {"skip_params": ["features.9.weight"]}, None, r"skip_params: 'features\.9\.weight' is not a unit"),
        ("slow_cnn", {}, "garbage", r"s\.pkl is not a pickle or is damaged"),
        ("slow_cnn", {}, "code", r"s\.pkl holds code or unexpected types \(pathlib\.Path\.touch\)"),
        ("constant_logits", {}, None, r"baseline top1 is 0, so a relative loss is undefined .*metric_mode: absolute"),
    ],
    ids=["unknown name", "not prunable", "unknown skip", "not a pickle", "holds code", "baseline 0"],
)  # fmt: skip
def test_bad_analysis_input_leaves_the_analysis_file_untouched(
    cli: Cli, tmp_path: Path, list_data: Path, arch: str, analysis: dict, existing: str | None, pattern: str
) -> None:
    before = existing_file(existing, tmp_path) if existing else None
    if arch == "constant_logits":  # every image is predicted as class 0; drop class-0 images so top1 is 0
        lines = (list_data / "val_list.txt").read_text().splitlines()
        (list_data / "val_list.txt").write_text("\n".join(x for x in lines if not x.endswith(" 0")) + "\n")
    result = cli("--config_path", analysis_config(tmp_path, list_data, arch, analysis, arch_kwargs={}))
    assert_user_error(result, pattern)
    path = tmp_path / "out" / "s.pkl"
    assert (path.read_bytes() == before) if before is not None else not path.exists()
    assert not (tmp_path / "pwned").exists()


def test_nan_logits_are_refused(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "constant_logits", arch_kwargs={"value": float("nan")})
    assert_user_error(cli("--config_path", path), r"baseline model produced non-finite top1|non-finite .*ce")
    assert not (tmp_path / "out" / "s.pkl").exists()


def test_file_from_another_model_is_refused_and_kept(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "slow_cnn", arch_kwargs={"delay": 0.0})
    assert cli("--config_path", path, "--quiet").code == 0
    before = (tmp_path / "out" / "s.pkl").read_bytes()
    first_model = load_sidecar(tmp_path / "out" / "s.pkl")["fingerprint"]["model"]
    result = cli("--config_path", path, "Global.seed=1")  # other random weights
    assert_user_error(result, r"s\.pkl was computed with another model .*--overwrite")
    assert (tmp_path / "out" / "s.pkl").read_bytes() == before
    result = cli("--config_path", path, "SensitivityAnalysis.criterion=l2_norm")
    assert_user_error(result, r"computed with criterion 'l1_norm' \(this run uses 'l2_norm'\)")
    result = cli("--config_path", path, "Global.max_samples=10")
    assert_user_error(result, r"computed with other data or preprocessing")
    assert cli("--config_path", path, "Global.seed=1", "--overwrite", "--quiet").code == 0
    assert load_sidecar(tmp_path / "out" / "s.pkl")["fingerprint"]["model"] != first_model


def test_full_run_prints_the_table_and_writes_the_files(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "depthwise_cnn", {"pruned_ratios": [0.25, 0.5], "target_loss": 0.5},
                           arch_kwargs={})  # fmt: skip
    result = cli("--config_path", path)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("baseline: top1=") and "(20 images)" in lines[0]
    header = next(line for line in lines if line.startswith("param"))
    assert header.split() == ["param", "shape", "group", "0.25", "0.5", "ratio"]
    assert any(line.startswith("0.weight ") for line in lines) and any(line.startswith("6.weight ") for line in lines)
    assert "  3.weight: depthwise conv" in result.out  # unprunable convs are listed with their reason
    assert "target_loss 0.5: each layer gets the largest ratio" in result.out
    for suffix in ("", ".json", ".ratios.yaml"):
        assert (tmp_path / "out" / f"s.pkl{suffix}").is_file()
    for name in ("s.wide.csv", "s.long.csv", "s.curves.png", "s.heatmap.png", "s.savings.png", "s.report.html"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    assert f"report: {tmp_path / 'out' / 's.report.html'}" in result.out


def test_no_report_flag_writes_only_the_analysis_files(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    result = cli("--config_path", analysis_config(tmp_path, list_data, "depthwise_cnn", arch_kwargs={}), "--no_report")
    assert result.code == 0, result.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s.pkl", "s.pkl.json"]


def test_report_command_reproduces_the_csv_from_a_copied_file(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "depthwise_cnn", {"pruned_ratios": [0.25, 0.5]}, arch_kwargs={})
    assert cli("--config_path", path, "--quiet").code == 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("s.pkl", "s.pkl.json"):
        (copy / name).write_bytes((tmp_path / "out" / name).read_bytes())
    result = cli("report", copy / "s.pkl", "--target_loss", "0.1")
    assert result.code == 0, result.err
    for name in ("s.wide.csv", "s.long.csv"):
        assert (copy / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name
    assert str(copy / "s.report.html") in result.out.splitlines()
    assert_user_error(cli("report", tmp_path / "missing.pkl"), r"Analysis file .*missing.pkl does not exist")


def test_deps_command_prints_and_exports_the_sets(cli: Cli, tmp_path: Path, list_data: Path) -> None:
    path = analysis_config(tmp_path, list_data, "depthwise_cnn", arch_kwargs={})
    result = cli("deps", "--config_path", path, "--output", tmp_path / "deps.csv")
    assert result.code == 0, result.err
    csv_lines = (tmp_path / "deps.csv").read_text().splitlines()
    assert csv_lines[0] == "Dependency Set,Layers"
    assert csv_lines[1] == "Set 1,0,3"  # the depthwise conv 3 goes with the conv feeding it
    assert "Set 1: 0, 3" in result.out and "not prunable: 3: depthwise conv" in result.out
    assert not (tmp_path / "out").exists()  # nothing evaluated, no analysis file

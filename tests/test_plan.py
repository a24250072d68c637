"""Budget plans on real models: the target is met exactly, coupled params share a ratio, joint verification and the
exported model reproduce what was measured, and the report shows predicted against measured loss."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime
import pytest
import torch
import yaml

from analysis import analysis_prune, run_plan_step
from analysis.config import load_config
from analysis.engine.evaluate import evaluate
from analysis.errors import UserError
from analysis.inputs.data import build_eval_loader
from analysis.inputs.models import build_model
from analysis.io.results import load_sensitivities, load_sidecar, save_sensitivities
from analysis.planning._curves import interpolate, monotone_curve
from analysis.planning.export import load_pruned
from analysis.planning.plan import build_plan, open_planner, param_count, plan_from_ratios
from analysis.structure.flops import count_cost
from analysis.structure.groups import eval_mode, find_prunable, removal_group
from analysis.structure.physical import jointly_pruned_copy

from helpers import REPO, CliResult, batches, pseudo_labelled, randomize, tiny_global, write_config
from tiny_models import tiny_cnn, tiny_densenet, tiny_grouped, tiny_inverted_residual, tiny_resnet

DEMO = ["digits_resnet.yaml", "digits_mobilenet.yaml"]
TINY_CNN_CHANNELS = {"0.weight": 8, "3.weight": 16}  # tiny_cnn's prunable convs (width 8) and their channels


def tiny_cnn_cost(removed_first: int, removed_second: int) -> tuple[int, int]:
    """(MACs, params) of ``tiny_cnn`` on 16x16 images with channels removed from its two convs, counted by hand:
    conv 3->8 3x3 on 16x16, BN, conv 8->16 3x3 stride 2 (8x8 out), BN, pool, linear 16->10 (convs without bias)."""
    first, second = 8 - removed_first, 16 - removed_second
    macs = first * 3 * 9 * 16 * 16 + second * first * 9 * 8 * 8 + second * 10
    params = first * 3 * 9 + 2 * first + second * first * 9 + 2 * second + second * 10 + 10
    return macs, params


TINY_CNN_DENSE = tiny_cnn_cost(0, 0)


def analysed(model: torch.nn.Module, path: Path, ratios=(0.25, 0.5, 0.75), **options: Any) -> Path:
    """Analyse ``model`` into ``path`` on two pseudo-labelled batches (``options``: analysis_prune's settings)."""
    data = pseudo_labelled(model, batches(count=2))
    analysis_prune(model, data, path, pruned_ratios=ratios, progress=False, **options)
    return path


@pytest.mark.parametrize("factory", [tiny_resnet, tiny_densenet], ids=["resnet", "densenet"])
@pytest.mark.parametrize("target", [0.2, 0.45])
def test_plan_meets_the_target_exactly_and_its_cost_is_the_pruned_models(factory, target, tmp_path: Path) -> None:
    model = randomize(factory())
    example = batches(count=1)[0][0]
    plan = build_plan(model, example, analysed(model, tmp_path / "s.pkl"), target)
    pruned = jointly_pruned_copy(model, plan.removals(), example)
    measured = count_cost(pruned, example)
    assert (measured.macs, measured.params) == (plan.pruned.macs, plan.pruned.params)  # the joint cost is exact
    assert 1 - measured.macs / plan.dense.macs >= target
    assert plan.predicted_loss >= plan.lower_bound - 1e-12


def test_coupled_params_share_their_groups_ratio(tmp_path: Path) -> None:
    """At 70% fewer MACs the plan of this seeded model prunes the stem's residual chain (conv1 and layer1.conv2,
    joined by the add) together with others: every member of a coupled group gets the group's one ratio."""
    model = randomize(tiny_resnet())
    example = batches(count=1)[0][0]
    plan = build_plan(model, example, analysed(model, tmp_path / "s.pkl"), 0.7)
    coupled = {p.name: set(p.coupled_params) for p in find_prunable(model, example) if p.prunable}
    ratios = plan.ratios
    checked = 0
    for name, partners in coupled.items():
        for partner in partners & set(ratios):
            assert name in ratios and ratios[name] == ratios[partner]
            checked += 1
    assert checked  # the plan does prune a coupled group, so the loop compared ratios
    assert ratios["conv1.weight"] == ratios["layer1.conv2.weight"] == 0.125  # 1 of the chain's 8 channels


@pytest.mark.parametrize("factory", [tiny_resnet, tiny_densenet, tiny_inverted_residual, tiny_grouped],
                         ids=["resnet", "densenet", "inverted", "grouped"])  # fmt: skip
def test_summed_shape_changes_give_the_exact_joint_cost(factory, tmp_path: Path) -> None:
    """The planner adds each group's per-dimension shape change; that equals costing the union of the groups."""
    model = randomize(factory())
    example = batches(count=1)[0][0]
    with eval_mode(model):
        planner, options = open_planner(model, example, analysed(model, tmp_path / "s.pkl"))
        generator = random.Random(0)
        for _ in range(20):
            picks = []
            for group in options:
                choice = generator.choice(group.choices)
                picks.append((choice.param, choice.count))
            removals = planner.removals(picks)
            groups = [removal_group(planner.graph, model.get_submodule(name), channels) for name, channels in removals]
            union = planner.costs.group_cost(planner.graph, [item for group in groups for item in group])
            assert planner.picks_cost(picks) == union  # summed deltas == costing the union of the groups
            pruned = jointly_pruned_copy(model, removals, example)
            measured = count_cost(pruned, example)
            assert (measured.macs, measured.params) == (
                planner.picks_cost(picks).macs,
                planner.picks_cost(picks).params,
            )


def test_plan_from_ratios_applies_each_group_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = randomize(tiny_resnet())
    example = batches(count=1)[0][0]
    path = analysed(model, tmp_path / "s.pkl")
    # conv1 and layer1.conv2 are coupled by the residual add: the first listed decides
    with caplog.at_level(logging.WARNING, logger="analysis"):
        plan = plan_from_ratios(model, example, path, {"conv1.weight": 0.25, "layer1.conv2.weight": 0.5,
                                                       "layer2.conv1.weight": 0.5})  # fmt: skip
    assert [(g.ranking_param, len(g.removed)) for g in plan.groups] == [("conv1.weight", 2),
                                                                        ("layer2.conv1.weight", 8)]  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "layer1.conv2.weight is coupled to conv1.weight, listed earlier, whose ratio decides their shared channels."
    ]
    with pytest.raises(UserError, match=r"'fc\.weight' is not a prunable unit of this model: coupled to the model"):
        plan_from_ratios(model, example, path, {"fc.weight": 0.5})


def test_plan_from_ratios_predicts_each_group_from_its_measured_curve(tmp_path: Path) -> None:
    model = randomize(tiny_cnn())
    example = batches(count=1)[0][0]
    path = analysed(model, tmp_path / "s.pkl", ratios=(0.25, 0.5))
    # known losses: 0.weight (8 channels) measured at 2 and 4 channels, 3.weight (16) at 4 and 8
    save_sensitivities(path, {"0.weight": {0.25: 0.1, 0.5: 0.3}, "3.weight": {0.25: 0.02, 0.5: 0.04}})
    plan = plan_from_ratios(model, example, path, {"0": 0.375, "3.weight": 0.5})  # a module name works too
    assert [(g.ranking_param, len(g.removed)) for g in plan.groups] == [("0.weight", 3), ("3.weight", 8)]
    # 3 channels: halfway between the measured 2 (0.1) and 4 (0.3); 8 channels: exactly the largest measured count
    assert [g.predicted_loss for g in plan.groups] == pytest.approx([0.2, 0.04])
    assert plan.predicted_loss == pytest.approx(0.24) and plan.notice is None
    assert (plan.measure, plan.method, plan.source) == ("macs", "ratios", "ratios")
    assert (plan.dense.macs, plan.dense.params) == TINY_CNN_DENSE
    assert (plan.pruned.macs, plan.pruned.params) == tiny_cnn_cost(3, 8)
    assert plan.reduction == pytest.approx(1 - tiny_cnn_cost(3, 8)[0] / TINY_CNN_DENSE[0])
    given = plan_from_ratios(model, example, path, {"0.weight": 0.0, "3.weight": 0.5}, source="given.yaml")
    assert [g.ranking_param for g in given.groups] == ["3.weight"] and given.source == "given.yaml"  # 0.0: unpruned

    save_sensitivities(path, {"0.weight": {0.25: 0.1, 0.5: 0.3}})  # 3.weight not analysed: its loss is unknown
    unanalysed = plan_from_ratios(model, example, path, {"3.weight": 0.5})
    assert len(unanalysed.groups[0].removed) == 8 and math.isnan(unanalysed.groups[0].predicted_loss)

    beyond = plan_from_ratios(model, example, path, {"0.weight": 0.75})  # 6 channels: past the curve's end
    assert len(beyond.groups[0].removed) == 6 and math.isnan(beyond.groups[0].predicted_loss)
    assert math.isnan(beyond.predicted_loss) and beyond.notice is None  # unknown, said by the plan's own note

    save_sensitivities(path, {"0.weight": {0.25: 0.7, 0.5: 0.9}, "3.weight": {0.25: 0.5, 0.5: 0.6}})
    summed = plan_from_ratios(model, example, path, {"0.weight": 0.5, "3.weight": 0.5})
    assert summed.predicted_loss == pytest.approx(1.5)
    assert summed.notice is not None and "a relative top1 loss cannot exceed 1" in summed.notice


@pytest.mark.parametrize(
    ("ratios", "refusal"),
    [
        ({"0.weight": 1.0}, r"^ratios: 0\.weight has ratio 1\.0; ratios must lie in \[0, 1\)\.$"),
        ({"0.weight": 1.5}, r"^ratios: 0\.weight has ratio 1\.5; ratios must lie in \[0, 1\)\.$"),
        ({"0.weight": -0.1}, r"^ratios: 0\.weight has ratio -0\.1; ratios must lie in \[0, 1\)\.$"),
        ({"0": 0.25, "0.weight": 0.5}, r"^ratios: '0' and '0\.weight' name the same param 0\.weight; list it once\.$"),
        (
            {"3.weigth": 0.5},
            r"^ratios: '3\.weigth' is not a prunable unit of this model \(did you mean '3\.weight'\?\)\.$",
        ),
        ({"8.weight": 0.5}, r"^ratios: '8\.weight' is not a prunable unit of this model: .+\.$"),
    ],
)
def test_plan_from_ratios_refuses_what_it_cannot_apply(ratios: dict[str, float], refusal: str, tmp_path: Path) -> None:
    model = randomize(tiny_cnn())
    example = batches(count=1)[0][0]
    path = analysed(model, tmp_path / "s.pkl", ratios=(0.25, 0.5))
    with pytest.raises(UserError, match=refusal):
        plan_from_ratios(model, example, path, ratios)


@pytest.mark.parametrize(
    ("factory", "round_to"),
    [(tiny_resnet, 1), (tiny_grouped, 1), (tiny_resnet, 4)],
    ids=["plain", "grouped", "round_to"],
)
def test_planner_options_offer_the_allowed_counts_with_their_curve_loss_and_exact_saving(
    factory, round_to: int, tmp_path: Path
) -> None:
    model = randomize(factory())
    example = batches(count=1)[0][0]
    path = tmp_path / "s.pkl"
    ratios = (0.25, 0.5, 0.75)
    analysed(model, path, ratios, round_to=round_to)
    # distinct, increasing losses (a random model's are mostly 0), so that every curve point matters
    sensitivities = {name: {r: 0.01 * (index + 1) * (k + 1) for k, r in enumerate(ratios)}
                     for index, name in enumerate(load_sensitivities(path))}  # fmt: skip
    save_sensitivities(path, sensitivities)
    with eval_mode(model):
        planner, options = open_planner(model, example, path)
        if factory is tiny_grouped:  # 16 channels in 4 conv groups: round(0.3 * 16) = 5 removed becomes 4
            assert param_count(planner.by_name["reduce.weight"], 0.3) == 4
        checked = 0
        for group in options:
            first = planner.by_name[group.members[0]]
            step = math.lcm(round_to, max(1, len(first.conv_blocks)))  # conv groups and round_to both divide counts
            assert group.choices[0].count == 0 and (group.choices[0].loss, group.choices[0].saved) == (0.0, 0.0)
            assert all(c.count % step == 0 or (first.channels - c.count) % step == 0 for c in group.choices)
            for choice in group.choices[1:]:
                param = planner.by_name[choice.param]
                counts = {r: param_count(param, r, round_to) for r in ratios}
                exact = [
                    (0.0, 0.0),
                    *[(float(m), planner.saved_alone(choice.param, m)) for m in sorted(set(counts.values())) if m],
                ]
                assert choice.saved == pytest.approx(interpolate(exact, choice.count))
                curve = monotone_curve([(counts[r], loss) for r, loss in sensitivities[choice.param].items()])
                assert choice.loss == pytest.approx(interpolate(curve, choice.count)) and choice.loss > 0
                checked += 1
        assert checked > len(options)  # several counts per group were compared
        if round_to == 4:  # 8 channels: 2 or 4 removed keep 6 or 4, rounded to a multiple of 4 kept: 8 and 4
            assert [param_count(planner.by_name["conv1.weight"], r, 4) for r in (0.25, 0.5)] == [0, 4]


def test_a_params_budget_is_planned_on_params(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    example = batches(count=1)[0][0]
    plan = build_plan(model, example, analysed(model, tmp_path / "s.pkl"), 0.3, "params")
    assert plan.measure == "params" and plan.groups
    assert 1 - plan.pruned.params / plan.dense.params >= 0.3
    assert plan.reduction == pytest.approx(1 - plan.pruned.params / plan.dense.params)


def test_plans_rank_channels_with_the_analysis_group_reduction(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    with torch.no_grad():  # conv1 alone ranks channel 0 lowest; its residual partner, 1000x larger, ranks it highest
        model.conv1.weight.copy_(torch.arange(1.0, 9.0).reshape(8, 1, 1, 1).expand_as(model.conv1.weight))
        model.layer1.conv2.weight.copy_(
            1000 * torch.arange(8.0, 0.0, -1).reshape(8, 1, 1, 1).expand_as(model.layer1.conv2.weight)
        )
    example = batches(count=1)[0][0]
    removed = {}
    for reduction in ("self", "mean"):
        path = tmp_path / f"{reduction}.pkl"
        analysed(model, path, (0.25,), prune_params=["conv1.weight"], group_reduction=reduction)
        plan = plan_from_ratios(model, example, path, {"conv1.weight": 0.25})
        removed[reduction] = plan.groups[0].removed
    assert removed == {"self": [0, 1], "mean": [6, 7]}


def test_unreachable_budget_is_one_clear_sentence(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    example = batches(count=1)[0][0]
    path = analysed(model, tmp_path / "s.pkl", ratios=(0.1,))
    with pytest.raises(UserError, match=r"target_macs_reduction 0.9 cannot be reached: .* removes \d"):
        build_plan(model, example, path, 0.9)


@pytest.mark.parametrize("config_name", DEMO)
def test_demo_plan_verified_and_exported(
    config_name: str, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    config_path = Path("configs/demo") / config_name
    analysis_file, export_dir = tmp_path / "s.pkl", tmp_path / "export"
    overrides = [f"SensitivityAnalysis.analysis_file={analysis_file}", "SensitivityAnalysis.pruned_ratios=[0.3,0.6]",
                 "Global.max_samples=100", "Global.calib_samples=256"]  # fmt: skip
    result = cli("plan", "--config_path", config_path, "--target_macs_reduction", "0.4", "--verify", "--export_dir",
                 export_dir, *overrides)  # fmt: skip
    assert result.code == 0, result.err
    plan = load_sidecar(analysis_file)["plan"]  # the analysis ran first (the file was missing), then the plan
    verification = plan["verification"]
    assert 1 - verification["macs"]["pruned"] / verification["macs"]["dense"] >= 0.4
    assert "measured loss" in result.out and "predicted" in result.out
    # both numbers: the raw pruned model, and with its BatchNorm statistics re-estimated on the training images
    assert "raw (dense BatchNorm statistics)" in result.out and "BatchNorm re-estimated (" in result.out
    reestimated = verification["reestimated"]
    assert reestimated["calibration_images"] == 256 and reestimated["batchnorm_layers"]
    assert reestimated["metrics"]["top1"] > verification["pruned"]["top1"] + 0.3  # stale statistics cost the most

    config = load_config(config_path, overrides).Global
    loader = build_eval_loader(config, torch.device("cpu"))
    pickled = torch.load(export_dir / "pruned_model.pt", weights_only=False)
    rebuilt = load_pruned(build_model(config), export_dir)  # no unpickling of code: JSON shapes + state_dict
    exported = verification["reestimated"]["metrics"]  # the export holds the re-estimated BatchNorm statistics
    for model in (pickled, rebuilt):
        assert evaluate(model, loader).metrics()["top1"] == exported["top1"]
    images = next(iter(loader))[0]
    with torch.inference_mode():
        assert torch.equal(pickled(images), rebuilt(images))
    exported_facts = json.loads((export_dir / "pruned_channels.json").read_text())
    changed = exported_facts["changed_layers"]
    assert changed and all(rebuilt.get_submodule(name) is not None for name in changed)
    # the ONNX export: checked on export, and ONNX Runtime computes what the exported PyTorch model computes
    onnx_check = exported_facts["onnx"]
    assert onnx_check["file"] == "pruned_model.onnx" and onnx_check["max_abs_diff"] <= onnx_check["tolerance"]
    assert plan["exported"]["onnx"] == str(export_dir / "pruned_model.onnx") and "ONNX (pruned_model.onnx" in result.out
    session = onnxruntime.InferenceSession(str(export_dir / "pruned_model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"images": images.numpy()})
    with torch.inference_mode():
        expected = rebuilt(images)
    assert (torch.from_numpy(logits) - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))

    block = yaml.safe_load((export_dir / "channel_prune.yaml").read_text())["ChannelPrune"]
    assert block["prune_params_name"] and len(block["pruned_ratio"]) == len(block["prune_params_name"])
    html = (tmp_path / "s.report.html").read_text()
    assert "Pruning plan" in html and "measured top1 loss" in html and "predicted loss" in html

    again = cli("verify", analysis_file, "--ratios", f"{analysis_file}.plan.yaml", "--no_report")
    assert again.code == 0, again.err  # the config comes from the sidecar
    assert load_sidecar(analysis_file)["plan"]["verification"]["pruned"]["top1"] == verification["pruned"]["top1"]


def test_plan_verify_export_from_python_writes_what_the_command_writes(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    def config(name: str) -> Path:
        return write_config(tmp_path / f"{name}.yaml", {
            "Global": tiny_global(list_data),
            "SensitivityAnalysis": {"analysis_file": str(tmp_path / name / "s.pkl"), "pruned_ratios": [0.25, 0.5],
                                    "target_macs_reduction": 0.2, "verify": True,
                                    "export_dir": str(tmp_path / name / "export")},
        })  # fmt: skip

    assert cli("plan", "--config_path", config("command"), "--no_report").code == 0
    python = load_config(config("python"))
    (tmp_path / "python").mkdir()
    shutil.copyfile(tmp_path / "command" / "s.pkl", tmp_path / "python" / "s.pkl")  # the same analysis
    shutil.copyfile(tmp_path / "command" / "s.pkl.json", tmp_path / "python" / "s.pkl.json")
    result = run_plan_step(python, progress=False)
    assert result.verification is not None and result.exported is not None
    for name in ("s.pkl.plan.yaml", "export/channel_prune.yaml", "export/pruned_channels.json"):
        assert (tmp_path / "python" / name).read_bytes() == (tmp_path / "command" / name).read_bytes(), name
    recorded = {side: load_sidecar(tmp_path / side / "s.pkl")["plan"] for side in ("command", "python")}
    for side in recorded.values():
        side.pop("verification")  # it holds latencies and seconds, measured again
        side.pop("ratios_file")
        side["exported"] = {kind: Path(path).name for kind, path in side["exported"].items()}
    assert recorded["python"] == recorded["command"]
    assert result.plan.ratios == yaml_ratios(tmp_path / "command" / "s.pkl.plan.yaml")


def yaml_ratios(path: Path) -> dict[str, float]:
    block = yaml.safe_load(path.read_text())["ChannelPrune"]
    return dict(zip(block["prune_params_name"], block["pruned_ratio"], strict=True))


def test_plan_cli_errors(cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)
    config_path = Path("configs/demo/digits_resnet.yaml")
    result = cli("plan", "--config_path", config_path, f"SensitivityAnalysis.analysis_file={tmp_path / 's.pkl'}")
    assert result.code == 2 and "needs a budget: --target_macs_reduction" in result.err
    result = cli("plan", "--config_path", config_path, "--target_macs_reduction", "1.5")
    assert result.code == 2 and "target_macs_reduction must be between 0 and 1" in result.err
    result = cli("verify", tmp_path / "missing.pkl", "--ratios", "r.yaml")
    assert result.code == 2 and "does not exist" in result.err
    assert not (tmp_path / "s.pkl").exists()


def test_main_run_verifies_target_loss_ratios_from_the_yaml(cli: Callable[..., CliResult], tmp_path: Path,
                                                            list_data: Path) -> None:  # fmt: skip
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.25, 0.5],
                                "target_loss": 0.5, "verify": True, "export_dir": str(tmp_path / "export")},
    })  # fmt: skip
    result = cli("--config_path", config, "--no_report")
    assert result.code == 0, result.err
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    assert plan["source"].endswith("s.pkl.ratios.yaml") and "verification" in plan  # the target_loss ratios
    ratios = yaml.safe_load((tmp_path / "s.pkl.ratios.yaml").read_text())["ChannelPrune"]
    assert (tmp_path / "export" / "channel_prune.yaml").read_text() == (tmp_path / "s.pkl.ratios.yaml").read_text()
    assert len(ratios["prune_params_name"]) >= len(plan["groups"])
    assert "verified (all groups pruned at once" in result.out
    # the verified model is pruned at exactly the file's ratios: min(C - 1, round(C * r)) channels of each conv
    from_file = dict(zip(ratios["prune_params_name"], ratios["pruned_ratio"], strict=True))
    assert from_file  # target_loss 0.5 leaves some layer a ratio
    removed = {name: min(channels - 1, round(channels * from_file.get(name, 0.0)))
               for name, channels in TINY_CNN_CHANNELS.items()}  # fmt: skip
    assert {g["ranking_param"]: g["channels_removed"] for g in plan["groups"]} == {
        name: count for name, count in removed.items() if count
    }
    verification = plan["verification"]
    macs, params = tiny_cnn_cost(removed["0.weight"], removed["3.weight"])
    assert verification["macs"] == {"dense": TINY_CNN_DENSE[0], "pruned": macs}
    assert verification["params"] == {"dense": TINY_CNN_DENSE[1], "pruned": params}


def test_verify_takes_its_ratios_from_the_file_when_the_config_sets_no_target(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    """A config that only analyses (no target_loss, no budget) can verify a hand-written ratios file."""
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data), "SensitivityAnalysis": {
        "analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5]}})  # fmt: skip
    assert cli("--config_path", config, "--no_report").code == 0
    (tmp_path / "r.yaml").write_text("ChannelPrune:\n  prune_params_name: [0.weight]\n  pruned_ratio: [0.5]\n")
    result = cli("verify", tmp_path / "s.pkl", "--ratios", tmp_path / "r.yaml", "--config_path", config, "--no_report")
    assert result.code == 0, result.err
    plan = load_sidecar(tmp_path / "s.pkl")["plan"]
    verification = plan["verification"]
    assert verification["macs"]["pruned"] < verification["macs"]["dense"]
    assert [(g["ranking_param"], g["channels"], g["channels_removed"]) for g in plan["groups"]] == [("0.weight", 8, 4)]
    assert verification["macs"] == {"dense": TINY_CNN_DENSE[0], "pruned": tiny_cnn_cost(4, 0)[0]}  # 64672
    assert verification["params"] == {"dense": TINY_CNN_DENSE[1], "pruned": tiny_cnn_cost(4, 0)[1]}  # 894

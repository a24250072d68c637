"""Recovery's parts: ACT's TrainConfig and Distillation read key by key, the distillation losses as paddleslim.dist
computes them, the training images' order and augmentation, and the loop's checkpoints (a killed run resumes to the
same weights), best weights and stops."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from analysis.act_keys import DISTILLATION_KEYS, TRAIN_CONFIG_KEYS
from analysis.config import Config, config_from_data
from analysis.errors import ConfigError, DataError
from analysis.inputs.data import Preprocess
from analysis.recovery import distill as distill_module
from analysis.recovery.act import DistillPair, TrainSettings, read_distillation, read_train_config
from analysis.recovery.checkpoint import CheckpointError
from analysis.recovery.data import Augmentation, Sharding, TrainBatches, build_train_batches, crop_box, seeded
from analysis.recovery.distill import captured, check_nodes, distillation_loss, dkd, l2, skd, soft_label
from analysis.recovery.optim import build_optimizer
from analysis.recovery.train import RecoveryJob, TrainingError, check_origin_metric, recover

from helpers import write_train_list

# ---- TrainConfig and Distillation, key by key ---------------------------------------------------------------------

TRAIN_CASES: list[tuple[str, dict[str, Any], Callable[[TrainSettings], bool]]] = [
    ("epochs", {"epochs": 3}, lambda t: t.epochs == 3 and t.total_steps(10) == 30),
    ("train_iter", {"train_iter": 25, "epochs": 3}, lambda t: t.total_steps(10) == 25),  # the first bound wins
    ("learning_rate", {"learning_rate": 0.015},
     lambda t: (t.schedule.type, t.schedule.initial_lr) == ("constant", 0.015)),
    ("learning_rate", {"learning_rate": {"type": "CosineAnnealingDecay", "learning_rate": 0.015}},
     lambda t: (t.schedule.type, t.schedule.initial_lr) == ("CosineAnnealingDecay", 0.015)),
    ("optimizer_builder", {"optimizer_builder": {"optimizer": {"type": "Momentum"}, "weight_decay": 2e-5}},
     lambda t: (t.optimizer.type, t.optimizer.weight_decay) == ("Momentum", 2e-5)),
    ("eval_iter", {"eval_iter": 7}, lambda t: t.eval_iter == 7),
    ("logging_iter", {"logging_iter": 3}, lambda t: t.logging_iter == 3),
    ("origin_metric", {"origin_metric": 0.7912}, lambda t: t.origin_metric == 0.7912),
    ("target_metric", {"target_metric": 0.8}, lambda t: t.target_metric == 0.8),
]  # fmt: skip


@pytest.mark.parametrize(("key", "block", "holds"), TRAIN_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TRAIN_CASES)])
def test_each_train_config_key_is_read(key: str, block: dict[str, Any], holds: Callable[[TrainSettings], bool]) -> None:
    assert holds(read_train_config(block))


def test_every_documented_train_config_key_has_a_case() -> None:
    assert {case[0] for case in TRAIN_CASES} == set(TRAIN_CONFIG_KEYS)


def test_act_defaults_and_what_the_optimizer_becomes() -> None:
    defaults = read_train_config(None)
    assert (defaults.epochs, defaults.train_iter, defaults.eval_iter, defaults.logging_iter) == (None, None, 1000, 10)
    assert defaults.total_steps(7) == 700  # neither bound: ACT's 100 epochs
    assert (defaults.schedule.initial_lr, defaults.optimizer.type) == (0.02, "SGD")
    momentum = read_train_config({"optimizer_builder": {"optimizer": {"type": "Momentum"}, "weight_decay": 2e-5}})
    built = build_optimizer([nn.Parameter(torch.zeros(2))], momentum.optimizer, 0.1)
    assert isinstance(built, torch.optim.SGD)
    assert (built.defaults["momentum"], built.defaults["weight_decay"]) == (0.9, 2e-5)  # Paddle's Momentum default


def test_paddle_only_keys_are_listed_as_ignored_and_old_names_translated(caplog: pytest.LogCaptureFixture) -> None:
    block = {"amp_config": {"use_pure_fp16": True}, "use_fleet": False, "epochs": 1}
    with caplog.at_level("INFO", logger="analysis.recovery.act"):
        checked = read_train_config(block, announce=False)  # the command line's early check says nothing ...
        assert caplog.text == ""
        settings = read_train_config(block)  # ... the workflow's reading says it once
    assert caplog.text.count("TrainConfig.amp_config is ignored") == 1 and checked == settings
    assert sorted(settings.ignored) == ["amp_config", "use_fleet"]
    both = read_train_config({"optimizer_builder": {"regularizer": {"type": "L2Decay", "coeff": 1e-4},
                                                    "weight_decay": 4e-5}})  # fmt: skip
    assert list(both.ignored) == ["optimizer_builder.weight_decay"] and both.optimizer.weight_decay == 1e-4
    legacy = read_train_config({"optimizer": "Momentum", "optim_args": {"weight_decay": 4e-5, "momentum": 0.8}})
    assert (legacy.optimizer.type, legacy.optimizer.weight_decay, legacy.optimizer.arguments) == (
        "Momentum", 4e-5, {"momentum": 0.8})  # fmt: skip


DISTILL_CASES: list[tuple[str, dict[str, Any], tuple[DistillPair, ...]]] = [
    ("loss", {"loss": "soft_label"}, (DistillPair("soft_label", "", "", 1.0),)),
    ("node", {"node": ["layer1", "fc"]},
     (DistillPair("l2", "layer1", "layer1", 1.0), DistillPair("l2", "fc", "fc", 1.0))),
    ("alpha", {"alpha": 0.5}, (DistillPair("l2", "", "", 0.5),)),
    ("teacher_model_dir", {"teacher_model_dir": None}, (DistillPair("l2", "", "", 1.0),)),
    ("teacher_model_filename", {"teacher_model_filename": "None"}, (DistillPair("l2", "", "", 1.0),)),
    ("teacher_params_filename", {"teacher_params_filename": None}, (DistillPair("l2", "", "", 1.0),)),
    ("loss", {"loss": ["skd", "l2"], "node": [["fc"], ["layer1"]], "alpha": [1.0, 2.0]},
     (DistillPair("skd", "fc", "fc", 1.0), DistillPair("l2", "layer1", "layer1", 2.0))),
    ("node", {"distill_loss": "l2_loss", "distill_node_pair": ["teacher_fc", "fc"], "distill_lambda": 1.0},
     (DistillPair("l2", "fc", "fc", 1.0),)),  # PaddleSlim 2.3's names and explicit pairs
]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "block", "pairs"), DISTILL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(DISTILL_CASES)]
)
def test_each_distillation_key_is_read(key: str, block: dict[str, Any], pairs: tuple[DistillPair, ...]) -> None:
    assert read_distillation(block).pairs == pairs


def test_every_documented_distillation_key_has_a_case() -> None:
    assert {case[0] for case in DISTILL_CASES} == set(DISTILLATION_KEYS)
    assert read_distillation(None).pairs == (DistillPair("l2", "", "", 1.0),)  # ACT's default: l2 on the outputs


@pytest.mark.parametrize(
    ("reader", "block", "message"),
    [
        (read_train_config, {"epoch": 1}, r"^TrainConfig\.epoch is not an ACT TrainConfig key \(did you mean 'epochs'"),
        (read_train_config, {"epochs": 0}, r"^TrainConfig\.epochs must be a positive integer, got 0\.$"),
        (read_train_config, {"origin_metric": "high"}, r"^TrainConfig\.origin_metric must be a number"),
        (read_train_config, {"optimizer_builder": {"optimizer": {"type": "Lamb"}}},
         r"optimizer\.type 'Lamb' has no PyTorch counterpart here; supported: SGD, Momentum"),
        (read_train_config, {"learning_rate": {"type": "ReduceOnPlateau", "learning_rate": 0.1}},
         r"^TrainConfig\.learning_rate\.type 'ReduceOnPlateau' cannot be given in a config file"),
        (read_distillation, {"losss": "l2"},
         r"^Distillation\.losss is not an ACT Distillation key \(did you mean 'loss'"),
        (read_distillation, {"loss": "fsp"},
         r"^Distillation\.loss 'fsp' cannot be given in a config file \(it compares"),
        (read_distillation, {"loss": "kl"},
         r"^Distillation\.loss 'kl' is not a paddleslim\.dist loss.*supported: l2, "),
        (read_distillation, {"teacher_model_dir": "teacher/"}, r"^Distillation\.teacher_model_dir is not supported"),
        (read_distillation, {"loss": ["l2", "l2"], "node": ["fc"]}, r"^Distillation\.node has 1 group\(s\) of nodes"),
        (read_distillation, {"loss": ["l2", "l2"], "alpha": [1.0]}, r"^Distillation\.alpha has 1 value\(s\)"),
        (read_distillation, {"distill_loss": "l2", "loss": "l2"}, r"same key \(old and new name\); keep loss\.$"),
    ],
)  # fmt: skip
def test_bad_training_blocks_are_one_sentence_naming_the_key(
    reader: Callable[[Any], Any], block: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        reader(block)
    assert "\n" not in str(error.value)


def test_overrides_set_act_keys_on_the_command_line(list_data: Path) -> None:
    raw = {"Global": {"arch": "resnet18", "data_dir": str(list_data)}, "TrainConfig": {"epochs": 3, "eval_iter": 9}}
    config = config_from_data(raw, list_data / "c.yaml", ["TrainConfig.epochs=1", "Distillation.loss=soft_label"])
    assert config.act_blocks["TrainConfig"] == {"epochs": 1, "eval_iter": 9}
    assert read_distillation(config.act_blocks["Distillation"]).pairs[0].loss == "soft_label"
    assert raw["TrainConfig"] == {"epochs": 3, "eval_iter": 9}  # the file's data is left as it was
    with pytest.raises(ConfigError, match=r"unknown section 'TrainConfg' \(did you mean 'TrainConfig'\?\)"):
        config_from_data(raw, list_data / "c.yaml", ["TrainConfg.epochs=1"])
    with pytest.raises(ConfigError, match=r"^TrainConfig must be a mapping of keys, not a int; fix the file's block"):
        config_from_data({**raw, "TrainConfig": 5}, list_data / "c.yaml", ["TrainConfig.epochs=1"])


# ---- the losses of paddleslim.dist --------------------------------------------------------------------------------


def _logits(seed: int, shape: tuple[int, ...] = (4, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _paddle_dkd(teacher: np.ndarray, student: np.ndarray) -> float:
    """paddleslim.dist._dkd_loss at temperature 1, alpha = beta = 1, written out step by step with NumPy."""

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    mask = (teacher == teacher.max(axis=1, keepdims=True)).astype(np.int32)  # _top_mask

    def predictions(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # _cal_tc_nc_pred
        top = (mask * softmax(x)).sum(axis=1, keepdims=True)
        return np.concatenate([top, 1 - top], axis=1), softmax(x + -100000 * mask)

    def kl_div(x: np.ndarray, label: np.ndarray) -> float:  # paddle.nn.functional.kl_div, reduction mean: 0 at 0
        positive = label > 0
        terms = np.zeros_like(label)
        terms[positive] = label[positive] * (np.log(label[positive]) - x[positive])
        return float(np.mean(terms))

    (s_tc, s_nc), (t_tc, t_nc) = predictions(student), predictions(teacher)
    return kl_div(s_tc, t_tc) + kl_div(s_nc, t_nc)


def test_the_losses_compute_what_paddleslim_dist_computes() -> None:
    teacher, student = _logits(0), _logits(1)
    assert float(l2(teacher, student)) == pytest.approx(float(((student - teacher) ** 2).mean()))
    cross = -(F.softmax(teacher, -1) * torch.log(F.softmax(student, -1))).sum(-1).mean()
    assert float(soft_label(teacher, student)) == pytest.approx(float(cross))
    assert float(dkd(teacher, student)) == pytest.approx(_paddle_dkd(teacher.numpy(), student.numpy()), rel=1e-9)
    scale = teacher.std(1, keepdim=True)
    norm_t = (teacher - teacher.mean(1, keepdim=True)) / torch.sqrt(teacher.var(1, unbiased=False, keepdim=True) + 1e-7)
    norm_s = (student - student.mean(1, keepdim=True)) / torch.sqrt(student.var(1, unbiased=False, keepdim=True) + 1e-7)
    expected = -(F.softmax(norm_t * scale, 1) * torch.log(F.softmax(norm_s * scale, 1))).sum(1).mean()
    assert float(skd(teacher, student)) == pytest.approx(float(expected))
    assert float(l2(teacher, teacher)) == 0.0 and float(soft_label(teacher, student)) > float(
        soft_label(teacher, teacher)
    )


class Net(nn.Module):
    """conv-BN-ReLU, pool, dropout, linear: small, with a module name to distil and dropout for the RNG."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.pool(self.features(x)).flatten(1)))


def test_nodes_are_module_outputs_and_a_wrong_one_is_named() -> None:
    model = Net()
    settings = read_distillation({"node": ["features", "fc"], "loss": "l2"})
    check_nodes(model, settings)
    with captured(model, settings.modules) as outputs:
        logits = model(torch.randn(2, 3, 8, 8))
    assert torch.equal(outputs["fc"], logits) and outputs["features"].shape == (2, 6, 8, 8)
    with pytest.raises(ConfigError, match=r"^Distillation\.node 'softmax_0\.tmp_0' is no module of the model.*Paddle"):
        check_nodes(model, read_distillation({"node": ["softmax_0.tmp_0"]}))
    with pytest.raises(ConfigError, match=r"'featurs' is no module of the model \(did you mean 'features'\?\)"):
        check_nodes(model, read_distillation({"node": ["featurs"]}))
    pruned = {"features": torch.zeros(2, 4, 8, 8)}
    with pytest.raises(ConfigError, match=r"^Distillation\.node features: the pruned model's output has shape"):
        distillation_loss(read_distillation({"node": ["features"]}), {"features": torch.zeros(2, 6, 8, 8)}, pruned)


# ---- training images ---------------------------------------------------------------------------------------------


def _config(root: Path, **recovery: Any) -> Config:
    raw = {"Global": {"arch": "resnet18", "data_dir": str(root), "img_size": 12, "resize_size": 14, "batch_size": 4,
                      "num_workers": 0}, "Recovery": recovery}  # fmt: skip
    return config_from_data(raw, root / "c.yaml")


@pytest.fixture
def train_data(list_data: Path) -> Path:
    write_train_list(list_data, 24)
    return list_data


def test_crops_stay_inside_and_depend_only_on_the_seed() -> None:
    augmentation = Augmentation((0.08, 1.0), (0.75, 4 / 3), 0.5)
    for index in range(200):
        top, left, height, width = crop_box(20, 16, augmentation, seeded(3, 1, index))
        assert top >= 0 and top + height <= 16 and left >= 0 and left + width <= 20 and height > 0 and width > 0
    assert crop_box(20, 16, augmentation, seeded(3, 1, 7)) == crop_box(20, 16, augmentation, seeded(3, 1, 7))
    assert crop_box(20, 16, augmentation, seeded(3, 1, 7)) != crop_box(20, 16, augmentation, seeded(3, 2, 7))


def test_any_step_gets_the_batches_of_an_uninterrupted_pass_and_ranks_split_each_batch(train_data: Path) -> None:
    config = _config(train_data)
    preprocess = Preprocess(12, 14)
    whole = build_train_batches(config, preprocess, labelled=True, sharding=Sharding())
    assert (whole.steps_per_epoch, whole.batch_size) == (6, 4)
    stream = whole.from_step(0)
    first = [next(stream) for _ in range(14)]  # more than two epochs
    assert [step for step, _, _ in first] == list(range(14))
    assert first[0][1].dtype == torch.uint8 and first[0][1].shape == (4, 3, 12, 12)
    assert not torch.equal(first[0][1], first[6][1])  # another epoch: another order and other crops
    later = build_train_batches(config, preprocess, labelled=True, sharding=Sharding()).from_step(9)
    for expected in first[9:]:
        step, images, labels = next(later)
        assert step == expected[0] and torch.equal(images, expected[1]) and torch.equal(labels, expected[2])
    halves = [build_train_batches(config, preprocess, True, Sharding(rank, 2)).from_step(0) for rank in (0, 1)]
    for expected in first[:7]:
        parts = [next(half) for half in halves]
        assert torch.equal(torch.cat([parts[0][1], parts[1][1]]), expected[1])


def test_training_data_errors_name_the_key(train_data: Path) -> None:
    with pytest.raises(DataError, match=r"^Recovery\.train_list .*missing\.txt does not exist; name a list file"):
        find = _config(train_data, train_list="missing.txt")
        build_train_batches(find, Preprocess(12, 14), True, Sharding())
    with pytest.raises(DataError, match=r"^Recovery\.batch_size 64 is larger than the 24 training images"):
        build_train_batches(_config(train_data, batch_size=64), Preprocess(12, 14), True, Sharding())
    with pytest.raises(DataError, match=r"^Recovery\.batch_size 5 does not split evenly over 2 processes"):
        build_train_batches(_config(train_data, batch_size=5), Preprocess(12, 14), True, Sharding(0, 2))
    (train_data / "train_list.txt").unlink()
    with pytest.raises(DataError, match=r"^No training images for run\.py compress: neither .*train_list\.txt nor"):
        build_train_batches(_config(train_data), Preprocess(12, 14), True, Sharding())


# ---- the loop: checkpoints, resume, best weights, stops -----------------------------------------------------------


def _job(folder: Path, train: dict[str, Any], identity: str = "run") -> RecoveryJob:
    return RecoveryJob(read_train_config(train), read_distillation({"node": ["features", "fc"], "loss": ["l2"]}),
                       "fp32", 0.1, folder, identity, Preprocess(12, 14), progress=False)  # fmt: skip


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    teacher, student = Net(), Net()
    return teacher.eval(), student


TRAIN = {
    "train_iter": 6,
    "eval_iter": 2,
    "learning_rate": 0.05,
    "optimizer_builder": {"optimizer": {"type": "Momentum"}},
}


def _scores(*values: float) -> Callable[[nn.Module], dict[str, float]]:
    """An evaluation that reports the given top1 values in turn."""
    queue = list(values)
    return lambda model: {"top1": queue.pop(0)}


def _run(batches: TrainBatches, folder: Path, student: nn.Module, teacher: nn.Module, **job: Any) -> Any:
    torch.manual_seed(1)
    return recover(student, teacher, batches, _scores(0.1, 0.2, 0.3), _job(folder, TRAIN, **job), {"top1": 0.5})


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = build_train_batches(_config(train_data), Preprocess(12, 14), labelled=True, sharding=Sharding())
    teacher, start = _models()
    whole = copy.deepcopy(start)
    outcome = _run(batches, tmp_path / "whole", whole, teacher)
    assert (outcome.steps, outcome.total_steps, outcome.stopped, outcome.resumed_from) == (6, 6, "finished", None)
    assert [e.step for e in outcome.history] == [2, 4, 6] and outcome.best.step == 6

    calls = {"count": 0}
    real_loss = distill_module.distillation_loss

    def dies_at_step_five(*args: Any) -> torch.Tensor:
        calls["count"] += 1
        if calls["count"] == 5:
            raise KeyboardInterrupt  # the process is killed after the checkpoint of step 4
        return real_loss(*args)

    monkeypatch.setattr("analysis.recovery.train.distillation_loss", dies_at_step_five)
    interrupted = copy.deepcopy(start)
    with pytest.raises(KeyboardInterrupt):
        _run(batches, tmp_path / "killed", interrupted, teacher)
    monkeypatch.setattr("analysis.recovery.train.distillation_loss", real_loss)
    resumed = copy.deepcopy(start)
    torch.manual_seed(99)  # the checkpoint's generator state wins over whatever the new process has
    outcome = recover(resumed, teacher, batches, _scores(0.3), _job(tmp_path / "killed", TRAIN), {"top1": 0.5})
    assert outcome.resumed_from == 4 and [e.step for e in outcome.history] == [2, 4, 6]
    for name, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert not torch.equal(whole.state_dict()["fc.weight"], start.state_dict()["fc.weight"])  # it did train

    with pytest.raises(CheckpointError, match=r"last\.pt is the checkpoint of another run .*--fresh"):
        recover(copy.deepcopy(start), teacher, batches, _scores(0.1), _job(tmp_path / "killed", TRAIN, "other"),
                {"top1": 0.5})  # fmt: skip


def test_the_loop_clips_the_gradients_and_then_adds_the_l1_term(train_data: Path, tmp_path: Path) -> None:
    """Gradients clamped to [0, 0] leave plain SGD nothing to do; an L1 term added after that clamp moves every weight
    towards 0 by the learning rate times the coefficient at each of the 6 steps (before the clamp it would vanish)."""
    batches = build_train_batches(_config(train_data), Preprocess(12, 14), labelled=True, sharding=Sharding())
    teacher, start = _models()
    zero = {"type": "ClipGradByValue", "min": 0.0, "max": 0.0}
    runs = {}
    for name, builder in (("clipped", {"grad_clip": zero}),
                          ("l1", {"grad_clip": zero, "regularizer": {"type": "L1Decay", "coeff": 1e-3}})):  # fmt: skip
        student = copy.deepcopy(start)
        train = {**TRAIN, "optimizer_builder": {"optimizer": {"type": "SGD"}, **builder}}
        torch.manual_seed(1)
        recover(student, teacher, batches, _scores(0.1, 0.2, 0.3), _job(tmp_path / name, train), {"top1": 0.5})
        runs[name] = dict(student.named_parameters())
    for name, weight in start.named_parameters():
        assert torch.equal(runs["clipped"][name], weight), name
        moved = weight - 6 * TRAIN["learning_rate"] * 1e-3 * torch.sign(weight)
        away_from_zero = weight.abs() > 1e-3  # no sign change within the 6 steps
        assert torch.allclose(runs["l1"][name][away_from_zero], moved[away_from_zero], atol=1e-7), name


def test_the_model_ends_with_the_best_evaluations_weights(train_data: Path, tmp_path: Path) -> None:
    batches = build_train_batches(_config(train_data), Preprocess(12, 14), labelled=True, sharding=Sharding())
    teacher, student = _models()
    torch.manual_seed(1)
    outcome = recover(student, teacher, batches, _scores(0.2, 0.9, 0.4), _job(tmp_path, TRAIN), {"top1": 0.95})
    assert outcome.best.step == 4 and outcome.best.metrics["top1"] == 0.9 and outcome.steps == 6
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    last = torch.load(tmp_path / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(value, best[name]) for name, value in student.state_dict().items())
    assert not torch.equal(best["fc.weight"], last["fc.weight"])
    assert "best 0.9000 at step 4" in (tmp_path / "train.log").read_text()


def test_training_stops_at_target_metric_near_origin_metric_and_on_a_bad_loss(train_data: Path, tmp_path: Path) -> None:
    batches = build_train_batches(_config(train_data), Preprocess(12, 14), labelled=True, sharding=Sharding())
    teacher, student = _models()
    targeted = _job(tmp_path / "t", {**TRAIN, "target_metric": 0.6})
    target = recover(student, teacher, batches, _scores(0.2, 0.7), targeted, {"top1": 0.9})
    assert (target.steps, target.stopped) == (4, "target_metric")
    near = recover(copy.deepcopy(student), teacher, batches, _scores(0.897),
                   _job(tmp_path / "o", {**TRAIN, "origin_metric": 0.9}), {"top1": 0.9})  # fmt: skip
    assert (near.steps, near.stopped) == (2, "within 0.5% of the dense model")
    with pytest.raises(DataError, match=r"dense model's top1 is 0\.7000 .* TrainConfig\.origin_metric says 0\.7900"):
        check_origin_metric(read_train_config({"origin_metric": 0.79}), {"top1": 0.7})
    check_origin_metric(read_train_config({"origin_metric": 0.79}), {"top1": 0.75})  # within ACT's 0.05
    with pytest.raises(TrainingError, match=r"^The recovery loss became (nan|inf) by step \d; lower TrainConfig"):
        recover(copy.deepcopy(student), teacher, batches, _scores(0.1), _job(tmp_path / "n", {**TRAIN,
                "learning_rate": 1e30}), {"top1": 0.9})  # fmt: skip


def test_a_batch_that_does_not_fit_in_memory_names_the_key(
    train_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = build_train_batches(_config(train_data), Preprocess(12, 14), labelled=True, sharding=Sharding())
    teacher, student = _models()

    def out_of_memory(self: nn.Module, images: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Net, "forward", out_of_memory)
    with pytest.raises(TrainingError, match=r"^A training batch of 4 images does not fit in the memory of cpu "
                       r"\(Recovery\.batch_size 4 over 1 process\(es\)\); lower Recovery\.batch_size"):  # fmt: skip
        recover(student, teacher, batches, _scores(0.1), _job(tmp_path, TRAIN), {"top1": 0.9})

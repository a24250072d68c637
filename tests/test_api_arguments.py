"""The Python API keeps the promise of its reference (issue 41): bad input raises a :class:`UserError` subclass naming
the argument at fault, checked at the edge before any work; reasonable input (a generator, uint8 or float64 images,
bare images for a label-free metric, a config's path) is accepted and gives what the equivalent ordinary input gives.

The entries: ``analysis_prune``, NNI's ``SensitivityAnalysis`` (constructor, ``analysis``, ``load_state_dict``,
``export``), ``build_plan`` and ``run_plan_step``. The Hypothesis properties give each argument a random value of a
wrong type: always a UserError, never a TypeError or AttributeError from deep inside.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from analysis import SensitivityAnalysis, analysis_prune
from analysis.config import Config, load_config
from analysis.errors import ConfigError, DataError, ModelError, UserError
from analysis.io.results import load_sensitivities
from analysis.planning.plan import build_plan
from analysis.workflow.plan import run_plan_step

from helpers import batches, pseudo_labelled, randomize, run_cli, tiny_global, write_config
from tiny_models import tiny_cnn

Call = Callable[[], object]


def refused(call: Call, argument: str, kind: type[UserError] = UserError) -> UserError:
    """``call`` raises a ``kind`` (a project error, no built-in one) whose one-line message names ``argument``."""
    with pytest.raises(UserError) as caught:
        call()
    error = caught.value
    assert isinstance(error, kind), repr(error)
    assert type(error).__module__ == "analysis.errors"  # never a TypeError/ValueError/... from deep inside
    message = str(error)
    assert re.search(rf"(?<![\w.]){re.escape(argument)}(?![\w])", message), message
    assert "\n" not in message
    return error


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return randomize(tiny_cnn())


@pytest.fixture(scope="module")
def data(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches of 8 images labelled with the model's own predictions (baseline top1 = 1)."""
    return pseudo_labelled(model, batches(count=2))


@pytest.fixture(scope="module")
def reference(model: nn.Module, data: list, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The analysis file :func:`prune` writes for ``data`` as given: what an equivalent input must write too."""
    path = tmp_path_factory.mktemp("reference") / "a.pkl"
    prune(model, data, path)()
    assert load_sensitivities(path)  # something was analysed
    return path.read_bytes()


def prune(model: nn.Module, data: object, path: object = "a.pkl", **options: Any) -> Call:
    """A call of :func:`analysis_prune` at one ratio, without progress bars."""
    settings = {"pruned_ratios": [0.5], "progress": False, **options}
    return lambda: analysis_prune(model, data, path, **settings)  # type: ignore[arg-type]


# ---- analysis_prune: each listed input ------------------------------------------------------------------------------


BAD_BATCHES: dict[str, Callable[[list[tuple[torch.Tensor, torch.Tensor]]], object]] = {
    "dicts": lambda data: [{"image": x, "label": y} for x, y in data],
    "3-tuples": lambda data: [(x, y, y) for x, y in data],
    "bare tensors": lambda data: [x for x, _ in data],
    "one batch unwrapped": lambda data: data[0],
    "float labels": lambda data: [(x, y.float()) for x, y in data],
    "labels at the class count": lambda data: [(x, torch.full_like(y, 10)) for x, y in data],
    "negative labels": lambda data: [(x, y - 1 - y) for x, y in data],
    "labels of another length": lambda data: [(x, y[:-1]) for x, y in data],
    "integer images": lambda data: [(x.long(), y) for x, y in data],
    "None": lambda data: None,
    "a number": lambda data: 3,
    "a tensor": lambda data: data[0][0],
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batches_are_a_data_error_naming_data(case: str, model: nn.Module, data: list, tmp_path: Path) -> None:
    error = refused(prune(model, BAD_BATCHES[case](data), tmp_path / "a.pkl"), "data", DataError)
    if case in ("dicts", "3-tuples", "bare tensors"):
        assert "(images, labels) pair" in str(error)  # says the shape batches must have
    if case == "one batch unwrapped":
        assert "[(images, labels)]" in str(error)
    if case.startswith("labels at") or case.startswith("negative"):
        assert "outside the model's 10 classes" in str(error)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_loader_is_checked_batch_by_batch_as_it_is_read(model: nn.Module, data: list, tmp_path: Path) -> None:
    images, labels = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    labels[12] = 12  # in the loader's fourth batch of 4: found as that batch is read, named with its index
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=4)
    error = refused(prune(model, loader, tmp_path / "a.pkl"), "data", DataError)
    assert "batch 3 holds the label 12, outside the model's 10 classes" in str(error)


ARGUMENTS: dict[str, tuple[str, Any, type[UserError]]] = {
    "model=None": ("model", None, ModelError),
    "pruned_ratios=0.3": ("pruned_ratios", 0.3, ConfigError),
    "analysis_file=None": ("analysis_file", None, ConfigError),
    "numerics=None": ("numerics", None, ConfigError),
    "prune_params as one string": ("prune_params", "0.weight", ConfigError),
    "criterion=None": ("criterion", None, ConfigError),
    "seed=0.5": ("seed", 0.5, ConfigError),
    "calibration of strings": ("calibration", ["a", "b"], DataError),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_an_argument_of_the_wrong_type_is_refused_by_name(case: str, model: nn.Module, data: list) -> None:
    name, value, kind = ARGUMENTS[case]
    arguments: dict[str, Any] = {"model": model, "data": data, "analysis_file": "a.pkl", "pruned_ratios": [0.5],
                                 "progress": False, name: value}  # fmt: skip
    error = refused(lambda: analysis_prune(**arguments), name, kind)
    if name == "pruned_ratios":
        assert "[0.3]" in str(error)  # what to pass instead
    if name == "prune_params":
        assert "['0.weight']" in str(error)  # not read as the names '0', '.', 'w', ...


@pytest.mark.parametrize("result", ["0.5", None, [0.5], torch.ones(2)], ids=["str", "None", "list", "tensor"])
def test_an_eval_function_returning_no_number_is_refused_by_name(model: nn.Module, data: list, result: object) -> None:
    error = refused(prune(model, lambda m: result, example_input=data[0][0]), "data", DataError)
    assert "eval function" in str(error)


def test_an_eval_function_may_return_a_one_element_tensor(model: nn.Module, data: list, tmp_path: Path) -> None:
    def score(candidate: nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return (candidate(data[0][0]).argmax(1) == data[0][1]).float().mean()

    prune(model, score, tmp_path / "t.pkl", example_input=data[0][0])()
    prune(model, lambda m: float(score(m)), tmp_path / "f.pkl", example_input=data[0][0])()
    assert load_sensitivities(tmp_path / "t.pkl") == load_sensitivities(tmp_path / "f.pkl")


# ---- analysis_prune: what is accepted -------------------------------------------------------------------------------


def test_a_generator_and_a_data_loader_give_what_a_list_of_their_batches_gives(
    model: nn.Module, data: list, reference: bytes, tmp_path: Path
) -> None:
    prune(model, (batch for batch in data), tmp_path / "generator.pkl")()  # one pass only: kept in memory
    images, labels = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=8)
    prune(model, loader, tmp_path / "loader.pkl")()  # its batches are [images, labels] lists
    for name in ("generator.pkl", "loader.pkl"):
        assert (tmp_path / name).read_bytes() == reference, name


def uint8_batches(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random uint8 images labelled with the model's predictions on them divided by 255."""
    generator = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=generator) for _ in range(2)]
    with torch.inference_mode():
        return [(x, model(x.float() / 255).argmax(1)) for x in images]


def test_uint8_images_give_the_losses_of_the_images_divided_by_255_and_say_so_once(
    model: nn.Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = uint8_batches(model)
    with caplog.at_level(logging.WARNING):
        prune(model, raw, tmp_path / "uint8.pkl")()
    said = [r.getMessage() for r in caplog.records if "uint8" in r.getMessage()]
    assert len(said) == 1 and "divided by 255" in said[0] and "without normalisation" in said[0]
    prune(model, [(x.float() / 255, y) for x, y in raw], tmp_path / "float.pkl")()
    assert (tmp_path / "uint8.pkl").read_bytes() == (tmp_path / "float.pkl").read_bytes()


def test_float64_images_are_converted_to_the_models_dtype_and_it_is_said_once(
    model: nn.Module, data: list, reference: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        prune(model, [(x.double(), y) for x, y in data], tmp_path / "float64.pkl")()  # float32 -> 64 -> 32 is exact
    said = [r.getMessage() for r in caplog.records if "float64" in r.getMessage()]
    assert len(said) == 1 and "converted to torch.float32" in said[0]
    assert (tmp_path / "float64.pkl").read_bytes() == reference


def test_float16_images_are_widened_to_the_models_dtype(model: nn.Module, data: list, tmp_path: Path) -> None:
    half = [(x.half(), y) for x, y in data]
    prune(model, half, tmp_path / "float16.pkl")()
    prune(model, [(x.float(), y) for x, y in half], tmp_path / "widened.pkl")()  # float16 -> 32 is exact
    assert (tmp_path / "float16.pkl").read_bytes() == (tmp_path / "widened.pkl").read_bytes()


def test_bare_images_serve_a_label_free_metric(model: nn.Module, data: list, tmp_path: Path) -> None:
    prune(model, data, tmp_path / "pairs.pkl", metric="agreement")()
    prune(model, [x for x, _ in data], tmp_path / "bare.pkl", metric="agreement")()
    assert load_sensitivities(tmp_path / "bare.pkl") == load_sensitivities(tmp_path / "pairs.pkl")
    mixed = [data[0][0], data[1]]
    refused(prune(model, mixed, tmp_path / "mixed.pkl", metric="agreement"), "data", DataError)


# ---- NNI's SensitivityAnalysis ---------------------------------------------------------------------------------------


def metric_of(data: list) -> Callable[[nn.Module], float]:
    def accuracy(model: nn.Module) -> float:
        with torch.inference_mode():
            return float((model(data[0][0]).argmax(1) == data[0][1]).float().mean())

    return accuracy


@pytest.mark.parametrize(
    ("argument", "options"),
    [("model", {"model": None}), ("val_func", {"val_func": None}), ("sparsities", {"sparsities": 0.3}),
     ("prune_type", {"prune_type": ["l1"]}), ("dependency_aware", {"dependency_aware": "yes"}),
     ("dummy_input", {"dummy_input": [1, 2]}), ("analysis_file", {"analysis_file": 3})],
)  # fmt: skip
def test_sensitivity_analysis_refuses_arguments_by_name(model: nn.Module, data: list, argument: str, options: dict
                                                        ) -> None:  # fmt: skip
    arguments = {"model": model, "val_func": metric_of(data), **options}
    refused(lambda: SensitivityAnalysis(**arguments), argument)


@pytest.mark.parametrize(
    ("argument", "options"),
    [
        ("val_args", {"val_args": 3}),
        ("val_kwargs", {"val_kwargs": [1]}),
        ("specified_layers", {"specified_layers": "0"}),
    ],
)
def test_sensitivity_analysis_method_refuses_arguments_by_name(model: nn.Module, data: list, argument: str,
                                                               options: dict) -> None:  # fmt: skip
    calls = []
    analysis = SensitivityAnalysis(model, lambda m: calls.append(m) or 1.0)
    refused(lambda: analysis.analysis(**{"val_args": [model], **options}), argument, ConfigError)
    assert not calls  # refused before val_func ran


@pytest.mark.parametrize("result", ["x", None, "0.5"], ids=["word", "None", "numeric string"])
def test_a_val_func_returning_no_number_is_refused_by_name(model: nn.Module, result: object) -> None:
    refused(lambda: SensitivityAnalysis(model, lambda m: result).analysis(val_args=[model]), "val_func", DataError)


def test_load_state_dict_and_export_refuse_by_name(model: nn.Module, data: list) -> None:
    analysis = SensitivityAnalysis(model, metric_of(data))
    refused(lambda: analysis.load_state_dict(None), "state_dict", ConfigError)  # type: ignore[arg-type]
    refused(lambda: analysis.load_state_dict({"nothing": torch.zeros(1)}), "state_dict", ModelError)
    refused(lambda: analysis.export(None), "filepath", ConfigError)  # type: ignore[arg-type]


# ---- build_plan ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def analysed(model: nn.Module, data: list, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "s.pkl"
    analysis_prune(model, data, path, pruned_ratios=[0.25, 0.5], progress=False)
    return path


@pytest.mark.parametrize(
    ("argument", "options", "found"),
    [("also", {"also": {"flops": 0.1}}, "'flops'"), ("also['params']", {"also": {"params": 1.5}}, "1.5"),
     ("also['params']", {"also": {"params": "x"}}, "'x'"), ("also", {"also": {"macs": 0.2}}, "'macs'"),
     ("also", {"also": [("params", 0.2)]}, "list"), ("measure", {"measure": "flops"}, "'flops'"),
     ("target", {"target": "0.3"}, "'0.3'"), ("model", {"model": None}, "None"),
     ("example_input", {"example_input": None}, "None"), ("analysis", {"analysis": None}, "None"),
     ("latency", {"measure": "latency"}, "measure='latency'")],
)  # fmt: skip
def test_build_plan_refuses_arguments_by_name(model: nn.Module, data: list, analysed: Path, argument: str,
                                              options: dict, found: str) -> None:  # fmt: skip
    arguments = {"model": model, "example_input": data[0][0], "analysis": analysed, "target": 0.3, **options}
    error = refused(lambda: build_plan(**arguments), argument)
    assert found in str(error)


def test_build_plan_takes_a_params_budget_in_also(model: nn.Module, data: list, analysed: Path) -> None:
    plan = build_plan(model, data[0][0], analysed, 0.2, also={"params": 0.1})
    assert plan.reduction_of("params") >= 0.1 and plan.budgets == {"macs": 0.2, "params": 0.1}


# ---- run_plan_step ----------------------------------------------------------------------------------------------


def test_run_plan_step_refuses_what_is_no_config(tmp_path: Path) -> None:
    refused(lambda: run_plan_step(None), "config", ConfigError)  # type: ignore[arg-type]
    refused(lambda: run_plan_step(tmp_path / "missing.yaml"), "config", ConfigError)
    refused(lambda: run_plan_step({"Global": {}}), "config", ConfigError)  # type: ignore[arg-type]


def test_run_plan_step_takes_a_configs_path(tmp_path: Path, list_data: Path) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(list_data),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.25, 0.5],
                                "target_macs_reduction": 0.2},
    })  # fmt: skip
    assert run_cli(["--config_path", config, "--quiet", "--no_report"]) == 0
    plan_file = tmp_path / "s.pkl.plan.yaml"
    by_path = run_plan_step(str(config), progress=False)
    written = plan_file.read_bytes()
    by_config = run_plan_step(load_config(config), progress=False)
    assert by_path.plan.ratios == by_config.plan.ratios and by_path.plan.ratios
    assert plan_file.read_bytes() == written
    refused(lambda: run_plan_step(config, progress="yes"), "progress", ConfigError)  # type: ignore[arg-type]


# ---- properties: any argument of a wrong type is a UserError ----------------------------------------------------


def property_settings(max_examples: int) -> settings:
    """Deterministic examples (no database), no deadline: CI runs the same cases every time."""
    return settings(derandomize=True, database=None, deadline=None, max_examples=max_examples)


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(), st.text(max_size=4),
    st.binary(max_size=3), st.builds(object),
)  # fmt: skip
WRONG = st.one_of(
    SCALARS,
    st.lists(SCALARS, min_size=1, max_size=3),
    st.tuples(SCALARS, SCALARS, SCALARS),
    st.dictionaries(st.text(max_size=3), SCALARS, min_size=1, max_size=2),
    st.sets(st.integers(), min_size=1, max_size=2),
    st.just(nn.Identity()),
)
"""Values of every kind; each argument draws only those of a type it does not take (:data:`TAKES`)."""


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_list_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, (list, tuple, set)) and all(check(item) for item in value)


def optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def is_text(value: object) -> bool:
    return isinstance(value, str)


def is_flag(value: object) -> bool:
    return isinstance(value, bool)


def is_path(value: object) -> bool:
    return isinstance(value, (str, Path))


def anything(value: object) -> bool:
    return False


TAKES: dict[str, dict[str, Callable[[object], bool]]] = {
    "analysis_prune": {
        "model": lambda value: isinstance(value, nn.Module), "data": callable, "analysis_file": is_path,
        "pruned_ratios": is_list_of(is_number), "target_loss": optional(is_number), "criterion": is_text,
        "prune_params": optional(is_list_of(is_text)), "metric": is_text, "example_input": optional(anything),
        "group_reduction": is_text, "metric_mode": is_text, "overwrite": is_flag, "progress": optional(is_flag),
        "engine": is_text, "precision": optional(lambda v: is_number(v) or is_text(v)),
        "seed": lambda v: isinstance(v, int) and not isinstance(v, bool), "granularity": is_text,
        "early_stop_mode": optional(is_text), "early_stop_value": optional(is_number),
        "round_to": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "adaptive_bn": is_flag, "calibration": optional(anything), "units": optional(is_list_of(is_text)),
        "decision_error": is_number, "decision_precision": optional(is_number), "numerics": is_text,
    },
    "SensitivityAnalysis": {
        "model": lambda value: isinstance(value, nn.Module), "val_func": callable,
        "sparsities": optional(is_list_of(is_number)), "prune_type": is_text, "early_stop_mode": optional(is_text),
        "early_stop_value": optional(is_number), "dependency_aware": is_flag, "dummy_input": optional(anything),
        "analysis_file": optional(is_path),
        # the analysis method's
        "val_args": optional(lambda v: isinstance(v, (list, tuple, set))),
        "val_kwargs": optional(lambda v: isinstance(v, dict) and all(map(is_text, v))),
        "specified_layers": optional(is_list_of(is_text)),
    },
    "build_plan": {
        "model": lambda value: isinstance(value, nn.Module), "example_input": anything, "analysis": is_path,
        "target": is_number, "measure": is_text, "latency": optional(anything), "also": optional(lambda v: v == {}),
    },
    "run_plan_step": {
        "config": anything, "inputs": optional(anything), "progress": optional(is_flag),
        "ratios_file": optional(is_path), "record": optional(anything),
    },
}  # fmt: skip
"""Per entry and argument: whether a value is of a type the argument takes (those are not drawn)."""


@functools.cache
def wrong_value(entry: str, argument: str) -> st.SearchStrategy[object]:
    """The values of a type ``argument`` of ``entry`` does not take (one strategy per argument, built once)."""
    takes = TAKES[entry][argument]
    return WRONG.filter(lambda value: not takes(value))


FEW_BATCHES = batches(count=1, size=2, resolution=8)


@pytest.mark.parametrize("argument", list(TAKES["analysis_prune"]))
@property_settings(10)
@given(value=st.data())
def test_analysis_prune_refuses_any_wrong_type_by_name(argument: str, value: st.DataObject) -> None:
    arguments: dict[str, Any] = {"model": tiny_cnn(), "data": FEW_BATCHES, "analysis_file": "never.pkl"}
    arguments[argument] = value.draw(wrong_value("analysis_prune", argument), label=argument)
    refused(lambda: analysis_prune(**arguments), argument)
    assert not Path("never.pkl").exists()


@pytest.mark.parametrize("argument", list(TAKES["SensitivityAnalysis"]))
@property_settings(10)
@given(value=st.data())
def test_sensitivity_analysis_refuses_any_wrong_type_by_name(argument: str, value: st.DataObject) -> None:
    model = tiny_cnn()
    calls: list[object] = []
    wrong = value.draw(wrong_value("SensitivityAnalysis", argument), label=argument)
    if argument in ("val_args", "val_kwargs", "specified_layers"):
        analysis = SensitivityAnalysis(model, lambda *args, **kwargs: calls.append(args) or 1.0)
        refused(lambda: analysis.analysis(**{argument: wrong}), argument)
    else:
        arguments: dict[str, Any] = {"model": model, "val_func": lambda *args: calls.append(args) or 1.0}
        refused(lambda: SensitivityAnalysis(**{**arguments, argument: wrong}), argument)
    assert not calls  # refused before val_func ran


@pytest.fixture(scope="module")
def plan_inputs(model: nn.Module, data: list, analysed: Path) -> dict[str, Any]:
    """build_plan's valid arguments."""
    return {"model": model, "example_input": data[0][0], "analysis": analysed, "target": 0.2}


@pytest.mark.parametrize("argument", list(TAKES["build_plan"]))
@property_settings(10)
@given(value=st.data())
def test_build_plan_refuses_any_wrong_type_by_name(argument: str, value: st.DataObject, plan_inputs: dict) -> None:
    wrong = value.draw(wrong_value("build_plan", argument), label=argument)
    refused(lambda: build_plan(**{**plan_inputs, argument: wrong}), argument)


@pytest.fixture(scope="module")
def plan_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """A config whose analysis file does not exist: every argument is checked before it is read."""
    folder = tmp_path_factory.mktemp("config")
    return load_config(write_config(folder / "c.yaml", {
        "Global": tiny_global(folder), "SensitivityAnalysis": {"analysis_file": str(folder / "never.pkl")},
    }))  # fmt: skip


@pytest.mark.parametrize("argument", list(TAKES["run_plan_step"]))
@property_settings(10)
@given(value=st.data())
def test_run_plan_step_refuses_any_wrong_type_by_name(argument: str, value: st.DataObject, plan_config: Config) -> None:
    wrong = value.draw(wrong_value("run_plan_step", argument), label=argument)
    arguments: dict[str, Any] = {"config": plan_config, argument: wrong}
    refused(lambda: run_plan_step(**arguments), argument)


def test_the_wrong_values_are_of_every_kind() -> None:
    # guards the properties: the values drawn for an argument include None, numbers, strings and containers
    kinds: set[str] = set()

    @property_settings(100)
    @given(value=wrong_value("build_plan", "target"))
    def draw(value: object) -> None:
        kinds.add(type(value).__name__)

    draw()
    assert {"NoneType", "bool", "complex", "str", "bytes", "list", "tuple", "dict", "set", "object"} <= kinds

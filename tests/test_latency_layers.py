"""Layer-level latency tables: the changed layer shapes are exact, savings equal the whole-model probes' on an
additive runtime, each shape is measured once, a killed build resumes, and a latency plan on it meets its budget."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from analysis.io.latency_table import LatencyTable, load_table, save_table
from analysis.io.record import load_record
from analysis.io.results import load_sidecar
from analysis.planning.latency_plan import plan_for_latency
from analysis.planning.layer_table import JointLayerSavings, changed_layers, layer_calls, measure_layer_table
from analysis.planning.plan import Planner, open_planner
from analysis.planning.probes import measure_table, table_key
from analysis.runtimes.timing import Latency
from analysis.structure.criteria import allowed_counts
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy
from analysis.workflow import plan as plan_workflow

import tiny_models
from helpers import CliResult, analysis_config, batches, randomize
from latency_fakes import MacsRuntime, analysed


class CountingRuntime(MacsRuntime):
    """:class:`MacsRuntime` that remembers the layer shapes it was asked to measure."""

    def __init__(self, example: torch.Tensor, **options: Any) -> None:
        super().__init__(example, **options)
        self.measured: list[str] = []

    def measure(self, model: nn.Module, sample_shape: Any, batch: int) -> Any:
        self.measured.append(f"{model!r} @ {tuple(sample_shape)}")
        return super().measure(model, sample_shape, batch)


@pytest.fixture
def setting(tmp_path: Path) -> tuple[nn.Module, torch.Tensor, Path]:
    model = randomize(tiny_models.tiny_resnet()).eval()
    return model, batches(count=1)[0][0], analysed(model, tmp_path / "s.pkl")


def planned(model: nn.Module, example: torch.Tensor, path: Path) -> tuple[Planner, dict[str, list[int]]]:
    planner, options = open_planner(model, example, load_record(path))
    return planner, planner.probe_counts(options, load_record(path).sensitivities)


@pytest.mark.parametrize(
    "build", [tiny_models.tiny_resnet, tiny_models.tiny_inverted_residual, tiny_models.tiny_grouped,
              tiny_models.tiny_flatten_head, tiny_models.tiny_densenet],
)  # fmt: skip
def test_changed_layer_shapes_are_those_of_the_physically_pruned_model(build: Callable[[], nn.Module]) -> None:
    """Depthwise convs (groups follow the channels), grouped convs, a flattening linear head and concatenations."""
    model = randomize(build()).eval()
    example = batches(count=1)[0][0]
    with eval_mode(model):
        planner = Planner(model, example, {"criterion": "l1_norm", "group_reduction": "self"}, "macs")
        dense = layer_calls(model, example)
        assert dense and planner.by_name
        for name, param in planner.by_name.items():
            counts = [c for c in allowed_counts(param.channels, len(param.conv_blocks)) if c]
            count = counts[len(counts) // 2]
            changed = {layer: changed_layers(planner, {layer: shapes}, name, count) for layer, shapes in dense.items()}
            copy = jointly_pruned_copy(model, [(param.module_name, planner.removed(name, count))], example)
            expected = {layer: [p for _, p in changed[layer]] or shapes for layer, shapes in dense.items()}
            assert layer_calls(copy, example) == expected, name
            pairs = [pair for found in changed.values() for pair in found]
            assert len(pairs) >= 2 and all(pruned != shape for shape, pruned in pairs)  # a producer and a consumer
            for _, shape in pairs:
                built = shape.build()
                built(torch.zeros(1, *shape.sample))  # a standalone layer of the pruned shape runs


@pytest.mark.parametrize("misaligned_ms", [0.0, 0.05])
def test_layer_savings_equal_the_whole_model_probes_on_an_additive_runtime(setting: Any, misaligned_ms: float) -> None:
    """Latency = overhead + MACs (+ a cost per misaligned conv) is a sum over layers, so the layer table's savings
    equal the whole-model probes' exactly; the two tables live in different files."""
    model, example, path = setting
    with eval_mode(model):
        planner, counts = planned(model, example, path)
        probes, probe_file, _ = measure_table(planner, counts, MacsRuntime(example, misaligned_ms), 1, path, False)
        layers, layer_file, _ = measure_layer_table(planner, counts, MacsRuntime(example, misaligned_ms), 1, path,
                                                    progress=False)  # fmt: skip
    assert layer_file != probe_file and layers.key["table"] == "layers" and "table" not in probes.key
    assert layers.dense_ms == probes.dense_ms and layers.layers and not probes.layers
    assert set(layers.probes) == set(probes.probes) == set(counts)
    for group, found in counts.items():
        assert sorted(layers.probes[group]) == found
        for count in found:
            assert layers.saving(group, count) == pytest.approx(probes.saving(group, count), abs=1e-9)
            assert layers.saving(group, count) > 0


def test_each_layer_shape_is_measured_once_and_a_killed_build_resumes(setting: Any) -> None:
    """Each pruned shape once, beside its dense shape measured just before it (the reference of its saving)."""
    model, example, path = setting
    with eval_mode(model):
        planner, counts = planned(model, example, path)
        calls = layer_calls(model, example)
        pairs = [
            pair for group, found in counts.items() for c in found for pair in changed_layers(planner, calls, group, c)
        ]
        dense_shapes = {dense.key for dense, _ in pairs}
        pruned_shapes = {pruned.key for _, pruned in pairs}
        assert len(dense_shapes) + len(pruned_shapes) < 2 * len(pairs)  # shapes are shared between probes
        runtime = CountingRuntime(example)
        fresh, _, _ = measure_layer_table(planner, counts, runtime, 1, path.with_name("fresh.pkl"), progress=False)
        assert runtime.calls == 1 + len(dense_shapes) + len(pruned_shapes)  # the model, each dense and pruned shape
        assert (
            set(fresh.references) == pruned_shapes and {what for what, _ in fresh.references.values()} <= dense_shapes
        )
        killed = CountingRuntime(example, fail_after=3)  # the model, a dense shape and one pruned shape get saved
        with pytest.raises(KeyboardInterrupt):
            measure_layer_table(planner, counts, killed, 1, path, progress=False)
        again = CountingRuntime(example)
        table, file, _ = measure_layer_table(planner, counts, again, 1, path, progress=False)
        assert killed.measured[2] not in again.measured and killed.measured[0] not in again.measured
        assert again.calls < runtime.calls - 1
        assert table.layers == fresh.layers and table.probes == fresh.probes and table.dense_ms == fresh.dense_ms
        cached = MacsRuntime(example)
        measure_layer_table(planner, counts, cached, 1, path, progress=False)
        assert cached.calls == 0 and load_table(file, table.key).layers == fresh.layers


class BusierRuntime(MacsRuntime):
    """:class:`MacsRuntime` on a machine three times slower (other jobs started while the build was down)."""

    def measure(self, model: nn.Module, sample_shape: Any, batch: int) -> Latency:
        steady = super().measure(model, sample_shape, batch)
        return Latency(steady.runtime, steady.device, batch, 3 * steady.median_ms, 0.0, 1)


def test_layer_savings_are_relative_to_the_dense_shape_measured_beside_them(setting: Any) -> None:
    """A build killed and resumed on a busier machine: the dense shape timed before the kill stays in the table, and
    the pruned shapes timed after it are taken against that shape measured again beside them, so every saving keeps
    its proportion to the steady machine's; plain differences across the restart would not."""
    model, example, path = setting
    with eval_mode(model):
        planner, counts = planned(model, example, path)
        steady, _, _ = measure_layer_table(planner, counts, MacsRuntime(example), 1, path.with_name("s2.pkl"), False)
        with pytest.raises(KeyboardInterrupt):
            measure_layer_table(planner, counts, MacsRuntime(example, fail_after=3), 1, path, False)
        resumed, _, _ = measure_layer_table(planner, counts, BusierRuntime(example), 1, path, False)
    plain_wrong = 0
    for pruned, (dense, _) in resumed.references.items():
        scale = resumed.layers[dense] / steady.layers[dense]
        expected = scale * steady.layer_saving(dense, pruned)
        assert resumed.layer_saving(dense, pruned) == pytest.approx(expected, rel=1e-9, abs=1e-12)
        plain_wrong += resumed.layers[dense] - resumed.layers[pruned] != pytest.approx(expected, rel=1e-6)
    assert plain_wrong >= 1  # the restart case was exercised


def test_a_whole_plans_layer_saving_counts_convs_between_two_pruned_groups_once(setting: Any) -> None:
    """On the additive fake runtime (latency = overhead + MACs) the joint layer saving of several groups pruned at
    once equals what the jointly pruned model saves exactly, while the groups' savings alone add up to more (a conv
    losing input channels to one group and filters to another is counted twice by the sum)."""
    model, example, path = setting
    runtime = MacsRuntime(example)
    with eval_mode(model):
        planner, counts = planned(model, example, path)
        table, file, _ = measure_layer_table(planner, counts, runtime, 1, path, progress=False)
        picks = {group: max(found) for group, found in counts.items()}
        removals = planner.removals(picks.items())
        exact = runtime.latency_of(model) - runtime.latency_of(jointly_pruned_copy(model, removals, example))
        joint = JointLayerSavings(planner, table, runtime, 1, file)
        before = runtime.calls
        assert joint(picks) == pytest.approx(exact, rel=1e-9)
        assert runtime.calls > before  # the joint shapes were timed on demand
        assert sum(table.saving(g, c) for g, c in picks.items()) > exact * 1.01
        again = runtime.calls
        assert joint(picks) == pytest.approx(exact, rel=1e-9) and runtime.calls == again  # and cached
    assert load_table(file, table.key).layers == table.layers


def test_a_layer_table_plan_is_predicted_with_its_interactions(setting: Any) -> None:
    """The plan's prediction is its joint layer saving: exact on the additive fake, where the groups' savings alone
    summed over-promise for the same plan; a plan it predicts to miss is not measured."""
    model, example, path = setting
    plan = plan_for_latency(model, example, load_record(path), MacsRuntime(example), reduction=0.7, table="layers",
                            round_to=1)  # fmt: skip
    assert plan.latency is not None
    first = plan.latency.attempts[0]
    assert first.predicted_ms == pytest.approx(first.measured_ms, rel=1e-9)
    table_file = Path(plan.latency.table_file)
    table = load_table(table_file, json.loads(table_file.read_text())["key"])
    picks = {group.members[0]: len(group.removed) for group in plan.groups}
    summed = table.dense_ms - sum(table.saving(g, c) for g, c in picks.items())
    assert summed < plan.latency.measured_ms * 0.99
    # the whole-plan prediction said the knapsack's first plans missed: raised before measuring, one plan measured
    assert len(plan.latency.attempts) == 1 and plan.latency.met and first.target_reduction > 0.7


def test_a_table_file_without_layers_loads_and_a_model_table_writes_none(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    key = {"runtime": "fake"}
    path.write_text(json.dumps({"key": key, "dense_ms": 3.0, "probes": {"a": {"2": 2.5}}}))
    table = load_table(path, key)
    assert table.layers == {} and table.saving("a", 2) == 0.5
    save_table(path, table)
    assert "layers" not in json.loads(path.read_text())
    save_table(path, LatencyTable(key, 3.0, {}, {"Linear(4->2) @ (4,)": 0.1}))
    assert load_table(path, key).layers == {"Linear(4->2) @ (4,)": 0.1}


def test_the_table_kind_is_part_of_the_cache_key(setting: Any) -> None:
    model, example, path = setting
    runtime = MacsRuntime(example)
    with eval_mode(model):
        planner, counts = planned(model, example, path)
        table, _, _ = measure_layer_table(planner, counts, runtime, 1, path, progress=False)
    assert table.key == {**table_key(runtime, model, tuple(example.shape[1:]), 1), "table": "layers"}


@pytest.mark.parametrize("target", [0.2, 0.5])
def test_a_latency_plan_on_a_layer_table_meets_its_budget_as_measured(setting: Any, target: float) -> None:
    model, example, path = setting
    runtime = MacsRuntime(example, 0.05)
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=target, table="layers", round_to=1)
    assert plan.latency is not None and plan.latency.met
    measured = runtime.latency_of(jointly_pruned_copy(model, plan.removals(), example))
    assert plan.latency.measured_ms == measured <= runtime.latency_of(model) * (1 - target)
    assert "table" in json.loads(Path(plan.latency.table_file).read_text())["key"]


@pytest.mark.parametrize(("on_cpu", "batch", "kind"), [(True, 32, "layers"), (True, 8, "model"), (False, 32, "model")])
def test_the_auto_table_is_the_layer_table_at_a_large_batch_on_a_cpu(
    setting: Any, on_cpu: bool, batch: int, kind: str
) -> None:
    """``latency_table: auto`` (the default): long calls on a CPU, where the layers' times add up, get the cheap layer
    table; batch 1-style calls and other devices the whole-model probes. The sidecar says which was measured."""
    model, example, path = setting
    runtime = MacsRuntime(example, 0.05)
    runtime.on_cpu = on_cpu
    plan = plan_for_latency(model, example, load_record(path), runtime, reduction=0.3, batch=batch, round_to=1)
    assert plan.latency is not None and plan.latency.table == kind and plan.latency.as_dict()["table"] == kind
    layered = "table" in json.loads(Path(plan.latency.table_file).read_text())["key"]
    assert layered == (kind == "layers")


def test_the_plan_command_builds_the_table_its_flag_names(
    tmp_path: Path, list_data: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_workflow, "latency_runtime", lambda config, device: MacsRuntime(torch.zeros(1)))
    config = analysis_config(tmp_path, list_data, "slow_cnn", {"pruned_ratios": [0.25, 0.5], "report": False},
                             arch_kwargs={"delay": 0.0})  # fmt: skip
    for kind in ("layers", "model"):
        result = cli("plan", "--config_path", config, "--target_latency_reduction", "0.2", "--latency_table", kind)
        assert result.code == 0, result.err
        latency = load_sidecar(tmp_path / "out" / "s.pkl")["plan"]["latency"]
        table = json.loads(Path(latency["table_file"]).read_text())
        assert latency["met"] and bool(table.get("layers")) == (kind == "layers")

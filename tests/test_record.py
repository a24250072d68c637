"""The analysis record: one read of the pickle and its sidecar, one handling of what is missing or partial, and the
report, the tables, the plans and the merge giving from a record exactly what they give from the file."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from analysis import analysis_prune
from analysis.errors import AnalysisFileError, UserError
from analysis.io.record import AnalysisRecord, as_record, load_record
from analysis.io.results import load_sensitivities, save_sensitivities, save_sidecar, sidecar_path
from analysis.io.sidecar import Sidecar
from analysis.io.tables import export_csv
from analysis.planning.estimates import estimate_notice
from analysis.planning.plan import build_plan, plan_from_ratios
from analysis.scale.shards import merge_files, merge_records

from helpers import batches, pseudo_labelled, randomize
from tiny_models import tiny_resnet

BASELINE = {"top1": 0.9, "top5": 0.99, "ce": 0.3, "images": 40}


def _variant(loss: float, interval: list[float] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"loss": loss, "top1": BASELINE["top1"] * (1 - loss), "ce": 0.3 + loss, "macs": 900}
    if interval is not None:
        found.update(interval=interval, samples=20)
    return found


def _partial(directory: Path, sidecar: bool = True) -> Path:
    """A partial analysis: ``b`` stopped early after 0.2, ``c`` was interrupted before any ratio, ``fc`` cannot be
    pruned, and ``a``'s loss at 0.3 is an estimate (an interval of non-zero width)."""
    path = directory / "partial.pkl"
    save_sensitivities(path, {"a.weight": {0.1: 0.01, 0.2: 0.02, 0.3: 0.05}, "b.weight": {0.1: 0.2, 0.2: 0.4},
                              "c.weight": {}})  # fmt: skip
    if sidecar:
        save_sidecar(
            path,
            {
                "fingerprint": {
                    "model": "ab" * 32,
                    "data": "cd" * 32,
                    "settings": {"metric": "top1", "criterion": "fpgm"},
                },
                "config": {"SensitivityAnalysis": {"target_loss": 0.03}},
                "params": {
                    "a.weight": {
                        "module": "a",
                        "kind": "conv",
                        "variants": {"0.1": _variant(0.01), "0.2": _variant(0.02), "0.3": _variant(0.05, [0.03, 0.07])},
                    },
                    "b.weight": {
                        "module": "b",
                        "early_stop": {"ratio": 0.2, "condition": "loss > 0.3"},
                        "variants": {"0.1": _variant(0.2), "0.2": _variant(0.4, [0.4, 0.4])},
                    },
                },
                "unprunable": {"fc.weight": "coupled to the output layer"},
                "model_order": ["a.weight", "b.weight", "c.weight"],
                "baseline": BASELINE,
                "cost": {"macs": 1000, "params": 100},
            },
        )
    return path


# ------------------------------------------------------------------------------------------------------ loading


def test_a_full_file_is_read_once_into_its_parts(tmp_path: Path) -> None:
    path = _partial(tmp_path)
    record = load_record(str(path))
    assert record.path == path and record.sensitivities == load_sensitivities(path)
    assert record.sidecar is not None and record.sidecar.to_json() == json.loads(sidecar_path(path).read_text())
    assert record.baseline == BASELINE and record.settings.criterion == "fpgm" and record.settings.metric_name == "top1"
    assert record.fingerprint is not None and record.fingerprint.data == "cd" * 32
    assert record.config is not None and record.config.target_loss() == 0.03
    assert record.cost is not None and (record.cost.macs, record.cost.params) == (1000, 100)
    assert record.model_order == ["a.weight", "b.weight", "c.weight"] and record.plan is None
    assert list(record.params) == ["a.weight", "b.weight"] and record.params["a.weight"].module == "a"
    assert record.param("b.weight") is record.sidecar.param("b.weight") and record.param("c.weight") is None
    found = record.variant("a.weight", 0.30000000000000004)
    assert found is not None and found.metric("top1") == pytest.approx(0.9 * 0.95)
    assert [(name, ratio) for name, ratio, _ in record.variants()] == [
        ("a.weight", 0.1), ("a.weight", 0.2), ("a.weight", 0.3), ("b.weight", 0.1), ("b.weight", 0.2),
    ]  # fmt: skip
    assert as_record(record) is record  # a record is taken as it is, never read again


def test_a_partial_analysis_says_what_is_partial(tmp_path: Path) -> None:
    record = load_record(_partial(tmp_path))
    assert record.unprunable == {"fc.weight": "coupled to the output layer"}
    assert record.early_stops == {"b.weight": 0.2}
    assert record.estimates == frozenset({("a.weight", 0.3)})  # b's zero-width interval is exact
    assert record.ratios == (0.1, 0.2, 0.3)
    assert record.missing_ratios() == {"b.weight": (0.3,)}  # c has no loss at all: it is not "missing some"
    measured = record.measured()
    assert list(measured.sensitivities) == ["a.weight", "b.weight"] and measured.sidecar is record.sidecar
    assert list(record.sensitivities) == ["a.weight", "b.weight", "c.weight"]  # the record itself is unchanged
    assert measured.measured() is measured


def test_without_a_sidecar_the_record_has_empty_parts(tmp_path: Path) -> None:
    path = _partial(tmp_path, sidecar=False)
    record = load_record(path)
    assert record.sidecar is None and record.sensitivities == load_sensitivities(path)
    assert (record.baseline, record.params, record.unprunable, record.early_stops) == ({}, {}, {}, {})
    assert record.model_order == []
    assert record.estimates == frozenset() and list(record.variants()) == [] and record.variant("a.weight", 0.1) is None
    assert (record.fingerprint, record.config, record.cost, record.plan) == (None, None, None, None)
    assert record.settings.metric_name == "top1" and record.settings.ranking()["criterion"] == "l1_norm"
    assert estimate_notice(record) is None


def test_a_missing_file_is_one_user_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "gone.pkl"
    with pytest.raises(UserError) as caught:
        load_record(missing)
    assert isinstance(caught.value, AnalysisFileError)
    assert str(caught.value) == (
        f"Analysis file {missing} does not exist; pass the .pkl a sensitivity run wrote (or run the analysis first)."
    )
    for step in (lambda: export_csv(missing, style="long"), lambda: estimate_notice(missing),
                 lambda: merge_files(tmp_path / "m.pkl", [missing])):  # fmt: skip
        with pytest.raises(AnalysisFileError, match=f"^Analysis file {missing} does not exist;"):
            step()
    assert not (tmp_path / "m.pkl").exists()


def test_missing_ok_reads_a_missing_pickle_as_no_losses_and_keeps_its_sidecar(tmp_path: Path) -> None:
    path = _partial(tmp_path)
    path.unlink()  # the store writes the sidecar first: a crash in between leaves it alone
    record = load_record(path, missing_ok=True)
    assert record.sensitivities == {} and record.sidecar is not None and record.baseline == BASELINE
    shutil.move(sidecar_path(path), tmp_path / "elsewhere.json")
    assert load_record(path, missing_ok=True) == AnalysisRecord(path, {}, None)


class _Touch:
    """Unpickled by a plain unpickler, this would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize(
    ("content", "refusal"),
    [
        (lambda marker: pickle.dumps({"a.weight": {0.1: _Touch(marker)}}), r"holds code or unexpected types"),
        (lambda marker: pickle.dumps([("a.weight", 0.1, 0.2)]), r"has the wrong structure \(the top level is a list"),
        (lambda marker: pickle.dumps({"a.weight": {0.1: "high"}}), r"has the wrong structure"),
        (lambda marker: b"not a pickle at all", r"is not a pickle or is damaged"),
        (lambda marker: b"", r"is not a pickle or is damaged \(it is empty\)"),
    ],
    ids=["code", "list", "text-loss", "garbage", "empty"],
)
def test_a_corrupt_or_non_data_pickle_is_refused(content: Any, refusal: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    path = tmp_path / "bad.pkl"
    path.write_bytes(content(marker))
    with pytest.raises(AnalysisFileError, match=rf"^Analysis file {path} {refusal}"):
        load_record(path)
    assert not marker.exists()  # nothing in the file was run


def test_a_damaged_sidecar_is_refused_naming_it(tmp_path: Path) -> None:
    path = _partial(tmp_path)
    sidecar_path(path).write_text('{"baseline": {"top1": "high"}}')
    with pytest.raises(AnalysisFileError, match=rf"^Sidecar file {sidecar_path(path)} has the wrong structure"):
        load_record(path)


def test_the_record_is_immutable_and_travels_between_ranks(tmp_path: Path) -> None:
    record = load_record(_partial(tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.sidecar = None  # type: ignore[misc]
    copy = pickle.loads(pickle.dumps(record))  # torchrun ranks send records to rank 0
    assert copy.path == record.path and copy.sensitivities == record.sensitivities
    assert isinstance(copy.sidecar, Sidecar) and copy.sidecar.to_json() == record.sidecar.to_json()


# --------------------------------------------------------------------------------- steps that take the record


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_report_and_tables_from_a_record_equal_those_from_the_file_and_read_nothing(tmp_path: Path) -> None:
    from analysis.workflow.report import write_report_files

    path = _partial(tmp_path)
    from_file = write_report_files(path, out_dir=tmp_path / "from_file")
    record = load_record(path)
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "partial.pkl", moved)  # the record is all the steps read: the files can go
    shutil.move(sidecar_path(path), tmp_path / "moved.json")
    from_record = write_report_files(record, out_dir=tmp_path / "from_record")
    assert [p.name for p in from_record] == [p.name for p in from_file] == [
        "partial.wide.csv", "partial.long.csv", "partial.curves.png", "partial.heatmap.png", "partial.savings.png",
        "partial.report.html",
    ]  # fmt: skip
    assert _files(tmp_path / "from_record") == _files(tmp_path / "from_file")
    html = (tmp_path / "from_record" / "partial.report.html").read_text()
    assert ">c.weight<" not in html and ">b.weight<" in html  # c has no loss: not drawn
    assert "coupled to the output layer" in html  # unprunable: listed with its reason
    assert (
        export_csv(record, tmp_path / "long.csv", style="long").read_bytes()
        == (tmp_path / "from_file" / "partial.long.csv").read_bytes()
    )


def test_report_without_a_sidecar_from_a_record(tmp_path: Path) -> None:
    from analysis.workflow.report import write_report_files

    path = _partial(tmp_path, sidecar=False)
    written = write_report_files(load_record(path), out_dir=tmp_path / "out")
    assert [p.name for p in written][:2] == ["partial.long.csv", "partial.curves.png"]  # wide CSV: needs the sidecar
    with pytest.raises(AnalysisFileError, match="live in the sidecar"):
        export_csv(load_record(path), style="wide")


def test_plans_from_a_record_equal_those_from_the_file(tmp_path: Path) -> None:
    model = randomize(tiny_resnet())
    example = batches(count=1)[0][0]
    path = tmp_path / "s.pkl"
    analysis_prune(model, pseudo_labelled(model, batches(count=2)), path, pruned_ratios=(0.25, 0.5), progress=False)
    budget_from_file = build_plan(model, example, path, 0.3)
    ratios_from_file = plan_from_ratios(model, example, path, {"conv1.weight": 0.25, "layer1.conv1.weight": 0.5})
    record = load_record(path)
    shutil.move(path, tmp_path / "elsewhere.pkl")  # the plan reads the record alone
    shutil.move(sidecar_path(path), tmp_path / "elsewhere.pkl.json")
    budget = build_plan(model, example, record, 0.3)
    assert budget.as_dict() == budget_from_file.as_dict() and budget.ratios == budget_from_file.ratios
    assert budget.record().to_json() == budget_from_file.record().to_json()
    ratios = plan_from_ratios(model, example, record, {"conv1.weight": 0.25, "layer1.conv1.weight": 0.5})
    assert ratios.as_dict() == ratios_from_file.as_dict()
    with pytest.raises(AnalysisFileError, match=r"s\.pkl has no sidecar \(s\.pkl\.json\), which a plan needs"):
        build_plan(model, example, dataclasses.replace(record, sidecar=None), 0.3)
    tampered = dataclasses.replace(record, sensitivities={name: {} for name in record.sensitivities})
    with pytest.raises(AnalysisFileError, match=r"s\.pkl has no measured filter-pruning losses to plan with"):
        build_plan(model, example, tampered, 0.3)


def test_merging_records_equals_merging_the_files(tmp_path: Path) -> None:
    first = _partial(tmp_path)
    second = tmp_path / "second.pkl"
    save_sensitivities(second, {"b.weight": {0.3: 0.7}, "d.weight": {0.1: 0.3}})
    save_sidecar(second, {**json.loads(sidecar_path(first).read_text()), "params": {}, "unprunable": {}})
    merged_files = merge_files(tmp_path / "files.pkl", [first, second])
    merged_records = merge_records(tmp_path / "records.pkl", [load_record(first), load_record(second)])
    assert merged_records == merged_files
    assert merged_files["b.weight"] == {0.1: 0.2, 0.2: 0.4, 0.3: 0.7}
    assert (tmp_path / "records.pkl").read_bytes() == (tmp_path / "files.pkl").read_bytes()
    sidecars = [json.loads(sidecar_path(tmp_path / name).read_text()) for name in ("records.pkl", "files.pkl")]
    for sidecar in sidecars:  # the time each was written, to the second, is all they may differ in
        assert sidecar.pop("saved_at")
    assert sidecars[0] == sidecars[1]

"""Analysis-file formats: the restricted pickle loader, byte-stable atomic saves, merging and the JSON sidecar."""

from __future__ import annotations

import csv
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from analysis.errors import AnalysisFileError, OutputError
from analysis.io import results
from analysis.io.atomic import atomic_write_bytes, atomic_write_text
from analysis.io.results import (
    load_sensitivities,
    load_sidecar,
    merge_sensitive,
    normalise_ratio,
    ratios_path,
    save_sensitivities,
    save_sidecar,
    sidecar_path,
)
from analysis.io.tables import csv_path, export_csv


def write_pickle(path: Path, data: object, protocol: int = pickle.DEFAULT_PROTOCOL) -> Path:
    """Write ``data`` with the standard (unrestricted) pickler, as PaddleSlim or an attacker would."""
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return path


def leftovers(directory: Path, keep: set[str]) -> list[str]:
    """Names in ``directory`` other than ``keep`` (e.g. temporary files an atomic write forgot)."""
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


class _Payload:
    """Unpickling this would create ``marker`` through ``pathlib.Path.touch``: code, not data."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return Path.touch, (self.marker,)


# ------------------------------------------------------------------------------------------------ normalise / paths


def test_normalise_ratio_merges_float_noise_into_one_key() -> None:
    assert normalise_ratio(0.1 + 0.2) == 0.3
    assert normalise_ratio(0.30000049) == 0.3
    assert normalise_ratio(0.1234567) == 0.123457
    assert isinstance(normalise_ratio(np.float32(0.5)), float)


def test_sidecar_and_ratios_paths_extend_the_analysis_file_name(tmp_path: Path) -> None:
    assert sidecar_path(tmp_path / "s.pkl") == tmp_path / "s.pkl.json"
    assert ratios_path(tmp_path / "s.pkl") == tmp_path / "s.pkl.ratios.yaml"
    assert sidecar_path("out/sensitivity.pkl") == Path("out/sensitivity.pkl.json")


# ---------------------------------------------------------------------------------------------------- save / load


def test_round_trip_normalises_keys_keeps_param_order_and_sorts_ratios(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"z.weight": {0.30000000000000004: 0.2, 0.1: 0.01}, "a.weight": {0.2: -0.01, 0.1: 0}})
    loaded = load_sensitivities(path)
    assert loaded == {"z.weight": {0.1: 0.01, 0.3: 0.2}, "a.weight": {0.1: 0.0, 0.2: -0.01}}
    assert list(loaded) == ["z.weight", "a.weight"]
    assert list(loaded["z.weight"]) == [0.1, 0.3]
    assert all(type(v) is float for curve in loaded.values() for v in curve.values())
    # Written content is plain floats too, readable by a standard unpickler (what PaddleSlim uses).
    raw = pickle.loads(path.read_bytes())
    assert list(raw["a.weight"].items()) == [(0.1, 0.0), (0.2, -0.01)]
    assert type(raw["a.weight"][0.1]) is float
    assert path.read_bytes()[:2] == b"\x80\x04"  # the fixed pickle protocol 4


def test_equal_content_gives_byte_identical_files(tmp_path: Path) -> None:
    first, second, third = tmp_path / "1.pkl", tmp_path / "2.pkl", tmp_path / "3.pkl"
    save_sensitivities(first, {"c1.weight": {0.1: 0.01, 0.2: 0.03}, "c2.weight": {0.1: 0.0}})
    save_sensitivities(second, {"c1.weight": {0.1: 0.01, 0.2: 0.03}, "c2.weight": {0.1: 0.0}})
    # Same content, ratios inserted in another order and with float noise and numpy types.
    save_sensitivities(
        third, {"c1.weight": {np.float64(0.2): np.float64(0.03), 0.1 + 1e-10: 0.01}, "c2.weight": {0.1: 0}}
    )
    assert first.read_bytes() == second.read_bytes() == third.read_bytes()
    # A resumed analysis rewrites what it loaded: that must not change a single byte.
    save_sensitivities(second, load_sensitivities(first))
    assert second.read_bytes() == first.read_bytes()


def test_resaving_with_a_changed_loss_changes_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"c.weight": {0.1: 0.01}})
    before = path.read_bytes()
    save_sensitivities(path, {"c.weight": {0.1: 0.02}})
    assert path.read_bytes() != before
    assert load_sensitivities(path) == {"c.weight": {0.1: 0.02}}


def test_missing_file_loads_as_empty(tmp_path: Path) -> None:
    assert load_sensitivities(tmp_path / "absent.pkl") == {}


def test_save_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "s.pkl"
    save_sensitivities(path, {"c.weight": {0.5: 0.1}})
    assert load_sensitivities(path) == {"c.weight": {0.5: 0.1}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"c.weight": {0.1: float("nan")}}, "not a finite number"),
        ({"c.weight": {0.1: True}}, "not a finite number"),
        ({3: {0.1: 0.2}}, "not a parameter name"),
        ({"c.weight": [0.1, 0.2]}, "not a {ratio: loss} dict"),
    ],
)
def test_save_refuses_what_load_would_refuse(tmp_path: Path, data: object, message: str) -> None:
    path = tmp_path / "s.pkl"
    with pytest.raises(ValueError, match=message):
        save_sensitivities(path, data)  # type: ignore[arg-type]
    assert not path.exists()


# --------------------------------------------------------------------------------------------- restricted loading


def test_malicious_pickle_is_refused_without_running_its_payload(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write_pickle(tmp_path / "evil.pkl", {"c.weight": {0.1: _Payload(marker)}})
    # Sanity check of the test itself: a plain unpickler does run the payload.
    pickle.loads(path.read_bytes())
    assert marker.exists()
    marker.unlink()

    with pytest.raises(AnalysisFileError, match=r"holds code or unexpected types \(pathlib.*touch\)") as info:
        load_sensitivities(path)
    assert not marker.exists()
    assert str(path) in str(info.value)
    assert "only dicts of numbers" in str(info.value)


@pytest.mark.parametrize(
    ("payload", "global_name"),
    [
        ((os.system, ("true",)), "posix.system|nt.system"),
        ((eval, ("1 + 1",)), "builtins.eval"),
        ((complex, (1, 2)), "builtins.complex"),
    ],
)
def test_any_global_outside_the_numpy_scalar_builders_is_refused(
    tmp_path: Path, payload: tuple[object, tuple[object, ...]], global_name: str
) -> None:
    class Reduce:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return payload

    path = write_pickle(tmp_path / "evil.pkl", {"c.weight": {0.1: Reduce()}})
    with pytest.raises(AnalysisFileError, match=f"holds code or unexpected types \\(({global_name})\\)"):
        load_sensitivities(path)


def test_torch_tensor_and_numpy_array_are_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    tensor_file = write_pickle(tmp_path / "tensor.pkl", {"c.weight": {0.1: torch.tensor(0.5)}})
    with pytest.raises(AnalysisFileError, match=r"unexpected types \(torch\."):
        load_sensitivities(tensor_file)
    array_file = write_pickle(tmp_path / "array.pkl", {"c.weight": {0.1: np.array([0.5])}})
    with pytest.raises(AnalysisFileError, match=r"unexpected types \(numpy\._?core\.multiarray\._reconstruct\)"):
        load_sensitivities(array_file)


def test_numpy_object_scalar_is_refused_even_through_allowed_globals(tmp_path: Path) -> None:
    # Hand-written protocol-2 pickle: numpy.dtype("O") then scalar(dtype, ...) -- only allowed globals, odd dtype.
    data = (
        b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01}q\x02G?\xb9\x99\x99\x99\x99\x99\x9a"
        b"cnumpy._core.multiarray\nscalar\nq\x03cnumpy\ndtype\nq\x04X\x01\x00\x00\x00O\x89\x88\x87Rq\x05"
        b"X\x01\x00\x00\x00x\x86Rq\x06ss."
    )
    path = tmp_path / "object.pkl"
    path.write_bytes(data)
    with pytest.raises(AnalysisFileError, match=r"unexpected types \(a numpy dtype 'O'\)"):
        load_sensitivities(path)


@pytest.mark.parametrize("protocol", [0, 2, 3, 4, 5])
def test_numpy_scalars_written_by_paddleslim_load_as_plain_floats(tmp_path: Path, protocol: int) -> None:
    data = {"w": {np.float64(0.1): np.float32(0.05), np.float32(0.2): np.float64(0.25), 0.3: np.int64(1)}}
    path = write_pickle(tmp_path / "paddle.pkl", data, protocol=protocol)
    loaded = load_sensitivities(path)
    # float32(0.05) widened to float64 is 0.05000000074505806; float32(0.2) as a key normalises to 0.2.
    assert loaded == {"w": {0.1: pytest.approx(0.05, abs=1e-8), 0.2: 0.25, 0.3: 1.0}}
    assert list(loaded["w"]) == [0.1, 0.2, 0.3]
    assert all(type(k) is float and type(v) is float for k, v in loaded["w"].items())


def test_integer_ratios_and_losses_become_floats(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "ints.pkl", {"w": {1: 0}})
    loaded = load_sensitivities(path)
    assert loaded == {"w": {1.0: 0.0}}
    assert type(next(iter(loaded["w"]))) is float


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "it is empty"),
        (b"\x00\x01garbage\xff\xfe", "UnpicklingError"),
        (pickle.dumps({"w": {0.1: 0.2}}, protocol=4)[:-7], "truncated"),
        (b'{"w": {"0.1": 0.2}}\n', "UnpicklingError"),
        (b"ratio loss\n0.1 0.2\n", "Error"),
        (pickle.dumps({"w": {0.1: 0.2}}, protocol=4) + b"trailing", "unexpected bytes after the pickle"),
    ],
    ids=["empty", "garbage", "truncated", "json", "text", "trailing-bytes"],
)
def test_files_that_are_not_pickles_are_reported(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "s.pkl"
    path.write_bytes(content)
    with pytest.raises(AnalysisFileError, match="is not a pickle") as info:
        load_sensitivities(path)
    assert str(path) in str(info.value)
    assert reason in str(info.value)


def test_a_directory_in_place_of_the_file_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "s.pkl").mkdir()
    with pytest.raises(AnalysisFileError, match="cannot be read"):
        load_sensitivities(tmp_path / "s.pkl")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([("w", {0.1: 0.2})], "the top level is a list, not a dict"),
        ({"ok": {0.1: 0.2}, b"w": {0.1: 0.2}}, "key b'w' is a bytes, not a parameter name string"),
        ({"ok": {0.1: 0.2}, "w": [0.1, 0.2]}, "entry 'w' is a list, not a {ratio: loss} dict"),
        ({"w": {"0.1": 0.2}}, "entry 'w' has ratio '0.1', which is not a finite number"),
        ({"w": {float("inf"): 0.2}}, "entry 'w' has ratio inf"),
        ({"w": {0.1: 0.2, 0.2: "0.3"}}, "entry 'w' at ratio 0.2 has loss '0.3', which is not a finite number"),
        ({"w": {0.1: float("nan")}}, "entry 'w' at ratio 0.1 has loss nan"),
        ({"w": {0.1: float("-inf")}}, "entry 'w' at ratio 0.1 has loss -inf"),
        ({"w": {0.1: None}}, "entry 'w' at ratio 0.1 has loss None"),
        ({"w": {True: 0.1}}, "entry 'w' has ratio True"),
        ({"w": {0.1: False}}, "entry 'w' at ratio 0.1 has loss False"),
    ],
)
def test_wrong_structure_names_the_first_bad_entry(tmp_path: Path, data: object, expected: str) -> None:
    path = write_pickle(tmp_path / "s.pkl", data)
    with pytest.raises(AnalysisFileError, match="has the wrong structure") as info:
        load_sensitivities(path)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_ratios_that_collide_after_normalising_keep_the_later_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_pickle(tmp_path / "s.pkl", {"w": {0.3: 0.1, 0.30000000000000004: 0.2}})
    assert load_sensitivities(path) == {"w": {0.3: 0.2}}
    assert "round to 0.3" in caplog.text


# ------------------------------------------------------------------------------------------------- atomic writes


def test_atomic_writes_leave_only_the_target(tmp_path: Path) -> None:
    atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic_write_text(tmp_path / "b.txt", "é\nline\r\n")
    save_sensitivities(tmp_path / "s.pkl", {"w": {0.1: 0.2}})
    save_sidecar(tmp_path / "s.pkl", {"k": 1})
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "é\nline\r\n".encode()
    assert leftovers(tmp_path, {"a.bin", "b.txt", "s.pkl", "s.pkl.json"}) == []


def test_atomic_write_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert leftovers(tmp_path, {"f.txt"}) == []


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_failed_write_keeps_the_previous_file_and_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"w": {0.1: 0.2}})
    before = path.read_bytes()

    def boom(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(results.os, failing, boom)
    with pytest.raises(OutputError, match=r"Cannot write .*s\.pkl: disk full; choose a writable location"):
        save_sensitivities(path, {"w": {0.1: 0.9}, "x": {0.5: 0.5}})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert leftovers(tmp_path, {"s.pkl"}) == []


def test_unserialisable_data_fails_before_touching_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_sensitivities(path, {"w": {0.1: 0.2}})
    before = path.read_bytes()
    with pytest.raises(ValueError):
        save_sensitivities(path, {"w": {0.1: object()}})  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert leftovers(tmp_path, {"s.pkl"}) == []


# ------------------------------------------------------------------------------------------------------- merging


def test_merge_later_sources_win_and_order_is_first_appearance(tmp_path: Path) -> None:
    first = tmp_path / "first.pkl"
    save_sensitivities(first, {"b.weight": {0.2: 0.02, 0.1: 0.01}, "a.weight": {0.1: 0.1}})
    second = {"c.weight": {0.1: 0.3}, "b.weight": {0.2: 0.5, 0.30000000000000004: 0.6}}
    merged = merge_sensitive([first, second, str(first.with_name("missing.pkl"))])
    assert merged == {"b.weight": {0.1: 0.01, 0.2: 0.5, 0.3: 0.6}, "a.weight": {0.1: 0.1}, "c.weight": {0.1: 0.3}}
    assert list(merged) == ["b.weight", "a.weight", "c.weight"]
    assert list(merged["b.weight"]) == [0.1, 0.2, 0.3]
    # Reversing the sources reverses who wins on the shared (param, ratio).
    assert merge_sensitive([second, str(first)])["b.weight"][0.2] == 0.02


def test_merge_does_not_modify_its_inputs() -> None:
    source = {"w": {0.2: 0.2, 0.1: 0.1}}
    merged = merge_sensitive([source, {"w": {0.1: 0.5}}])
    assert merged == {"w": {0.1: 0.5, 0.2: 0.2}}
    assert source == {"w": {0.2: 0.2, 0.1: 0.1}}


def test_merge_needs_a_non_empty_sequence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one source"):
        merge_sensitive([])
    with pytest.raises(TypeError, match="sequence of sources"):
        merge_sensitive(str(tmp_path / "s.pkl"))


def test_merge_reports_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pkl"
    bad.write_text("not a pickle")
    with pytest.raises(AnalysisFileError, match=r"bad\.pkl is not a pickle"):
        merge_sensitive([{"w": {0.1: 0.1}}, bad])


# ------------------------------------------------------------------------------------------------------- sidecar


def test_sidecar_round_trip_is_strict_utf8_json_with_trailing_newline(tmp_path: Path) -> None:
    analysis = tmp_path / "s.pkl"
    data = {"baseline": {"top1": 0.75, "top5": 0.9}, "groups": [["a.weight", "b.weight"]], "note": "µ-net"}
    save_sidecar(analysis, data)
    text = (tmp_path / "s.pkl.json").read_bytes().decode("utf-8")
    assert text.endswith("}\n")
    assert '\n  "baseline": {\n    "top1": 0.75' in text
    assert "µ-net" in text
    assert load_sidecar(analysis) == data


def test_missing_sidecar_is_none(tmp_path: Path) -> None:
    assert load_sidecar(tmp_path / "s.pkl") is None


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"a": 1,', "is not valid JSON (Expecting"),
        (b'{"a": NaN}', "is not valid JSON (NaN is not a JSON number)"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b'"text"', "holds a JSON str, not an object"),
        (b'{"a": "\xff"}', "is not UTF-8 text"),
    ],
)
def test_malformed_sidecar_is_a_user_error_naming_the_file(tmp_path: Path, content: bytes, expected: str) -> None:
    (tmp_path / "s.pkl.json").write_bytes(content)
    with pytest.raises(AnalysisFileError, match=r"s\.pkl\.json") as info:
        load_sidecar(tmp_path / "s.pkl")
    assert expected in str(info.value)


def test_sidecar_refuses_nan_as_a_programming_error(tmp_path: Path) -> None:
    # NaN in the sidecar data is a bug in the caller (metrics are finite), so it is a ValueError, not a user error.
    with pytest.raises(ValueError, match="Out of range float"):
        save_sidecar(tmp_path / "s.pkl", {"top1": float("nan")})
    assert not (tmp_path / "s.pkl.json").exists()
    assert leftovers(tmp_path, set()) == []


def test_sidecar_is_replaced_atomically(tmp_path: Path) -> None:
    save_sidecar(tmp_path / "s.pkl", {"run": 1})
    save_sidecar(tmp_path / "s.pkl", {"run": 2})
    assert json.loads((tmp_path / "s.pkl.json").read_text()) == {"run": 2}
    assert leftovers(tmp_path, {"s.pkl.json"}) == []


def analysed_file(directory: Path, with_cost: bool = True) -> Path:
    """A two-conv analysis file whose second conv lacks ratio 0.4, with a sidecar in the engine's format."""
    path = directory / "s.pkl"
    save_sensitivities(path, {"b.weight": {0.2: 0.1, 0.4: 0.3}, "a.weight": {0.2: -0.05}})

    def variant(loss: float, top1: float, macs: int) -> dict:
        cost = {"macs": macs, "params": macs // 10, "macs_reduction": 1 - macs / 1000, "params_reduction": 0.5}
        return {"loss": loss, "top1": top1, "top5": 1.0, "ce": 0.7, "images": 50, **(cost if with_cost else {})}

    sidecar = {
        "fingerprint": {"settings": {"metric": "top1"}},
        "baseline": {"top1": 0.8, "top5": 1.0, "ce": 0.5, "images": 50},
        "params": {
            "b.weight": {"variants": {"0.2": variant(0.1, 0.72, 900), "0.4": variant(0.3, 0.56, 700)}},
            "a.weight": {"variants": {"0.2": variant(-0.05, 0.84, 950)}},
        },
    }
    if with_cost:
        sidecar["cost"] = {"convention": "MACs", "macs": 1000, "params": 100}
    save_sidecar(path, sidecar)
    return path


def read_rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_wide_csv_is_nni_format_with_metric_values(tmp_path: Path) -> None:
    written = export_csv(analysed_file(tmp_path), style="wide")
    assert written == csv_path(tmp_path / "s.pkl", "wide") == tmp_path / "s.wide.csv"
    # the file's (model) order, module names, metric values; a ratio the conv lacks stays empty
    assert read_rows(written) == [["layername", "0.2", "0.4"], ["b", "0.72", "0.56"], ["a", "0.84", ""]]


def test_long_csv_is_distiller_format_plus_relative_loss_and_macs(tmp_path: Path) -> None:
    rows = read_rows(export_csv(analysed_file(tmp_path), tmp_path / "long.csv", style="long"))
    assert rows[0] == ["parameter", "sparsity", "top1", "top5", "loss", "relative_loss", "macs", "params",
                       "macs_reduction", "params_reduction"]  # fmt: skip
    assert rows[1] == ["b.weight", "0.0", "80.0", "100.0", "0.5", "0.0", "1000", "100", "0.0", "0.0"]  # baseline
    assert rows[3] == ["b.weight", "0.4", "56.0", "100.0", "0.7", "0.3", "700", "70", "0.30000000000000004", "0.5"]
    assert [row[:2] for row in rows[1:]] == [["b.weight", "0.0"], ["b.weight", "0.2"], ["b.weight", "0.4"],
                                             ["a.weight", "0.0"], ["a.weight", "0.2"]]  # fmt: skip
    assert rows[5][5] == "-0.05"  # the analysis file's number, negative losses kept


def test_csv_without_costs_or_sidecar(tmp_path: Path) -> None:
    path = analysed_file(tmp_path, with_cost=False)
    assert read_rows(export_csv(path, style="long"))[1][6:] == ["", "", "", ""]
    sidecar_path(path).unlink()
    rows = read_rows(export_csv(path, style="long"))
    assert rows[2] == ["b.weight", "0.2", "", "", "", "0.1", "", "", "", ""]
    with pytest.raises(AnalysisFileError, match=r"s.pkl.json.*export style='long' instead"):
        export_csv(path, style="wide")
    with pytest.raises(ValueError, match="style must be one of"):
        export_csv(path, style="tall")


def test_csv_export_is_byte_stable(tmp_path: Path) -> None:
    path = analysed_file(tmp_path)
    first = export_csv(path, tmp_path / "one.csv", style="long").read_bytes()
    assert export_csv(path, tmp_path / "two.csv", style="long").read_bytes() == first
    assert b"\r" not in first and first.endswith(b"\n")

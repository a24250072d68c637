"""Shards: deterministic balanced splits, and merged shards byte-identical to one uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.errors import ConfigError
from analysis.io.results import load_sensitivities, load_sidecar
from analysis.scale.shards import ShardSpec, assign, downstream_macs

from helpers import CliResult, analysis_config, assert_user_error


def test_shard_spec_parsing_and_paths() -> None:
    assert ShardSpec.parse(" 2/4 ") == ShardSpec(2, 4)
    assert ShardSpec(2, 4).path("out/s.pkl") == Path("out/s.shard2of4.pkl")
    for bad in ("0/4", "5/4", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match=r"--shard must be I/N with 1 <= I <= N"):
            ShardSpec.parse(bad)


def test_assign_balances_costs_deterministically() -> None:
    costs = [("a", 7.0), ("b", 5.0), ("c", 4.0), ("d", 3.0), ("e", 3.0), ("f", 2.0)]
    shards = assign(costs, 2)
    assert sorted(name for shard in shards for name in shard) == list("abcdef")  # each exactly once
    loads = [sum(dict(costs)[n] for n in shard) for shard in shards]
    assert sorted(loads) == [12.0, 12.0]  # LPT finds the even split here
    assert shards == assign(costs, 2) and all(shard == sorted(shard) for shard in shards)  # input order kept
    assert assign(costs, 8)[6:] == [[], []]  # more shards than params: some are empty


def test_downstream_macs_accumulates_from_the_end() -> None:
    macs = {"conv1": 10, "conv2": 20, "conv3": 30, "fc": 5}
    assert downstream_macs(["conv1", "conv2", "conv3"], macs) == {"conv3": 35, "conv2": 55, "conv1": 65}


def test_merged_shards_equal_one_run_and_mismatches_are_refused(cli: object, tmp_path: Path, list_data: Path) -> None:
    run = cli  # type: ignore[assignment]
    analysis = {"pruned_ratios": [0.25, 0.5, 0.75]}
    path = analysis_config(tmp_path, list_data, "slow_cnn", analysis, arch_kwargs={"delay": 0.0})
    whole = tmp_path / "whole.pkl"
    assert run("--config_path", path, "--analysis_file", whole, "--quiet", "--no_report").code == 0
    shard_files = []
    for index in (1, 2):
        result: CliResult = run("--config_path", path, "--shard", f"{index}/2", "--quiet")
        assert result.code == 0, result.err
        shard_files.append(tmp_path / "out" / f"s.shard{index}of2.pkl")
        assert f"python run.py merge {tmp_path / 'out' / 's.pkl'}" in result.out
    first, second = (load_sensitivities(p) for p in shard_files)
    assert first and second and not set(first) & set(second)  # disjoint, non-empty shares
    assert not (tmp_path / "out" / "s.pkl").exists()  # shards never write the main file
    merged = tmp_path / "merged.pkl"
    result = run("merge", merged, *reversed(shard_files))  # input order does not matter for disjoint shards
    assert result.code == 0, result.err
    assert merged.read_bytes() == whole.read_bytes()
    timeless = [{k: v for k, v in load_sidecar(p)["baseline"].items() if k != "seconds"} for p in (merged, whole)]
    assert timeless[0] == timeless[1]

    other = analysis_config(tmp_path, list_data, "slow_cnn", {**analysis, "metric": "top5"}, arch_kwargs={"delay": 0.0})
    assert run("--config_path", other, "--analysis_file", tmp_path / "top5.pkl", "--quiet", "--no_report").code == 0
    before = merged.read_bytes()
    refused = run("merge", merged, shard_files[0], tmp_path / "top5.pkl")
    assert_user_error(refused, r"top5.pkl was computed on another model, other data or with other settings")
    assert merged.read_bytes() == before


def test_merge_later_files_win(cli: object, tmp_path: Path) -> None:
    from analysis.io.results import save_sensitivities

    save_sensitivities(tmp_path / "a.pkl", {"x.weight": {0.1: 0.5, 0.2: 0.6}})
    save_sensitivities(tmp_path / "b.pkl", {"x.weight": {0.2: 0.9}, "y.weight": {0.1: 0.0}})
    result = cli("merge", tmp_path / "m.pkl", tmp_path / "a.pkl", tmp_path / "b.pkl")  # type: ignore[operator]
    assert result.code == 0, result.err
    assert load_sensitivities(tmp_path / "m.pkl") == {"x.weight": {0.1: 0.5, 0.2: 0.9}, "y.weight": {0.1: 0.0}}
    assert "has no sidecar" in result.err

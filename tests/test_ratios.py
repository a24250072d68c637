"""Per-layer ratios from sensitivities (PaddleSlim's rule, hand-computed goldens) and the ChannelPrune YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analysis.io.ratios_yaml import channel_prune_yaml, save_ratios_yaml
from analysis.planning.ratios import get_ratios_by_loss
from analysis.text import explain_target_loss

# --------------------------------------------------------------------------------------------- get_ratios_by_loss


def test_monotone_curve_interpolates_between_the_bracketing_ratios() -> None:
    curve = {0.1: 0.01, 0.2: 0.02, 0.3: 0.04, 0.4: 0.08}
    # Scanning down: 0.4 (0.08) and 0.3 (0.04) exceed 0.03; 0.2 (0.02) qualifies.
    # 0.2 + (0.03 - 0.02) * (0.3 - 0.2) / (0.04 - 0.02) = 0.2 + 0.01 * 0.1 / 0.02 = 0.2 + 0.05 = 0.25
    assert get_ratios_by_loss({"w": curve}, 0.03) == {"w": pytest.approx(0.25)}


def test_non_monotone_curve_uses_the_first_qualifying_point_from_the_top() -> None:
    curve = {0.1: 0.01, 0.2: 0.05, 0.3: 0.02, 0.4: 0.2}
    # Scanning down: 0.4 (0.2) fails, 0.3 (0.02) qualifies, although 0.2 (0.05) would not have.
    # 0.3 + (0.03 - 0.02) * (0.4 - 0.3) / (0.2 - 0.02) = 0.3 + 0.01 * 0.1 / 0.18 = 0.3 + 0.00555... = 0.305556
    result = get_ratios_by_loss({"w": curve}, 0.03)
    assert result["w"] == pytest.approx(0.3 + 0.001 / 0.18)
    assert result["w"] == pytest.approx(0.305556, abs=1e-6)


def test_no_qualifying_ratio_gives_zero() -> None:
    # Every loss (0.05, 0.1) exceeds 0.02, so the layer is not pruned.
    result = get_ratios_by_loss({"w": {0.1: 0.05, 0.2: 0.1}}, 0.02)
    assert result == {"w": 0.0}
    assert type(result["w"]) is float


def test_largest_ratio_qualifying_returns_it_without_interpolation() -> None:
    # 0.4 has loss 0.015 <= 0.02, and it is the largest measured ratio: the answer is 0.4 itself.
    result = get_ratios_by_loss({"w": {0.1: 0.001, 0.2: 0.05, 0.4: 0.015}}, 0.02)
    assert result == {"w": 0.4}


def test_loss_equal_to_the_target_qualifies() -> None:
    curve = {0.1: 0.01, 0.2: 0.02, 0.3: 0.06}
    # 0.2 has loss exactly 0.02 (<= holds): 0.2 + (0.02 - 0.02) * ... = 0.2
    assert get_ratios_by_loss({"w": curve}, 0.02) == {"w": pytest.approx(0.2)}
    # The largest ratio with loss exactly at the target is returned as is.
    assert get_ratios_by_loss({"w": curve}, 0.06) == {"w": 0.3}
    # Where equality decides the outcome: the smallest ratio at exactly the target is kept (not 0.0) ...
    assert get_ratios_by_loss({"w": {0.1: 0.02, 0.2: 0.05}}, 0.02) == {"w": pytest.approx(0.1)}
    # ... and on a non-monotone curve 0.3 (loss 0.02) wins: 0.3 + (0.02 - 0.02) * ... = 0.3; with a strict
    # comparison the scan would fall through to 0.1 and give 0.1 + 0.02 * 0.1 / 0.05 = 0.14 instead.
    assert get_ratios_by_loss({"w": {0.1: 0.0, 0.2: 0.05, 0.3: 0.02, 0.4: 0.1}}, 0.02) == {"w": pytest.approx(0.3)}


def test_negative_losses_count_as_within_target() -> None:
    curve = {0.1: -0.02, 0.2: -0.01, 0.3: 0.03}
    # 0.3 (0.03) fails, 0.2 (-0.01) qualifies:
    # 0.2 + (0.01 - (-0.01)) * (0.3 - 0.2) / (0.03 - (-0.01)) = 0.2 + 0.02 * 0.1 / 0.04 = 0.2 + 0.05 = 0.25
    assert get_ratios_by_loss({"w": curve}, 0.01) == {"w": pytest.approx(0.25)}
    # A negative target: only -0.02 at 0.1 qualifies for -0.015:
    # 0.1 + (-0.015 - (-0.02)) * (0.2 - 0.1) / (-0.01 - (-0.02)) = 0.1 + 0.005 * 0.1 / 0.01 = 0.1 + 0.05 = 0.15
    assert get_ratios_by_loss({"w": curve}, -0.015) == {"w": pytest.approx(0.15)}


def test_unsorted_ratio_order_in_the_input_gives_the_same_answer() -> None:
    # Same curve as the monotone test, inserted in a scrambled order: 0.25 again.
    curve = {0.3: 0.04, 0.1: 0.01, 0.4: 0.08, 0.2: 0.02}
    assert get_ratios_by_loss({"w": curve}, 0.03) == {"w": pytest.approx(0.25)}


def test_params_keep_input_order_and_empty_params_are_left_out() -> None:
    sensitivities = {
        "z.weight": {0.1: 0.5},  # nothing qualifies -> 0.0
        "empty.weight": {},  # no points -> left out
        "a.weight": {0.1: 0.0, 0.2: 0.04},  # 0.1 + (0.02 - 0.0) * 0.1 / 0.04 = 0.1 + 0.05 = 0.15
    }
    result = get_ratios_by_loss(sensitivities, 0.02)
    assert list(result) == ["z.weight", "a.weight"]
    assert result == {"z.weight": 0.0, "a.weight": pytest.approx(0.15)}


def test_non_finite_target_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        get_ratios_by_loss({"w": {0.1: 0.0}}, float("nan"))


def test_explain_target_loss_states_the_percentage_and_the_caveat() -> None:
    line = explain_target_loss(0.02)
    assert line.startswith("target_loss 0.02: ")
    assert "<= 2.0%" in line
    assert "not additive" in line
    assert "\n" not in line
    assert "<= 1.25%" in explain_target_loss(0.0125)
    assert "<= 0.5%" in explain_target_loss(0.005)


# ----------------------------------------------------------------------------------------------- ChannelPrune YAML


def test_channel_prune_yaml_follows_model_order_and_round_trips() -> None:
    ratios = {"extra.weight": 0.1, "conv2.weight": 0.123456789, "conv1.weight": 0.3}
    text = channel_prune_yaml(ratios, ["conv1.weight", "missing.weight", "conv2.weight"], "l1_norm", 0.02)
    block = yaml.safe_load(text)["ChannelPrune"]
    # Model order first (names absent from ratios are skipped), then names missing from the order.
    assert block == {
        "criterion": "l1_norm",
        "prune_params_name": ["conv1.weight", "conv2.weight", "extra.weight"],
        "pruned_ratio": [0.3, 0.123457, 0.1],
    }
    assert list(block) == ["criterion", "prune_params_name", "pruned_ratio"]


def test_channel_prune_yaml_header_and_unpruned_params() -> None:
    ratios = {"a.weight": 0.0, "b.weight": 0.25, "c.weight": 0.0}
    text = channel_prune_yaml(ratios, ["c.weight", "b.weight", "a.weight"], "l2_norm", 0.01)
    lines = text.splitlines()
    assert lines[0].startswith("# ")
    assert "target_loss 0.01" in text.split("ChannelPrune:")[0]
    assert "not additive" in text
    assert "# not pruned (no ratio meets target_loss 0.01): c.weight, a.weight" in lines
    assert all(len(line) <= 120 for line in lines)
    block = yaml.safe_load(text)["ChannelPrune"]
    assert block["prune_params_name"] == ["b.weight"]
    assert block["pruned_ratio"] == [0.25]
    assert block["criterion"] == "l2_norm"


def test_channel_prune_yaml_with_nothing_to_prune_has_empty_lists() -> None:
    text = channel_prune_yaml({"a.weight": 0.0}, ["a.weight"], "l1_norm")
    block = yaml.safe_load(text)["ChannelPrune"]
    assert block["prune_params_name"] == []
    assert block["pruned_ratio"] == []
    assert "# not pruned (ratio 0.0): a.weight" in text.splitlines()


def test_channel_prune_yaml_quotes_awkward_names() -> None:
    ratios = {"yes": 0.2, "1.0": 0.3, "a: b": 0.4}
    block = yaml.safe_load(channel_prune_yaml(ratios, [], "l1_norm", 0.05))["ChannelPrune"]
    assert block["prune_params_name"] == ["yes", "1.0", "a: b"]
    assert block["pruned_ratio"] == [0.2, 0.3, 0.4]


def test_long_unpruned_lists_wrap_as_comments(tmp_path: Path) -> None:
    names = [f"features.{i}.block.conv.weight" for i in range(30)]
    text = channel_prune_yaml(dict.fromkeys(names, 0.0), names, "l1_norm", 0.001)
    comment = [line for line in text.splitlines() if line.startswith("#")]
    assert len(comment) > 3
    assert all(len(line) <= 120 for line in comment)
    assert yaml.safe_load(text)["ChannelPrune"]["prune_params_name"] == []


def test_ratios_from_the_rule_end_up_in_the_yaml(tmp_path: Path) -> None:
    sensitivities = {"b.weight": {0.1: 0.01, 0.2: 0.03}, "a.weight": {0.1: 0.5}}
    # b: 0.1 + (0.02 - 0.01) * 0.1 / (0.03 - 0.01) = 0.1 + 0.05 = 0.15; a: nothing qualifies -> 0.0
    ratios = get_ratios_by_loss(sensitivities, 0.02)
    path = tmp_path / "out" / "s.pkl.ratios.yaml"
    save_ratios_yaml(path, ratios, ["a.weight", "b.weight"], "l1_norm", 0.02)
    text = path.read_text(encoding="utf-8")
    assert text == channel_prune_yaml(ratios, ["a.weight", "b.weight"], "l1_norm", 0.02)
    assert yaml.safe_load(text)["ChannelPrune"]["pruned_ratio"] == [0.15]
    assert "a.weight" in text.split("ChannelPrune:")[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.pkl.ratios.yaml"]

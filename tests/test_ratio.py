"""The one ratio rule: the range a ratio may lie in and the key it is stored under, shared by every reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from analysis.config import normalise_ratios
from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.ratios_yaml import load_ratios_yaml
from analysis.ratio import RATIO_DECIMALS, normalise_ratio, ratio_problem


def test_equal_ratios_written_differently_are_one_key() -> None:
    assert normalise_ratio(0.1 + 0.2) == normalise_ratio(0.3) == 0.3
    assert normalise_ratios([0.30000000000000004, 0.3, 0.1], "k") == [0.1, 0.3]


@pytest.mark.parametrize(
    ("value", "zero_allowed", "usable"),
    [
        (0.5, False, True),
        (0.0, False, False),
        (0.0, True, True),
        (1.0, True, False),
        (-0.1, True, False),
        (math.nan, True, False),
        (10 ** -(RATIO_DECIMALS + 1), False, False),  # rounds to 0 when stored
        (1 - 10 ** -(RATIO_DECIMALS + 1), True, False),  # rounds to 1 when stored
    ],
)
def test_the_rule_says_which_values_are_ratios(value: float, zero_allowed: bool, usable: bool) -> None:
    assert (ratio_problem(value, zero_allowed=zero_allowed) is None) is usable


def test_the_config_and_a_ratios_file_refuse_by_the_same_rule(tmp_path: Path) -> None:
    almost_one = 1 - 10 ** -(RATIO_DECIMALS + 1)
    with pytest.raises(ConfigError, match=r"rounds to 1\.0"):
        normalise_ratios([almost_one], "SensitivityAnalysis.pruned_ratios")
    path = tmp_path / "ratios.yaml"
    path.write_text(yaml.safe_dump({"ChannelPrune": {"prune_params_name": ["a.weight"], "pruned_ratio": [almost_one]}}))
    with pytest.raises(AnalysisFileError, match=r"rounds to 1\.0"):
        load_ratios_yaml(path)

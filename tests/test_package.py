"""The package's shape: ``import analysis`` stays cheap, and every public name resolves from its subpackage."""

from __future__ import annotations

import subprocess
import sys

import pytest

import analysis

HEAVY = ("torch", "torchvision", "torch_pruning", "matplotlib", "timm")


def imported_after(statement: str) -> set[str]:
    """The heavy top-level modules loaded by ``statement`` in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(result.stdout.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import analysis",
        "import analysis.config",
        "import analysis.errors",
        "from analysis.io.results import load_sensitivities, save_sensitivities",
        "from analysis.planning.ratios import get_ratios_by_loss",
        "from analysis import get_ratios_by_loss, load_config, load_sensitivities",
    ],
)
def test_reading_files_and_configs_loads_no_torch(statement: str) -> None:
    assert imported_after(statement) == set()


def test_a_name_that_needs_torch_loads_it_on_first_use() -> None:
    assert imported_after("from analysis import SensitivityAnalysis") >= {"torch", "torch_pruning"}


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    import importlib

    exported = analysis._EXPORTS
    assert sorted(analysis.__all__) == sorted([*exported, "__version__"])
    for name, module in exported.items():
        value = getattr(analysis, name)
        assert value is getattr(importlib.import_module(module), name), name
    assert set(exported) <= set(dir(analysis))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = analysis.no_such_name  # type: ignore[attr-defined]

"""Exact, dependency-aware structured-pruning sensitivity analysis for PyTorch CNNs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prune-sensitivity")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

from analysis.api import analysis_prune
from analysis.config import Config, load_config
from analysis.data import build_eval_loader
from analysis.errors import AnalysisFileError, ConfigError, DataError, ModelError, UserError
from analysis.evaluate import EvalResult, evaluate
from analysis.flops import CostModel, count_cost
from analysis.groups import PrunableParam, dependency_sets, find_prunable, not_safe_to_prune
from analysis.models import build_model
from analysis.ratios import get_ratios_by_loss
from analysis.results import export_csv, load_sensitivities, merge_sensitive, save_sensitivities


def __getattr__(name: str) -> object:
    """``write_report`` is imported on first use: it needs matplotlib, which the analysis itself does not."""
    if name == "write_report":
        from analysis.report import write_report

        return write_report
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")


__all__ = [
    "AnalysisFileError",
    "Config",
    "ConfigError",
    "CostModel",
    "DataError",
    "EvalResult",
    "ModelError",
    "PrunableParam",
    "UserError",
    "__version__",
    "analysis_prune",
    "build_eval_loader",
    "build_model",
    "count_cost",
    "dependency_sets",
    "evaluate",
    "export_csv",
    "find_prunable",
    "get_ratios_by_loss",
    "load_config",
    "load_sensitivities",
    "merge_sensitive",
    "not_safe_to_prune",
    "save_sensitivities",
    "write_report",
]

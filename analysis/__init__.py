"""Exact, dependency-aware structured-pruning sensitivity analysis for PyTorch CNNs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prune-sensitivity")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

from analysis.api import analysis_prune
from analysis.compat import SensitivityAnalysis
from analysis.config import Config, load_config
from analysis.counter import count_flops_params
from analysis.data import build_eval_loader
from analysis.errors import AnalysisFileError, ConfigError, DataError, ModelError, UserError
from analysis.evaluate import EvalResult, evaluate
from analysis.export import export_pruned, load_pruned
from analysis.flops import CostModel, count_cost
from analysis.groups import PrunableParam, find_prunable
from analysis.mask_conflict import fix_mask_conflict
from analysis.models import build_model
from analysis.plan import Plan, build_plan, plan_from_ratios
from analysis.ratios import get_ratios_by_loss
from analysis.results import export_csv, load_sensitivities, merge_sensitive, save_sensitivities
from analysis.topology import ChannelDependency, dependency_sets, not_safe_to_prune
from analysis.verify import verify_plan


def __getattr__(name: str) -> object:
    """``write_report`` is imported on first use: it needs matplotlib, which the analysis itself does not."""
    if name == "write_report":
        from analysis.report import write_report

        return write_report
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")


__all__ = [
    "AnalysisFileError",
    "ChannelDependency",
    "Config",
    "ConfigError",
    "CostModel",
    "DataError",
    "EvalResult",
    "ModelError",
    "Plan",
    "PrunableParam",
    "SensitivityAnalysis",
    "UserError",
    "__version__",
    "analysis_prune",
    "build_eval_loader",
    "build_model",
    "build_plan",
    "count_cost",
    "count_flops_params",
    "dependency_sets",
    "evaluate",
    "export_csv",
    "export_pruned",
    "find_prunable",
    "fix_mask_conflict",
    "get_ratios_by_loss",
    "load_config",
    "load_pruned",
    "load_sensitivities",
    "merge_sensitive",
    "not_safe_to_prune",
    "plan_from_ratios",
    "save_sensitivities",
    "verify_plan",
    "write_report",
]

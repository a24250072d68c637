"""Exact, dependency-aware structured-pruning sensitivity analysis for PyTorch CNNs.

``import analysis`` is cheap: the public names below are imported from their subpackage on first use (PEP 562), so
a script that only reads an analysis file or a config never loads torch, torchvision or Torch-Pruning.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("prune-sensitivity")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

# public name -> module that defines it
_EXPORTS = {
    "AnalysisFileError": "analysis.errors",
    "ChannelDependency": "analysis.compat.topology",
    "Config": "analysis.config",
    "ConfigError": "analysis.errors",
    "CostModel": "analysis.structure.flops",
    "DataError": "analysis.errors",
    "EvalResult": "analysis.engine.evaluate",
    "ModelError": "analysis.errors",
    "Plan": "analysis.planning.plan",
    "PrunableUnit": "analysis.structure.groups",
    "SensitivityAnalysis": "analysis.compat.nni",
    "UserError": "analysis.errors",
    "analysis_prune": "analysis.compat.paddleslim",
    "build_eval_loader": "analysis.inputs.data",
    "build_model": "analysis.inputs.models",
    "build_plan": "analysis.planning.plan",
    "count_cost": "analysis.structure.flops",
    "count_flops_params": "analysis.compat.counter",
    "dependency_sets": "analysis.compat.topology",
    "derive": "analysis.config",
    "evaluate": "analysis.engine.evaluate",
    "export_csv": "analysis.io.tables",
    "export_pruned": "analysis.planning.export",
    "find_prunable": "analysis.structure.groups",
    "fix_mask_conflict": "analysis.compat.mask_conflict",
    "get_ratios_by_loss": "analysis.planning.ratios",
    "load_config": "analysis.config",
    "load_pruned": "analysis.planning.export",
    "load_sensitivities": "analysis.io.results",
    "main": "analysis.cli.main",
    "merge_sensitive": "analysis.io.results",
    "not_safe_to_prune": "analysis.compat.topology",
    "plan_from_ratios": "analysis.planning.plan",
    "run_compress": "analysis.workflow.compress",
    "run_plan_step": "analysis.workflow.plan",
    "save_sensitivities": "analysis.io.results",
    "verify_plan": "analysis.planning.verify",
    "write_report": "analysis.reporting.report",
}

if TYPE_CHECKING:
    from analysis.cli.main import main
    from analysis.compat.counter import count_flops_params
    from analysis.compat.mask_conflict import fix_mask_conflict
    from analysis.compat.nni import SensitivityAnalysis
    from analysis.compat.paddleslim import analysis_prune
    from analysis.compat.topology import ChannelDependency, dependency_sets, not_safe_to_prune
    from analysis.config import Config, derive, load_config
    from analysis.engine.evaluate import EvalResult, evaluate
    from analysis.errors import AnalysisFileError, ConfigError, DataError, ModelError, UserError
    from analysis.inputs.data import build_eval_loader
    from analysis.inputs.models import build_model
    from analysis.io.results import load_sensitivities, merge_sensitive, save_sensitivities
    from analysis.io.tables import export_csv
    from analysis.planning.export import export_pruned, load_pruned
    from analysis.planning.plan import Plan, build_plan, plan_from_ratios
    from analysis.planning.ratios import get_ratios_by_loss
    from analysis.planning.verify import verify_plan
    from analysis.reporting.report import write_report
    from analysis.structure.flops import CostModel, count_cost
    from analysis.structure.groups import PrunableUnit, find_prunable
    from analysis.workflow.compress import run_compress
    from analysis.workflow.plan import run_plan_step


def __getattr__(name: str) -> object:
    """Import a public name from its module on first use and keep it."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
    "PrunableUnit",
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
    "derive",
    "evaluate",
    "export_csv",
    "export_pruned",
    "find_prunable",
    "fix_mask_conflict",
    "get_ratios_by_loss",
    "load_config",
    "load_pruned",
    "load_sensitivities",
    "main",
    "merge_sensitive",
    "not_safe_to_prune",
    "plan_from_ratios",
    "run_compress",
    "run_plan_step",
    "save_sensitivities",
    "verify_plan",
    "write_report",
]

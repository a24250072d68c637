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
from analysis.groups import PrunableParam, find_prunable
from analysis.models import build_model
from analysis.ratios import get_ratios_by_loss
from analysis.results import load_sensitivities, merge_sensitive, save_sensitivities

__all__ = [
    "AnalysisFileError",
    "Config",
    "ConfigError",
    "DataError",
    "EvalResult",
    "ModelError",
    "PrunableParam",
    "UserError",
    "__version__",
    "analysis_prune",
    "build_eval_loader",
    "build_model",
    "evaluate",
    "find_prunable",
    "get_ratios_by_loss",
    "load_config",
    "load_sensitivities",
    "merge_sensitive",
    "save_sensitivities",
]

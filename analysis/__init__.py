"""Exact, dependency-aware structured-pruning sensitivity analysis for PyTorch CNNs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prune-sensitivity")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

from analysis.config import Config, load_config
from analysis.data import build_eval_loader
from analysis.errors import ConfigError, DataError, ModelError, UserError
from analysis.evaluate import EvalResult, evaluate
from analysis.models import build_model

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "EvalResult",
    "ModelError",
    "UserError",
    "__version__",
    "build_eval_loader",
    "build_model",
    "evaluate",
    "load_config",
]

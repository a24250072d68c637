"""The command line: the main job, the report/merge/deps/plan/verify subcommands, the registry that dispatches to
them (:mod:`analysis.cli.registry`), the reference page rendered from it (:mod:`analysis.cli.reference`), and
logging."""

from analysis.cli.main import main

__all__ = ["main"]

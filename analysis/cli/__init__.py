"""The command line: the main job, the report/merge/deps/plan/verify subcommands, and logging."""

from analysis.cli.main import main

__all__ = ["main"]

"""MkDocs hook: fills the generated reference pages at build time from the code, so they cannot drift from it.

A page holds a marker line such as ``<!-- generated: config-reference -->``; the marker is replaced by the Markdown
the package renders from its config schema or its argument parsers. A key or option without a description makes
the renderer raise, which fails the build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _config_reference() -> str:
    from analysis.config_reference import config_reference_markdown

    return config_reference_markdown()


def _cli_reference() -> str:
    from analysis.cli.reference import cli_reference_markdown

    return cli_reference_markdown()


GENERATORS: dict[str, Callable[[], str]] = {
    "<!-- generated: config-reference -->": _config_reference,
    "<!-- generated: cli-reference -->": _cli_reference,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every generator marker on the page with what its generator renders now."""
    for marker, render in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown

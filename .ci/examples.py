"""Run the command examples marked to run in README.md and docs/: a line ``<!-- ci:NAME -->`` right above a fenced
``bash`` or ``python`` block. ``test`` and ``demo`` are left out (.ci/run runs them first, to build the venv).

Usage, from the repository root: ``python .ci/examples.py`` runs them (bash blocks with ``bash -euo pipefail``,
Python blocks with ``.venv/bin/python``; the first failure stops the run with its exit code), ``--list`` lists them,
and ``--print NAME`` prints the README's block NAME (how .ci/run reads ``test`` and ``demo``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!-- ci:([\w-]+) -->$")
RUN_BY_CI_FIRST = {"test", "demo"}
INTERPRETERS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [".venv/bin/python", "-c"]}


@dataclass(frozen=True)
class Example:
    """One marked block: where it is, its language and its text."""

    name: str
    path: Path
    line: int
    language: str
    code: str


def examples(root: Path) -> list[Example]:
    """Every marked block of README.md and docs/**/*.md, in file order; a marker without a block is an error."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            match = MARKER.match(line.strip())
            if not match:
                continue
            fence = lines[number + 1] if number + 1 < len(lines) else ""
            language = fence.removeprefix("```").strip()
            if not fence.startswith("```") or language not in INTERPRETERS:
                sys.exit(f"{path}:{number + 1}: marker ci:{match[1]} is not followed by a ```bash or ```python block")
            end = next((i for i in range(number + 2, len(lines)) if lines[i].startswith("```")), None)
            if end is None:
                sys.exit(f"{path}:{number + 1}: the block of marker ci:{match[1]} is never closed with ```")
            code = "\n".join(lines[number + 2 : end])
            found.append(Example(match[1], path.relative_to(root), number + 1, language, code))
    return found


def main() -> int:
    root = Path.cwd()
    if "--print" in sys.argv:
        name = sys.argv[sys.argv.index("--print") + 1]
        block = [example for example in examples(root) if example.name == name and example.path == Path("README.md")]
        if not block:
            sys.exit(f"README.md has no <!-- ci:{name} --> command block")
        print(block[0].code)
        return 0
    chosen = [example for example in examples(root) if example.name not in RUN_BY_CI_FIRST]
    for example in chosen:
        if "--list" in sys.argv:
            print(f"{example.path}:{example.line} ci:{example.name} ({example.language})")
            continue
        print(f"CI [{example.name}] ({example.path}:{example.line}) $ {example.code}", flush=True)
        start = time.monotonic()
        returncode = subprocess.run([*INTERPRETERS[example.language], example.code], cwd=root).returncode
        if returncode != 0:
            print(f"CI: example ci:{example.name} of {example.path}:{example.line} failed (exit {returncode})")
            return returncode
        print(f"CI [{example.name}] passed in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The documentation's promises that the docs build alone does not check: the README stays short and keeps the CI
commands, its links resolve, no page describes a config key by hand, the API reference covers every public name, and
the command examples CI runs are well formed."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import analysis
from analysis.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def _examples_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_examples", ROOT / ".ci" / "examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_keeps_both_ci_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) < 15_000
    examples = {example.name: example for example in _examples_script().examples(ROOT)}
    assert "run.py --config_path configs/demo/" in examples["demo"].code
    assert '.venv/bin/pip install -e ".[test]"' in examples["test"].code and "pytest" in examples["test"].code
    assert examples["demo"].path == examples["test"].path == Path("README.md")  # .ci/run reads them from the README


def test_readme_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [target for target in targets if "://" not in target]
    assert any(target.startswith("docs/") for target in local)
    missing = [target for target in local if not (ROOT / target).exists()]
    assert missing == []


def test_no_page_describes_a_config_key_by_hand() -> None:
    # the configuration reference is generated from the schema; a hand-written table row of a key would drift from it
    keys = {f.name for schema in SECTIONS.values() for f in dataclasses.fields(schema)}
    rows = [
        f"{page.relative_to(ROOT)}: {line[:60]}"
        for page in PAGES
        for line in page.read_text(encoding="utf-8").splitlines()
        if (match := re.match(r"\|\s*`([\w.]+)`", line)) and match[1].split(".")[-1] in keys
    ]
    assert rows == []
    assert (DOCS / "reference" / "config.md").read_text().strip() == "<!-- generated: config-reference -->"


def test_api_reference_covers_every_public_name() -> None:
    documented = set(re.findall(r"^::: ([\w.]+)$", (DOCS / "reference" / "api.md").read_text(), flags=re.MULTILINE))
    exports = analysis._EXPORTS  # every public name but __version__ -> its defining module
    assert set(exports) == set(analysis.__all__) - {"__version__"}
    missing = sorted(name for name in exports if f"{exports[name]}.{name}" not in documented)
    assert missing == []
    for path in documented:  # every documented object exists where the page says
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), path


def test_marked_examples_are_well_formed() -> None:
    examples = _examples_script().examples(ROOT)
    names = [example.name for example in examples]
    assert len(names) == len(set(names))
    assert {"test", "demo", "docs", "python-example"} <= set(names)
    docs_build = next(example for example in examples if example.name == "docs")
    assert '-e ".[docs]"' in docs_build.code and "mkdocs build --strict" in docs_build.code
    for example in examples:
        if example.language == "python":
            compile(example.code, f"{example.path}:{example.line}", "exec")
        else:
            checked = subprocess.run(["bash", "-n", "-c", example.code], capture_output=True, text=True)
            assert checked.returncode == 0, f"{example.path}:{example.line}: {checked.stderr}"


def test_a_marker_without_a_block_is_refused(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- ci:broken -->\ntext, not a fenced block\n")
    with pytest.raises(SystemExit, match="ci:broken"):
        _examples_script().examples(tmp_path)


def test_a_block_never_closed_is_refused(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- ci:open -->\n```bash\necho never closed\n")
    with pytest.raises(SystemExit, match="ci:open is never closed"):
        _examples_script().examples(tmp_path)


def test_ci_reads_the_readme_commands_through_the_same_parser() -> None:
    # .ci/run takes the test and demo commands from `.ci/examples.py --print NAME`: what the test above checks is run
    printed = subprocess.run(["python3", ".ci/examples.py", "--print", "test"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert printed.strip() == next(e.code for e in _examples_script().examples(ROOT) if e.name == "test").strip()
    assert 'python3 .ci/examples.py --print "$1"' in (ROOT / ".ci" / "run").read_text()

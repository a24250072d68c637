"""The package's layers point one way: a module imports only from its own layer and the layers below it, never another
subpackage's private (``_``) module, and the module-level imports form no cycle (docs/design.md, Layout)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "analysis"

LAYERS = (
    (
        "errors",
        "text",
        "progress",
        "metrics",
        "ratio",
        "early_stop",
        "trust",
        "command_template",
        "config",
        "act_keys",
        "config_reference",
    ),
    ("io",),
    ("inputs",),
    ("structure",),
    ("engine",),
    ("runtimes",),
    ("planning",),
    ("recovery",),
    ("scale",),
    ("reporting",),
    ("workflow",),
    ("compat",),
    ("cli",),
)
"""From the bottom up; the first row is the vocabulary every layer may use (it imports only within itself)."""


@dataclass(frozen=True)
class Import:
    """One import of an ``analysis`` module by another."""

    importer: str
    imported: str
    line: int
    module_level: bool  # executed on import (not inside a function, nor under ``if TYPE_CHECKING``)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path) -> Iterator[Import]:
    """Every import of an ``analysis`` module in ``path`` (``from m import x`` also counts as ``m.x`` when that is a
    module)."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    deferred: set[int] = set()  # ids of nodes inside functions or TYPE_CHECKING blocks
    for node in ast.walk(tree):
        is_type_check = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or is_type_check:
            deferred.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(importer, path.name == "__init__.py", node)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if is_module(f"{base}.{alias.name}")]
        else:
            continue
        for target in targets:
            if target == "analysis" or target.startswith("analysis."):
                yield Import(importer, target, node.lineno, id(node) not in deferred)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> int:
    """The row of :data:`LAYERS` holding ``module``; ``analysis`` itself is at the bottom: its ``__init__`` holds
    ``__version__`` and resolves its public names lazily, importing nothing of the package until asked."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    for index, row in enumerate(LAYERS):
        if parts[1] in row:
            return index
    raise AssertionError(f"{module} is in no layer: add its subpackage to LAYERS (and to docs/design.md, Layout)")


def unit_of(module: str) -> str:
    """The subpackage (or bottom module) a module belongs to."""
    return ".".join(module.split(".")[:2])


ALL_IMPORTS = [found for path in sorted(PACKAGE.rglob("*.py")) for found in imports_of(path)]


def test_the_walk_finds_the_imports_it_checks() -> None:
    # guards the walk itself: known imports of each kind are found, so an empty walk cannot pass the tests below
    pairs = {(i.importer, i.imported, i.module_level) for i in ALL_IMPORTS}
    assert ("analysis.workflow.analyse", "analysis.planning.ratios", True) in pairs
    assert ("analysis.config", "analysis.early_stop", True) in pairs
    assert any(i.importer == "analysis.engine._early_stop" and not i.module_level for i in ALL_IMPORTS)  # TYPE_CHECKING
    assert len({i.importer for i in ALL_IMPORTS}) > 60


def test_the_package_facade_imports_nothing_of_the_package_on_import() -> None:
    assert not [i for i in ALL_IMPORTS if i.importer == "analysis" and i.module_level]


def test_every_subpackage_is_in_a_layer() -> None:
    for path in PACKAGE.iterdir():
        if path.name.startswith((".", "__")) or path.suffix not in ("", ".py"):
            continue
        layer_of(f"analysis.{path.stem}")


@pytest.mark.parametrize("kind", ["upward", "private"])
def test_imports_point_down_and_never_into_another_subpackage_private_module(kind: str) -> None:
    wrong = []
    for found in ALL_IMPORTS:
        own, other = unit_of(found.importer), unit_of(found.imported)
        if own == other or found.importer == "analysis":  # the facade's names are typed under TYPE_CHECKING only
            continue
        if kind == "upward" and layer_of(found.imported) > layer_of(found.importer):
            wrong.append(f"{found.importer}:{found.line} imports {found.imported} from a higher layer")
        hidden = [part for part in found.imported.split(".")[2:] if part.startswith("_")]
        if kind == "private" and hidden:
            wrong.append(f"{found.importer}:{found.line} imports {found.imported}, private to {other}")
    assert not wrong, "\n".join(wrong)


def test_module_level_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for found in ALL_IMPORTS:
        if found.module_level and is_module(found.imported) and found.imported != found.importer:
            graph.setdefault(found.importer, set()).add(found.imported)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]) if target in path else target)
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)

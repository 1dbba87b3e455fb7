"""The import rules of the layout (docs/architecture.md), checked from the source.

- ``api/`` imports only ``jobs/``, ``fleet/``, ``db/`` and ``config/`` (and
  itself): what it shares with the workers lives in the neutral packages
  ``jobs/`` and ``fleet/``, never in ``tasks/`` (Celery) or ``workers/``
  (processes). ``fleet/`` imports only ``jobs/``, ``db/`` and ``config/``;
  ``jobs/`` only ``db/`` and ``config/``. No package imports ``cli/``.
- No import cycle among the project's modules, counting imports inside
  functions too (they run, only later) but not those under
  ``if TYPE_CHECKING:``. An import of ``a.b.c`` counts as one of that module
  only, not of the packages above it.

``python -m tests.import_rules`` prints every breach and exits 1 (``make
lint`` runs it); ``tests/unit/test_import_rules.py`` runs the same check.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "cli", "tasks", "jobs", "workers", "fleet", "models", "db", "config", "client")
MAY_IMPORT = {
    "api": frozenset({"api", "jobs", "fleet", "db", "config"}),
    "fleet": frozenset({"fleet", "jobs", "db", "config"}),
    "jobs": frozenset({"jobs", "db", "config"}),
}
"""The only project packages a package's modules may import (those not named here: any)."""
TOP = frozenset({"cli"})
"""Packages no other package imports: the command line drives the farm, not the reverse."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (the deepest module each import names)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the module pkg.sub when there is one.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, targets in sorted(graph.items()):
        package = name.split(".")[0]
        allowed = MAY_IMPORT.get(package)
        found += [
            f"{name} imports {t}"
            for t in sorted(targets)
            if (allowed is not None and t.split(".")[0] not in allowed)
            or (t.split(".")[0] in TOP and package != t.split(".")[0])
        ]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(groups)


def breaches() -> list[str]:
    graph = import_graph()
    found = forbidden_imports(graph)
    found += ["import cycle: " + " <-> ".join(group) for group in cycles(graph)]
    return found


def main() -> int:
    found = breaches()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} breach(es) of the import rules (tests/import_rules.py)")
        return 1
    print("import rules hold: api, fleet, jobs import what they may; none imports cli; no cycle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

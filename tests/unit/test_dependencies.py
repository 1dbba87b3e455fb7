"""Dependencies are declared where they are imported, and only those.

pyproject.toml is the source (``pip install .`` gives the API side,
``.[worker]`` the model side); requirements-api.txt and requirements.txt, which
the Makefile and the images install, hold the same lines.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from config.settings import PROJECT_ROOT

PACKAGES = ("api", "tasks", "workers", "fleet", "models", "db", "config", "client")
# Declared but never imported, each for a reason.
NOT_IMPORTED = {
    "gunicorn": "runs the API as a program (python -m gunicorn)",
    "gevent": "gunicorn's gevent worker class serves the API (api/gunicorn_conf.py)",
    "psycopg2-binary": "SQLAlchemy's Postgres driver, chosen by the DATABASE_URL",
    "gguf": "transformers needs it to read the default model's GGUF file",
    "accelerate": "transformers needs it to load GGUF weights",
}


def _lines(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "-r"))
    ]


def _project() -> dict:
    return tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]


def test_requirements_files_match_pyproject() -> None:
    project = _project()
    assert project["dependencies"] == _lines(PROJECT_ROOT / "requirements-api.txt")
    assert project["optional-dependencies"]["worker"] == _lines(PROJECT_ROOT / "requirements.txt")
    assert "torch==2.13.0" in project["optional-dependencies"]["worker"]


def _imported_top_levels() -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (PROJECT_ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in PACKAGES}


def test_every_import_is_declared_and_every_declaration_imported() -> None:
    project = _project()
    declared = {
        canonicalize_name(Requirement(r).name)
        for r in project["dependencies"] + project["optional-dependencies"]["worker"]
    }
    owners = packages_distributions()
    imported: set[str] = set()
    undeclared = []
    for name in sorted(_imported_top_levels()):
        dists = {canonicalize_name(d) for d in owners.get(name, [])}
        assert dists, f"{name} is imported but no installed distribution provides it"
        imported |= dists
        if not dists & declared:
            undeclared.append(f"{name} ({', '.join(sorted(dists))})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = declared - imported - set(NOT_IMPORTED)
    assert not unused, f"declared but never imported: {sorted(unused)}"

"""Dependencies are declared where they are imported, and only those.

pyproject.toml is the source (``pip install .`` gives the API side,
``.[worker]`` the model side); requirements-api.txt and requirements.txt, which
the Makefile and the images install, hold the same lines.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from config.settings import PROJECT_ROOT
from tests.import_rules import PACKAGES

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


PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "-q")


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``argv``; its standard output, or a failure with its standard error."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel ``pip install .`` would build, from a copy of the packages (no network)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(
            PROJECT_ROOT / package,
            source / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    out = tmp_path / "wheel"
    _run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), "."],
        source,
    )
    (wheel,) = out.glob("switchyard-*.whl")
    return wheel


def test_pip_install_gives_a_working_cli_and_api(tmp_path: Path) -> None:
    """``pip install .`` (here: its wheel, installed alone) runs ``switchyard`` and the API.

    The dependencies themselves are checked above against the imports; this
    checks what the wheel carries: every package file (migrations, model
    definitions, the web app), the ``switchyard`` command, an importable API.
    """
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        carried = set(archive.namelist())
        entry_points = archive.read(
            next(n for n in carried if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
    shipped = {
        path.relative_to(PROJECT_ROOT).as_posix()
        for package in PACKAGES
        for path in (PROJECT_ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert not shipped - carried, f"left out of the wheel: {sorted(shipped - carried)}"
    assert "switchyard = cli.main:main" in entry_points

    site = tmp_path / "site"
    _run([*PIP, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
    # Only the installed copy is importable: no checkout on the path, run elsewhere,
    # with none of the farm's settings in the environment.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWITCHYARD_") and k not in ("DATABASE_URL", "REDIS_URL")
    }
    env.update(PYTHONPATH=str(site), HOME=str(tmp_path / "home"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert "run API, Redis" in _run([str(site / "bin" / "switchyard"), "--help"], elsewhere, env)
    probe = (
        "import api, db.migrate, config; "
        "print(api.__file__); "
        "print(config.load_catalog(config.load_settings({}).models_dir).names); "
        "print((db.migrate.MIGRATIONS / 'env.py').is_file()); "
        "print(config.load_settings({}).state_dir)"
    )
    found = _run([sys.executable, "-c", probe], elsewhere, env).splitlines()
    where, models, migrations, state_dir = found
    assert where == str(site / "api" / "__init__.py")
    assert "tiny-random" in models and migrations == "True"
    # Its database (prompts, token hashes) is the user's, not inside the installation,
    # and the first command to open it makes it, private.
    assert Path(state_dir) == tmp_path / "home" / ".local" / "state" / "switchyard"
    _run([str(site / "bin" / "switchyard"), "migrate"], elsewhere, env)
    assert stat.S_IMODE(Path(state_dir).stat().st_mode) == 0o700
    assert stat.S_IMODE((Path(state_dir) / "switchyard.db").stat().st_mode) == 0o600

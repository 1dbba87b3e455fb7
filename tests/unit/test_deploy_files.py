"""Deployment files cannot run here (no Docker engine, no cluster), so check them
against the project: every command they run parses with our CLI, every file they
copy exists, every Switchyard variable they set is a real setting, every port
matches the API's."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.settings import PROJECT_ROOT, Settings, variable_name
from workers.cli import build_parser

DOCKER = PROJECT_ROOT / "docker"
SETTINGS_VARIABLES = {variable_name(f) for f in Settings.model_fields}
# Variables that are not Switchyard settings but are legitimately set.
OTHER_VARIABLES = {
    "PYTHONUNBUFFERED",
    "PIP_NO_CACHE_DIR",
    "DEBIAN_FRONTEND",
    "HF_HUB_OFFLINE",
    "PATH",
    "POSTGRES_USER",
    "POSTGRES_PASSWORD",
    "POSTGRES_DB",
    "CUDA_VISIBLE_DEVICES",
    "PROMETHEUS_MULTIPROC_DIR",
    "POD_NAME",
    "POD_NAMESPACE",
}


def _check_command(argv: list[str], where: str) -> None:
    """A command line of ours must exist and parse."""
    if "sh" in argv[:1] and "-c" in argv:
        for part in re.split(r"&&|;", argv[argv.index("-c") + 1]):
            _check_command(shlex.split(part.replace("exec ", "")), where)
        return
    if argv[:3] == ["python", "-m", "workers"] or argv[:1] == ["switchyard"]:
        args = argv[3:] if argv[0] == "python" else argv[1:]
        args = [re.sub(r"\$\{?\w+(:-([^}]*))?\}?", lambda m: m.group(2) or "x", a) for a in args]
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `{' '.join(argv)}` is not a valid switchyard command")
    elif argv[:3] == ["python", "-m", "gunicorn"]:
        assert "-c" in argv and (PROJECT_ROOT / argv[argv.index("-c") + 1]).exists(), where
        assert argv[-1].strip("'\"") == "api:create_app()", where
    elif argv[:1] in (["pg_isready"], ["redis-cli"], ["redis-server"]):
        pass
    else:
        pytest.fail(f"{where}: unknown command {argv}")


def _check_env(names: list[str], where: str) -> None:
    for name in names:
        if name.startswith("SWITCHYARD_") or name in ("DATABASE_URL", "REDIS_URL"):
            assert name in SETTINGS_VARIABLES, f"{where}: {name} is not a setting"
        else:
            assert name in OTHER_VARIABLES, f"{where}: unexpected variable {name}"


def _as_argv(value: Any) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value if v not in ("CMD", "CMD-SHELL")]


def test_procfile_commands_are_the_launchers() -> None:
    from workers.launcher import web_command, worker_command

    lines = dict(
        line.split(": ", 1) for line in (PROJECT_ROOT / "Procfile").read_text().splitlines() if line
    )
    assert {"web", "worker"} <= set(lines)
    for name, command in lines.items():
        _check_command(shlex.split(command), f"Procfile {name}")
    assert shlex.split(lines["web"])[1:] == [
        *web_command()[1:3],
        "-c",
        "api/gunicorn_conf.py",
        "api:create_app()",
    ]
    assert shlex.split(lines["worker"])[1:5] == worker_command("m")[1:5]


def _dockerfiles() -> Iterator[Path]:
    yield from sorted(DOCKER.glob("Dockerfile*"))


@pytest.mark.parametrize("path", list(_dockerfiles()), ids=lambda p: p.name)
def test_dockerfiles(path: Path) -> None:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "COPY":
            for source in rest.split()[:-1]:
                if source != ".":
                    assert (PROJECT_ROOT / source).exists(), f"{path.name}: COPY {source}"
        elif word == "ENV":
            _check_env(re.findall(r"(\w+)=", rest), path.name)
        elif word == "CMD":
            _check_command(
                yaml.safe_load(rest) if rest.startswith("[") else shlex.split(rest), path.name
            )
        elif word == "HEALTHCHECK":
            _check_command(shlex.split(rest.split(" CMD ", 1)[1]), path.name)
        elif word == "EXPOSE":
            assert rest.strip() == str(Settings().api_port)


def test_compose_services() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "api"} <= set(services)
    assert any(name.startswith("worker-") for name in services)
    redis_cmd = services["redis"]["command"]
    assert "--appendonly" in redis_cmd and "noeviction" in redis_cmd
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        _check_command(_as_argv(service["healthcheck"]["test"]), f"compose {name} healthcheck")
        if "command" in service:
            _check_command(_as_argv(service["command"]), f"compose {name}")
        if "build" in service:
            assert (DOCKER.parent / service["build"]["dockerfile"]).exists()
        _check_env(list(service.get("environment", {})), f"compose {name}")
    assert services["api"]["ports"] == [f"{Settings().api_port}:{Settings().api_port}"]


def _k8s_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_kubernetes_manifests() -> None:
    docs = list(_k8s_documents())
    if not docs:
        pytest.fail("docker/k8s/ holds no manifests")
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service"} <= kinds
    for name, doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            where = f"{name} {doc['metadata']['name']}/{container['name']}"
            argv = _as_argv(container.get("command", [])) + _as_argv(container.get("args", []))
            if argv:
                _check_command(argv, where)
            _check_env([e["name"] for e in container.get("env", [])], where)
            for port in container.get("ports", []):
                assert port["containerPort"] == Settings().api_port, where

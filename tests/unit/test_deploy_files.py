"""Deployment files cannot run here (no Docker engine, no cluster), so check them
against the project: every command they run parses with our CLI, every file they
copy exists, every Switchyard variable they set is a real setting, every port
matches the API's."""

from __future__ import annotations

import fnmatch
import re
import shlex
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from cli.healthcheck import build_parser as healthcheck_parser
from cli.main import build_parser
from config.settings import PROJECT_ROOT, Settings, variable_name

DOCKER = PROJECT_ROOT / "docker"
SETTINGS_VARIABLES = {variable_name(f) for f in Settings.model_fields}
# Variables that are not Switchyard settings but are legitimately set.
OTHER_VARIABLES = {
    "GF_SECURITY_ADMIN_PASSWORD",
    "PYTHONUNBUFFERED",
    "PIP_NO_CACHE_DIR",
    "DEBIAN_FRONTEND",
    "HF_HUB_OFFLINE",
    "PATH",
    "HOME",
    "HF_HOME",
    "PYTHONDONTWRITEBYTECODE",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "REDISCLI_AUTH",
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
    if argv[:3] == ["python", "-m", "cli.healthcheck"]:
        try:
            healthcheck_parser().parse_args(argv[3:])
        except SystemExit:
            pytest.fail(f"{where}: `{' '.join(argv)}` is not a valid health probe")
    elif argv[:3] == ["python", "-m", "cli"] or argv[:1] == ["switchyard"]:
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
    elif argv[:1] == ["wget"] or all(a.startswith("--") for a in argv):
        pass  # Prometheus' and Grafana's images: a health probe, the server's own flags
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
    port = Settings().api_port
    # Published on loopback unless the operator says otherwise (docker/.env).
    assert services["api"]["ports"] == [f"${{PUBLISH_ADDRESS:-127.0.0.1}}:{port}:{port}"]


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


# --- the hardening rules (issue 16) ---------------------------------------------------------

PINNED_IMAGE = re.compile(r"^[\w./-]+:(?!latest$)[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?$")


def _pinned(image: str) -> bool:
    """A tag that names a version (a digit in it), never ``latest`` nor none."""
    return bool(PINNED_IMAGE.match(image))


def test_pinned_image_rule() -> None:
    assert _pinned("python:3.11.14-slim-bookworm") and _pinned("switchyard-api:0.1.0")
    assert not _pinned("switchyard-api:latest") and not _pinned("redis") and not _pinned("x:slim")


def _dockerignore() -> set[str]:
    return {
        line.strip().rstrip("/")
        for line in (PROJECT_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def test_dockerignore_keeps_local_state_out() -> None:
    assert {".git", ".venv", ".switchyard", ".env", "*.db"} <= _dockerignore()


def _ignored(path: str, patterns: set[str]) -> bool:
    """Whether Docker leaves ``path`` (or a folder above it) out of the build context."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
        or fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], pattern.removeprefix("**/"))
        for prefix in prefixes
        for pattern in patterns
        if not pattern.startswith("!")
    )


def test_dockerignore_keeps_what_the_images_install() -> None:
    """``pip install -e .`` in an image needs pyproject.toml, its readme and every package."""
    patterns = _dockerignore()
    assert _ignored(".venv/bin/python", patterns) and _ignored("a/b/__pycache__/c.pyc", patterns)
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], "api/gunicorn_conf.py"]
    needed += [
        p.removesuffix("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    needed += [
        source
        for path in _dockerfiles()
        for line in path.read_text().splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
        if source != "."
    ]
    needed += [
        str(p.relative_to(PROJECT_ROOT)) for p in (PROJECT_ROOT / "config" / "models").iterdir()
    ]
    assert not [n for n in needed if _ignored(n, patterns)]


@pytest.mark.parametrize("path", list(_dockerfiles()), ids=lambda p: p.name)
def test_dockerfile_rules(path: Path) -> None:
    lines = [line.strip() for line in re.sub(r"\\\n\s*", " ", path.read_text()).splitlines()]
    words = [line.partition(" ") for line in lines if line and not line.startswith("#")]
    bases = [rest.split()[0] for word, _, rest in words if word == "FROM"]
    assert bases and all(_pinned(b) for b in bases), f"{path.name}: unpinned base {bases}"
    users = [rest.strip() for word, _, rest in words if word == "USER"]
    assert users, f"{path.name}: runs as root (no USER)"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"{path.name}: USER {users[-1]} (numeric, not 0)"
    # USER comes before what the container runs, after what the build installs.
    order = [word for word, _, _ in words]
    assert order.index("USER") > max(i for i, w in enumerate(order) if w in ("RUN", "COPY"))
    assert "HEALTHCHECK" in order, f"{path.name}: no HEALTHCHECK"


def test_images_build_the_postgres_driver_from_source(tmp_path: Path) -> None:
    """Every image installs its requirements through docker/install-requirements.sh,
    whose rewrite turns the development installs' psycopg2-binary into psycopg2
    (built against Debian's libpq, as its authors advise for production)."""
    script = DOCKER / "install-requirements.sh"
    for path in _dockerfiles():
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        runs = [line for line in text.splitlines() if line.startswith("RUN ")]
        assert any("sh install-requirements.sh requirements" in run for run in runs), path.name
        assert not any(re.search(r"pip install (-r|--requirement)", run) for run in runs), path.name
    (sed,) = [line for line in script.read_text().splitlines() if line.startswith("sed -i ")]
    (tmp_path / "requirements-api.txt").write_text(
        (PROJECT_ROOT / "requirements-api.txt").read_text()
    )
    subprocess.run(["sh", "-c", sed], cwd=tmp_path, check=True)
    rewritten = (tmp_path / "requirements-api.txt").read_text().splitlines()
    assert "psycopg2>=2.9" in rewritten
    assert not [line for line in rewritten if line.startswith("psycopg2-binary")]
    assert "psycopg2-binary>=2.9" in (PROJECT_ROOT / "requirements-api.txt").read_text()


def test_images_have_the_projects_python() -> None:
    """Each image's base ships a Python that ``requires-python`` accepts; none adds another.

    (An earlier worker image installed python3.11 with apt on an Ubuntu that has no such
    package: it could never have been built.)
    """
    requires = SpecifierSet(
        tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    )
    for path in _dockerfiles():
        text = path.read_text()
        bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
        for base in bases:
            found = re.match(r"python:(\d+\.\d+(?:\.\d+)?)-", base)
            assert found, f"{path.name}: base {base} is not an official Python image"
            assert requires.contains(found.group(1)), f"{path.name}: {base} vs {requires}"
        assert not re.search(r"apt(-get)? install[^\n]*python3", text), path.name


def test_make_generates_private_compose_secrets(tmp_path: Path) -> None:
    """``make docker/.env`` writes every variable compose requires, random, mode 0600, once."""
    (tmp_path / "docker").mkdir()
    make = ["make", "-s", "-f", str(PROJECT_ROOT / "Makefile"), f"PYTHON={sys.executable}"]
    done = subprocess.run(
        [*make, "docker/.env"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    env_file = tmp_path / "docker" / ".env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    values = dict(
        line.split("=", 1)
        for line in env_file.read_text().splitlines()
        if line and not line.startswith("#")
    )
    required = set(re.findall(r"\$\{(\w+):\?", (DOCKER / "compose.yml").read_text()))
    assert required == set(values), (required, set(values))
    assert all(len(v) >= 32 and re.fullmatch(r"[0-9a-f]+", v) for v in values.values())
    first = env_file.read_text()
    again = subprocess.run(
        [*make, "docker/.env"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and env_file.read_text() == first  # never overwritten
    # A second generation gives other passwords: they are random, not a default.
    other = tmp_path / "other"
    (other / "docker").mkdir(parents=True)
    subprocess.run([*make, "docker/.env"], cwd=other, check=True, timeout=60)
    assert (other / "docker" / ".env").read_text() != first


def test_compose_hardening() -> None:
    text = (DOCKER / "compose.yml").read_text()
    services = yaml.safe_load(text)["services"]
    for name, service in services.items():
        assert _pinned(service["image"]), f"compose {name}: image {service.get('image')}"
        if "build" in service:  # ours: no root, no capabilities, nothing written outside volumes
            assert service["read_only"] is True, name
            assert service["cap_drop"] == ["ALL"], name
            assert "no-new-privileges:true" in service["security_opt"], name
            # A tmpfs is root's (0755) unless its options say otherwise: the state folder
            # must be the image's user's, or the API cannot write it (seen in a container).
            for mount in service.get("tmpfs", []):
                path, _, options = mount.partition(":")
                if path != "/tmp":
                    assert "uid=10001" in options.split(","), f"compose {name}: tmpfs {mount}"
    # Secrets come from docker/.env (make docker/.env), never from the file itself.
    postgres_password = services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert postgres_password.startswith("${POSTGRES_PASSWORD:?"), postgres_password
    redis_cmd = services["redis"]["command"]
    assert "--requirepass" in redis_cmd
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    anchors = yaml.safe_load(text)["x-env"]
    assert "${POSTGRES_PASSWORD" in anchors["DATABASE_URL"]
    assert anchors["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")
    for name, service in services.items():
        for published in service.get("ports", []):
            assert published.startswith("${PUBLISH_ADDRESS:-127.0.0.1}:"), f"{name}: {published}"
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "\ndocker/.env:" in makefile and "umask 077" in makefile
    assert "docker/.env" in (PROJECT_ROOT / ".gitignore").read_text()


def _pod_specs() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for name, doc in _k8s_documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            yield f"{name} {doc['metadata']['name']}", doc, spec


def test_kubernetes_hardening() -> None:
    pods = list(_pod_specs())
    assert pods
    for where, _doc, spec in pods:
        pod_context = spec.get("securityContext", {})
        assert pod_context.get("runAsNonRoot") is True, where
        assert pod_context.get("runAsUser", 0) != 0, where
        # Only a pod with a service account of its own (with a Role) gets the token.
        if "serviceAccountName" in spec:
            assert spec.get("automountServiceAccountToken") is True, where
        else:
            assert spec.get("automountServiceAccountToken") is False, where
        mounts_needed = {"/tmp"}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            at = f"{where}/{container['name']}"
            assert _pinned(container["image"]), f"{at}: image {container['image']}"
            context = container.get("securityContext", {})
            assert context.get("readOnlyRootFilesystem") is True, at
            assert context.get("allowPrivilegeEscalation") is False, at
            assert context.get("capabilities", {}).get("drop") == ["ALL"], at
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert mounts_needed <= set(mounts), f"{at}: a read-only root needs /tmp writable"
            for volume in mounts.values():
                assert "emptyDir" in volumes[volume] or "persistentVolumeClaim" in volumes[volume]


def _probes() -> Iterator[tuple[str, list[str], float]]:
    """Every health probe of ours that runs a command: where, its argv, its timeout in s."""
    for path in _dockerfiles():
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            if line.startswith("HEALTHCHECK "):
                options, _, command = line.partition(" CMD ")
                found = re.search(r"--timeout=(\d+)s", options)
                yield path.name, shlex.split(command), float(found.group(1)) if found else 30.0
    services = yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]
    for name, service in services.items():
        argv = _as_argv(service["healthcheck"]["test"])
        timeout = float(service["healthcheck"].get("timeout", "30s").removesuffix("s"))
        yield f"compose {name}", argv, timeout
    for where, _doc, spec in _pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = container.get(kind, {})
                if "exec" in probe:  # Kubernetes' default timeoutSeconds is 1
                    at = f"{where}/{container['name']} {kind}"
                    yield at, probe["exec"]["command"], probe.get("timeoutSeconds", 1)


def test_probes_run_the_light_health_check_with_room_to_start() -> None:
    """A probe of ours runs ``python -m cli.healthcheck`` (not the whole command line,
    3.1 s to import on a loaded 2-core host, which made Docker mark a healthy API
    unhealthy) under a timeout of 5 s or more."""
    ours = [(w, argv, t) for w, argv, t in _probes() if argv[:1] == ["python"]]
    assert len(ours) >= 6
    for where, argv, timeout in ours:
        assert argv[:3] == ["python", "-m", "cli.healthcheck"], f"{where}: {argv}"
        _check_command(argv, where)
        assert timeout >= 5, f"{where}: timeout {timeout} s"


def test_the_scaler_is_probed_as_a_scaler() -> None:
    """Compose's scaler was probed through the API (healthy while its loop was stuck) and
    the Kubernetes scaler not at all; both now ask whether its own loop turns."""
    services = yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]
    scalers = {n: s for n, s in services.items() if s.get("command", [])[2:4] == ["cli", "scaler"]}
    assert scalers
    for name, service in scalers.items():
        assert _as_argv(service["healthcheck"]["test"])[3:] == ["--scaler"], name
    pods = [
        (where, c)
        for where, _doc, spec in _pod_specs()
        for c in spec["containers"]
        if c.get("command", [])[2:4] == ["cli", "scaler"]
    ]
    assert pods
    for where, container in pods:
        command = container["livenessProbe"]["exec"]["command"]
        assert command == ["python", "-m", "cli.healthcheck", "--scaler"], where
        # The file it reads lives in the state folder: writable under a read-only root.
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/var/lib/switchyard" in mounts, where


def test_network_policy_keeps_redis_and_postgres_to_the_farm() -> None:
    policies = {
        d["metadata"]["name"]: d for _, d in _k8s_documents() if d["kind"] == "NetworkPolicy"
    }
    assert any(p["spec"]["podSelector"] == {} for p in policies.values()), "no default deny"
    for component, port in (("redis", 6379), ("postgres", 5432)):
        chosen = [
            p
            for p in policies.values()
            if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
            == component
        ]
        assert chosen, f"no NetworkPolicy for {component}"
        for rule in chosen[0]["spec"]["ingress"]:
            assert [p["port"] for p in rule["ports"]] == [port]
            sources = rule["from"]
            assert sources, f"{component}: open to every pod"
            assert {"matchLabels": {"app.kubernetes.io/name": "switchyard"}} in [
                s.get("podSelector") for s in sources if "namespaceSelector" not in s
            ]


def test_keda_counts_the_list_the_workers_consume() -> None:
    """KEDA's redis trigger names the Redis list kombu keeps the model's queue in: the queue
    under the farm's prefix (the manifests set none: the default)."""
    from jobs.queues import queue_key

    for where, _doc, spec in _pod_specs():
        for container in spec.get("containers", []):
            names = [e["name"] for e in container.get("env", [])]
            assert variable_name("redis_prefix") not in names, f"{where}: keda.yaml's listName"
    scaled = [d for _, d in _k8s_documents() if d["kind"] == "ScaledObject"]
    assert scaled, "keda.yaml holds no ScaledObject"
    for doc in scaled:
        model = doc["spec"]["scaleTargetRef"]["name"].removeprefix("switchyard-worker-")
        triggers = doc["spec"]["triggers"]
        lists = [t["metadata"]["listName"] for t in triggers if t["type"] == "redis"]
        assert lists == [queue_key(Settings(), model)] == [f"sy:gen.{model}"]

"""The Kubernetes executor against a real HTTP server speaking the apps/v1 scale subresource.

The server is small and in-process, but the requests are the official
``kubernetes`` client's own, over a socket; the scaler drives it from real
Postgres and Redis state.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from kubernetes import client as k8s

from config import Settings, load_catalog
from config.settings import PROJECT_ROOT
from db.overrides import ModelOverrides
from db.session import Database
from fleet.controls import ScalingControls
from fleet.scaler_state import ScalerState
from workers.executors.base import ExecutorError
from workers.executors.kubernetes import KubernetesExecutor, deployment_name
from workers.scaler import Scaler

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")


class FakeApps:
    """Deployments' replica counts, and every request the client made."""

    def __init__(self, deployments: dict[tuple[str, str], int]) -> None:
        self.replicas = dict(deployments)
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def scale_body(self, namespace: str, name: str) -> dict[str, Any]:
        n = self.replicas[(namespace, name)]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": n},
            "status": {"replicas": n},
        }


def _handler(apps: FakeApps) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            with apps.lock:
                apps.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "content_type": self.headers.get("Content-Type"),
                        "body": body,
                    }
                )
                match = SCALE_PATH.match(self.path.split("?")[0])
                if match is None or (match[1], match[2]) not in apps.replicas:
                    self._reply(
                        404,
                        {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404},
                    )
                    return
                key = (match[1], match[2])
                if self.command == "PATCH":
                    assert body is not None
                    apps.replicas[key] = int(body["spec"]["replicas"])
                self._reply(200, apps.scale_body(*key))

        do_GET = _handle
        do_PATCH = _handle

    return Handler


@pytest.fixture
def fake_cluster() -> Iterator[tuple[FakeApps, str]]:
    apps = FakeApps({})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(apps))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield apps, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def api_client(url: str) -> k8s.ApiClient:
    configuration = k8s.Configuration()
    configuration.host = url
    return k8s.ApiClient(configuration)


def test_executor_patches_the_scale_only_when_it_differs(
    fake_cluster: tuple[FakeApps, str],
) -> None:
    apps, url = fake_cluster
    settings = Settings(k8s_namespace="farm")
    apps.replicas[("farm", "switchyard-worker-tiny-random")] = 1
    executor = KubernetesExecutor(settings, api_client(url))

    executor.apply("tiny-random", 3)
    assert apps.replicas[("farm", "switchyard-worker-tiny-random")] == 3
    assert [(r["method"], r["path"]) for r in apps.requests] == [
        ("GET", "/apis/apps/v1/namespaces/farm/deployments/switchyard-worker-tiny-random/scale"),
        ("PATCH", "/apis/apps/v1/namespaces/farm/deployments/switchyard-worker-tiny-random/scale"),
    ]
    patch = apps.requests[1]
    assert patch["body"] == {"spec": {"replicas": 3}}
    assert patch["content_type"] in (
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    )

    apps.requests.clear()
    executor.apply("tiny-random", 3)  # already there: read, no write
    assert [r["method"] for r in apps.requests] == ["GET"]
    executor.apply("tiny-random", 0)
    assert apps.replicas[("farm", "switchyard-worker-tiny-random")] == 0
    assert executor.replicas() == {"tiny-random": 0}

    with pytest.raises(ExecutorError, match="404"):
        executor.apply("no-deployment", 1)


def test_deployment_names_are_dns_labels() -> None:
    settings = Settings(k8s_deployment="llm-{model}")
    assert deployment_name(settings, "qwen2.5_7b") == "llm-qwen2.5-7b"


def test_unreachable_api_server_is_an_executor_error() -> None:
    executor = KubernetesExecutor(Settings(), api_client("http://127.0.0.1:1"))
    with pytest.raises(ExecutorError, match="cannot reach"):
        executor.apply("tiny-random", 1)


def test_scaler_drives_deployments_from_the_farm_state(
    migrated: Settings, fake_cluster: tuple[FakeApps, str], tmp_path: Path
) -> None:
    apps, url = fake_cluster
    model = f"sc-k8s-{uuid.uuid4().hex[:6]}"
    folder = tmp_path / "models"
    folder.mkdir()
    smol = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "smollm2-135m.yaml").read_text())
    (folder / "smollm2-135m.yaml").write_text(yaml.safe_dump(smol))
    tiny = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "tiny-random.yaml").read_text())
    tiny.update(name=model, scaling={"min_replicas": 0, "max_replicas": 4})
    (folder / f"{model}.yaml").write_text(yaml.safe_dump(tiny))
    settings = migrated.model_copy(
        update={
            "models_dir": folder,
            "k8s_namespace": "switchyard",
        }
    )
    apps.replicas[("switchyard", f"switchyard-worker-{model}")] = 0
    apps.replicas[("switchyard", "switchyard-worker-smollm2-135m")] = 0
    client = redis.Redis.from_url(settings.redis_url)
    db = Database(settings.database_url)
    catalog = load_catalog(folder)
    scaler = Scaler(settings, catalog, db, client, KubernetesExecutor(settings, api_client(url)))

    scaler.tick()
    assert apps.replicas[("switchyard", "switchyard-worker-smollm2-135m")] == 1  # its min
    assert apps.replicas[("switchyard", f"switchyard-worker-{model}")] == 0

    controls = ScalingControls(settings, catalog, db, client)
    controls.scale(model, 3, until=None, actor="test")
    scaler.tick()
    assert apps.replicas[("switchyard", f"switchyard-worker-{model}")] == 3
    controls.auto(model, "test")
    controls.update_policy(model, {"downscale_delay_s": 0, "scale_to_zero_delay_s": 0}, "test")
    scaler.tick()
    assert apps.replicas[("switchyard", f"switchyard-worker-{model}")] == 0
    # A model disabled at run time scales to zero, whatever its manual count.
    controls.scale(model, 2, until=None, actor="test")
    ModelOverrides(db).set(model, actor="test", enabled=False)
    scaler.tick()
    assert apps.replicas[("switchyard", f"switchyard-worker-{model}")] == 0
    assert ScalerState(client, settings).desired()[model]["desired"] == 0
    patches = [
        r["body"]["spec"]["replicas"]
        for r in apps.requests
        if r["method"] == "PATCH" and model in r["path"]
    ]
    assert patches == [3, 0]

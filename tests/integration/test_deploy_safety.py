"""Safe defaults for a farm deployed as shipped (issue 16), against a real API.

Content types, origins and CORS, token expiry, replica ceilings, what users
and operators learn about a failed job, and the launcher's refusal to start on
a port that is taken. Real Postgres, Redis and processes throughout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import websocket

from config import Settings, load_catalog
from config.settings import PROJECT_ROOT
from db.jobs import JobStore
from db.session import Database
from jobs.events import EventLog, JobEvent
from tests import farm
from tests.integration.test_executor_local import python
from tests.integration.test_scaling import make_models, settings_for, unique
from workers.executors import RecordOnlyExecutor
from workers.executors.local import LocalExecutor
from workers.scaler import Scaler

JOB = {"model": "tiny-random", "prompt": "Hello", "params": {"max_new_tokens": 2}}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- Content-Type ---------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_json_routes_refuse_a_body_not_sent_as_json(
    api_url: str, user_token: str, admin_token: str, content_type: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    raw = json.dumps(JOB).encode()
    r = requests.post(
        f"{api_url}/v1/jobs", data=raw, headers={**auth(user_token), **headers}, timeout=30
    )
    assert r.status_code == 415, r.text
    body = r.json()
    assert body["error_type"] == "unsupported_media_type"
    assert "Content-Type: application/json" in body["error"]
    # The OpenAI door answers in its own envelope; an admin route the same way.
    chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(
        f"{api_url}/v1/chat/completions",
        data=json.dumps(chat).encode(),
        headers={**auth(user_token), **headers},
        timeout=30,
    )
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = requests.post(
        f"{api_url}/v1/admin/users",
        data=json.dumps({"name": unique("ct")}).encode(),
        headers={**auth(admin_token), **headers},
        timeout=30,
    )
    assert r.status_code == 415


def test_json_with_a_charset_or_a_json_suffix_is_accepted(api_url: str, admin_token: str) -> None:
    for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        r = requests.post(
            f"{api_url}/v1/admin/users",
            data=json.dumps({"name": unique("ct")}).encode(),
            headers={**auth(admin_token), "Content-Type": content_type},
            timeout=30,
        )
        assert r.status_code == 201, (content_type, r.text)


# --- Origin and CORS ------------------------------------------------------------------------


def _ws(
    api_url: str, path: str, origin: str | None, token: str, host: str | None = None
) -> websocket.WebSocket:
    url = api_url.replace("http", "ws", 1) + path
    options: dict[str, Any] = {"header": [f"Authorization: Bearer {token}"], "timeout": 30}
    if origin is None:
        options["suppress_origin"] = True
    else:
        options["origin"] = origin
    if host is not None:
        options["host"] = host
    return websocket.create_connection(url, **options)


def test_websockets_from_another_origin_are_refused(api_url: str, user_token: str) -> None:
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        _ws(api_url, "/v1/ws", "https://evil.example", user_token)
    assert refused.value.status_code == 403
    # The API's own origin (the web app) and programs that send no Origin are welcome.
    for origin in (api_url, None):
        ws = _ws(api_url, "/v1/ws", origin, user_token)
        try:
            ws.send(json.dumps({"type": "ping"}))
            assert json.loads(ws.recv())["type"] == "pong"
        finally:
            ws.close()


def test_a_name_rebound_to_loopback_is_not_the_apis_own_origin(
    api_url: str, user_token: str
) -> None:
    """DNS rebinding: a page loaded from rebind.example, whose name then resolves to
    127.0.0.1, sends Host and Origin that agree. An API on a loopback address is its
    own origin only under a loopback name."""
    port = api_url.rsplit(":", 1)[1]
    host, page = f"rebind.example:{port}", f"http://rebind.example:{port}"
    r = requests.post(
        f"{api_url}/v1/jobs",
        json=JOB,
        headers={**auth(user_token), "Origin": page, "Host": host},
        timeout=30,
    )
    assert r.status_code == 403 and "origin" in r.json()["error"]
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        _ws(api_url, "/v1/ws", page, user_token, host=host)
    assert refused.value.status_code == 403
    # The same page under a loopback name is the API's own (the web app at localhost).
    ws = _ws(api_url, "/v1/ws", f"http://localhost:{port}", user_token, host=f"localhost:{port}")
    try:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv())["type"] == "pong"
    finally:
        ws.close()


def test_state_changing_requests_from_another_origin_are_refused(
    api_url: str, user_token: str
) -> None:
    evil = {"Origin": "https://evil.example"}
    r = requests.post(f"{api_url}/v1/jobs", json=JOB, headers={**auth(user_token), **evil})
    assert r.status_code == 403 and "origin" in r.json()["error"]
    assert "Access-Control-Allow-Origin" not in r.headers
    # A page elsewhere gets no CORS grant: its browser hides every answer from it.
    r = requests.get(f"{api_url}/v1/models", headers=evil, timeout=30)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    r = requests.options(
        f"{api_url}/v1/jobs",
        headers={**evil, "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert "Access-Control-Allow-Origin" not in r.headers


def test_allowed_origins_get_cors_and_websockets(migrated: Settings, user_token: str) -> None:
    other = "https://chat.example.com"
    settings = migrated.model_copy(update={"allowed_origins": f"{other}, http://localhost:3000"})
    with farm.serve_app_in_thread(settings) as url:
        r = requests.options(
            f"{url}/v1/jobs",
            headers={
                "Origin": other,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
            timeout=30,
        )
        assert r.headers["Access-Control-Allow-Origin"] == other
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
        assert "Access-Control-Allow-Credentials" not in r.headers
        r = requests.get(f"{url}/v1/models", headers={"Origin": other}, timeout=30)
        assert r.headers["Access-Control-Allow-Origin"] == other
        assert "Origin" in r.headers["Vary"]
        ws = _ws(url, "/v1/ws", other, user_token)
        ws.close()
        with pytest.raises(websocket.WebSocketBadStatusException):
            _ws(url, "/v1/ws", "https://evil.example", user_token)


# --- Token expiry ---------------------------------------------------------------------------


def test_new_tokens_expire_by_default(migrated: Settings, api_url: str, admin_token: str) -> None:
    name = unique("ttl")
    r = requests.post(
        f"{api_url}/v1/admin/users", json={"name": name}, headers=auth(admin_token), timeout=30
    )
    assert r.status_code == 201
    tokens = f"{api_url}/v1/admin/users/{name}/tokens"
    r = requests.post(tokens, json={"name": "laptop"}, headers=auth(admin_token), timeout=30)
    assert r.status_code == 201
    expires = datetime.fromisoformat(r.json()["expires_at"])
    expected = datetime.now(UTC) + timedelta(days=migrated.token_ttl_days)
    assert abs((expires - expected).total_seconds()) < 120
    # Never expiring is a choice made out loud.
    r = requests.post(tokens, json={"expires_at": None}, headers=auth(admin_token), timeout=30)
    assert r.status_code == 201 and r.json()["expires_at"] is None

    # The CLI the same: the default from the settings, --days 0 for never.
    env = farm.settings_env(migrated)
    cli = [sys.executable, "-m", "cli", "token", "create", "--user", name]
    for extra, days in (
        ([], migrated.token_ttl_days),
        (["--days", "7"], 7.0),
        (["--days", "0"], 0),
    ):
        done = subprocess.run(
            cli + extra, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith("sy_") and len(done.stdout.split()) == 1
        assert ("never expires" in done.stderr) == (days == 0), done.stderr
    listed = requests.get(
        f"{api_url}/v1/admin/tokens", params={"user": name}, headers=auth(admin_token), timeout=30
    ).json()["data"]
    cli_expiries = [t["expires_at"] for t in listed[2:]]
    assert cli_expiries[0] is not None and cli_expiries[1] is not None and cli_expiries[2] is None
    week = datetime.fromisoformat(cli_expiries[1]) - datetime.now(UTC)
    assert timedelta(days=6, hours=23) < week <= timedelta(days=7)


# --- Replica ceilings -----------------------------------------------------------------------


def test_replicas_above_the_farm_ceiling_are_refused(
    migrated: Settings, admin_token: str, tmp_path: Path
) -> None:
    model = unique("ceiling")
    models = make_models(tmp_path / "models", {model: {"scaling": {"max_replicas": 100}}})
    settings = settings_for(migrated, models, max_replicas_per_model=3)
    scaling = f"/v1/admin/models/{model}/scaling"
    with farm.serve_app_in_thread(settings) as url:
        for body, field in (
            ({"replicas": 4}, "replicas"),
            ({"max_replicas": 10_000}, "max_replicas"),
            ({"min_replicas": 4}, "min_replicas"),
        ):
            r = requests.put(url + scaling, json=body, headers=auth(admin_token), timeout=30)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["field"] == field and "limit of 3" in r.json()["error"]
        r = requests.post(
            url + f"/v1/admin/models/{model}/schedule",
            json={"cron": "* * * * *", "max_replicas": 5},
            headers=auth(admin_token),
            timeout=30,
        )
        assert r.status_code == 422 and r.json()["field"] == "max_replicas"
        r = requests.put(url + scaling, json={"replicas": 3}, headers=auth(admin_token), timeout=30)
        assert r.status_code == 200, r.text


class _RecordingExecutor(RecordOnlyExecutor):
    """Records the counts the scaler applies, starts nothing."""

    def __init__(self) -> None:
        self.applied: dict[str, int] = {}

    def apply(self, model: str, replicas: int) -> None:
        self.applied[model] = replicas


def test_the_scaler_never_asks_more_than_the_farm_ceiling(
    migrated: Settings, tmp_path: Path
) -> None:
    """A model definition may say 10,000 replicas; the scaler asks its executor for the
    farm's ceiling at most."""
    model = unique("ceiling")
    policy = {"min_replicas": 10_000, "max_replicas": 10_000}
    models = make_models(tmp_path / "models", {model: {"scaling": policy}})
    settings = settings_for(migrated, models, max_replicas_per_model=3)
    executor = _RecordingExecutor()
    db = Database(settings.database_url)
    try:
        scaler = Scaler(
            settings, load_catalog(models), db, redis.Redis.from_url(settings.redis_url), executor
        )
        scaler.tick()
    finally:
        db.dispose()
    assert executor.applied[model] == 3


def test_the_local_executor_runs_at_most_its_host_limit() -> None:
    settings = Settings(max_local_replicas=3)
    executor = LocalExecutor(
        settings, env={}, command=lambda m: python("import time; time.sleep(120)")
    )
    try:
        executor.apply("a", 2)
        executor.apply("b", 5)
        assert executor.replicas() == {"a": 2, "b": 1}
        assert len(executor.processes()) == 3
        executor.apply("a", 0)  # draining ones still count until they are gone
        assert len(executor.processes()) == 3
        deadline = time.monotonic() + 30
        while len(executor.processes()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            executor.poll()
        assert executor.replicas() == {"a": 0, "b": 3}
    finally:
        executor.close()


# --- Error text and worker names by role ----------------------------------------------------

INTERNAL = "RuntimeError: CUDA error: out of memory at /srv/models/secret-path/weights.bin"


def _failed_job(migrated: Settings, api_url: str, token: str) -> tuple[str, str]:
    """A job of ``token``'s user that failed on a worker with an internal error."""
    r = requests.post(
        f"{api_url}/v1/jobs",
        json={**JOB, "model": "tiny-late"},  # no worker serves it: it stays queued
        headers=auth(token),
        timeout=30,
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    worker = "gpu-host-7:4242"
    db = Database(migrated.database_url)
    try:
        jobs = JobStore(db)
        assert jobs.claim(job_id, worker) is not None
        assert jobs.fail_running(job_id, worker, INTERNAL)
    finally:
        db.dispose()
    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    seq = events.next_seq(job_id)
    events.append(
        job_id,
        [
            JobEvent(seq, "started", {"attempt": 1, "worker": worker}),
            JobEvent(seq + 1, "error", {"error": INTERNAL}),
        ],
    )
    return job_id, worker


def test_users_get_generic_errors_and_operators_the_full_text(
    migrated: Settings, api_url: str, user_token: str, admin_token: str
) -> None:
    job_id, worker = _failed_job(migrated, api_url, user_token)
    mine = requests.get(f"{api_url}/v1/jobs/{job_id}", headers=auth(user_token), timeout=30).json()
    assert mine["status"] == "failed" and mine["worker"] is None
    assert "CUDA" not in mine["error"] and "/srv" not in mine["error"]
    assert "operator" in mine["error"]
    listed = requests.get(f"{api_url}/v1/jobs", headers=auth(user_token), timeout=30).json()
    (row,) = [j for j in listed["data"] if j["id"] == job_id]
    assert row["error"] == mine["error"] and row["worker"] is None
    stream = farm.ws_events(api_url, job_id, user_token)
    assert stream[-1]["type"] == "error" and stream[-1]["error"] == mine["error"]
    assert all("worker" not in e for e in stream)
    sse = farm.sse_events(api_url, job_id, user_token)
    assert sse[-1]["error"] == mine["error"]

    full = requests.get(f"{api_url}/v1/jobs/{job_id}", headers=auth(admin_token), timeout=30)
    assert full.json()["error"] == INTERNAL and full.json()["worker"] == worker
    stream = farm.ws_events(api_url, job_id, admin_token)
    assert stream[-1]["error"] == INTERNAL
    assert [e["worker"] for e in stream if e["type"] == "started"] == [worker]


def test_errors_about_the_request_reach_users_as_they_are() -> None:
    from api.disclosure import GENERIC_ERROR, public_error

    for text in (
        "expired",
        "prompt: 2001 tokens, more than the model's 512",
        "params.max_new_tokens: above 1024",
        "timed out after 1800 s",
        "worker lost 3 times",
    ):
        assert public_error(text) == text
    for text in (INTERNAL, "ValueError: boom", "prompt\nTraceback"):
        assert public_error(text) == GENERIC_ERROR


# --- The launcher and a port that is taken --------------------------------------------------


def test_run_refuses_a_port_that_is_taken_and_says_why(migrated: Settings, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = farm.settings_env(migrated)
        env.update(SWITCHYARD_API_PORT=str(port), SWITCHYARD_STATE_DIR=str(tmp_path / "state"))
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "cli", "run", "--model", "tiny-random"],
            env=env,
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in done.stderr
    assert "SWITCHYARD_API_PORT" in done.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "state").exists()  # refused before anything started

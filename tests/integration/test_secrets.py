"""API tokens are secrets: stored only as hashes, never written to a log."""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import websocket
from sqlalchemy import create_engine, text

from config import Settings
from config.settings import PROJECT_ROOT
from db.accounts import Accounts
from db.schema import Role
from db.session import Database
from tests import farm

MODEL = "tiny-late"  # private; no worker serves it, so its jobs stay queued
JOB = {"model": MODEL, "prompt": "hello", "params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def accounts(migrated: Settings) -> Iterator[Accounts]:
    db = Database(migrated.database_url)
    yield Accounts(db)
    db.dispose()


def _person(accounts: Accounts, role: Role = Role.user) -> str:
    name = f"secret-{role.value}-{uuid.uuid4().hex[:8]}"
    accounts.add_user(name, role, max_concurrent_jobs=1000, requests_per_minute=10_000)
    return name


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _every_row_as_text(database_url: str) -> dict[str, list[str]]:
    """Every row of every table of the public schema, as Postgres prints it."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            tables = conn.execute(
                text(
                    "SELECT table_name FROM information_schema.tables"
                    " WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
                )
            ).scalars()
            return {
                table: list(conn.execute(text(f'SELECT t::text FROM "{table}" t')).scalars())
                for table in list(tables)
            }
    finally:
        engine.dispose()


def test_the_database_holds_token_hashes_never_secrets(
    migrated: Settings, api_url: str, accounts: Accounts
) -> None:
    admin = accounts.issue_token(_person(accounts, Role.admin)).secret
    name = _person(accounts)
    r = requests.post(
        f"{api_url}/v1/admin/users/{name}/tokens", json={"name": "laptop"}, headers=_bearer(admin)
    )
    assert r.status_code == 201, r.text
    issued = r.json()
    secret = issued["token"]
    # Use the token, so every table it can reach (jobs, chats, last use) has a row of it.
    assert requests.post(f"{api_url}/v1/jobs", json=JOB, headers=_bearer(secret)).status_code == 202
    r = requests.post(f"{api_url}/v1/chats", json={"title": "t"}, headers=_bearer(secret))
    assert r.status_code == 201, r.text

    engine = create_engine(migrated.database_url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(
                text("SELECT token_hash, prefix FROM api_tokens WHERE id = :id"),
                {"id": issued["id"]},
            ).one()
    finally:
        engine.dispose()
    assert stored.token_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(stored.prefix) and len(stored.prefix) < len(secret) // 2

    rows = _every_row_as_text(migrated.database_url)
    assert "api_tokens" in rows and "jobs" in rows
    for table, texts in rows.items():
        for row in texts:
            for s in (secret, admin):
                assert s not in row, f"a token's secret is stored in table {table}"


@pytest.fixture(scope="module")
def gunicorn(
    migrated: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, farm.Process]]:
    """The API under gunicorn at DEBUG (its base URL), its output in a log file of its own."""
    settings = migrated.model_copy(update={"api_port": farm.free_port()})
    env = {**farm.settings_env(settings), "SWITCHYARD_LOG_LEVEL": "DEBUG"}
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(PROJECT_ROOT / "api" / "gunicorn_conf.py"),
        "api:create_app()",
    ]
    log_path: Path = tmp_path_factory.mktemp("gunicorn") / "api.log"
    proc = farm.Process(argv, env, log_path)
    try:
        url = f"http://127.0.0.1:{settings.api_port}"
        farm.wait_http(url + "/healthz")
        yield url, proc
    finally:
        proc.stop()


def _ws_first_frame(url: str, token: str | None = None) -> dict[str, object]:
    """The answer to a ping on a websocket, the token (if any) in its subprotocol."""
    protocols = None if token is None else ["switchyard", f"bearer.{token}"]
    ws = websocket.create_connection(url, timeout=30, subprotocols=protocols)
    try:
        ws.send(json.dumps({"type": "ping", "id": "p"}))
        return dict(json.loads(ws.recv()))
    finally:
        ws.close()


def test_tokens_never_reach_the_api_log(
    gunicorn: tuple[str, farm.Process], accounts: Accounts
) -> None:
    url, proc = gunicorn
    ws_url = url.replace("http", "ws", 1)
    good = accounts.issue_token(_person(accounts)).secret
    revoked = accounts.issue_token(_person(accounts))
    accounts.revoke(revoked.token_id)
    bad = "sy_" + uuid.uuid4().hex + uuid.uuid4().hex

    # A token in the Authorization header.
    r = requests.post(f"{url}/v1/jobs", json=JOB, headers=_bearer(good), timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert requests.get(f"{url}/v1/jobs/{job_id}", headers=_bearer(good)).status_code == 200
    # In a websocket's subprotocol.
    assert _ws_first_frame(f"{ws_url}/v1/jobs/{job_id}/ws", good)["type"] == "queued"
    assert _ws_first_frame(f"{ws_url}/v1/ws", good)["type"] == "pong"
    # In the query string on SSE, where a browser (EventSource) has no other way ...
    with requests.get(f"{url}/v1/jobs/{job_id}/events?token={good}", stream=True) as r:
        assert r.status_code == 200
    # ... and nowhere else, a good token neither: 401 saying where it goes.
    for path in (f"/v1/jobs/{job_id}/ws", "/v1/ws"):
        refused = _ws_first_frame(f"{ws_url}{path}?token={good}")
        assert refused["type"] == "error" and refused["status"] == 401
        assert "subprotocol 'bearer.<token>'" in str(refused["error"])
    r = requests.get(f"{url}/v1/jobs/{job_id}?token={good}", timeout=30)
    assert r.status_code == 401 and "Authorization header" in r.json()["error"]
    # Refused tokens: bad, revoked, malformed header, and bad in a query.
    for token in (bad, revoked.secret):
        assert requests.get(f"{url}/v1/jobs", headers=_bearer(token)).status_code == 401
        assert requests.post(f"{url}/v1/jobs", json=JOB, headers=_bearer(token)).status_code == 401
        refused = _ws_first_frame(f"{ws_url}/v1/ws", token)
        assert refused["type"] == "error" and refused["status"] == 401
        refused = _ws_first_frame(f"{ws_url}/v1/jobs/{job_id}/ws", token)
        assert refused["type"] == "error" and refused["status"] == 401
        assert requests.get(f"{url}/v1/jobs/{job_id}/events?token={token}").status_code == 401
    malformed = {"Authorization": f"Token {bad}"}
    assert requests.get(f"{url}/v1/jobs", headers=malformed).status_code == 401

    proc.stop()  # flushes the log
    log = proc.log()
    # The requests were logged (so the check below looks at something) ...
    assert f"/v1/jobs/{job_id}/ws" in log and "/v1/ws" in log and " 401 " in log
    # ... and no secret is in it, whole or as its recognisable tail.
    for secret in (good, bad, revoked.secret):
        assert secret not in log
        assert secret[-16:] not in log

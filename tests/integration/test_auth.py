"""Users, tokens and access: every rule a client or an operator relies on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests

from config import Settings
from db.accounts import Accounts
from db.session import Database
from tests import farm

PROMPT = {"model": "tiny-late", "prompt": "hello", "params": {"max_new_tokens": 2}}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def accounts(migrated: Settings) -> Iterator[Accounts]:
    db = Database(migrated.database_url)
    yield Accounts(db)
    db.dispose()


@pytest.fixture(scope="module")
def admin(migrated: Settings) -> str:
    return farm.make_token(migrated, "admin")


@pytest.fixture(scope="module")
def operator(migrated: Settings) -> str:
    return farm.make_token(migrated, "operator")


@pytest.fixture(scope="module")
def user(migrated: Settings) -> str:
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


@pytest.fixture(scope="module")
def other(migrated: Settings) -> str:
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


def submit(api_url: str, token: str | None, body: dict[str, Any] = PROMPT) -> requests.Response:
    return requests.post(
        f"{api_url}/v1/jobs", json=body, headers=auth(token) if token else {}, timeout=30
    )


def cancel(api_url: str, token: str, job_id: str) -> None:
    requests.delete(f"{api_url}/v1/jobs/{job_id}", headers=auth(token), timeout=30)


def test_no_wrong_revoked_and_expired_tokens_are_401(
    api_url: str, admin: str, accounts: Accounts
) -> None:
    name = f"carol-{uuid.uuid4().hex[:6]}"
    r = requests.post(f"{api_url}/v1/admin/users", json={"name": name}, headers=auth(admin))
    assert r.status_code == 201 and r.json()["role"] == "user"
    r = requests.post(
        f"{api_url}/v1/admin/users/{name}/tokens",
        json={"name": "laptop", "expires_in_s": 3600},
        headers=auth(admin),
    )
    assert r.status_code == 201
    issued = r.json()
    assert issued["token"].startswith("sy_")
    assert submit(api_url, issued["token"]).status_code == 202
    assert submit(api_url, None).status_code == 401
    assert submit(api_url, "sy_" + "x" * 43).status_code == 401
    wrong = requests.post(
        f"{api_url}/v1/jobs", json=PROMPT, headers={"Authorization": "Token abc"}, timeout=30
    )
    assert wrong.status_code == 401 and "abc" not in wrong.text
    # Listed with its prefix and last use, never its secret.
    listed = requests.get(f"{api_url}/v1/admin/tokens?user={name}", headers=auth(admin)).json()
    (entry,) = listed["data"]
    assert entry["name"] == "laptop" and entry["active"] and entry["last_used_at"]
    assert issued["token"] not in str(listed) and issued["token"].startswith(entry["prefix"])
    # Revoked: refused at once.
    r = requests.delete(f"{api_url}/v1/admin/tokens/{issued['id']}", headers=auth(admin))
    assert r.status_code == 200 and r.json()["revoked"]
    refused = submit(api_url, issued["token"])
    assert refused.status_code == 401 and issued["token"] not in refused.text
    assert (
        requests.delete(f"{api_url}/v1/admin/tokens/999999", headers=auth(admin)).status_code == 404
    )
    # Expired: refused.
    expired = accounts.issue_token(name, expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert submit(api_url, expired.secret).status_code == 401


def test_other_users_jobs_are_404_and_operators_see_all(
    api_url: str, user: str, other: str, operator: str
) -> None:
    job_id = submit(api_url, user).json()["id"]
    for method in ("get", "delete"):
        r = requests.request(method, f"{api_url}/v1/jobs/{job_id}", headers=auth(other))
        assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    assert requests.get(f"{api_url}/v1/jobs/{job_id}", headers=auth(user)).status_code == 200
    assert requests.get(f"{api_url}/v1/jobs/{job_id}", headers=auth(operator)).status_code == 200
    mine = requests.get(f"{api_url}/v1/jobs", headers=auth(other)).json()["data"]
    assert job_id not in [j["id"] for j in mine]
    assert requests.get(f"{api_url}/v1/jobs?all=true", headers=auth(other)).status_code == 403
    everyone = requests.get(f"{api_url}/v1/jobs?all=true&limit=100", headers=auth(operator))
    assert job_id in [j["id"] for j in everyone.json()["data"]]
    r = requests.delete(f"{api_url}/v1/jobs/{job_id}", headers=auth(operator))
    assert r.status_code == 200 and r.json()["status"] == "cancelled"


def test_job_list_is_paginated_newest_first(api_url: str, migrated: Settings) -> None:
    token = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    ids = [submit(api_url, token).json()["id"] for _ in range(5)]
    seen: list[str] = []
    url = f"{api_url}/v1/jobs?limit=2"
    while True:
        page = requests.get(url, headers=auth(token), timeout=30).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        url = f"{api_url}/v1/jobs?limit=2&before={page['next_before']}"
    assert seen == list(reversed(ids))
    queued = requests.get(f"{api_url}/v1/jobs?status=succeeded", headers=auth(token)).json()
    assert queued["data"] == []
    assert requests.get(f"{api_url}/v1/jobs?limit=0", headers=auth(token)).status_code == 422
    assert requests.get(f"{api_url}/v1/jobs").status_code == 401
    for job_id in ids:
        cancel(api_url, token, job_id)


def test_role_checks_on_admin_routes(api_url: str, user: str, operator: str, admin: str) -> None:
    assert requests.get(f"{api_url}/v1/admin/users").status_code == 401
    assert requests.get(f"{api_url}/v1/admin/users", headers=auth(user)).status_code == 403
    assert requests.get(f"{api_url}/v1/admin/users", headers=auth(operator)).status_code == 403
    assert requests.get(f"{api_url}/v1/admin/users", headers=auth(admin)).status_code == 200
    assert requests.get(f"{api_url}/v1/admin/models", headers=auth(user)).status_code == 403
    models = requests.get(f"{api_url}/v1/admin/models", headers=auth(operator))
    assert models.status_code == 200
    assert "tiny-random" in [m["id"] for m in models.json()["data"]]
    r = requests.post(
        f"{api_url}/v1/admin/users", json={"name": "x", "role": "king"}, headers=auth(admin)
    )
    assert r.status_code == 422 and r.json()["field"] == "role"
    name = f"dup-{uuid.uuid4().hex[:6]}"
    assert (
        requests.post(
            f"{api_url}/v1/admin/users", json={"name": name}, headers=auth(admin)
        ).status_code
        == 201
    )
    assert (
        requests.post(
            f"{api_url}/v1/admin/users", json={"name": name}, headers=auth(admin)
        ).status_code
        == 409
    )


def test_model_overrides_public_and_enabled(api_url: str, operator: str, user: str) -> None:
    url = f"{api_url}/v1/admin/models/tiny-late"
    try:
        assert submit(api_url, None).status_code == 401  # private by its YAML
        r = requests.patch(url, json={"public": True}, headers=auth(operator))
        assert (
            r.status_code == 200 and r.json()["public"] and r.json()["defaults"]["public"] is False
        )
        anonymous = submit(api_url, None)
        assert anonymous.status_code == 202
        r = requests.patch(url, json={"enabled": False}, headers=auth(operator))
        assert r.json()["enabled"] is False
        gone = submit(api_url, user)
        assert gone.status_code == 404 and gone.json()["field"] == "model"
    finally:
        r = requests.patch(url, json={"public": None, "enabled": None}, headers=auth(operator))
        assert r.json()["enabled"] is True and r.json()["public"] is False
    assert submit(api_url, None).status_code == 401
    assert (
        requests.patch(
            f"{api_url}/v1/admin/models/nope", json={"enabled": False}, headers=auth(operator)
        ).status_code
        == 404
    )


def test_cli_manages_users_and_tokens(migrated: Settings, api_url: str) -> None:
    env = farm.settings_env(migrated)

    def cli(*args: str) -> str:
        done = farm.switchyard(env, *args, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    name = f"dave-{uuid.uuid4().hex[:6]}"
    cli("user", "add", name, "--role", "operator")
    cli("user", "set", name, "--requests-per-minute", "7")
    assert any(
        line.split()[:2] == [name, "operator"] and line.split()[3] == "7"
        for line in cli("user", "list").splitlines()
    )
    secret = cli("token", "create", "--user", name, "--name", "ci").strip()
    assert requests.get(f"{api_url}/v1/admin/models", headers=auth(secret)).status_code == 200
    listing = cli("token", "list", "--user", name)
    assert secret not in listing and "active" in listing
    token_id = listing.splitlines()[1].split()[0]
    assert "revoked" in cli("token", "revoke", token_id)
    # The API (another process than the CLI) forgets a valid token's lookup within
    # token_cache_s: its first request after the revocation may still be inside it.
    deadline = time.monotonic() + migrated.token_cache_s + 1.0
    while True:
        status = requests.get(f"{api_url}/v1/admin/models", headers=auth(secret)).status_code
        if status != 200 or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert status == 401


def test_a_lapsed_cached_token_is_looked_up_once_by_many_callers(migrated: Settings) -> None:
    """Thousands of open streams re-check one token: when its cache entry lapses, one
    query answers them all (they used to empty the connection pool, bench/LOAD.md)."""
    import threading

    from sqlalchemy import event

    from db.schema import Role

    db = Database(migrated.database_url)
    try:
        cached = Accounts(db, cache_s=60.0)
        name = f"herd-{uuid.uuid4().hex[:8]}"
        cached.add_user(name, Role.user)
        secret = cached.issue_token(name).secret
        lookups: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if "api_tokens" in statement and statement.lstrip().upper().startswith("SELECT"):
                lookups.append(statement)

        event.listen(db.engine, "before_cursor_execute", count)
        start = threading.Barrier(40)
        answers: list[Any] = []

        def call() -> None:
            start.wait()
            answers.append(cached.authenticate(secret))

        threads = [threading.Thread(target=call) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) == 40 and all(a is not None and a.user_name == name for a in answers)
        assert len(lookups) == 1, f"{len(lookups)} lookups of one token"
    finally:
        db.dispose()

"""Who sees and controls what: anonymous jobs, the model list, /metrics, chats' models."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest
import requests

from config import Settings
from db.accounts import Accounts
from db.overrides import CACHE_MAX_AGE_S, ModelOverrides
from db.schema import Role
from db.session import Database
from tests import farm

TINY = "tiny-random.yaml"


@pytest.fixture(scope="module")
def vis_settings(migrated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """The session's catalog plus a public model and a model operators switch off."""
    folder = tmp_path_factory.mktemp("visibility-models")
    for path in migrated.models_dir.glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    tiny = (migrated.models_dir / TINY).read_text()
    for name, public in (("tiny-open", True), ("tiny-switch", False)):
        text = tiny.replace("name: tiny-random", f"name: {name}")
        (folder / f"{name}.yaml").write_text(text.replace("public: false", f"public: {public}"))
    return migrated.model_copy(update={"models_dir": folder})


@pytest.fixture(scope="module")
def url(vis_settings: Settings) -> Iterator[str]:
    with farm.serve_app_in_thread(vis_settings) as base:
        yield base


@pytest.fixture(scope="module")
def db(vis_settings: Settings) -> Iterator[Database]:
    database = Database(vis_settings.database_url)
    yield database
    database.dispose()


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def revoked_token(db: Database) -> str:
    accounts = Accounts(db)
    name = f"revoked-{uuid.uuid4().hex[:8]}"
    accounts.add_user(name, Role.admin)
    issued = accounts.issue_token(name)
    assert accounts.revoke(issued.token_id)
    return issued.secret


def submit(url: str, token: str | None, model: str = "tiny-open") -> str:
    body = {"model": model, "prompt": "hello", "params": {"max_new_tokens": 2}}
    r = requests.post(f"{url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_anonymous_idempotency_keys_are_scoped_by_address(vis_settings: Settings) -> None:
    """Two anonymous callers sending the same key and request get two jobs; a retry, one."""
    body = {"model": "tiny-open", "prompt": "hello", "params": {"max_new_tokens": 2}}
    key = f"anon-{uuid.uuid4()}"
    proxied = vis_settings.model_copy(update={"api_trusted_proxies": 1})

    def post(base: str, address: str) -> requests.Response:
        headers = {"Idempotency-Key": key, "X-Forwarded-For": address}
        return requests.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)

    with farm.serve_app_in_thread(proxied) as base:
        first = post(base, "203.0.113.7")
        retry = post(base, "203.0.113.7")
        stranger = post(base, "203.0.113.8")
        assert first.status_code == retry.status_code == stranger.status_code == 202
        assert retry.json()["id"] == first.json()["id"]
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert stranger.json()["id"] != first.json()["id"]
        assert "Idempotent-Replayed" not in stranger.headers
        for job in (first, stranger):
            requests.delete(f"{base}/v1/jobs/{job.json()['id']}", timeout=30)


def test_an_anonymous_job_is_read_and_cancelled_by_whoever_has_its_id(
    url: str, vis_settings: Settings
) -> None:
    user = farm.make_token(vis_settings, max_concurrent_jobs=0, requests_per_minute=0)
    other = farm.make_token(vis_settings, max_concurrent_jobs=0, requests_per_minute=0)
    anonymous = submit(url, None)
    # Its submitter (no token) reads and cancels it.
    assert requests.get(f"{url}/v1/jobs/{anonymous}", timeout=30).status_code == 200
    r = requests.delete(f"{url}/v1/jobs/{anonymous}", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    # The id is the capability: anyone holding it may too, with a token or not.
    second = submit(url, None)
    assert requests.get(f"{url}/v1/jobs/{second}", headers=auth(user), timeout=30).ok
    r = requests.delete(f"{url}/v1/jobs/{second}", headers=auth(user), timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    # A user's job stays theirs: 401 without a token, 404 for another user.
    owned = submit(url, user)
    assert requests.delete(f"{url}/v1/jobs/{owned}", timeout=30).status_code == 401
    r = requests.delete(f"{url}/v1/jobs/{owned}", headers=auth(other), timeout=30)
    assert r.status_code == 404
    r = requests.delete(f"{url}/v1/jobs/{owned}", headers=auth(user), timeout=30)
    assert r.status_code == 200


def test_the_model_list_holds_only_what_the_caller_may_use(
    url: str, vis_settings: Settings, db: Database
) -> None:
    user = farm.make_token(vis_settings)

    def listed(token: str | None) -> set[str]:
        r = requests.get(f"{url}/v1/models", headers=auth(token), timeout=30)
        assert r.status_code == 200, r.text
        return {m["id"] for m in r.json()["data"]}

    anonymous, authenticated = listed(None), listed(user)
    assert "tiny-open" in anonymous and "tiny-switch" not in anonymous
    assert "tiny-random" not in anonymous  # private: not even its name
    assert {"tiny-open", "tiny-switch", "tiny-random"} <= authenticated
    # A revoked token is refused, not treated as no token.
    r = requests.get(f"{url}/v1/models", headers=auth(revoked_token(db)), timeout=30)
    assert r.status_code == 401
    # A model switched off at run time is listed to no one.
    overrides = ModelOverrides(db)
    overrides.set("tiny-switch", actor="test", enabled=False)
    try:
        assert "tiny-switch" not in listed(user)
    finally:
        overrides.set("tiny-switch", actor="test", enabled=None)
    assert "tiny-switch" in listed(user)


def test_metrics_can_require_an_operator_token(
    url: str, vis_settings: Settings, db: Database
) -> None:
    assert requests.get(f"{url}/metrics", timeout=30).status_code == 200  # the default
    user = farm.make_token(vis_settings)
    operator = farm.make_token(vis_settings, "operator")
    with farm.serve_app_in_thread(
        vis_settings.model_copy(update={"metrics_token_required": True})
    ) as locked:
        expected = {None: 401, revoked_token(db): 401, user: 403, operator: 200}
        for token, status in expected.items():
            r = requests.get(f"{locked}/metrics", headers=auth(token), timeout=30)
            assert r.status_code == status, (token, r.text)
        assert (
            b"switchyard_jobs"
            in requests.get(f"{locked}/metrics", headers=auth(operator), timeout=30).content
        )


def test_a_chat_takes_only_a_model_that_is_enabled_now(
    url: str, vis_settings: Settings, db: Database
) -> None:
    user = farm.make_token(vis_settings)
    overrides = ModelOverrides(db)
    chat = requests.post(f"{url}/v1/chats", json={"title": "t"}, headers=auth(user), timeout=30)
    assert chat.status_code == 201
    chat_url = f"{url}/v1/chats/{chat.json()['id']}"
    # Written behind the API's back (not through PATCH /v1/admin/models): each
    # API process sees it within its cache's second (db/overrides.py).
    overrides.set("tiny-switch", actor="test", enabled=False)
    try:
        body = {"title": "t", "model": "tiny-switch"}

        def refused() -> list[requests.Response]:  # a list: a 404 Response is falsy
            r = requests.post(f"{url}/v1/chats", json=body, headers=auth(user), timeout=30)
            return [r] if r.status_code != 201 else []

        [r] = farm.wait_for("the switched-off model refused", refused, CACHE_MAX_AGE_S + 5)
        assert r.status_code == 404 and r.json()["field"] == "model"
        r = requests.patch(chat_url, json={"model": "tiny-switch"}, headers=auth(user), timeout=30)
        assert r.status_code == 404
    finally:
        overrides.set("tiny-switch", actor="test", enabled=None)

    def taken() -> list[requests.Response]:
        r = requests.patch(chat_url, json={"model": "tiny-switch"}, headers=auth(user), timeout=30)
        return [r] if r.status_code != 404 else []

    [r] = farm.wait_for("the model back on", taken, CACHE_MAX_AGE_S + 5)
    assert r.status_code == 200 and r.json()["model"] == "tiny-switch"

"""The access matrix: every route of the app against every kind of caller.

Each route of ``app.url_map`` is listed in :data:`ROUTES` with the status each
principal gets; a route missing from the table fails the suite, so no route is
added without deciding who may use it. Resources belong to ``user``: another
user gets 404 for them (their existence is not disclosed), operators and
admins see jobs but not chats. Generation routes are sent a ``max_new_tokens``
over the model's limit, so a caller who passes authentication gets 422 (and no
job waits for a worker), while one who does not gets 401.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests
import websocket

from config import Settings
from db.accounts import Accounts
from db.schema import Role
from db.session import Database

PRINCIPALS = ("anon", "user", "other", "operator", "admin", "revoked", "expired")
MODEL = "tiny-late"  # private, and no worker serves it: its jobs stay queued
OVER_LIMIT = 999_999  # over tiny-late's max_new_tokens: 422 once authenticated


@dataclass
class Farm:
    """The principals' tokens and the resources ``user`` owns."""

    url: str
    tokens: dict[str, str | None]
    accounts: Accounts
    throwaway_user: str
    job_id: str = ""
    chat_id: str = ""
    message_id: int = 0
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def headers(self, principal: str) -> dict[str, str]:
        token = self.tokens[principal]
        return {"Authorization": f"Bearer {token}"} if token else {}

    def call(self, method: str, path: str, principal: str, body: Any = None) -> requests.Response:
        return requests.request(
            method, self.url + path, json=body, headers=self.headers(principal), timeout=30
        )

    def new_job(self) -> str:
        r = self.call("POST", "/v1/jobs", "user", JOB_BODY)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def new_chat(self) -> str:
        r = self.call("POST", "/v1/chats", "user", {"title": "matrix"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def new_window(self) -> int:
        r = self.call("POST", f"/v1/admin/models/{MODEL}/schedule", "admin", WINDOW_BODY)
        assert r.status_code == 201, r.text
        window_id = int(r.json()["id"])
        self.cleanup.append(lambda: self.delete_window(window_id))
        return window_id

    def delete_window(self, window_id: int) -> None:
        self.call("DELETE", f"/v1/admin/models/{MODEL}/schedule/{window_id}", "admin")

    def new_token_id(self) -> int:
        return self.accounts.issue_token(self.throwaway_user, name="matrix").token_id


JOB_BODY = {"model": MODEL, "prompt": "hello", "params": {"max_new_tokens": 2}}
WINDOW_BODY = {"cron": "0 0 1 1 *", "timezone": "UTC", "min_replicas": 0, "max_replicas": 1}
TGI_BODY = {"inputs": "hello", "model": MODEL, "parameters": {"max_new_tokens": OVER_LIMIT}}
CHAT_COMPLETION = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": OVER_LIMIT,
}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": OVER_LIMIT}

# Expected statuses, by principal; an int or a set of acceptable ints.
Expect = dict[str, int | set[int]]


def everyone(status: int) -> Expect:
    return dict.fromkeys(PRINCIPALS, status)


def token_checked(authed: int | set[int]) -> Expect:
    """Any token holder gets ``authed``; no token, a revoked or expired one: 401."""
    return {
        "anon": 401,
        "revoked": 401,
        "expired": 401,
        **dict.fromkeys(("user", "other", "operator", "admin"), authed),
    }


def token_optional(ok: int) -> Expect:
    """``ok`` without a token or with a valid one; a revoked or expired token: 401."""
    return {**everyone(ok), "revoked": 401, "expired": 401}


def role_checked(roles: tuple[str, ...], ok: int) -> Expect:
    """``ok`` for ``roles``, 403 for other token holders, 401 without a valid token."""
    return {
        **token_checked(403),
        **dict.fromkeys(roles, ok),
    }


def owner_only(ok: int | set[int]) -> Expect:
    """Chats: only their owner sees them; everyone else with a token gets 404."""
    return {**token_checked(404), "user": ok}


def job_visible(ok: int | set[int]) -> Expect:
    """Jobs: the owner, operators and admins see them; another user gets 404."""
    return {**token_checked(ok), "other": 404}


OPERATORS = ("operator", "admin")
ADMINS = ("admin",)

Path = str | Callable[[Farm], str]
Body = Any


@dataclass(frozen=True)
class Case:
    path: Path
    expect: Expect
    body: Body = None
    kind: str = "http"  # http | sse | ws-job | ws-multiplex


def _unique_user(_: Farm) -> dict[str, str]:
    return {"name": f"matrix-{uuid.uuid4().hex[:10]}"}


ROUTES: dict[tuple[str, str], Case] = {
    # Public: no token needed, and none is looked at.
    ("GET", "/healthz"): Case("/healthz", everyone(200)),
    ("GET", "/readyz"): Case("/readyz", everyone(200)),
    ("GET", "/openapi.json"): Case("/openapi.json", everyone(200)),
    ("GET", "/"): Case("/", everyone(200)),
    ("GET", "/ops"): Case("/ops", everyone(200)),
    ("GET", "/assets/<path:filename>"): Case("/assets/app.js", everyone(200)),
    ("GET", "/metrics"): Case("/metrics", everyone(200)),
    # What the caller may use (public models without a token); a bad token is refused.
    ("GET", "/v1/models"): Case("/v1/models", token_optional(200)),
    # Per model: a private model needs a valid token.
    ("GET", "/info"): Case(f"/info?model={MODEL}", token_checked(200)),
    ("POST", "/tokenize"): Case(
        "/tokenize",
        # 503 until the model's tokenizer is cached by a worker's first load.
        token_checked({200, 503}),
        {"model": MODEL, "prompt": "hello"},
    ),
    ("POST", "/"): Case("/", token_checked(422), TGI_BODY),
    ("POST", "/generate"): Case("/generate", token_checked(422), TGI_BODY),
    ("POST", "/generate_stream"): Case("/generate_stream", token_checked(422), TGI_BODY),
    ("POST", "/v1/chat/completions"): Case(
        "/v1/chat/completions", token_checked(422), CHAT_COMPLETION
    ),
    ("POST", "/v1/completions"): Case("/v1/completions", token_checked(422), COMPLETION),
    ("GET", "/v1/ws"): Case("/v1/ws", token_checked(422), kind="ws-multiplex"),
    # Jobs.
    ("POST", "/v1/jobs"): Case("/v1/jobs", token_checked(202), JOB_BODY),
    ("GET", "/v1/jobs"): Case("/v1/jobs", token_checked(200)),
    ("GET", "/v1/jobs/<job_id>"): Case(lambda f: f"/v1/jobs/{f.job_id}", job_visible(200)),
    ("DELETE", "/v1/jobs/<job_id>"): Case(
        lambda f: f"/v1/jobs/{f.new_job()}", job_visible({200, 202})
    ),
    ("GET", "/v1/jobs/<job_id>/events"): Case(
        lambda f: f"/v1/jobs/{f.job_id}/events", job_visible(200), kind="sse"
    ),
    ("GET", "/v1/jobs/<job_id>/ws"): Case(
        lambda f: f"/v1/jobs/{f.job_id}/ws", job_visible(200), kind="ws-job"
    ),
    # Chats: private to their owner, even from operators and admins.
    ("GET", "/v1/chats"): Case("/v1/chats", token_checked(200)),
    ("POST", "/v1/chats"): Case("/v1/chats", token_checked(201), {"title": "matrix"}),
    ("GET", "/v1/chats/<chat_id>"): Case(lambda f: f"/v1/chats/{f.chat_id}", owner_only(200)),
    ("PATCH", "/v1/chats/<chat_id>"): Case(
        lambda f: f"/v1/chats/{f.chat_id}", owner_only(200), {"title": "matrix"}
    ),
    ("DELETE", "/v1/chats/<chat_id>"): Case(lambda f: f"/v1/chats/{f.new_chat()}", owner_only(204)),
    ("POST", "/v1/chats/<chat_id>/messages"): Case(
        lambda f: f"/v1/chats/{f.chat_id}/messages",
        owner_only(201),
        {"role": "user", "content": "hello"},
    ),
    ("GET", "/v1/chats/<chat_id>/messages/<int:message_id>"): Case(
        lambda f: f"/v1/chats/{f.chat_id}/messages/{f.message_id}", owner_only(200)
    ),
    # Users and tokens: admins only.
    ("GET", "/v1/admin/users"): Case("/v1/admin/users", role_checked(ADMINS, 200)),
    ("POST", "/v1/admin/users"): Case("/v1/admin/users", role_checked(ADMINS, 201), _unique_user),
    ("PATCH", "/v1/admin/users/<name>"): Case(
        lambda f: f"/v1/admin/users/{f.throwaway_user}", role_checked(ADMINS, 200), {}
    ),
    ("POST", "/v1/admin/users/<name>/tokens"): Case(
        lambda f: f"/v1/admin/users/{f.throwaway_user}/tokens",
        role_checked(ADMINS, 201),
        {"name": "matrix"},
    ),
    ("GET", "/v1/admin/tokens"): Case("/v1/admin/tokens", role_checked(ADMINS, 200)),
    ("DELETE", "/v1/admin/tokens/<int:token_id>"): Case(
        lambda f: f"/v1/admin/tokens/{f.new_token_id()}", role_checked(ADMINS, 200)
    ),
    # Models, workers and scaling: operators and admins.
    ("GET", "/v1/admin/models"): Case("/v1/admin/models", role_checked(OPERATORS, 200)),
    ("PATCH", "/v1/admin/models/<name>"): Case(
        f"/v1/admin/models/{MODEL}", role_checked(OPERATORS, 200), {}
    ),
    ("GET", "/v1/admin/workers"): Case("/v1/admin/workers", role_checked(OPERATORS, 200)),
    ("GET", "/v1/admin/history"): Case("/v1/admin/history", role_checked(OPERATORS, 200)),
    ("GET", "/v1/admin/scaling"): Case("/v1/admin/scaling", role_checked(OPERATORS, 200)),
    ("GET", "/v1/admin/models/<name>/scaling"): Case(
        f"/v1/admin/models/{MODEL}/scaling", role_checked(OPERATORS, 200)
    ),
    ("PUT", "/v1/admin/models/<name>/scaling"): Case(
        # An empty change changes nothing and answers the current view.
        f"/v1/admin/models/{MODEL}/scaling",
        role_checked(OPERATORS, 200),
        {},
    ),
    ("GET", "/v1/admin/models/<name>/scaling/audit"): Case(
        f"/v1/admin/models/{MODEL}/scaling/audit", role_checked(OPERATORS, 200)
    ),
    ("GET", "/v1/admin/models/<name>/schedule"): Case(
        f"/v1/admin/models/{MODEL}/schedule", role_checked(OPERATORS, 200)
    ),
    ("POST", "/v1/admin/models/<name>/schedule"): Case(
        f"/v1/admin/models/{MODEL}/schedule", role_checked(OPERATORS, 201), WINDOW_BODY
    ),
    ("DELETE", "/v1/admin/models/<name>/schedule/<int:window_id>"): Case(
        lambda f: f"/v1/admin/models/{MODEL}/schedule/{f.new_window()}",
        role_checked(OPERATORS, 204),
    ),
}

# Routes Flask adds itself; they serve no data of ours.
FRAMEWORK_ENDPOINTS = {"static"}


def _url_map_routes(migrated: Settings) -> set[tuple[str, str]]:
    from api import create_app

    app = create_app(migrated)
    try:
        return {
            (method, rule.rule)
            for rule in app.url_map.iter_rules()
            if rule.endpoint not in FRAMEWORK_ENDPOINTS
            for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}
        }
    finally:
        app.extensions["switchyard"].close()


def test_every_route_of_the_app_is_in_the_matrix(migrated: Settings) -> None:
    routes = _url_map_routes(migrated)
    missing = sorted(routes - ROUTES.keys())
    assert not missing, f"routes with no access decision in ROUTES: {missing}"
    stale = sorted(ROUTES.keys() - routes)
    assert not stale, f"ROUTES lists routes the app no longer has: {stale}"


@pytest.fixture(scope="module")
def farm_(migrated: Settings, api_url: str) -> Iterator[Farm]:
    db = Database(migrated.database_url)
    accounts = Accounts(db)
    tokens: dict[str, str | None] = {"anon": None}

    def person(role: Role) -> str:
        name = f"matrix-{role.value}-{uuid.uuid4().hex[:8]}"
        # Generous limits: the matrix submits many jobs that stay queued.
        accounts.add_user(name, role, max_concurrent_jobs=10_000, requests_per_minute=100_000)
        return name

    for principal, role in (
        ("user", Role.user),
        ("other", Role.user),
        ("operator", Role.operator),
        ("admin", Role.admin),
    ):
        tokens[principal] = accounts.issue_token(person(role)).secret
    revoked = accounts.issue_token(person(Role.admin))
    assert accounts.revoke(revoked.token_id)
    tokens["revoked"] = revoked.secret
    past = datetime.now(UTC) - timedelta(hours=1)
    tokens["expired"] = accounts.issue_token(person(Role.admin), expires_at=past).secret

    f = Farm(url=api_url, tokens=tokens, accounts=accounts, throwaway_user=person(Role.user))
    f.job_id = f.new_job()
    f.chat_id = f.new_chat()
    r = f.call("POST", f"/v1/chats/{f.chat_id}/messages", "user", {"role": "user", "content": "hi"})
    assert r.status_code == 201, r.text
    f.message_id = int(r.json()["id"])
    try:
        yield f
    finally:
        for undo in f.cleanup:
            undo()
        db.dispose()


def _ws_status(f: Farm, path: str, principal: str, *, multiplex: bool) -> int:
    """The status a websocket answers: an error frame's ``status``, else 200."""
    url = f.url.replace("http", "ws", 1) + path
    headers = [f"{k}: {v}" for k, v in f.headers(principal).items()]
    ws = websocket.create_connection(url, header=headers, timeout=30)
    try:
        if multiplex:
            frame = {
                "type": "generate",
                "id": "matrix",
                "model": MODEL,
                "prompt": "hello",
                "params": {"max_new_tokens": OVER_LIMIT},
            }
            # Refused at connect, the socket may be closed already: its error frame waits.
            with contextlib.suppress(websocket.WebSocketConnectionClosedException, BrokenPipeError):
                ws.send(json.dumps(frame))
        first = json.loads(ws.recv())
    finally:
        ws.close()
    if first.get("type") == "error":
        return int(first["status"])
    return 200


def _status(f: Farm, method: str, case: Case, principal: str) -> int:
    path = case.path(f) if callable(case.path) else case.path
    body = case.body(f) if callable(case.body) else case.body
    if case.kind in ("ws-job", "ws-multiplex"):
        return _ws_status(f, path, principal, multiplex=case.kind == "ws-multiplex")
    stream = case.kind == "sse"
    with requests.request(
        method,
        f.url + path,
        json=body,
        headers=f.headers(principal),
        stream=stream,
        timeout=30,
    ) as r:
        if r.status_code == 201 and method == "POST" and "/schedule" in path:
            window_id = int(r.json()["id"])
            f.cleanup.append(lambda: f.delete_window(window_id))
        if stream and r.status_code == 200:
            assert r.headers["Content-Type"].startswith("text/event-stream")
        return r.status_code


MATRIX = [
    pytest.param(method, rule, principal, id=f"{method} {rule} as {principal}")
    for (method, rule) in ROUTES
    for principal in PRINCIPALS
]


@pytest.mark.parametrize(("method", "rule", "principal"), MATRIX)
def test_access(farm_: Farm, method: str, rule: str, principal: str) -> None:
    case = ROUTES[(method, rule)]
    expected = case.expect[principal]
    allowed = expected if isinstance(expected, set) else {expected}
    got = _status(farm_, method, case, principal)
    assert got in allowed, f"{method} {rule} as {principal}: {got}, expected {sorted(allowed)}"


def test_another_users_job_is_hidden_as_not_found(farm_: Farm) -> None:
    """What a snooping user reads is the same as for a job that does not exist."""
    mine = farm_.call("GET", f"/v1/jobs/{farm_.job_id}", "other")
    nobody = farm_.call("GET", f"/v1/jobs/{uuid.uuid4()}", "other")
    assert mine.status_code == nobody.status_code == 404
    # The same answer as for an id that was never issued (it names only the id sent).
    assert mine.json()["error_type"] == nobody.json()["error_type"] == "not_found"
    listed = farm_.call("GET", "/v1/jobs", "other").json()
    assert farm_.job_id not in json.dumps(listed)
    assert farm_.call("GET", "/v1/jobs?all=true", "other").status_code == 403
    assert farm_.call("GET", "/v1/jobs?all=true", "operator").status_code == 200


def _serves(expected: int | set[int]) -> bool:
    """Whether a caller who gets ``expected`` passed authentication and authorization."""
    return not ({expected} if isinstance(expected, int) else expected) & {401, 403, 404}


STATE_CHANGING = [
    pytest.param(method, rule, id=f"{method} {rule}")
    for (method, rule) in ROUTES
    if method in ("POST", "PUT", "PATCH", "DELETE")
]


@pytest.mark.parametrize(("method", "rule"), STATE_CHANGING)
def test_no_state_changing_route_serves_another_site(farm_: Farm, method: str, rule: str) -> None:
    """Every route that changes state, called by someone it serves: from a page of another
    origin it is a 403; with a body not sent as JSON (a form or ``text/plain``, which any
    page can make a browser send without asking) a 415."""
    case = ROUTES[(method, rule)]
    principal = next(p for p in ("user", "operator", "admin") if _serves(case.expect[p]))
    headers = farm_.headers(principal)
    body = case.body(farm_) if callable(case.body) else case.body
    path = case.path(farm_) if callable(case.path) else case.path
    r = requests.request(
        method,
        farm_.url + path,
        json=body,
        headers={**headers, "Origin": "https://evil.example"},
        timeout=30,
    )
    assert r.status_code == 403 and "web origin" in r.text, r.text  # each door's envelope
    if body is None:
        return
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = requests.request(
            method,
            farm_.url + path,
            data=json.dumps(body),
            headers={**headers, "Content-Type": content_type},
            timeout=30,
        )
        assert r.status_code == 415, f"{method} {rule} as {principal} ({content_type}): {r.text}"

"""Open-stream caps, anonymous idle close, token re-check on open sockets, ProxyFix (issue 13).

Real Redis and Postgres, the real app on a real socket; each test gets an app
with its own limits.
"""

from __future__ import annotations

import json
import time
from typing import Any

import websocket

from config import Settings
from db.accounts import Accounts
from db.session import Database
from tests import farm


def ws(url: str, token: str | None = None, headers: list[str] | None = None) -> Any:
    extra = list(headers or [])
    if token:
        extra.append(f"Authorization: Bearer {token}")
    return websocket.create_connection(
        url.replace("http", "ws", 1) + "/v1/ws", header=extra, timeout=15
    )


def held(sock: Any) -> Any:
    """``sock`` once the server counts it (its handler answers a ping past the caps)."""
    sock.send(json.dumps({"type": "ping"}))
    assert json.loads(sock.recv())["type"] == "pong"
    return sock


def closed_with(sock: Any) -> tuple[int | None, list[dict[str, Any]]]:
    """Read until the server closes: (close code, text frames before it)."""
    frames = []
    while True:
        opcode, data = sock.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return (int.from_bytes(data[:2], "big") if len(data) >= 2 else None), frames
        if opcode == websocket.ABNF.OPCODE_TEXT:
            frames.append(json.loads(data))


def test_anonymous_sockets_past_the_address_cap_are_closed_with_4029(migrated: Settings) -> None:
    app = migrated.model_copy(update={"streams_per_address": 3, "redis_prefix": "capaddr"})
    with farm.serve_app_in_thread(app) as url:
        holders = [held(ws(url)) for _ in range(3)]
        refused = ws(url)
        code, frames = closed_with(refused)
        assert code == 4029
        assert frames[0]["error_type"] == "too_many_streams" and frames[0]["retry_after"] >= 1
        holders.pop().close()
        time.sleep(0.5)
        again = held(ws(url))  # a freed place can be taken again
        for s in [*holders, again]:
            s.close()


def test_behind_a_trusted_proxy_each_forwarded_address_has_its_own_cap(
    migrated: Settings,
) -> None:
    update = {"streams_per_address": 1, "api_trusted_proxies": 1, "redis_prefix": "capproxy"}
    with farm.serve_app_in_thread(migrated.model_copy(update=update)) as url:
        a = held(ws(url, headers=["X-Forwarded-For: 203.0.113.7"]))
        b = held(ws(url, headers=["X-Forwarded-For: 203.0.113.8"]))
        # A client's own X-Forwarded-For entry before the proxy's is not trusted:
        # only the last hop counts, so this is 203.0.113.7 again.
        c = ws(url, headers=["X-Forwarded-For: 198.51.100.1, 203.0.113.7"])
        assert closed_with(c)[0] == 4029
        a.close()
        b.close()


def test_without_a_trusted_proxy_forwarded_headers_are_ignored(migrated: Settings) -> None:
    update = {"streams_per_address": 1, "redis_prefix": "capnoproxy"}
    with farm.serve_app_in_thread(migrated.model_copy(update=update)) as url:
        a = held(ws(url, headers=["X-Forwarded-For: 203.0.113.7"]))
        b = ws(url, headers=["X-Forwarded-For: 203.0.113.8"])
        assert closed_with(b)[0] == 4029
        a.close()


def test_an_idle_anonymous_socket_is_closed(migrated: Settings) -> None:
    update = {"ws_anonymous_idle_s": 1.0, "redis_prefix": "capidle"}
    with farm.serve_app_in_thread(migrated.model_copy(update=update)) as url:
        sock = ws(url)
        started = time.monotonic()
        code, _ = closed_with(sock)
        assert code == 4408
        assert time.monotonic() - started < 10


def test_a_revoked_token_closes_its_open_socket(migrated: Settings) -> None:
    token = farm.make_token(migrated)
    update = {"ws_token_check_s": 0.5, "redis_prefix": "caprevoke"}
    with farm.serve_app_in_thread(migrated.model_copy(update=update)) as url:
        sock = ws(url, token)
        sock.send(json.dumps({"type": "ping"}))
        assert json.loads(sock.recv())["type"] == "pong"
        db = Database(migrated.database_url)
        try:
            accounts = Accounts(db)
            principal = accounts.authenticate(token)
            assert principal is not None
            accounts.revoke(principal.token_id)
        finally:
            db.dispose()
        revoked_at = time.monotonic()
        code, _ = closed_with(sock)
        assert code == 1008
        assert time.monotonic() - revoked_at < 5

"""A websocket client that never reads is dropped (4008) without hurting anyone else."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import requests

from config import Settings
from tests import farm

CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
# Socket buffers of a congested path: a few KB, so a client that does not read
# fills them within a few frames (loopback buffers would absorb a whole job).
SMALL_BUFFER = 1024


@contextmanager
def serve_with_small_send_buffers(
    settings: Settings, sock_options: dict[str, Any] | None = None
) -> Iterator[str]:
    """The real app on Werkzeug's threaded server, each accepted socket with a small send buffer.

    ``sock_options`` change the websocket server's options (e.g. its ping interval).
    """
    from werkzeug.serving import make_server

    from api import create_app

    app = create_app(settings)
    app.config["SOCK_SERVER_OPTIONS"].update(sock_options or {})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    accept = server.get_request

    def get_request() -> tuple[socket.socket, Any]:
        conn, addr = accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        return conn, addr

    server.get_request = get_request  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        app.extensions["switchyard"].close()


def submit(api_url: str, token: str, max_new_tokens: int) -> str:
    body = {
        "model": "tiny-random",
        "messages": CHAT,
        "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    r = requests.post(
        f"{api_url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize(
    "limits",
    [
        # Few buffered events: the relay's buffer overflows first.
        {"ws_send_timeout_s": 5.0, "relay_max_buffered_events": 16},
        # A buffer larger than the job: the blocked send times out.
        {"ws_send_timeout_s": 1.0, "relay_max_buffered_events": 100_000},
    ],
    ids=["buffer-overflow", "send-timeout"],
)
def test_a_client_that_never_reads_is_dropped_and_others_stream_on(
    migrated: Settings, user_token: str, tiny_worker: farm.Process, limits: dict[str, Any]
) -> None:
    with serve_with_small_send_buffers(migrated.model_copy(update=limits)) as url:
        slow_job = submit(url, user_token, 1024)
        laggard = farm.RawWebSocket(url, f"/v1/jobs/{slow_job}/ws", user_token, SMALL_BUFFER)
        try:
            # Meanwhile a normal client streams another job in full, gapless.
            normal_job = submit(url, user_token, 64)
            frames = farm.ws_events(url, normal_job, user_token)
            assert [f["seq"] for f in frames] == list(range(len(frames)))
            assert frames[-1]["type"] == "done"
            assert farm.wait_final(url, user_token, normal_job)["status"] == "succeeded"

            # The laggard's job runs to its end regardless.
            final = farm.wait_final(url, user_token, slow_job)
            assert final["status"] == "succeeded"
            assert final["usage"]["completion_tokens"] > 0

            # The server closed the laggard: with 4008 when the close frame could
            # go out, at least by closing the connection, never by a full stream.
            laggard.read_until_closed(timeout=60)
            got = laggard.frames()
            assert laggard.close_code() in (4008, None)
            assert not got or got[-1]["type"] != "done"
            assert [f["seq"] for f in got] == list(range(len(got)))

            # Re-attaching with ?after= gives the rest of the stream.
            after = got[-1]["seq"] if got else -1
            rest = farm.ws_events(url, slow_job, user_token, after=after)
            assert [f["seq"] for f in rest] == list(range(after + 1, after + 1 + len(rest)))
            assert rest[-1]["type"] == "done"
        finally:
            laggard.sock.close()

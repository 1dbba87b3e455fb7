"""A websocket client that never reads is dropped (4008) without hurting anyone else."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import requests
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

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


def wait_final(api_url: str, token: str, job_id: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = requests.get(
            f"{api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        job = r.json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not final after {timeout} s")


class Laggard:
    """A raw websocket client that completes the handshake, then reads nothing."""

    def __init__(self, api_url: str, job_id: str, token: str) -> None:
        host, port = api_url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        self.sock.connect((host, int(port)))
        self.ws = WSConnection(ConnectionType.CLIENT)
        request = Request(
            host=f"{host}:{port}",
            target=f"/v1/jobs/{job_id}/ws",
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
        )
        self.sock.sendall(self.ws.send(request))
        self.events: list[Any] = []
        self.sock.settimeout(30)
        while not any(isinstance(e, AcceptConnection) for e in self.events):
            self._feed(self.sock.recv(1024))

    def _feed(self, data: bytes) -> None:
        self.ws.receive_data(data or None)
        self.events.extend(self.ws.events())

    def read_until_closed(self, timeout: float) -> None:
        """Read everything the server sent; returns when it closed the connection."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(5)
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            except TimeoutError:
                continue
            if not data:
                return
            self._feed(data)
            if any(isinstance(e, CloseConnection) for e in self.events):
                return
        raise AssertionError(f"the server did not close the laggard within {timeout} s")

    def frames(self) -> list[dict[str, Any]]:
        """The complete text frames received (wsproto hands them over in pieces)."""
        frames, pending = [], ""
        for event in self.events:
            if isinstance(event, TextMessage):
                pending += event.data
                if event.message_finished:
                    frames.append(json.loads(pending))
                    pending = ""
        return frames

    def close_code(self) -> int | None:
        closes = [e for e in self.events if isinstance(e, CloseConnection)]
        return closes[0].code if closes else None


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
        laggard = Laggard(url, slow_job, user_token)
        try:
            # Meanwhile a normal client streams another job in full, gapless.
            normal_job = submit(url, user_token, 64)
            frames = farm.ws_events(url, normal_job, user_token)
            assert [f["seq"] for f in frames] == list(range(len(frames)))
            assert frames[-1]["type"] == "done"
            assert wait_final(url, user_token, normal_job)["status"] == "succeeded"

            # The laggard's job runs to its end regardless.
            final = wait_final(url, user_token, slow_job)
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

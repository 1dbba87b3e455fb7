"""Websocket abuse: a /v1/ws client that never reads, 16 MB frames, 10,000 messages at once.

Each is refused or cut off with a clear close code; the API stays up and
another client streams a job meanwhile without a gap.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any

import pytest
import requests
import websocket
from wsproto.events import TextMessage

from config import Settings
from tests import farm
from tests.integration.test_slow_client import SMALL_BUFFER, serve_with_small_send_buffers

CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
FLOOD = 10_000


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def ws_url(api_url: str, path: str) -> str:
    return api_url.replace("http", "ws", 1) + path


def stream_normally(url: str, token: str) -> list[dict[str, Any]]:
    body = {"model": "tiny-random", "messages": CHAT, "params": {"max_new_tokens": 64}}
    r = requests.post(f"{url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    return farm.ws_events(url, r.json()["id"], token)


def assert_gapless(frames: list[dict[str, Any]]) -> None:
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert frames[-1]["type"] == "done"


def test_a_multiplexed_socket_that_never_reads_is_dropped_on_buffer_overflow(
    migrated: Settings, tiny_worker: farm.Process
) -> None:
    # A send timeout and a ping interval far beyond the test (a client that never
    # reads never answers a ping either: 1008): only the relay buffer's overflow
    # can drop it.
    limits = {"ws_send_timeout_s": 600.0, "relay_max_buffered_events": 4}
    token = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    app = migrated.model_copy(update=limits)
    with serve_with_small_send_buffers(app, {"ping_interval": 3600}) as url:
        laggard = farm.RawWebSocket(url, "/v1/ws", token, SMALL_BUFFER)
        try:
            laggard.send_json(
                {
                    "type": "generate",
                    "id": "slow",
                    "model": "tiny-random",
                    "messages": CHAT,
                    "params": {"max_new_tokens": 1024},
                }
            )
            assert_gapless(stream_normally(url, token))
            # Its job ends before the laggard reads anything: the drop (on the buffer's
            # overflow) closed the socket, which cancels the socket's jobs.
            jobs = requests.get(f"{url}/v1/jobs?limit=2", headers=auth(token), timeout=30)
            slow = next(j for j in jobs.json()["data"] if j["params"]["max_new_tokens"] == 1024)
            final = farm.wait_final(url, token, slow["id"])
            assert final["status"] == "cancelled", final
            laggard.read_until_closed(timeout=60)
            assert laggard.close_code() in (4008, None)
            got = laggard.frames()
            assert got and got[0]["type"] == "queued" and got[0]["job_id"] == slow["id"]
            assert got[-1]["type"] != "done"
        finally:
            laggard.sock.close()


@pytest.mark.parametrize("path", ["/v1/ws", "/v1/jobs/{job}/ws"])
def test_a_16_mb_frame_closes_the_socket_with_1009(
    api_url: str, migrated: Settings, tiny_worker: farm.Process, path: str
) -> None:
    token = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    body = {"model": "tiny-late", "prompt": "hello", "params": {"max_new_tokens": 2}}
    job = requests.post(f"{api_url}/v1/jobs", json=body, headers=auth(token), timeout=30).json()
    raw = farm.RawWebSocket(api_url, path.format(job=job["id"]), token, SMALL_BUFFER)
    huge = raw.ws.send(TextMessage(data="x" * (16 * 1024 * 1024)))

    def send_huge() -> None:
        with contextlib.suppress(OSError):  # the server stops reading past the limit
            raw.sock.sendall(huge)

    sender = threading.Thread(target=send_huge, daemon=True)
    try:
        sender.start()
        raw.read_until_closed(timeout=120)
        assert raw.close_code() == 1009
        assert all(f["type"] == "queued" for f in raw.frames())
    finally:
        with contextlib.suppress(OSError):
            raw.sock.shutdown(socket.SHUT_RDWR)  # wakes the sender if it still waits
        raw.sock.close()
        sender.join(timeout=30)
        requests.delete(f"{api_url}/v1/jobs/{job['id']}", headers=auth(token), timeout=30)
    # The API serves everyone else on.
    assert_gapless(stream_normally(api_url, token))


def test_10000_messages_at_once_are_rate_limited_then_the_socket_is_closed(
    api_url: str, migrated: Settings, tiny_worker: farm.Process
) -> None:
    limited = farm.make_token(migrated, max_concurrent_jobs=3, requests_per_minute=1000)
    other = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    flood = websocket.create_connection(
        ws_url(api_url, "/v1/ws"), header=[f"Authorization: Bearer {limited}"], timeout=60
    )
    frames: list[dict[str, Any]] = []
    close: list[int] = []

    def read() -> None:
        try:
            while True:
                opcode, frame = flood.recv_data_frame(True)
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    close.append(int.from_bytes(frame.data[:2], "big"))
                    return
                if opcode == websocket.ABNF.OPCODE_TEXT:
                    frames.append(json.loads(frame.data))
        except (OSError, websocket.WebSocketException):
            return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    normal: list[dict[str, Any]] = []
    streamer = threading.Thread(target=lambda: normal.extend(stream_normally(api_url, other)))
    streamer.start()
    sent = 0
    try:
        for i in range(FLOOD):
            kind = "generate" if i % 2 == 0 else "ping"
            frame = {"type": kind, "id": f"m{i}", "model": "tiny-late", "prompt": "hi"}
            flood.send(json.dumps(frame))
            sent += 1
    except (OSError, websocket.WebSocketException):
        pass  # closed by the server mid-flood
    reader.join(timeout=120)
    streamer.join(timeout=180)
    flood.close()

    errors = [f for f in frames if f["type"] == "error"]
    rate_limited = [f for f in errors if f["error_type"] == "rate_limited" and f["id"] is None]
    assert rate_limited, "no message was refused for its rate"
    assert all(f["status"] == 429 and f["retry_after"] >= 1 for f in rate_limited)
    print(
        f"flood: {sent} of {FLOOD} messages sent before the close, {len(frames)} frames back "
        f"({len(rate_limited)} rate_limited), close {close}"
    )
    # The server closed the socket: with a 1008 close frame, or, when the close
    # lands while the client is still sending, a TCP reset that can discard
    # that frame before the client reads it.
    assert not reader.is_alive(), "the flooding socket was not closed"
    assert close in ([1008], []), close
    acted_on = [f for f in frames if not (f["type"] == "error" and f["id"] is None)]
    assert len(acted_on) < FLOOD // 10, "most of the flood was acted on"
    # Generate frames went through the user's own limits: at most 3 jobs at once.
    queued = [f for f in frames if f["type"] == "queued"]
    assert 1 <= len(queued) <= 3
    assert any(f["type"] == "error" and f["status"] == 429 and f["id"] for f in errors)
    jobs = requests.get(f"{api_url}/v1/jobs?limit=100", headers=auth(limited), timeout=30)
    assert len(jobs.json()["data"]) == len(queued)
    for f in queued:  # the close cancelled them
        assert farm.wait_final(api_url, limited, f["job_id"])["status"] == "cancelled"
    # The API stayed up and the other client got its whole stream.
    assert_gapless(normal)
    assert requests.get(f"{api_url}/healthz", timeout=30).status_code == 200

"""An SSE client that never reads is cut off under gunicorn, as a slow websocket is.

The API runs under gunicorn (gthread, one process of four threads) with 1 KiB
send buffers on its sockets; two raw clients send their request (job events,
and an OpenAI streaming completion) and never read. Meanwhile a normal client
streams a job in full. The laggards' connections are closed by the server's
write timeout (``SWITCHYARD_WS_SEND_TIMEOUT_S``): the per-job stream's job runs
on, the OpenAI stream's job is cancelled, and afterwards all four threads
serve streams at once again.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from config import Settings
from config.settings import PROJECT_ROOT
from tests import farm

THREADS = 4
SEND_TIMEOUT_S = 2.0
SMALL_BUFFER = 1024
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


@contextmanager
def gunicorn_small_buffers(settings: Settings, log_dir: Path) -> Iterator[str]:
    port = farm.free_port()
    env = {
        **farm.settings_env(settings),
        "SWITCHYARD_API_PORT": str(port),
        "SWITCHYARD_API_WORKERS": "1",
        "SWITCHYARD_API_THREADS": str(THREADS),
        "SWITCHYARD_WS_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
    }
    conf = PROJECT_ROOT / "tests" / "integration" / "gunicorn_small_buffers.py"
    argv = [sys.executable, "-m", "gunicorn", "-c", str(conf), "api:create_app()"]
    proc = farm.Process(argv, env, log_dir / f"gunicorn-sse-{time.time_ns()}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        farm.wait_http(url + "/healthz")
        yield url
    finally:
        proc.stop()


class SilentClient:
    """A raw HTTP client that sends one request, then reads nothing until told to."""

    def __init__(self, url: str, method: str, path: str, token: str, body: Any = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        self.sock.connect((host, int(port)))
        payload = json.dumps(body).encode() if body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)

    def drain(self, quiet_s: float = 5.0, timeout: float = 120) -> tuple[bytes, bool]:
        """Everything the server sent, and whether it closed the connection (else it
        went quiet for ``quiet_s`` with the connection open)."""
        data = b""
        self.sock.settimeout(quiet_s)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return data, True
            except TimeoutError:
                return data, False
            if not chunk:
                return data, True
            data += chunk
        return data, False

    def close(self) -> None:
        self.sock.close()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def submit(url: str, token: str, model: str, max_new_tokens: int) -> str:
    body = {"model": model, "messages": CHAT, "params": {"max_new_tokens": max_new_tokens}}
    r = requests.post(f"{url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def first_event_of_each(url: str, token: str, job_ids: list[str]) -> list[str]:
    """Open one SSE stream per job at once; each waits until all have their first event.

    Only as many streams as there are free threads can be served at once, so
    this passes only when every one of the server's threads is free.
    """
    barrier = threading.Barrier(len(job_ids), timeout=60)

    def first(job_id: str) -> str:
        with requests.get(
            f"{url}/v1/jobs/{job_id}/events", headers=auth(token), stream=True, timeout=60
        ) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    barrier.wait()
                    return str(line.removeprefix("event: "))
        raise AssertionError("the stream ended without an event")

    with ThreadPoolExecutor(len(job_ids)) as pool:
        return list(pool.map(first, job_ids))


def test_sse_clients_that_never_read_are_cut_off_and_free_their_threads(
    migrated: Settings, tiny_worker: farm.Process, log_dir: Path
) -> None:
    token = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    with gunicorn_small_buffers(migrated, log_dir) as url:
        events_job = submit(url, token, "tiny-random", 1024)
        events_laggard = SilentClient(url, "GET", f"/v1/jobs/{events_job}/events", token)
        chat = {"model": "tiny-random", "messages": CHAT, "max_tokens": 1024, "stream": True}
        openai_laggard = SilentClient(url, "POST", "/v1/chat/completions", token, chat)
        try:
            # A normal client streams a whole job meanwhile, gapless.
            normal = submit(url, token, "tiny-random", 64)
            events = farm.sse_events(url, normal, token)
            assert [e["seq"] for e in events] == list(range(len(events)))
            assert events[-1]["type"] == "done"

            # The per-job stream's job runs to its end regardless of its reader.
            assert farm.wait_final(url, token, events_job)["status"] == "succeeded"
            # Every write the laggards did not take has timed out by now.
            time.sleep(3 * SEND_TIMEOUT_S + migrated.stream_keepalive_s)

            data, closed = events_laggard.drain()
            assert closed, "the server kept the never-reading SSE client's connection"
            assert data.startswith(b"HTTP/1.1 200")
            assert b"event: done" not in data  # cut off, not a full stream

            data, closed = openai_laggard.drain()
            assert closed, "the server kept the never-reading OpenAI stream's connection"
            head = data.split(b"\r\n\r\n", 1)[0].decode()
            job_id = next(
                line.split(":", 1)[1].strip()
                for line in head.split("\r\n")
                if line.lower().startswith("x-job-id:")
            )
            assert b"[DONE]" not in data
            # Client gone (it stopped reading) = the job is cancelled.
            assert farm.wait_final(url, token, job_id)["status"] == "cancelled"
        finally:
            events_laggard.close()
            openai_laggard.close()

        # Every thread is free again: as many streams as threads are served at once.
        waiting = [submit(url, token, "tiny-late", 4) for _ in range(THREADS)]
        try:
            assert first_event_of_each(url, token, waiting) == ["queued"] * THREADS
        finally:
            for job_id in waiting:
                requests.delete(f"{url}/v1/jobs/{job_id}", headers=auth(token), timeout=30)

    # Each cut-off is one line in the API's log, not a traceback.
    log = max(log_dir.glob("gunicorn-sse-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "closed a client that stopped reading" in log
    assert "Socket error processing request" not in log

"""``WS /v1/ws``: many requests on one socket, cancel, detach and re-attach, auth."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from config import Settings
from tests import farm

CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def token(migrated: Settings) -> str:
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


def connect(
    api_url: str, token: str | None = None, headers: tuple[str, ...] = (), **kwargs: Any
) -> websocket.WebSocket:
    url = api_url.replace("http", "ws", 1) + "/v1/ws"
    auth = [f"Authorization: Bearer {token}"] if token else []
    return websocket.create_connection(url, header=[*auth, *headers], timeout=120, **kwargs)


def frames_until(ws: websocket.WebSocket, done: set[str]) -> list[dict[str, Any]]:
    """Frames until every request id in ``done`` got its final frame."""
    frames = []
    pending = set(done)
    while pending:
        frame = json.loads(ws.recv())
        frames.append(frame)
        if frame["type"] in ("done", "error") and frame.get("id") in pending:
            pending.discard(frame["id"])
    return frames


def job_status(api_url: str, token: str, job_id: str, final: bool = True) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        r = requests.get(
            f"{api_url}/v1/jobs/{job_id}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        job = dict(r.json())
        if not final or job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def test_two_concurrent_requests_and_a_cancel_on_one_socket(
    api_url: str, migrated: Settings, tiny_worker: farm.Process
) -> None:
    # An operator's socket: the worker a job runs on is shown to operators only.
    token = farm.make_token(migrated, "operator", max_concurrent_jobs=0, requests_per_minute=0)
    ws = connect(api_url, token)
    try:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv())["type"] == "pong"
        for rid, n in (("a", 24), ("b", 1024)):
            ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": rid,
                        "model": "tiny-random",
                        "messages": CHAT,
                        "params": {"max_new_tokens": n, "temperature": 0},
                    }
                )
            )
        frames: list[dict[str, Any]] = []
        # Cancel "b" once it has produced some text.
        while not any(f["type"] == "token" and f["id"] == "b" for f in frames):
            frames.append(json.loads(ws.recv()))
        ws.send(json.dumps({"type": "cancel", "id": "b"}))
        frames += frames_until(ws, {"a", "b"})
    finally:
        ws.close()
    by_id: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for f in frames:
        by_id[f["id"]].append(f)
    for rid, own in by_id.items():
        assert own[0]["type"] == "queued" and own[0]["position"] >= 0, rid
        text = "".join(f["text"] for f in own if f["type"] == "token")
        assert own[-1]["type"] == "done"
        assert own[-1]["text"] == text
        # The same fields as the job's own stream: which attempt, on which worker.
        started = [f for f in own if f["type"] == "started"]
        assert len(started) == 1 and started[0]["attempt"] == 1 and started[0]["worker"], rid
    assert by_id["a"][-1]["finish_reason"] in ("length", "eos_token")
    assert by_id["b"][-1]["finish_reason"] == "cancelled"
    job_b = job_status(api_url, token, by_id["b"][0]["job_id"])
    assert job_b["status"] == "cancelled"


def test_bad_frames_get_error_frames_and_the_socket_stays(api_url: str, token: str) -> None:
    ws = connect(api_url, token)
    try:
        ws.send("not json")
        assert json.loads(ws.recv())["status"] == 400
        ws.send(json.dumps({"type": "generate", "id": "x", "model": "tiny-random"}))
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["id"] == "x" and error["status"] == 422
        ws.send(json.dumps({"type": "generate", "id": "y", "model": "nope", "prompt": "hi"}))
        error = json.loads(ws.recv())
        assert error["status"] == 404 and error["field"] == "model"
        ws.send(json.dumps({"type": "cancel", "id": "never"}))
        assert json.loads(ws.recv())["status"] == 404
        ws.send(json.dumps({"type": "launch"}))
        assert json.loads(ws.recv())["field"] == "type"
        ws.send(json.dumps({"type": "ping", "id": "still-here"}))
        assert json.loads(ws.recv()) == {"type": "pong", "id": "still-here"}
    finally:
        ws.close()


def test_closing_cancels_but_a_detached_job_can_be_reattached(
    api_url: str, token: str, tiny_worker: farm.Process
) -> None:
    ws = connect(api_url, token)
    try:
        for rid, detach in (("kept", True), ("dropped", False)):
            ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": rid,
                        # tiny-late has no worker: both jobs wait in the queue.
                        "model": "tiny-late",
                        "prompt": "hello",
                        "params": {"max_new_tokens": 4},
                        "detach": detach,
                    }
                )
            )
        queued = {}
        while len(queued) < 2:
            frame = json.loads(ws.recv())
            if frame["type"] == "queued":
                queued[frame["id"]] = frame["job_id"]
    finally:
        ws.close()
    assert job_status(api_url, token, queued["dropped"])["status"] == "cancelled"
    time.sleep(1.0)
    kept = job_status(api_url, token, queued["kept"], final=False)
    assert kept["status"] == "queued"
    # The page comes back: re-attach, then cancel through the job resource.
    requests.delete(
        f"{api_url}/v1/jobs/{queued['kept']}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    events = farm.ws_events(api_url, queued["kept"], token)
    assert [e["type"] for e in events] == ["queued", "done"]


def test_websocket_auth(api_url: str, token: str, tiny_worker: farm.Process) -> None:
    # No token: a private model is refused, per request, with a 401 frame.
    ws = connect(api_url)
    try:
        ws.send(json.dumps({"type": "generate", "id": "r", "model": "tiny-random", "prompt": "hi"}))
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["status"] == 401 and frame["id"] == "r"
    finally:
        ws.close()
    # A browser's way: the token as a subprotocol, never in the URL.
    ws = connect(api_url, subprotocols=["switchyard", f"bearer.{token}"])
    try:
        assert ws.getsubprotocol() == "switchyard"
        ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "r",
                    "model": "tiny-random",
                    "prompt": "hi",
                    "params": {"max_new_tokens": 4},
                }
            )
        )
        frames = frames_until(ws, {"r"})
        assert frames[-1]["type"] == "done"
    finally:
        ws.close()
    # A bad token closes the socket with a policy violation.
    ws = connect(api_url, "sy_wrong")
    try:
        assert json.loads(ws.recv())["status"] == 401
        opcode, close = ws.recv_data_frame(True)
        assert opcode == websocket.ABNF.OPCODE_CLOSE
        assert int.from_bytes(close.data[:2], "big") == 1008
    finally:
        ws.close()


def test_queue_position_is_sent_again_when_it_changes(api_url: str, token: str) -> None:
    ws = connect(api_url, token)
    try:
        for rid in ("first", "second"):
            ws.send(
                json.dumps({"type": "generate", "id": rid, "model": "tiny-late", "prompt": "hello"})
            )
        positions: dict[str, list[int]] = {"first": [], "second": []}
        while not (positions["first"] and positions["second"]):
            frame = json.loads(ws.recv())
            if frame["type"] == "queued":
                positions[frame["id"]].append(frame["position"])
        assert positions["second"][0] == positions["first"][0] + 1
        ws.send(json.dumps({"type": "cancel", "id": "first"}))
        while len(positions["second"]) < 2:
            frame = json.loads(ws.recv())
            if frame["type"] == "queued":
                positions[frame["id"]].append(frame["position"])
        assert positions["second"][1] == positions["second"][0] - 1
        ws.send(json.dumps({"type": "cancel", "id": "second"}))
        frames_until(ws, {"second"})
    finally:
        ws.close()


def test_a_job_waiting_for_a_starting_worker_is_told_how_far_it_is(
    api_url: str, token: str, migrated: Settings, log_dir: Path
) -> None:
    """No ready worker: ``waiting`` frames say how many start and, from the model's last
    start, how far along they are; then the job runs as usual."""
    model = "tiny-slow"
    first = farm.start_worker(migrated, model, log_dir)  # its start time is recorded
    try:
        farm.wait_ready(migrated, model, first)
    finally:
        first.stop()
    ws = connect(api_url, token)
    second: farm.Process | None = None
    try:
        ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "w",
                    "model": model,
                    "messages": CHAT,
                    "params": {"max_new_tokens": 4, "temperature": 0},
                }
            )
        )
        frames = [json.loads(ws.recv()), json.loads(ws.recv())]
        assert [f["type"] for f in frames] == ["queued", "waiting"], frames
        assert frames[1]["replicas_starting"] == 0 and frames[1]["id"] == "w"
        second = farm.start_worker(migrated, model, log_dir)
        frames += frames_until(ws, {"w"})
    finally:
        ws.close()
        if second is not None:
            second.stop()
    loading = [f for f in frames if f["type"] == "waiting" and f["replicas_starting"] == 1]
    assert loading, frames
    progress = [f["progress"] for f in loading]
    assert all(isinstance(p, float | int) and 0 <= p <= 99 for p in progress), loading
    assert progress == sorted(progress)
    assert all(f["eta_s"] >= 0 for f in loading)
    kinds = [f["type"] for f in frames]
    assert kinds.index("started") > kinds.index("waiting")
    assert kinds[-1] == "done"


def test_a_jobs_own_streams_carry_waiting_frames_only_when_asked(api_url: str, token: str) -> None:
    """``?waiting=1`` on a job's websocket and SSE stream: ``waiting`` frames without a
    seq (not events of its log); without it, the streams are as they always were."""
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": "tiny-late", "prompt": "hello", "params": {"max_new_tokens": 4}}
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    url = api_url.replace("http", "ws", 1) + f"/v1/jobs/{job_id}/ws"
    try:
        auth = [f"Authorization: Bearer {token}"]
        asked = websocket.create_connection(url + "?waiting=1", header=auth, timeout=30)
        plain = websocket.create_connection(url, header=auth, timeout=5)
        try:
            assert json.loads(asked.recv())["type"] == "queued"
            waiting = json.loads(asked.recv())
            assert waiting == {
                "type": "waiting",
                "replicas_starting": 0,
                "progress": None,
                "eta_s": None,
            }
            assert json.loads(plain.recv())["type"] == "queued"
            with pytest.raises(websocket.WebSocketTimeoutException):
                plain.recv()  # keep-alive ticks only: nothing new to read
        finally:
            asked.close()
            plain.close()
        with requests.get(
            f"{api_url}/v1/jobs/{job_id}/events?waiting=1",
            headers={**headers, "Accept": "text/event-stream"},
            stream=True,
            timeout=30,
        ) as sse:
            lines = sse.iter_lines(decode_unicode=True)
            seen: list[str] = []
            for line in lines:
                seen.append(line)
                if line.startswith("data:") and "waiting" in line:
                    break
        block = seen[seen.index("event: waiting") :]
        assert not any(line.startswith("id:") for line in block), seen
        assert json.loads(block[1][len("data: ") :])["replicas_starting"] == 0
    finally:
        requests.post(f"{api_url}/v1/jobs/{job_id}/cancel", headers=headers, timeout=30)


def test_each_job_of_a_socket_has_its_own_request_id(
    api_url: str, token: str, tiny_worker: farm.Process
) -> None:
    """A frame's ``request_id``, else the handshake's id and the job's number on the socket."""
    ws = connect(api_url, token, headers=("X-Request-ID: sock-7",))
    try:
        for rid, extra in (("a", {"request_id": "chat-turn-1"}), ("b", {}), ("c", {})):
            frame = {"type": "generate", "id": rid, "model": "tiny-random", "prompt": "hi"}
            ws.send(json.dumps({**frame, "params": {"max_new_tokens": 2}, **extra}))
        ws.send(json.dumps({**frame, "id": "d", "request_id": "has space"}))
        frames = frames_until(ws, {"a", "b", "c", "d"})
    finally:
        ws.close()
    queued = {f["id"]: f for f in frames if f["type"] == "queued"}
    assert {k: f["request_id"] for k, f in queued.items()} == {
        "a": "chat-turn-1",
        "b": "sock-7.2",
        "c": "sock-7.3",
    }
    refused = next(f for f in frames if f["id"] == "d")
    assert refused["status"] == 422 and refused["field"] == "request_id"
    for rid, f in queued.items():
        job = job_status(api_url, token, f["job_id"], final=False)
        assert job["request_id"] == queued[rid]["request_id"]

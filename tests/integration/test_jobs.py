"""The spine through real Postgres, Redis and a Celery worker process (tiny model)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from config import Settings
from tests import farm

CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


def submit(api_url: str, token: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(
        f"{api_url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def submit_ok(api_url: str, token: str, model: str = "tiny-random", **params: Any) -> str:
    params = {"max_new_tokens": 24, "temperature": 0, **params}
    r = submit(api_url, token, {"model": model, "messages": CHAT, "params": params})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["stream"] == {
        "ws": f"/v1/jobs/{body['id']}/ws",
        "events": f"/v1/jobs/{body['id']}/events",
    }
    return str(body["id"])


def get_job(api_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(
        f"{api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_final(api_url: str, token: str, job_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_job(api_url, token, job_id)
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not final after {timeout} s")


def assert_gapless(events: list[dict[str, Any]], start: int = 0) -> None:
    assert [e["seq"] for e in events] == list(range(start, start + len(events)))


def test_job_streams_over_websocket_and_row_matches(
    api_url: str, user_token: str, admin_token: str, tiny_worker: farm.Process
) -> None:
    job_id = submit_ok(api_url, user_token)
    events = farm.ws_events(api_url, job_id, user_token)
    assert_gapless(events)
    types = [e["type"] for e in events]
    assert types[0] == "queued" and types[1] == "started" and types[-1] == "done"
    assert set(types[2:-1]) == {"token"}
    text = "".join(e["text"] for e in events if e["type"] == "token")
    done = events[-1]
    assert done["text"] == text
    assert done["finish_reason"] in ("length", "eos_token")
    # Read by an admin: the worker's name is for operators (api/disclosure.py).
    job = wait_final(api_url, admin_token, job_id)
    assert job["status"] == "succeeded"
    assert job["output_text"] == text
    assert job["usage"]["prompt_tokens"] > 0
    assert job["usage"]["completion_tokens"] == done["usage"]["completion_tokens"] > 0
    assert job["attempts"] == 1
    assert job["worker"].startswith("tiny-random@")
    stamps = job["timestamps"]
    assert stamps["queued"] <= stamps["started"] <= stamps["first_token"] <= stamps["finished"]


def test_late_subscriber_replay_after_and_twins(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    job_id = submit_ok(api_url, user_token)
    live = farm.ws_events(api_url, job_id, user_token)
    wait_final(api_url, user_token, job_id)
    late = farm.ws_events(api_url, job_id, user_token)
    assert late == live  # the whole history, after done
    k = 2
    tail = farm.ws_events(api_url, job_id, user_token, after=k)
    assert tail == live[k + 1 :]
    sse = farm.sse_events(api_url, job_id, user_token)
    assert sse == live
    sse_tail = farm.sse_events(api_url, job_id, user_token, last_event_id=k)
    assert sse_tail == live[k + 1 :]


def test_two_concurrent_subscribers_see_identical_streams(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    job_id = submit_ok(api_url, user_token, max_new_tokens=64)
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(farm.ws_events, api_url, job_id, user_token)
        b = pool.submit(farm.sse_events, api_url, job_id, user_token)
        first, second = a.result(), b.result()
    assert first == second
    assert_gapless(first)
    assert first[-1]["type"] == "done"


def test_seeded_sampling_is_reproducible(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    texts = []
    for _ in range(2):
        job_id = submit_ok(api_url, user_token, temperature=0.9, top_p=0.9, seed=1234)
        texts.append(wait_final(api_url, user_token, job_id)["output_text"])
    assert texts[0] == texts[1] and texts[0]


def test_worker_error_fails_the_job_with_an_error_event(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    # tiny-random accepts at most 512 input tokens: the worker refuses this prompt.
    long_prompt = "word " * 2000
    r = submit(api_url, user_token, {"model": "tiny-random", "prompt": long_prompt})
    assert r.status_code == 202
    job_id = r.json()["id"]
    events = farm.ws_events(api_url, job_id, user_token)
    assert events[-1]["type"] == "error"
    assert "512" in events[-1]["error"]
    job = wait_final(api_url, user_token, job_id)
    assert job["status"] == "failed" and "512" in job["error"]


def test_cancel_queued_job_is_never_started_and_queued_job_runs_when_worker_starts(
    api_url: str, user_token: str, migrated: Settings, log_dir: Path
) -> None:
    # No worker serves tiny-late yet: both jobs wait in the queue.
    cancelled = submit_ok(api_url, user_token, model="tiny-late")
    waiting = submit_ok(api_url, user_token, model="tiny-late")
    time.sleep(0.5)
    assert get_job(api_url, user_token, waiting)["status"] == "queued"
    r = requests.delete(
        f"{api_url}/v1/jobs/{cancelled}",
        headers={"Authorization": f"Bearer {user_token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    events = farm.ws_events(api_url, cancelled, user_token)
    assert [e["type"] for e in events] == ["queued", "done"]
    assert events[-1]["finish_reason"] == "cancelled"

    # A private model is listed to token holders only.
    auth = {"Authorization": f"Bearer {user_token}"}
    models = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()["data"]
    late = next(m for m in models if m["id"] == "tiny-late")
    assert late["state"]["replicas_ready"] == 0
    assert late["state"]["queue_depth"] >= 1

    proc = farm.start_worker(migrated, "tiny-late", log_dir)
    try:
        farm.wait_ready(migrated, "tiny-late", proc)
        job = wait_final(api_url, user_token, waiting)
        assert job["status"] == "succeeded"
        models = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()["data"]
        assert next(m for m in models if m["id"] == "tiny-late")["state"]["replicas_ready"] == 1
        time.sleep(1.0)
        final = get_job(api_url, user_token, cancelled)
        assert final["status"] == "cancelled" and final["attempts"] == 0 and final["worker"] is None
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_cancel_a_running_job_stops_it_with_the_text_so_far(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    import websocket

    job_id = submit_ok(api_url, user_token, max_new_tokens=1024)
    url = api_url.replace("http", "ws", 1) + f"/v1/jobs/{job_id}/ws"
    ws = websocket.create_connection(
        url, header=[f"Authorization: Bearer {user_token}"], timeout=120
    )
    frames = []
    try:
        while not any(f["type"] == "token" for f in frames):
            frames.append(json.loads(ws.recv()))
        r = requests.delete(
            f"{api_url}/v1/jobs/{job_id}",
            headers={"Authorization": f"Bearer {user_token}"},
            timeout=30,
        )
        assert r.status_code == 202, r.text
        assert r.json()["cancel_requested"] is True
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv()))
    finally:
        ws.close()
    assert_gapless(frames)
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert done["text"] == text
    job = wait_final(api_url, user_token, job_id)
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled"
    assert job["output_text"] == text
    assert 0 < job["usage"]["completion_tokens"] < 1024
    # The slot is free again: the next job runs to completion.
    follow = submit_ok(api_url, user_token)
    assert wait_final(api_url, user_token, follow)["status"] == "succeeded"


def test_other_users_job_is_not_found(
    api_url: str,
    user_token: str,
    other_user_token: str,
    admin_token: str,
    tiny_worker: farm.Process,
) -> None:
    job_id = submit_ok(api_url, user_token)
    r = requests.get(
        f"{api_url}/v1/jobs/{job_id}",
        headers={"Authorization": f"Bearer {other_user_token}"},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    r = requests.delete(
        f"{api_url}/v1/jobs/{job_id}",
        headers={"Authorization": f"Bearer {other_user_token}"},
        timeout=30,
    )
    assert r.status_code == 404
    assert get_job(api_url, admin_token, job_id)["id"] == job_id
    wait_final(api_url, user_token, job_id)


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"model": "tiny-random"}, 422, "(body)"),
        ({"model": "tiny-random", "messages": "hi"}, 422, "messages"),
        (
            {"model": "tiny-random", "messages": [{"role": "wizard", "content": "x"}]},
            422,
            "messages.0.role",
        ),
        (
            {"model": "tiny-random", "prompt": "x", "params": {"temperature": "hot"}},
            422,
            "params.temperature",
        ),
        (
            {"model": "tiny-random", "prompt": "x", "params": {"max_new_tokens": 100000}},
            422,
            "params.max_new_tokens",
        ),
        (
            {"model": "tiny-random", "prompt": "x", "params": {"stop": ["a"] * 9}},
            422,
            "params.stop",
        ),
        ({"model": "tiny-random", "prompt": "x", "params": {"bogus": 1}}, 422, "params.bogus"),
        ({"model": 7, "prompt": "x"}, 422, "model"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_job_bodies(
    api_url: str, user_token: str, body: dict[str, Any], status: int, field: str
) -> None:
    auth = {"Authorization": f"Bearer {user_token}"}
    before = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()
    r = submit(api_url, user_token, body)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    assert r.json()["field"] == field
    assert r.json()["error"]
    after = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()
    depth = {m["id"]: m["state"]["queue_depth"] for m in after["data"]}
    assert depth == {m["id"]: m["state"]["queue_depth"] for m in before["data"]}


def test_malformed_json_and_bad_utf8_are_400(api_url: str, user_token: str) -> None:
    headers = {"Authorization": f"Bearer {user_token}", "Content-Type": "application/json"}
    for raw in (b"{not json", b"\xff\xfe{}", b""):
        r = requests.post(f"{api_url}/v1/jobs", data=raw, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error_type"] == "bad_request"


def test_auth_is_required(api_url: str) -> None:
    body = {"model": "tiny-random", "prompt": "hello"}
    r = requests.post(f"{api_url}/v1/jobs", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"
    r = requests.post(
        f"{api_url}/v1/jobs", json=body, headers={"Authorization": "Bearer sy_wrong"}, timeout=30
    )
    assert r.status_code == 401
    r = requests.post(
        f"{api_url}/v1/jobs", json=body, headers={"Authorization": "Basic abc"}, timeout=30
    )
    assert r.status_code == 401


def test_unknown_job_is_404_and_websocket_closes_with_reason(api_url: str, user_token: str) -> None:
    import websocket

    r = requests.get(
        f"{api_url}/v1/jobs/nope", headers={"Authorization": f"Bearer {user_token}"}, timeout=30
    )
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    ws = websocket.create_connection(
        api_url.replace("http", "ws") + "/v1/jobs/nope/ws",
        header=[f"Authorization: Bearer {user_token}"],
        timeout=30,
    )
    frame = ws.recv()
    assert '"not_found"' in frame
    opcode, close = ws.recv_data_frame(True)
    assert opcode == websocket.ABNF.OPCODE_CLOSE
    assert int.from_bytes(close.data[:2], "big") == 4404
    assert close.data[2:].decode() == "no job 'nope'"
    ws.close()


def test_unknown_routes_and_methods_answer_json(api_url: str) -> None:
    r = requests.get(f"{api_url}/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    r = requests.put(f"{api_url}/v1/jobs", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


def test_oversized_body_is_413(api_url: str, user_token: str) -> None:
    big = {"model": "tiny-random", "prompt": "x" * 2_000_000}
    r = submit(api_url, user_token, big)
    assert r.status_code == 413 and r.json()["error"]


def test_health_and_readiness(api_url: str) -> None:
    assert requests.get(f"{api_url}/healthz", timeout=30).json() == {"status": "ok"}
    ready = requests.get(f"{api_url}/readyz", timeout=30)
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_models_list_the_catalog_with_state(
    api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    auth = {"Authorization": f"Bearer {user_token}"}  # private models: token holders only
    body = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert {"smollm2-135m", "tiny-random", "tiny-late"} <= set(by_id)
    assert by_id["tiny-random"]["state"]["replicas_ready"] == 1
    assert by_id["tiny-random"]["limits"]["max_new_tokens"] == 1024


def test_a_finished_job_whose_stream_expired_ends_from_its_record(
    api_url: str, user_token: str, tiny_worker: farm.Process, migrated: Settings
) -> None:
    """After ``stream_ttl_s`` the stream is gone; a reader still gets the end, from the row."""
    import redis

    from jobs.events import EventLog

    job_id = submit_ok(api_url, user_token)
    live = farm.ws_events(api_url, job_id, user_token)
    job = wait_final(api_url, user_token, job_id)
    client = redis.Redis.from_url(migrated.redis_url)
    assert client.delete(EventLog(client, migrated).channel(job_id)) == 1  # as the TTL does
    done = live[-1]
    expected = {
        "type": "done",
        "finish_reason": done["finish_reason"],
        "text": done["text"],
        "usage": done["usage"],
        "from_record": True,
    }
    started = time.monotonic()
    assert farm.ws_events(api_url, job_id, user_token, timeout=30) == [{"seq": 0, **expected}]
    assert farm.ws_events(api_url, job_id, user_token, after=7, timeout=30) == [
        {"seq": 8, **expected}
    ]
    assert farm.sse_events(api_url, job_id, user_token, timeout=30) == [{"seq": 0, **expected}]
    assert time.monotonic() - started < 5, "the end should come at once, not after a keep-alive"
    assert job["output_text"] == done["text"]


def test_a_job_that_ended_without_its_final_event_still_ends_its_readers(
    api_url: str, user_token: str, migrated: Settings
) -> None:
    """A worker wrote the final row, then its ``done`` event was lost (Redis restarted
    between the two): a reader that is following the job gets the end from the row.

    The test plays that worker: it claims the job (no worker serves tiny-late now)
    and records the outcome in the database, writing no event.
    """
    import threading

    import websocket

    from db.jobs import JobOutcome, JobStore
    from db.schema import JobStatus
    from db.session import Database

    job_id = submit_ok(api_url, user_token, model="tiny-late")
    frames: list[dict[str, Any]] = []
    ws = websocket.create_connection(
        api_url.replace("http", "ws", 1) + f"/v1/jobs/{job_id}/ws",
        header=[f"Authorization: Bearer {user_token}"],
        timeout=60,
    )

    def read() -> None:  # frames as they come (farm.ws_events returns them at the end)
        with contextlib.suppress(websocket.WebSocketException):
            while raw := ws.recv():
                frames.append(json.loads(raw))

    reader = threading.Thread(target=read)
    reader.start()
    farm.wait_for("the reader to see queued", lambda: bool(frames) or None, timeout=30)
    db = Database(migrated.database_url)
    try:
        store = JobStore(db)
        assert store.claim(job_id, "played-worker") is not None
        outcome = JobOutcome(JobStatus.succeeded, "the lost answer", "length", 5, 3)
        assert store.finish(job_id, "played-worker", outcome)
    finally:
        db.dispose()
    reader.join(60)
    ws.close()
    assert not reader.is_alive(), "the reader never ended"
    assert [f["type"] for f in frames] == ["queued", "done"]
    assert frames[1] == {
        "seq": 1,
        "type": "done",
        "finish_reason": "length",
        "text": "the lost answer",
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        "from_record": True,
    }

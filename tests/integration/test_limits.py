"""Limits: per-user rate and concurrency (shared by API servers), queue length,
models that can never get a worker, idempotency keys, queue deadlines."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from config import Settings
from db.jobs import JobStore
from db.schema import utcnow
from db.session import Database
from tests import farm

TINY = "tiny-random.yaml"


@pytest.fixture(scope="module")
def limits_settings(migrated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """The session's catalog plus models that exercise the limits."""
    folder = tmp_path_factory.mktemp("limit-models")
    for path in migrated.models_dir.glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    tiny = (migrated.models_dir / TINY).read_text()

    def variant(name: str, text: str) -> None:
        (folder / f"{name}.yaml").write_text(text.replace("name: tiny-random", f"name: {name}"))

    variant(
        "tiny-capped", tiny.replace("max_batch_size: 8", "max_batch_size: 8\n  max_queue_length: 2")
    )
    variant("tiny-never", tiny.replace("max_replicas: 2", "max_replicas: 0"))
    variant("tiny-expiry", tiny)
    broken = tiny.split("source:")[0] + "source:\n  kind: local\n  path: /nonexistent/model\n"
    broken += "backend:" + tiny.split("backend:")[1]
    variant("tiny-nosource", broken)
    return migrated.model_copy(update={"models_dir": folder})


@pytest.fixture(scope="module")
def two_apis(limits_settings: Settings) -> Iterator[tuple[str, str]]:
    """Two API servers, each with its own app, Redis and database connections."""
    with (
        farm.serve_app_in_thread(limits_settings) as a,
        farm.serve_app_in_thread(limits_settings) as b,
    ):
        yield a, b


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def submit(
    url: str,
    token: str,
    model: str = "tiny-late",
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> requests.Response:
    body = {"model": model, "prompt": "hello", "params": {"max_new_tokens": 2}, **extra}
    return requests.post(
        f"{url}/v1/jobs", json=body, headers={**auth(token), **(headers or {})}, timeout=30
    )


def cancel_all(url: str, token: str) -> None:
    for job in requests.get(f"{url}/v1/jobs?limit=100", headers=auth(token)).json()["data"]:
        requests.delete(f"{url}/v1/jobs/{job['id']}", headers=auth(token), timeout=30)


def assert_429(r: requests.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error_type"] == "rate_limited"
    assert 1 <= int(r.headers["Retry-After"]) <= 60


def test_requests_per_minute_are_counted_across_api_servers(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, requests_per_minute=3, max_concurrent_jobs=0)
    a, b = two_apis
    answers = [submit(url, token) for url in (a, b, a, b, a)]
    assert [r.status_code for r in answers[:3]] == [202, 202, 202]
    for r in answers[3:]:
        assert_429(r)
    # Refused requests enqueued nothing.
    jobs = requests.get(f"{a}/v1/jobs", headers=auth(token)).json()["data"]
    assert len(jobs) == 3
    cancel_all(a, token)


def test_only_accepted_requests_count_against_the_per_minute_limit(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, requests_per_minute=2, max_concurrent_jobs=1)
    a, b = two_apis
    first = submit(a, token, "tiny-capped")
    assert first.status_code == 202
    # Two refusals, on both servers: a full queue... (tiny-capped holds 2: fill it)
    other = farm.make_token(limits_settings, requests_per_minute=0, max_concurrent_jobs=0)
    filler = submit(b, other, "tiny-capped")
    assert filler.status_code == 202
    full = submit(b, token, "tiny-capped")
    assert_429(full)
    assert "queue" in full.json()["error"]
    # ...and the caller's one concurrent job.
    busy = submit(a, token)
    assert_429(busy)
    assert "at once" in busy.json()["error"]
    requests.delete(f"{a}/v1/jobs/{first.json()['id']}", headers=auth(token), timeout=30)
    # The refusals were not counted: this is the second request of the minute.
    second = submit(b, token)
    assert second.status_code == 202, second.text
    cancel_all(a, token)
    # And the limit still holds: a third accepted request would be one too many.
    third = submit(a, token)
    assert_429(third)
    assert "per minute" in third.json()["error"]
    cancel_all(a, other)


def test_concurrent_jobs_are_limited_and_freed_when_a_job_ends(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=2, requests_per_minute=0)
    a, b = two_apis
    first, second = submit(a, token), submit(b, token)
    assert first.status_code == second.status_code == 202
    assert_429(submit(a, token))
    assert_429(submit(b, token))
    requests.delete(f"{b}/v1/jobs/{first.json()['id']}", headers=auth(token), timeout=30)
    assert submit(a, token).status_code == 202
    cancel_all(a, token)


def test_a_full_queue_is_429_and_enqueues_nothing(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    a, b = two_apis
    assert submit(a, token, "tiny-capped").status_code == 202
    assert submit(b, token, "tiny-capped").status_code == 202
    full = submit(a, token, "tiny-capped")
    assert_429(full)
    assert "queue" in full.json()["error"]
    assert len(requests.get(f"{a}/v1/jobs", headers=auth(token)).json()["data"]) == 2
    cancel_all(a, token)
    assert submit(b, token, "tiny-capped").status_code == 202
    cancel_all(a, token)


def test_models_that_can_never_get_a_worker_are_503(
    two_apis: tuple[str, str], limits_settings: Settings, log_dir: Path
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    a, _ = two_apis
    never = submit(a, token, "tiny-never")
    assert never.status_code == 503 and "max_replicas" in never.json()["error"]
    proc = farm.start_worker(limits_settings, "tiny-nosource", log_dir)
    assert proc.proc.wait(timeout=120) != 0  # its model cannot load
    proc.stop()
    broken = submit(a, token, "tiny-nosource")
    assert broken.status_code == 503, broken.text
    assert "failed to start" in broken.json()["error"]
    assert requests.get(f"{a}/v1/jobs", headers=auth(token)).json()["data"] == []
    # A model merely without workers keeps the spine's behaviour: the job waits.
    assert submit(a, token, "tiny-expiry").status_code == 202
    cancel_all(a, token)


def test_a_worker_report_missing_fields_does_not_break_submissions(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    """A live report from another version of the worker (no ``state``) is not a 500."""
    import redis

    from fleet.registry import registry_key, worker_key

    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    client = redis.Redis.from_url(limits_settings.redis_url)
    report = json.dumps({"id": "odd-worker", "model": "tiny-expiry", "updated_at": time.time()})
    client.hset(registry_key(limits_settings), "odd-worker", report)
    client.set(worker_key(limits_settings, "odd-worker"), report, ex=60)
    try:
        a, _ = two_apis
        r = submit(a, token, "tiny-expiry")
        assert r.status_code == 202, r.text
    finally:
        client.hdel(registry_key(limits_settings), "odd-worker")
        client.delete(worker_key(limits_settings, "odd-worker"))
        cancel_all(two_apis[0], token)


def test_lookups_are_counted_in_a_window_of_their_own(limits_settings: Settings) -> None:
    """/tokenize and /v1/models count against the caller, apart from generation requests."""
    update = {"anonymous_requests_per_minute": 1, "lookup_factor": 2, "redis_prefix": "lookups"}
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=1)
    with farm.serve_app_in_thread(limits_settings.model_copy(update=update)) as url:
        models = f"{url}/v1/models"
        assert [requests.get(models, timeout=30).status_code for _ in range(2)] == [200, 200]
        assert_429(requests.get(models, timeout=30))
        # A user's lookups are theirs: the anonymous window does not touch them.
        body = {"model": "tiny-random", "prompt": "hello"}
        first = requests.post(f"{url}/tokenize", json=body, headers=auth(token), timeout=30)
        assert first.status_code in (200, 503), first.text  # 503: no tokenizer cached yet
        assert requests.get(models, headers=auth(token), timeout=30).status_code == 200
        over = requests.post(f"{url}/tokenize", json=body, headers=auth(token), timeout=30)
        assert_429(over)
        assert "lookups" in over.json()["error"]
        # Lookups took nothing from the generation window: the one request still goes.
        accepted = submit(url, token, "tiny-late")
        assert accepted.status_code == 202, accepted.text
        cancel_all(url, token)


def test_idempotency_key_returns_the_same_job(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    other = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    a, b = two_apis
    key = {"Idempotency-Key": f"order-{uuid.uuid4()}"}
    first = submit(a, token, headers=key)
    again = submit(b, token, headers=key)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert submit(a, other, headers=key).json()["id"] != first.json()["id"]  # per user
    assert submit(a, token).json()["id"] != first.json()["id"]
    # Racing twins of one retried request still make one job.
    race = {"Idempotency-Key": f"race-{uuid.uuid4()}"}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda u: submit(u, token, headers=race), [a, b, a, b]))
    assert {r.status_code for r in answers} == {202}
    assert len({r.json()["id"] for r in answers}) == 1
    # The key reused for another request is refused, not answered with the first job.
    changed = submit(b, token, headers=key, prompt="something else")
    assert changed.status_code == 422, changed.text
    assert changed.json()["field"] == "Idempotency-Key"
    assert "same parameters" in changed.json()["error"]
    # Through the OpenAI door too, which keeps its envelope.
    chat = {
        "model": "tiny-late",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    chat_key = {**auth(token), "Idempotency-Key": f"chat-{uuid.uuid4()}"}
    with requests.post(
        f"{a}/v1/chat/completions", json=chat, headers=chat_key, stream=True, timeout=30
    ) as first_chat:
        assert first_chat.status_code == 200
        assert first_chat.headers["X-Job-Id"]
    r = requests.post(
        f"{b}/v1/chat/completions", json={**chat, "max_tokens": 3}, headers=chat_key, timeout=30
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "Idempotency-Key"
    bad = submit(a, token, headers={"Idempotency-Key": "x" * 300})
    assert bad.status_code == 400 and bad.json()["field"] == "Idempotency-Key"
    cancel_all(a, token)
    cancel_all(a, other)


def test_the_claim_never_starts_an_expired_job(limits_settings: Settings) -> None:
    db = Database(limits_settings.database_url)
    jobs = JobStore(db)
    try:
        past, future = str(uuid.uuid4()), str(uuid.uuid4())
        for job_id, delta in ((past, -1), (future, 60)):
            jobs.create(
                job_id=job_id,
                model="tiny-expiry",
                user_id=None,
                messages=None,
                prompt="x",
                params={},
                deadline_at=utcnow() + timedelta(seconds=delta),
            )
        expired = jobs.claim(past, "w1")
        assert expired is not None and expired.status == "failed" and expired.error == "expired"
        assert expired.worker is None and expired.started_at is None and expired.attempts == 0
        assert jobs.claim(past, "w2") is None  # and it stays final
        started = jobs.claim(future, "w1")
        assert started is not None and started.status == "running" and started.attempts == 1
    finally:
        db.dispose()


def test_a_job_past_its_deadline_ends_expired_and_its_worker_skips_it(
    two_apis: tuple[str, str], limits_settings: Settings, log_dir: Path
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    a, _ = two_apis
    late = submit(a, token, "tiny-expiry", deadline_s=0.5).json()["id"]
    control = submit(a, token, "tiny-expiry").json()["id"]
    time.sleep(1.0)
    proc = farm.start_worker(limits_settings, "tiny-expiry", log_dir)
    try:
        farm.wait_ready(limits_settings, "tiny-expiry", proc)
        events = farm.ws_events(a, late, token)
        assert [e["type"] for e in events] == ["queued", "error"]
        assert events[-1]["error"] == "expired"
        assert farm.ws_events(a, control, token)[-1]["type"] == "done"
    finally:
        proc.stop()
    job = requests.get(f"{a}/v1/jobs/{late}", headers=auth(token)).json()
    assert job["status"] == "failed" and job["error"] == "expired"
    assert job["attempts"] == 0 and job["worker"] is None and job["timestamps"]["started"] is None


def test_a_waiting_client_is_told_when_its_job_expires(
    two_apis: tuple[str, str], limits_settings: Settings
) -> None:
    token = farm.make_token(limits_settings, max_concurrent_jobs=0, requests_per_minute=0)
    a, _ = two_apis
    ws = websocket.create_connection(
        a.replace("http", "ws", 1) + "/v1/ws", header=[f"Authorization: Bearer {token}"], timeout=60
    )
    try:
        ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "soon",
                    "model": "tiny-late",
                    "prompt": "hello",
                    "deadline_s": 1,
                }
            )
        )
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv()))
    finally:
        ws.close()
    assert frames[0]["type"] == "queued"
    assert frames[-1]["error"] == "expired" and frames[-1]["status"] == 503

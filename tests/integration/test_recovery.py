"""Recovery through real processes: kill -9 and SIGTERM workers mid-job, lose broker messages.

The session's API runs the reaper (every 0.5 s, ``max_attempts = 2``,
``reconcile_after_s = 5``, heartbeat TTL 3 s; see conftest). Workers serve
``tiny-recovery``, a tiny random model allowed long generations, so a job is
still generating when its worker is killed.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from config import Settings
from fleet.registry import list_workers
from jobs.events import EventLog
from jobs.messages import BrokerView, queue_keys
from tests import farm

MODEL = "tiny-recovery"
CHAT = [{"role": "user", "content": "Tell me a very long story about a fox."}]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def submit(api_url: str, token: str, max_new_tokens: int, model: str = MODEL) -> str:
    body = {
        "model": model,
        "messages": CHAT,
        "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def get_job(api_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(f"{api_url}/v1/jobs/{job_id}", headers=auth(token), timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


wait_for = farm.wait_for


def wait_final(api_url: str, token: str, job_id: str, timeout: float = 180) -> dict[str, Any]:
    return dict(
        wait_for(
            f"job {job_id} to end",
            lambda: (
                (j := get_job(api_url, token, job_id))["status"]
                in ("succeeded", "failed", "cancelled")
                and j
            ),
            timeout,
        )
    )


class Workers:
    """Worker processes of one model, found by the id their heartbeat reports."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.procs: dict[str, farm.Process] = {}

    def start(self, env: dict[str, str] | None = None) -> str:
        proc = farm.start_worker(self.settings, MODEL, self.log_dir, env)
        worker_id = farm.wait_ready(self.settings, MODEL, proc)
        self.procs[worker_id] = proc
        return worker_id

    def alive(self) -> list[str]:
        return [i for i, p in self.procs.items() if p.alive()]

    def kill(self, worker_id: str) -> None:
        proc = self.procs[worker_id]
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def workers(migrated: Settings, log_dir: Path) -> Iterator[Workers]:
    pool = Workers(migrated, log_dir)
    try:
        yield pool
    finally:
        pool.stop_all()


def stream_in_background(api_url: str, job_id: str, token: str) -> tuple[threading.Thread, list]:
    """A websocket client reading the job's events from now on, in a thread."""
    box: list[list[dict[str, Any]]] = []
    thread = threading.Thread(
        target=lambda: box.append(farm.ws_events(api_url, job_id, token, timeout=240)),
        daemon=True,
    )
    thread.start()
    return thread, box


def tokens_after_last_restart(events: EventLog, job_id: str) -> int:
    history = events.history(job_id)
    restarts = [i for i, e in enumerate(history) if e.type in ("restart", "resumed")]
    start = restarts[-1] + 1 if restarts else 0
    return sum(1 for e in history[start:] if e.type == "token")


def running_on(api_url: str, token: str, job_id: str, attempts: int) -> str | None:
    job = get_job(api_url, token, job_id)
    if job["status"] == "running" and job["attempts"] == attempts and job["worker"]:
        return str(job["worker"])
    return None


def assert_gapless(events: list[dict[str, Any]]) -> None:
    assert [e["seq"] for e in events] == list(range(len(events)))


def test_kill_9_mid_job_continues_it_on_another_worker_and_the_stream_stays_whole(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, workers: Workers
) -> None:
    first, second = workers.start(), workers.start()
    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    # Long enough (~15 s here) that the kill lands mid-generation on a faster machine too.
    job_id = submit(api_url, user_token, max_new_tokens=800)
    # An admin's stream and view: worker names are for operators (api/disclosure.py).
    reader, frames = stream_in_background(api_url, job_id, admin_token)

    victim = wait_for("the job to run", lambda: running_on(api_url, admin_token, job_id, 1))
    wait_for("its first tokens", lambda: tokens_after_last_restart(events, job_id) >= 2)
    survivor = second if victim == first else first
    workers.kill(victim)

    reader.join(timeout=240)
    assert frames, "the websocket client got nothing"
    stream = frames[0]
    assert_gapless(stream)
    types = [e["type"] for e in stream]
    assert "restart" not in types and types.count("started") == 2
    second = types.index("started", 2)
    assert types[:2] == ["queued", "started"] and "token" in types[2:second]
    assert stream[second]["attempt"] == 2 and stream[second]["worker"] == survivor
    resumed = stream[second + 1]
    assert resumed["type"] == "resumed" and resumed["previous_worker"] == victim
    carried = [e for e in stream[:second] if e["type"] == "token"]
    assert resumed["tokens"] == sum(len(e["ids"]) for e in carried) > 0
    assert types[-1] == "done" and set(types[second + 2 : -1]) == {"token"}
    # One answer: the first attempt's tokens, then the second's, each once.
    whole_text = "".join(e["text"] for e in stream if e["type"] == "token")
    assert stream[-1]["text"] == whole_text

    job = wait_final(api_url, admin_token, job_id)
    assert job["status"] == "succeeded"
    assert job["attempts"] == 2
    assert job["worker"] == survivor
    assert job["output_text"] == whole_text
    assert job["usage"]["completion_tokens"] == 800

    # Operators see the killed worker as lost, no longer counted.
    r = requests.get(f"{api_url}/v1/admin/workers", headers=auth(admin_token), timeout=30)
    assert r.status_code == 200, r.text
    listed = {w["id"]: w for w in r.json()["workers"]}
    assert listed[victim]["status"] == "lost" and listed[victim]["lost"] is True
    assert listed[survivor]["status"] == "ready" and listed[survivor]["lost"] is False
    model = next(m for m in r.json()["models"] if m["model"] == MODEL)
    assert model["replicas_ready"] == 1


def test_redis_redelivery_of_the_dead_workers_message_is_dropped(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, workers: Workers
) -> None:
    """The killed worker never acked its message; when Redis re-delivers it, the claim drops it."""
    from kombu import Connection

    from tasks.celery import celery_config

    client = redis.Redis.from_url(migrated.redis_url)
    broker = BrokerView(client, migrated)
    events = EventLog(client, migrated)
    # Other tests' killed workers may have left messages of their own under this
    # prefix (some of their jobs live in other databases: 404 here).
    found = [
        r.json()
        for r in (
            requests.get(f"{api_url}/v1/jobs/{i}", headers=auth(admin_token), timeout=30)
            for i in broker.unacked_ids()
        )
        if r.status_code == 200
    ]
    finished = [j["id"] for j in found if j["status"] == "succeeded" and j["model"] == MODEL]
    assert finished, "the killed worker's unacknowledged message should still be in Redis"
    job_id = finished[0]
    before = get_job(api_url, admin_token, job_id)
    history = events.history(job_id)

    # What kombu does once the visibility timeout passed, with the timeout at zero
    # (and the farm's broker options, its key prefix among them).
    options = {**celery_config(migrated)["broker_transport_options"], "visibility_timeout": 0}
    with Connection(migrated.redis_url, transport_options=options) as conn:
        conn.default_channel.qos.restore_visible(num=1000, interval=1)
    # The surviving worker takes the message again, loses the claim and acks it.
    wait_for(
        "the re-delivered message to be consumed",
        lambda: job_id not in broker.unacked_ids() and job_id not in broker.waiting_ids(MODEL),
        timeout=60,
    )
    time.sleep(1.0)
    after = get_job(api_url, admin_token, job_id)
    assert after["status"] == "succeeded"
    assert after["attempts"] == before["attempts"] == 2
    assert after["output_text"] == before["output_text"]
    assert events.history(job_id) == history


def test_a_job_whose_workers_keep_dying_fails_after_max_attempts(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, workers: Workers
) -> None:
    assert migrated.max_attempts == 2
    while len(workers.alive()) < 2:
        workers.start()
    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    job_id = submit(api_url, user_token, max_new_tokens=800)
    for attempt in (1, 2):
        worker = wait_for(
            f"attempt {attempt} to run",
            lambda a=attempt: running_on(api_url, admin_token, job_id, a),
        )
        wait_for("tokens", lambda: tokens_after_last_restart(events, job_id) >= 2)
        workers.kill(worker)

    job = wait_final(api_url, user_token, job_id)
    assert job["status"] == "failed"
    assert job["error"] == "worker lost 2 times"
    stream = farm.ws_events(api_url, job_id, user_token)
    assert_gapless(stream)
    types = [e["type"] for e in stream]
    assert types.count("resumed") == 1 and "restart" not in types
    assert stream[-1]["type"] == "error" and stream[-1]["error"] == "worker lost 2 times"
    # Nothing is left running on a worker that is gone.
    auth = {"Authorization": f"Bearer {user_token}"}  # private models: token holders only
    counts = requests.get(f"{api_url}/v1/models", headers=auth, timeout=30).json()["data"]
    assert next(m for m in counts if m["id"] == MODEL)["state"]["running"] == 0


def test_sigterm_lets_a_running_job_finish_within_the_grace_period(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, workers: Workers
) -> None:
    # A grace long enough for the whole job (the default, 0, hands it over at once).
    worker = workers.start(env={"SWITCHYARD_WORKER_GRACE_S": "60"})
    job_id = submit(api_url, user_token, max_new_tokens=120)
    wait_for("the job to run", lambda: running_on(api_url, admin_token, job_id, 1) == worker)
    proc = workers.procs[worker]
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == 0, proc.log()[-3000:]
    job = wait_final(api_url, admin_token, job_id)
    assert job["status"] == "succeeded" and job["attempts"] == 1 and job["worker"] == worker
    assert job["usage"]["completion_tokens"] == 120
    types = [e["type"] for e in farm.ws_events(api_url, job_id, user_token)]
    assert "restart" not in types and "resumed" not in types and types[-1] == "done"
    # A worker that stopped cleanly leaves the registry (it is not "lost").
    assert worker not in {w.id for w in list_workers(workers.redis, migrated)}


def test_sigterm_past_the_grace_period_hands_the_job_over_and_it_continues_elsewhere(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, workers: Workers
) -> None:
    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    # No grace at all: the job is re-queued the moment the worker is told to stop,
    # however fast this machine generates (the tiny model can finish 600 tokens in 1 s).
    worker = workers.start(env={"SWITCHYARD_WORKER_GRACE_S": "0"})
    job_id = submit(api_url, user_token, max_new_tokens=2048)
    wait_for("the job to run", lambda: running_on(api_url, admin_token, job_id, 1) == worker)
    wait_for("tokens", lambda: tokens_after_last_restart(events, job_id) >= 2)
    proc = workers.procs[worker]
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == 0, proc.log()[-3000:]

    queued = get_job(api_url, admin_token, job_id)
    assert queued["status"] == "queued" and queued["worker"] is None
    handed = events.history(job_id)
    carried = sum(len(e.fields["ids"]) for e in handed if e.type == "token")
    assert carried > 0 and handed[-1].type == "token"  # nothing after its last token

    other = workers.start()
    job = wait_final(api_url, admin_token, job_id)
    assert job["status"] == "succeeded" and job["worker"] == other
    assert job["attempts"] == 1  # a drain gives its attempt back
    stream = [e.as_dict() for e in events.history(job_id)]  # worker names: internal
    assert_gapless(stream)
    types = [e["type"] for e in stream]
    assert "restart" not in types and types.count("started") == 2
    resumed = stream[types.index("resumed")]
    assert resumed["tokens"] == carried and resumed["previous_worker"] == worker
    assert types[-1] == "done" and job["usage"]["completion_tokens"] == 2048
    assert stream[-1]["text"] == "".join(e["text"] for e in stream if e["type"] == "token")


def test_a_queued_job_whose_broker_message_vanished_is_sent_again(
    api_url: str, user_token: str, migrated: Settings
) -> None:
    """As after a Redis restart without persistence: the row is queued, the message gone."""
    client = redis.Redis.from_url(migrated.redis_url)
    broker = BrokerView(client, migrated)
    model = "tiny-late"  # no worker serves it here, so its message waits in the queue
    job_id = submit(api_url, user_token, max_new_tokens=8, model=model)
    assert job_id in broker.waiting_ids(model)
    client.delete(*queue_keys(migrated, model))
    assert job_id not in broker.waiting_ids(model)
    wait_for(
        "the reaper to send it again",
        lambda: job_id in broker.waiting_ids(model),
        timeout=migrated.reconcile_after_s + 30,
    )
    assert get_job(api_url, user_token, job_id)["status"] == "queued"


def test_admin_workers_route_is_for_operators_only(
    api_url: str, user_token: str, admin_token: str, migrated: Settings
) -> None:
    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    r = requests.get(f"{api_url}/v1/admin/workers", headers=auth(user_token), timeout=30)
    assert r.status_code == 403 and r.json()["error_type"] == "forbidden"
    r = requests.get(f"{api_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 401
    db = Database(migrated.database_url)
    try:
        accounts = Accounts(db)
        accounts.add_user("ops-recovery", Role.operator)
        token = accounts.issue_token("ops-recovery").secret
    finally:
        db.dispose()
    r = requests.get(f"{api_url}/v1/admin/workers", headers=auth(token), timeout=30)
    assert r.status_code == 200
    assert {"workers", "models"} <= set(r.json())

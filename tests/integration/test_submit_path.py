"""The submit path's shortcuts against real Redis and Postgres (issue 13).

The API writes Celery's message itself (``jobs.messages``), in the same
round trip as the job's ``queued`` event; and the database pool pings a
connection only after it sat idle. Each shortcut must behave as what it
replaces: the message as ``Celery.send_task``'s, a dead connection replaced.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

import db.session
from config import Settings
from db.jobs import JobStore
from db.schema import JobStatus
from db.session import Database
from jobs.messages import send_generate
from jobs.queues import GENERATE_TASK, broker_key, queue_key, queue_name
from tasks import configure


def _decoded(raw: bytes) -> dict[str, Any]:
    message = cast(dict[str, Any], json.loads(raw))
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def test_the_generate_message_is_the_one_celery_send_task_writes(migrated: Settings) -> None:
    client = redis.Redis.from_url(migrated.redis_url)
    model = f"msg-{uuid.uuid4().hex[:8]}"
    queue, key = queue_name(model), queue_key(migrated, model)
    job_id = str(uuid.uuid4())
    try:
        # Celery routes by the queue's name; kombu pushes onto the list under the prefix.
        configure(migrated).send_task(GENERATE_TASK, args=[job_id], task_id=job_id, queue=queue)
        send_generate(client, migrated, job_id, model)
        ours, celerys = (cast(bytes, client.lpop(key)) for _ in range(2))
        assert client.llen(key) == 0 and not client.exists(queue)
    finally:
        client.delete(
            key,
            broker_key(migrated, f"_kombu.binding.{queue}"),
            broker_key(migrated, f"_kombu.binding_permanent.{queue}"),
        )
    mine, theirs = _decoded(ours), _decoded(celerys)
    # A fresh delivery tag each; Celery names its reply queue (results, which jobs have none).
    for message in (mine, theirs):
        assert uuid.UUID(message["properties"].pop("delivery_tag"))
        message["properties"].pop("reply_to")
    assert mine == theirs
    assert mine["headers"]["id"] == job_id and mine["body"][0] == [job_id]


def _backend_pid(database: Database) -> int:
    with database.engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(url: str, pid: int) -> None:
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        admin.dispose()


@contextmanager
def _pool(settings: Settings, size: int) -> Iterator[Database]:
    database = Database(settings.database_url, pool_size=size, max_overflow=0)
    try:
        yield database
    finally:
        database.dispose()


def test_a_pooled_connection_killed_while_idle_is_replaced_before_use(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db.session, "PING_IDLE_S", 0.05)
    with _pool(migrated, 1) as database:
        first = _backend_pid(database)
        _terminate(migrated.database_url, first)
        time.sleep(0.1)
        assert _backend_pid(database) != first  # no error: the ping found it dead


def test_a_connection_killed_in_steady_use_fails_one_statement_then_the_pool_renews(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db.session, "PING_IDLE_S", 3600.0)
    with _pool(migrated, 2) as database:
        with database.engine.connect() as a, database.engine.connect() as b:  # two in the pool
            pids = {int(c.execute(text("SELECT pg_backend_pid()")).scalar_one()) for c in (a, b)}
        for pid in pids:
            _terminate(migrated.database_url, pid)
        with pytest.raises(OperationalError):
            _backend_pid(database)
        # The disconnect dropped every older connection: the next checkout connects afresh.
        assert _backend_pid(database) not in pids


def test_a_process_keeps_the_connections_its_settings_allow_however_many_threads_query(
    migrated: Settings,
) -> None:
    """A worker's job threads (one per slot) claim and finish jobs together: its pool
    holds ``db_pool_size`` connections and, without overflow, a burst waits for one
    instead of opening more (each would be a Postgres backend started and ended)."""
    settings = migrated.model_copy(update={"db_pool_size": 3, "db_max_overflow": 0})
    database = Database.for_process(settings)
    pids: set[int] = set()
    errors: list[BaseException] = []
    start = threading.Barrier(12)

    def query() -> None:
        try:
            start.wait()
            for _ in range(4):
                with database.session() as s:
                    pid = s.execute(text("SELECT pg_backend_pid() FROM pg_sleep(0.01)"))
                    pids.add(int(pid.scalar_one()))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=query) for _ in range(12)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        database.dispose()
    assert not errors
    assert 1 <= len(pids) <= 3


def _synchronous_commit(database: Database) -> str:
    with database.session() as s:
        return str(s.execute(text("SHOW synchronous_commit")).scalar_one())


def test_a_worker_commits_without_waiting_for_the_disk_and_its_claims_are_seen_at_once(
    migrated: Settings,
) -> None:
    """A worker's database (``worker_synchronous_commit`` off, the default) commits
    its claims and final rows without waiting for the WAL's flush; the API's
    stays synchronous. Whoever reads next sees the claim at once."""
    assert migrated.worker_synchronous_commit is False
    worker = Database.for_process(migrated, synchronous_commit=migrated.worker_synchronous_commit)
    api = Database.for_process(migrated)
    try:
        assert _synchronous_commit(worker) == "off"
        assert _synchronous_commit(api) == "on"
        job_id = uuid.uuid4().hex
        JobStore(api).create(
            job_id=job_id, model="tiny-random", user_id=None, messages=None, prompt="hi", params={}
        )
        claimed = JobStore(worker).claim(job_id, "w-test")
        assert claimed is not None and claimed.status == JobStatus.running.value
        seen = JobStore(api).get(job_id)
        assert seen is not None and seen.status == JobStatus.running.value
        assert seen.worker == "w-test"
        assert JobStore(worker).claim(job_id, "w-other") is None  # a duplicate loses
    finally:
        worker.dispose()
        api.dispose()

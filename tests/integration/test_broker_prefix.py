"""Two farms in one Redis database, kept apart by their prefixes (issue 15).

Farm A is the session's (its API in this process, prefix ``t…``); farm B has a
database and a prefix of its own, its own API, and a real Celery worker for
``tiny-late``: the model no worker of farm A serves, whose jobs other tests
leave queued. Every key and channel of the Celery broker is under its farm's
prefix, so B's worker takes B's messages only, neither farm's queue depth
counts the other's, and a message left under the broker's keys of before the
prefix (an upgrade) is sent again by the reaper.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast

import pytest
import redis
import requests
from sqlalchemy import make_url

from config import Settings
from config.settings import PROJECT_ROOT
from jobs.messages import BrokerView
from jobs.queues import broker_key, queue_key, queue_name
from tests import farm

MODEL = "tiny-late"  # no worker of the session's farm serves it: its jobs stay queued


def submit(base_url: str, token: str) -> str:
    body = {"model": MODEL, "prompt": "hello", "params": {"max_new_tokens": 4}}
    headers = {"Authorization": f"Bearer {token}"}
    r = requests.post(f"{base_url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def status(base_url: str, token: str, job_id: str) -> str:
    headers = {"Authorization": f"Bearer {token}"}
    r = requests.get(f"{base_url}/v1/jobs/{job_id}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


def cancel(base_url: str, token: str, job_id: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    requests.delete(f"{base_url}/v1/jobs/{job_id}", headers=headers, timeout=30)


def pings(settings: Settings) -> str:
    """What ``celery -A tasks inspect ping`` prints in ``settings``' environment: the names
    of the workers that answered on that farm's remote-control channels."""
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "inspect", "--timeout", "3", "ping"]
    done = subprocess.run(
        argv,
        env=farm.settings_env(settings),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def farm_b(migrated: Settings) -> Settings:
    """A second farm: its own database and prefix, the same Redis database as the session's."""
    from db.migrate import upgrade

    if make_url(migrated.database_url).get_backend_name() != "postgresql":
        pytest.skip("needs Postgres")
    url = farm.database_of_its_own(migrated.database_url, "prefix")
    farm.reset_database(url)
    upgrade(url)
    return migrated.model_copy(
        update={
            "database_url": url,
            "redis_prefix": f"b{uuid.uuid4().hex[:8]}",
            "api_port": farm.free_port(),
        }
    )


def test_a_worker_takes_only_its_own_farms_messages(
    api_url: str, user_token: str, migrated: Settings, farm_b: Settings, log_dir: Path
) -> None:
    assert farm_b.redis_url == migrated.redis_url and farm_b.redis_prefix != migrated.redis_prefix
    client = redis.Redis.from_url(migrated.redis_url)
    broker_a, broker_b = BrokerView(client, migrated), BrokerView(client, farm_b)

    # Farm A's job waits in A's queue, a list under A's prefix; farm B sees no message.
    job_a = submit(api_url, user_token)
    try:
        assert job_a in broker_a.waiting_ids(MODEL) and broker_a.waiting(MODEL) >= 1
        listed = cast(list[bytes], client.lrange(queue_key(migrated, MODEL), 0, -1))
        assert any(job_a.encode() in message for message in listed)
        assert not client.exists(queue_name(MODEL))  # no broker key without a prefix
        assert broker_b.waiting(MODEL) == 0 and broker_b.waiting_ids(MODEL) == set()

        # B's worker consumes the queue of the same name, gen.tiny-late, on B's broker:
        # it runs B's job, submitted after A's (a shared list would give it A's first).
        worker = farm.start_worker(farm_b, MODEL, log_dir)
        try:
            farm.wait_ready(farm_b, MODEL, worker)
            with farm.serve_app_in_thread(farm_b) as url_b:
                token_b = farm.make_token(farm_b)
                job_b = submit(url_b, token_b)
                final = farm.wait_final(url_b, token_b, job_b, timeout=120)
                assert final["status"] == "succeeded", final

            # A's message is where it was: not taken, not delivered, its job still queued.
            assert job_a in broker_a.waiting_ids(MODEL)
            assert job_a not in broker_a.unacked_ids() and job_a not in broker_b.unacked_ids()
            assert status(api_url, user_token, job_a) == "queued"
            assert broker_b.waiting(MODEL) == 0

            # kombu keeps B's queue binding under B's prefix, and nothing at the bare names.
            binding = f"_kombu.binding.{queue_name(MODEL)}"
            assert client.exists(broker_key(farm_b, binding))
            for bare in (queue_name(MODEL), binding, "unacked", "unacked_index"):
                assert not client.exists(bare), bare

            # Remote control travels on prefixed channels too: only B's broker reaches B's worker.
            name = f"{MODEL}@{socket.gethostname()}-{worker.proc.pid}"
            assert name in pings(farm_b)
            assert name not in pings(migrated)
        finally:
            worker.stop()
    finally:
        cancel(api_url, user_token, job_a)


def test_a_message_left_under_the_unprefixed_queue_is_sent_again_under_the_prefix(
    api_url: str, user_token: str, migrated: Settings
) -> None:
    """An upgrade from a version whose broker had no prefix: a job queued then has its
    message in the bare list ``gen.<model>``, which no upgraded worker reads. The reaper
    finds no message for it under the prefix and sends it again there."""
    client = redis.Redis.from_url(migrated.redis_url)
    broker = BrokerView(client, migrated)
    key, bare = queue_key(migrated, MODEL), queue_name(MODEL)
    job_id = submit(api_url, user_token)
    try:
        # Move the message where the old version put it.
        raw = next(m for m in cast(list[bytes], client.lrange(key, 0, -1)) if job_id.encode() in m)
        assert client.lrem(key, 1, raw) == 1
        client.lpush(bare, raw)
        assert job_id not in broker.waiting_ids(MODEL)
        farm.wait_for(
            "the reaper to send it again under the prefix",
            lambda: job_id in broker.waiting_ids(MODEL),
            timeout=migrated.reconcile_after_s + 30,
        )
        assert status(api_url, user_token, job_id) == "queued"
    finally:
        client.delete(bare)
        cancel(api_url, user_token, job_id)

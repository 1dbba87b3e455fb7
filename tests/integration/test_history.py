"""The history the farm keeps itself: scaler ticks become one-minute rows an operator reads.

Real Postgres and Redis, the real scaler (its executor records only), the real
reaper and the API on a socket; jobs are written into the jobs table with the
timestamps a worker would have given them.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from config import Settings, load_catalog
from db.jobs import JobStore
from db.schema import Job
from db.session import Database
from fleet.reaper import Reaper
from fleet.registry import Heartbeat, WorkerReport, registry_key
from fleet.scaler_state import ScalerState
from jobs.events import EventLog
from tests.integration.test_scaling import (
    controls_for,
    make_models,
    settings_for,
    unique,
    wait_for,
)
from workers.executors.base import RecordOnlyExecutor
from workers.scaler import Scaler

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


def add_job(db: Database, model: str, status: str, **times: Any) -> str:
    job_id = str(uuid.uuid4())
    with db.session() as s:
        s.add(Job(id=job_id, model=model, status=status, params={}, attempts=1, **times))
    return job_id


def get_history(api_url: str, token: str | None, **query: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.get(f"{api_url}/v1/admin/history", params=query, headers=headers, timeout=30)


def scaler_for(settings: Settings) -> Scaler:
    return Scaler(
        settings,
        load_catalog(settings.models_dir),
        Database(settings.database_url),
        redis.Redis.from_url(settings.redis_url),
        RecordOnlyExecutor(),
    )


def test_ticks_become_one_minute_rows_with_job_figures_then_are_pruned(
    migrated: Settings, api_url: str, admin_token: str, tmp_path: Path
) -> None:
    model = unique("hist")
    settings = settings_for(
        migrated,
        make_models(
            tmp_path / "models",
            {model: {"scaling": {"max_replicas": 3, "target_jobs_per_replica": 1}}},
        ),
    )
    db = Database(settings.database_url)
    s = timedelta(seconds=1)
    # Minute 09:00: four jobs started (waits 1, 5, 7, 9 s) and finished, one of them
    # failed; the three that succeeded had their first token after 0.5, 1 and 2 s.
    for wait, ttft in ((5, 0.5), (7, 1.0), (9, 2.0)):
        add_job(
            db,
            model,
            "succeeded",
            created_at=T0 + 5 * s,
            started_at=T0 + (5 + wait) * s,
            first_token_at=T0 + (5 + wait + ttft) * s,
            finished_at=T0 + 30 * s,
        )
    failed = add_job(
        db,
        model,
        "failed",
        created_at=T0 + 1 * s,
        started_at=T0 + 2 * s,
        finished_at=T0 + 40 * s,
        error="worker lost 2 times",
    )
    for _ in range(2):
        add_job(db, model, "queued", created_at=T0 + 45 * s)
    client = redis.Redis.from_url(settings.redis_url)
    report = WorkerReport(id=f"{model}@test:1:abc", model=model, state="ready", tokens_per_s=42.0)
    beat = Heartbeat(client, settings, report)
    scaler = scaler_for(settings)
    try:
        beat.beat()
        scaler.tick(T0 + 50 * s)
        beat.beat()
        scaler.tick(T0 + 65 * s)  # the next minute; 09:00 gets its last figures

        r = get_history(
            api_url, admin_token, model=model, **{"from": "2026-03-02T09:00:00Z"},
            to="2026-03-02T09:05:00Z",
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["step_s"] == 60 and body["retention_s"] == 7 * 86_400
        series = body["models"][model]
        assert series["minute"] == ["2026-03-02T09:00:00+00:00", "2026-03-02T09:01:00+00:00"]
        assert series["queue_depth"] == [2, 2]
        assert series["desired"] == [2, 2]
        assert series["ready"] == [1, 1] and series["starting"] == [0, 0]
        assert series["tokens_per_s"] == [42.0, 42.0]
        assert series["jobs_started"][0] == 4 and series["jobs_finished"][0] == 4
        assert series["errors"] == [1, 0]
        assert series["queue_wait_p50_s"][0] == pytest.approx(6.0)
        assert series["queue_wait_p95_s"][0] == pytest.approx(8.7)
        assert series["ttft_p50_s"][0] == pytest.approx(1.0)
        assert series["ttft_p95_s"][0] == pytest.approx(1.9)
        assert series["ttft_p50_s"][1] is None  # nothing finished in 09:01
        assert [j["id"] for j in body["failed_jobs"]] == [failed]
        assert body["failed_jobs"][0]["error"] == "worker lost 2 times"
        first = body["events"][-1]
        assert (first["kind"], first["desired"], first["by"]) == ("queue", 2, scaler.id)

        # Eight days later the leader prunes what is older than the retention.
        beat.beat()
        scaler.tick(T0 + timedelta(days=8))
        r = get_history(
            api_url, admin_token, model=model, **{"from": "2026-03-02T09:00:00Z"},
            to="2026-03-02T09:05:00Z",
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["models"] == {}
    finally:
        beat.stop()
        db.dispose()


def test_events_say_who_and_why_and_only_operators_read_them(
    migrated: Settings,
    api_url: str,
    admin_token: str,
    user_token: str,
    tmp_path: Path,
) -> None:
    model = unique("hist-ev")
    settings = settings_for(
        migrated,
        make_models(
            tmp_path / "models",
            {
                model: {
                    "scaling": {
                        "max_replicas": 3,
                        "scale_to_zero_delay_s": 0,
                        "downscale_delay_s": 0,
                    }
                }
            },
        ),
    )
    db = Database(settings.database_url)
    client = redis.Redis.from_url(settings.redis_url)
    scaler = scaler_for(settings)
    controls = controls_for(settings)
    try:
        scaler.tick()  # no job: zero replicas
        queued = add_job(db, model, "queued", created_at=datetime.now(UTC))
        scaler.tick()  # a job for a model at zero: wake
        JobStore(db).cancel_queued(queued)
        scaler.tick()  # idle again: to zero at once (delays 0)
        controls.scale(model, 2, until=None, actor="alice")
        scaler.tick()  # alice's pin
        # A running job on a worker whose last beat is long gone: the reaper re-runs it.
        ghost = f"{model}@gone:9:dead"
        client.hset(
            registry_key(settings),
            ghost,
            json.dumps({"id": ghost, "model": model, "updated_at": time.time() - 3600}),
        )
        lost = add_job(db, model, "running", worker=ghost, created_at=datetime.now(UTC))
        # The API's own reaper thread (one sweep per interval across processes) finds it.
        wait_for(
            lambda: (j := JobStore(db).get(lost)) is not None and j.status == "queued",
            30,
            "the reaper to re-queue the lost worker's job",
        )

        assert get_history(api_url, None, last="1h").status_code == 401
        assert get_history(api_url, user_token, last="1h").status_code == 403
        bad = get_history(api_url, admin_token, last="1y")
        assert bad.status_code == 422 and bad.json()["field"] == "last"
        r = get_history(api_url, admin_token, last="1h", model=model)
        assert r.status_code == 200, r.text
        events = r.json()["events"]
        kinds = [e["kind"] for e in reversed(events)]
        assert kinds == ["queue", "wake", "scale_to_zero", "setting", "manual", "reaper"]
        by_kind = {e["kind"]: e for e in events}
        assert by_kind["setting"]["by"] == "alice"
        assert (by_kind["manual"]["previous"], by_kind["manual"]["desired"]) == (0, 2)
        assert by_kind["wake"]["by"] == scaler.id
        reaped = by_kind["reaper"]
        assert (reaped["job_id"], reaped["action"], reaped["worker"]) == (lost, "requeued", ghost)
        assert reaped["why"] == "worker lost"
    finally:
        db.dispose()


def test_without_a_scaler_the_reapers_sweeps_keep_the_history(
    migrated: Settings, api_url: str, admin_token: str, tmp_path: Path
) -> None:
    """Workers started by hand (or by Kubernetes' autoscaling): no scaler leads, so the
    reaper's sweeps record the gauges, ``desired`` null; never while a scaler leads."""
    model = unique("hist-noscaler")
    settings = settings_for(migrated, make_models(tmp_path / "models", {model: {}}))
    db = Database(settings.database_url)
    client = redis.Redis.from_url(settings.redis_url)
    reaper = Reaper(settings, JobStore(db), EventLog(client, settings), client)
    lock = ScalerState.lock_key_of(settings)
    client.delete(lock)
    queued = [add_job(db, model, "queued", created_at=datetime.now(UTC)) for _ in range(3)]
    report = WorkerReport(id=f"{model}@test:1:abc", model=model, state="ready", tokens_per_s=7.0)
    beat = Heartbeat(client, settings, report)
    try:
        beat.beat()
        reaper.sweep()
        now = datetime.now(UTC)
        window = {
            "from": (now - timedelta(minutes=2)).isoformat(),
            "to": (now + timedelta(minutes=2)).isoformat(),
        }
        r = get_history(api_url, admin_token, model=model, **window)
        assert r.status_code == 200, r.text
        series = r.json()["models"][model]
        assert series["queue_depth"] == [3] and series["running"] == [0]
        assert series["ready"] == [1] and series["tokens_per_s"] == [7.0]
        assert series["desired"] == [None]

        # A scaler leads: the history is its to write, the sweep adds nothing.
        client.set(lock, "a-scaler", px=30_000)
        before = get_history(api_url, admin_token, model=model, **window).json()["models"]
        assert not reaper.record_history()
        reaper.sweep()
        after = get_history(api_url, admin_token, model=model, **window).json()["models"]
        assert after == before
    finally:
        client.delete(lock)
        beat.stop()
        with db.session() as s:
            for job_id in queued:
                job = s.get(Job, job_id)
                if job is not None:
                    s.delete(job)
        db.dispose()

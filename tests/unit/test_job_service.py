"""The job service on fakes of its stores: no Redis, no database (jobs/service.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from config import load_settings
from db.schema import Job, utcnow
from jobs.events import JobEvent
from jobs.service import JobService, final_from_record


class FakeJobs:
    def __init__(self, *jobs: Job) -> None:
        self.rows = {j.id: j for j in jobs}

    def get(self, job_id: str) -> Job | None:
        return self.rows.get(job_id)

    def delete(self, job_id: str) -> None:
        self.rows.pop(job_id, None)

    def _end_queued(self, job_id: str, status: str) -> bool:
        job = self.rows.get(job_id)
        if job is None or job.status != "queued":
            return False
        job.status = status
        return True

    def cancel_queued(self, job_id: str) -> bool:
        return self._end_queued(job_id, "cancelled")

    def expire_queued(self, job_id: str) -> bool:
        return self._end_queued(job_id, "failed")


class FakeEvents:
    def __init__(self) -> None:
        self.log: dict[str, list[JobEvent]] = {}
        self.cancel_requests: list[str] = []

    def next_seq(self, job_id: str) -> int:
        return len(self.log.get(job_id, []))

    def append(self, job_id: str, events: list[JobEvent]) -> None:
        self.log.setdefault(job_id, []).extend(events)

    def append_to(self, pipe: Any, job_id: str, events: list[JobEvent]) -> None:
        pipe.calls.append(("events", job_id, [e.type for e in events]))

    def request_cancel(self, job_id: str) -> None:
        self.cancel_requests.append(job_id)


class FakePipeline:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []

    def lpush(self, key: str, value: str) -> None:
        self.calls.append(("lpush", key))

    def execute(self) -> None:
        if self.fail:
            raise ConnectionError("redis is away")


class FakeRedis:
    def __init__(self, fail: bool = False) -> None:
        self.pipe = FakePipeline(fail)

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        assert transaction
        return self.pipe


def job(status: str = "queued", **fields: Any) -> Job:
    return Job(id="j1", model="m", status=status, attempts=0, **fields)


def service(*jobs: Job, fail: bool = False) -> tuple[JobService, FakeJobs, FakeEvents, FakeRedis]:
    store, events, client = FakeJobs(*jobs), FakeEvents(), FakeRedis(fail)
    settings = load_settings({}, redis_prefix="farm-a")
    return (
        JobService(settings, store, events, client),  # type: ignore[arg-type]
        store,
        events,
        client,
    )


def test_enqueue_writes_the_queued_event_and_the_message_in_one_pipeline() -> None:
    svc, store, _, client = service(job())
    svc.enqueue(store.rows["j1"])
    # The queue's list is under the farm's prefix, as kombu's global_keyprefix puts it.
    assert client.pipe.calls == [("events", "j1", ["queued"]), ("lpush", "farm-a:gen.m")]
    assert "j1" in store.rows


def test_a_failed_enqueue_deletes_the_row_and_raises() -> None:
    svc, store, _, _ = service(job(), fail=True)
    with pytest.raises(ConnectionError):
        svc.enqueue(store.rows["j1"])
    assert store.rows == {}


def test_cancel_ends_a_queued_job_asks_a_running_one_and_leaves_a_final_one() -> None:
    svc, store, events, _ = service(job())
    assert svc.cancel("j1") == "cancelled"
    assert [(e.seq, e.type, e.fields["finish_reason"]) for e in events.log["j1"]] == [
        (0, "done", "cancelled")
    ]
    assert svc.cancel("j1") == "final"
    store.rows["j1"].status = "running"
    assert svc.cancel("j1") == "cancel_requested" and events.cancel_requests == ["j1"]
    assert svc.cancel("nobody") == "final"


def test_expire_if_due_fails_only_a_queued_job_past_its_deadline() -> None:
    svc, store, events, _ = service(job(deadline_at=utcnow() + timedelta(minutes=1)))
    assert not svc.expire_if_due(store.rows["j1"])
    store.rows["j1"].deadline_at = utcnow() - timedelta(seconds=1)
    assert svc.expire_if_due(store.rows["j1"])
    assert [(e.type, e.fields) for e in events.log["j1"]] == [("error", {"error": "expired"})]
    assert not svc.expire_if_due(store.rows["j1"])  # no longer queued


def test_the_final_event_from_the_record() -> None:
    done = final_from_record(job("succeeded", output_text="hi", completion_tokens=1), 4)
    assert (done.seq, done.type, done.fields["text"], done.fields["finish_reason"]) == (
        4,
        "done",
        "hi",
        "stop",
    )
    failed = final_from_record(job("failed", error="boom"), 2)
    assert (failed.type, failed.fields["error"], failed.fields["from_record"]) == (
        "error",
        "boom",
        True,
    )

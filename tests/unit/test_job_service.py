"""The job service on fakes of its stores: no Redis, no database (jobs/service.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from config import Catalog, ModelDefinition, load_settings
from db.accounts import Principal
from db.lookups import RowCache
from db.overrides import cache_key
from db.schema import Job, utcnow
from jobs.errors import (
    InvalidRequest,
    JobRefused,
    OverLimit,
    QueueDown,
    ReaderLagging,
    TokenRequired,
    UnknownModel,
    Unservable,
)
from jobs.events import JobEvent
from jobs.service import JobService, JobSpec, final_from_record, job_row_key, request_hash


class FakeJobs:
    def __init__(self, *jobs: Job) -> None:
        self.rows = {j.id: j for j in jobs}

    def get(self, job_id: str) -> Job | None:
        return self.rows.get(job_id)

    def create(self, *, job_id: str, model: str, **fields: Any) -> Job:
        self.rows[job_id] = Job(id=job_id, model=model, status="queued", attempts=0, **fields)
        return self.rows[job_id]

    def by_idempotency_key(self, key: str) -> Job | None:
        return next((j for j in self.rows.values() if j.idempotency_key == key), None)

    def waiting_count(self, model: str) -> int:
        return sum(1 for j in self.rows.values() if j.model == model and j.status == "queued")

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

    def last_seq(self, job_id: str) -> int:
        return len(self.log.get(job_id, [])) - 1

    def history(self, job_id: str, after: int = -1) -> list[JobEvent]:
        return [e for e in self.log.get(job_id, []) if e.seq > after]


class FakeSubscription:
    """Live events in batches: each call of :meth:`events` gives the next batch
    (then the stream is idle); none left: idle for good."""

    def __init__(self, *batches: list[JobEvent]) -> None:
        self.batches = list(batches)
        self.lagging = False
        self.closed = False

    def events(self, after: int = -1, *, idle_timeout: float | None = None) -> Iterator[JobEvent]:
        batch = self.batches.pop(0) if self.batches else []
        yield from (e for e in batch if e.seq > after)

    def __enter__(self) -> FakeSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


class FakeRelay:
    def __init__(self) -> None:
        self.sub = FakeSubscription()

    def subscribe(self, job_id: str) -> FakeSubscription:
        return self.sub


class FakeWatch:
    def __init__(self) -> None:
        self.subs: set[Any] = set()

    def add(self, sub: Any) -> None:
        self.subs.add(sub)

    def discard(self, sub: Any) -> None:
        self.subs.discard(sub)


class FakePipeline:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []

    def lpush(self, key: str, value: str) -> None:
        self.calls.append(("lpush", key))

    def zrem(self, key: str, member: str) -> None:
        self.calls.append(("zrem", key.rpartition(":")[0]))

    def execute(self) -> None:
        if self.fail:
            raise ConnectionError("redis is away")


class FakeScript:
    """The limiter's admission script: admits (``[0, 0]``) unless told its answer."""

    def __init__(self) -> None:
        self.answer = [0, 0]
        self.calls = 0

    def __call__(self, keys: list[str], args: list[Any]) -> list[int]:
        self.calls += 1
        return self.answer


class FakeRedis:
    def __init__(self, fail: bool = False) -> None:
        self.pipe = FakePipeline(fail)
        self.script = FakeScript()

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return self.pipe

    def register_script(self, text: str) -> FakeScript:
        return self.script


class FakeFleet:
    def __init__(self) -> None:
        self.refusal: JobRefused | None = None
        self.woken: list[str] = []

    def check_capacity(self, definition: ModelDefinition) -> None:
        if self.refusal is not None:
            raise self.refusal

    def wake_if_idle(self, model: str) -> None:
        self.woken.append(model)


def job(status: str = "queued", **fields: Any) -> Job:
    return Job(id="j1", model="m", status=status, attempts=0, **fields)


def definition(name: str = "m", **fields: Any) -> ModelDefinition:
    source = {"kind": "random", "tokenizer_from": "x"}
    return ModelDefinition.model_validate({"name": name, "source": source, **fields})


def service(
    *jobs: Job, fail: bool = False, models: tuple[ModelDefinition, ...] = ()
) -> tuple[JobService, FakeJobs, FakeEvents, FakeRedis]:
    store, events, client = FakeJobs(*jobs), FakeEvents(), FakeRedis(fail)
    settings = load_settings({}, redis_prefix="farm-a")
    rows = RowCache()
    for d in models:
        rows.put(cache_key(d.name), None)  # no run-time override: the database is not read
    svc = JobService(
        settings,
        store,  # type: ignore[arg-type]
        events,  # type: ignore[arg-type]
        client,  # type: ignore[arg-type]
        catalog=Catalog(list(models)),
        db=None,  # type: ignore[arg-type]
        rows=rows,
        fleet=FakeFleet(),
        relay=FakeRelay(),
    )
    return svc, store, events, client


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


ANON = {"address": "10.0.0.1"}


def test_submit_records_and_queues_the_job_and_wakes_its_model_once_a_second() -> None:
    svc, store, _, client = service(models=(definition(public=True),))
    first = svc.submit(JobSpec("m", prompt="hi", params={"seed": 1}), None, request_id="r1", **ANON)
    second = svc.submit(JobSpec("m", prompt="hi"), None, **ANON)
    assert not first.replayed and first.job.id != second.job.id
    row = store.rows[first.job.id]
    assert (row.prompt, row.params, row.request_id, row.status) == (
        "hi",
        {"seed": 1},
        "r1",
        "queued",
    )
    assert client.pipe.calls.count(("lpush", "farm-a:gen.m")) == 2
    assert client.script.calls == 2
    assert svc.fleet.woken == ["m"]  # type: ignore[attr-defined]


def test_a_refused_submission_stores_and_counts_nothing() -> None:
    private, public = definition("p"), definition("m", public=True)
    svc, store, _, client = service(models=(private, public))
    refusals: list[tuple[JobSpec, type[JobRefused], str | None]] = [
        (JobSpec("nope", prompt="hi"), UnknownModel, "model"),
        (JobSpec("p", prompt="hi"), TokenRequired, None),
        (
            JobSpec("m", prompt="hi", params={"max_new_tokens": 10_000}),
            InvalidRequest,
            "params.max_new_tokens",
        ),
    ]
    for spec, kind, field in refusals:
        with pytest.raises(kind) as refused:
            svc.submit(spec, None, **ANON)
        assert refused.value.field == field
    svc.fleet.refusal = Unservable("no worker can come")  # type: ignore[attr-defined]
    with pytest.raises(Unservable):
        svc.submit(JobSpec("m", prompt="hi"), None, **ANON)
    assert store.rows == {} and client.script.calls == 0


def test_a_caller_over_their_limit_is_told_when_to_retry() -> None:
    svc, store, _, client = service(models=(definition(public=True),))
    client.script.answer = [1, 1500]
    with pytest.raises(OverLimit) as refused:
        svc.submit(JobSpec("m", prompt="hi"), None, **ANON)
    assert refused.value.retry_after_s == 1.5 and store.rows == {}


def test_an_idempotency_key_replays_its_job_for_the_same_caller_only() -> None:
    svc, store, _, client = service(models=(definition(public=True),))
    spec = JobSpec("m", prompt="hi")
    first = svc.submit(spec, None, idempotency_key="k", **ANON)
    again = svc.submit(spec, None, idempotency_key="k", **ANON)
    assert again.replayed and again.job.id == first.job.id
    assert client.script.calls == 1  # a replay counts against no limit
    assert store.rows[first.job.id].request_hash == request_hash(spec)
    with pytest.raises(InvalidRequest) as refused:
        svc.submit(JobSpec("m", prompt="bye"), None, idempotency_key="k", **ANON)
    assert refused.value.field == "Idempotency-Key"
    # Another anonymous caller's key is its own, as is a user's.
    other = svc.submit(spec, None, idempotency_key="k", address="10.0.0.2")
    user = Principal(user_id=7, user_name="u", role="user", token_id=1)
    mine = svc.submit(spec, user, idempotency_key="k", **ANON)
    assert len({first.job.id, other.job.id, mine.job.id}) == 3


def test_a_queue_that_is_down_keeps_nothing_and_refunds_the_limits() -> None:
    svc, store, _, client = service(models=(definition(public=True),), fail=True)
    with pytest.raises(QueueDown):
        svc.submit(JobSpec("m", prompt="hi"), None, **ANON)
    assert store.rows == {}
    assert ("zrem", "farm-a:limit:jobs:anon") in client.pipe.calls


def ev(seq: int, kind: str, **fields: Any) -> JobEvent:
    return JobEvent(seq=seq, type=kind, fields=fields)


def relay_of(svc: JobService) -> FakeRelay:
    relay: FakeRelay = svc.relay  # type: ignore[assignment]
    return relay


def test_follow_gives_the_events_after_a_seq_and_ends_after_the_final_one() -> None:
    svc, store, _, _ = service(job())
    relay_of(svc).sub = FakeSubscription(
        [ev(0, "queued"), ev(1, "started")], [ev(2, "token", text="hi"), ev(3, "done")]
    )
    svc.rows.put(job_row_key("j1"), store.rows["j1"])
    seen = list(svc.follow(store.rows["j1"], 0, idle_s=0.01))
    # An idle pause between the batches is a None (the caller's keep-alive).
    assert [e if e is None else (e.seq, e.type) for e in seen] == [
        (1, "started"),
        None,
        (2, "token"),
        (3, "done"),
    ]
    assert svc.rows.peek(job_row_key("j1"), 60) is None  # the row changed: read it again
    assert relay_of(svc).sub.closed


def test_a_job_that_ended_before_its_stream_was_read_ends_from_its_row() -> None:
    ended = job("succeeded", output_text="hi", completion_tokens=1)
    svc, _, events, _ = service(ended)
    # The stream expired: the row alone answers.
    [done] = list(svc.follow(ended, 4, idle_s=0.01))
    assert (done.seq, done.type, done.fields["from_record"]) == (5, "done", True)
    # The stream lost its final event (a Redis restart): its events, then the row's.
    events.log["j1"] = [ev(0, "queued"), ev(1, "token", text="hi")]
    seen = list(svc.follow(ended, -1, idle_s=0.01))
    assert [(e.seq, e.type) for e in seen if e is not None] == [
        (0, "queued"),
        (1, "token"),
        (2, "done"),
    ]


def test_a_quiet_queued_job_past_its_deadline_expires_while_followed() -> None:
    late = job(deadline_at=utcnow() - timedelta(seconds=1))
    svc, store, events, _ = service(late)
    follow = svc.follow(late, idle_s=0.01)
    assert next(follow) is None
    assert store.rows["j1"].status == "failed" and events.log["j1"][-1].type == "error"
    follow.close()
    assert relay_of(svc).sub.closed


def test_a_lagging_reader_is_told_and_leaves_its_watch() -> None:
    svc, store, _, _ = service(job())
    relay_of(svc).sub = FakeSubscription([ev(0, "queued")])
    relay_of(svc).sub.lagging = True
    watch = FakeWatch()
    with pytest.raises(ReaderLagging):
        list(svc.follow(store.rows["j1"], idle_s=0.01, watch=watch))
    assert watch.subs == set()
    # Without a watch (SSE), nobody asks: the reader catches up from the history.
    relay_of(svc).sub = FakeSubscription([ev(0, "queued"), ev(1, "done")])
    relay_of(svc).sub.lagging = True
    assert [e.type for e in svc.follow(store.rows["j1"], idle_s=0.01) if e] == ["queued", "done"]

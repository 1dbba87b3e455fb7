"""JobRunner alone: fakes of its own stores, a scripted engine and a fake clock.

The thing under test is the real :class:`workers.runner.JobRunner`; its
collaborators are test doubles of the Protocols it declares (``JobRows``,
``JobStreams``, ``GenerationEngine``). Time is a fake clock that the scripted
engine advances, so coalescing windows, the cancel poll, drains and deadlines
are exact, whatever the machine's load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.exc import SQLAlchemyError

from config import Catalog, Settings, load_settings
from db.jobs import EXPIRED, JobOutcome
from db.schema import Job, JobStatus
from jobs.events import JobEvent, StreamTaken
from models.engine import FinishEvent, GenerationRequest, TokenEvent
from workers.runner import CANCEL_POLL_S, DRAIN_CANCEL_WAIT_S, JobRunner, coalescing_window_s

WORKER = "host:1"
MODEL = "tiny-random"


class FakeClock:
    """Monotonic time that moves only when told to (the engine waits, the runner sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float | None) -> None:
        """A wait that timed out; real time always moves a little, so this does too."""
        self.now += max(timeout or 0.0, 1e-6)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FakeRows:
    """Job rows in memory, with the conditional moves of ``db.jobs.JobStore``."""

    def __init__(self, job: Job) -> None:
        self.rows = {job.id: job}
        self.finish_errors = 0  # finish() raises this many times before it writes
        self.commit_then_raise = False  # the first finish() writes, then raises
        self.outcomes: list[JobOutcome] = []

    def claim(self, job_id: str, worker: str) -> Job | None:
        job = self.rows.get(job_id)
        if job is None or job.status != JobStatus.queued.value:
            return None
        now = datetime.now(UTC)
        if job.deadline_at is not None and job.deadline_at <= now and job.started_at is None:
            job.status, job.error = JobStatus.failed.value, EXPIRED
            return job
        job.status, job.worker, job.started_at = JobStatus.running.value, worker, now
        job.attempts += 1
        return job

    def get(self, job_id: str) -> Job | None:
        return self.rows.get(job_id)

    def finish(self, job_id: str, worker: str, outcome: JobOutcome) -> bool:
        if self.finish_errors > 0:
            self.finish_errors -= 1
            raise SQLAlchemyError("the database is away")
        job = self.rows[job_id]
        if job.status != JobStatus.running.value or job.worker != worker:
            return False
        job.status, job.output_text, job.error = (
            outcome.status.value,
            outcome.output_text,
            outcome.error,
        )
        job.finish_reason = outcome.finish_reason
        self.outcomes.append(outcome)
        if self.commit_then_raise:
            self.commit_then_raise = False
            raise SQLAlchemyError("the answer to the commit was lost")
        return True

    def requeue(self, job_id: str, worker: str, *, count_attempt: bool) -> Job | None:
        job = self.rows[job_id]
        if job.status != JobStatus.running.value or job.worker != worker:
            return None
        job.status, job.worker = JobStatus.queued.value, None
        if not count_attempt:
            job.attempts -= 1
        return job


class FakeStreams:
    """Event logs in memory, fenced like ``jobs.events.EventLog``."""

    def __init__(self) -> None:
        self.logs: dict[str, list[JobEvent]] = {}
        self.appends: list[list[JobEvent]] = []
        self.owners: dict[str, str] = {}
        self.cancel_after_tokens: int | None = None  # a client cancels after this many events
        self.taken_after_appends: int | None = None  # a later attempt takes the stream then

    def append(self, job_id: str, events: list[JobEvent]) -> None:
        self.logs.setdefault(job_id, []).extend(events)
        self.appends.append(list(events))

    def append_fenced(self, job_id: str, events: list[JobEvent], owner: str) -> bool:
        if len(self.appends) == self.taken_after_appends:
            self.owners[job_id] = "a later attempt"
        if self.owners.get(job_id) != owner:
            raise StreamTaken(job_id)
        self.append(job_id, events)
        return self.cancel_requested(job_id)  # read in the same round trip, as EventLog

    def take(self, job_id: str, owner: str) -> list[JobEvent]:
        self.owners[job_id] = owner
        return self.history(job_id)

    def history(self, job_id: str, after: int = -1) -> list[JobEvent]:
        return [e for e in self.logs.get(job_id, []) if e.seq > after]

    def next_seq(self, job_id: str) -> int:
        log = self.logs.get(job_id)
        return log[-1].seq + 1 if log else 0

    def cancel_requested(self, job_id: str) -> bool:
        tokens = sum(e.type == "token" for e in self.logs.get(job_id, []))
        return self.cancel_after_tokens is not None and tokens >= self.cancel_after_tokens

    def of(self, job_id: str) -> list[JobEvent]:
        return self.logs.get(job_id, [])


@dataclass
class ScriptedGeneration:
    """A request that yields its script's tokens, each ``after`` seconds of fake time.

    ``cancel()`` ends it with ``cancelled`` at once, unless ``deaf`` (an
    engine that stopped stepping) or ``late`` (the request ends by itself,
    its script played out, in the step before the engine sees the cancel).
    """

    clock: FakeClock
    request: GenerationRequest
    script: list[tuple[float, str]]
    end: str = "eos_token"
    deaf: bool = False
    late: bool = False
    cancelled: bool = False
    text: str = ""
    sent: int = 0
    _finish: FinishEvent | None = None
    _ready_at: float | None = None

    def _finished(self, reason: str) -> FinishEvent:
        resumed = len(self.request.resume_ids or [])
        self._finish = FinishEvent(
            reason,
            (self.request.resume_text or "") + self.text,
            len(self.request.prompt_ids),
            resumed + self.sent,
        )
        return self._finish

    def next_event(self, timeout: float | None = None) -> TokenEvent | FinishEvent | None:
        if self._finish is not None:
            return self._finish
        if self.cancelled and not self.deaf and not self.late:
            return self._finished("cancelled")
        if not self.script:
            if self.cancelled and self.deaf:  # it never ends
                self.clock.wait(timeout)
                return None
            return self._finished(self.end)
        after, text = self.script[0]
        if self._ready_at is None:
            self._ready_at = self.clock.now + after
        wait = timeout if timeout is not None else float("inf")
        if self._ready_at > self.clock.now + wait:
            self.clock.wait(wait)
            return None
        self.clock.now = max(self.clock.now, self._ready_at)
        self.script.pop(0)
        self._ready_at = None
        self.text += text
        self.sent += 1
        return TokenEvent(text, [100 + len(self.text)])

    def next_events(
        self, timeout: float | None = None, *, until_finished: bool = False
    ) -> list[TokenEvent | FinishEvent]:
        """As the engine's handle: what is due now, else a wait for the next event
        (``until_finished``: the tokens due meanwhile gather until the finish or
        the timeout)."""
        end = self.clock.now + (timeout if timeout is not None else float("inf"))
        events: list[TokenEvent | FinishEvent] = []
        while not (events and isinstance(events[-1], FinishEvent)):
            # After the first event, only what is due already (unless gathering).
            wait = 0.0 if events and not until_finished else max(0.0, end - self.clock.now)
            event = self.next_event(wait)
            if event is None:
                break
            events.append(event)
        return events

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class ScriptedEngine:
    """Encodes every prompt as three ids and plays the script to every request."""

    clock: FakeClock
    script: list[tuple[float, str]] = field(default_factory=list)
    end: str = "eos_token"
    deaf: bool = False
    late: bool = False
    submitted: list[ScriptedGeneration] = field(default_factory=list)

    def encode_prompt(self, text: str, *, truncate: bool = False) -> list[int]:
        return [1, 2, 3]

    def encode_chat(self, messages: list[dict[str, str]], *, truncate: bool = False) -> list[int]:
        return [1, 2, 3]

    def submit(self, request: GenerationRequest) -> ScriptedGeneration:
        generation = ScriptedGeneration(
            self.clock, request, list(self.script), end=self.end, deaf=self.deaf, late=self.late
        )
        self.submitted.append(generation)
        return generation


def tokens(texts: Iterable[str], every_s: float) -> list[tuple[float, str]]:
    return [(every_s, t) for t in texts]


@dataclass
class Farm:
    """A runner on fakes, with the job it will run."""

    runner: JobRunner
    job: Job
    rows: FakeRows
    streams: FakeStreams
    engine: ScriptedEngine
    clock: FakeClock
    resent: list[tuple[str, str]]

    def run(self) -> list[JobEvent]:
        self.runner.run(self.job.id)
        return self.streams.of(self.job.id)


def make_job(**columns: Any) -> Job:
    values: dict[str, Any] = {
        "id": "job-1",
        "model": MODEL,
        "status": JobStatus.queued.value,
        "prompt": "hello",
        "messages": None,
        "params": {"max_new_tokens": 64},
        "attempts": 0,
        "created_at": datetime.now(UTC),
        "started_at": None,
        "deadline_at": None,
        "worker": None,
    }
    values.update(columns)
    return Job(**values)


@pytest.fixture
def settings() -> Settings:
    return load_settings(
        {},
        database_url="sqlite:///:memory:",
        redis_url="redis://127.0.0.1:1/0",
        stream_coalesce_ms=50,
        job_timeout_s=10,
        finish_retry_s=3,
    )


@pytest.fixture
def make_farm(settings: Settings, catalog: Catalog) -> Any:
    def make(
        script: list[tuple[float, str]],
        *,
        job: Job | None = None,
        end: str = "eos_token",
        deaf: bool = False,
        late: bool = False,
        settings_: Settings | None = None,
    ) -> Farm:
        clock = FakeClock()
        job = job or make_job()
        rows, streams = FakeRows(job), FakeStreams()
        engine = ScriptedEngine(clock, script, end=end, deaf=deaf, late=late)
        resent: list[tuple[str, str]] = []
        runner = JobRunner(
            settings=settings_ or settings,
            definition=catalog[MODEL],
            engine=engine,
            jobs=rows,
            events=streams,
            worker_id=WORKER,
            resend=lambda job_id, model: resent.append((job_id, model)),
            clock=clock.monotonic,
            sleep=clock.sleep,
        )
        return Farm(runner, job, rows, streams, engine, clock, resent)

    return make


def kinds(events: list[JobEvent]) -> list[str]:
    return [e.type for e in events]


def texts(events: list[JobEvent]) -> list[str]:
    return [e.text for e in events if e.type == "token"]


def token_writes(farm: Farm) -> list[tuple[float, str]]:
    """When each token event of ``farm``'s job is written, and its text (filled as it runs)."""
    written: list[tuple[float, str]] = []
    append = farm.streams.append

    def timed(job_id: str, events: list[JobEvent]) -> None:
        written.extend((farm.clock.now, e.text) for e in events if e.type == "token")
        append(job_id, events)

    farm.streams.append = timed
    return written


def test_a_job_streams_its_tokens_and_ends_with_done(make_farm: Any) -> None:
    farm = make_farm(tokens(["Hel", "lo"], every_s=0.2))
    events = farm.run()
    assert kinds(events) == ["started", "token", "token", "done"]
    assert [e.seq for e in events] == [1, 2, 3, 4]  # seq 0 is the API's `queued`
    assert events[0].fields == {"attempt": 1, "worker": WORKER}
    done = events[-1].fields
    assert done["finish_reason"] == "eos_token" and done["text"] == "Hello"
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert farm.job.status == JobStatus.succeeded.value and farm.job.output_text == "Hello"
    assert farm.runner.active_jobs == []


def test_the_first_token_goes_out_at_once_and_the_next_ones_coalesce(make_farm: Any) -> None:
    # Four tokens 10 ms apart, then a pause: the first alone, the rest in one event
    # written when the 50 ms window closes (not when the job ends).
    farm = make_farm([(0.0, "a"), (0.01, "b"), (0.01, "c"), (0.01, "d"), (1.0, "e")])
    events = farm.run()
    assert texts(events) == ["a", "bcd", "e"]
    token_events = [e for e in events if e.type == "token"]
    assert token_events[1].fields["ids"] == [102, 103, 104]
    assert kinds(events) == ["started", "token", "token", "token", "done"]


def test_the_answers_last_text_goes_out_with_done_in_one_write(make_farm: Any) -> None:
    # "b" and "c" arrive inside a window and the request ends in it: they are
    # written with `done`, after the final row, in the same append.
    farm = make_farm([(0.0, "a"), (0.01, "b"), (0.01, "c")])
    farm.run()
    assert [kinds(write) for write in farm.streams.appends] == [
        ["started"],
        ["token"],
        ["token", "done"],
    ]
    last = farm.streams.appends[-1]
    assert last[0].text == "bc" and last[1].fields["text"] == "abc"
    assert farm.job.status == JobStatus.succeeded.value


def test_coalesced_tokens_go_out_when_a_window_of_the_shared_grid_ends(make_farm: Any) -> None:
    # Tokens 10 ms apart from an arbitrary instant: after the first, each event is
    # written as a 50 ms window of the monotonic clock's grid ends, so every job of
    # a worker publishes at the same instants, whatever its own timing.
    farm = make_farm([(0.013, "a"), *tokens("bcdefghijklmnop", every_s=0.01)])
    written = token_writes(farm)
    farm.run()
    assert "".join(text for _, text in written) == "abcdefghijklmnop"
    windows = [t / 0.05 for t, _ in written[1:-1]]  # the first goes at once, the last with done
    assert len(windows) >= 2
    assert all(abs(w - round(w)) < 1e-6 for w in windows)


def test_the_window_lengthens_with_the_workers_streams_and_stops_at_its_longest() -> None:
    settings = load_settings(
        {},
        database_url="sqlite:///:memory:",
        stream_coalesce_ms=50,
        stream_writes_per_s=160,
        stream_coalesce_max_ms=250,
    )
    window = [coalescing_window_s(settings, n) for n in (1, 8, 9, 16, 32, 40, 200)]
    assert window == pytest.approx([0.05, 0.05, 9 / 160, 0.1, 0.2, 0.25, 0.25])
    fixed = settings.model_copy(update={"stream_writes_per_s": 0})
    assert coalescing_window_s(fixed, 200) == 0.05
    alone = settings.model_copy(update={"stream_coalesce_ms": 0})
    assert coalescing_window_s(alone, 200) == 0  # every token alone, whatever the load


def test_a_busy_worker_publishes_each_stream_once_a_longer_window(
    make_farm: Any, settings: Settings
) -> None:
    # 16 streams on a worker that writes 160 events a second: windows of 100 ms on
    # the shared grid, not 50; the first token still goes at once.
    busy = settings.model_copy(update={"stream_writes_per_s": 160, "stream_coalesce_max_ms": 250})
    farm = make_farm(
        [(0.013, "a"), *tokens("bcdefghijklmnopqrstuvwxyz", every_s=0.01)], settings_=busy
    )
    farm.runner._active.update(f"other-{k}" for k in range(15))
    written = token_writes(farm)
    start = farm.clock.now
    farm.run()
    assert "".join(text for _, text in written) == "abcdefghijklmnopqrstuvwxyz"
    assert written[0][1] == "a" and written[0][0] - start == pytest.approx(0.013, abs=1e-3)
    windows = [t / 0.1 for t, _ in written[1:-1]]  # the last goes with done
    assert len(windows) >= 2
    assert all(abs(w - round(w)) < 1e-6 for w in windows)
    # About ten 10 ms steps a window (the first one's opened after "a", at 13 ms).
    assert [text for _, text in written[1:-1]] == ["bcdefghi", "jklmnopqrs"]


def test_slow_steps_are_not_held_back_by_the_window(make_farm: Any) -> None:
    # Steps slower than the coalescing window: no other token would join, so each goes alone.
    farm = make_farm(tokens("abcd", every_s=0.08))
    assert texts(farm.run()) == ["a", "b", "c", "d"]


def test_a_client_cancel_stops_the_engine_and_records_cancelled(make_farm: Any) -> None:
    farm = make_farm(tokens("abcdefghij", every_s=0.3))
    farm.streams.cancel_after_tokens = 1
    events = farm.run()
    generation = farm.engine.submitted[0]
    assert generation.cancelled
    assert generation.sent < 10
    assert events[-1].type == "done" and events[-1].fields["finish_reason"] == "cancelled"
    assert farm.job.status == JobStatus.cancelled.value
    assert farm.resent == []


def test_the_cancel_is_seen_within_one_poll(make_farm: Any) -> None:
    farm = make_farm(tokens("abcdefghij", every_s=1.0))
    farm.streams.cancel_after_tokens = 1
    start = farm.clock.now
    farm.run()
    # First token after 1 s; the flag is read at most one poll later.
    assert farm.clock.now - start <= 1.0 + 2 * CANCEL_POLL_S


def test_a_drain_hands_the_job_back_without_counting_the_attempt(make_farm: Any) -> None:
    farm = make_farm(tokens("abcdefghij", every_s=0.1))
    farm.runner.drain(0.35)
    events = farm.run()
    assert farm.engine.submitted[0].cancelled
    assert "done" not in kinds(events) and "error" not in kinds(events)
    assert farm.job.status == JobStatus.queued.value and farm.job.attempts == 0
    assert farm.resent == [(farm.job.id, MODEL)]
    # The token that arrived as the drain fell due is published; the cancel follows it.
    assert "".join(texts(events)) == "abcd"


def test_a_drained_job_is_requeued_even_if_the_engine_never_confirms(make_farm: Any) -> None:
    farm = make_farm(tokens("abcdefghijklmnopqrstuvwxyz" * 3, every_s=0.1), deaf=True)
    farm.runner.drain(0.25)
    start = farm.clock.now
    events = farm.run()
    # Tokens the engine still sends after the cancel are not published: the next
    # attempt generates them again.
    assert farm.engine.submitted[0].sent > 3
    assert "".join(texts(events)) == "abc"
    assert farm.job.status == JobStatus.queued.value
    assert farm.resent == [(farm.job.id, MODEL)]
    assert farm.clock.now - start >= 0.25 + DRAIN_CANCEL_WAIT_S


def test_a_job_that_ends_as_the_drain_cancels_it_is_done_with_every_token(
    make_farm: Any,
) -> None:
    """The engine finished the request (here its last token) in the step the
    cancel came after: the job is done, not handed back, and the tokens that
    came after the drain fell due are published before ``done``, whose text
    holds them (found by a scaler's SIGKILL in CI: the stream lacked the
    answer's last word)."""
    farm = make_farm(tokens("abcdef", every_s=0.1), end="length", late=True)
    farm.runner.drain(0.35)
    events = farm.run()
    assert farm.engine.submitted[0].cancelled and farm.resent == []
    assert farm.job.status == JobStatus.succeeded.value and farm.job.attempts == 1
    assert kinds(events)[-1] == "done"
    assert "".join(texts(events)) == events[-1].text == farm.job.output_text == "abcdef"


def test_a_message_that_arrives_after_the_drain_is_passed_on(make_farm: Any) -> None:
    farm = make_farm(tokens("ab", every_s=0.1))
    farm.runner.drain(0)
    assert farm.run() == []
    assert farm.engine.submitted == [] and farm.job.status == JobStatus.queued.value
    assert farm.resent == [(farm.job.id, MODEL)]


def test_a_job_past_its_timeout_fails_with_the_text_so_far(
    make_farm: Any, settings: Settings
) -> None:
    farm = make_farm(
        tokens("abcdefghijklmnopqrstuvwxyz", every_s=0.3),
        settings_=settings.model_copy(update={"job_timeout_s": 1}),
    )
    events = farm.run()
    assert farm.engine.submitted[0].cancelled
    assert events[-1].type == "error"
    assert events[-1].fields["error"] == "timed out after 1 s"
    assert farm.job.status == JobStatus.failed.value
    assert farm.job.output_text == "".join(texts(events)) != ""


def test_a_job_past_its_queue_deadline_is_not_started(make_farm: Any) -> None:
    job = make_job(deadline_at=datetime.now(UTC) - timedelta(seconds=1))
    farm = make_farm(tokens("ab", every_s=0.1), job=job)
    events = farm.run()
    assert kinds(events) == ["error"] and events[0].fields["error"] == EXPIRED
    assert farm.engine.submitted == []


def test_a_duplicate_delivery_is_dropped(make_farm: Any) -> None:
    farm = make_farm(tokens("ab", every_s=0.1), job=make_job(status=JobStatus.running.value))
    assert farm.run() == []
    assert farm.engine.submitted == []


def test_the_final_write_is_retried_while_the_database_is_away(make_farm: Any) -> None:
    farm = make_farm(tokens("ab", every_s=0.1))
    farm.rows.finish_errors = 3
    events = farm.run()
    assert kinds(events)[-1] == "done"
    assert farm.job.status == JobStatus.succeeded.value
    assert farm.clock.slept == [0.2, 0.4, 0.8]


def test_a_write_that_committed_but_lost_its_answer_counts_as_written(make_farm: Any) -> None:
    farm = make_farm(tokens("ab", every_s=0.1))
    farm.rows.commit_then_raise = True
    events = farm.run()
    assert kinds(events)[-1] == "done"
    assert len(farm.rows.outcomes) == 1


def test_past_finish_retry_s_the_error_leaves_the_job_to_the_reaper(make_farm: Any) -> None:
    farm = make_farm(tokens("ab", every_s=0.1))
    farm.rows.finish_errors = 10_000
    with pytest.raises(SQLAlchemyError):
        farm.run()
    assert "done" not in kinds(farm.streams.of(farm.job.id))
    assert farm.job.status == JobStatus.running.value
    assert farm.runner.active_jobs == []


def test_a_later_attempt_continues_what_the_stream_holds(make_farm: Any) -> None:
    job = make_job(attempts=1)
    farm = make_farm(tokens("cd", every_s=0.1), job=job)
    earlier = [
        JobEvent(0, "started", {"attempt": 1, "worker": "other:2"}),
        JobEvent(1, "token", {"text": "ab", "ids": [7, 8]}),
    ]
    farm.streams.append(job.id, earlier)
    events = farm.run()[2:]
    request = farm.engine.submitted[0].request
    assert list(request.resume_ids or ()) == [7, 8] and request.resume_text == "ab"
    assert kinds(events) == ["started", "resumed", "token", "token", "done"]
    # `started` is written in one append with the `resumed` that follows it.
    assert kinds(farm.streams.appends[1]) == ["started", "resumed"]
    assert events[1].fields["previous_worker"] == "other:2"
    assert events[-1].fields["text"] == "abcd"


def test_a_worker_whose_stream_was_taken_writes_nothing_more(make_farm: Any) -> None:
    # The reaper took this worker for lost and a later attempt took the stream
    # after this one's first token.
    farm = make_farm(tokens("abcdef", every_s=0.1))
    farm.streams.taken_after_appends = 2
    events = farm.run()
    assert kinds(events) == ["started", "token"]
    assert farm.engine.submitted[0].cancelled
    assert farm.job.status == JobStatus.running.value

"""The job runner: one job from claim to final row, streaming events on the way.

It is what the Celery task calls, and knows nothing of Celery: claim the row
(a duplicate delivery loses the claim and is dropped), submit to the engine,
publish coalesced token events, honour cancellation, write the outcome and
its metrics. While a job's text waits to be published, its thread sleeps until
the window ends or the request finishes: tokens that arrive meanwhile wait in
the engine's handle, so the thread wakes once a window, not once a token, and
leaves the cores (and the GIL) to the engine's step. Windows are cut from the
monotonic clock (``stream_coalesce_ms`` each), the same for every job: a
worker's job threads wake and publish together, once a window (not also at
the window's first token, as when each window began with its first token),
rather than at instants scattered over it. (Measured on 2 cores at 16
clients, the farm's tokens/s did not move: 939 / 984 / 907 against 943 / 906
in alternating runs.) Under load the window lengthens: a worker with more
streams than ``stream_writes_per_s`` allows at ``stream_coalesce_ms`` gathers
each for ``streams / stream_writes_per_s`` seconds, up to
``stream_coalesce_max_ms`` (:func:`coalescing_window_s`).

Continuation: a job run again (its worker was lost, a drain handed it back,
its outcome could not be written) goes on from what its stream already holds.
The runner reads the stream's history at the claim: the ids of every token
event (each carries the ids its text came from, exactly as generated) and
their text are submitted as ``resume_ids`` / ``resume_text``, so the engine
prefills prompt plus output and continues with the remaining budget. The
attempt begins with ``started`` then ``resumed`` (``attempt``, ``worker``,
``tokens`` carried over, ``previous_worker``); clients see one answer. When
continuing is impossible, a ``restart`` event (``reason``) says the output
starts again: prompt plus output do not fit the engine's context, or the
stream's history is incomplete (expired, or lost with Redis).

A later attempt's ``started`` is written in one append with the event that
follows it (``resumed``, ``restart`` or ``error``), so the stream never holds
the one without the other: a worker killed between two writes would leave an
attempt that said it started but not what it continued, and the next
attempt's ``resumed`` would name that worker, which carried nothing, as the
previous one. A first run writes ``started`` at once.

Fencing: right after the claim, the attempt takes the stream and reads its
history in the same transaction (:meth:`EventLog.take`), and writes only while
it holds it. A worker taken for lost while it still runs (a long pause) can then
neither add tokens the next attempt did not carry over nor interleave with
it: its write is refused (:class:`StreamTaken`) and it drops the job.

Draining (the worker was told to stop): :meth:`JobRunner.drain` sets a
deadline (``worker_grace_s``, 0 by default: at once); jobs still generating
then are cancelled and put back in the queue (``running → queued`` only if
still ours, a new message through ``resend``) to continue elsewhere, and the
attempt is given back — a drain is not the job's fault, so it does not count
toward ``max_attempts``. Tokens the engine releases after the cancel are not
published: the next attempt generates them again. Unless the request ended
(its last token, a stop) in the step before the engine saw the cancel: then
the job is done, and those tokens are published before its ``done``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import redis
from sqlalchemy.exc import SQLAlchemyError

from config import ModelDefinition, Settings
from db.jobs import JobOutcome
from db.schema import Job, JobStatus
from jobs import metrics as m
from jobs.events import JobEvent, StreamedOutput, StreamTaken, usage
from jobs.joblog import log_job_event
from models.engine import (
    EngineError,
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    PromptTooLong,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)

# How often a running job looks for a cancel request, in seconds.
CANCEL_POLL_S = 0.1
# How long a worker keeps retrying to publish a job's events while Redis is
# unreachable before it gives the job up, in seconds.
PUBLISH_RETRY_S = 60.0
# How long a drained job waits for the engine to confirm its cancellation
# before it is re-queued anyway (an engine that stopped stepping never will).
DRAIN_CANCEL_WAIT_S = 5.0


T = TypeVar("T")


class JobRows(Protocol):
    """The job rows a runner claims and finishes (:class:`db.jobs.JobStore`)."""

    def claim(self, job_id: str, worker: str) -> Job | None: ...
    def get(self, job_id: str) -> Job | None: ...
    def finish(self, job_id: str, worker: str, outcome: JobOutcome) -> bool: ...
    def requeue(self, job_id: str, worker: str, *, count_attempt: bool) -> Job | None: ...


class JobStreams(Protocol):
    """The event log a runner writes and its cancel flags (:class:`jobs.events.EventLog`)."""

    def append(self, job_id: str, events: list[JobEvent]) -> None: ...
    def append_fenced(self, job_id: str, events: list[JobEvent], owner: str) -> bool: ...
    def take(self, job_id: str, owner: str) -> list[JobEvent]: ...
    def next_seq(self, job_id: str) -> int: ...
    def cancel_requested(self, job_id: str) -> bool: ...


class Generation(Protocol):
    """One submitted request (:class:`models.engine.RequestHandle`)."""

    def next_events(
        self, timeout: float | None = None, *, until_finished: bool = False
    ) -> list[TokenEvent | FinishEvent]: ...
    def cancel(self) -> None: ...


class GenerationEngine(Protocol):
    """What a runner asks of the engine (:class:`models.engine.Engine`)."""

    def encode_prompt(self, text: str, *, truncate: bool = False) -> list[int]: ...
    def encode_chat(
        self, messages: list[dict[str, str]], *, truncate: bool = False
    ) -> list[int]: ...
    def submit(self, request: GenerationRequest) -> Generation: ...


class MetricsRecorder(Protocol):
    """One batch of metric changes (:class:`jobs.metrics.MetricsBatch`)."""

    def inc(self, spec: m.CounterSpec, labels: Mapping[str, str], amount: float = 1) -> None: ...
    def observe(self, spec: m.HistogramSpec, labels: Mapping[str, str], value: float) -> None: ...
    def commit(self) -> None: ...


class Metrics(Protocol):
    """Where a runner counts jobs and tokens (:class:`jobs.metrics.MetricsStore`)."""

    def batch(self) -> MetricsRecorder: ...


def retry_redis(job_id: str, what: str, call: Callable[[], T]) -> T:
    """``call()``, retried while Redis is unreachable, for up to :data:`PUBLISH_RETRY_S`.

    Redis restarting or failing over must not fail a generation; redis-py
    reconnects by itself on the next try.
    """
    delay = 0.1
    deadline = time.monotonic() + PUBLISH_RETRY_S
    while True:
        try:
            return call()
        except redis.RedisError as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("job %s: could not %s (%s); retrying", job_id, what, exc)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _seconds(start: datetime | None, end: datetime) -> float | None:
    return round((end - start).total_seconds(), 4) if start is not None else None


def sampling_params(definition: ModelDefinition, requested: dict[str, Any]) -> SamplingParams:
    """The request's sampling parameters over the model's defaults."""
    d = definition.sampling
    stop = requested.get("stop") or ()
    return SamplingParams(
        max_new_tokens=int(requested.get("max_new_tokens") or d.max_new_tokens),
        temperature=float(requested.get("temperature", d.temperature)),
        top_p=float(requested.get("top_p", d.top_p)),
        top_k=int(requested.get("top_k", d.top_k)),
        repetition_penalty=float(requested.get("repetition_penalty", d.repetition_penalty)),
        stop=tuple(stop),
        seed=requested.get("seed"),
    )


@dataclass
class _Stream:
    """Sequence numbers and the pending token text of one job's stream."""

    events: JobStreams
    job_id: str
    next_seq: int
    owner: str | None = None  # this attempt's fence token (see EventLog.take)
    pending: str = ""
    pending_ids: list[int] = field(default_factory=list)
    held: list[JobEvent] = field(default_factory=list)
    # Set by a fenced write, which reads the job's cancel request in the same round
    # trip: whether one was seen, and whether one was read since the runner last looked.
    cancel_seen: bool = False
    cancel_read: bool = False

    def hold(self, kind: str, **fields: Any) -> None:
        """Number an event now and write it with the next write, in the same append."""
        self.held.append(self._event(kind, fields))

    def release(self) -> None:
        """Write the held events now."""
        if self.held:
            self._write([])

    def emit(self, kind: str, **fields: Any) -> None:
        """Write the pending text and then this event, in one append."""
        events = [self._pending_event()] if self.pending else []
        self._write([*events, self._event(kind, fields)])

    def add_text(self, text: str, ids: list[int]) -> None:
        self.pending += text
        self.pending_ids.extend(ids)

    def flush(self) -> None:
        if self.pending:
            self._write([self._pending_event()])

    def _pending_event(self) -> JobEvent:
        # ``ids`` are what a next attempt carries over (see the module docstring).
        event = self._event("token", {"text": self.pending, "ids": self.pending_ids})
        self.pending, self.pending_ids = "", []
        return event

    def _event(self, kind: str, fields: dict[str, Any]) -> JobEvent:
        event = JobEvent(seq=self.next_seq, type=kind, fields=fields)
        self.next_seq += 1
        return event

    def _write(self, events: list[JobEvent]) -> None:
        # A write that half-happened before an error repeats a seq, which every
        # reader skips.
        events, self.held = [*self.held, *events], []
        if self.owner is None:
            retry_redis(
                self.job_id, "publish events", lambda: self.events.append(self.job_id, events)
            )
            return
        owner = self.owner
        cancel = retry_redis(
            self.job_id,
            "publish events",
            lambda: self.events.append_fenced(self.job_id, events, owner),
        )
        self.cancel_read = True
        self.cancel_seen = self.cancel_seen or cancel


def coalescing_window_s(settings: Settings, streams: int) -> float:
    """The coalescing window of a worker writing ``streams`` streams, in seconds.

    ``stream_coalesce_ms`` while the worker's writes stay within
    ``stream_writes_per_s``; past that, ``streams / stream_writes_per_s`` (each
    stream gathers longer, the worker writes no more often), up to
    ``stream_coalesce_max_ms``. Every write costs the same few hundred
    microseconds of CPU wherever its tokens go (the worker's write, Redis,
    the API's relay and socket, the client's read) however many tokens it
    holds, and on a CPU host those cores are the engine's: fewer, fuller
    events leave them to generating. A longer window never delays a first
    token or an answer's end (:meth:`JobRunner._follow`).
    """
    base = settings.stream_coalesce_ms / 1000
    if base <= 0 or settings.stream_writes_per_s <= 0:
        return base
    longest = max(base, settings.stream_coalesce_max_ms / 1000)
    return min(longest, max(base, streams / settings.stream_writes_per_s))


def _window_end(now: float, window_s: float) -> float:
    """The end of the coalescing window ``now`` falls in, on a grid of ``window_s``.

    The grid is the monotonic clock's, so every job of a worker (and every worker
    of a host) publishes at the same instants: the engine's step is interrupted
    once a window by all of them, not once per job at scattered times.
    """
    return (math.floor(now / window_s) + 1) * window_s


def _joined(events: list[TokenEvent | FinishEvent]) -> TokenEvent | None:
    """The token events of ``events`` as one (their text and ids in order), or None."""
    tokens = [event for event in events if isinstance(event, TokenEvent)]
    if len(tokens) <= 1:
        return tokens[0] if tokens else None
    return TokenEvent(
        "".join(event.text for event in tokens),
        [token for event in tokens for token in event.token_ids],
    )


class JobRunner:
    """Runs jobs of one model on this process's engine."""

    def __init__(
        self,
        *,
        settings: Settings,
        definition: ModelDefinition,
        engine: GenerationEngine,
        jobs: JobRows,
        events: JobStreams,
        worker_id: str,
        resend: Callable[[str, str], None] | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``resend(job_id, model)`` puts a re-queued job's message back on its queue.

        ``clock`` (seconds, monotonic) and ``sleep`` time the coalescing
        window, the cancel poll, drains, the job timeout and the final
        write's retries.
        """
        self.settings = settings
        self.definition = definition
        self.engine = engine
        self.jobs = jobs
        self.events = events
        self.worker_id = worker_id
        self.resend = resend
        self.metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self.last_job: str | None = None
        self._drain_at: float | None = None
        self._lock = threading.Lock()
        self._active: set[str] = set()

    def drain(self, grace_s: float) -> None:
        """Stop after ``grace_s`` seconds: jobs still running then are re-queued.

        Safe to call from a signal handler (it only records the deadline).
        """
        deadline = self._clock() + grace_s
        if self._drain_at is None or deadline < self._drain_at:
            self._drain_at = deadline

    def _drain_due(self, now: float) -> bool:
        return self._drain_at is not None and now >= self._drain_at

    @property
    def active_jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._active)

    def run(self, job_id: str) -> None:
        if self._drain_due(self._clock()):
            self._pass_on(job_id)
            return
        job = self.jobs.claim(job_id, self.worker_id)
        if job is None:
            log.info("job %s is not queued (duplicate delivery or cancelled); dropped", job_id)
            return
        if job.status == JobStatus.failed.value:  # the claim expired it: never started
            log_job_event("failed", job, worker=self.worker_id, error=job.error)
            stream = _Stream(self.events, job_id, self._next_seq(job_id))
            stream.emit("error", error=job.error)
            return
        self.last_job = job_id
        with self._lock:
            self._active.add(job_id)
        log_job_event(
            "started",
            job,
            worker=self.worker_id,
            queue_wait_s=_seconds(job.created_at, job.started_at or datetime.now(UTC)),
        )
        try:
            self._record_start(job)
            # Fence and read in one transaction: an earlier attempt's late write is
            # either in this history or refused, never after it (StreamTaken).
            owner = f"{self.worker_id}/{uuid.uuid4().hex}"
            history = retry_redis(
                job_id, "take and read its stream", lambda: self.events.take(job_id, owner)
            )
            next_seq = max(history[-1].seq + 1 if history else 0, 1)
            stream = _Stream(self.events, job_id, next_seq, owner=owner)
            # Written with what follows it (module docstring).
            stream.hold("started", attempt=job.attempts, worker=self.worker_id)
            try:
                self._generate(job, stream, StreamedOutput.of(history))
            except StreamTaken:
                # Re-queued while this worker still ran it (it looked lost): the
                # next attempt owns the job; stop here, writing nothing.
                log.warning("job %s was taken over by a later attempt; dropped here", job_id)
            except Exception as exc:  # the job fails; the worker keeps serving
                log.exception("job %s failed", job_id)
                self._fail(job, stream, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._active.discard(job_id)

    def _next_seq(self, job_id: str) -> int:
        return retry_redis(job_id, "read its stream", lambda: self.events.next_seq(job_id))

    def _pass_on(self, job_id: str) -> None:
        """A message that arrived after the drain deadline: leave the job to another worker.

        The message is acknowledged when this returns, so it is sent again.
        """
        job = self.jobs.get(job_id)
        if job is not None and job.status == JobStatus.queued.value and self.resend is not None:
            self.resend(job_id, job.model)
            log_job_event("queued", job, reason="arrived at a draining worker; sent back")

    def _record_start(self, job: Job) -> None:
        if self.metrics is None or job.started_at is None:
            return
        batch = self.metrics.batch()
        if job.attempts == 1:  # the wait before a re-try would include the lost attempt
            wait = (job.started_at - job.created_at).total_seconds()
            batch.observe(m.QUEUE_WAIT, {"model": job.model}, max(0.0, wait))
        batch.commit()

    def _encode(self, job: Job) -> list[int]:
        truncate = bool(job.params.get("truncate", False))
        if job.messages is not None:
            return self.engine.encode_chat(job.messages, truncate=truncate)
        return self.engine.encode_prompt(job.prompt or "", truncate=truncate)

    def _submit(
        self, job: Job, stream: _Stream, before: StreamedOutput
    ) -> Generation | FinishEvent:
        """Submit the job, continuing what earlier attempts streamed (module docstring).

        Returns a :class:`FinishEvent` instead when earlier attempts already
        used the whole budget (their outcome was lost, not their tokens).
        Raises :class:`InvalidRequest` for a request the engine refuses.
        """
        prompt_ids = self._encode(job)
        params = sampling_params(self.definition, job.params)
        fresh = GenerationRequest(job.id, prompt_ids, params)
        if before.attempts == 0 and (before.whole or job.attempts <= 1):
            stream.release()  # a first run: `started` goes out at once
            return self.engine.submit(fresh)
        if not before.whole:
            self._restart(job, stream, "the stream's history is incomplete")
            return self.engine.submit(fresh)
        if len(before.ids) >= params.max_new_tokens:
            self._resumed(job, stream, before)
            return FinishEvent("length", before.text, len(prompt_ids), len(before.ids))
        try:
            handle = self.engine.submit(
                GenerationRequest(
                    job.id,
                    prompt_ids,
                    params,
                    resume_ids=before.ids,
                    resume_text=before.text,
                )
            )
        except PromptTooLong as exc:
            reason = (
                f"prompt plus output ({exc.n_tokens} tokens) exceed the model's limit "
                f"of {exc.limit}"
            )
            self._restart(job, stream, reason)
            return self.engine.submit(fresh)
        self._resumed(job, stream, before)
        return handle

    def _resumed(self, job: Job, stream: _Stream, before: StreamedOutput) -> None:
        stream.emit(
            "resumed",
            attempt=job.attempts,
            worker=self.worker_id,
            tokens=len(before.ids),
            previous_worker=before.last_worker,
        )
        self._count_continuation(job, "resumed")
        log.info(
            "job %s resumed after %d tokens (attempt %d)", job.id, len(before.ids), job.attempts
        )

    def _restart(self, job: Job, stream: _Stream, reason: str) -> None:
        stream.emit("restart", reason=reason, attempt=job.attempts, worker=self.worker_id)
        self._count_continuation(job, "restart")
        log.warning("job %s cannot be continued (%s); generated again", job.id, reason)

    def _count_continuation(self, job: Job, outcome: str) -> None:
        if self.metrics is not None:
            batch = self.metrics.batch()
            batch.inc(m.JOB_CONTINUATIONS, {"model": job.model, "outcome": outcome})
            batch.commit()

    def _generate(self, job: Job, stream: _Stream, before: StreamedOutput) -> None:
        try:
            submitted = self._submit(job, stream, before)
        except InvalidRequest as exc:
            self._fail(job, stream, str(exc))
            return
        if isinstance(submitted, FinishEvent):
            self._finish(job, stream, submitted, None, False)
            return
        try:
            self._follow(job, stream, submitted)
        except BaseException:  # the engine must not generate on for nobody
            submitted.cancel()
            raise

    def _follow(self, job: Job, stream: _Stream, handle: Generation) -> None:
        """Publish ``handle``'s events until it finishes, then record the outcome."""
        deadline = self._clock() + self.settings.job_timeout_s
        next_cancel_check = self._clock() + CANCEL_POLL_S
        first_token_at: datetime | None = None
        timed_out = False
        user_cancelled = False
        drained_at: float | None = None
        batch = self.metrics.batch() if self.metrics is not None else None
        labels = {"model": job.model}
        last_token_t: float | None = None
        # Steps faster than the window: wake once a window, at the window's end on a
        # clock grid every job of the process shares, and publish what came meanwhile.
        gathering = False
        after_drain: list[TokenEvent] = []  # released after a drain's cancel, unpublished
        while True:
            now = self._clock()
            # The same for every job of this worker (its count of streams), hence one grid.
            coalesce_s = coalescing_window_s(self.settings, len(self._active))
            due = _window_end(now, coalesce_s) if gathering else None
            wait = CANCEL_POLL_S if due is None else min(CANCEL_POLL_S, due - now)
            # While gathering, tokens join the pending text without waking this thread:
            # it wakes at the window's end (or the finish), not at each token.
            events = handle.next_events(timeout=wait, until_finished=gathering)
            now = self._clock()
            event = _joined(events)
            if isinstance(event, TokenEvent) and drained_at is not None and not user_cancelled:
                # Handed back, the next attempt generates it again (module docstring);
                # unless the engine ended the request before it saw the cancel.
                after_drain.append(event)
            elif isinstance(event, TokenEvent):
                first = first_token_at is None and bool(event.text)
                if first:
                    first_token_at = datetime.now(UTC)
                    log_job_event(
                        "first_token", job, ttft_s=_seconds(job.started_at, first_token_at)
                    )
                gap = None if last_token_t is None else now - last_token_t
                n = max(1, len(event.token_ids))
                if batch is not None and gap is not None:
                    # A chunk of n tokens after `gap` seconds: n tokens of gap/n each.
                    for _ in range(n):
                        batch.observe(m.INTER_TOKEN_LATENCY, labels, gap / n)
                last_token_t = now
                stream.add_text(event.text, event.token_ids)
                # Time-to-first-token is what a user feels: never coalesce it. Nor
                # gather when the engine's steps are slower than the window (a big
                # batch): no other token would join this one, the wait only delays
                # it and costs a wake-up.
                gathering = (
                    coalesce_s > 0 and not first and gap is not None and gap / n < coalesce_s
                )
                if not gathering:
                    stream.flush()
            if events and isinstance(events[-1], FinishEvent):
                finish = events[-1]
                drained = drained_at is not None and not user_cancelled
                if drained and finish.finish_reason == "cancelled":
                    stream.flush()  # the next attempt continues from what the stream holds
                    self._requeue(job, stream)
                    return
                # Finished in the step that the cancel came after: its text is the
                # answer's end, published before the `done` that holds it.
                for late in after_drain:
                    stream.add_text(late.text, late.token_ids)
                if stream.pending and first_token_at is None:
                    first_token_at = datetime.now(UTC)
                # The answer's last text goes out with its `done` (or `error`), in one
                # write, once the final row is recorded.
                self._finish(job, stream, finish, first_token_at, timed_out, batch)
                return
            if stream.pending and due is not None and now >= due:
                stream.flush()
            if drained_at is None and self._drain_due(now):
                drained_at = now
                handle.cancel()
            elif drained_at is not None and now - drained_at >= DRAIN_CANCEL_WAIT_S:
                log.warning("job %s: the engine did not confirm its cancel; re-queued", job.id)
                stream.flush()
                self._requeue(job, stream)
                return
            if stream.cancel_seen and not user_cancelled:
                user_cancelled = True  # read with the last write
                handle.cancel()
            if now >= next_cancel_check:
                next_cancel_check = now + CANCEL_POLL_S
                # A write since the last look read the cancel request already.
                read, stream.cancel_read = stream.cancel_read, False
                if now >= deadline and not timed_out:
                    timed_out = True
                    handle.cancel()
                elif not read and self._cancel_requested(job.id):
                    user_cancelled = True
                    handle.cancel()

    def _cancel_requested(self, job_id: str) -> bool:
        try:
            return self.events.cancel_requested(job_id)
        except redis.RedisError:
            return False

    def _finish(
        self,
        job: Job,
        stream: _Stream,
        event: FinishEvent,
        first_token_at: datetime | None,
        timed_out: bool,
        batch: MetricsRecorder | None = None,
    ) -> None:
        if event.finish_reason == "error" or timed_out:
            error = event.error or "error"
            if timed_out:
                error = f"timed out after {self.settings.job_timeout_s} s"
            self._fail(job, stream, error, event=event, first_token_at=first_token_at, batch=batch)
            return
        status = JobStatus.cancelled if event.finish_reason == "cancelled" else JobStatus.succeeded
        outcome = JobOutcome(
            status=status,
            output_text=event.text,
            finish_reason=event.finish_reason,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            first_token_at=first_token_at,
        )
        if not self._record_outcome(job, outcome):
            log.warning("job %s was taken from this worker; its result is dropped", job.id)
            return
        started = job.started_at or datetime.now(UTC)
        finished = datetime.now(UTC)
        total_s = (finished - started).total_seconds()
        log_job_event(
            "cancelled" if status is JobStatus.cancelled else "finished",
            job,
            finish_reason=event.finish_reason,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            total_s=round(total_s, 4),
        )
        if batch is not None:
            labels = {"model": job.model}
            batch.inc(m.JOBS_FINISHED, {**labels, "status": status.value})
            batch.inc(m.GENERATED_TOKENS, labels, event.completion_tokens)
            batch.inc(m.PROMPT_TOKENS, labels, event.prompt_tokens)
            if first_token_at is not None:
                ttft = (first_token_at - started).total_seconds()
                batch.observe(m.TIME_TO_FIRST_TOKEN, labels, max(0.0, ttft))
            if status is JobStatus.succeeded:
                e2e = (finished - job.created_at).total_seconds()
                batch.observe(m.E2E_LATENCY, labels, max(0.0, e2e))
            batch.commit()
        stream.emit(
            "done",
            finish_reason=event.finish_reason,
            text=event.text,
            usage=usage(event.prompt_tokens, event.completion_tokens),
            timings={
                "queue_s": round((started - job.created_at).total_seconds(), 4),
                "first_token_s": round((first_token_at - started).total_seconds(), 4)
                if first_token_at
                else None,
                "total_s": round(total_s, 4),
                "tokens_per_s": round(event.completion_tokens / total_s, 2) if total_s else None,
            },
        )

    def _record_outcome(self, job: Job, outcome: JobOutcome) -> bool:
        """Write the final row, retrying while the database is away; False if not ours.

        A restart of the database must not leave a finished job ``running``:
        the same conditional UPDATE is retried for up to ``finish_retry_s``. A
        retry that finds the row already final (the first try committed but its
        answer was lost) counts as written. Past the deadline the error is
        raised: the job leaves this worker's active list (its heartbeat's
        ``active_jobs``) and the reaper re-runs it.
        """
        delay = 0.2
        deadline = self._clock() + self.settings.finish_retry_s
        retried = False
        while True:
            try:
                if self.jobs.finish(job.id, self.worker_id, outcome):
                    return True
                if not retried:
                    return False
                row = self.jobs.get(job.id)
                return (
                    row is not None
                    and row.worker == self.worker_id
                    and row.status == outcome.status.value
                    and row.output_text == outcome.output_text
                )
            except SQLAlchemyError as exc:
                if self._clock() >= deadline:
                    raise
                retried = True
                log.warning("job %s: could not write its outcome (%s); retrying", job.id, exc)
                self._sleep(delay)
                delay = min(delay * 2, 2.0)

    def _fail(
        self,
        job: Job,
        stream: _Stream,
        error: str,
        *,
        event: FinishEvent | None = None,
        first_token_at: datetime | None = None,
        batch: MetricsRecorder | None = None,
    ) -> None:
        outcome = JobOutcome(
            status=JobStatus.failed,
            output_text=event.text if event else "",
            finish_reason="error",
            prompt_tokens=event.prompt_tokens if event else None,
            completion_tokens=event.completion_tokens if event else None,
            error=error,
            first_token_at=first_token_at,
        )
        if self._record_outcome(job, outcome):
            log_job_event("failed", job, error=error)
            stream.emit("error", error=error)
            if self.metrics is not None:
                batch = batch or self.metrics.batch()
                labels = {"model": job.model}
                batch.inc(m.JOBS_FINISHED, {**labels, "status": JobStatus.failed.value})
                if event is not None:
                    batch.inc(m.GENERATED_TOKENS, labels, event.completion_tokens)
                    batch.inc(m.PROMPT_TOKENS, labels, event.prompt_tokens)
                batch.commit()

    def _requeue(self, job: Job, stream: _Stream) -> None:
        """Give a drained job back to the queue, if it is still ours."""
        if self.jobs.requeue(job.id, self.worker_id, count_attempt=False) is None:
            log.info("job %s is no longer ours; not re-queued by the drain", job.id)
            return
        log_job_event("retried", job, reason="worker draining")
        if self.metrics is not None:
            batch = self.metrics.batch()
            batch.inc(m.JOB_RESTARTS, {"model": job.model, "reason": "worker_draining"})
            batch.commit()
        if self.resend is None:
            return
        try:
            self.resend(job.id, job.model)
        except Exception as exc:  # the reaper's reconciler sends it later
            log.warning("job %s re-queued but its message could not be sent: %s", job.id, exc)
            return
        log.info("job %s re-queued by the drain", job.id)


__all__ = ["EngineError", "JobRunner", "sampling_params"]

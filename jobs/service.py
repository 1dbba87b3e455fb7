"""The job service: a job's submission and life, whichever front door took it.

:meth:`JobService.submit` is the one submission path of every front door
(native, OpenAI, TGI, the multiplexed websocket): the served model and its
token, the model's limits, idempotency, capacity, queue length and the
caller's limits, the deadline, then the row, the ``queued`` event and the
generate message. Then cancelling, expiring a job queued past its deadline,
and a finished job's final event rebuilt from its row.

It knows nothing of Flask, so it is driven the same way from a test or
another process: what the API reads from a request (the client's address,
the request id, the idempotency key) comes in as plain arguments, and a
request it will not take raises a :class:`jobs.errors.JobRefused`, which the
API answers in HTTP (:func:`api.errors.refusal_error`). What it asks of the
workers' side comes through :class:`Fleet` (``jobs/`` imports no ``fleet/``).

:meth:`JobService.follow` is the reading half: a job's events from a seq on,
live, ending after its final one, through the process's :class:`Relay` (the
API's pub/sub hub); how an event is shown to whom stays with the API.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol, cast

import redis
from sqlalchemy.exc import SQLAlchemyError

from config import Catalog, ModelDefinition, Settings
from db.accounts import Principal
from db.jobs import DuplicateIdempotencyKey, JobStore
from db.lookups import RowCache
from db.overrides import CACHE_MAX_AGE_S, ModelOverrides, Override, apply, cache_key
from db.schema import Job, JobStatus, utcnow
from db.session import Database
from jobs.errors import InvalidRequest, QueueDown, ReaderLagging, TokenRequired, UnknownModel
from jobs.events import EventLog, JobEvent, usage
from jobs.joblog import log_job_event
from jobs.limits import Limiter, caller_for, check_queue
from jobs.messages import queue_generate
from jobs.queues import queue_name

log = logging.getLogger(__name__)

CancelResult = Literal["cancelled", "cancel_requested", "final"]

AWAKE_MAX_AGE_S = 1.0
"""How often one process checks (and wakes) a model's scaler as jobs arrive, in seconds."""
RECORD_CHECK_S = 10.0
"""How often a quiet stream's job row is read again, in seconds, to notice a job
that ended without its final event reaching the stream (see :meth:`JobService.follow`)."""


class Fleet(Protocol):
    """What a submission asks of the workers' side (:class:`fleet.capacity.SubmissionFleet`)."""

    def check_capacity(self, definition: ModelDefinition) -> None:
        """Raise :class:`jobs.errors.Unservable` when no worker of the model can ever come."""

    def wake_if_idle(self, model: str) -> None:
        """Wake the scaler for ``model`` if it is at zero; never raises."""


class Subscription(Protocol):
    """One reader's live events of one job (:class:`api.streams.Subscription`)."""

    @property
    def lagging(self) -> bool:
        """True once its buffer of live events overflowed."""

    def events(self, after: int = -1, *, idle_timeout: float | None = None) -> Iterator[JobEvent]:
        """Every event with ``seq > after`` in order, ending after a final event or
        after ``idle_timeout`` seconds with nothing new."""


class Relay(Protocol):
    """The process's live events of jobs (:class:`api.streams.RelayHub`)."""

    def subscribe(self, job_id: str) -> contextlib.AbstractContextManager[Subscription]:
        """A subscription to ``job_id``'s events, ended when its context exits."""


class Watch(Protocol):
    """The subscriptions feeding one reader (:class:`api.streams.LagWatch`)."""

    def add(self, sub: Any) -> None: ...

    def discard(self, sub: Any) -> None: ...


def job_row_key(job_id: str) -> str:
    """The key of ``job_id``'s row in the process's row cache."""
    return f"job:{job_id}"


@dataclass(frozen=True)
class JobSpec:
    """What a job is made of, whichever front door's JSON it came in.

    ``params`` holds only the sampling parameters the client set; exactly one
    of ``prompt`` and ``messages`` is given (the front doors' schemas check it).
    """

    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    deadline_s: float | None = None


@dataclass(frozen=True)
class Submitted:
    """A job as submitted; ``replayed`` when an idempotency key found an earlier one."""

    job: Job
    replayed: bool = False


def request_hash(spec: JobSpec) -> str:
    """SHA-256 (hex) of what a job is made of: model, input, sampling params, deadline.

    Two requests with the same hash make the same job, whichever front door
    or JSON spelling they came with.
    """
    canonical = {
        "model": spec.model,
        "messages": spec.messages,
        "prompt": spec.prompt,
        "params": spec.params,
        "deadline_s": spec.deadline_s,
    }
    raw = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


def _replay(earlier: Job, digest: str) -> Submitted:
    """The earlier job of an idempotency key; refused when it was made for another request."""
    if earlier.request_hash is not None and earlier.request_hash != digest:
        raise InvalidRequest(
            "Idempotency-Key: keys for idempotent requests can only be used with the same "
            f"parameters; this key was first used for job {earlier.id} with different ones",
            field="Idempotency-Key",
        )
    return Submitted(earlier, replayed=True)


def final_from_record(job: Job, seq: int) -> JobEvent:
    """The final event of a finished ``job``, rebuilt from its row (``from_record``: true).

    For a stream that no longer holds it: expired after ``stream_ttl_s``, or
    lost with a Redis restart between the worker's write and any reader.
    """
    if job.status == JobStatus.failed:
        return JobEvent(seq, "error", {"error": job.error or "failed", "from_record": True})
    fields: dict[str, Any] = {
        "finish_reason": job.finish_reason
        or ("cancelled" if job.status == JobStatus.cancelled else "stop"),
        "text": job.output_text or "",
        "usage": usage(job.prompt_tokens or 0, job.completion_tokens or 0),
        "from_record": True,
    }
    return JobEvent(seq, "done", fields)


class JobService:
    """Submit, queue, cancel and expire jobs through the database and the event log.

    ``rows`` is the process's cache of rows read often (model overrides,
    queue counts, the rows of followed jobs): the same one its other readers use.
    """

    def __init__(
        self,
        settings: Settings,
        jobs: JobStore,
        events: EventLog,
        client: redis.Redis,
        *,
        catalog: Catalog,
        db: Database,
        rows: RowCache,
        fleet: Fleet,
        relay: Relay,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.events = events
        self.redis = client
        self.catalog = catalog
        self.db = db
        self.rows = rows
        self.fleet = fleet
        self.relay = relay
        self.limiter = Limiter(client, settings)

    def served_model(self, name: str) -> ModelDefinition:
        """The definition of a model served here, with its run-time overrides;
        :class:`UnknownModel` for one unknown or disabled."""
        definition = self.catalog.get(name)
        if definition is not None:
            override = self.rows.get(
                cache_key(name), CACHE_MAX_AGE_S, lambda: ModelOverrides(self.db).get(name)
            )
            definition = apply(definition, cast(Override | None, override))
        if definition is None or not definition.enabled:
            raise UnknownModel(f"model {name!r} is not served here", field="model")
        return definition

    @staticmethod
    def authorize_model(definition: ModelDefinition, principal: Principal | None) -> None:
        """A private model needs a token (:class:`TokenRequired` otherwise)."""
        if principal is None and not definition.public:
            raise TokenRequired(f"model {definition.name!r} needs an API token")

    def submit(
        self,
        spec: JobSpec,
        principal: Principal | None,
        *,
        address: str,
        request_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Submitted:
        """Record a job, log its ``queued`` event and put it on its model's queue.

        ``address`` is the client's (the limits of a caller without a token),
        ``request_id`` the one the job's row and log lines carry. Raises a
        :class:`~jobs.errors.JobRefused` before anything is stored or counted
        when the request cannot be served: unknown or disabled model, private
        model without a token, a parameter over the model's limits, a model
        that can never get a worker, a full queue or a caller over their
        limits (:class:`~jobs.errors.OverLimit`, with when to retry). A
        refused request is not counted against the caller's requests per
        minute. With ``idempotency_key``, a job already submitted with that
        key by the same caller is returned instead of a new one (before any
        limit is counted), or :class:`~jobs.errors.InvalidRequest` when the
        key was first used for a different request. A queue that cannot take
        the job (Redis or the broker down) is :class:`~jobs.errors.QueueDown`,
        with nothing kept or counted.
        """
        definition = self.served_model(spec.model)
        self.authorize_model(definition, principal)
        params = spec.params
        max_new = params.get("max_new_tokens")
        if max_new is not None and max_new > definition.limits.max_new_tokens:
            raise InvalidRequest(
                f"params.max_new_tokens: at most {definition.limits.max_new_tokens} "
                f"for {spec.model}",
                field="params.max_new_tokens",
            )
        scoped_key = digest = None
        if idempotency_key is not None:
            # Per user; a caller without a token is scoped by its address, so one
            # anonymous caller can never learn another's job id by guessing a key.
            scope = str(principal.user_id) if principal is not None else f"anon@{address}"
            scoped_key = f"{scope}:{idempotency_key}"
            digest = request_hash(spec)
            earlier = self.jobs.by_idempotency_key(scoped_key)
            if earlier is not None:
                return _replay(earlier, digest)
        self.fleet.check_capacity(definition)
        check_queue(definition, self.jobs, self.settings, self.rows)
        caller = caller_for(principal, address, self.settings)
        job_id = str(uuid.uuid4())
        admission = self.limiter.admit_job(caller, job_id, self.jobs)
        wait_s: float | None = self.settings.queue_deadline_s or None
        if spec.deadline_s is not None:
            wait_s = min(spec.deadline_s, wait_s) if wait_s else spec.deadline_s
        try:
            job = self.jobs.create(
                job_id=job_id,
                model=spec.model,
                user_id=principal.user_id if principal else None,
                messages=spec.messages,
                prompt=spec.prompt,
                params=params,
                deadline_at=utcnow() + timedelta(seconds=wait_s) if wait_s else None,
                idempotency_key=scoped_key,
                request_hash=digest,
                request_id=request_id,
            )
        except DuplicateIdempotencyKey:
            # A concurrent twin of this request won the insert: answer with its job.
            self.limiter.refund(admission)
            earlier = self.jobs.by_idempotency_key(scoped_key or "")
            if earlier is None:  # pragma: no cover - the twin's row was deleted meanwhile
                raise QueueDown("the job queue is unavailable; retry shortly") from None
            return _replay(earlier, digest or "")
        except BaseException:
            with contextlib.suppress(Exception):
                self.limiter.refund(admission)
            raise
        log_job_event("submitted", job)
        try:
            self.enqueue(job)
        except Exception as exc:  # broker or Redis down: nothing was accepted (row deleted)
            # Redis may be what is down; the prune on the caller's next refusal frees
            # the slot, and the window forgets the request within a minute.
            with contextlib.suppress(Exception):
                self.limiter.refund(admission)
            if isinstance(exc, (redis.RedisError, OSError)):
                raise QueueDown("the job queue is unavailable; retry shortly") from None
            raise
        # The row as written: its stream, opened next (here, mostly), need not read it back.
        self.rows.put(job_row_key(job.id), job)
        # A model at zero starts a worker now: at most one check (and wake-up) per
        # model a second per process; a lost wake-up only waits for the scaler's tick.
        awake = f"awake:{spec.model}"
        if not self.rows.peek(awake, AWAKE_MAX_AGE_S):
            self.fleet.wake_if_idle(spec.model)
            self.rows.put(awake, True)
        return Submitted(job)

    def enqueue(self, job: Job) -> None:
        """Write ``job``'s ``queued`` event and put its message on its model's queue.

        Both in one round trip (MULTI), all or nothing. When that fails (Redis
        or the broker down) nothing was accepted: the row is deleted and the
        error raised for the caller to answer.
        """
        try:
            pipe = self.redis.pipeline(transaction=True)
            queued = JobEvent(seq=0, type="queued", fields={"model": job.model})
            self.events.append_to(pipe, job.id, [queued])
            queue_generate(pipe, self.settings, job.id, job.model)
            pipe.execute()
            log_job_event("queued", job, queue=queue_name(job.model))
        except Exception as exc:
            log_job_event("failed", job, error=f"not enqueued: {type(exc).__name__}; not kept")
            self.jobs.delete(job.id)
            raise

    def cancel(self, job_id: str) -> CancelResult:
        """Stop a job: a queued one ends at once (``done`` event, cancelled), a
        running one is asked to stop at its worker's next step (its batch slot is
        freed then), a final one is left alone.
        """
        if self.jobs.cancel_queued(job_id):
            seq = self.events.next_seq(job_id)
            self.events.append(
                job_id,
                [JobEvent(seq=seq, type="done", fields={"finish_reason": "cancelled", "text": ""})],
            )
            cancelled = self.jobs.get(job_id)
            if cancelled is not None:
                log_job_event("cancelled", cancelled, by="api")
            return "cancelled"
        job = self.jobs.get(job_id)
        if job is not None and job.status == JobStatus.running.value:
            self.events.request_cancel(job_id)
            return "cancel_requested"
        return "final"

    def expire_if_due(self, job: Job) -> bool:
        """Fail ``job`` if it is still queued past its deadline, with an ``error`` event.

        Workers do this when they take an expired job; a client waiting on a
        model with no worker at all gets its answer from here.
        """
        if job.deadline_at is None or utcnow() < job.deadline_at:
            return False
        if not self.jobs.expire_queued(job.id):
            return False
        seq = self.events.next_seq(job.id)
        self.events.append(job.id, [JobEvent(seq=seq, type="error", fields={"error": "expired"})])
        log_job_event("failed", job, error="expired")
        return True

    def job_row(self, job_id: str) -> Job | None:
        """``job_id``'s row, read at most every :data:`RECORD_CHECK_S` in this process
        while the job has not ended (one read for all its streams, at a time)."""
        found = self.rows.get(
            job_row_key(job_id),
            RECORD_CHECK_S,
            lambda: self.jobs.get(job_id),
            keep=lambda row: isinstance(row, Job) and not JobStatus(row.status).final,
        )
        return found if isinstance(found, Job) else None

    def follow(
        self, job: Job, after: int = -1, *, idle_s: float, watch: Watch | None = None
    ) -> Generator[JobEvent | None, None, None]:
        """Every event of ``job`` after seq ``after``, ending after the final one.

        Yields None after each ``idle_s`` of silence, so a caller can send a
        keep-alive (which is also how a vanished client is noticed); expires
        the job when it is still queued past its deadline. With ``watch`` (a
        websocket's), the subscription joins it and :class:`ReaderLagging` is
        raised once its buffer overflowed: the reader is too slow.

        A job can end without its final event in the stream: the stream
        expired (``stream_ttl_s``), or Redis restarted and lost it. While the
        stream is quiet, the job's row is read again (at once for a job that
        had already ended when the reader came, then every
        :data:`RECORD_CHECK_S`); a row that has ended gives the final event
        (:func:`final_from_record`), so no reader waits for an event that
        will never come.

        Events come as the log holds them, internals included; what a
        client may see of them is the caller's to decide.
        """
        ended_before = JobStatus(job.status).final
        if ended_before and self.events.last_seq(job.id) < 0:
            yield final_from_record(job, after + 1)  # its stream expired (or was lost)
            return
        with self.relay.subscribe(job.id) as sub:
            if watch is not None:
                watch.add(sub)
            try:
                last = after
                now = time.monotonic()
                next_check = now if ended_before else now + RECORD_CHECK_S
                while True:
                    for event in sub.events(last, idle_timeout=idle_s):
                        if watch is not None and sub.lagging:
                            raise ReaderLagging("the subscription is lagging")
                        last = event.seq
                        if event.final:
                            # The row changed: the next stream to open reads it again.
                            self.rows.forget(job_row_key(job.id))
                        yield event
                        if event.final:
                            return
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + RECORD_CHECK_S
                        try:
                            ended = self._ended_by_record(job.id, last)
                        except SQLAlchemyError as exc:
                            # A safety net, not the stream: a busy or absent database
                            # skips this check (retried next time) instead of closing
                            # a stream that works (10,000 openings once emptied the pool).
                            log.info(
                                "record check of job %s skipped: %s", job.id, type(exc).__name__
                            )
                            ended = None
                        if ended is not None:
                            yield from ended
                            return
                    self.expire_if_due(job)
                    yield None
            finally:
                if watch is not None:
                    watch.discard(sub)

    def _ended_by_record(self, job_id: str, last: int) -> list[JobEvent] | None:
        """How a stream that has reached ``last`` ends, if ``job_id`` has ended in the
        database: the stream's own events after ``last`` up to its final one, or,
        when the stream holds no final event, those followed by the row's. None
        while the row has not ended.

        The row can end before this reader has taken the job's last events (a
        busy process relays them late): they are read from the stream, never
        skipped. A row that has not ended is read at most once per
        :data:`RECORD_CHECK_S` per job in this process, however many streams
        follow the job; an ended one is never taken from that cache.
        """
        job = self.job_row(job_id)
        if job is None or not JobStatus(job.status).final:
            return None
        rest: list[JobEvent] = []
        for event in self.events.history(job_id, after=last):
            rest.append(event)
            if event.final:
                return rest
        seq = max(last, self.events.last_seq(job_id), *(e.seq for e in rest)) + 1
        log.info("job %s ended but its stream holds no final event; answered from its row", job_id)
        return [*rest, final_from_record(job, seq)]

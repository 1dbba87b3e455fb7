"""Admission limits: per-caller rate and concurrency, per-model queue length and capacity.

Per-caller counters live in Redis, so every API process enforces the same
numbers; each check-and-count is one Lua script, hence atomic across processes.

* Requests per minute: a sliding window, a sorted set of admission times
  (Redis's own clock, so API hosts need not agree on the time). A request
  refused by a later check (its concurrency slot) takes its entry back out, so
  only accepted requests count.
* Lookups per minute (``/tokenize``, ``/v1/models``: no job, but a tokenizer
  run or a database read each): a window of their own, ``lookup_factor``
  times the caller's requests per minute.
* Concurrent jobs: a sorted set of the caller's job ids. A job leaves it when
  the set is full and the database says the job has ended (the API does not see
  every job end, so the set is pruned against Postgres, the source of truth,
  only when it would refuse).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import cast

import redis
from sqlalchemy.exc import SQLAlchemyError

from api.auth import client_address
from api.errors import ApiError, Unavailable
from api.services import services
from config import ModelDefinition, Settings
from db.accounts import Principal
from db.jobs import JobStore
from db.lookups import RowCache
from db.schema import ScalingOverride
from db.session import Database
from fleet.registry import list_workers

# A reservation younger than this, in seconds, whose job row is missing is kept:
# its request may still be inserting the row.
RESERVATION_GRACE_S = 60.0
WINDOW_MS = 60_000

_RATE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tonumber(oldest[2]) + window - now
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return 0
"""

_SLOT_SCRIPT = """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


class RateLimited(ApiError):
    """429: a limit is full; ``Retry-After`` says when to try again, in seconds."""

    status = 429
    error_type = "rate_limited"

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        super().__init__(message, headers={"Retry-After": str(self.retry_after_s)})


@dataclass(frozen=True)
class Caller:
    """Whose counters a request counts against, and their limits (0: none)."""

    key: str
    max_concurrent_jobs: int
    requests_per_minute: int


def caller_for(principal: Principal | None, address: str, settings: Settings) -> Caller:
    """The caller's counters: the user's (any of their tokens), else the client address."""
    if principal is None:
        return Caller(
            key=f"anon:{address or 'unknown'}",
            max_concurrent_jobs=settings.anonymous_max_concurrent_jobs,
            requests_per_minute=settings.anonymous_requests_per_minute,
        )
    role = principal.role if principal.role in ("admin", "operator", "user") else "user"
    concurrent = getattr(settings, f"{role}_max_concurrent_jobs")
    rpm = getattr(settings, f"{role}_requests_per_minute")
    if principal.max_concurrent_jobs is not None:
        concurrent = principal.max_concurrent_jobs
    if principal.requests_per_minute is not None:
        rpm = principal.requests_per_minute
    return Caller(
        key=f"user:{principal.user_id}", max_concurrent_jobs=concurrent, requests_per_minute=rpm
    )


class Limiter:
    """The Redis side of per-caller limits."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings

    def _key(self, kind: str, caller: Caller) -> str:
        return self.settings.key("limit", kind, caller.key)

    def admit_request(self, caller: Caller) -> str | None:
        """Count one generation request; :class:`RateLimited` past the per-minute limit.

        Returns the request's entry in the window (None: the caller has no
        limit), for :meth:`refund_request` should a later check refuse it.
        """
        return self._admit("rpm", caller.requests_per_minute, caller, "requests")

    def admit_lookup(self, caller: Caller) -> None:
        """Count one lookup (``/tokenize``, ``/v1/models``) in a window of its own.

        A caller may make ``lookup_factor`` times as many lookups per minute as
        generation requests; :class:`RateLimited` past that.
        """
        limit = caller.requests_per_minute * self.settings.lookup_factor
        self._admit("lookups", limit, caller, "lookups (/tokenize, /v1/models)")

    def _admit(self, kind: str, limit: int, caller: Caller, what: str) -> str | None:
        if limit <= 0:
            return None
        entry = uuid.uuid4().hex
        wait_ms = int(
            cast(
                int,
                self.redis.eval(_RATE_SCRIPT, 1, self._key(kind, caller), limit, WINDOW_MS, entry),
            )
        )
        if wait_ms > 0:
            raise RateLimited(f"at most {limit} {what} per minute; retry later", wait_ms / 1000)
        return entry

    def refund_request(self, caller: Caller, entry: str | None) -> None:
        """Take back a request counted by :meth:`admit_request` that was then refused."""
        if entry is not None:
            self.redis.zrem(self._key("rpm", caller), entry)

    def reserve_slot(self, caller: Caller, job_id: str, jobs: JobStore) -> bool:
        """Hold one of the caller's concurrent-job slots for ``job_id``.

        Returns whether a slot was taken (False: the caller has no limit).
        Raises :class:`RateLimited` when every slot holds a job that has not ended.
        """
        limit = caller.max_concurrent_jobs
        if limit <= 0:
            return False
        key = self._key("jobs", caller)
        if self._try_reserve(key, limit, job_id):
            return True
        self._prune(key, jobs)
        if self._try_reserve(key, limit, job_id):
            return True
        raise RateLimited(
            f"at most {limit} jobs may be queued or running at once; wait for one to end",
            self.settings.retry_after_s,
        )

    def release_slot(self, caller: Caller, job_id: str) -> None:
        """Give back a slot whose job was never accepted (or has ended)."""
        self.redis.zrem(self._key("jobs", caller), job_id)

    def _try_reserve(self, key: str, limit: int, job_id: str) -> bool:
        # A forgotten set expires after the longest a job can live.
        ttl = self.settings.queue_deadline_s + self.settings.job_timeout_s + 3600
        taken = self.redis.eval(_SLOT_SCRIPT, 1, key, limit, job_id, time.time(), ttl)
        return bool(taken)

    def _prune(self, key: str, jobs: JobStore) -> None:
        members = cast(list[tuple[bytes, float]], self.redis.zrange(key, 0, -1, withscores=True))
        if not members:
            return
        ids = [m.decode() for m, _ in members]
        alive = jobs.unfinished(ids)
        exists = jobs.existing(ids)
        young = time.time() - RESERVATION_GRACE_S
        stale = [
            job_id
            for job_id, (_, score) in zip(ids, members, strict=True)
            if job_id not in alive and (job_id in exists or score < young)
        ]
        if stale:
            self.redis.zrem(key, *stale)


def count_lookup(principal: Principal | None) -> None:
    """Count this request as one of the caller's lookups (:meth:`Limiter.admit_lookup`)."""
    svc = services()
    caller = caller_for(principal, client_address(), svc.settings)
    Limiter(svc.redis, svc.settings).admit_lookup(caller)


def max_queue_length(definition: ModelDefinition, settings: Settings) -> int:
    if definition.limits.max_queue_length is not None:
        return definition.limits.max_queue_length
    return settings.max_queue_length


QUEUE_COUNT_MAX_AGE_S = 1.0
"""How old a model's queue count may be when its queue is far from full."""
QUEUE_COUNT_SLACK = 500
"""Jobs the API hosts might accept within :data:`QUEUE_COUNT_MAX_AGE_S`
(issue 13's 500 submissions a second per host): a queue with at least this
much room left a second ago is not counted again for every submission."""


def check_queue(
    definition: ModelDefinition, jobs: JobStore, settings: Settings, rows: RowCache
) -> None:
    """:class:`RateLimited` when ``definition``'s queue is full.

    Counting the queue is a query over its rows; a queue that had
    :data:`QUEUE_COUNT_SLACK` or more free places under a second ago cannot
    have filled since, so the count is reused. Near the limit every
    submission counts exactly.
    """
    limit = max_queue_length(definition, settings)
    key = f"waiting:{definition.name}"
    recent = rows.peek(key, QUEUE_COUNT_MAX_AGE_S)
    if isinstance(recent, int) and recent <= limit - QUEUE_COUNT_SLACK:
        return
    waiting = jobs.waiting_count(definition.name)
    rows.put(key, waiting)
    if waiting >= limit:
        raise RateLimited(
            f"the queue of {definition.name} is full ({limit} jobs waiting); retry later",
            settings.retry_after_s,
        )


def _max_replicas(definition: ModelDefinition, db: Database) -> int:
    """The model's maximum replicas, with a run-time scaling override if one is set."""
    try:
        with db.session() as s:
            override = s.get(ScalingOverride, definition.name)
            if override is not None and override.max_replicas is not None:
                return int(override.max_replicas)
    except SQLAlchemyError:
        # Scaling overrides are another feature's table; without it the YAML decides.
        pass
    return definition.scaling.max_replicas


LIVE_WORKER_MAX_AGE_S = 1.0
"""How long a process trusts that a model had a live worker, before reading the registry again."""


def check_capacity(
    definition: ModelDefinition,
    client: redis.Redis,
    db: Database,
    settings: Settings,
    rows: RowCache,
) -> None:
    """:class:`Unavailable` when no worker of ``definition`` can ever come.

    That is: no live worker and scaling allows none, or every registered worker
    failed. A model merely at zero replicas, or starting, passes: its queue
    holds the job until a worker is up. A model seen with a live worker under
    :data:`LIVE_WORKER_MAX_AGE_S` ago passes without reading the registry (a
    job sent as its last worker dies waits for the next, as any queued job does).
    """
    key = f"live:{definition.name}"
    if rows.peek(key, LIVE_WORKER_MAX_AGE_S):
        return
    workers = [w for w in list_workers(client, settings) if w.get("model") == definition.name]
    # .get: a report from another version of the worker may lack a field; it must
    # not turn a submission into a 500.
    live = [w for w in workers if not w.get("lost") and w.get("state") in ("starting", "ready")]
    if live:
        rows.put(key, True)
        return
    if _max_replicas(definition, db) == 0:
        raise Unavailable(
            f"model {definition.name!r} has no workers and its scaling allows none "
            "(max_replicas is 0); ask an operator to raise it"
        )
    if workers and all(w.get("state") == "failed" for w in workers):
        reason = next((w.get("error") for w in workers if w.get("error")), None)
        detail = f": {reason}" if reason else ""
        raise Unavailable(
            f"every worker of model {definition.name!r} failed to start{detail}",
        )

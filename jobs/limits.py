"""Admission limits: per-caller rate and concurrency, per-model queue length.

Per-caller counters live in Redis, so every API process enforces the same
numbers; each check-and-count is one Lua script, hence atomic across processes.

* Requests per minute: a sliding window, a sorted set of admission times
  (Redis's own clock, so API hosts need not agree on the time). Only accepted
  requests count: a job's window entry and its concurrency slot are taken
  together, in one script (:meth:`Limiter.admit_job`), or neither is.
* Lookups per minute (``/tokenize``, ``/v1/models``: no job, but a tokenizer
  run or a database read each): a window of their own, ``lookup_factor``
  times the caller's requests per minute.
* Concurrent jobs: a sorted set of the caller's job ids. A job leaves it when
  the set is full and the database says the job has ended (the API does not see
  every job end, so the set is pruned against Postgres, the source of truth,
  only when it would refuse).

A submission's limits cost one round trip to Redis (the job script, sent by
its SHA once Redis knows it); a refusal by the slots costs a prune and a second try.
A full limit raises :class:`jobs.errors.OverLimit` (the API's 429 with Retry-After).
The model's capacity (can a worker ever come?) is the fleet's question:
:func:`fleet.capacity.check_capacity`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import cast

import redis

from config import ModelDefinition, Settings
from db.accounts import Principal
from db.jobs import JobStore
from db.lookups import RowCache
from jobs.errors import OverLimit

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

# A job's admission: the per-minute window (KEYS[1]; ARGV[1] its limit, 0 for
# none, ARGV[2] the window in ms, ARGV[3] the entry) and the concurrency slots
# (KEYS[2]; ARGV[4] their limit, 0 for none, ARGV[5] the job id, ARGV[6] the
# set's TTL in s, ARGV[7] the API's time in s: the job's score). Both are
# taken or neither: {0, 0} admitted, {1, ms} the window is full for ms more,
# {2, 0} every slot is held.
_JOB_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate, window, slots = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if rate > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  if redis.call('ZCARD', KEYS[1]) >= rate then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {1, tonumber(oldest[2]) + window - now}
  end
end
if slots > 0 then
  if redis.call('ZCARD', KEYS[2]) >= slots then
    return {2, 0}
  end
  redis.call('ZADD', KEYS[2], ARGV[7], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[6])
end
if rate > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
end
return {0, 0}
"""


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


@dataclass(frozen=True)
class Admission:
    """What :meth:`Limiter.admit_job` counted for one job, for :meth:`Limiter.refund`."""

    caller: Caller
    job_id: str
    entry: str | None  # its entry in the per-minute window (None: no limit)
    slot: bool  # whether it holds a concurrency slot


class Limiter:
    """The Redis side of per-caller limits."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        # Sent by their SHA (Redis loads a script's text once).
        self._job_script = client.register_script(_JOB_SCRIPT)
        self._rate_script = client.register_script(_RATE_SCRIPT)

    def _key(self, kind: str, caller: Caller) -> str:
        return self.settings.key("limit", kind, caller.key)

    def admit_job(self, caller: Caller, job_id: str, jobs: JobStore) -> Admission:
        """Count one generation request and hold a concurrent-job slot for ``job_id``.

        Both in one script, or neither. Raises :class:`OverLimit` past the
        per-minute limit, or when every slot holds a job that has not ended
        (the slots are pruned against the database and tried once more first).
        """
        rate, slots = caller.requests_per_minute, caller.max_concurrent_jobs
        entry = uuid.uuid4().hex if rate > 0 else None
        if rate <= 0 and slots <= 0:
            return Admission(caller, job_id, None, False)
        jobs_key = self._key("jobs", caller)
        # A forgotten set expires after the longest a job can live.
        ttl = self.settings.queue_deadline_s + self.settings.job_timeout_s + 3600
        keys = [self._key("rpm", caller), jobs_key]
        args: list[str | int | float] = [
            max(rate, 0),
            WINDOW_MS,
            entry or "",
            max(slots, 0),
            job_id,
            ttl,
            time.time(),
        ]
        for attempt in range(2):
            code, wait_ms = cast(list[int], self._job_script(keys=keys, args=args))
            if code == 0:
                return Admission(caller, job_id, entry, slots > 0)
            if code == 1:
                raise OverLimit(
                    f"at most {rate} requests per minute; retry later", int(wait_ms) / 1000
                )
            if attempt == 0:
                self._prune(jobs_key, jobs)
        raise OverLimit(
            f"at most {slots} jobs may be queued or running at once; wait for one to end",
            self.settings.retry_after_s,
        )

    def refund(self, admission: Admission) -> None:
        """Take back what :meth:`admit_job` counted, for a job that was not accepted."""
        pipe = self.redis.pipeline(transaction=False)
        if admission.slot:
            pipe.zrem(self._key("jobs", admission.caller), admission.job_id)
        if admission.entry is not None:
            pipe.zrem(self._key("rpm", admission.caller), admission.entry)
        if pipe:
            pipe.execute()

    def admit_lookup(self, caller: Caller) -> None:
        """Count one lookup (``/tokenize``, ``/v1/models``) in a window of its own.

        A caller may make ``lookup_factor`` times as many lookups per minute as
        generation requests; :class:`OverLimit` past that.
        """
        limit = caller.requests_per_minute * self.settings.lookup_factor
        if limit <= 0:
            return
        key = self._key("lookups", caller)
        args: list[str | int | float] = [limit, WINDOW_MS, uuid.uuid4().hex]
        wait_ms = int(cast(int, self._rate_script(keys=[key], args=args)))
        if wait_ms > 0:
            raise OverLimit(
                f"at most {limit} lookups (/tokenize, /v1/models) per minute; retry later",
                wait_ms / 1000,
            )

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
    """:class:`OverLimit` when ``definition``'s queue is full.

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
        raise OverLimit(
            f"the queue of {definition.name} is full ({limit} jobs waiting); retry later",
            settings.retry_after_s,
        )

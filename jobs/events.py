"""A job's event log: a Redis Stream for history plus a pub/sub channel for live delivery.

Both the worker (writer) and the API (reader) go through :class:`EventLog`, so
the Redis mechanics live in one place. Each event carries ``seq`` (0, 1, 2, …
per job, across attempts); a reader that has seen ``seq = k`` asks for the
events after ``k`` and never sees one twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis

from config import Settings

EventType = Literal["queued", "started", "token", "resumed", "restart", "done", "error"]
FINAL_TYPES: frozenset[str] = frozenset({"done", "error"})
_Entries = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's stream; ``fields`` holds the type-specific data."""

    seq: int
    type: str
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.type in FINAL_TYPES

    @property
    def text(self) -> str:
        return str(self.fields.get("text", ""))

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, **self.fields}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobEvent:
        data = json.loads(raw)
        seq = int(data.pop("seq"))
        kind = str(data.pop("type"))
        return cls(seq=seq, type=kind, fields=data)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A ``done`` event's ``usage`` field, in OpenAI's shape (prompt, completion, total)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_of(fields: dict[str, Any]) -> dict[str, int]:
    """The ``usage`` of a ``done`` event's ``fields``; a count it lacks is 0."""
    given = fields.get("usage") or {}
    return usage(int(given.get("prompt_tokens") or 0), int(given.get("completion_tokens") or 0))


@dataclass(frozen=True)
class StreamedOutput:
    """What a job's stream has delivered so far: the output a next attempt continues.

    ``ids`` and ``text`` are the token events' ids and text since the last
    ``restart`` (a restart starts the output again). ``whole`` is false when
    the history does not begin at seq 0 (it expired or Redis lost it) or a
    token event carries no ids: then what clients saw is not known exactly
    and the output cannot be continued. ``attempts`` counts ``started`` events.
    """

    ids: tuple[int, ...] = ()
    text: str = ""
    whole: bool = True
    attempts: int = 0
    last_worker: str | None = None

    @classmethod
    def of(cls, history: list[JobEvent]) -> StreamedOutput:
        ids: list[int] = []
        text: list[str] = []
        whole = bool(history) and history[0].seq == 0
        attempts = 0
        worker: str | None = None
        for event in history:
            if event.type == "started":
                attempts += 1
                worker = str(event.fields.get("worker") or "") or None
            elif event.type == "restart":
                ids, text = [], []
            elif event.type == "token":
                got = event.fields.get("ids")
                if not isinstance(got, list):
                    whole = False
                else:
                    ids.extend(int(i) for i in got)
                text.append(event.text)
        return cls(tuple(ids), "".join(text), whole, attempts, worker)


class StreamTaken(Exception):
    """A fenced write was refused: another attempt of the job owns its stream now."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: its stream belongs to a later attempt")
        self.job_id = job_id


# KEYS: owner key, stream key, cancel key; ARGV: owner token, ttl, then the JSON
# payloads. A missing owner key (Redis restarted without persistence) is taken
# again: the writer that finds it first holds the stream, as the claim says it
# should. Returns 0 when refused, 1 when written, 2 when written and a cancel of
# the job is requested (the writer learns it in the same round trip).
_FENCED_APPEND = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
for i = 3, #ARGV do
  redis.call('XADD', KEYS[2], '*', 'e', ARGV[i])
  redis.call('PUBLISH', KEYS[2], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then return 2 end
return 1
"""


def _first_copies(entries: _Entries, after: int) -> list[JobEvent]:
    """The events of a stream's ``entries`` with ``seq > after``, in order, each seq once."""
    events = []
    last = after
    for _id, fields in entries:
        event = JobEvent.from_json(fields[b"e"])
        if event.seq > last:
            events.append(event)
            last = event.seq
    return events


class EventLog:
    """Append to and read from job event streams in one Redis."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings

    def channel(self, job_id: str) -> str:
        """Name of both the stream key and the pub/sub channel of a job."""
        return self.settings.key("job", job_id)

    def channel_prefix(self) -> str:
        return self.settings.key("job", "")

    def append(self, job_id: str, events: list[JobEvent]) -> None:
        """Write events to the stream and publish them, in one round trip."""
        if not events:
            return
        pipe = self.redis.pipeline(transaction=False)
        self.append_to(pipe, job_id, events)
        pipe.execute()

    def append_to(self, pipe: redis.client.Pipeline, job_id: str, events: list[JobEvent]) -> None:
        """Add :meth:`append`'s commands to ``pipe``: they run when it is executed."""
        key = self.channel(job_id)
        for event in events:
            payload = event.to_json()
            pipe.xadd(key, {"e": payload})
            pipe.publish(key, payload)
        pipe.expire(key, self.settings.stream_ttl_s)

    def owner_key(self, job_id: str) -> str:
        return self.settings.key("owner", job_id)

    def take(self, job_id: str, owner: str) -> list[JobEvent]:
        """Make ``owner`` (one attempt of the job) the only fenced writer of its
        stream, and return the stream's history (:meth:`history`).

        Called by a worker right after it claims the job. Both happen in one
        transaction, one round trip: a write of an earlier attempt that was
        still on its way lands before them (and is in the history returned) or
        is refused.
        """
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.owner_key(job_id), owner, ex=self.settings.stream_ttl_s)
        pipe.xrange(self.channel(job_id))
        _, entries = pipe.execute()
        return _first_copies(cast(_Entries, entries), -1)

    def append_fenced(self, job_id: str, events: list[JobEvent], owner: str) -> bool:
        """:meth:`append`, only while ``owner`` holds the stream; else :class:`StreamTaken`.

        Returns whether a cancel of the job is requested (:meth:`cancel_requested`),
        read in the same round trip: a writer that writes often need not ask apart.
        """
        if not events:
            return False
        payloads = [e.to_json() for e in events]
        keys = [self.owner_key(job_id), self.channel(job_id), self.cancel_key(job_id)]
        args: list[str | int] = [owner, self.settings.stream_ttl_s, *payloads]
        written = self.redis.eval(_FENCED_APPEND, 3, *keys, *args)
        if not written:
            raise StreamTaken(job_id)
        return int(written) == 2

    def history(self, job_id: str, after: int = -1) -> list[JobEvent]:
        """Every stored event with ``seq > after``, in order, each seq once.

        A writer that retried after a Redis error may have stored an event
        twice; only its first copy is returned.
        """
        return _first_copies(cast(_Entries, self.redis.xrange(self.channel(job_id))), after)

    def last_seq(self, job_id: str) -> int:
        """The seq of the newest event, or -1 for an empty stream."""
        entries = cast(_Entries, self.redis.xrevrange(self.channel(job_id), count=1))
        if not entries:
            return -1
        return JobEvent.from_json(entries[0][1][b"e"]).seq

    def next_seq(self, job_id: str) -> int:
        """The seq of the next event of a job the API accepted: at least 1.

        Seq 0 is the ``queued`` event written at submission. An empty stream
        lost its history since (Redis restarted without persistence); reusing
        seq 0 would hide the next event from a client that saw the first.
        """
        return max(self.last_seq(job_id) + 1, 1)

    def cancel_key(self, job_id: str) -> str:
        return self.settings.key("cancel", job_id)

    def request_cancel(self, job_id: str) -> None:
        """Ask the worker running ``job_id`` to stop it at its next step."""
        self.redis.set(self.cancel_key(job_id), "1", ex=self.settings.stream_ttl_s)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.cancel_key(job_id)))

"""The generate message: sending it, and finding which jobs' messages the broker still holds.

Sending is what the API does on submit and the reaper and draining workers do
on a re-queue: one message on ``gen.<model>`` whose task id is the job id.
The message is written here, not by ``Celery.send_task``: it is Celery's
message protocol 2 in kombu's Redis envelope (what ``send_task`` writes, field
for field; a test holds the two equal), pushed with ``LPUSH`` onto the queue's
list. So the API puts it in the same Redis round trip as the job's ``queued``
event, and a submission costs no kombu producer, no exchange lookup and no
task-sent event (about 1 ms of the API's CPU per POST).

Finding reads kombu's Redis layout (kombu 5.x), every key under the farm's
prefix (kombu's ``global_keyprefix``, :func:`jobs.queues.broker_prefix`): a
queue is a list named after it (``<prefix>:gen.<model>``, plus
``<prefix>:gen.<model>\\x06\\x16<n>`` for priorities 3, 6, 9); a delivered but
unacknowledged message sits in the hash ``<prefix>:unacked`` (delivery tag →
``[message, exchange, routing_key]``) with its delivery time in the sorted set
``<prefix>:unacked_index``. A message is found by its ``headers.id``
(Celery's protocol 2), which is the job id.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from typing import Any, cast

import redis
from celery.utils.nodenames import anon_nodename

from config import Settings
from jobs.queues import GENERATE_TASK, broker_key, queue_key, queue_name

PRIORITY_SEPARATOR = "\x06\x16"
PRIORITY_STEPS = (3, 6, 9)
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"
# LRANGE page size when scanning a queue, so a long queue is read in bounded pieces.
SCAN_PAGE = 1000


_ORIGIN = anon_nodename()
"""Celery's ``origin`` header: the sending process (``gen<pid>@<host>``)."""
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def generate_message(job_id: str, model: str) -> str:
    """The message that runs ``job_id`` on ``model``'s queue, as kombu stores it in Redis.

    Celery's protocol 2 (headers, ``[args, kwargs, embed]`` body) in kombu's
    envelope: JSON body, base64-encoded, routed by the anonymous exchange to
    the queue of the same name, priority 0, a fresh delivery tag.
    """
    queue = queue_name(model)
    args = [job_id]
    headers: dict[str, Any] = {
        "lang": "py",
        "task": GENERATE_TASK,
        "id": job_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": job_id,
        "parent_id": None,
        "argsrepr": repr(args),
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": None,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    body = json.dumps([args, {}, _EMBED])
    return json.dumps(
        {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                "correlation_id": job_id,
                "reply_to": "",
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    )


def queue_generate(
    pipe: redis.client.Pipeline, settings: Settings, job_id: str, model: str
) -> None:
    """Add the push of ``job_id``'s message to ``pipe`` (sent with the pipeline)."""
    pipe.lpush(queue_key(settings, model), generate_message(job_id, model))


def send_generate(client: redis.Redis, settings: Settings, job_id: str, model: str) -> None:
    """Put ``job_id`` on its model's queue (task id = job id)."""
    client.lpush(queue_key(settings, model), generate_message(job_id, model))


def queue_keys(settings: Settings, model: str) -> list[str]:
    """The Redis lists that hold ``model``'s waiting messages, every priority."""
    base = queue_key(settings, model)
    return [base, *(f"{base}{PRIORITY_SEPARATOR}{p}" for p in PRIORITY_STEPS)]


# kombu writes ``"headers": {..., "id": "<task id>", ...}``; the body is base64,
# so the only ``"id": "`` in a message is that key. Reading it without parsing
# the whole message keeps the reaper's scan of a 10,000-message queue cheap.
_HEADER_ID = re.compile(rb'"id": ?"([0-9a-f-]{36})"')


def _task_id(raw: bytes | str) -> str | None:
    found = _HEADER_ID.search(raw.encode() if isinstance(raw, str) else raw)
    if found is not None:
        return found.group(1).decode()
    try:
        message = json.loads(raw)
        if isinstance(message, list):  # an unacked entry: [message, exchange, routing_key]
            message = message[0]
        return str(message["headers"]["id"])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


class BrokerView:
    """Read-only questions about the messages in one farm's Celery broker (its prefix)."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        self.unacked_key = broker_key(settings, UNACKED)
        self.unacked_index_key = broker_key(settings, UNACKED_INDEX)

    def waiting(self, model: str) -> int:
        """Messages waiting in ``model``'s queue (every priority)."""
        pipe = self.redis.pipeline(transaction=False)
        for key in queue_keys(self.settings, model):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())

    def waiting_ids(self, model: str) -> set[str]:
        """Job ids of the messages waiting in ``model``'s queue."""
        found: set[str] = set()
        for key in queue_keys(self.settings, model):
            start = 0
            while True:
                page = cast(list[bytes], self.redis.lrange(key, start, start + SCAN_PAGE - 1))
                found.update(i for i in map(_task_id, page) if i is not None)
                if len(page) < SCAN_PAGE:
                    break
                start += SCAN_PAGE
        return found

    def delivered_ids(self, *, since_s: float) -> set[str]:
        """Job ids of unacknowledged messages delivered in the last ``since_s`` seconds.

        An older unacknowledged message of a job that is still queued was taken
        by a worker that never claimed it (it died in between): it does not count.
        """
        floor = time.time() - since_s
        tags = cast(list[bytes], self.redis.zrangebyscore(self.unacked_index_key, floor, "+inf"))
        if not tags:
            return set()
        values = cast(list[bytes | None], self.redis.hmget(self.unacked_key, tags))
        return {i for i in map(_task_id, (v for v in values if v)) if i is not None}

    def unacked_ids(self) -> dict[str, list[str]]:
        """Every unacknowledged message: job id → delivery tags."""
        found: dict[str, list[str]] = {}
        for tag, raw in cast(dict[bytes, bytes], self.redis.hgetall(self.unacked_key)).items():
            job_id = _task_id(raw)
            if job_id is not None:
                found.setdefault(job_id, []).append(tag.decode())
        return found

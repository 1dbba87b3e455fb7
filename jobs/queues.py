"""Queue naming: one Celery queue per served model, the Redis keys the broker keeps it
under, and the name of the task its messages run.

Every key of the Celery broker lives under the farm's prefix: kombu's Redis
transport is given ``global_keyprefix`` = :func:`broker_prefix` (see
:func:`tasks.celery.celery_config`) and writes the queue named
``gen.<model>`` as the list ``<prefix>:gen.<model>``, its ``unacked`` hash as
``<prefix>:unacked``, its bindings as ``<prefix>:_kombu.binding.*`` and its
fanout channels (remote control) under the same prefix. So farms with
different ``redis_prefix`` share one Redis database without seeing each
other's messages. A name (``queue_name``) is what Celery routes by and a
worker consumes; a key (``queue_key``, ``broker_key``) is what Redis holds.
"""

from __future__ import annotations

from config import Settings

GENERATE_TASK = "switchyard.generate"
"""The task every generate message names (``tasks.generate`` registers it)."""


def queue_name(model: str) -> str:
    """The Celery queue that holds ``model``'s jobs (what routing and ``--queues`` name)."""
    return f"gen.{model}"


def broker_prefix(settings: Settings) -> str:
    """What every key and channel of the Celery broker starts with: ``<prefix>:``.

    kombu's ``global_keyprefix``; a broker key is then named as
    ``settings.key`` names Switchyard's own (``<prefix>:gen.<model>``).
    """
    return f"{settings.redis_prefix}:"


def broker_key(settings: Settings, name: str) -> str:
    """The Redis key kombu keeps its ``name`` under (a queue, ``unacked``, ...)."""
    return broker_prefix(settings) + name


def queue_key(settings: Settings, model: str) -> str:
    """The Redis list that holds ``model``'s waiting messages (priority 0)."""
    return broker_key(settings, queue_name(model))

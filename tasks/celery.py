"""Exactly one Celery app. Nothing else constructs ``Celery()``."""

from __future__ import annotations

from typing import Any

from celery import Celery

from config import Settings
from jobs.queues import broker_prefix

app = Celery("switchyard", set_as_current=False, include=["tasks.generate"])
# Lazy: the module is read on first access to app.conf, not at import, and only
# when configure() was not called first (``celery -A tasks inspect …``).
app.config_from_object("tasks.celeryconfig")


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from Switchyard's settings.

    The job row is the result, so nothing is stored in a result backend (no
    result keys in Redis at all). Every key and pub/sub channel of the broker
    (queues, ``unacked``, bindings, remote control) is under the farm's prefix
    (``global_keyprefix``, see :mod:`jobs.queues`), so farms with different
    prefixes share a Redis database without seeing each other's messages.
    Messages are acknowledged after the job ends (acks_late) and re-delivered
    after ``visibility_timeout_s`` if the worker vanished before acking; the
    claim in the database drops any duplicate delivery.
    """
    return {
        "broker_url": settings.redis_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            "socket_keepalive": True,
            "health_check_interval": 30,
            "global_keyprefix": broker_prefix(settings),
        },
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_create_missing_queues": True,
        "task_default_queue": "switchyard.default",
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        # Flower and `celery events` read these (SWITCHYARD_TASK_EVENTS).
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        "broker_heartbeat": 0,
        "timezone": "UTC",
    }


def configure(settings: Settings) -> Celery:
    """Configure :data:`app` from ``settings`` (API start-up, worker start-up, tests)."""
    app.config_from_object(celery_config(settings), force=True)
    return app

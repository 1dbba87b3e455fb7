"""Queue names and the Redis keys the broker keeps them under (jobs/queues.py)."""

from __future__ import annotations

from config import load_settings
from jobs.messages import queue_keys
from jobs.queues import broker_key, broker_prefix, queue_key, queue_name
from tasks.celery import celery_config


def test_a_queue_is_named_for_its_model_and_kept_under_the_farms_prefix() -> None:
    settings = load_settings({}, redis_prefix="farm-a")
    assert queue_name("m") == "gen.m"  # what Celery routes by and a worker consumes
    assert queue_key(settings, "m") == "farm-a:gen.m" == settings.key("gen.m")
    assert broker_key(settings, "unacked") == "farm-a:unacked"
    assert queue_keys(settings, "m") == [
        "farm-a:gen.m",
        *(f"farm-a:gen.m\x06\x16{p}" for p in (3, 6, 9)),
    ]


def test_celery_writes_every_broker_key_under_the_same_prefix() -> None:
    settings = load_settings({}, redis_prefix="farm-b")
    options = celery_config(settings)["broker_transport_options"]
    assert options["global_keyprefix"] == broker_prefix(settings) == "farm-b:"
    # kombu's key for a queue is the prefix and the name: the key jobs/ reads and writes.
    assert options["global_keyprefix"] + queue_name("m") == queue_key(settings, "m")

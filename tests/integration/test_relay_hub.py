"""The API process's relay hub on a real Redis: it sleeps until there is work, and wakes for it.

The hub thread waits on its pub/sub socket and a wake-up pipe (no polling):
a new subscription must still reach Redis at once, a published event must
still reach its subscriber at once, and a process that already holds
thousands of descriptors (ten thousand open websockets) must still relay.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import pytest
import redis

from api.streams import RelayHub, Subscription
from config import Settings
from jobs.events import EventLog, JobEvent


@pytest.fixture
def hub(settings: Settings) -> Iterator[RelayHub]:
    client = redis.Redis.from_url(settings.redis_url)
    relay = RelayHub(client, EventLog(client, settings), settings)
    yield relay
    relay.stop()
    client.close()


def relayed(hub: RelayHub, sub: Subscription, seq: int) -> JobEvent:
    event = JobEvent(seq=seq, type="token", fields={"text": f"t{seq}", "ids": [seq]})
    hub.redis.publish(sub.channel, event.to_json())
    return sub.queue.get(timeout=5)


def test_a_subscription_is_confirmed_and_events_arrive_without_a_poll(hub: RelayHub) -> None:
    for job in ("job-a", "job-b"):  # the second one while the hub sleeps on the first
        started = time.perf_counter()
        sub = hub.subscribe(job)
        assert sub.confirmed.is_set()
        assert time.perf_counter() - started < 0.5
        time.sleep(0.3)  # the hub is asleep now
        got = [relayed(hub, sub, seq) for seq in range(3)]
        assert [(e.seq, e.fields["text"]) for e in got] == [(0, "t0"), (1, "t1"), (2, "t2")]
    hub.unsubscribe(sub)
    again = hub.subscribe("job-b")  # re-subscribed after the channel was dropped
    assert again.confirmed.is_set()
    assert relayed(hub, again, 7).seq == 7


def test_the_hub_relays_when_its_socket_is_past_descriptor_1024(hub: RelayHub) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        sub = hub.subscribe("job-high")  # the hub's pub/sub connection opens now
        assert sub.confirmed.is_set()
        time.sleep(0.3)
        assert relayed(hub, sub, 0).fields["text"] == "t0"
    finally:
        for fd in held:
            os.close(fd)

"""The relay: one Redis pub/sub connection per API process, fanned out to every socket.

A subscriber registers for a job's channel first, then reads the stream's
history, then takes live events, skipping any ``seq`` it has already passed on
and filling any gap from the history. So a client that connects late, or
reconnects after ``seq = k``, receives every event exactly once, in order. If
pub/sub goes quiet (Redis restarted, a message lost), the history is re-read
every ``relay_poll_s``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator

import redis

from config import Settings
from tasks.events import EventLog, JobEvent

log = logging.getLogger(__name__)

# How long the hub thread blocks waiting for a pub/sub message, in seconds:
# also the longest a new subscription waits to be sent to Redis.
HUB_TICK_S = 0.01
# How long a subscriber waits for Redis to confirm its subscription, in seconds.
SUBSCRIBE_WAIT_S = 1.0


class Subscription:
    """One reader of one job's events."""

    def __init__(self, hub: RelayHub, job_id: str) -> None:
        self.hub = hub
        self.job_id = job_id
        self.channel = hub.events.channel(job_id)
        self.queue: queue.SimpleQueue[JobEvent] = queue.SimpleQueue()
        self.confirmed = threading.Event()

    def events(self, after: int = -1, *, idle_timeout: float | None = None) -> Iterator[JobEvent]:
        """Every event with ``seq > after`` in order, ending after a final event.

        ``idle_timeout`` ends the iteration when nothing new arrived for that
        long (callers use it to send keep-alives and check their client).
        """
        last = after
        for event in self.hub.events.history(self.job_id, after=last):
            yield event
            last = event.seq
            if event.final:
                return
        idle_since = time.monotonic()
        while True:
            try:
                event = self.queue.get(timeout=self.hub.settings.relay_poll_s)
            except queue.Empty:
                # Cheap check first: an idle job costs one XREVRANGE per poll.
                missed = []
                if self.hub.events.last_seq(self.job_id) > last:
                    missed = self.hub.events.history(self.job_id, after=last)
                if not missed:
                    if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                        return
                    continue
                batch = missed
            else:
                if event.seq <= last:
                    continue
                batch = [event]
                if event.seq > last + 1:  # a gap: fill it from the history
                    batch = self.hub.events.history(self.job_id, after=last)
            for item in batch:
                if item.seq <= last:
                    continue
                yield item
                last = item.seq
                idle_since = time.monotonic()
                if item.final:
                    return

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RelayHub:
    """Owns the process's pub/sub connection and routes messages to subscriptions."""

    def __init__(self, client: redis.Redis, events: EventLog, settings: Settings) -> None:
        self.redis = client
        self.events = events
        self.settings = settings
        self._lock = threading.Lock()
        self._listeners: dict[str, set[Subscription]] = {}
        self._commands: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def subscribe(self, job_id: str) -> Subscription:
        """Register for a job's live events; returns once Redis confirmed (or after a bound)."""
        self._ensure_thread()
        sub = Subscription(self, job_id)
        with self._lock:
            listeners = self._listeners.setdefault(sub.channel, set())
            first = not listeners
            listeners.add(sub)
            if not first:
                sub.confirmed.set()
        if first:
            self._commands.put(("subscribe", sub.channel))
        sub.confirmed.wait(SUBSCRIBE_WAIT_S)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            listeners = self._listeners.get(sub.channel)
            if listeners is None:
                return
            listeners.discard(sub)
            if listeners:
                return
            del self._listeners[sub.channel]
        self._commands.put(("unsubscribe", sub.channel))

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._listeners.values())

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="relay-hub", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                with self._lock:
                    channels = list(self._listeners)
                if channels:
                    pubsub.subscribe(*channels)
                self._pump(pubsub)
            except redis.RedisError as exc:
                log.warning("relay lost its pub/sub connection (%s); reconnecting", exc)
                time.sleep(0.5)
            finally:
                with contextlib.suppress(redis.RedisError):
                    pubsub.close()

    def _pump(self, pubsub: redis.client.PubSub) -> None:
        while not self._stopping.is_set():
            while True:
                try:
                    command, channel = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command == "subscribe":
                    pubsub.subscribe(channel)
                else:
                    pubsub.unsubscribe(channel)
            if not pubsub.subscribed:
                time.sleep(HUB_TICK_S)
                continue
            message = pubsub.get_message(timeout=HUB_TICK_S)
            if message is None:
                continue
            channel = message["channel"]
            if isinstance(channel, bytes):
                channel = channel.decode()
            if message["type"] == "subscribe":
                with self._lock:
                    for sub in self._listeners.get(channel, ()):
                        sub.confirmed.set()
            elif message["type"] == "message":
                try:
                    event = JobEvent.from_json(message["data"])
                except (ValueError, KeyError):
                    log.warning("malformed event on %s dropped", channel)
                    continue
                with self._lock:
                    targets = list(self._listeners.get(channel, ()))
                for sub in targets:
                    sub.queue.put(event)

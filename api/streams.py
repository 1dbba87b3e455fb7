"""The relay: one Redis pub/sub connection per API process, fanned out to every socket.

A subscriber registers for a job's channel first, then reads the stream's
history, then takes live events, skipping any ``seq`` it has already passed on
and filling any gap from the history. So a client that connects late, or
reconnects after ``seq = k``, receives every event exactly once, in order. If
pub/sub goes quiet (Redis restarted, a message lost), the history is re-read
every ``relay_poll_s``.

Each subscription buffers at most ``relay_max_buffered_events`` live events.
One whose reader falls that far behind stops taking live events and is marked
:attr:`Subscription.lagging`; its reader then catches up from the history, so
memory stays bounded and the stream stays gapless. The websocket senders
(:func:`send_frame`) close a lagging socket, or one whose client does not take
a frame within ``ws_send_timeout_s``, with :data:`CLOSE_TOO_SLOW`; the job runs
on and ``?after=<seq>`` re-attaches. A multiplexed socket watches all its
subscriptions at once (:class:`LagWatch`). SSE responses (:func:`sse_response`)
get the same write limit as a socket timeout: the server's write of a chunk
that the client does not take in ``ws_send_timeout_s`` fails, the server
closes the connection and the stream's generator is closed (its ``finally``
decides what becomes of the job).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import redis
from flask import Response, request, stream_with_context
from simple_websocket import ConnectionClosed
from wsproto.events import CloseConnection, TextMessage

from api.wire import WriteTimeout, wire_of
from config import Settings
from db.lookups import RowCache
from jobs.events import EventLog, JobEvent

log = logging.getLogger(__name__)

# How long the hub thread sleeps when nothing wakes it, in seconds. A pub/sub
# message (its socket turns readable) or a (un)subscription (a byte on the
# hub's pipe) wakes it at once, so this only bounds how long a stop waits.
HUB_IDLE_S = 1.0
# The hub's tick where the pub/sub connection has no socket to wait on (a
# redis-py without ``Connection._sock``): it polls, and a new subscription
# waits up to this long to be sent to Redis.
HUB_TICK_S = 0.01
# How long a subscriber waits for Redis to confirm its subscription, in seconds.
SUBSCRIBE_WAIT_S = 1.0
# The websocket close code and reason given to a client that reads too slowly
# (4000-4999 is the application range).
CLOSE_TOO_SLOW = 4008
CLOSE_TOO_SLOW_REASON = "client too slow"
# How long a laggard's close frame may take to leave, in seconds: it is a courtesy,
# the socket is shut down after it either way.
CLOSE_WRITE_S = 1.0


class SlowClient(Exception):
    """A websocket client did not keep up: a frame timed out, or its subscription lagged.

    ``partial`` is true when part of a frame was written, so no other frame
    (not even a close frame) may follow on that connection.
    """

    def __init__(self, why: str, *, partial: bool = False) -> None:
        super().__init__(why)
        self.partial = partial


class Subscription:
    """One reader of one job's events."""

    def __init__(self, hub: RelayHub, job_id: str) -> None:
        self.hub = hub
        self.job_id = job_id
        self.channel = hub.events.channel(job_id)
        self.queue: queue.Queue[JobEvent] = queue.Queue(hub.settings.relay_max_buffered_events)
        self.confirmed = threading.Event()
        # Set by the hub on overflow, cleared by the reader once it caught up
        # from the history; while set, live events are not taken.
        self._paused = False
        self._overflows = 0

    @property
    def lagging(self) -> bool:
        """True once the buffer of live events overflowed (it stays true)."""
        return self._overflows > 0

    def offer(self, event: JobEvent) -> None:
        """Take a live event, unless the buffer is full: then mark the subscription lagging.

        Called by the hub thread; never blocks.
        """
        if self._paused:
            return
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            self._paused = True
            self._overflows += 1
            log.info("subscriber of job %s is lagging; live events paused", self.job_id)

    def events(self, after: int = -1, *, idle_timeout: float | None = None) -> Iterator[JobEvent]:
        """Every event with ``seq > after`` in order, ending after a final event.

        ``idle_timeout`` ends the iteration when nothing new arrived for that
        long (callers use it to send keep-alives and check their client).
        """
        last = after
        for event in self.hub.opening_history(self.job_id, after=last):
            yield event
            last = event.seq
            if event.final:
                return
        idle_since = time.monotonic()
        while True:
            if self._paused and self.queue.empty():
                # Resume live events first, then read what was dropped from the
                # history: an event is in one or the other (seq skips doubles).
                self._paused = False
                batch = self.hub.events.history(self.job_id, after=last)
            else:
                received = self._next_batch(last)
                if received is None:
                    if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                        return
                    continue
                batch = received
            for item in batch:
                if item.seq <= last:
                    continue
                yield item
                last = item.seq
                idle_since = time.monotonic()
                if item.final:
                    return

    def _next_batch(self, last: int) -> list[JobEvent] | None:
        """The next events after ``last``: live, or from the history after a gap or a
        quiet ``relay_poll_s``; None when nothing new arrived."""
        try:
            event = self.queue.get(timeout=self.hub.settings.relay_poll_s)
        except queue.Empty:
            # Cheap check first: an idle job costs one XREVRANGE per poll and process.
            if self.hub.last_seq(self.job_id) > last:
                return self.hub.events.history(self.job_id, after=last) or None
            return None
        if event.seq <= last:
            return []
        if event.seq > last + 1:  # a gap: fill it from the history
            return self.hub.events.history(self.job_id, after=last)
        return [event]

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
        # A byte on this pipe wakes the hub thread for a command (or a stop).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._last_seqs = RowCache()
        # Whole histories, briefly: bounded to what a few seconds of openings ask for.
        self._histories = RowCache(max_rows=2_000)

    def last_seq(self, job_id: str) -> int:
        """The job's last event number in its stream, read at most every half
        ``relay_poll_s`` in this process however many of its streams ask."""
        max_age = self.settings.relay_poll_s / 2
        return cast(int, self._last_seqs.get(job_id, max_age, lambda: self.events.last_seq(job_id)))

    def opening_history(self, job_id: str, after: int) -> list[JobEvent]:
        """The events after ``after`` that a new subscription starts from.

        Read from Redis at most every half ``relay_poll_s`` per job in this
        process, however many of its streams open at once (fifty sockets on one
        job's answer: one read, not fifty). A copy that misses the newest
        events is safe: the subscription is live before this is read, a live
        event past a gap re-reads the history, and a quiet one compares
        :meth:`last_seq` within ``relay_poll_s``.
        """
        max_age = self.settings.relay_poll_s / 2
        found = cast(
            list[JobEvent],
            self._histories.get(job_id, max_age, lambda: self.events.history(job_id)),
        )
        return [event for event in found if event.seq > after]

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
            self._command("subscribe", sub.channel)
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
        self._command("unsubscribe", sub.channel)

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._listeners.values())

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
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

    def _command(self, command: str, channel: str) -> None:
        self._commands.put((command, channel))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the hub has bytes to wake on
            os.write(self._wake_w, b"\0")

    def _pump(self, pubsub: redis.client.PubSub) -> None:
        """Route messages and carry out commands until stopped.

        The thread sleeps until a message or a command arrives: it does not
        poll (a hundred wake-ups a second per API process, idle or not, before
        2026-12-02). The wake-up bytes are read before the commands, so a
        command queued after that read leaves a byte that ends the next wait.
        """
        while not self._stopping.is_set():
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
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
                self._sleep()
                continue
            # What the connection has buffered or received already, without waiting.
            message = pubsub.get_message(timeout=0)
            if message is None:
                sock = getattr(pubsub.connection, "_sock", None)
                if not isinstance(sock, socket.socket):
                    message = pubsub.get_message(timeout=HUB_TICK_S)
                elif not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                    self._sleep(sock)
                    continue
                else:
                    continue  # decrypted bytes wait in the TLS layer: read them now
            if message is None:
                continue
            self._route(message)

    def _sleep(self, sock: socket.socket | None = None) -> None:
        """Wait until ``sock`` or the wake-up pipe is readable, at most ``HUB_IDLE_S``.

        ``poll``, not ``select``: a process holding thousands of sockets opens
        its pub/sub connection at a descriptor past select's limit of 1024.
        """
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if sock is not None:
            poller.register(sock, select.POLLIN)
        poller.poll(HUB_IDLE_S * 1000)

    def _route(self, message: dict[str, Any]) -> None:
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
                return
            with self._lock:
                targets = list(self._listeners.get(channel, ()))
            for sub in targets:
                sub.offer(event)


class LagWatch:
    """The subscriptions feeding one websocket: it lags as soon as one of them does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: set[Subscription] = set()

    def add(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.add(sub)

    def discard(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    @property
    def lagging(self) -> bool:
        with self._lock:
            return any(sub.lagging for sub in self._subs)


def sse_response(
    body: Iterator[str], timeout_s: float, *, headers: dict[str, str] | None = None
) -> Response:
    """A ``text/event-stream`` response of ``body`` whose writes time out after ``timeout_s``.

    The WSGI server (gunicorn's gthread, Werkzeug) writes each chunk with a
    blocking ``sendall`` on the client's socket, which waits forever for a
    client that does not read. A timeout on that socket makes the write fail
    instead: the server closes the connection, frees its thread and closes
    ``body``. gunicorn resets the socket's mode before it reads the next
    request of a kept-alive connection.
    """
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if isinstance(sock, socket.socket):
        sock.settimeout(timeout_s)
    response = Response(stream_with_context(body), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def client_gone() -> bool:
    """Whether the client of the current request has closed its connection.

    For a request that answers only at the end (a non-streaming completion):
    the client sent its whole request, so its socket is readable only once it
    closed (a read gives end of file) or pipelines another request (the bytes
    stay where they are: this only peeks). False when the server does not
    expose the socket.
    """
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if not isinstance(sock, socket.socket):
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


def send_frame(
    ws: Any, data: str, timeout_s: float, *, give_up: Callable[[], bool] | None = None
) -> None:
    """Send one text frame on a simple-websocket ``ws`` within ``timeout_s`` seconds.

    The frame is encoded and written whole under the socket's write lock
    (api/wire.py), so no other writer (another relay, simple-websocket's pings)
    can cut into it. simple-websocket's own ``send`` blocks for as long as the
    client does not read; this raises :class:`SlowClient` when the client has
    not taken the frame in time, or as soon as ``give_up()`` is true while
    waiting. Raises ``ConnectionClosed`` when the socket is closed.
    """
    if not ws.connected:
        raise ConnectionClosed(ws.close_reason, ws.close_message)
    try:
        wire_of(ws).write(lambda: ws.ws.send(TextMessage(data=data)), timeout_s, give_up)
    except WriteTimeout as exc:
        raise SlowClient(str(exc), partial=exc.partial) from None
    except OSError as exc:
        raise ConnectionClosed(1006, str(exc)) from None


def drop_laggard(ws: Any, reason: SlowClient) -> None:
    """Close a too-slow client's socket with :data:`CLOSE_TOO_SLOW` and free it."""
    close_now(ws, CLOSE_TOO_SLOW, CLOSE_TOO_SLOW_REASON, partial=reason.partial)


def close_now(ws: Any, code: int, reason: str, *, partial: bool = False) -> None:
    """Close ``ws`` with ``code`` without waiting on its client, and free it.

    The close frame goes out when it can within :data:`CLOSE_WRITE_S` (not at
    all when ``partial`` or the socket is broken: a frame was cut short); the
    socket is shut down after it either way, which ends simple-websocket's
    reader and any receive waiting on it.
    """
    if not ws.connected:
        return
    ws.connected = False
    wire = wire_of(ws)
    if not partial:
        # The close frame is a courtesy to a socket that is going anyway.
        with contextlib.suppress(Exception):
            wire.write(lambda: ws.ws.send(CloseConnection(code, reason)), CLOSE_WRITE_S)
    with contextlib.suppress(OSError):
        wire.raw.shutdown(socket.SHUT_RDWR)

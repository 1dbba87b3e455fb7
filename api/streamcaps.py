"""Caps on open streams (websockets and SSE): per API process, per user, per client address.

A stream costs the API a socket and a greenlet for as long as it is open, so
nobody may hold more than their share:

* per process, ``streams_per_process`` (503 with Retry-After; a websocket is
  closed with 1013 "try again later");
* per user, ``streams_per_user`` across every API process (admins: no cap);
* per client address without a token, ``streams_per_address``; both are 429
  with Retry-After, or a websocket closed with :data:`CLOSE_TOO_MANY_STREAMS`.

The user and address counts live in Redis as sorted sets of leases (member: the
stream, score: when its lease ends), so every process counts the same streams
and a process that dies without closing its streams frees them when their
leases run out: each process renews its open streams' leases every
:data:`RENEW_S` in one pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import redis

from api.errors import ApiError
from config import Settings
from db.accounts import Principal

log = logging.getLogger(__name__)

# Seconds a stream's lease lasts without renewal, and how often leases are renewed.
LEASE_S = 120.0
RENEW_S = 30.0
# Websocket close codes (4000-4999 is the application range; 4029 mirrors HTTP 429).
CLOSE_TOO_MANY_STREAMS = 4029
CLOSE_SERVER_FULL = 1013

_TAKE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class TooManyStreams(ApiError):
    """429: the caller holds as many open streams as they may."""

    status = 429
    error_type = "too_many_streams"
    close_code = CLOSE_TOO_MANY_STREAMS

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class ServerFull(ApiError):
    """503: this API process holds as many streams as it may; another may not."""

    status = 503
    error_type = "overloaded"
    close_code = CLOSE_SERVER_FULL

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class StreamCaps:
    """The open streams of one API process and their leases in Redis."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        self._lock = threading.Lock()
        self._open = 0
        # every stream held: id -> the Redis key of its lease ("": not counted there)
        self._leases: dict[str, str] = {}
        self._renewer: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def open_streams(self) -> int:
        return self._open

    def _key_and_cap(self, principal: Principal | None, address: str) -> tuple[str, int, str]:
        s = self.settings
        if principal is None:
            who = f"the address {address or 'unknown'}"
            return s.key("streams", "addr", address or "unknown"), s.streams_per_address, who
        cap = 0 if principal.is_admin else s.streams_per_user
        return s.key("streams", "user", str(principal.user_id)), cap, "one user"

    @contextlib.contextmanager
    def hold(self, principal: Principal | None, address: str) -> Iterator[None]:
        """Count one open stream for its lifetime; :class:`ServerFull` or
        :class:`TooManyStreams` when a cap is reached (nothing is counted then)."""
        stream_id = self.take(principal, address)
        try:
            yield
        finally:
            self.release(stream_id)

    def take(self, principal: Principal | None, address: str) -> str:
        """Count one open stream and return its id, for :meth:`release`; raises as :meth:`hold`."""
        retry = self.settings.retry_after_s
        with self._lock:
            if self._open >= self.settings.streams_per_process:
                raise ServerFull(
                    f"this API process holds {self._open} streams, its most; retry shortly",
                    retry,
                )
            self._open += 1
            stream_id = uuid.uuid4().hex
            self._leases[stream_id] = ""
        try:
            key, cap, who = self._key_and_cap(principal, address)
            if cap > 0:
                now = time.time()
                taken = self.redis.eval(
                    _TAKE_SCRIPT, 1, key, cap, stream_id, now, now + LEASE_S, int(LEASE_S) * 2
                )
                if not taken:
                    raise TooManyStreams(
                        f"at most {cap} open streams for {who}; close one and retry", retry
                    )
                with self._lock:
                    self._leases[stream_id] = key
                self._ensure_renewer()
        except BaseException:
            with self._lock:
                self._open -= 1
                self._leases.pop(stream_id, None)
            raise
        return stream_id

    def release(self, stream_id: str) -> None:
        """Stop counting a stream (a second release of the same one does nothing)."""
        with self._lock:
            if stream_id not in self._leases:
                return
            self._open -= 1
            key = self._leases.pop(stream_id)
        if key:
            try:
                self.redis.zrem(key, stream_id)
            except redis.RedisError:  # its lease runs out instead
                log.warning("could not release stream %s; its lease will expire", stream_id)

    def stop(self) -> None:
        self._stopping.set()

    def _ensure_renewer(self) -> None:
        with self._lock:
            if self._renewer is not None and self._renewer.is_alive():
                return
            self._renewer = threading.Thread(
                target=self._renew_loop, name="stream-leases", daemon=True
            )
            self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stopping.wait(RENEW_S):
            with self._lock:
                leases = [(i, key) for i, key in self._leases.items() if key]
            if not leases:
                continue
            until = time.time() + LEASE_S
            try:
                with self.redis.pipeline(transaction=False) as pipe:
                    for stream_id, key in leases:
                        pipe.zadd(key, {stream_id: until}, xx=True)
                    pipe.execute()
            except redis.RedisError as exc:
                log.warning("could not renew stream leases: %s", exc)

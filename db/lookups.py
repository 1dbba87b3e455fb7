"""One load per key at a time, for the caches in front of the database.

When a cached row lapses, every caller that wants it at that moment would
otherwise query at once: ten thousand open streams re-checking one token, or
following a few hundred jobs, emptied the API's connection pool that way
(bench/LOAD.md). Behind a :class:`LookupGate` the first caller loads and the
others wait for it, then find its answer in the cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class LookupGate:
    """Per-key locks, made on demand and dropped when nobody holds or waits on them."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Lock] = {}
        self.max_keys = max_keys

    @contextmanager
    def held(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock: re-check the cache inside, load only if still missing."""
        with self._lock:
            if len(self._gates) >= self.max_keys:
                self._gates.clear()  # a flood of distinct keys: start over
            gate = self._gates.setdefault(key, threading.Lock())
        try:
            with gate:
                yield
        finally:
            with self._lock:
                if self._gates.get(key) is gate and not gate.locked():
                    del self._gates[key]


class RowCache:
    """Values read from the database or Redis for many callers (a job's row for its
    streams, a token's principal for its requests), each loaded once per
    ``max_age`` in this process, and once at a time (:class:`LookupGate`).

    Ten thousand quiet streams each re-reading their job's row would be
    thousands of queries a second and would empty the connection pool; a few
    hundred jobs' rows, each read at most once per ``max_age``, are not.
    """

    MAX_ROWS = 20_000

    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, object]] = {}
        self._loads = LookupGate(max_rows)

    def peek(self, key: str, max_age: float) -> object | None:
        """The value of ``key`` if it was stored at most ``max_age`` seconds ago, else None."""
        with self._lock:
            hit = self._rows.get(key)
        return hit[1] if hit is not None and time.monotonic() - hit[0] < max_age else None

    def put(self, key: str, value: object) -> None:
        """Store ``value`` for ``key`` as read now."""
        now = time.monotonic()
        with self._lock:
            if len(self._rows) >= self.max_rows:
                self._rows.clear()  # a flood of distinct keys: start over
            self._rows[key] = (now, value)

    def forget(self, key: str) -> None:
        """Drop ``key``: the next :meth:`get` loads it again (e.g. after a local write)."""
        with self._lock:
            self._rows.pop(key, None)

    def clear(self) -> None:
        """Forget every value: the next :meth:`get` of each key loads it again."""
        with self._lock:
            self._rows.clear()

    def get(
        self,
        key: str,
        max_age: float,
        load: Callable[[], object],
        keep: Callable[[object], bool] = lambda _value: True,
    ) -> object:
        """The value of ``key`` loaded at most ``max_age`` seconds ago, else ``load()``'s
        (kept for the next callers only when ``keep(value)``)."""
        now = time.monotonic()
        with self._lock:
            hit = self._rows.get(key)
        if hit is not None and now - hit[0] < max_age:
            return hit[1]
        with self._loads.held(key):  # one load of a lapsed row, not one per stream
            with self._lock:
                hit = self._rows.get(key)
            if hit is not None and time.monotonic() - hit[0] < max_age:
                return hit[1]
            value = load()
            if not keep(value):
                return value
            with self._lock:
                if len(self._rows) >= self.max_rows:
                    self._rows = {k: v for k, v in self._rows.items() if now - v[0] < max_age}
                self._rows[key] = (time.monotonic(), value)
        return value

"""One load per key at a time, for the caches in front of the database.

When a cached row lapses, every caller that wants it at that moment would
otherwise query at once: ten thousand open streams re-checking one token, or
following a few hundred jobs, emptied the API's connection pool that way
(bench/LOAD.md). Behind a :class:`LookupGate` the first caller loads and the
others wait for it, then find its answer in the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
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

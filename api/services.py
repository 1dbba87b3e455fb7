"""What one API process holds: settings, catalog, database, Redis, Celery, the relay hub.

Created by the app factory and stored in ``app.extensions``; routes reach it
through :func:`services`. Nothing here connects at construction: Redis and
SQLAlchemy pools open lazily, the relay hub's thread starts on first use (so
gunicorn can fork safely).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import redis
from celery import Celery
from flask import current_app

from api.streamcaps import StreamCaps
from api.streams import RelayHub
from config import Catalog, Settings
from db.accounts import Accounts
from db.jobs import JobStore
from db.lookups import LookupGate
from db.session import Database
from tasks.events import EventLog

EXTENSION = "switchyard"


class Background(Protocol):
    """A loop an API process runs beside its requests (e.g. the reaper)."""

    def stop(self) -> None: ...


class RowCache:
    """Job rows read by streams, shared by every stream of a job in this process.

    Ten thousand quiet streams each re-reading their job's row would be
    thousands of queries a second and would empty the connection pool; a few
    hundred jobs' rows, each read at most once per ``max_age``, are not.
    """

    MAX_ROWS = 20_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, object]] = {}
        self._loads = LookupGate(self.MAX_ROWS)

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
                if len(self._rows) >= self.MAX_ROWS:
                    self._rows = {k: v for k, v in self._rows.items() if now - v[0] < max_age}
                self._rows[key] = (time.monotonic(), value)
        return value


@dataclass
class Services:
    settings: Settings
    catalog: Catalog
    db: Database
    jobs: JobStore
    accounts: Accounts
    redis: redis.Redis
    events: EventLog
    hub: RelayHub
    celery: Celery
    caps: StreamCaps
    rows: RowCache = field(default_factory=RowCache)
    background: list[Background] = field(default_factory=list)

    def close(self) -> None:
        for loop in self.background:
            loop.stop()
        self.hub.stop()
        self.caps.stop()
        self.db.dispose()
        self.redis.close()


def services() -> Services:
    """The current app's services."""
    found: Services = current_app.extensions[EXTENSION]
    return found

"""What one API process holds: settings, catalog, database, Redis, Celery, the relay hub.

Created by the app factory and stored in ``app.extensions``; routes reach it
through :func:`services`. Nothing here connects at construction: Redis and
SQLAlchemy pools open lazily, the relay hub's thread starts on first use (so
gunicorn can fork safely).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import redis
from flask import current_app

from api.streamcaps import StreamCaps
from api.streams import RelayHub
from config import Catalog, Settings
from db.accounts import Accounts
from db.jobs import JobStore
from db.lookups import RowCache
from db.session import Database
from fleet.capacity import SubmissionFleet
from jobs.events import EventLog
from jobs.metrics import MetricsBuffer, MetricsStore
from jobs.service import JobService

EXTENSION = "switchyard"


class Background(Protocol):
    """A loop an API process runs beside its requests (e.g. the reaper)."""

    def ensure_started(self) -> None: ...

    def stop(self) -> None: ...


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
    caps: StreamCaps
    rows: RowCache = field(default_factory=RowCache)
    background: list[Background] = field(default_factory=list)
    job_service: JobService = field(init=False)
    http_metrics: MetricsBuffer = field(init=False)  # the API's per-request counters

    def __post_init__(self) -> None:
        self.job_service = JobService(
            self.settings,
            self.jobs,
            self.events,
            self.redis,
            catalog=self.catalog,
            db=self.db,
            rows=self.rows,
            fleet=SubmissionFleet(self.redis, self.db, self.settings, self.rows),
            relay=self.hub,
        )
        self.http_metrics = MetricsBuffer(MetricsStore(self.redis, self.settings))

    def start_background(self) -> None:
        """Start the process's loops: gunicorn's ``post_worker_init`` calls this.

        An app built in a test or a script runs none unless it asks; one that
        does stops them with :meth:`close`.
        """
        for loop in self.background:
            loop.ensure_started()

    def close(self) -> None:
        for loop in self.background:
            loop.stop()
        self.hub.stop()
        self.caps.stop()
        self.http_metrics.stop()
        self.db.dispose()
        self.redis.close()


def services() -> Services:
    """The current app's services."""
    found: Services = current_app.extensions[EXTENSION]
    return found

"""Engine and session factory for one database URL."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine, event, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from config import Settings


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, *, flush: bool = True) -> None:
    # WAL lets the API read while a worker writes; the busy timeout makes a
    # writer wait for the lock instead of failing at once. Without ``flush``
    # (a worker's: Database's ``synchronous_commit``), WAL mode syncs at
    # checkpoints only: a commit survives the process's crash, and may be
    # rolled back by the machine's.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA synchronous={'FULL' if flush else 'NORMAL'}")
    cursor.close()


def prepare_sqlite_file(url: str) -> None:
    """Create the SQLite file of ``url`` private before SQLite opens it.

    The file holds every prompt, output and token hash: a new one is 0600 in a
    new folder made 0700 (SQLite gives its WAL and shared-memory files the
    database file's mode), whatever the umask, so ``switchyard migrate`` or
    the API can be the first to open it. Files and folders that exist are left
    as they are (``switchyard run`` makes its state folder private itself).
    Other databases, and in-memory SQLite, are left alone.
    """
    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:":
        return
    if path.startswith("file:"):
        return  # a URI filename: SQLite's own options decide
    file = Path(path)
    if file.exists():
        return
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # another process created it first
        os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _commit_without_flush(dbapi_connection: Any, _record: Any) -> None:
    """Postgres' ``synchronous_commit = off`` for this connection's transactions.

    A commit then returns once its changes are written and visible to every
    session, without waiting for the WAL's flush to disk (the WAL writer
    flushes within three ``wal_writer_delay``, 0.6 s by default). A crash of
    the server in that moment loses those last commits, never part of one:
    the database comes back consistent, as of a fraction of a second before.
    A worker's claim and final row are such commits, on the path of every
    job, and the farm redoes them if they are lost (the reaper, the
    reconciler): waiting for the disk buys nothing. On this project's CI
    machine a flushed commit took 0.2-0.4 ms with the disk quiet and 4 ms
    while a package build wrote to it; 0.03-0.2 ms without the flush. Set
    per connection, not in the startup packet: PgBouncer refuses unknown
    startup parameters.
    """
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET synchronous_commit TO off")
    finally:
        cursor.close()
    dbapi_connection.commit()


PING_IDLE_S = 1.0
"""A pooled connection idle this long is pinged before use (seconds)."""


def _mark_checkin(_dbapi_connection: Any, record: Any) -> None:
    record.info["idle_since"] = time.monotonic()


def _ping_if_idle(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
    """Ping a connection that sat idle in the pool; a dead one is replaced.

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip and
    about 0.2 ms of CPU per transaction, a third of a job insert's. A
    connection in steady use is not pinged: if the server went away under
    it, the statement fails, SQLAlchemy sees the disconnect and drops every
    older connection of the pool, and the next checkout connects afresh.
    Raising ``DisconnectionError`` here makes the pool retry with a new one.
    """
    idle_since = record.info.get("idle_since")
    if idle_since is None or time.monotonic() - idle_since < PING_IDLE_S:
        return
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.close()
    except Exception as exc:
        raise DisconnectionError(f"pooled connection is dead: {exc}") from exc


class Database:
    """A SQLAlchemy engine plus a session factory; one per process."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        max_overflow: int = 40,
        synchronous_commit: bool = True,
    ) -> None:
        """``synchronous_commit=False``: a commit returns before its WAL is flushed to
        disk (Postgres: :func:`_commit_without_flush`; SQLite: ``synchronous=NORMAL``)."""
        self.url = url
        kwargs: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            prepare_sqlite_file(url)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
        else:
            kwargs.update(
                pool_size=pool_size, max_overflow=max_overflow, pool_recycle=1800, pool_timeout=10
            )
        if url.startswith("postgresql"):
            # A server that stops answering (host gone, packets dropped) fails a
            # request in seconds instead of hanging it: the API answers 503.
            kwargs["connect_args"] = {
                "connect_timeout": 5,
                "keepalives": 1,
                "keepalives_idle": 30,
                "keepalives_interval": 10,
                "keepalives_count": 3,
            }
        self.engine: Engine = create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            event.listen(
                self.engine, "connect", functools.partial(_sqlite_pragmas, flush=synchronous_commit)
            )
        else:
            event.listen(self.engine, "checkin", _mark_checkin)
            if not synchronous_commit and url.startswith("postgresql"):
                event.listen(self.engine, "connect", _commit_without_flush)
            event.listen(self.engine, "checkout", _ping_if_idle)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def for_process(cls, settings: Settings, *, synchronous_commit: bool = True) -> Database:
        """The database of a long-lived process (API, worker, scaler), its pool sized by
        ``db_pool_size`` and ``db_max_overflow``: what Postgres' ``max_connections``
        is divided by. With no overflow, a burst of queries (a worker's job threads
        claiming together) waits a moment for a pooled connection instead of
        opening and closing new ones."""
        return cls(
            settings.database_url,
            pool_size=settings.db_pool_size,
            max_overflow=settings.db_max_overflow,
            synchronous_commit=synchronous_commit,
        )

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session committed on success, rolled back on error."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def ping(self) -> None:
        """Raise if the database cannot answer a trivial query."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()

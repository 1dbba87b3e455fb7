"""The SQLite database of a farm without Postgres: created private, wherever it lies."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from db.migrate import upgrade
from db.session import Database


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that would leave new files readable by everyone (0644 / 0755)."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_migrate_creates_a_private_database_in_a_new_folder(
    tmp_path: Path, open_umask: None
) -> None:
    """``switchyard migrate`` (or the API) first: the folder and the file are made, private."""
    path = tmp_path / "new" / "state" / "switchyard.db"
    upgrade(f"sqlite:///{path}")
    assert _mode(path.parent) == 0o700
    assert _mode(path) == 0o600
    db = Database(f"sqlite:///{path}")
    try:
        with db.session() as session:
            session.execute(text("CREATE TABLE t (x INTEGER)"))
        wal = path.with_name(path.name + "-wal")
        assert wal.exists() and _mode(wal) == 0o600
    finally:
        db.dispose()


def test_an_existing_database_and_other_urls_are_left_alone(
    tmp_path: Path, open_umask: None
) -> None:
    shared = tmp_path / "shared.db"
    shared.touch(mode=0o640)
    Database(f"sqlite:///{shared}").dispose()
    assert _mode(shared) == 0o640
    Database("sqlite://").dispose()  # in memory: no file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.db"]


def test_a_worker_database_commits_without_a_flush_and_others_with_one(tmp_path: Path) -> None:
    """``synchronous_commit=False`` (a worker's, by default) puts SQLite's WAL in
    ``synchronous=NORMAL`` (1): a commit survives the process's crash, not the
    machine's. Every other process keeps FULL (2)."""
    url = f"sqlite:///{tmp_path / 'farm.db'}"

    def synchronous(database: Database) -> int:
        with database.session() as s:
            return int(s.execute(text("PRAGMA synchronous")).scalar_one())

    worker, api = Database(url, synchronous_commit=False), Database(url)
    try:
        assert synchronous(worker) == 1
        assert synchronous(api) == 2
    finally:
        worker.dispose()
        api.dispose()

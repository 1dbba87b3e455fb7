"""Apply Alembic migrations programmatically (start-up, tests, ``switchyard migrate``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from db.session import prepare_sqlite_file

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # Alembic's config is an ini parser: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "heads") -> None:
    """Bring the database at ``url`` to ``revision`` (a new SQLite file is made private)."""
    prepare_sqlite_file(url)
    command.upgrade(alembic_config(url), revision)

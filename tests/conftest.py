"""Fixtures shared by integration and e2e tests: real Postgres, Redis, processes."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from config import Settings, load_settings
from config.settings import PROJECT_ROOT
from tests import farm

REAL_SERVICE_DIRS = ("integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def real_services() -> None:
    """Postgres and Redis must answer; skip (or fail under CI) otherwise."""
    problems = farm.unreachable_services()
    if problems:
        message = "unreachable: " + "; ".join(problems)
        if farm.services_required():
            pytest.fail(message + " (SY_TEST_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real catalog plus test models: ``tiny-late``, a model no worker serves until a test
    starts one, and the others described below."""
    folder = tmp_path_factory.mktemp("models")
    for path in (PROJECT_ROOT / "config" / "models").glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    late = (folder / "tiny-random.yaml").read_text().replace("name: tiny-random", "name: tiny-late")
    (folder / "tiny-late.yaml").write_text(late)
    # tiny-handover: served only by the in-process runners of test_handover.py.
    handover = late.replace("name: tiny-late", "name: tiny-handover")
    (folder / "tiny-handover.yaml").write_text(handover)
    # tiny-recovery: long generations, so a test can kill its worker mid-job.
    tiny = (folder / "tiny-random.yaml").read_text()
    recovery = tiny.replace("name: tiny-random", "name: tiny-recovery")
    (folder / "tiny-recovery.yaml").write_text(
        recovery.replace("max_new_tokens: 1024", "max_new_tokens: 2048")
    )
    # tiny-broken: its second pre-start action fails, so no worker ever serves it.
    broken = tiny.replace("name: tiny-random", "name: tiny-broken") + (
        "pre_start_actions:\n"
        "  - action: write_file\n"
        "    path: prestart/tiny-broken.txt\n"
        "    body: written before the failing command\n"
        "  - action: run_command\n"
        "    args: [sh, -c, 'echo no accelerator here >&2; exit 7']\n"
    )
    (folder / "tiny-broken.yaml").write_text(broken)
    # tiny-slow: a pre-start action makes its workers take a few seconds to start.
    slow = tiny.replace("name: tiny-random", "name: tiny-slow") + (
        "pre_start_actions:\n  - action: run_command\n    args: [sleep, '3']\n"
    )
    (folder / "tiny-slow.yaml").write_text(slow)
    # tiny-badpath: its checkpoint folder does not exist, so its model never loads.
    badpath = (
        "name: tiny-badpath\n"
        "source:\n"
        "  kind: local\n"
        "  path: /nonexistent/switchyard-checkpoint\n"
        "backend: transformers\n"
        "dtype: float32\n"
        "device: cpu\n"
        "scaling:\n"
        "  max_replicas: 1\n"
    )
    (folder / "tiny-badpath.yaml").write_text(badpath)
    return folder


@pytest.fixture(scope="session")
def settings(real_services: None, models_dir: Path) -> Settings:
    """Settings for a test session: real services, a Redis prefix of its own."""
    return load_settings(
        {},
        database_url=farm.tests_database_url(),
        redis_url=farm.tests_redis_url(),
        redis_prefix=f"t{uuid.uuid4().hex[:8]}",
        state_dir=PROJECT_ROOT / ".switchyard",
        models_dir=models_dir,
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=3.0,
        reaper_interval_s=0.5,
        max_attempts=2,
        reconcile_after_s=5.0,
        api_port=farm.free_port(),
        api_workers=2,
    )


@pytest.fixture(scope="session")
def migrated(settings: Settings) -> Settings:
    """A fresh database at the newest migration, and an empty Redis database."""
    from db.migrate import upgrade

    farm.reset_database(settings.database_url)
    upgrade(settings.database_url)
    redis.Redis.from_url(settings.redis_url).flushdb()
    return settings


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def _token(settings: Settings, role: str) -> str:
    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    db = Database(settings.database_url)
    try:
        accounts = Accounts(db)
        name = f"{role}-{uuid.uuid4().hex[:8]}"
        accounts.add_user(name, Role(role))
        return accounts.issue_token(name).secret
    finally:
        db.dispose()


@pytest.fixture(scope="session")
def user_token(migrated: Settings) -> str:
    return _token(migrated, "user")


@pytest.fixture(scope="session")
def other_user_token(migrated: Settings) -> str:
    return _token(migrated, "user")


@pytest.fixture(scope="session")
def admin_token(migrated: Settings) -> str:
    return _token(migrated, "admin")


@pytest.fixture(scope="session")
def api_url(migrated: Settings) -> Iterator[str]:
    """The Flask app on a real socket in this process (integration tests)."""
    with farm.serve_app_in_thread(migrated) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_worker(migrated: Settings, log_dir: Path) -> Iterator[farm.Process]:
    """One real Celery worker process serving ``tiny-random``."""
    proc = farm.start_worker(migrated, "tiny-random", log_dir)
    try:
        farm.wait_ready(migrated, "tiny-random", proc)
        yield proc
    finally:
        proc.stop()

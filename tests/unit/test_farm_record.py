"""The record of a running farm, and which farm a command steers with it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from config.farm_record import choose_farm, describe_farm, forget_farm, masked_url, record_farm

FARM_ENV = {
    "DATABASE_URL": "postgresql+psycopg2://sy:dbsecret@db.internal:5432/farm",
    "REDIS_URL": "redis://:redissecret@redis.internal:6379/2",
    "SWITCHYARD_REDIS_PREFIX": "prod",
    "PATH": "/usr/bin",
    "HOME": "/home/someone",
}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_record_is_private_and_holds_only_the_farms_settings(tmp_path: Path) -> None:
    path = record_farm(tmp_path, FARM_ENV, api_url="http://127.0.0.1:8000")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "dbsecret" in text and "SWITCHYARD_REDIS_PREFIX" in text
    assert "PATH" not in text and "/home/someone" not in text


def test_a_command_without_variables_steers_the_recorded_farm(tmp_path: Path) -> None:
    state = {"SWITCHYARD_STATE_DIR": str(tmp_path)}
    record_farm(tmp_path, {**FARM_ENV, **state}, api_url="http://127.0.0.1:8000")
    choice = choose_farm(state)
    assert choice.record is not None and choice.record.pid == os.getpid()
    assert choice.settings.database_url == FARM_ENV["DATABASE_URL"]
    assert choice.settings.redis_url == FARM_ENV["REDIS_URL"]
    assert choice.settings.redis_prefix == "prod"
    # A setting of the command's own environment wins over the record's.
    assert choose_farm({**state, "SWITCHYARD_REDIS_PREFIX": "mine"}).settings.redis_prefix == "mine"


def test_a_farm_named_by_variables_wins_over_the_record(tmp_path: Path) -> None:
    state = {"SWITCHYARD_STATE_DIR": str(tmp_path)}
    record_farm(tmp_path, {**FARM_ENV, **state}, api_url="http://127.0.0.1:8000")
    choice = choose_farm({**state, "REDIS_URL": "redis://127.0.0.1:6390/0"})
    assert choice.record is None
    assert choice.settings.redis_url == "redis://127.0.0.1:6390/0"
    assert choice.settings.database_url.startswith("sqlite:///")
    assert choice.settings.redis_prefix == "sy"


def test_the_record_of_a_launcher_that_is_gone_is_ignored(tmp_path: Path) -> None:
    state = {"SWITCHYARD_STATE_DIR": str(tmp_path)}
    record_farm(tmp_path, {**FARM_ENV, **state}, api_url="http://x", pid=_dead_pid())
    choice = choose_farm(state)
    assert choice.record is None and choice.ignored is not None
    assert choice.settings.database_url == f"sqlite:///{tmp_path}/switchyard.db"


def test_only_the_launcher_that_wrote_the_record_removes_it(tmp_path: Path) -> None:
    path = record_farm(tmp_path, FARM_ENV, api_url="http://x", pid=12345678)
    forget_farm(tmp_path)  # another launcher's record: kept
    assert path.exists()
    record_farm(tmp_path, FARM_ENV, api_url="http://x")
    forget_farm(tmp_path)
    assert not path.exists()
    forget_farm(tmp_path)  # nothing left to remove: no error


def test_an_unreadable_record_is_no_farm(tmp_path: Path) -> None:
    (tmp_path / "farm.json").write_text("{not json")
    choice = choose_farm({"SWITCHYARD_STATE_DIR": str(tmp_path)})
    assert choice.record is None and choice.ignored is None


def test_the_farm_is_named_without_its_passwords() -> None:
    assert masked_url(FARM_ENV["REDIS_URL"]) == "redis://:***@redis.internal:6379/2"
    assert masked_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert masked_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    settings = choose_farm({k: v for k, v in FARM_ENV.items() if k not in ("PATH", "HOME")})
    line = describe_farm(settings.settings)
    assert "secret" not in line
    assert line == (
        "postgresql+psycopg2://sy:***@db.internal:5432/farm "
        "(redis redis://:***@redis.internal:6379/2, prefix prod)"
    )

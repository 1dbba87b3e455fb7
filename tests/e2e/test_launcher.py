"""`switchyard run` as a new user starts it, with no services: embedded Redis, SQLite.

What a shared machine needs: a private state folder, a Redis nobody else can
use; and what a process manager needs: ``kill -9`` of the launcher leaves no
process of the farm behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
import requests
import yaml

from config.farm_record import masked_url
from config.settings import PROJECT_ROOT, with_postgres_driver
from db.scaling import ScalingStore
from db.session import Database
from tests import farm

# What the farm's processes may take to notice their parent's death and exit.
DIE_WITHIN_S = 10.0


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


def _terminal_env() -> dict[str, str]:
    """A new terminal's environment: no farm variables set."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    return {k: v for k, v in env.items() if not k.startswith("SWITCHYARD_")}


def _start(tmp_path: Path, *args: str, **env_extra: str) -> subprocess.Popen[str]:
    env = _terminal_env()
    env.update(
        SWITCHYARD_STATE_DIR=str(tmp_path / "state"),
        SWITCHYARD_API_PORT=str(farm.free_port()),
        SWITCHYARD_API_WORKERS="1",
        HF_HUB_OFFLINE="1",
        **env_extra,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "run", *args],
        env=env,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    """The launchers a test starts, killed at its end whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture
def launcher(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    launched.append(_start(tmp_path, "--model", "tiny-random"))
    return launched[0]


def _read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 180) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        if re.search(pattern, seen):
            return seen
    raise AssertionError(f"no {pattern!r} in the launcher's output:\n{seen[-3000:]}")


def test_kill_9_of_the_launcher_leaves_no_process_and_state_is_private(
    launcher: subprocess.Popen[str], tmp_path: Path
) -> None:
    out = _read_until(launcher, r"Ctrl-C stops everything")
    base = re.search(r"API at (http://\S+)", out).group(1)  # type: ignore[union-attr]
    assert requests.get(base + "/healthz", timeout=10).status_code == 200
    # The first admin token expires and the admin is told to make a named one.
    assert re.search(r"first admin API token \(shown once, expires in 24 h\): sy_", out)
    assert "switchyard token create --user admin --name" in out

    state = tmp_path / "state"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "switchyard.db").stat().st_mode) == 0o600
    conf = state / "redis" / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    port = int(re.search(r"embedded Redis at 127\.0\.0\.1:(\d+)", out).group(1))  # type: ignore[union-attr]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()  # no password: refused
    password = re.search(r"^requirepass (\S+)$", conf.read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert redis.Redis(port=port, password=password).ping()
    # The password is on no command line (`ps` shows those to every user).
    farm_procs = psutil.Process(launcher.pid).children(recursive=True)
    assert farm_procs
    for p in farm_procs:
        assert password not in " ".join(p.cmdline())

    _kill_and_check(launcher, base, term_first_s=None)


def _farm(launcher: subprocess.Popen[str]) -> list[psutil.Process]:
    """The launcher's processes once the API (gunicorn) and a model worker are among them."""
    farm_procs: list[psutil.Process] = []

    def complete() -> bool:
        farm_procs[:] = psutil.Process(launcher.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) for p in farm_procs if not _gone(p)]
        return any("gunicorn" in n for n in names) and any(" worker " in n for n in names)

    farm.wait_for("the API and a worker", complete, timeout=120, every=0.5)
    return farm_procs


def _kill_and_check(
    launcher: subprocess.Popen[str], base: str, *, term_first_s: float | None
) -> None:
    """Kill the launcher (after a SIGTERM ``term_first_s`` earlier, as process managers
    do) and check that every process of its farm is gone within :data:`DIE_WITHIN_S`."""
    # The farm writes to the launcher's pipe: keep reading it, or a full pipe
    # would block a child's write and keep it alive through its signal.
    later: list[str] = []
    assert launcher.stdout is not None
    threading.Thread(target=later.extend, args=(launcher.stdout,), daemon=True).start()
    farm_procs = _farm(launcher)
    how = "kill -9"
    if term_first_s is not None:
        launcher.send_signal(signal.SIGTERM)
        time.sleep(term_first_s)
        how = f"SIGTERM, then {term_first_s:g} s later kill -9,"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + DIE_WITHIN_S
    while time.monotonic() < deadline and not all(_gone(p) for p in farm_procs):
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())) for p in farm_procs if not _gone(p)]
    assert not left, (
        f"still running {DIE_WITHIN_S} s after {how} of the launcher: {left}\n"
        + "".join(later[-40:])
    )
    with pytest.raises(requests.ConnectionError):
        requests.get(base + "/readyz", timeout=5)


def _models_dir(tmp_path: Path, tiny_random_min: int = 1) -> Path:
    """The shipped catalog with tiny-random kept at ``tiny_random_min`` to one replica and
    smollm2-135m at none."""
    folder = tmp_path / "models"
    folder.mkdir()
    for path in (PROJECT_ROOT / "config" / "models").glob("*.yaml"):
        definition = yaml.safe_load(path.read_text())
        tiny = definition["name"] == "tiny-random"
        definition["scaling"] = {
            "min_replicas": tiny_random_min if tiny else 0,
            "max_replicas": 1 if tiny else 0,
        }
        (folder / path.name).write_text(yaml.safe_dump(definition))
    return folder


@pytest.mark.parametrize(
    ("args", "term_first_s"),
    [
        (("--model", "tiny-random"), 2.0),  # fixed workers, started by the launcher's thread
        ((), None),  # make run's default: the scaler's thread starts the workers
        ((), 2.0),
    ],
    ids=["model-term-then-kill", "scaler-kill", "scaler-term-then-kill"],
)
def test_no_process_outlives_the_launcher(
    tmp_path: Path,
    launched: list[subprocess.Popen[str]],
    args: tuple[str, ...],
    term_first_s: float | None,
) -> None:
    env = {} if args else {"SWITCHYARD_MODELS_DIR": str(_models_dir(tmp_path))}
    launched.append(_start(tmp_path, *args, **env))
    out = _read_until(launched[0], r"Ctrl-C stops everything")
    base = re.search(r"API at (http://\S+)", out).group(1)  # type: ignore[union-attr]
    _kill_and_check(launched[0], base, term_first_s=term_first_s)


def _command(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``switchyard`` command typed in another terminal, beside state folder ``state``."""
    return farm.switchyard({**_terminal_env(), "SWITCHYARD_STATE_DIR": str(state)}, *args)


def test_commands_of_another_terminal_steer_the_running_farm(
    real_services: None, tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    """The issue's case: a farm started with DATABASE_URL and REDIS_URL, then
    `switchyard scale` typed without them changes that farm, and says which."""
    database = farm.database_of_its_own(farm.tests_database_url(), "steer")
    farm.reset_database(database)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    launched.append(
        _start(
            tmp_path,
            DATABASE_URL=database,
            REDIS_URL=farm.tests_redis_url(),
            SWITCHYARD_REDIS_PREFIX=prefix,
            SWITCHYARD_MODELS_DIR=str(_models_dir(tmp_path, tiny_random_min=0)),
        )
    )
    launcher = launched[0]
    out = _read_until(launcher, r"Ctrl-C stops everything")
    state = tmp_path / "state"
    record = state / "farm.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert f"recorded in {record}" in out
    later: list[str] = []
    assert launcher.stdout is not None
    threading.Thread(target=later.extend, args=(launcher.stdout,), daemon=True).start()

    def led() -> bool:
        r = _command(state, "status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["leader"] is not None

    farm.wait_for("the launcher's scaler to lead", led, timeout=60, every=0.5)
    r = _command(state, "scale", "tiny-random", "0", "--for", "1h", "--as", "steer-test")
    assert r.returncode == 0, r.stderr
    assert "tiny-random: 0 replicas until" in r.stdout
    assert f"farm {masked_url(with_postgres_driver(database))} " in r.stderr
    assert f"prefix {prefix})" in r.stderr
    assert "warning" not in r.stderr
    db = Database(database)
    try:
        override = ScalingStore(db).override("tiny-random")
        assert override is not None
        assert override.manual_replicas == 0 and override.updated_by == "cli:steer-test"
    finally:
        db.dispose()
    # A second launcher on the same state folder refuses to start.
    second = _start(tmp_path)
    assert second.wait(timeout=60) == 1
    assert second.stdout is not None and "runs already" in second.stdout.read()

    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 0, "".join(later[-40:])
    assert not record.exists()

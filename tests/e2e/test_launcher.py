"""`switchyard run` as a new user starts it, with no services: embedded Redis, SQLite.

What a shared machine needs: a private state folder, a Redis nobody else can
use; and what a process manager needs: ``kill -9`` of the launcher leaves no
process of the farm behind.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
import requests

from config.settings import PROJECT_ROOT
from tests import farm

# What the farm's processes may take to notice their parent's death and exit.
DIE_WITHIN_S = 10.0


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def launcher(tmp_path: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env = {k: v for k, v in env.items() if not k.startswith("SWITCHYARD_")}
    env.update(
        SWITCHYARD_STATE_DIR=str(tmp_path / "state"),
        SWITCHYARD_API_PORT=str(farm.free_port()),
        SWITCHYARD_API_WORKERS="1",
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "run", "--model", "tiny-random"],
        env=env,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


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

    # Wait for the worker to be up so every kind of child is there to be orphaned.
    names = {" ".join(p.cmdline()) for p in farm_procs}
    assert any("gunicorn" in n for n in names) and any("worker" in n for n in names)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + DIE_WITHIN_S
    while time.monotonic() < deadline and not all(_gone(p) for p in farm_procs):
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())) for p in farm_procs if not _gone(p)]
    assert not left, f"still running {DIE_WITHIN_S} s after kill -9 of the launcher: {left}"
    with pytest.raises(requests.ConnectionError):
        requests.get(base + "/readyz", timeout=5)

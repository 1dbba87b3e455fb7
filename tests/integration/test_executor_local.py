"""The local executor's supervision with real child processes.

The processes here are small Python programs standing in for workers (the
executor takes the command line as a parameter), so GPU hand-out, crash
backoff and the kill after the drain grace are checked in seconds; the real
worker's start, drain and stop are in test_scaling.py. The executor's clock is
a parameter too, so backoff and grace are checked without waiting for them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from config import Settings
from workers.executors.local import LocalExecutor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_exit(executor: LocalExecutor, timeout: float = 30) -> None:
    """Block until every process of ``executor`` has exited (without reaping them)."""
    deadline = time.monotonic() + timeout
    for replicas in executor._replicas.values():
        for r in replicas:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))


def wait_files(folder: Path, n: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(folder.glob("*.ready"))
        if len(files) >= n:
            return [f.read_text() for f in files]
        time.sleep(0.05)
    raise AssertionError(f"{n} processes did not report in {timeout} s")


def test_one_gpu_per_replica_and_no_more_replicas_than_gpus(tmp_path: Path) -> None:
    settings = Settings(cuda_visible_devices="3,5")
    code = (
        "import os, time, pathlib; "
        f"pathlib.Path({str(tmp_path)!r}, str(os.getpid()) + '.ready')"
        ".write_text(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(120)"
    )
    executor = LocalExecutor(settings, env={}, command=lambda model: python(code))
    try:
        executor.apply("m", 3)
        assert sorted(p["gpu"] for p in executor.processes()) == ["3", "5"]
        assert sorted(wait_files(tmp_path, 2)) == ["3", "5"]

        executor.apply("m", 1)  # drains one (SIGTERM ends the sleep)
        wait_exit_of_draining(executor)
        executor.poll()
        (left,) = executor.processes()
        executor.apply("m", 2)
        assert sorted(p["gpu"] for p in executor.processes()) == ["3", "5"]
        assert executor.replicas() == {"m": 2}
        # The one left kept running (its view's uptime_s moves on, so match the pid).
        assert left["pid"] in {p["pid"] for p in executor.processes()}
    finally:
        executor.close()
    assert executor.processes() == []


def wait_exit_of_draining(executor: LocalExecutor) -> None:
    for replicas in executor._replicas.values():
        for r in replicas:
            if r.draining_since is not None:
                r.proc.wait(timeout=30)


def test_a_crashing_worker_is_restarted_with_a_doubling_backoff() -> None:
    settings = Settings(restart_backoff_s=1.0, restart_backoff_max_s=3.0)
    clock = Clock()
    executor = LocalExecutor(
        settings, env={}, command=lambda model: python("raise SystemExit(3)"), clock=clock
    )
    try:
        executor.apply("m", 1)
        starts = 1
        for backoff in (1.0, 2.0, 3.0, 3.0):  # doubling, capped at restart_backoff_max_s
            assert len(executor.processes()) == 1
            wait_exit(executor)
            executor.poll()  # reaps the crash; no restart before the backoff
            assert executor.processes() == []
            clock.now += backoff - 0.5
            executor.poll()
            assert executor.processes() == [], f"restarted before {backoff} s"
            clock.now += 0.5
            executor.poll()
            starts += 1
        assert len(executor.processes()) == 1 and starts == 5
    finally:
        executor.close()


def test_a_worker_that_ignores_the_drain_is_killed_after_the_grace(tmp_path: Path) -> None:
    settings = Settings(drain_grace_s=30)
    clock = Clock()
    code = (
        "import os, signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(tmp_path)!r}, 'w.ready').write_text('x'); time.sleep(120)"
    )
    executor = LocalExecutor(settings, env={}, command=lambda model: python(code), clock=clock)
    try:
        executor.apply("m", 1)
        wait_files(tmp_path, 1)
        (replica,) = executor._replicas["m"]
        executor.apply("m", 0)
        assert executor.processes()[0]["state"] == "draining"
        clock.now += 29
        executor.poll()
        time.sleep(0.5)
        assert replica.proc.poll() is None  # still draining within the grace
        clock.now += 1
        executor.poll()
        assert replica.proc.wait(timeout=30) == -9
        executor.poll()
        assert executor.processes() == []
        executor.poll()
        assert executor.processes() == []  # a drained worker is not replaced
    finally:
        executor.close()


def test_a_worker_killed_after_it_served_is_no_crash_loop(settings: Settings) -> None:
    """kill -9 after a while of honest work: each replacement waits the first backoff only."""
    import uuid

    import redis

    from fleet.registry import registry_key

    served = settings.model_copy(
        update={
            "redis_prefix": f"x{uuid.uuid4().hex[:8]}",
            "restart_backoff_s": 1.0,
            "restart_backoff_max_s": 300.0,
        }
    )
    # A stand-in that reports itself ready in the registry, as a worker does, then dies.
    code = (
        "import json, os, socket, time, redis; "
        f"c = redis.Redis.from_url({served.redis_url!r}); "
        "r = {'id': 'w%d' % os.getpid(), 'model': 'm', 'pid': os.getpid(), "
        "'host': socket.gethostname(), 'state': 'ready', 'started_at': time.time()}; "
        f"c.hset({registry_key(served)!r}, r['id'], json.dumps(r)); "
        "os.kill(os.getpid(), 9)"
    )
    clock = Clock()
    client = redis.Redis.from_url(served.redis_url)
    executor = LocalExecutor(
        served, client=client, env=None, command=lambda model: python(code), clock=clock
    )
    try:
        executor.apply("m", 1)
        for _ in range(4):
            wait_exit(executor)
            executor.poll()
            assert executor.processes() == []
            clock.now += 1.0  # restart_backoff_s, never doubled
            executor.poll()
            assert len(executor.processes()) == 1
    finally:
        executor.close()
        client.delete(registry_key(served))

"""A worker keeps a job's events through a Redis outage (a real redis-server, restarted)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import redis

from config import Settings
from jobs.events import EventLog, JobEvent
from tests import farm
from workers.launcher import redis_server_binary
from workers.runner import _Stream


def start_redis(port: int, folder: Path) -> subprocess.Popen[bytes]:
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(folder)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    raise AssertionError("redis-server did not start")


def test_events_written_during_a_redis_restart_are_retried_not_lost(
    migrated: Settings, tmp_path: Path
) -> None:
    port = farm.free_port()
    servers = [start_redis(port, tmp_path)]
    settings = migrated.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})
    log = EventLog(redis.Redis.from_url(settings.redis_url), settings)
    stream = _Stream(log, "outage-job", 0)
    # Redis comes back 1.5 s after it stopped, while the worker is publishing.
    restart = threading.Timer(1.5, lambda: servers.append(start_redis(port, tmp_path)))
    try:
        stream.emit("started", attempt=1, worker="w")
        servers[0].terminate()
        servers[0].wait(timeout=10)
        restart.start()
        started = time.monotonic()
        stream.add_text("hello", [1])
        stream.flush()
        waited = time.monotonic() - started
        stream.emit("done", finish_reason="length", text="hello")
        history = log.history("outage-job")
        # Nothing is kept on disk, so the restart lost the first event; every event
        # written after it arrived once, in order: the write waited instead of failing.
        assert [(e.seq, e.type) for e in history] == [(1, "token"), (2, "done")]
        assert history[0].text == "hello"
        assert waited >= 1.0
    finally:
        restart.cancel()
        restart.join()
        for proc in servers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)


def test_history_returns_each_seq_once(migrated: Settings) -> None:
    log = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    events = [JobEvent(0, "queued"), JobEvent(1, "token", {"text": "a"})]
    log.append("twice", events)
    log.append("twice", events[1:])  # a retried write that had half-happened
    log.append("twice", [JobEvent(2, "done", {"text": "a"})])
    assert [e.seq for e in log.history("twice")] == [0, 1, 2]
    assert [e.seq for e in log.history("twice", after=0)] == [1, 2]

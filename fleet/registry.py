"""Worker heartbeats: a key per worker with a TTL, plus a registry of every worker seen.

A worker whose key expired is lost: it no longer counts as capacity, but its
last report stays in the registry so operators can see what vanished.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Self

import redis

from config import Settings

log = logging.getLogger(__name__)

WorkerState = Literal["starting", "ready", "draining", "failed"]


@dataclass
class WorkerReport:
    id: str
    model: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    device: str = "cpu"
    state: WorkerState = "starting"
    busy_slots: int = 0
    total_slots: int = 0
    tokens_per_s: float = 0.0
    last_job: str | None = None
    # The jobs this worker is running now; None until it serves (and from
    # workers that predate the field). The reaper re-runs a job left
    # ``running`` on a live worker that no longer lists it.
    active_jobs: list[str] | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    # While ``starting``: how long the model's last start took on this farm
    # (seconds, None before its first), and from it the share done (0-100)
    # and the seconds left (:func:`load_estimate`); 100 and 0 once ready.
    start_expected_s: float | None = None
    load_progress: float | None = None
    load_eta_s: float | None = None

    @classmethod
    def parse(cls, raw: bytes | str, worker_id: str, **extra: Any) -> Self:
        """The report a heartbeat wrote (its JSON), as ``cls``; ``extra`` sets more fields.

        A report from another version of the worker may lack a field or carry
        one this version does not know: a missing field takes its default (the
        id the registry keys it by; no host, pid or start time, never this
        process's), an unknown one is left out.
        """
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {
            "id": worker_id,
            "model": "",
            "host": "",
            "pid": 0,
            "started_at": 0.0,
        }
        values.update((k, v) for k, v in data.items() if k in known)
        values.update(extra)
        return cls(**values)


@dataclass
class RegisteredWorker(WorkerReport):
    """A worker as the registry lists it: its last report, and whether it still beats."""

    # True once its heartbeat expired: it no longer counts as capacity.
    lost: bool = False
    # Seconds since its last beat, by this host's clock.
    heartbeat_age_s: float = 0.0


def load_estimate(
    started_at: float, expected_s: float | None, now: float | None = None
) -> tuple[float | None, float | None]:
    """A starting worker's progress (0-99 %) and seconds left; (None, None) without a
    previous start to go by. Time-based: the last start of the model took ``expected_s``."""
    if not expected_s or expected_s <= 0:
        return None, None
    elapsed = max(0.0, (time.time() if now is None else now) - started_at)
    return round(min(99.0, 100 * elapsed / expected_s), 1), round(max(0.0, expected_s - elapsed), 1)


def start_time_key(settings: Settings, model: str) -> str:
    return settings.key("start-s", model)


def remember_start_time(
    client: redis.Redis, settings: Settings, model: str, seconds: float
) -> None:
    """Record how long a worker of ``model`` took from process start to ready."""
    client.set(start_time_key(settings, model), f"{seconds:.2f}")


def last_start_time(client: redis.Redis, settings: Settings, model: str) -> float | None:
    """How long the last worker of ``model`` took to start, in seconds (None: never)."""
    raw = client.get(start_time_key(settings, model))
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def worker_key(settings: Settings, worker_id: str) -> str:
    return settings.key("worker", worker_id)


def registry_key(settings: Settings) -> str:
    return settings.key("workers")


class Heartbeat:
    """Publishes a :class:`WorkerReport` every ``heartbeat_interval_s`` from a thread."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        report: WorkerReport,
        sample: Callable[[WorkerReport], None] | None = None,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.report = report
        self.sample = sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def set_state(self, state: WorkerState, error: str | None = None) -> None:
        self.report.state = state
        self.report.error = error
        self.beat()

    def beat(self) -> None:
        if self.sample is not None:
            self.sample(self.report)
        self.report.updated_at = time.time()
        payload = json.dumps(asdict(self.report))
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(
            worker_key(self.settings, self.report.id),
            payload,
            px=int(self.settings.heartbeat_ttl_s * 1000),
        )
        pipe.hset(registry_key(self.settings), self.report.id, payload)
        pipe.execute()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:  # Redis away: keep trying, the TTL decides.
                log.warning("heartbeat failed: %s", exc)

    def stop(self, *, forget: bool = True) -> None:
        """Stop beating; ``forget`` removes this worker from Redis at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if forget:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.delete(worker_key(self.settings, self.report.id))
                pipe.hdel(registry_key(self.settings), self.report.id)
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("could not remove heartbeat: %s", exc)


def list_workers(client: redis.Redis, settings: Settings) -> list[RegisteredWorker]:
    """Every worker in the registry, sorted by id: its last report, ``lost`` and
    ``heartbeat_age_s`` (:class:`RegisteredWorker`)."""
    registry = client.hgetall(registry_key(settings))
    if not registry:
        return []
    ids = sorted(k.decode() if isinstance(k, bytes) else k for k in registry)
    live = client.mget([worker_key(settings, i) for i in ids])
    now = time.time()
    workers = []
    for worker_id, current in zip(ids, live, strict=True):
        raw = current if current is not None else registry[worker_id.encode()]
        worker = RegisteredWorker.parse(raw, worker_id, lost=current is None)
        worker.heartbeat_age_s = round(max(0.0, now - float(worker.updated_at or 0)), 3)
        workers.append(worker)
    return workers


@dataclass
class Tally:
    """Live workers per model: how many are ready and starting, and their tokens/s."""

    ready: Counter[str] = field(default_factory=Counter)
    starting: Counter[str] = field(default_factory=Counter)
    tokens_per_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, workers: list[RegisteredWorker]) -> Tally:
        """The tally of :func:`list_workers`' reports (lost ones left out)."""
        tally = cls()
        for w in workers:
            if w.lost:
                continue
            rate = float(w.tokens_per_s or 0.0)
            tally.tokens_per_s[w.model] = tally.tokens_per_s.get(w.model, 0.0) + rate
            if w.state == "ready":
                tally.ready[w.model] += 1
            elif w.state == "starting":
                tally.starting[w.model] += 1
        return tally


def live_worker_ids(client: redis.Redis, settings: Settings, ids: list[str]) -> set[str]:
    """The ids among ``ids`` whose heartbeat has not expired."""
    if not ids:
        return set()
    values = client.mget([worker_key(settings, i) for i in ids])
    return {i for i, v in zip(ids, values, strict=True) if v is not None}


def live_reports(
    client: redis.Redis, settings: Settings, ids: list[str]
) -> dict[str, WorkerReport]:
    """The current report of each worker among ``ids`` whose heartbeat has not expired."""
    if not ids:
        return {}
    values = client.mget([worker_key(settings, i) for i in ids])
    return {i: WorkerReport.parse(v, i) for i, v in zip(ids, values, strict=True) if v is not None}


def last_beats(client: redis.Redis, settings: Settings) -> dict[str, float]:
    """Worker id → time of its last registered beat (epoch seconds), lost ones included."""
    beats = {}
    for key, raw in client.hgetall(registry_key(settings)).items():
        worker_id = key.decode() if isinstance(key, bytes) else str(key)
        try:
            beats[worker_id] = float(json.loads(raw).get("updated_at", 0))
        except (ValueError, AttributeError):
            beats[worker_id] = 0.0
    return beats


def prune_lost(client: redis.Redis, settings: Settings, older_than_s: float) -> list[str]:
    """Forget lost workers whose last beat is older than ``older_than_s``; their ids."""
    beats = last_beats(client, settings)
    ids = sorted(beats)
    live = live_worker_ids(client, settings, ids)
    cutoff = time.time() - older_than_s
    stale = [i for i in ids if i not in live and beats[i] < cutoff]
    if stale:
        client.hdel(registry_key(settings), *stale)
    return stale

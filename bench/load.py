"""The load program of the reliability suite: a burst of jobs, many streams, a soak.

``python -m bench.load [--phase burst|streams|soak|all]`` (``make load``) starts
its own farm on loopback — the API under gunicorn (one process, like one API
host) and two tiny random-weight models, ``tiny-load-a`` and ``tiny-load-b``,
with ``--workers-per-model`` worker processes each — and runs:

burst
    ``--jobs`` jobs posted to ``POST /v1/jobs`` from ``--clients`` threads,
    alternating between the two models, then waits until all are final. Checks:
    exactly N rows for the run's user, every one ``succeeded`` with
    ``attempts == 1``, and every job's Redis stream (read as the job ends,
    before its TTL) holds seq 0..k once each with exactly one ``done``.
streams
    ``--subscribers`` concurrent websockets, then as many SSE clients, each
    receiving one job's full stream (``--fanout`` subscribers per job). The
    workers stop consuming (Celery's ``cancel_consumer``) while the jobs are
    submitted and every subscriber connects and receives its ``queued`` frame,
    so all of them are open at once; then consuming resumes and every stream
    runs to ``done``. Checks: each subscriber saw seq 0, 1, … without a gap or a
    double, ending with ``done``.
soak
    ``--soak-clients`` threads loop submit + stream (ws and SSE in turn) for
    ``--soak-s`` seconds while a sampler records, every ``--sample-s``: resident
    memory, threads, open files and TCP connections of the API and of each
    worker; Redis ``used_memory``, its clients on our database, the number and
    bytes of our keys. After the load it waits out the stream TTL
    (``--stream-ttl-s``) and checks that the streams expired and our Redis
    memory returned to the baseline taken before the load.

It prints tables and exits 1 when a correctness check fails (growth thresholds
are printed with the figures). Services: ``--database-url``/``--redis-url``,
else ``DATABASE_URL``/``REDIS_URL``, else the test services
(``SY_TEST_DATABASE_URL``/``SY_TEST_REDIS_URL``). Like ``bench.farm`` it drops
and flushes nothing: migrations are applied, a fresh admin user is added, and
every Redis key, the Celery queues ``<prefix>:gen.tiny-load-*`` among them, is
under a fresh prefix.
Bounded: every request, connect and wait has a timeout; loopback only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil
import redis
import requests
import websocket

from bench.farm import (
    API_READY_TIMEOUT_S,
    Child,
    MiB,
    PeakMemory,
    admin_token,
    child_env,
    farm_settings,
    percentile,
    raise_open_files_limit,
    rss,
    sse_messages,
    start_api,
    wait_http,
    wait_worker_ready,
)
from config import Settings, load_settings
from config.settings import PROJECT_ROOT

MODELS = ("tiny-load-a", "tiny-load-b")
TEST_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
TEST_REDIS_URL = "redis://127.0.0.1:6379/15"

HTTP_TIMEOUT_S = 60.0  # one POST or GET
STREAM_TIMEOUT_S = 300.0  # silence on one stream before its client gives up
OPEN_TIMEOUT_S = 300.0  # every subscriber of a streams phase connected
FINAL_TIMEOUT_S = 1800.0  # every job of a burst final
CONTROL_TIMEOUT_S = 5.0  # replies to a Celery control command
OPENING_CONCURRENCY = 64  # subscribers connecting at the same moment
POLL_S = 0.5
STREAM_SETTLE_S = 10.0  # a final job's stream may lack its `done` this long
CLIENT_THREAD_STACK = 512 * 1024

# Soak growth thresholds (generous: they catch leaks, not noise).
RSS_GROWTH_MAX = (16 * MiB, 0.10)  # second half of the load: at most max(16 MiB, 10 %)
# A count at the end of the load may exceed the first half's highest by this
# much, plus PER_CLIENT_SLACK for each soak client (whose stream holds a
# socket, and on a websocket a reader thread, at the moment of the sample).
COUNT_SLACK = {"threads": 4, "fds": 16, "tcp": 8, "redis_clients": 4}
PER_CLIENT_SLACK = {"threads": 2, "fds": 3, "tcp": 3, "redis_clients": 0}
REDIS_KEYS_SLACK = 64 * 1024  # our keys' bytes after the streams expired, over baseline
REDIS_USED_SLACK = 32 * MiB  # server-wide used_memory (shared server: only clear growth)
EXPIRY_MARGIN_S = 15.0  # waited past the stream TTL for Redis to drop the keys

FINAL_STATES = ("succeeded", "failed", "cancelled")


# -- checks and report ------------------------------------------------------------


@dataclass
class Check:
    """One correctness check of a phase."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class PhaseResult:
    """A phase's checks, its printed table and its numbers (for ``--json``)."""

    name: str
    checks: list[Check] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        self.checks.append(Check(name, passed, detail))

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
    }


def dist_row(label: str, values: Sequence[float]) -> str:
    d = _dist(values)
    return f"  {label:<34} {d['n']:>6} {_ms(d['p50']):>9} {_ms(d['p99']):>9} {_ms(d['max']):>9}"


DIST_HEAD = f"  {'latency (ms)':<34} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9}"


# -- the farm -----------------------------------------------------------------------


def load_models_dir(into: Path) -> Path:
    """The real catalog plus the two load models (copies of ``tiny-random``)."""
    source = PROJECT_ROOT / "config" / "models"
    for path in source.glob("*.yaml"):  # tiny-random takes smollm2's tokenizer
        shutil.copy(path, into / path.name)
    tiny = (source / "tiny-random.yaml").read_text()
    for name in MODELS:
        (into / f"{name}.yaml").write_text(tiny.replace("name: tiny-random", f"name: {name}"))
    return into


class LoadFarm:
    """The API (one gunicorn process) and ``per_model`` workers for each load model."""

    def __init__(
        self,
        settings: Settings,
        env: dict[str, str],
        api_threads: int,
        per_model: int,
        log_dir: Path,
    ) -> None:
        self.settings = settings
        self.env = env
        self.api_threads = api_threads
        self.per_model = per_model
        self.log_dir = log_dir
        self.base = f"http://127.0.0.1:{settings.api_port}"
        self.token = admin_token(settings)
        self.api: Child | None = None
        self.workers: dict[str, list[Child]] = {m: [] for m in MODELS}
        self.redis = redis.Redis.from_url(settings.redis_url)
        # Keys under the prefix before the run (a shared prefix, as in the
        # tests): not ours, left out of every count.
        self.preexisting = frozenset(
            self.redis.scan_iter(match=f"{settings.redis_prefix}:*", count=1000)
        )

    def start(self) -> None:
        self.clear_leftovers()
        self.api = start_api(self.env, self.api_threads, self.log_dir)
        for model in MODELS:
            for i in range(self.per_model):
                argv = [sys.executable, "-m", "cli", "worker", "--model", model]
                self.workers[model].append(
                    Child(f"worker-{model}-{i}", argv, self.env, self.log_dir)
                )
        wait_http(self.base + "/healthz", self.api, API_READY_TIMEOUT_S)
        for model, children in self.workers.items():
            for child in children:
                wait_worker_ready(self.settings, model, child)

    def clear_leftovers(self) -> None:
        """Cancel what an earlier run left queued for the bench's models; drop its messages.

        A capacity run's submit phase queues thousands of jobs no worker takes;
        an interrupted run leaves more. Left there, they would fill the queue's
        limit, and the reaper would send their messages again to this run's
        queues (a run under an earlier run's prefix finds its messages too).
        """
        from sqlalchemy import update

        from db.schema import Job, JobStatus, utcnow
        from db.session import Database
        from jobs.messages import queue_keys

        db = Database(self.settings.database_url)
        try:
            with db.session() as s:
                s.execute(
                    update(Job)
                    .where(Job.model.in_(MODELS), Job.status == JobStatus.queued.value)
                    .values(status=JobStatus.cancelled.value, finished_at=utcnow())
                )
        finally:
            db.dispose()
        self.redis.delete(*(key for model in MODELS for key in queue_keys(self.settings, model)))

    def stop(self) -> None:
        for children in self.workers.values():
            for child in children:
                child.stop()
        if self.api is not None:
            self.api.stop()
        self.redis.close()

    @property
    def api_pid(self) -> int:
        assert self.api is not None
        return self.api.pid

    def all_workers(self) -> list[tuple[str, Child]]:
        return [(f"{m}#{i}", c) for m, cs in self.workers.items() for i, c in enumerate(cs)]

    def consuming(self, on: bool) -> None:
        """Make every worker stop (``on=False``) or resume taking jobs from its queue.

        Celery's own remote control (``cancel_consumer``/``add_consumer``); the
        workers stay up, their heartbeats go on, queued jobs wait in the queue.
        """
        from jobs.queues import queue_name
        from tasks.celery import configure

        app = configure(self.settings)
        host = socket.gethostname()
        for model, children in self.workers.items():
            names = [f"{model}@{host}-{c.pid}" for c in children]
            if on:
                replies = app.control.add_consumer(
                    queue_name(model), destination=names, reply=True, timeout=CONTROL_TIMEOUT_S
                )
            else:
                replies = app.control.cancel_consumer(
                    queue_name(model), destination=names, reply=True, timeout=CONTROL_TIMEOUT_S
                )
            if len(replies or []) != len(names):
                raise RuntimeError(f"{model}: {len(replies or [])} of {len(names)} workers replied")


# -- clients ------------------------------------------------------------------------


def submit(
    session: requests.Session, farm: LoadFarm, model: str, max_new_tokens: int, prompt: str
) -> tuple[str | None, float, str | None]:
    """POST one job: (job id or None, seconds the POST took, error)."""
    started = time.perf_counter()
    try:
        r = session.post(
            f"{farm.base}/v1/jobs",
            json={
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            },
            headers={"Authorization": f"Bearer {farm.token}"},
            timeout=HTTP_TIMEOUT_S,
        )
    except requests.RequestException as exc:
        return None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - started
    if r.status_code != 202:
        return None, seconds, f"{r.status_code} {r.text[:200]}"
    return str(r.json()["id"]), seconds, None


@dataclass
class StreamRecord:
    """What one subscriber received; times are ``time.perf_counter()`` seconds."""

    job_id: str
    kind: str  # "ws" or "sse"
    connect_started: float = 0.0
    first_frame_at: float | None = None
    started_at: float | None = None  # the `started` frame
    first_token_at: float | None = None
    done_at: float | None = None
    seqs: list[int] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    error: str | None = None

    def take(self, event: dict[str, Any]) -> bool:
        """Record one frame; True when it was the last one (``done`` or ``error``)."""
        now = time.perf_counter()
        if self.first_frame_at is None:
            self.first_frame_at = now
        self.seqs.append(int(event["seq"]))
        self.types.append(str(event["type"]))
        if event["type"] == "started" and self.started_at is None:
            self.started_at = now
        elif event["type"] == "token" and self.first_token_at is None:
            self.first_token_at = now
        elif event["type"] == "done":
            self.done_at = now
        return event["type"] in ("done", "error")

    def problem(self) -> str | None:
        """Why this stream is not one full stream (seq 0…k once each, ending in done)."""
        if self.error is not None:
            return self.error
        if not self.seqs:
            return "no frames"
        if self.seqs != list(range(self.seqs[0], self.seqs[0] + len(self.seqs))):
            return f"seqs not contiguous: {self.seqs[:40]}"
        if self.seqs[0] != 0:
            return f"first seq {self.seqs[0]}, not 0"
        if self.types[-1] != "done" or self.types.count("done") != 1:
            return f"does not end with one done: {self.types[-3:]}"
        return None


def read_stream(
    farm: LoadFarm, record: StreamRecord, on_first: Callable[[], None] | None = None
) -> None:
    """Follow ``record.job_id``'s websocket or SSE stream to its end into ``record``.

    ``on_first`` is called once the first frame arrived (or the stream failed
    before one did), so a caller can count open subscribers.
    """
    notified = False

    def first() -> None:
        nonlocal notified
        if not notified and on_first is not None:
            notified = True
            on_first()

    record.connect_started = time.perf_counter()
    headers = {"Authorization": f"Bearer {farm.token}"}
    try:
        if record.kind == "ws":
            url = farm.base.replace("http", "ws", 1) + f"/v1/jobs/{record.job_id}/ws"
            ws = websocket.create_connection(
                url, header=[f"{k}: {v}" for k, v in headers.items()], timeout=STREAM_TIMEOUT_S
            )
            try:
                while True:
                    raw = ws.recv()
                    if not raw:
                        break
                    last = record.take(json.loads(raw))
                    first()
                    if last:
                        break
            except websocket.WebSocketConnectionClosedException:
                pass
            finally:
                ws.close()
        else:
            with requests.get(
                f"{farm.base}/v1/jobs/{record.job_id}/events",
                headers={**headers, "Accept": "text/event-stream"},
                stream=True,
                timeout=STREAM_TIMEOUT_S,
            ) as r:
                r.raise_for_status()
                for message in sse_messages(r):
                    last = record.take(json.loads(message["data"]))
                    first()
                    if last:
                        break
        if record.done_at is None and record.error is None:
            record.error = f"the stream ended after {record.types[-3:]}"
    except Exception as exc:  # recorded as this subscriber's failure; the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        first()


# -- measuring processes and Redis --------------------------------------------------


@dataclass
class ProcStats:
    """A process tree's resident bytes, threads, open files and TCP connections."""

    rss: int
    threads: int
    fds: int
    tcp: int


def proc_stats(pid: int) -> ProcStats:
    root = psutil.Process(pid)
    total = ProcStats(0, 0, 0, 0)
    for proc in [root, *root.children(recursive=True)]:
        with suppress(psutil.NoSuchProcess):
            with proc.oneshot():
                total.rss += proc.memory_info().rss
                total.threads += proc.num_threads()
                total.fds += proc.num_fds()
            total.tcp += len(proc.net_connections(kind="tcp"))
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants."""
    root = psutil.Process(pid)
    seconds = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            seconds += t.user + t.system
    return seconds


def redis_db(url: str) -> int:
    path = url.rsplit("/", 1)[-1].split("?")[0]
    return int(path) if path.isdigit() else 0


@dataclass
class RedisStats:
    used_memory: int  # server-wide
    db_clients: int  # clients on our database (CLIENT LIST db=…)
    stream_keys: int  # our jobs' event streams
    our_keys: int  # every key under our prefix, Celery's queues among them
    our_bytes: int  # MEMORY USAGE of those


def redis_stats(
    client: redis.Redis, settings: Settings, ignore: frozenset[bytes] = frozenset()
) -> RedisStats:
    """Redis memory and our keys (those under the prefix, less ``ignore``)."""
    db = redis_db(settings.redis_url)
    used = int(client.info("memory")["used_memory"])
    clients = client.client_list()
    db_clients = sum(1 for c in clients if int(c.get("db", -1)) == db)
    keys = [
        k
        for k in client.scan_iter(match=f"{settings.redis_prefix}:*", count=1000)
        if k not in ignore
    ]
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k)
    sizes = pipe.execute() if keys else []
    stream_prefix = settings.key("job", "").encode()
    return RedisStats(
        used_memory=used,
        db_clients=db_clients,
        stream_keys=sum(1 for k in keys if k.startswith(stream_prefix)),
        our_keys=len(keys),
        our_bytes=sum(int(s or 0) for s in sizes),
    )


def wait_streams_expired(farm: LoadFarm, timeout: float) -> RedisStats:
    """Wait until none of our job streams is left in Redis (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    stats = redis_stats(farm.redis, farm.settings, farm.preexisting)
    while stats.stream_keys and time.monotonic() < deadline:
        time.sleep(1.0)
        stats = redis_stats(farm.redis, farm.settings, farm.preexisting)
    return stats


# -- burst ----------------------------------------------------------------------------


def _raw_stream_problem(client: redis.Redis, key: str) -> str | None:
    """A stored stream's fault: seqs not 0..k once each, or not exactly one done."""
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(key))
    if not entries:
        return "stream missing (expired or never written)"
    events = [json.loads(fields[b"e"]) for _id, fields in entries]
    seqs = [int(e["seq"]) for e in events]
    if seqs != list(range(len(seqs))):
        return f"seqs {seqs[:40]}"
    done = sum(1 for e in events if e["type"] == "done")
    if done != 1 or events[-1]["type"] != "done":
        return f"{done} done events, last {events[-1]['type']}"
    return None


def burst_phase(farm: LoadFarm, args: argparse.Namespace) -> PhaseResult:
    from sqlalchemy import func, select

    from db.schema import Job
    from db.session import Database

    result = PhaseResult("burst")
    n = args.jobs
    local = threading.local()
    posts: list[tuple[str | None, str, float, float, str | None]] = []
    lock = threading.Lock()

    def post(i: int) -> None:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
        model = MODELS[i % len(MODELS)]
        started = time.perf_counter()
        job_id, seconds, error = submit(session, farm, model, args.max_new_tokens, f"burst {i}")
        with lock:
            posts.append((job_id, model, started, seconds, error))

    print(f"burst: posting {n} jobs from {args.clients} client threads…", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(post, range(n)))
    submit_s = time.perf_counter() - t0
    accepted = [p for p in posts if p[0] is not None]
    errors = [p[4] for p in posts if p[4] is not None]
    ids = [str(p[0]) for p in accepted]
    result.check(
        "every POST accepted (202)", not errors, f"{len(errors)} refused, e.g. {errors[:1]}"
    )

    # Wait for every job to be final, reading each one's stream as it ends
    # (before the stream's TTL runs out).
    db = Database(farm.settings.database_url)
    stream_problems: dict[str, str] = {}
    final: dict[str, str] = {}
    deadline = time.monotonic() + FINAL_TIMEOUT_S
    # A worker records the outcome in the database, then writes `done`: a
    # stream without it is read again for up to STREAM_SETTLE_S.
    unsettled: dict[str, float] = {}
    total_s = float("nan")
    try:
        while (len(final) < len(ids) or unsettled) and time.monotonic() < deadline:
            pending = [i for i in ids if i not in final]
            with db.session() as s:
                rows = s.execute(
                    select(Job.id, Job.status).where(
                        Job.id.in_(pending), Job.status.in_(FINAL_STATES)
                    )
                ).all()
            now = time.monotonic()
            for job_id, status in rows:
                final[job_id] = status
                unsettled[job_id] = now
            if len(final) == len(ids) and total_s != total_s:
                total_s = time.perf_counter() - t0
            for job_id, seen in list(unsettled.items()):
                problem = _raw_stream_problem(farm.redis, farm.settings.key("job", job_id))
                if problem is None or now - seen > STREAM_SETTLE_S:
                    del unsettled[job_id]
                    if problem is not None:
                        stream_problems[job_id] = problem
            if len(final) < len(ids) or unsettled:
                time.sleep(POLL_S)
        if total_s != total_s:
            total_s = time.perf_counter() - t0
        with db.session() as s:
            jobs = s.execute(
                select(
                    Job.id,
                    Job.model,
                    Job.status,
                    Job.attempts,
                    Job.worker,
                    Job.user_id,
                    Job.created_at,
                    Job.started_at,
                    Job.finished_at,
                ).where(Job.id.in_(ids))
            ).all()
            user_ids = {j.user_id for j in jobs}
            user_rows = s.execute(
                select(func.count()).select_from(Job).where(Job.user_id.in_(user_ids))
            ).scalar_one()
    finally:
        db.dispose()

    statuses = Counter(j.status for j in jobs)
    attempts = Counter(j.attempts for j in jobs)
    result.check(
        f"exactly {n} rows for the run's user", user_rows == n == len(jobs), f"{user_rows}"
    )
    result.check(
        "every job final in time", len(final) == len(ids), f"{len(ids) - len(final)} not final"
    )
    result.check("every job succeeded", statuses == Counter({"succeeded": n}), f"{dict(statuses)}")
    result.check("attempts == 1 for every job", attempts == Counter({1: n}), f"{dict(attempts)}")
    result.check(
        "every stream: seq 0..k once, exactly one done",
        not stream_problems and len(final) == len(ids),
        "; ".join(f"{k[:8]}: {v}" for k, v in list(stream_problems.items())[:3]),
    )

    submit_lat = [p[3] for p in accepted]
    queue_wait = [
        (j.started_at - j.created_at).total_seconds() for j in jobs if j.started_at is not None
    ]
    first_post = min(p[2] for p in posts)
    last_accept = max(p[2] + p[3] for p in accepted) if accepted else first_post
    rate = len(accepted) / (last_accept - first_post) if accepted else 0.0
    finished = [j.finished_at for j in jobs if j.finished_at is not None]
    db_span = (max(finished) - min(j.created_at for j in jobs)).total_seconds() if finished else 0
    result.numbers = {
        "jobs": n,
        "accepted": len(accepted),
        "accepted_per_s": rate,
        "submit_s": submit_s,
        "total_s": total_s,
        "db_span_s": db_span,
        "submit_latency": _dist(submit_lat),
        "queue_wait": _dist(queue_wait),
        "statuses": dict(statuses),
        "stream_problems": len(stream_problems),
    }
    lines = [
        f"burst: {n} jobs, {args.max_new_tokens} new tokens, temperature 0, "
        f"{args.clients} client threads, {len(MODELS)} models × {farm.per_model} workers",
        f"  accepted {len(accepted)}/{n} in {submit_s:.2f} s = {rate:.1f} submissions/s; "
        f"all final after {total_s:.2f} s (first row created → last finished: {db_span:.2f} s)",
        DIST_HEAD,
        dist_row("submit (POST round trip)", submit_lat),
        dist_row("queue wait (started − queued)", queue_wait),
        f"  {'model':<14} {'worker':<40} {'jobs':>6}",
    ]
    split = Counter((j.model, j.worker or "-") for j in jobs)
    for (model, worker), count in sorted(split.items()):
        lines.append(f"  {model:<14} {worker[:40]:<40} {count:>6}")
    result.numbers["split"] = {f"{m} {w}": c for (m, w), c in split.items()}
    result.lines = lines
    return result


# -- streams ----------------------------------------------------------------------------


def streams_phase(farm: LoadFarm, args: argparse.Namespace, kind: str) -> PhaseResult:
    result = PhaseResult(f"streams/{kind}")
    count = args.subscribers
    n_jobs = math.ceil(count / args.fanout)
    print(f"streams/{kind}: {count} subscribers on {n_jobs} jobs…", flush=True)
    farm.consuming(False)
    released = False
    try:
        with ThreadPoolExecutor(16) as pool:
            submitted = list(
                pool.map(
                    lambda i: submit(
                        requests.Session(),
                        farm,
                        MODELS[i % len(MODELS)],
                        args.stream_tokens,
                        f"stream {kind} {i}",
                    ),
                    range(n_jobs),
                )
            )
        refused = [e for _, _, e in submitted if e is not None]
        if refused:
            result.check("every POST accepted (202)", False, refused[0] or "")
            return result
        job_ids = [str(j) for j, _, _ in submitted]
        records = [StreamRecord(job_ids[i % n_jobs], kind) for i in range(count)]
        gate = threading.BoundedSemaphore(OPENING_CONCURRENCY)
        opened = threading.Semaphore(0)

        def opened_one() -> None:
            gate.release()
            opened.release()

        def run(record: StreamRecord) -> None:
            gate.acquire()
            read_stream(farm, record, on_first=opened_one)

        rss_idle = rss(farm.api_pid)
        cpu_before = cpu_seconds(farm.api_pid)
        peak = PeakMemory(farm.api_pid)
        threading.stack_size(CLIENT_THREAD_STACK)
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in records]
        threading.stack_size(0)
        with peak.sampling():
            t_open = time.perf_counter()
            for t in threads:
                t.start()
            deadline = time.monotonic() + OPEN_TIMEOUT_S
            got = 0
            while got < count and opened.acquire(timeout=max(0.0, deadline - time.monotonic())):
                got += 1
            open_s = time.perf_counter() - t_open
            failed_open = sum(1 for r in records if r.first_frame_at is None)
            time.sleep(1.0)
            stats_open = proc_stats(farm.api_pid)
            released = True
            t_release = time.perf_counter()
            farm.consuming(True)
            for t in threads:
                t.join(timeout=STREAM_TIMEOUT_S)
            all_done_s = time.perf_counter() - t_release
        cpu_used = cpu_seconds(farm.api_pid) - cpu_before
        rss_after = rss(farm.api_pid)
    finally:
        if not released:
            farm.consuming(True)

    hung = sum(1 for t in threads if t.is_alive())
    problems = [(r.job_id, p) for r in records if (p := r.problem()) is not None]
    result.check(
        f"all {count} subscribers open at once (got their queued frame)",
        failed_open == 0,
        f"{failed_open} failed before it, e.g. "
        + next((str(r.error) for r in records if r.first_frame_at is None), ""),
    )
    result.check("no subscriber still running at the deadline", hung == 0, f"{hung}")
    result.check(
        "every subscriber: seq 0..k once each, ends with done",
        not problems,
        f"{len(problems)} bad, e.g. {problems[:2]}",
    )
    subscribe = [r.first_frame_at - r.connect_started for r in records if r.first_frame_at]
    ttft = [r.first_token_at - r.started_at for r in records if r.first_token_at and r.started_at]
    release_ttft = [r.first_token_at - t_release for r in records if r.first_token_at]
    by_job: dict[str, list[float]] = {}
    for r in records:
        if r.done_at is not None:
            by_job.setdefault(r.job_id, []).append(r.done_at)
    skew = [max(v) - min(v) for v in by_job.values() if len(v) > 1]
    frames = sum(len(r.seqs) for r in records)
    result.numbers = {
        "subscribers": count,
        "jobs": n_jobs,
        "frames": frames,
        "open_s": open_s,
        "all_done_s": all_done_s,
        "api_threads": farm.api_threads,
        "api_rss_idle": rss_idle,
        "api_rss_open": stats_open.rss,
        "api_rss_peak": peak.peak,
        "api_rss_after": rss_after,
        "api_cpu_s": cpu_used,
        "api_threads_open": stats_open.threads,
        "api_fds_open": stats_open.fds,
        "subscribe": _dist(subscribe),
        "ttft_from_started": _dist(ttft),
        "ttft_from_release": _dist(release_ttft),
        "done_skew": _dist(skew),
        "bad": len(problems),
    }
    result.lines = [
        f"streams/{kind}: {count} concurrent subscribers, {args.fanout} per job × {n_jobs} jobs "
        f"of {args.stream_tokens} new tokens; API: 1 gunicorn worker, "
        f"SWITCHYARD_API_THREADS={farm.api_threads}",
        f"  opened all in {open_s:.2f} s ({OPENING_CONCURRENCY} connecting at a time); "
        f"all done {all_done_s:.2f} s after release; {frames} frames, {len(problems)} bad streams",
        f"  API RSS (master+worker): idle {rss_idle / MiB:.0f} MiB → {stats_open.rss / MiB:.0f} "
        f"MiB with all open → peak {peak.peak / MiB:.0f} MiB → {rss_after / MiB:.0f} MiB after; "
        f"{(stats_open.rss - rss_idle) / max(1, count) / 1024:.0f} KiB per subscriber",
        f"  API CPU: {cpu_used:.1f} s user+system over the phase "
        f"({cpu_used / max(1, frames) * 1e6:.0f} µs per frame delivered); "
        f"threads {stats_open.threads}, open files {stats_open.fds} with all open",
        DIST_HEAD,
        dist_row("connect → queued frame", subscribe),
        dist_row("TTFT: started frame → first token", ttft),
        dist_row("TTFT: release → first token", release_ttft),
        dist_row("done skew across a job's subscribers", skew),
    ]
    return result


# -- soak -----------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    api: ProcStats
    workers: dict[str, ProcStats]
    redis: RedisStats


def take_sample(farm: LoadFarm, t0: float) -> Sample:
    return Sample(
        t=time.perf_counter() - t0,
        api=proc_stats(farm.api_pid),
        workers={name: proc_stats(c.pid) for name, c in farm.all_workers()},
        redis=redis_stats(farm.redis, farm.settings, farm.preexisting),
    )


def _series(samples: Sequence[Sample]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in samples:
        rows = {"api": s.api, **{f"w {k}": v for k, v in s.workers.items()}}
        for who, p in rows.items():
            for metric in ("rss", "threads", "fds", "tcp"):
                out.setdefault(f"{who} {metric}", []).append(float(getattr(p, metric)))
        out.setdefault("redis used_memory", []).append(float(s.redis.used_memory))
        out.setdefault("redis clients (our db)", []).append(float(s.redis.db_clients))
        out.setdefault("redis stream keys", []).append(float(s.redis.stream_keys))
        out.setdefault("redis our bytes", []).append(float(s.redis.our_bytes))
    return out


def soak_phase(farm: LoadFarm, args: argparse.Namespace) -> PhaseResult:
    result = PhaseResult("soak")
    ttl = args.stream_ttl_s
    print(f"soak: waiting for earlier streams to expire (TTL {ttl} s)…", flush=True)
    baseline = wait_streams_expired(farm, ttl + EXPIRY_MARGIN_S + 30)
    print(
        f"soak: {args.soak_clients} clients for {args.soak_s:.0f} s, a sample every "
        f"{args.sample_s:.0f} s…",
        flush=True,
    )
    stop = threading.Event()
    counts: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        session = requests.Session()
        i = 0
        while not stop.is_set():
            model = MODELS[(k + i) % len(MODELS)]
            kind = ("ws", "sse")[(k + i) % 2]
            job_id, _, error = submit(session, farm, model, args.max_new_tokens, f"soak {k} {i}")
            if job_id is None:
                problem: str | None = f"POST: {error}"
            else:
                record = StreamRecord(job_id, kind)
                read_stream(farm, record)
                problem = record.problem()
            with lock:
                counts["jobs"] += 1
                if problem is not None:
                    counts["bad"] += 1
                    failures.append(problem)
            i += 1

    t0 = time.perf_counter()
    samples = [take_sample(farm, t0)]
    threads = [
        threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.soak_clients)
    ]
    for t in threads:
        t.start()
    while time.perf_counter() - t0 < args.soak_s:
        time.sleep(min(args.sample_s, max(0.0, args.soak_s - (time.perf_counter() - t0))))
        samples.append(take_sample(farm, t0))
    stop.set()
    for t in threads:
        t.join(timeout=STREAM_TIMEOUT_S)
    load_s = time.perf_counter() - t0
    print(f"soak: load stopped; waiting out the stream TTL ({ttl} s)…", flush=True)
    after = wait_streams_expired(farm, ttl + EXPIRY_MARGIN_S + 30)
    time.sleep(1.0)
    end_idle = take_sample(farm, t0)
    after = end_idle.redis

    result.check(
        "every soak job: one full stream ending in done",
        counts["bad"] == 0 and counts["jobs"] > 0,
        f"{counts['bad']} bad of {counts['jobs']}, e.g. {failures[:2]}",
    )
    result.check(
        "streams expired after the TTL", after.stream_keys == 0, f"{after.stream_keys} left"
    )
    keys_growth = after.our_bytes - baseline.our_bytes
    result.check(
        f"our Redis keys back to baseline (+{REDIS_KEYS_SLACK // 1024} KiB)",
        keys_growth <= REDIS_KEYS_SLACK,
        f"{baseline.our_bytes} → {after.our_bytes} bytes",
    )
    used_growth = after.used_memory - baseline.used_memory
    result.check(
        f"Redis used_memory back to baseline (+{REDIS_USED_SLACK // MiB} MiB, shared server)",
        used_growth <= REDIS_USED_SLACK,
        f"{baseline.used_memory} → {after.used_memory}",
    )

    series = _series(samples)
    half = max(1, len(samples) // 2)
    table = [
        f"  {'series':<32} {'start':>10} {'half':>10} {'end':>10} {'max':>10} "
        f"{'idle after':>10}  verdict",
    ]
    idle_series = _series([end_idle])
    for name, values in series.items():
        metric = name.rsplit(" ", 1)[-1]
        start, mid, end, top = values[0], values[half], values[-1], max(values)
        idle = idle_series[name][0]
        verdict = ""
        if metric == "rss":
            allowed = max(RSS_GROWTH_MAX[0], RSS_GROWTH_MAX[1] * mid)
            grew = end - mid
            ok = grew <= allowed
            verdict = f"{'ok' if ok else 'GROWS'} (+{grew / MiB:.1f} MiB ≤ {allowed / MiB:.0f})"
            result.check(f"{name} flat in the second half", ok, verdict)
            fmt: Callable[[float], str] = lambda v: f"{v / MiB:.1f}M"  # noqa: E731
        elif metric in ("threads", "fds", "tcp") or name == "redis clients (our db)":
            kind = metric if metric in COUNT_SLACK else "redis_clients"
            slack = COUNT_SLACK[kind] + PER_CLIENT_SLACK[kind] * args.soak_clients
            first_max = max(values[:half])
            # Judged once the load stopped: a leak stays, while a stream that
            # happened to be open at a sample does not, and gthread's pool keeps
            # the threads it grew lazily up to the load's concurrency.
            ok = idle <= first_max + slack
            verdict = (
                f"{'ok' if ok else 'GROWS'} (idle after ≤ first-half max {first_max:.0f} + {slack})"
            )
            result.check(f"{name} no growth", ok, verdict)
            fmt = lambda v: f"{v:.0f}"  # noqa: E731
        elif name in ("redis used_memory", "redis our bytes"):
            fmt = lambda v: f"{v / 1024:.0f}K"  # noqa: E731
        else:
            fmt = lambda v: f"{v:.0f}"  # noqa: E731
        table.append(
            f"  {name[:32]:<32} {fmt(start):>10} {fmt(mid):>10} {fmt(end):>10} {fmt(top):>10} "
            f"{fmt(idle):>10}  {verdict}"
        )
    rate = counts["jobs"] / load_s if load_s else 0.0
    result.numbers = {
        "soak_s": args.soak_s,
        "clients": args.soak_clients,
        "jobs": counts["jobs"],
        "bad": counts["bad"],
        "jobs_per_s": rate,
        "samples": len(samples),
        "stream_ttl_s": ttl,
        "baseline": asdict(baseline),
        "after": asdict(after),
        "series": series,
    }
    result.lines = [
        f"soak: {args.soak_clients} clients × (submit + ws/SSE stream) for {load_s:.0f} s: "
        f"{counts['jobs']} jobs ({rate:.1f}/s), {counts['bad']} bad; "
        f"{len(samples)} samples every {args.sample_s:.0f} s; stream TTL {ttl} s",
        f"  Redis baseline (no streams): used_memory {baseline.used_memory / 1024:.0f} KiB, our "
        f"keys {baseline.our_keys} / {baseline.our_bytes} B → after TTL: used_memory "
        f"{after.used_memory / 1024:.0f} KiB ({used_growth / 1024:+.0f} KiB), our keys "
        f"{after.our_keys} / {after.our_bytes} B, stream keys {after.stream_keys}",
        "  ('half' is the first sample of the second half, the growth baseline; 'idle after' "
        "is taken once the streams expired)",
        *table,
    ]
    return result


# -- main -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--phase", choices=("burst", "streams", "soak", "all"), default="all")
    parser.add_argument("--jobs", type=int, default=1000, help="burst jobs")
    parser.add_argument("--clients", type=int, default=32, help="burst client threads")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="burst and soak jobs")
    parser.add_argument("--subscribers", type=int, default=1000, help="per streams run")
    parser.add_argument("--fanout", type=int, default=10, help="subscribers per job")
    parser.add_argument("--stream-tokens", type=int, default=32, help="streams jobs' new tokens")
    parser.add_argument("--soak-s", type=float, default=600.0)
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--stream-ttl-s", type=int, default=60, help="SWITCHYARD_STREAM_TTL_S")
    parser.add_argument("--workers-per-model", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--redis-prefix", default=None, help="default: a fresh load<hex>")
    parser.add_argument("--json", default=None, help="also write every number to this file")
    args = parser.parse_args(argv)
    if min(args.jobs, args.clients, args.subscribers, args.fanout, args.soak_clients) < 1:
        parser.error("counts must be >= 1")
    if args.stream_ttl_s < 10 or args.soak_s <= 0 or args.sample_s <= 0:
        parser.error("--stream-ttl-s must be >= 10, --soak-s and --sample-s > 0")
    return args


def services(args: argparse.Namespace, base: Settings) -> None:
    """Fill in the services: flags, else DATABASE_URL/REDIS_URL, else the test services."""
    if args.database_url is None:
        if "database_url" in base.model_fields_set:
            args.database_url = base.database_url
        else:
            args.database_url = os.environ.get("SY_TEST_DATABASE_URL", TEST_DATABASE_URL)
    if args.redis_url is None:
        if "redis_url" in base.model_fields_set:
            args.redis_url = base.redis_url
        else:
            args.redis_url = os.environ.get("SY_TEST_REDIS_URL", TEST_REDIS_URL)


def run(args: argparse.Namespace) -> list[PhaseResult]:
    base = load_settings()
    services(args, base)
    open_files = raise_open_files_limit()
    if args.subscribers * 2 + 256 > open_files:
        raise SystemExit(f"load: {args.subscribers} subscribers need more than {open_files} files")
    log_dir = base.state_dir / "bench" / time.strftime("load-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[PhaseResult] = []
    with ExitStack() as stack:
        models_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-load-")))
        args.models_dir = str(load_models_dir(models_dir))
        args.api_port = None
        args.redis_prefix = args.redis_prefix or f"load{uuid.uuid4().hex[:8]}"
        settings = farm_settings(args, base, stack)
        # Each open websocket or SSE stream holds a gthread thread.
        api_threads = max(settings.api_threads, args.subscribers + 2 * args.soak_clients + 64)
        env = child_env(settings, args.threads, api_threads, args.jobs + args.subscribers + 100)
        env["SWITCHYARD_STREAM_TTL_S"] = str(args.stream_ttl_s)
        settings = settings.model_copy(update={"stream_ttl_s": args.stream_ttl_s})
        print(
            f"load: database {settings.database_url.split('@')[-1]}, redis "
            f"{settings.redis_url.split('@')[-1]}, prefix {settings.redis_prefix}, "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; logs in {log_dir}",
            flush=True,
        )
        farm = LoadFarm(settings, env, api_threads, args.workers_per_model, log_dir)
        stack.callback(farm.stop)
        started = time.perf_counter()
        farm.start()
        print(f"load: farm up in {time.perf_counter() - started:.1f} s", flush=True)
        phases: list[Callable[[], PhaseResult]] = []
        if args.phase in ("burst", "all"):
            phases.append(lambda: burst_phase(farm, args))
        if args.phase in ("streams", "all"):
            phases.append(lambda: streams_phase(farm, args, "ws"))
            phases.append(lambda: streams_phase(farm, args, "sse"))
        if args.phase in ("soak", "all"):
            phases.append(lambda: soak_phase(farm, args))
        for phase in phases:
            result = phase()
            results.append(result)
            print_result(result)
    return results


def print_result(result: PhaseResult) -> None:
    print()
    print("\n".join(result.lines))
    for c in result.checks:
        print(
            f"  [{'pass' if c.passed else 'FAIL'}] {c.name}" + ("" if c.passed else f": {c.detail}")
        )
    print(flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    failed = [f"{r.name}: {c.name}" for r in results for c in r.checks if not c.passed]
    print("load: " + ("all checks passed" if not failed else f"{len(failed)} checks FAILED"))
    for line in failed:
        print(f"  {line}")
    if args.json:
        report = {
            "args": {k: v for k, v in vars(args).items() if k != "models_dir"},
            "phases": {
                r.name: {"checks": [asdict(c) for c in r.checks], "numbers": r.numbers}
                for r in results
            },
        }
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

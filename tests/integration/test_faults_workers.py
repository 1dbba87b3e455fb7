"""Faults under load (issue 7): kill -9 storms, SIGTERM to the scaler and the API.

Everything is real: gunicorn, ``switchyard scaler --executor local`` and the
worker processes it starts, Postgres, Redis, websocket and SSE clients on
every job. The module has a database of its own (``<test database>_faults``)
and a Redis prefix of its own: the session's API, if another module started
it, runs a reaper with ``max_attempts = 2`` over the session database, and
would fail the jobs this module kills several times. Here ``max_attempts`` is
5 and the storm never kills a worker running a job on its fifth attempt, so
every job must end ``succeeded`` (a job killed four times still has one).

``SY_FAULT_KILLS`` sets the storm's kills (3 by default, 50 in ``make
faults``). Each test prints a markdown table of what it measured and appends
it to ``.switchyard/reports/faults.md``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml
from sqlalchemy.engine import make_url

from config import Settings
from config.settings import PROJECT_ROOT
from db.jobs import JobStore
from db.session import Database
from fleet.registry import list_workers
from jobs.events import EventLog
from tests import farm

CHAT = [{"role": "user", "content": "Tell me a very long story about a fox."}]
FINAL = ("succeeded", "failed", "cancelled")
KILLS = int(os.environ.get("SY_FAULT_KILLS", "3"))
REPLICAS = 2
SLOTS = 4
# /proc for process trees, and the parent death signal, are Linux's.
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
    # Above the suite's 300 s: a kill costs up to ~30 s on 2 busy cores.
    pytest.mark.timeout(600 + 60 * KILLS),
]
# Jobs kept in flight during the storm: a few per worker, so each kill hits several.
IN_FLIGHT = 6


# --- the farm of this module -----------------------------------------------------------


@pytest.fixture(scope="module")
def fsettings(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings of this module: own database, own prefix, one model pinned at 2 workers."""
    from db.migrate import upgrade

    if make_url(settings.database_url).get_backend_name() != "postgresql":
        pytest.skip("needs Postgres")
    url = farm.database_of_its_own(settings.database_url, "faults")
    farm.reset_database(url)
    upgrade(url)
    folder = tmp_path_factory.mktemp("fault-models")
    smol = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "smollm2-135m.yaml").read_text())
    smol["enabled"] = False  # only its tokenizer is borrowed
    (folder / "smollm2-135m.yaml").write_text(yaml.safe_dump(smol))
    tiny = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "tiny-random.yaml").read_text())
    model = f"faults-{uuid.uuid4().hex[:6]}"  # a Celery queue no other test shares
    tiny.update(
        name=model,
        # Four jobs at a time per worker, so a burst leaves some queued.
        # Inputs up to 2048 tokens, so prompt plus any output fits and every
        # re-run job continues (a `restart` would fail these tests).
        limits={**tiny["limits"], "max_new_tokens": 2048, "max_input_tokens": 2048, "slots": SLOTS},
        scaling={"min_replicas": REPLICAS, "max_replicas": REPLICAS},
    )
    (folder / f"{model}.yaml").write_text(yaml.safe_dump(tiny))
    return settings.model_copy(
        update={
            "database_url": url,
            "redis_prefix": f"f{uuid.uuid4().hex[:8]}",
            "models_dir": folder,
            "max_attempts": 5,
            "api_port": farm.free_port(),
            "api_workers": 1,
            "scaler_interval_s": 0.5,
            "scaler_lock_ttl_s": 3.0,
        }
    )


def model_of(settings: Settings) -> str:
    (name,) = [p.stem for p in settings.models_dir.glob("faults-*.yaml")]
    return name


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = farm.settings_env(settings)
    env.update(
        {
            "SWITCHYARD_SCALER_INTERVAL_S": str(settings.scaler_interval_s),
            "SWITCHYARD_SCALER_LOCK_TTL_S": str(settings.scaler_lock_ttl_s),
            "SWITCHYARD_RESTART_BACKOFF_S": str(settings.restart_backoff_s),
            "SWITCHYARD_RESTART_BACKOFF_MAX_S": str(settings.restart_backoff_max_s),
            # Two workers share two cores with the API, the scaler and the clients.
            "SWITCHYARD_TORCH_THREADS": "1",
            **extra,
        }
    )
    return env


def start_scaler(settings: Settings, log_dir: Path, **extra: str) -> farm.Process:
    argv = [sys.executable, "-m", "cli", "scaler", "--executor", "local"]
    return farm.Process(
        argv, child_env(settings, **extra), log_dir / f"scaler-{time.time_ns()}.log"
    )


def start_api(settings: Settings, log_dir: Path, port: int, **extra: str) -> farm.Process:
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(PROJECT_ROOT / "api" / "gunicorn_conf.py"),
        "api:create_app()",
    ]
    env = child_env(settings, SWITCHYARD_API_PORT=str(port), **extra)
    proc = farm.Process(argv, env, log_dir / f"gunicorn-{time.time_ns()}.log")
    farm.wait_http(f"http://127.0.0.1:{port}/healthz")
    return proc


# --- processes -------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def wait_for(what: str, check: Callable[[], Any], timeout: float = 240, every: float = 0.1) -> Any:
    return farm.wait_for(what, check, timeout, every)


def ready_workers(settings: Settings, parent: int) -> dict[str, int]:
    """Worker id → pid of the ready workers that are children of ``parent``."""
    client = redis.Redis.from_url(settings.redis_url)
    kids = children_of(parent)
    return {
        w.id: w.pid
        for w in list_workers(client, settings)
        if w.state == "ready" and not w.lost and w.pid in kids
    }


# --- clients ---------------------------------------------------------------------------


@dataclass
class Follower:
    """A client of one job's stream (websocket or SSE) that re-attaches when dropped.

    Each event is stamped with its arrival (epoch seconds); ``attaches`` counts
    the connections it needed.
    """

    job_id: str
    kind: str
    token: str
    base_url: Callable[[], str]
    events: list[dict[str, Any]] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    attaches: int = 0
    errors: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> Follower:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] in ("done", "error")

    def run(self) -> None:
        deadline = time.monotonic() + 900
        while not self.ended and time.monotonic() < deadline:
            self.attaches += 1
            after = self.events[-1]["seq"] if self.events else None
            try:
                if self.kind == "ws":
                    self._ws(after)
                else:
                    self._sse(after)
            except Exception as exc:  # dropped: re-attach where it left off
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.3)

    def _take(self, event: dict[str, Any]) -> None:
        self.stamps.append(time.time())
        self.events.append(event)

    def _ws(self, after: int | None) -> None:
        import websocket

        url = self.base_url().replace("http", "ws", 1) + f"/v1/jobs/{self.job_id}/ws"
        if after is not None:
            url += f"?after={after}"
        ws = websocket.create_connection(
            url, header=[f"Authorization: Bearer {self.token}"], timeout=120
        )
        try:
            while not self.ended:
                raw = ws.recv()
                if not raw:
                    raise ConnectionError("closed before the final event")
                self._take(json.loads(raw))
        finally:
            ws.close()

    def _sse(self, after: int | None) -> None:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"}
        if after is not None:
            headers["Last-Event-ID"] = str(after)
        url = f"{self.base_url()}/v1/jobs/{self.job_id}/events"
        with requests.get(url, headers=headers, stream=True, timeout=120) as r:
            r.raise_for_status()
            data = None
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                elif line == "" and data is not None:
                    self._take(json.loads(data))
                    data = None
                    if self.ended:
                        return
        raise ConnectionError("the SSE stream ended before the final event")

    def join(self, timeout: float = 600) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert self.ended, f"job {self.job_id}: no final event; errors {self.errors[-3:]}"


def submit(base_url: str, token: str, model: str, max_new_tokens: int) -> str:
    body = {
        "model": model,
        "messages": CHAT,
        "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    r = requests.post(
        f"{base_url}/v1/jobs",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def tokens_since_start(events: EventLog, job_id: str) -> int:
    history = events.history(job_id)
    starts = [i for i, e in enumerate(history) if e.type == "started"]
    return sum(1 for e in history[starts[-1] :] if e.type == "token") if starts else 0


def check_stream(
    f: Follower, job: Any, events: EventLog, answer: str | None = None
) -> list[dict[str, Any]]:
    """The invariants of every job's stream; returns its ``resumed`` events.

    Every attempt after the first begins ``started``, ``resumed`` (its worker
    continued the output): never ``restart`` here, where prompt plus output
    always fit. The client's text is each token once and equals ``answer``,
    the uninterrupted greedy answer, when given.
    """
    seqs = [e["seq"] for e in f.events]
    assert seqs == list(range(len(seqs))), f"job {f.job_id}: gaps or repeats in {seqs}"
    types = [e["type"] for e in f.events]
    assert sum(t in ("done", "error") for t in types) == 1 and types[-1] in ("done", "error")
    # The client saw exactly what the log holds.
    assert [e.seq for e in events.history(f.job_id)] == seqs
    assert "restart" not in types, f"job {f.job_id} could not continue: {f.events}"
    starts = [i for i, t in enumerate(types) if t == "started"]
    assert types[0] == "queued" and starts
    for i in starts[1:]:
        # A later attempt says what it continued in the same write as `started`,
        # so no kill can come between the two.
        assert types[i + 1] == "resumed", types[i : i + 3]
    resumed = [e for e in f.events if e["type"] == "resumed"]
    assert len(resumed) == len(starts) - 1
    for r in resumed:
        i = f.events.index(r)
        before = sum(len(e["ids"]) for e in f.events[:i] if e["type"] == "token")
        assert r["tokens"] == before, (r, before)
    attempts = [f.events[i]["attempt"] for i in starts]
    # Non-decreasing: a drain hands its attempt back.
    assert attempts == sorted(attempts) and attempts[-1] == job.attempts
    text = "".join(e["text"] for e in f.events if e["type"] == "token")
    assert job.status == "succeeded", f"job {f.job_id}: {job.status} {job.error}"
    assert f.events[-1]["type"] == "done" and f.events[-1]["text"] == text == job.output_text
    if answer is not None:
        assert text == answer, f"job {f.job_id}: its text differs from the uninterrupted answer"
    return resumed


def story(job_id: str, events: EventLog, kills: list[dict[str, Any]]) -> str:
    """A job's stream (entry time, seq, type, worker) next to the kills: a failure's evidence."""
    lines = [f"job {job_id}:"]
    entries = events.redis.xrange(events.channel(job_id))
    for entry_id, fields in entries:
        data = json.loads(fields[b"e"])
        at = int(entry_id.split(b"-")[0]) / 1000
        lines.append(
            f"  {at:.3f} seq {data['seq']} {data['type']} {data.get('worker', '')}"
            f" {data.get('previous_worker', '')} n={len(data.get('ids', []))}"
        )
    lines += [f"  kill {k['at']:.3f} {k['worker']} jobs {k['jobs']}" for k in kills]
    return "\n".join(lines)


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def report(title: str, rows: list[tuple[str, Any]]) -> str:
    table = [f"### {title}", "", f"run {datetime.now(UTC).isoformat(timespec='seconds')}", ""]
    table += ["| measure | value |", "|---|---|"]
    table += [f"| {k} | {v} |" for k, v in rows]
    body = "\n".join(table) + "\n"
    print("\n" + body)
    folder = PROJECT_ROOT / ".switchyard" / "reports"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "faults.md").open("a") as out:
        out.write(body + "\n")
    return body


@pytest.fixture(scope="module")
def ftoken(fsettings: Settings) -> str:
    # An operator's limits (64 jobs in flight, 600 a minute) fit the storm's pace.
    return farm.make_token(fsettings, "operator")


@pytest.fixture(scope="module")
def jobs_db(fsettings: Settings) -> Iterator[JobStore]:
    db = Database(fsettings.database_url)
    try:
        yield JobStore(db)
    finally:
        db.dispose()


def pick_victim(
    settings: Settings,
    jobs: JobStore,
    events: EventLog,
    scaler_pid: int,
    spared: frozenset[int] = frozenset(),
) -> tuple[str, int, list[str]] | None:
    """A ready worker of the scaler that is generating a job, and its running jobs.

    Never one running a job on its last attempt: the kill would fail that job,
    and this test wants every job to complete (see the module docstring). Nor
    one in ``spared`` (already killed, perhaps not yet dead).
    """
    workers = {
        wid: pid for wid, pid in ready_workers(settings, scaler_pid).items() if pid not in spared
    }
    by_worker: dict[str, list[Any]] = {}
    for job in jobs.running():
        if job.worker in workers:
            by_worker.setdefault(job.worker, []).append(job)
    for worker_id, running in sorted(by_worker.items(), key=lambda kv: -len(kv[1])):
        if any(j.attempts >= settings.max_attempts for j in running):
            continue
        if any(tokens_since_start(events, j.id) >= 2 for j in running):
            return worker_id, workers[worker_id], [j.id for j in running]
    return None


# --- tests -----------------------------------------------------------------------------


def generating_on_every_worker(
    settings: Settings, jobs: JobStore, events: EventLog, scaler_pid: int
) -> bool:
    """Whether each ready worker of the scaler has a job that already streams tokens."""
    workers = ready_workers(settings, scaler_pid)
    busy = {j.worker for j in jobs.running() if tokens_since_start(events, j.id) >= 2 and j.worker}
    return len(workers) == REPLICAS and set(workers) <= busy


def handed_back(jobs_db: JobStore, events: EventLog, job_ids: list[str]) -> list[str]:
    """Jobs queued again with tokens already streamed: a drain handed them over."""
    return [
        j
        for j in job_ids
        if (row := jobs_db.get(j)) is not None
        and row.status == "queued"
        and any(e.type == "token" for e in events.history(j))
    ]


def continuations(events: EventLog, job_ids: list[str]) -> int:
    return sum(e.type == "resumed" for j in job_ids for e in events.history(j))


def test_scaler_sigterm_drains_its_workers_kill_9_takes_them_along_nothing_is_lost(
    fsettings: Settings, ftoken: str, jobs_db: JobStore, log_dir: Path
) -> None:
    """SIGTERM: the scaler drains its workers (finish or hand back within the
    worker grace) and exits 0; queued work waits for the next scaler. SIGKILL:
    its workers get SIGTERM from the kernel (parent death signal) and do the
    same, so no orphan worker outlives it. A third scaler finishes every job."""
    settings = fsettings
    model = model_of(settings)
    events = EventLog(redis.Redis.from_url(settings.redis_url), settings)
    port = farm.free_port()
    base = f"http://127.0.0.1:{port}"
    api = start_api(settings, log_dir, port)
    # A short worker grace, so running jobs are handed back, not finished.
    grace = {"SWITCHYARD_WORKER_GRACE_S": "3", "SWITCHYARD_DRAIN_GRACE_S": "120"}
    scalers: list[farm.Process] = []
    followers: dict[str, Follower] = {}
    try:
        first = start_scaler(settings, log_dir, **grace)
        scalers.append(first)
        wait_for("2 workers", lambda: len(ready_workers(settings, first.proc.pid)) == 2, 300)
        first_workers = children_of(first.proc.pid)
        for i in range(10):  # 8 slots: 8 run, 2 wait in the queue
            job_id = submit(base, ftoken, model, max_new_tokens=1000)
            kind = "ws" if i % 2 == 0 else "sse"
            followers[job_id] = Follower(job_id, kind, ftoken, lambda: base).start()
        ids = list(followers)
        wait_for(
            "both workers to generate",
            lambda: generating_on_every_worker(settings, jobs_db, events, first.proc.pid),
        )
        sigterm_at = time.time()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=180) == 0, first.log()[-3000:]
        scaler_exit_s = time.time() - sigterm_at
        assert first_workers and not [p for p in first_workers if pid_alive(p)]
        after_drain = {j: jobs_db.get(j) for j in ids}
        assert all(j is not None and j.status != "running" for j in after_drain.values())
        handed = handed_back(jobs_db, events, ids)
        done_in_drain = [j for j, row in after_drain.items() if row and row.status == "succeeded"]
        queued = [j for j, row in after_drain.items() if row and row.status == "queued"]
        assert handed and len(done_in_drain) + len(queued) == len(ids)

        second = start_scaler(settings, log_dir, **grace)
        scalers.append(second)
        wait_for("2 workers", lambda: len(ready_workers(settings, second.proc.pid)) == 2, 300)
        second_workers = children_of(second.proc.pid)
        wait_for(
            "both workers to generate",
            lambda: generating_on_every_worker(settings, jobs_db, events, second.proc.pid),
        )
        handed_before = continuations(events, ids) + len(handed_back(jobs_db, events, ids))
        killed_at = time.time()
        second.proc.kill()
        second.proc.wait(timeout=30)
        wait_for(
            "the dead scaler's workers to exit",
            lambda: not [p for p in second_workers if pid_alive(p)],
            120,
        )
        orphans_gone_s = time.time() - killed_at
        assert not [j for j in jobs_db.running() if j.model == model]
        handed_after = continuations(events, ids) + len(handed_back(jobs_db, events, ids))

        third = start_scaler(settings, log_dir)
        scalers.append(third)
        for f in followers.values():
            f.join()
        total_s = time.time() - sigterm_at
        third_workers = children_of(third.proc.pid)
        assert third.stop(timeout=120) == 0
        assert not [p for p in third_workers if pid_alive(p)]
    finally:
        for proc in scalers:
            proc.stop(timeout=120)
        api.stop()
    for job_id, f in followers.items():
        job = jobs_db.get(job_id)
        assert job is not None
        check_stream(f, job, events)
        assert job.attempts == 1  # a drain gives its attempt back
    report(
        "SIGTERM and SIGKILL to the scaler (local executor, 2 workers, worker grace 3 s)",
        [
            ("jobs (1000 tokens each)", len(ids)),
            ("SIGTERM → scaler exit 0, s", f"{scaler_exit_s:.1f}"),
            (
                "… jobs finished in the drain / handed back / left queued",
                f"{len(done_in_drain)} / {len(handed)} / {len(queued) - len(handed)}",
            ),
            ("SIGKILL → every worker of the dead scaler exited, s", f"{orphans_gone_s:.1f}"),
            ("… jobs handed back by those workers", handed_after - handed_before),
            ("jobs succeeded in the end / lost", f"{len(followers)} / 0"),
            ("SIGTERM → every job done (3 scalers), s", f"{total_s:.0f}"),
        ],
    )


def test_sigterm_to_the_api_streams_reattach_elsewhere_and_jobs_go_on(
    shared_farm: Farm, ftoken: str, jobs_db: JobStore, log_dir: Path
) -> None:
    """gunicorn's SIGTERM: in-flight streams get ``graceful_timeout``, then are cut;
    the jobs run on (a closed per-job stream cancels nothing) and each client
    re-attaches to another API process with ?after= / Last-Event-ID."""
    settings = shared_farm.settings
    model = model_of(settings)
    events = EventLog(redis.Redis.from_url(settings.redis_url), settings)
    graceful = 5
    first_port, second_port = farm.free_port(), farm.free_port()
    current = {"url": f"http://127.0.0.1:{first_port}"}
    first = start_api(
        settings, log_dir, first_port, GUNICORN_CMD_ARGS=f"--graceful-timeout {graceful}"
    )
    second: farm.Process | None = None
    try:
        followers = {}
        for i in range(6):
            job_id = submit(current["url"], ftoken, model, max_new_tokens=1500)
            kind = "ws" if i % 2 == 0 else "sse"
            followers[job_id] = Follower(job_id, kind, ftoken, lambda: current["url"]).start()
        wait_for(
            "every client to get tokens",
            lambda: all(
                sum(e["type"] == "token" for e in f.events) >= 2 for f in followers.values()
            ),
        )
        second = start_api(settings, log_dir, second_port)
        current["url"] = f"http://127.0.0.1:{second_port}"  # as a load balancer would
        sigterm_at = time.time()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=graceful + 60) == 0, first.log()[-3000:]
        exit_s = time.time() - sigterm_at
        running_at_exit = [
            j for j in followers if (row := jobs_db.get(j)) and row.status == "running"
        ]
        for f in followers.values():
            f.join()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    for job_id, f in followers.items():
        job = jobs_db.get(job_id)
        assert job is not None
        assert check_stream(f, job, events) == []  # the API's exit restarts nothing
        assert job.attempts == 1
    for job_id in running_at_exit:  # its stream was cut, and picked up where it was
        assert followers[job_id].attaches >= 2, followers[job_id].errors
    report(
        f"SIGTERM to the API (gunicorn, graceful_timeout {graceful} s) with 6 streams",
        [
            ("SIGTERM → gunicorn exit 0, s", f"{exit_s:.1f}"),
            ("jobs still running when it exited", len(running_at_exit)),
            (
                "clients that re-attached to the other API",
                sum(f.attaches > 1 for f in followers.values()),
            ),
            ("jobs succeeded / restarted / lost", f"{len(followers)} / 0 / 0"),
        ],
    )


@dataclass
class Farm:
    """The module's API under gunicorn and its scaler (local executor, 2 workers)."""

    settings: Settings
    base: str
    api: farm.Process
    scaler: farm.Process


@pytest.fixture(scope="module")
def shared_farm(fsettings: Settings, log_dir: Path) -> Iterator[Farm]:
    api = start_api(fsettings, log_dir, fsettings.api_port)
    scaler = start_scaler(fsettings, log_dir)
    try:
        wait_for(
            "the scaler's workers",
            lambda: len(ready_workers(fsettings, scaler.proc.pid)) == REPLICAS,
            300,
        )
        yield Farm(fsettings, f"http://127.0.0.1:{fsettings.api_port}", api, scaler)
    finally:
        pids = children_of(scaler.proc.pid)
        rc = scaler.stop(timeout=120)
        api.stop()
    assert rc == 0, scaler.log()[-3000:]
    assert not [p for p in pids if pid_alive(p)], "the scaler left workers behind"


def test_kill_9_storm_every_job_continues_to_the_uninterrupted_answer(
    shared_farm: Farm, ftoken: str, jobs_db: JobStore
) -> None:
    settings, base, scaler = shared_farm.settings, shared_farm.base, shared_farm.scaler
    model = model_of(settings)
    events = EventLog(redis.Redis.from_url(settings.redis_url), settings)
    followers: dict[str, Follower] = {}
    kills: list[dict[str, Any]] = []
    log_before = len(scaler.log().splitlines())
    seen = set(ready_workers(settings, scaler.proc.pid).values())
    came_up: list[float] = []  # when each replacement worker was first seen ready
    # Every job asks the same greedy question: each must end with this answer.
    reference = submit(base, ftoken, model, max_new_tokens=500)
    farm.wait_final(base, ftoken, reference)
    reference_row = jobs_db.get(reference)
    assert reference_row is not None and reference_row.attempts == 1
    answer = reference_row.output_text or ""
    assert answer

    def watch_replacements() -> dict[str, int]:
        ready = ready_workers(settings, scaler.proc.pid)
        for pid in set(ready.values()) - seen:
            seen.add(pid)
            came_up.append(time.time())
        return ready

    started = time.monotonic()
    while len(kills) < KILLS:
        assert scaler.alive(), scaler.log()[-3000:]
        watch_replacements()
        live = sum(not f.ended for f in followers.values())
        for _ in range(IN_FLIGHT - live):
            job_id = submit(base, ftoken, model, max_new_tokens=500)
            kind = "ws" if len(followers) % 2 == 0 else "sse"
            followers[job_id] = Follower(job_id, kind, ftoken, lambda: base).start()
        killed_pids = frozenset(k["pid"] for k in kills)
        victim = pick_victim(settings, jobs_db, events, scaler.proc.pid, killed_pids)
        if victim is None:
            time.sleep(0.1)
            continue
        # No waiting for the replacement: kills come as fast as there is a
        # worker generating, so the survivors and the executor are both loaded.
        worker_id, pid, running = victim
        if pid not in seen:  # it came up since the last look: count its replacement
            seen.add(pid)
            came_up.append(time.time())
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        kills.append({"at": killed_at, "worker": worker_id, "pid": pid, "jobs": running})
    for f in followers.values():
        f.join()

    # The executor ends at full strength: every killed worker was replaced.
    def replacements_started() -> int:
        lines = scaler.log().splitlines()[log_before:]
        return sum(f"started {model} worker pid" in line for line in lines)

    try:
        wait_for(
            "every killed worker to be replaced",
            lambda: len(watch_replacements()) == REPLICAS and replacements_started() >= len(kills),
            300,
        )
    except AssertionError as exc:
        tail = "\n".join(scaler.log().splitlines()[log_before:][-60:])
        raise AssertionError(
            f"{exc}; {replacements_started()} started for {len(kills)} kills\n{tail}"
        ) from None
    wall = time.monotonic() - started

    killed = {k["worker"]: k for k in kills}
    to_resumed: list[float] = []
    to_done: list[float] = []
    resumed_jobs = carried = 0
    for job_id, f in followers.items():
        job = jobs_db.get(job_id)
        assert job is not None
        resumed = check_stream(f, job, events, answer)
        # Each lost attempt counted; each continuation names a killed worker.
        assert len(resumed) < job.attempts <= settings.max_attempts
        for r in resumed:
            assert r["previous_worker"] in killed, r
            carried += r["tokens"]
            to_resumed.append(f.stamps[f.events.index(r)] - killed[r["previous_worker"]]["at"])
        if resumed:
            resumed_jobs += 1
            to_done.append(f.stamps[-1] - killed[resumed[-1]["previous_worker"]]["at"])
    # Every job running on a victim continued elsewhere, unless it ended on it just before.
    for kill in kills:
        for job_id in kill["jobs"]:
            f = followers[job_id]
            named = [e.get("previous_worker") for e in f.events if e["type"] == "resumed"]
            started_on = [e.get("worker") for e in f.events if e["type"] == "started"]
            job = jobs_db.get(job_id)
            assert job is not None
            assert (
                kill["worker"] in named
                # claimed there but killed before it said `started`: nothing to carry
                or kill["worker"] not in started_on
                or (job.worker == kill["worker"] and f.stamps[-1] <= kill["at"] + 1)
            ), story(job_id, events, kills)
    assert not [j for j in jobs_db.running() if j.model == model]
    # A worker that served and was then killed is no crash loop: each kill is "crash 1".
    lines = scaler.log().splitlines()[log_before:]
    crash_lines = [ln for ln in lines if "exited unexpectedly" in ln]
    assert len(crash_lines) == len(kills), crash_lines[-5:]
    assert all("crash 1 in a row" in ln for ln in crash_lines), crash_lines

    # The executor replaces in the order workers died: pair the n-th kill with
    # the n-th replacement the scaler's log says it started.
    spawned = [
        datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for ln in lines
        if f"started {model} worker pid" in ln
    ]
    replaced = [up - k["at"] for k, up in zip(kills, spawned, strict=False)]
    report(
        f"kill -9 storm ({REPLICAS} workers, {IN_FLIGHT} jobs in flight, 500 tokens each)",
        [
            ("kills done", len(kills)),
            ("jobs total", len(followers)),
            ("jobs continued (at least once)", resumed_jobs),
            ("continuations (`resumed`) / `restart`", f"{len(to_resumed)} / 0"),
            ("tokens carried over (not generated again)", carried),
            ("jobs whose text equals the uninterrupted answer", len(followers)),
            ("jobs final / succeeded / left running", f"{len(followers)} / {len(followers)} / 0"),
            ("kill → `resumed` event, s (p50 / max)", quantiles(to_resumed)),
            ("kill → job done, s (p50 / max)", quantiles(to_done)),
            ("kill → replacement worker started, s (p50 / max)", quantiles(replaced)),
            ("replacement workers seen ready", len(came_up)),
            ("client re-attaches", sum(f.attaches - 1 for f in followers.values())),
            ("storm wall time (first kill → all replaced), s", f"{wall:.0f}"),
        ],
    )

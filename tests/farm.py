"""Real services and processes for integration and e2e tests.

Postgres and Redis are the real servers named by ``SY_TEST_DATABASE_URL`` and
``SY_TEST_REDIS_URL``; when they are unreachable the tests skip, unless
``SY_TEST_REQUIRE_SERVICES=1`` (CI) turns that into a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import redis
import requests
from sqlalchemy import create_engine, make_url, text
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from config import Settings
from config.settings import PROJECT_ROOT

DEFAULT_PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/15"


def tests_database_url() -> str:
    return os.environ.get("SY_TEST_DATABASE_URL", DEFAULT_PG)


def tests_redis_url() -> str:
    return os.environ.get("SY_TEST_REDIS_URL", DEFAULT_REDIS)


def services_required() -> bool:
    return os.environ.get("SY_TEST_REQUIRE_SERVICES", "") == "1"


def unreachable_services() -> list[str]:
    problems = []
    try:
        engine = create_engine(tests_database_url(), connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        problems.append(f"Postgres at {tests_database_url()}: {type(exc).__name__}")
    try:
        redis.Redis.from_url(tests_redis_url(), socket_connect_timeout=3).ping()
    except Exception as exc:
        problems.append(f"Redis at {tests_redis_url()}: {type(exc).__name__}")
    return problems


def reset_database(url: str) -> None:
    """Drop every table (ours and Alembic's) so migrations start from nothing."""
    engine = create_engine(url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
        else:
            for table in ("jobs", "api_tokens", "users", "alembic_version"):
                conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
    engine.dispose()


def database_of_its_own(base_url: str, suffix: str) -> str:
    """The URL of ``<database>_<suffix>`` beside ``base_url``'s database, created if missing.

    For a farm of its own inside a test session: a reaper sweeps every running
    job of the database it is given, and takes the jobs of a farm whose workers
    beat in another Redis (or under another prefix) for jobs of lost workers.
    Two farms must never share a database.
    """
    url = make_url(base_url)
    name = f"{url.database}_{suffix}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
        if exists.scalar() is None:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


def processes_of_farm(redis_prefix: str, marker: str) -> list[list[str]]:
    """Command lines of the running processes with ``marker`` in them that belong to the
    farm under ``redis_prefix`` (their ``SWITCHYARD_REDIS_PREFIX``).

    Another test run on the same machine (another checkout, another database)
    may be running the same program with the same model names at the same
    time: its processes carry its own session's prefix, and are not ours.
    """
    found: list[list[str]] = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"]
        if not cmdline or marker not in " ".join(cmdline):
            continue
        try:
            prefix = p.environ().get("SWITCHYARD_REDIS_PREFIX")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone meanwhile, or another user's
        if prefix == redis_prefix:
            found.append(cmdline)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(
        {
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": settings.redis_url,
            "SWITCHYARD_REDIS_PREFIX": settings.redis_prefix,
            "SWITCHYARD_STATE_DIR": str(settings.state_dir),
            "SWITCHYARD_MODELS_DIR": str(settings.models_dir),
            "SWITCHYARD_API_PORT": str(settings.api_port),
            "SWITCHYARD_API_WORKERS": str(settings.api_workers),
            "SWITCHYARD_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
            "SWITCHYARD_HEARTBEAT_TTL_S": str(settings.heartbeat_ttl_s),
            "SWITCHYARD_REAPER_INTERVAL_S": str(settings.reaper_interval_s),
            "SWITCHYARD_REAPER_IN_API": "1" if settings.reaper_in_api else "0",
            "SWITCHYARD_MAX_ATTEMPTS": str(settings.max_attempts),
            "SWITCHYARD_RECONCILE_AFTER_S": str(settings.reconcile_after_s),
            "SWITCHYARD_WORKER_GRACE_S": str(settings.worker_grace_s),
            "SWITCHYARD_LOG_FORMAT": settings.log_format,
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def switchyard(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The ``switchyard`` command with ``args`` in environment ``env``, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Process:
    """A child process whose output goes to a log file, stopped on exit."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=PROJECT_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_worker(
    settings: Settings, model: str, log_dir: Path, env: dict[str, str] | None = None
) -> Process:
    """A worker process for ``model``; ``env`` adds to (or overrides) its environment."""
    argv = [sys.executable, "-m", "cli", "worker", "--model", model]
    full_env = {**settings_env(settings), **(env or {})}
    return Process(argv, full_env, log_dir / f"worker-{model}-{time.time_ns()}.log")


def wait_ready(settings: Settings, model: str, proc: Process, timeout: float = 240) -> str:
    """Block until ``proc``'s worker reports ready; returns its worker id."""
    from fleet.registry import list_workers

    client = redis.Redis.from_url(settings.redis_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(f"worker exited early:\n{proc.log()[-4000:]}")
        for w in list_workers(client, settings):
            if w.model == model and w.pid == proc.proc.pid and w.state == "ready" and not w.lost:
                return w.id
        time.sleep(0.2)
    raise AssertionError(f"worker not ready in {timeout} s:\n{proc.log()[-4000:]}")


@contextmanager
def serve_app_in_thread(settings: Settings) -> Iterator[str]:
    """The real Flask app on a real socket (Werkzeug's threaded server)."""
    from werkzeug.serving import make_server

    from api import create_app

    app = create_app(settings)
    app.extensions["switchyard"].start_background()  # the reaper, as gunicorn's hook does
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        app.extensions["switchyard"].close()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120, every: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout} s")


@contextmanager
def serving(
    argv: list[str], env: dict[str, str], log_path: Path, ready_url: str, timeout: float = 60
) -> Iterator[Process]:
    """A server process, once ``ready_url`` answers 200; stopped when the block ends."""
    proc = Process(argv, env, log_path)
    try:
        wait_http(ready_url, timeout=timeout)
        yield proc
    finally:
        proc.stop()


def ws_events(
    base_url: str, job_id: str, token: str, *, after: int | None = None, timeout: float = 120
) -> list[dict[str, Any]]:
    """Every frame of a job's websocket until the server closes it."""
    import websocket

    url = base_url.replace("http", "ws", 1) + f"/v1/jobs/{job_id}/ws"
    if after is not None:
        url += f"?after={after}"
    ws = websocket.create_connection(
        url, header=[f"Authorization: Bearer {token}"], timeout=timeout
    )
    frames = []
    try:
        while True:
            try:
                raw = ws.recv()
            except websocket.WebSocketConnectionClosedException:
                break
            if not raw:
                break
            frames.append(json.loads(raw))
            if frames[-1]["type"] in ("done", "error"):
                break
    finally:
        ws.close()
    return frames


def sse_events(
    base_url: str,
    job_id: str,
    token: str,
    *,
    last_event_id: int | None = None,
    timeout: float = 120,
) -> list[dict[str, Any]]:
    """Every event of a job's SSE stream, parsed from the wire format."""
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    events = []
    with requests.get(
        f"{base_url}/v1/jobs/{job_id}/events", headers=headers, stream=True, timeout=timeout
    ) as r:
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in r.iter_lines(decode_unicode=True):
            if line == "":
                if "data" in fields:
                    event = json.loads(fields["data"])
                    assert int(fields["id"]) == event["seq"]
                    assert fields["event"] == event["type"]
                    events.append(event)
                    if event["type"] in ("done", "error"):
                        break
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
    return events


@contextmanager
def serve_gunicorn(settings: Settings, log_dir: Path) -> Iterator[str]:
    """The API under gunicorn, as deployed, on ``settings.api_port``; its base URL."""
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(PROJECT_ROOT / "api" / "gunicorn_conf.py"),
        "api:create_app()",
    ]
    proc = Process(argv, settings_env(settings), log_dir / f"gunicorn-{time.time_ns()}.log")
    url = f"http://127.0.0.1:{settings.api_port}"
    try:
        wait_http(url + "/healthz")
        yield url
    finally:
        proc.stop()


def make_token(
    settings: Settings,
    role: str = "user",
    *,
    max_concurrent_jobs: int | None = None,
    requests_per_minute: int | None = None,
) -> str:
    """A new user of ``role`` (with these limits) and a token for it, in the test database."""
    import uuid

    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    db = Database(settings.database_url)
    try:
        accounts = Accounts(db)
        name = f"{role}-{uuid.uuid4().hex[:10]}"
        accounts.add_user(
            name,
            Role(role),
            max_concurrent_jobs=max_concurrent_jobs,
            requests_per_minute=requests_per_minute,
        )
        return accounts.issue_token(name).secret
    finally:
        db.dispose()


def wait_final(base_url: str, token: str, job_id: str, timeout: float = 180) -> dict[str, Any]:
    """``GET /v1/jobs/<id>`` once the job is succeeded, failed or cancelled."""
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = requests.get(f"{base_url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not final after {timeout} s")


class RawWebSocket:
    """A websocket client on a raw socket with a small receive buffer that reads
    only when told to: a client the server must treat as slow."""

    def __init__(self, base_url: str, path: str, token: str, receive_buffer: int = 1024) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect((host, int(port)))
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.events: list[Any] = []
        request = Request(
            host=f"{host}:{port}",
            target=path,
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
        )
        self.sock.sendall(self.ws.send(request))
        self.sock.settimeout(30)
        while not any(isinstance(e, AcceptConnection) for e in self.events):
            self._feed(self.sock.recv(4096))

    def _feed(self, data: bytes) -> None:
        self.ws.receive_data(data or None)
        self.events.extend(self.ws.events())

    def send_json(self, frame: dict[str, Any]) -> None:
        self.sock.sendall(self.ws.send(TextMessage(data=json.dumps(frame))))

    def read_until_closed(self, timeout: float) -> None:
        """Read everything the server sent; returns when it closed the connection."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(5)
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return
            except TimeoutError:
                continue
            if not data:
                return
            self._feed(data)
            if any(isinstance(e, CloseConnection) for e in self.events):
                return
        raise AssertionError(f"the server did not close the socket within {timeout} s")

    def frames(self) -> list[dict[str, Any]]:
        """The complete text frames received (wsproto hands them over in pieces)."""
        frames, pending = [], ""
        for event in self.events:
            if isinstance(event, TextMessage):
                pending += event.data
                if event.message_finished:
                    frames.append(json.loads(pending))
                    pending = ""
        return frames

    def close_code(self) -> int | None:
        closes = [e for e in self.events if isinstance(e, CloseConnection)]
        return closes[0].code if closes else None

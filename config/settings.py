"""The one typed settings object, built from the environment once.

Every tunable lives here with its unit and default. ``DATABASE_URL`` and
``REDIS_URL`` keep their conventional names; everything else is prefixed with
``SWITCHYARD_``. A bad value stops start-up with a message naming the variable.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PREFIX = "SWITCHYARD_"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_state_dir(root: Path = PROJECT_ROOT, home: Path | None = None) -> Path:
    """Where the farm keeps its state when ``SWITCHYARD_STATE_DIR`` is unset.

    In a checkout (``root`` holds ``pyproject.toml``: ``make run``, the images'
    ``pip install -e .``) the folder ``.switchyard`` beside the code. In an
    installed copy (``pip install .``: ``root`` is site-packages) the user's
    ``~/.local/state/switchyard``: the database, with every prompt and token
    hash, never lies inside the Python installation.
    """
    if (root / "pyproject.toml").is_file():
        return root / ".switchyard"
    return (home or Path.home()) / ".local" / "state" / "switchyard"


DEFAULT_STATE_DIR = default_state_dir()


class SettingsError(ValueError):
    """A variable of the environment has a value Switchyard cannot use."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


class Settings(BaseModel):
    """Everything a Switchyard process may be tuned by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    database_url: str = Field(
        default=f"sqlite:///{DEFAULT_STATE_DIR / 'switchyard.db'}",
        description=(
            "SQLAlchemy URL of the job database (Postgres in production); unset, the "
            "SQLite file switchyard.db in the state folder. postgres:// and postgresql:// "
            "(what hosts hand out) use the installed driver, psycopg2 (or psycopg 3)."
        ),
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL: Celery broker, event streams, heartbeats.",
    )
    state_dir: Path = Field(
        default=DEFAULT_STATE_DIR,
        description=(
            "Folder for the SQLite file, embedded Redis and converted model caches; unset, "
            "<project>/.switchyard in a checkout, ~/.local/state/switchyard in an installed copy."
        ),
    )
    models_dir: Path = Field(
        default=PROJECT_ROOT / "config" / "models",
        description="Folder of model definition files (*.yaml).",
    )
    redis_prefix: str = Field(
        default="sy",
        pattern=r"^[A-Za-z0-9_.-]{1,32}$",
        description=(
            "Prefix of every Redis key and channel of the farm: streams, heartbeats and "
            "Celery's broker (the queues <prefix>:gen.<model>)."
        ),
    )
    stream_ttl_s: int = Field(
        default=3600,
        ge=10,
        description="Seconds a job's event stream is kept after its last event.",
    )
    stream_coalesce_ms: int = Field(
        default=50,
        ge=0,
        le=1000,
        description=(
            "Milliseconds a worker gathers a job's tokens before publishing them as one "
            "event: windows of this length on the host's monotonic clock, so every job "
            "publishes at the same instants (the first token goes at once); 0 publishes "
            "every token alone. Under load the window lengthens (stream_writes_per_s)."
        ),
    )
    stream_writes_per_s: int = Field(
        default=100,
        ge=0,
        le=100_000,
        description=(
            "Token events a worker publishes a second, at most, over all its streams: with "
            "more streams than that allows at stream_coalesce_ms (100: 5 streams at 50 ms), each "
            "window lengthens to streams / this many seconds, up to stream_coalesce_max_ms, "
            "so the cores a busy worker shares go to generating rather than to publishing, "
            "relaying and reading more, smaller events; 0 keeps every window at "
            "stream_coalesce_ms. The first token and the end of an answer never wait."
        ),
    )
    stream_coalesce_max_ms: int = Field(
        default=250,
        ge=0,
        le=5000,
        description=(
            "The longest a worker's coalescing window grows under load (stream_writes_per_s)."
        ),
    )
    relay_poll_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Seconds of pub/sub silence after which a relay re-reads the stream history.",
    )
    relay_max_buffered_events: int = Field(
        default=1000,
        ge=1,
        description=(
            "Live events buffered per stream subscriber, in events; past it the subscriber "
            "is lagging (a websocket is closed with 4008)."
        ),
    )
    ws_send_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description=(
            "Seconds a websocket frame or an SSE write may wait for a client that does not "
            "read before the connection is closed (websockets with 4008)."
        ),
    )
    ws_max_message_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description=(
            "Largest websocket message a client may send, in bytes; a larger one closes the "
            "socket with 1009 'message too big'."
        ),
    )
    ws_max_messages_per_s: float = Field(
        default=20.0,
        gt=0,
        description=(
            "Messages per second a client may send on one /v1/ws socket (a token bucket); "
            "past it a message is answered with a 'rate_limited' error frame."
        ),
    )
    ws_message_burst: int = Field(
        default=50,
        ge=1,
        description=(
            "Messages a /v1/ws client may send at once above ws_max_messages_per_s; after as "
            "many refused messages in a row the socket is closed with 1008."
        ),
    )
    job_timeout_s: int = Field(
        default=1800, ge=10, description="Longest a single generation may run, in seconds."
    )
    visibility_timeout_s: int = Field(
        default=3600,
        ge=60,
        description=(
            "Seconds before Redis re-delivers an unacknowledged message; above job_timeout_s."
        ),
    )
    heartbeat_interval_s: float = Field(
        default=2.0, gt=0, le=60, description="Seconds between a worker's heartbeats."
    )
    heartbeat_ttl_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Seconds a heartbeat lives; a silent worker is lost after it.",
    )
    worker_grace_s: float = Field(
        default=0.0,
        ge=0,
        le=86_400,
        description=(
            "Seconds a worker told to stop (SIGTERM, scale-down) keeps generating its running "
            "jobs before it hands them back; they continue on another worker from the tokens "
            "already streamed. 0 (the default): at once. Keep it below the executor's kill "
            "deadline (drain_grace_s, Kubernetes' terminationGracePeriodSeconds)."
        ),
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=100,
        description="Attempts a job gets before a lost worker fails it ('worker lost N times').",
    )
    reaper_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="Seconds between two reaper sweeps (lost workers' jobs, orphaned messages).",
    )
    reaper_in_api: bool = Field(
        default=True,
        description=(
            "Run the reaper in a thread of each API process (one sweeps per interval, by a "
            "Redis lock); off when a `switchyard reaper` process or the scaler runs it."
        ),
    )
    reconcile_after_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Seconds a queued job may lack a broker message (not waiting in its queue, not "
            "freshly delivered) before the reaper sends it again."
        ),
    )
    finish_retry_s: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description=(
            "Seconds a worker keeps retrying a job's final row while the database is "
            "unreachable; after that the reaper re-runs the job."
        ),
    )
    worker_synchronous_commit: bool = Field(
        default=False,
        description=(
            "A worker's writes to the jobs table (the claim, the final row, a re-queue) wait "
            "until the database has flushed them to disk. Off: each returns once written "
            "and visible to every reader (Postgres flushes within about 0.6 s; SQLite at "
            "its next checkpoint); a crash of the database server (SQLite: of the machine) "
            "in that moment loses those transitions, which the reaper and the reconciler "
            "redo. The API's insert of a submitted job always waits."
        ),
    )
    worker_prune_after_s: float = Field(
        default=3600.0,
        gt=0,
        description="Seconds a lost worker stays listed (as lost) before it is pruned.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest request body the API accepts, in bytes."
    )
    torch_threads: int = Field(
        default=0, ge=0, description="Threads torch may use in a worker; 0 keeps torch's default."
    )
    native_kernels: bool = Field(
        default=True,
        description=(
            "Compile (once per machine, with the system's C compiler) and use the engine's own"
            " CPU kernels for int4 models; off, or without a compiler, PyTorch's int4 kernel runs."
        ),
    )
    engine_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description=(
            "How much lower than its process a CPU worker's engine computes in the OS's priority"
            " (nice, per thread on Linux): the API, Redis, the database and the worker's own job"
            " threads sharing its cores get the CPU at once when they need it, and the engine"
            " takes the rest; 0 leaves it at its process's priority."
        ),
    )
    prefix_caching: bool = Field(
        default=True,
        description=(
            "A worker's engine keeps a finished request's keys and values in its slot and"
            " prefills only what a new request does not share with them; off, every prompt is"
            " prefilled in full (reused keys may differ from recomputed ones in the last bits)."
        ),
    )
    native_cache: str = Field(
        default="",
        description=(
            "Folder for the compiled native kernels; empty: ~/.cache/switchyard/native, else one"
            " in the system's temporary folder."
        ),
    )
    default_model: str = Field(
        default="smollm2-135m", description="Model the local launcher starts a worker for."
    )
    api_host: str = Field(default="127.0.0.1", description="Address the API listens on.")
    api_port: int = Field(default=8000, ge=1, le=65535, description="Port the API listens on.")
    api_threads: int = Field(
        default=64,
        ge=2,
        le=4096,
        description=(
            "Threads per gunicorn worker under api_worker_class 'gthread', where each open "
            "websocket or SSE stream holds one (unused by 'gevent')."
        ),
    )
    api_workers: int = Field(default=2, ge=1, le=64, description="gunicorn worker processes.")
    api_worker_class: Literal["gevent", "gthread"] = Field(
        default="gevent",
        description=(
            "gunicorn worker class: 'gevent' (a stream is a greenlet of a few KiB) or "
            "'gthread' (a stream holds one of api_threads threads)."
        ),
    )
    api_worker_connections: int = Field(
        default=10_000,
        ge=10,
        le=100_000,
        description=(
            "Open connections (streams included) per gevent API process; with api_workers "
            "processes a host holds api_workers x this."
        ),
    )
    api_trusted_proxies: int = Field(
        default=0,
        ge=0,
        le=10,
        description=(
            "Reverse proxies in front of the API whose X-Forwarded-For/-Proto/-Host are "
            "trusted (Werkzeug's ProxyFix); 0: the connecting address is the client's."
        ),
    )
    db_pool_size: int = Field(
        default=10, ge=1, le=200, description="Database connections kept open per process."
    )
    db_max_overflow: int = Field(
        default=0,
        ge=0,
        le=200,
        description=(
            "Database connections a process may open beyond db_pool_size under load. "
            "0: a burst waits for a pooled connection (each query holds one for about "
            "a millisecond) instead of opening and closing new ones by the hundred."
        ),
    )
    streams_per_process: int = Field(
        default=8000,
        ge=1,
        description=(
            "Open websocket and SSE streams per API process; past it a new stream gets 503 "
            "(SSE) or close code 1013 'try again later' (websocket)."
        ),
    )
    streams_per_user: int = Field(
        default=2000,
        ge=0,
        description=(
            "Open websocket and SSE streams per user (admins: no limit) across the API; "
            "0: no limit."
        ),
    )
    streams_per_address: int = Field(
        default=100,
        ge=0,
        description=(
            "Open websocket and SSE streams without a token per client address; 0: no limit."
        ),
    )
    ws_anonymous_idle_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Seconds a /v1/ws socket without a token may stay open with no job running "
            "before it is closed (1000 'idle')."
        ),
    )
    token_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description=(
            "Seconds an API process keeps a valid token's lookup; a revocation, expiry or "
            "role change takes effect within it. 0: look the token up on every request."
        ),
    )
    ws_token_check_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description=(
            "Seconds between two checks of an open websocket's token: a revoked or "
            "expired token closes the socket (1008)."
        ),
    )
    scaler_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Seconds between two scaler ticks (a wake-up from the API ticks at once).",
    )
    task_events: bool = Field(
        default=True,
        description=(
            "Workers send Celery's task events and event heartbeats, so Flower (or "
            "`celery events`) on the same broker sees the workers and their jobs (from "
            "task-received on; the API sends no task-sent events); off: none are sent."
        ),
    )
    history_retention_s: int = Field(
        default=7 * 86_400,
        ge=0,
        le=366 * 86_400,
        description=(
            "Seconds the farm keeps its history (per-model one-minute rollups, scaling "
            "decisions, job recoveries); the scaler leader prunes older rows. 0: no history "
            "is recorded."
        ),
    )
    scaler_lock_ttl_s: float = Field(
        default=15.0,
        gt=0,
        le=600,
        description=(
            "Seconds the scaler leader lock lives unless renewed; a standby scaler takes over "
            "this long after the leader dies. Above scaler_interval_s."
        ),
    )
    scaler_executor: str = Field(
        default="local",
        pattern=r"^(local|kubernetes|none)$",
        description=(
            "What applies the scaler's replica counts: 'local' processes, 'kubernetes', or "
            "'none' (decide, record and reap only; replicas are managed elsewhere)."
        ),
    )
    drain_grace_s: float = Field(
        default=1800.0,
        ge=0,
        description=(
            "Seconds a draining local worker may take to finish its running jobs after SIGTERM "
            "before it is killed; at least job_timeout_s to never cut a job short."
        ),
    )
    restart_backoff_s: float = Field(
        default=2.0,
        gt=0,
        description="Seconds before a crashed local worker is restarted; doubles per crash.",
    )
    restart_backoff_max_s: float = Field(
        default=300.0,
        gt=0,
        description="Longest wait, in seconds, before restarting a worker that keeps crashing.",
    )
    cuda_visible_devices: str = Field(
        default="",
        pattern=r"^[0-9A-Za-z,:-]*$",
        description=(
            "GPUs the local executor hands out, one per worker (CUDA_VISIBLE_DEVICES, "
            "comma-separated); empty: workers get no GPU assignment."
        ),
    )
    max_replicas_per_model: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description=(
            "Most replicas one model may be given, in processes or pods: a manual count, a "
            "max_replicas or a window above it is refused (422), and the scaler never asks "
            "for more, whatever a model definition says."
        ),
    )
    max_local_replicas: int = Field(
        default=16,
        ge=1,
        le=1024,
        description=(
            "Most worker processes the local executor runs on this host, all models and "
            "draining ones together; past it a model gets fewer replicas than asked (logged)."
        ),
    )
    k8s_namespace: str = Field(
        default="switchyard",
        description="Kubernetes namespace of the worker Deployments (kubernetes executor).",
    )
    k8s_deployment: str = Field(
        default="switchyard-worker-{model}",
        description="Name of a model's worker Deployment; {model} is the model name.",
    )
    max_queue_length: int = Field(
        default=1000,
        ge=1,
        description=(
            "Jobs that may wait in one model's queue; beyond it submissions get 429. "
            "A model definition's limits.max_queue_length wins."
        ),
    )
    queue_deadline_s: int = Field(
        default=3600,
        ge=0,
        description=(
            "Seconds a job may wait in the queue before it expires unstarted (failed, "
            "error 'expired'); a request may ask for less. 0: jobs never expire."
        ),
    )
    retry_after_s: int = Field(
        default=5,
        ge=1,
        le=3600,
        description="Seconds a 429 for a full queue or too many running jobs asks to wait.",
    )
    token_touch_interval_s: int = Field(
        default=60,
        ge=0,
        description=(
            "Seconds between two writes of a token's last-used time (0: on every request)."
        ),
    )
    stream_keepalive_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description=(
            "Seconds of silence after which an SSE stream (job events, OpenAI, TGI) sends a "
            "keep-alive; a vanished client is noticed (and, on OpenAI/TGI, its job "
            "cancelled) on such a write."
        ),
    )
    anonymous_max_concurrent_jobs: int = Field(
        default=2,
        ge=0,
        description="Queued+running jobs per client address without a token; 0: no limit.",
    )
    anonymous_requests_per_minute: int = Field(
        default=20,
        ge=0,
        description="Generation requests per minute per address without a token; 0: no limit.",
    )
    lookup_factor: int = Field(
        default=10,
        ge=0,
        le=1000,
        description=(
            "Lookups (/tokenize, /v1/models) a caller may make per minute, as a multiple of "
            "their generation requests per minute (0: not counted)."
        ),
    )
    user_max_concurrent_jobs: int = Field(
        default=8, ge=0, description="Queued+running jobs per user of role 'user'; 0: no limit."
    )
    user_requests_per_minute: int = Field(
        default=120, ge=0, description="Generation requests per minute per 'user'; 0: no limit."
    )
    operator_max_concurrent_jobs: int = Field(
        default=64, ge=0, description="Queued+running jobs per operator; 0: no limit."
    )
    operator_requests_per_minute: int = Field(
        default=600, ge=0, description="Generation requests per minute per operator; 0: no limit."
    )
    admin_max_concurrent_jobs: int = Field(
        default=0, ge=0, description="Queued+running jobs per admin; 0: no limit."
    )
    admin_requests_per_minute: int = Field(
        default=0, ge=0, description="Generation requests per minute per admin; 0: no limit."
    )
    token_ttl_days: float = Field(
        default=90.0,
        ge=0,
        le=3650,
        description=(
            "Days a new API token lives when its creator gives no expiry (CLI `token create`, "
            "POST /v1/admin/users/<name>/tokens); 0: new tokens never expire by default."
        ),
    )
    first_token_ttl_h: float = Field(
        default=24.0,
        gt=0,
        le=24 * 365,
        description=(
            "Hours the admin token printed at the first `switchyard run` lives: long enough to "
            "create named tokens with it, not a credential to keep."
        ),
    )
    allowed_origins: str = Field(
        default="",
        max_length=4096,
        pattern=r"^\s*(\*|(https?://[A-Za-z0-9.\-\[\]:]+\s*(,\s*https?://[A-Za-z0-9.\-\[\]:]+\s*)*))?\s*$",
        description=(
            "Browser origins besides the API's own that may use it: open websockets, and read "
            "answers (CORS), comma-separated (https://chat.example.com); '*' any origin; "
            "empty: same origin only. Requests from other origins that change state, and "
            "their websockets, are refused (403)."
        ),
    )
    metrics_token_required: bool = Field(
        default=False,
        description=(
            "GET /metrics needs an operator's or admin's API token (scrapers send it as a "
            "bearer token); off, /metrics is open, like most exporters."
        ),
    )
    log_level: str = Field(
        default="INFO",
        pattern=r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)$",
        description="Log level of every Switchyard process.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description=(
            "How every Switchyard process writes its log on stderr: 'text' lines, or 'json' "
            "(one object a line: time, level, logger, message, and a job event's job_id, "
            "model, worker, attempt and request_id as fields)."
        ),
    )

    @field_validator("database_url")
    @classmethod
    def _postgres_driver(cls, url: str) -> str:
        return with_postgres_driver(url)

    @model_validator(mode="before")
    @classmethod
    def _sqlite_in_state_dir(cls, values: Any) -> Any:
        # The default database lives in the state folder, wherever that is set.
        if isinstance(values, dict) and "database_url" not in values and "state_dir" in values:
            values = {
                **values,
                "database_url": f"sqlite:///{Path(values['state_dir'])}/switchyard.db",
            }
        return values

    def key(self, *parts: str) -> str:
        """A Redis key under this deployment's prefix."""
        return ":".join((self.redis_prefix, *parts))

    @property
    def scaler_alive_file(self) -> Path:
        """Touched by a scaler's loop at every turn (its liveness probe reads the age)."""
        return self.state_dir / "scaler.alive"

    def origins(self) -> frozenset[str]:
        """The allowed origins besides the API's own, normalised (no trailing slash)."""
        return frozenset(
            o.strip().rstrip("/").lower() for o in self.allowed_origins.split(",") if o.strip()
        )


def with_postgres_driver(url: str) -> str:
    """``postgres://`` and ``postgresql://`` URLs with the installed driver named.

    SQLAlchemy reads a bare ``postgresql://`` as psycopg 3 (and rejects
    ``postgres://``); Switchyard installs psycopg2. A URL naming its driver
    (``postgresql+psycopg://``) is left as it is.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgres", "postgresql"):
        return url
    driver = "psycopg2"
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg"):
        driver = "psycopg"
    return f"postgresql+{driver}://{rest}"


_UNPREFIXED = {
    "database_url": "DATABASE_URL",
    "redis_url": "REDIS_URL",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
}


def variable_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    return _UNPREFIXED.get(field, PREFIX + field.upper())


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Build :class:`Settings` from ``environ`` (default: ``os.environ``).

    ``overrides`` win over the environment (tests, the local launcher).
    Raises :class:`SettingsError` naming the first bad variable, or an unknown
    ``SWITCHYARD_*`` variable (a typo would otherwise be silently ignored).
    """
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    known = {variable_name(name): name for name in Settings.model_fields}
    for var, value in env.items():
        if var in known:
            values[known[var]] = value
        elif var.startswith(PREFIX):
            raise SettingsError(var, "unknown setting")
    values.update(overrides)
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        raise SettingsError(variable_name(field), first["msg"]) from None

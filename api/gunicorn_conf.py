"""gunicorn settings for the API, from Switchyard's settings.

The ``gevent`` worker by default: every request, websocket and SSE stream is a
greenlet (a few KiB and no OS thread), so one process holds thousands of
streams; ``api_worker_connections`` bounds them per process. gunicorn patches
the standard library before the app is imported, so redis-py, Celery's
producer and simple-websocket's reader "threads" cooperate; psycopg2 is made
to cooperate in :func:`post_fork` (psycogreen). ``SWITCHYARD_API_WORKER_CLASS=
gthread`` goes back to a thread per stream (``api_workers x api_threads``
streams). Measured in bench/LOAD.md: 10,000 streams on one host under gevent,
where gthread would need 10,000 threads.
"""

import gc
import logging
import resource
from typing import Any

from config import load_settings

_settings = load_settings()
GC_THRESHOLDS = (50_000, 20, 100)  # CPython's defaults: (700, 10, 10)

bind = f"{_settings.api_host}:{_settings.api_port}"
worker_class = _settings.api_worker_class
workers = _settings.api_workers
if worker_class == "gthread":
    threads = _settings.api_threads
    # gthread accepts at most worker_connections clients per process (default
    # 1000), threads or not: keep it at least the thread count.
    worker_connections = max(1000, _settings.api_threads * 2)
else:
    worker_connections = _settings.api_worker_connections
# Long-lived streams must not be killed as "silent" workers; gevent's and
# gthread's main loops keep the heartbeat alive while streams wait, so 30 s is enough.
timeout = 30
graceful_timeout = 20
keepalive = 5
# A burst of thousands of connections must queue in the kernel, not be refused.
backlog = 4096
accesslog = "-"
# The path without its query string: a browser may pass ?token=… and secrets
# never belong in a log.
access_log_format = '%(h)s "%(m)s %(U)s %(H)s" %(s)s %(b)s %(M)sms "%(a)s"'
errorlog = "-"
loglevel = _settings.log_level.lower()
if _settings.log_format == "json":
    # gunicorn's own lines (start, workers, the access log) in the app's JSON shape too;
    # the app's records reach stderr through the handler of config.logs.
    logconfig_dict = {
        "root": {"level": _settings.log_level, "handlers": []},
        "loggers": {
            name: {"level": level, "handlers": ["json"], "propagate": False, "qualname": name}
            for name, level in (
                ("gunicorn.error", _settings.log_level),
                ("gunicorn.access", "INFO"),
            )
        },
        "handlers": {
            "json": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "formatters": {"json": {"()": "config.logs.JsonFormatter"}},
    }


class _SlowClientRecord(logging.Filter):
    """One line, not a traceback, for a stream closed because its client stopped reading.

    The API puts a send timeout on an SSE client's socket
    (``SWITCHYARD_WS_SEND_TIMEOUT_S``); when it fires, gunicorn logs the
    ``TimeoutError`` as "Socket error processing request." with its traceback.
    That is the mechanism working, not a server error.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, TimeoutError) and "Socket error" in str(record.msg):
            record.msg = "closed a client that stopped reading (send timed out)"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _raise_open_files(wanted: int) -> None:
    """Raise this process's soft limit of open files towards ``wanted`` (at most the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def on_starting(_server: object) -> None:
    # Every stream is a socket: room for them plus the process's own files.
    _raise_open_files(worker_connections + 1024)


def post_fork(_server: object, _worker: object) -> None:
    logging.getLogger("gunicorn.error").addFilter(_SlowClientRecord())
    _raise_open_files(worker_connections + 1024)
    if worker_class == "gevent":
        # psycopg2 waits for Postgres in C; psycogreen's wait callback makes it
        # yield to other greenlets instead of blocking the whole process.
        from psycogreen.gevent import patch_psycopg

        patch_psycopg()


def post_worker_init(worker: Any) -> None:
    # The app's loops (the reaper, when reaper_in_api) start after the fork, in
    # the process that serves, and stop with it.
    _services_of(worker).start_background()
    # Ten thousand open streams are millions of objects the cyclic collector
    # walks at every full collection: /healthz p99 was 100-820 ms with them
    # open, 7-26 ms with what was loaded before serving frozen out of its
    # reach and collections 70 times rarer (bench/LOAD.md).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def worker_exit(_server: object, worker: Any) -> None:
    _services_of(worker).close()


def _services_of(worker: Any) -> Any:
    from api.services import EXTENSION

    return worker.wsgi.extensions[EXTENSION]

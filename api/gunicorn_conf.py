"""gunicorn settings for the API, from Switchyard's settings.

The ``gthread`` worker: each websocket or SSE stream holds a thread for its
life, which flask-sock supports without monkey-patching, so psycopg2, redis-py
and Celery's producer stay ordinary blocking libraries. Capacity is
``api_workers × api_threads`` concurrent streams (128 by default).
"""

import logging

from config import load_settings

_settings = load_settings()

bind = f"{_settings.api_host}:{_settings.api_port}"
worker_class = "gthread"
workers = _settings.api_workers
threads = _settings.api_threads
# gthread accepts at most worker_connections clients per process (default 1000),
# threads or not: keep it at least the thread count so every thread can stream.
worker_connections = max(1000, _settings.api_threads * 2)
# Long-lived streams must not be killed as "silent" workers; a request's own
# thread keeps the worker's heartbeat alive in gthread, so 30 s is enough.
timeout = 30
graceful_timeout = 20
keepalive = 5
accesslog = "-"
# The path without its query string: a browser may pass ?token=… and secrets
# never belong in a log.
access_log_format = '%(h)s "%(m)s %(U)s %(H)s" %(s)s %(b)s %(M)sms "%(a)s"'
errorlog = "-"
loglevel = _settings.log_level.lower()


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


def post_fork(_server: object, _worker: object) -> None:
    logging.getLogger("gunicorn.error").addFilter(_SlowClientRecord())

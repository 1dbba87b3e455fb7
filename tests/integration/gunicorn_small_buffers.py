"""gunicorn settings for tests: the API's own, plus a small send buffer on each request's socket.

Loopback sockets autotune their buffers to megabytes, which would absorb a
whole job's stream; a congested path holds a few KB. Used with
``gunicorn -c tests/integration/gunicorn_small_buffers.py``.
"""

import socket
from typing import Any

from api.gunicorn_conf import *  # noqa: F403 - the deployed settings, unchanged

SMALL_SEND_BUFFER = 1024


def pre_request(worker: Any, req: Any) -> None:
    req.unreader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_SEND_BUFFER)

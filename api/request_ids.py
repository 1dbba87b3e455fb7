"""``X-Request-ID``: the id that ties a client's request to the job and its log lines.

A client (or the proxy in front) may send ``X-Request-ID``; the API keeps it
when it is short and printable (1 to :data:`MAX_LENGTH` visible ASCII
characters, no spaces), else makes one (32 hex digits). Every answer carries
the id back in ``X-Request-ID``; a job submitted by the request stores it
(``request_id`` in the job's JSON) and every log line of the job names it
(:mod:`jobs.joblog`). A websocket's id is its handshake's; each job submitted
on one ``/v1/ws`` socket gets one of its own: the ``generate`` frame's
``request_id`` when it is accepted, else ``<socket's id>.<n>`` for the n-th
job of the socket (:func:`request_id_as`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from flask import Flask, Response, g, request

HEADER = "X-Request-ID"
MAX_LENGTH = 128
_ACCEPTED = re.compile(rf"[\x21-\x7e]{{1,{MAX_LENGTH}}}")


def accepted(value: str | None) -> str | None:
    """``value`` if it may be used as a request id as it is; None otherwise."""
    if value is not None and _ACCEPTED.fullmatch(value):
        return value
    return None


def request_id() -> str:
    """This request's id: the client's accepted one, or one made for it (then kept)."""
    found: str | None = g.get("request_id")
    if found is None:
        found = accepted(request.headers.get(HEADER)) or uuid.uuid4().hex
        g.request_id = found
    return found


@contextmanager
def request_id_as(value: str) -> Iterator[None]:
    """Within: :func:`request_id` is ``value`` (one request of a multiplexed socket)."""
    outer = request_id()
    g.request_id = value
    try:
        yield
    finally:
        g.request_id = outer


def _answer_with_id(response: Response) -> Response:
    response.headers[HEADER] = request_id()
    return response


def init_app(app: Flask) -> None:
    """Give every answer of ``app`` its ``X-Request-ID``."""
    app.after_request(_answer_with_id)

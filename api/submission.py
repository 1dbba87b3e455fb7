"""The job service in HTTP terms: every front door's way in and out.

:func:`submit_job` is how the native, OpenAI, TGI and multiplexed front doors
reach :meth:`jobs.service.JobService.submit`: it hands the service what it
reads from the request (client address, request id, idempotency key) and
answers the service's refusals as HTTP errors. :func:`follow_job` is the
shared reading half (each event disclosed for the caller, a lagging reader
as a slow client), :func:`final_event` the wait of a client that wants one
whole answer, and :func:`refuse_socket` / :func:`close_socket` how a
websocket is turned away or closed. The routes of the job resource itself are
in api/jobs.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator
from typing import Any

from flask import request
from simple_websocket import ConnectionClosed

from api.auth import client_address
from api.disclosure import event_for
from api.errors import ApiError, BadRequest, refusal_error
from api.openapi import Header
from api.request_ids import request_id
from api.schemas import JobRequest
from api.services import services
from api.streams import LagWatch, SlowClient, client_gone, send_frame
from db.accounts import Principal
from db.jobs import EXPIRED
from db.schema import Job
from jobs.errors import JobRefused, ReaderLagging
from jobs.events import JobEvent
from jobs.service import JobSpec, Submitted

MAX_IDEMPOTENCY_KEY = 255


# How often a client waiting for a whole answer is looked at (gone: its job is cancelled), s.
CLIENT_CHECK_S = 1.0


IDEMPOTENCY_HEADER = Header(
    "Idempotency-Key",
    "A retried submission with the same key (per user) returns the first job, not a new one; "
    "the key reused for a different request is a 422.",
    {"type": "string", "maxLength": MAX_IDEMPOTENCY_KEY},
)


def idempotency_key_header() -> str | None:
    """The request's ``Idempotency-Key``; 400 when it is not short printable ASCII."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isascii() or not key.isprintable():
        raise BadRequest(
            f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
            field="Idempotency-Key",
        )
    return key


def job_spec(req: JobRequest) -> JobSpec:
    """What ``req`` makes a job of, as the job service takes it."""
    return JobSpec(
        model=req.model,
        prompt=req.prompt,
        messages=[m.model_dump() for m in req.messages] if req.messages is not None else None,
        params=req.params.given(),
        deadline_s=req.deadline_s,
    )


def submit_job(
    req: JobRequest, principal: Principal | None, *, idempotency_key: str | None = None
) -> Submitted:
    """Submit ``req`` for this request's client (:meth:`jobs.service.JobService.submit`).

    The submission path of every front door: the client's address and the
    request id come from the request, and a refusal is raised as the
    :class:`ApiError` it is answered with (:func:`api.errors.refusal_error`):
    404 unknown or disabled model, 401 private model without a token, 422 a
    parameter over the model's limits or an idempotency key reused for another
    request, 503 a model that can never get a worker or a queue that is down,
    429 (with Retry-After) a full queue or a caller over their limits.
    """
    try:
        return services().job_service.submit(
            job_spec(req),
            principal,
            address=client_address(),
            request_id=request_id(),
            idempotency_key=idempotency_key,
        )
    except JobRefused as exc:
        raise refusal_error(exc) from None


class JobFailed(ApiError):
    """A job that ended in error, given to a client that waited for its answer.

    A worker's error names the field it refused (``prompt: …``) when the
    request was at fault: that is a 400. A deadline that passed in the queue is
    a 503 (retry when the farm is less busy); anything else failed on the
    worker's side.
    """

    def __init__(self, error: str) -> None:
        field, sep, _ = error.partition(": ")
        if error == EXPIRED:
            super().__init__("the job waited in the queue past its deadline (expired)")
            self.status, self.error_type = 503, "expired"
        elif sep and (field in ("prompt", "messages") or field.startswith("params")):
            super().__init__(error, field=field)
            self.status, self.error_type = 400, "invalid_request"
        else:
            super().__init__(f"generation failed: {error}")
            self.status, self.error_type = 500, "generation_error"


def follow_job(
    job: Job,
    after: int = -1,
    *,
    idle_s: float,
    watch: LagWatch | None = None,
    full: bool = False,
) -> Generator[JobEvent | None, None, None]:
    """Every event of ``job`` after seq ``after``, ending after the final one
    (:meth:`jobs.service.JobService.follow`: keep-alive Nones, deadlines, the
    row's final event when the stream lost it).

    Without ``full`` (operators' streams) events lose their internals: worker
    names and the text of errors not worded for clients (api/disclosure.py).
    With ``watch`` (a websocket's), :class:`SlowClient` is raised once the
    subscription's buffer overflowed: the socket's reader is too slow.
    """
    try:
        for event in services().job_service.follow(job, after, idle_s=idle_s, watch=watch):
            yield event if event is None else event_for(event, full)
    except ReaderLagging:
        raise SlowClient("the subscription is lagging") from None


def restart_error(fields: dict[str, Any]) -> str:
    """The error a stream that cannot take text back ends with, on a ``restart`` event."""
    reason = str(fields.get("reason") or "unknown reason")
    return f"the answer could not be continued after its worker was lost ({reason})"


def final_event(job: Job, *, idle_s: float) -> JobEvent:
    """Wait for ``job``'s ``done`` event; :class:`JobFailed` on an ``error`` event.

    For a client waiting on one answer (a non-streaming completion): its
    socket is looked at every :data:`CLIENT_CHECK_S` seconds, and a client
    that has gone away gets its job cancelled, as a streaming client's does,
    and :class:`ClientClosed`.
    """
    next_check = time.monotonic() + CLIENT_CHECK_S
    for event in follow_job(job, idle_s=min(idle_s, CLIENT_CHECK_S)):
        if event is not None and event.final:
            if event.type == "error":
                raise JobFailed(str(event.fields.get("error") or "error"))
            return event
        now = time.monotonic()
        if now >= next_check:
            next_check = now + CLIENT_CHECK_S
            if client_gone():
                services().job_service.cancel(job.id)
                raise ClientClosed(f"the client went away; job {job.id} was cancelled")
    raise JobFailed("the event stream ended without a final event")  # pragma: no cover


class ClientClosed(ApiError):
    """The client left before its answer: nginx's 499, which nobody reads."""

    status = 499
    error_type = "client_closed_request"


def refuse_socket(ws: Any, exc: ApiError) -> None:
    """Answer a websocket that may not stream with an ``error`` frame and a close code
    that says why: 1008 (auth), the cap's (stream caps), 4000 + the status otherwise."""
    frame = {"type": "error", **exc.body(), "status": exc.status}
    retry = exc.headers.get("Retry-After")
    if retry is not None:
        frame["retry_after"] = int(retry)
    code = getattr(exc, "close_code", None)
    if code is None:
        code = 1008 if exc.status in (401, 403) else 4000 + exc.status
    with contextlib.suppress(ConnectionClosed, SlowClient):
        send_frame(ws, json.dumps(frame), services().settings.ws_send_timeout_s)
    close_socket(ws, code, exc.message[:120])


def close_socket(ws: Any, code: int, message: str) -> None:
    """Close ``ws`` with ``code`` (the close frame written whole, after every frame before
    it); a socket the client closed first is left alone."""
    with contextlib.suppress(ConnectionClosed, OSError):
        ws.close(reason=code, message=message)

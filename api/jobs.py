"""The job resource: submit, list, read, cancel, and stream (websocket and SSE).

:func:`submit_job` is every front door's way into
:meth:`jobs.service.JobService.submit` (native, OpenAI, TGI, the multiplexed
websocket): it hands the service what it reads from the request (client
address, request id) and answers its refusals in HTTP. :func:`follow_job` is
the shared reading half.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Generator, Iterator
from typing import Any, Literal

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ConfigDict, Field
from simple_websocket import ConnectionClosed

from api.auth import (
    CLOSE_TOKEN_INVALID,
    CLOSE_TOKEN_INVALID_REASON,
    TokenRecheck,
    client_address,
    optional_principal,
    presented_token,
    require_principal,
)
from api.disclosure import event_for, public_error, sees_internals
from api.errors import (
    ApiError,
    BadRequest,
    Forbidden,
    NotFound,
    Unauthorized,
    ValidationFailed,
    refusal_error,
)
from api.openapi import Header, spec
from api.request_ids import request_id
from api.schemas import JobRequest, json_body, parse
from api.services import services
from api.sock import sock
from api.streams import (
    LagWatch,
    SlowClient,
    client_gone,
    drop_laggard,
    send_frame,
    sse_response,
)
from api.waiting import WaitingWatch
from db.accounts import Principal
from db.jobs import EXPIRED
from db.schema import Job
from jobs.errors import JobRefused, ReaderLagging
from jobs.events import JobEvent
from jobs.service import JobSpec, Submitted

log = logging.getLogger(__name__)

bp = Blueprint("jobs", __name__)

MAX_IDEMPOTENCY_KEY = 255
# How often a client waiting for a whole answer is looked at (gone: its job is cancelled), s.
CLIENT_CHECK_S = 1.0

IDEMPOTENCY_HEADER = Header(
    "Idempotency-Key",
    "A retried submission with the same key (per user) returns the first job, not a new one; "
    "the key reused for a different request is a 422.",
    {"type": "string", "maxLength": MAX_IDEMPOTENCY_KEY},
)


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def job_view(job: Job, full: bool = False) -> dict[str, Any]:
    """The public JSON shape of a job; ``full`` (operators) adds the internals.

    Without ``full`` the error is the client's version (api/disclosure.py) and
    the worker that ran the job is not named.
    """
    return {
        "id": job.id,
        "model": job.model,
        "status": job.status,
        "output_text": job.output_text,
        "finish_reason": job.finish_reason,
        "usage": {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
        },
        "error": job.error if full else public_error(job.error),
        "attempts": job.attempts,
        "worker": job.worker if full else None,
        "request_id": job.request_id,
        "params": job.params,
        "timestamps": {
            "queued": _iso(job.created_at),
            "started": _iso(job.started_at),
            "first_token": _iso(job.first_token_at),
            "finished": _iso(job.finished_at),
            "deadline": _iso(job.deadline_at),
        },
        "stream": stream_urls(job.id),
    }


def stream_urls(job_id: str) -> dict[str, str]:
    return {"ws": f"/v1/jobs/{job_id}/ws", "events": f"/v1/jobs/{job_id}/events"}


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


def visible_job(job_id: str, principal: Principal | None, *, shared: bool = False) -> Job:
    """A job the caller may see (and cancel); 404 for unknown ids and other users' jobs alike.

    A user's job: its owner, operators and admins. An anonymous job (a public
    model, no token): whoever has its id, which is a capability like a
    capability URL (122 random bits, only ever given to its submitter).

    ``shared`` (a stream opening): an unfinished job's row may come from the
    process's row cache (:meth:`jobs.service.JobService.job_row`, dropped when
    a stream here sees the job end): its owner never changes, and the stream
    itself says how the job goes on. Ten thousand sockets following two
    hundred jobs then read two hundred rows, not ten thousand.
    """
    svc = services()
    job = svc.job_service.job_row(job_id) if shared else svc.jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    if job.user_id is not None:
        if principal is None:
            raise Unauthorized()
        if job.user_id != principal.user_id and not principal.sees_all_jobs:
            raise NotFound(f"no job {job_id!r}")
    return job


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


class JobListQuery(BaseModel):
    """Query of ``GET /v1/jobs``."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(default=20, ge=1, le=100, description="Jobs per page.")
    before: str | None = Field(
        default=None, max_length=64, description="next_before of the previous page."
    )
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = None
    model: str | None = Field(default=None, max_length=64)
    all: bool = Field(default=False, description="Every user's jobs (operators and admins).")


@bp.post("/v1/jobs")
@spec(
    "Submit a job",
    tags=("jobs",),
    body=JobRequest,
    headers=(IDEMPOTENCY_HEADER,),
    success=202,
    description="Private models need a token. 429 with Retry-After when a limit is full.",
)
def create_job() -> tuple[Response, int]:
    principal = optional_principal()
    req = parse(JobRequest, json_body())
    submitted = submit_job(req, principal, idempotency_key=idempotency_key_header())
    job = submitted.job
    body = {"id": job.id, "status": job.status, "model": job.model, "stream": stream_urls(job.id)}
    response = jsonify(body)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response, 202


@bp.get("/v1/jobs")
@spec("List the caller's jobs, newest first", tags=("jobs",), query=JobListQuery, auth="required")
def list_jobs() -> Response:
    principal = require_principal()
    query = parse(JobListQuery, request.args.to_dict())
    if query.all and not principal.sees_all_jobs:
        raise Forbidden("all: only operators and admins see every user's jobs", field="all")
    svc = services()
    before = None
    if query.before is not None:
        before = svc.jobs.get(query.before)
        if before is None or (before.user_id != principal.user_id and not principal.sees_all_jobs):
            raise ValidationFailed("before: no such job", field="before")
    jobs = svc.jobs.list_jobs(
        user_id=principal.user_id,
        limit=query.limit + 1,
        before=before,
        status=query.status,
        model=query.model,
        all_users=query.all,
    )
    page = jobs[: query.limit]
    has_more = len(jobs) > query.limit
    return jsonify(
        {
            "object": "list",
            "data": [job_view(j, sees_internals(principal)) for j in page],
            "has_more": has_more,
            "next_before": page[-1].id if has_more and page else None,
        }
    )


@bp.get("/v1/jobs/<job_id>")
@spec("A job's state and result", tags=("jobs",))
def get_job(job_id: str) -> Response:
    principal = optional_principal()
    job = visible_job(job_id, principal)
    return jsonify(job_view(job, sees_internals(principal)))


@bp.delete("/v1/jobs/<job_id>")
@spec(
    "Cancel a job",
    tags=("jobs",),
    description="Whoever may read a job may cancel it: an anonymous job, anyone with its id.",
)
def cancel_job(job_id: str) -> tuple[Response, int]:
    principal = optional_principal()
    svc = services()
    job = visible_job(job_id, principal)
    result = services().job_service.cancel(job_id)
    job = svc.jobs.get(job_id) or job
    full = sees_internals(principal)
    if result == "cancel_requested":
        return jsonify({**job_view(job, full), "cancel_requested": True}), 202
    return jsonify(job_view(job, full)), 200


def _after_param(raw: str | None) -> int:
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise ValidationFailed("after: must be an integer event seq", field="after") from None
    if value < -1:
        raise ValidationFailed("after: must be -1 or more", field="after")
    return value


@bp.get("/v1/jobs/<job_id>/events")
@spec(
    "A job's events as server-sent events (id = seq; Last-Event-ID or ?after= resumes)",
    tags=("jobs",),
    stream=True,
)
def job_events(job_id: str) -> Response:
    """Server-sent events: ``id`` is the seq, ``event`` the type, ``data`` the JSON."""
    principal = optional_principal(door="event_stream")
    job = visible_job(job_id, principal, shared=True)
    after = _after_param(request.headers.get("Last-Event-ID") or request.args.get("after"))
    svc = services()
    settings = svc.settings
    stream = svc.caps.take(principal, client_address())  # 429/503 past the stream caps
    events = follow_job(
        job, after, idle_s=settings.stream_keepalive_s, full=sees_internals(principal)
    )
    waiting = _waiting_watch(job)

    def generate() -> Iterator[str]:
        try:
            yield "retry: 1000\n\n"
            for event in events:
                if event is None:
                    frame = waiting.tick()
                    # No id: a waiting frame is not an event of the job's log.
                    yield (
                        ": keep-alive\n\n"
                        if frame is None
                        else f"event: waiting\ndata: {json.dumps(frame)}\n\n"
                    )
                    continue
                waiting.seen(event)
                yield f"id: {event.seq}\nevent: {event.type}\ndata: {event.to_json()}\n\n"
        finally:
            # Also when a write timed out: the job runs on, Last-Event-ID resumes.
            events.close()
            svc.caps.release(stream)

    response = sse_response(generate(), settings.ws_send_timeout_s)
    # Also when the body never started (the client left first).
    response.call_on_close(lambda: svc.caps.release(stream))
    return response


def job_socket(ws: Any, job_id: str) -> None:
    """Websocket: one JSON text frame per event, closed after ``done`` or ``error``.

    A client that does not take a frame within ``ws_send_timeout_s``, or falls
    ``relay_max_buffered_events`` behind, is closed with 4008 "client too slow".
    A client that left is noticed within ``stream_keepalive_s`` even while the
    job is quiet (queued), so its greenlet is not held until the job ends.
    Past the stream caps (api/streamcaps.py) the socket gets an ``error`` frame
    and is closed with 4029 (the caller's streams) or 1013 (the server's); a
    token revoked or expired while the socket is open closes it with 1008.
    """
    svc = services()
    try:
        principal = optional_principal(door="websocket")
        job = visible_job(job_id, principal, shared=True)
        after = _after_param(request.args.get("after"))
        stream = svc.caps.take(principal, client_address())
    except ApiError as exc:
        refuse_socket(ws, exc)
        return
    try:
        _relay_job(ws, job, after, principal)
    finally:
        svc.caps.release(stream)


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


def _waiting_watch(job: Job) -> WaitingWatch:
    """``?waiting=1``: the stream also carries ``waiting`` frames (api/waiting.py)."""
    asked = request.args.get("waiting", "").lower() in ("1", "true", "yes")
    return WaitingWatch(job.model, asked=asked)


def _relay_job(ws: Any, job: Job, after: int, principal: Principal | None) -> None:
    settings = services().settings
    timeout_s = settings.ws_send_timeout_s
    waiting = _waiting_watch(job)
    watch = LagWatch()
    recheck = TokenRecheck(presented_token(door="websocket"), settings.ws_token_check_s)
    try:
        full = sees_internals(principal)
        for event in follow_job(
            job, after, idle_s=settings.stream_keepalive_s, watch=watch, full=full
        ):
            if not recheck.valid():
                close_socket(ws, CLOSE_TOKEN_INVALID, CLOSE_TOKEN_INVALID_REASON)
                return
            if event is None:
                if not ws.connected:  # gone (or closed for a too big message) meanwhile
                    return
                frame = waiting.tick()
                if frame is not None:
                    send_frame(ws, json.dumps(frame), timeout_s, give_up=lambda: watch.lagging)
                continue
            waiting.seen(event)
            send_frame(ws, event.to_json(), timeout_s, give_up=lambda: watch.lagging)
    except ConnectionClosed:
        return
    except SlowClient as exc:
        # The job runs on; the client may re-attach with ?after=<seq>.
        log.info("websocket of job %s dropped: %s", job.id, exc)
        drop_laggard(ws, exc)
        return
    except Exception:
        # Past the handshake, an error response would be written into the
        # websocket as garbage frames: close with 1011 (internal error)
        # instead; the client may re-attach with ?after=<seq>.
        log.exception("websocket of job %s failed", job.id)
        close_socket(ws, 1011, "internal error")
        return
    # The client may close first, on reading `done`: its socket is gone then.
    close_socket(ws, 1000, "done")


sock.route("/v1/jobs/<job_id>/ws", bp=bp)(
    spec(
        "A job's events over a websocket (re-attach a detached job here; ?after= resumes)",
        tags=("jobs",),
        websocket=True,
    )(job_socket)
)

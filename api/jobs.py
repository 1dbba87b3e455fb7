"""The job resource: submit, list, read, cancel, and stream (websocket and SSE).

Its routes reach the job service through api/submission.py, as every other
front door does (OpenAI, TGI, the multiplexed websocket).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
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
from api.disclosure import public_error, sees_internals
from api.errors import (
    ApiError,
    Forbidden,
    NotFound,
    Unauthorized,
    ValidationFailed,
)
from api.openapi import spec
from api.schemas import JobRequest, json_body, parse
from api.services import services
from api.sock import sock
from api.streams import (
    LagWatch,
    SlowClient,
    drop_laggard,
    send_frame,
    sse_response,
)
from api.submission import (
    IDEMPOTENCY_HEADER,
    close_socket,
    follow_job,
    idempotency_key_header,
    refuse_socket,
    submit_job,
)
from api.waiting import WaitingWatch
from db.accounts import Principal
from db.schema import Job

log = logging.getLogger(__name__)

bp = Blueprint("jobs", __name__)


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

"""The job resource: submit, read, cancel, and stream (websocket and SSE)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context
from kombu.exceptions import OperationalError as BrokerError
from simple_websocket import ConnectionClosed

from api.auth import optional_principal, require_principal
from api.errors import ApiError, NotFound, Unauthorized, Unavailable, ValidationFailed
from api.schemas import JobRequest, json_body, parse
from api.services import services
from api.sock import sock
from db.accounts import Principal
from db.schema import Job, JobStatus
from tasks.celery import GENERATE_TASK
from tasks.events import JobEvent
from tasks.queues import queue_name

log = logging.getLogger(__name__)

bp = Blueprint("jobs", __name__)

# Seconds of silence after which an SSE stream sends a keep-alive comment.
SSE_KEEPALIVE_S = 15.0


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def job_view(job: Job) -> dict[str, Any]:
    """The public JSON shape of a job."""
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
        "error": job.error,
        "attempts": job.attempts,
        "worker": job.worker,
        "params": job.params,
        "timestamps": {
            "queued": _iso(job.created_at),
            "started": _iso(job.started_at),
            "first_token": _iso(job.first_token_at),
            "finished": _iso(job.finished_at),
        },
        "stream": stream_urls(job.id),
    }


def stream_urls(job_id: str) -> dict[str, str]:
    return {"ws": f"/v1/jobs/{job_id}/ws", "events": f"/v1/jobs/{job_id}/events"}


def submit_job(req: JobRequest, principal: Principal | None) -> Job:
    """Record a job, log its ``queued`` event and put it on its model's queue.

    Shared by every front door (native, OpenAI, TGI); raises an :class:`ApiError`
    before anything is stored when the request cannot be served.
    """
    svc = services()
    definition = svc.catalog.get(req.model)
    if definition is None or not definition.enabled:
        raise NotFound(f"model {req.model!r} is not served here", field="model")
    if principal is None and not definition.public:
        raise Unauthorized()
    params = req.params.given()
    max_new = params.get("max_new_tokens")
    if max_new is not None and max_new > definition.limits.max_new_tokens:
        raise ValidationFailed(
            f"params.max_new_tokens: at most {definition.limits.max_new_tokens} for {req.model}",
            field="params.max_new_tokens",
        )
    job_id = str(uuid.uuid4())
    job = svc.jobs.create(
        job_id=job_id,
        model=req.model,
        user_id=principal.user_id if principal else None,
        messages=[m.model_dump() for m in req.messages] if req.messages is not None else None,
        prompt=req.prompt,
        params=params,
    )
    try:
        svc.events.append(job_id, [JobEvent(seq=0, type="queued", fields={"model": req.model})])
        svc.celery.send_task(
            GENERATE_TASK, args=[job_id], task_id=job_id, queue=queue_name(req.model)
        )
    except Exception as exc:  # broker or Redis down: nothing was accepted
        log.warning("could not enqueue job %s: %s", job_id, exc)
        svc.jobs.delete(job_id)
        if isinstance(exc, (BrokerError, OSError)) or "redis" in type(exc).__module__:
            raise Unavailable("the job queue is unavailable; retry shortly") from None
        raise
    return job


def visible_job(job_id: str, principal: Principal | None) -> Job:
    """A job the caller may see; 404 for unknown ids and other users' jobs alike."""
    job = services().jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    if job.user_id is not None:
        if principal is None:
            raise Unauthorized()
        if job.user_id != principal.user_id and not principal.sees_all_jobs:
            raise NotFound(f"no job {job_id!r}")
    return job


@bp.post("/v1/jobs")
def create_job() -> tuple[Response, int]:
    principal = optional_principal()
    req = parse(JobRequest, json_body())
    job = submit_job(req, principal)
    body = {"id": job.id, "status": job.status, "model": job.model, "stream": stream_urls(job.id)}
    response = jsonify(body)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return response, 202


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    job = visible_job(job_id, optional_principal())
    return jsonify(job_view(job))


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> tuple[Response, int]:
    principal = require_principal()
    svc = services()
    job = visible_job(job_id, principal)
    if svc.jobs.cancel_queued(job_id):
        seq = svc.events.last_seq(job_id) + 1
        svc.events.append(
            job_id,
            [JobEvent(seq=seq, type="done", fields={"finish_reason": "cancelled", "text": ""})],
        )
        return jsonify(job_view(svc.jobs.get(job_id) or job)), 200
    job = svc.jobs.get(job_id) or job
    if job.status == JobStatus.running.value:
        svc.events.request_cancel(job_id)
        return jsonify({**job_view(job), "cancel_requested": True}), 202
    return jsonify(job_view(job)), 200


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
def job_events(job_id: str) -> Response:
    """Server-sent events: ``id`` is the seq, ``event`` the type, ``data`` the JSON."""
    visible_job(job_id, optional_principal(allow_query=True))
    after = _after_param(request.headers.get("Last-Event-ID") or request.args.get("after"))
    hub = services().hub
    sub = hub.subscribe(job_id)

    def generate() -> Iterator[str]:
        try:
            yield "retry: 1000\n\n"
            last = after
            while True:
                ended = False
                for event in sub.events(last, idle_timeout=SSE_KEEPALIVE_S):
                    last = event.seq
                    yield f"id: {event.seq}\nevent: {event.type}\ndata: {event.to_json()}\n\n"
                    if event.final:
                        ended = True
                        break
                if ended:
                    return
                yield ": keep-alive\n\n"
        finally:
            sub.close()

    response = Response(stream_with_context(generate()), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    return response


@sock.route("/v1/jobs/<job_id>/ws", bp=bp)
def job_socket(ws: Any, job_id: str) -> None:
    """Websocket: one JSON text frame per event, closed after ``done`` or ``error``."""
    try:
        visible_job(job_id, optional_principal(allow_query=True))
        after = _after_param(request.args.get("after"))
    except ApiError as exc:
        ws.send(json.dumps({"type": "error", **exc.body(), "status": exc.status}))
        ws.close(
            reason=1008 if exc.status in (401, 403) else 4000 + exc.status,
            message=exc.message[:120],
        )
        return
    with services().hub.subscribe(job_id) as sub:
        try:
            for event in sub.events(after):
                ws.send(event.to_json())
        except ConnectionClosed:
            return
    ws.close(reason=1000, message="done")

"""``WS /v1/ws``: one websocket carrying many requests, for a web page.

Client frames (JSON text):

- ``{"type": "generate", "id": "<client id>", "model": …, "messages" | "prompt": …,
  "params": {…}, "detach": false, "deadline_s": …}`` starts a job (the same
  fields and checks as ``POST /v1/jobs``);
- ``{"type": "cancel", "id": …}`` cancels it;
- ``{"type": "ping"}`` is answered ``{"type": "pong"}``.

Server frames, each tagged with the request's ``id``: ``queued`` (with
``job_id`` and ``position``, the jobs of the model queued ahead of it; sent
again whenever the position changes while the job waits), ``started``, ``token`` (``text``),
``restart``, ``done`` (``finish_reason``, ``text``, ``usage``, ``timings``) and
``error`` (``error``, ``error_type``, ``status``, ``field``; a 429 also has
``retry_after``). A malformed frame is answered with an ``error`` frame, the
socket stays open.

Authentication is the connection's: the ``Authorization`` header, the
``bearer.<token>`` subprotocol (browsers: ``new WebSocket(url, ["switchyard",
"bearer." + token])``) or a ``token`` query parameter. A socket without a token
may only use public models; a bad token closes the socket (1008).

Closing the socket cancels its unfinished jobs, except those sent with
``"detach": true``: they run on, and ``/v1/jobs/<job_id>/ws`` re-attaches.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from flask import Blueprint, Flask, current_app
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from simple_websocket import ConnectionClosed

from api.auth import optional_principal
from api.errors import ApiError, BadRequest, NotFound, ValidationFailed
from api.jobs import cancel, follow_job, submit_job
from api.limits import RateLimited
from api.openapi import spec
from api.schemas import JobRequest, field_name
from api.services import services
from api.sock import sock
from api.streams import SlowClient, drop_laggard, send_frame
from db.accounts import Principal
from db.schema import Job, JobStatus

log = logging.getLogger(__name__)

bp = Blueprint("multiplex", __name__)

# Seconds between two looks at a waiting job's queue position.
POSITION_POLL_S = 1.0
MAX_ID = 64


class GenerateFrame(JobRequest):
    """A ``generate`` frame: a job request plus the client's id for it."""

    type: Literal["generate"]
    id: str = Field(min_length=1, max_length=MAX_ID)
    detach: bool = False


class CancelFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["cancel"]
    id: str = Field(min_length=1, max_length=MAX_ID)


@dataclass
class _Request:
    """One request of the socket and the thread relaying its job's events."""

    id: str
    job: Job
    detach: bool
    finished: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class Session:
    """The requests of one socket; its sends are serialised by one lock."""

    def __init__(self, ws: Any, app: Flask, principal: Principal | None) -> None:
        self.ws = ws
        self.app = app
        self.principal = principal
        self.closed = threading.Event()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}

    def send(self, frame: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        data = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
        timeout_s = services().settings.ws_send_timeout_s
        try:
            with self._send_lock:
                if self.closed.is_set():
                    return
                send_frame(self.ws, data, timeout_s)
        except (ConnectionClosed, OSError):
            self.closed.set()
        except SlowClient as exc:
            # Closing cancels the socket's jobs that are not detached, as any close does.
            log.info("multiplexed websocket dropped: %s", exc)
            self.closed.set()
            with self._send_lock:
                drop_laggard(self.ws, exc)

    def send_error(self, request_id: str | None, error: ApiError) -> None:
        frame: dict[str, Any] = {"type": "error", "id": request_id, **error.body()}
        frame["status"] = error.status
        if isinstance(error, RateLimited):
            frame["retry_after"] = error.retry_after_s
        self.send(frame)

    # -- client frames ---------------------------------------------------------

    def handle(self, raw: str | bytes) -> None:
        """Act on one client frame; every failure becomes an ``error`` frame."""
        request_id: str | None = None
        try:
            if isinstance(raw, bytes):
                raise BadRequest("frames are JSON text, not binary")
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):
                raise BadRequest("the frame is not valid JSON") from None
            if not isinstance(data, dict):
                raise ValidationFailed("a frame is a JSON object", field="(frame)")
            if isinstance(data.get("id"), str):
                request_id = data["id"][:MAX_ID]
            kind = data.get("type")
            if kind == "ping":
                self.send({"type": "pong", "id": request_id})
            elif kind == "generate":
                self._generate(_parse(GenerateFrame, data))
            elif kind == "cancel":
                self._cancel(_parse(CancelFrame, data))
            else:
                raise ValidationFailed("type: one of 'generate', 'cancel', 'ping'", field="type")
        except ApiError as exc:
            self.send_error(request_id, exc)

    def _generate(self, frame: GenerateFrame) -> None:
        with self._lock:
            current = self._requests.get(frame.id)
            if current is not None and not current.finished.is_set():
                raise ValidationFailed(f"id: request {frame.id!r} is still running", field="id")
        job = submit_job(frame, self.principal).job
        position = services().jobs.queue_position(job)
        self.send({"type": "queued", "id": frame.id, "job_id": job.id, "position": position})
        req = _Request(id=frame.id, job=job, detach=frame.detach)
        req.thread = threading.Thread(
            target=self._relay, args=(req, position), name=f"ws-relay-{job.id}", daemon=True
        )
        with self._lock:
            self._requests[frame.id] = req
        req.thread.start()

    def _cancel(self, frame: CancelFrame) -> None:
        with self._lock:
            req = self._requests.get(frame.id)
        if req is None:
            raise NotFound(f"id: no request {frame.id!r} on this socket", field="id")
        if not req.finished.is_set():
            cancel(req.job.id)

    # -- job events ------------------------------------------------------------

    def _relay(self, req: _Request, position: int) -> None:
        with self.app.app_context():
            try:
                self._forward(req, position)
            except Exception:  # a relay must never take the socket down
                log.exception("relay of job %s failed", req.job.id)
                self.send(
                    {
                        "type": "error",
                        "id": req.id,
                        "error": "the event relay failed; re-attach with the job id",
                        "error_type": "relay_error",
                        "status": 500,
                        "job_id": req.job.id,
                    }
                )
            finally:
                req.finished.set()

    def _forward(self, req: _Request, position: int) -> None:
        started = False
        for event in follow_job(req.job, idle_s=POSITION_POLL_S):
            if self.closed.is_set():
                return
            if event is None:
                if not started:
                    current = services().jobs.get(req.job.id)
                    if current is not None and current.status == JobStatus.queued.value:
                        now = services().jobs.queue_position(current)
                        if now != position:
                            position = now
                            self.send(
                                {
                                    "type": "queued",
                                    "id": req.id,
                                    "job_id": req.job.id,
                                    "position": now,
                                }
                            )
                continue
            base = {"id": req.id, "job_id": req.job.id, "seq": event.seq}
            if event.type == "queued":
                continue  # already announced, with the position
            if event.type == "started":
                started = True
                self.send({"type": "started", **base})
            elif event.type == "token":
                self.send({"type": "token", **base, "text": event.text})
            elif event.type == "restart":
                self.send({"type": "restart", **base})
            elif event.type == "done":
                self.send({**event.fields, "type": "done", **base})
            elif event.type == "error":
                error = str(event.fields.get("error") or "error")
                expired = error == "expired"
                self.send(
                    {
                        "type": "error",
                        **base,
                        "error": error,
                        "error_type": "expired" if expired else "generation_error",
                        "status": 503 if expired else 500,
                    }
                )

    def close(self) -> None:
        """The socket is gone: cancel what is not detached, stop every relay."""
        self.closed.set()
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            if not req.detach and not req.finished.is_set():
                try:
                    cancel(req.job.id)
                except Exception:  # keep cancelling the others
                    log.exception("could not cancel job %s", req.job.id)


def _parse(schema: type[GenerateFrame] | type[CancelFrame], data: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = field_name(first["loc"])
        raise ValidationFailed(f"{name}: {first['msg']}", field=name) from None


def multiplex(ws: Any) -> None:
    try:
        principal = optional_principal(allow_query=True)
    except ApiError as exc:
        ws.send(json.dumps({"type": "error", "id": None, **exc.body(), "status": exc.status}))
        ws.close(reason=1008, message=exc.message[:120])
        return
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    session = Session(ws, app, principal)
    try:
        while not session.closed.is_set():
            raw = ws.receive()
            if raw is None:
                break
            session.handle(raw)
    except ConnectionClosed:
        pass
    finally:
        session.close()


sock.route("/v1/ws", bp=bp)(
    spec(
        "One websocket for many requests (generate / cancel / ping frames)",
        tags=("jobs",),
        websocket=True,
        description=__doc__ or "",
    )(multiplex)
)

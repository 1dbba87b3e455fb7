"""``WS /v1/ws``: one websocket carrying many requests, for a web page.

Client frames (JSON text):

- ``{"type": "generate", "id": "<client id>", "model": …, "messages" | "prompt": …,
  "params": {…}, "detach": false, "deadline_s": …, "request_id": …}`` starts a
  job (the same fields and checks as ``POST /v1/jobs``; ``request_id``, optional,
  is what ``X-Request-ID`` is to a POST, else ``<the socket's id>.<n>``);
- ``{"type": "cancel", "id": …}`` cancels it;
- ``{"type": "ping"}`` is answered ``{"type": "pong"}``.

Server frames, each tagged with the request's ``id``: ``queued`` (with
``job_id``, ``request_id`` and ``position``, the jobs of the model queued ahead of it; sent
again whenever the position changes while the job waits), ``waiting`` while
the model has no ready worker (``replicas_starting``, ``progress`` in %,
``eta_s``: api/waiting.py; sent again as they change), then the job's
events with the same fields as on ``/v1/jobs/<id>/ws`` plus ``id`` and
``job_id``: ``started`` (``attempt``, ``worker``), ``token`` (``text``),
``resumed`` (``attempt``, ``worker``, ``tokens``, ``previous_worker``: the
answer continues after a lost worker), ``restart`` (``reason``, ``attempt``,
``worker``: it starts again), ``done`` (``finish_reason``,
``text``, ``usage``, ``timings``) and ``error`` (``error``, ``error_type``,
``status``, ``field``; a 429 also has ``retry_after``). A malformed frame is
answered with an ``error`` frame, the socket stays open.

Limits: a message above ``ws_max_message_bytes`` closes the socket with 1009;
messages beyond ``ws_max_messages_per_s`` (a token bucket holding
``ws_message_burst``) are each answered with an ``error`` frame of
``error_type`` ``rate_limited`` (status 429, ``retry_after``) and not acted on;
the ``ws_message_burst``-th refusal in a row closes the socket with 1008
instead. A client that reads too slowly is closed with 4008, as on a job's socket.

Authentication is the connection's: the ``Authorization`` header, the
``bearer.<token>`` subprotocol (browsers: ``new WebSocket(url, ["switchyard",
"bearer." + token])``); a ``token`` query parameter is refused (401, 1008). A socket without a token
may only use public models, and is closed with 4408 "idle" after
``ws_anonymous_idle_s`` with no job running; a bad token closes the socket
(1008), and so does a token revoked or expired while the socket is open
(checked every ``ws_token_check_s``). Past the open-stream caps (per user, per
address without a token, per API process) the socket gets an ``error`` frame
(``too_many_streams`` or ``overloaded``, with ``retry_after``) and is closed
with 4029 or 1013.

Closing the socket cancels its unfinished jobs, except those sent with
``"detach": true``: they run on, and ``/v1/jobs/<job_id>/ws`` re-attaches.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from flask import Blueprint, Flask, current_app
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from simple_websocket import ConnectionClosed

from api.auth import (
    CLOSE_TOKEN_INVALID,
    CLOSE_TOKEN_INVALID_REASON,
    TokenRecheck,
    client_address,
    optional_principal,
    presented_token,
)
from api.disclosure import sees_internals
from api.errors import ApiError, BadRequest, NotFound, RateLimited, ValidationFailed
from api.openapi import spec
from api.request_ids import accepted, request_id, request_id_as
from api.schemas import JobRequest, field_name, reject_nul
from api.services import services
from api.sock import sock
from api.streams import LagWatch, SlowClient, close_now, drop_laggard, send_frame
from api.submission import follow_job, refuse_socket, submit_job
from api.waiting import WaitingWatch
from config import Settings
from db.accounts import Principal
from db.schema import Job, JobStatus
from jobs.events import JobEvent

log = logging.getLogger(__name__)

bp = Blueprint("multiplex", __name__)

# Seconds between two looks at a waiting job's queue position.
POSITION_POLL_S = 1.0
MAX_ID = 64
# The close code and reason for a client that keeps sending past its rate.
CLOSE_FLOOD = 1008
CLOSE_FLOOD_REASON = "too many messages"
# The close code and reason for a socket without a token left idle
# (ws_anonymous_idle_s with no job running); 4408 mirrors HTTP 408.
CLOSE_IDLE = 4408
CLOSE_IDLE_REASON = "idle"


def event_frame(event: JobEvent, request_id: str, job_id: str) -> dict[str, Any]:
    """The frame of a job event on this socket: the event as a job's own socket sends it,
    tagged with the request's ``id`` and the ``job_id``; an ``error`` also gets the
    ``error_type`` and ``status`` of the socket's other error frames."""
    frame = {**event.as_dict(), "id": request_id, "job_id": job_id}
    if event.type == "error":
        expired = frame.get("error") == "expired"
        frame.setdefault("error", "error")
        frame["error_type"] = "expired" if expired else "generation_error"
        frame["status"] = 503 if expired else 500
    return frame


class MessageRate:
    """A token bucket of one socket's client messages; counts refusals in a row."""

    def __init__(self, settings: Settings) -> None:
        self.rate = settings.ws_max_messages_per_s
        self.burst = settings.ws_message_burst
        self.tokens = float(self.burst)
        self.stamp = time.monotonic()
        self.refused_in_a_row = 0

    def take(self) -> bool:
        """Whether a message may be acted on now."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            self.refused_in_a_row = 0
            return True
        self.refused_in_a_row += 1
        return False

    @property
    def flooding(self) -> bool:
        """True once ``burst`` messages in a row were refused."""
        return self.refused_in_a_row >= self.burst

    def retry_after_s(self) -> float:
        return (1 - self.tokens) / self.rate


class GenerateFrame(JobRequest):
    """A ``generate`` frame: a job request plus the client's id for it, and optionally
    the request id its job and log lines carry (api/request_ids.py)."""

    type: Literal["generate"]
    id: str = Field(min_length=1, max_length=MAX_ID)
    detach: bool = False
    request_id: str | None = None


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
        self.watch = LagWatch()
        self.rate = MessageRate(services().settings)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._submitted = 0  # generate frames that made a job, for their request ids

    def send(self, frame: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        data = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
        timeout_s = services().settings.ws_send_timeout_s
        try:
            with self._send_lock:
                if self.closed.is_set():
                    return
                send_frame(self.ws, data, timeout_s, give_up=lambda: self.watch.lagging)
        except (ConnectionClosed, OSError):
            self.closed.set()
        except SlowClient as exc:
            self.drop(exc)

    def drop(self, reason: SlowClient) -> None:
        """Close a too-slow client (4008); closing cancels the jobs that are not detached,
        as any close does."""
        log.info("multiplexed websocket dropped: %s", reason)
        self.closed.set()
        with self._send_lock:
            drop_laggard(self.ws, reason)

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
            if not self.rate.take():
                self._refuse()
                return
            if isinstance(raw, bytes):
                raise BadRequest("frames are JSON text, not binary")
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):
                raise BadRequest("the frame is not valid JSON") from None
            reject_nul(data)
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

    def _refuse(self) -> None:
        """Answer a message over the socket's rate; close a socket that keeps flooding."""
        if self.rate.flooding:
            log.info("multiplexed websocket closed: %s", CLOSE_FLOOD_REASON)
            self.closed.set()
            with self._send_lock:
                close_now(self.ws, CLOSE_FLOOD, CLOSE_FLOOD_REASON)
            return
        self.send_error(
            None,
            RateLimited(
                f"at most {self.rate.rate:g} messages per second on one socket "
                f"(bursts of {self.rate.burst}); this message was ignored",
                self.rate.retry_after_s(),
            ),
        )

    def _generate(self, frame: GenerateFrame) -> None:
        with self._lock:
            current = self._requests.get(frame.id)
            if current is not None and not current.finished.is_set():
                raise ValidationFailed(f"id: request {frame.id!r} is still running", field="id")
        if frame.request_id is not None and accepted(frame.request_id) is None:
            raise ValidationFailed(
                "request_id: 1 to 128 visible ASCII characters, no spaces", field="request_id"
            )
        rid = frame.request_id or f"{request_id()}.{self._submitted + 1}"
        with request_id_as(rid):
            job = submit_job(frame, self.principal).job
        self._submitted += 1
        position = services().jobs.queue_position(job)
        self.send(
            {
                "type": "queued",
                "id": frame.id,
                "job_id": job.id,
                "position": position,
                "request_id": job.request_id,
            }
        )
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
            services().job_service.cancel(req.job.id)

    # -- job events ------------------------------------------------------------

    def _relay(self, req: _Request, position: int) -> None:
        # ``finished`` means the job needs no cancel: it ended, or its relay failed
        # (reported to the client). A relay stopped by the socket's close leaves it
        # unset, so that close cancels the job (unless detached).
        ended = True
        with self.app.app_context():
            try:
                ended = self._forward(req, position)
            except SlowClient as exc:
                ended = False
                self.drop(exc)
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
                if ended:
                    req.finished.set()

    def _forward(self, req: _Request, position: int) -> bool:
        """Relay the job's events; True after its final event, False when the socket closed."""
        started = False
        full = sees_internals(self.principal)
        waiting = WaitingWatch(req.job.model)
        tags = {"id": req.id, "job_id": req.job.id}
        for event in follow_job(req.job, idle_s=POSITION_POLL_S, watch=self.watch, full=full):
            if self.closed.is_set():
                return False
            if event is None:
                if not started:
                    current = services().jobs.get(req.job.id)
                    if current is not None and current.status == JobStatus.queued.value:
                        now = services().jobs.queue_position(current)
                        if now != position:
                            position = now
                            self.send({"type": "queued", **tags, "position": now})
                        frame = waiting.tick()
                        if frame is not None:
                            self.send({**frame, **tags})
                continue
            if event.type == "queued":
                continue  # already announced, with the position
            started = started or event.type == "started"
            waiting.seen(event)
            self.send(event_frame(event, req.id, req.job.id))
        return True

    @property
    def busy(self) -> bool:
        """True while one of the socket's jobs has not finished."""
        with self._lock:
            return any(not req.finished.is_set() for req in self._requests.values())

    def close_with(self, code: int, reason: str) -> None:
        """Close the socket with ``code`` now (after any frame being written)."""
        self.closed.set()
        with self._send_lock:
            close_now(self.ws, code, reason)

    def close(self) -> None:
        """The socket is gone: cancel what is not detached, stop every relay."""
        self.closed.set()
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            if not req.detach and not req.finished.is_set():
                try:
                    services().job_service.cancel(req.job.id)
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
    svc = services()
    try:
        principal = optional_principal(door="websocket")
        stream = svc.caps.take(principal, client_address())
    except ApiError as exc:
        refuse_socket(ws, exc)
        return
    try:
        _serve(ws, principal)
    finally:
        svc.caps.release(stream)


def _serve(ws: Any, principal: Principal | None) -> None:
    settings = services().settings
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    session = Session(ws, app, principal)
    recheck = TokenRecheck(presented_token(door="websocket"), settings.ws_token_check_s)
    idle_since = time.monotonic()
    try:
        while not session.closed.is_set():
            raw = ws.receive(timeout=min(settings.ws_token_check_s, settings.ws_anonymous_idle_s))
            if not recheck.valid():
                session.close_with(CLOSE_TOKEN_INVALID, CLOSE_TOKEN_INVALID_REASON)
                break
            if raw is None:
                if not ws.connected:
                    break
                if session.busy:
                    idle_since = time.monotonic()
                elif principal is None and time.monotonic() - idle_since >= (
                    settings.ws_anonymous_idle_s
                ):
                    session.close_with(CLOSE_IDLE, CLOSE_IDLE_REASON)
                    break
                continue
            idle_since = time.monotonic()
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

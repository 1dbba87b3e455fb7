"""What a job that waits for a worker is told: replicas starting, load progress, time left.

A job of a model with no ready worker (scaled to zero and waking, or its
workers still loading the model) waits longer than any queue position says.
The relays that watch a queued job then send a ``waiting`` frame:
``replicas_starting`` (live workers of the model in state ``starting``),
``progress`` (0-99 %, the furthest of them) and ``eta_s`` (its seconds left),
both estimated from how long the model's last start took on this farm
(:func:`fleet.registry.load_estimate`) and null before its first start.
``/v1/ws`` sends it always; a job's own websocket and SSE stream only when
asked (``?waiting=1``): it is not an event of the job's log and has no
``seq``, which older readers of those streams would not expect.
"""

from __future__ import annotations

from typing import Any, cast

from api.services import services
from fleet.registry import RegisteredWorker, list_workers, load_estimate
from jobs.events import JobEvent

# How long one read of the worker registry serves every waiting job of this
# process, in seconds.
WORKERS_MAX_AGE_S = 1.0


def waiting_frame(model: str) -> dict[str, Any] | None:
    """The ``waiting`` frame for a queued job of ``model``; None while a worker is ready."""
    svc = services()
    workers = cast(list[RegisteredWorker] | None, svc.rows.peek("workers", WORKERS_MAX_AGE_S))
    if workers is None:
        workers = list_workers(svc.redis, svc.settings)
        svc.rows.put("workers", workers)
    mine = [w for w in workers if w.model == model and not w.lost]
    if any(w.state == "ready" for w in mine):
        return None
    starting = [w for w in mine if w.state == "starting"]
    estimates = [load_estimate(float(w.started_at or 0), w.start_expected_s) for w in starting]
    known = [e for e in estimates if e[0] is not None]
    progress, eta = max(known, key=lambda e: e[0] or 0.0) if known else (None, None)
    return {
        "type": "waiting",
        "replicas_starting": len(starting),
        "progress": progress,
        "eta_s": eta,
    }


class WaitingWatch:
    """The ``waiting`` frames of one relayed job: call :meth:`seen` with each of its
    events and :meth:`tick` when the stream is idle. A watch made with ``asked``
    false (a stream that did not ask for them) never has one."""

    def __init__(self, model: str, *, asked: bool = True) -> None:
        self.model = model
        self.started = not asked
        self._last: dict[str, Any] | None = None

    def seen(self, event: JobEvent) -> None:
        """Any event after ``queued`` (started, or ended while queued) ends the waiting."""
        self.started = self.started or event.type != "queued"

    def tick(self) -> dict[str, Any] | None:
        """A ``waiting`` frame to send now: None before a change, or once it started."""
        if self.started:
            return None
        frame = waiting_frame(self.model)
        if frame == self._last:
            return None
        self._last = frame
        return frame

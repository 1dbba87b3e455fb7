"""One log line per event in a job's life, in the API, the workers and the reaper.

The events, and who logs them:

=============  ===========================================================
submitted      the API recorded the job (its row exists)
queued         its message is on the model's queue (the API; the reaper
               when it sends a lost message again)
started        a worker claimed it (attempt 1, 2, …)
first_token    the worker streamed its first token (``ttft_s``)
finished       it ended well (``finish_reason``, tokens, ``total_s``)
failed         it ended in error (``error``), or expired unstarted
cancelled      it was cancelled (in the queue by the API, running by its worker)
retried        it went back to its queue for another attempt (``reason``)
=============  ===========================================================

Every line carries ``job_id``, ``model``, ``worker`` (none before a claim),
``attempt`` and ``request_id`` (the submitting request's ``X-Request-ID``),
as ``key=value`` text or, with ``SWITCHYARD_LOG_FORMAT=json``, as fields of
the line's object (:mod:`config.logs`), so ``grep <job id>`` or a log query
on ``job_id`` follows one job through every process it crossed.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

from config.logs import FIELDS_ATTRIBUTE

log = logging.getLogger("switchyard.jobs")

JobEventName = Literal[
    "submitted",
    "queued",
    "started",
    "first_token",
    "finished",
    "failed",
    "cancelled",
    "retried",
]


class JobFacts(Protocol):
    """What a line needs of a job (a :class:`db.schema.Job` row has it)."""

    @property
    def id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def worker(self) -> str | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def request_id(self) -> str | None: ...


def log_job_event(event: JobEventName, job: JobFacts, **fields: Any) -> None:
    """Log ``event`` of ``job``, with ``fields`` added (they win over the job's own:
    ``worker=`` names the worker that acts when the row does not yet)."""
    line: dict[str, Any] = {
        "job_id": job.id,
        "model": job.model,
        "worker": job.worker,
        "attempt": job.attempts,
        "request_id": job.request_id,
        **fields,
    }
    level = logging.WARNING if event == "failed" else logging.INFO
    log.log(level, "job %s", event, extra={FIELDS_ATTRIBUTE: {"event": event, **line}})

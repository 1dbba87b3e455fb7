"""The job service: what happens to a job once its row exists, whichever front door took it.

The last step of a submission (the ``queued`` event and the generate message
in one round trip), cancelling, expiring a job queued past its deadline, and
a finished job's final event rebuilt from its row. The API's front doors
call it after their own checks (model, token, limits, idempotency) and answer
in HTTP; it knows nothing of Flask, so it is driven the same way from a test
or another process.
"""

from __future__ import annotations

from typing import Any, Literal

import redis

from config import Settings
from db.jobs import JobStore
from db.schema import Job, JobStatus, utcnow
from jobs.events import EventLog, JobEvent, usage
from jobs.joblog import log_job_event
from jobs.messages import queue_generate
from jobs.queues import queue_name

CancelResult = Literal["cancelled", "cancel_requested", "final"]


def final_from_record(job: Job, seq: int) -> JobEvent:
    """The final event of a finished ``job``, rebuilt from its row (``from_record``: true).

    For a stream that no longer holds it: expired after ``stream_ttl_s``, or
    lost with a Redis restart between the worker's write and any reader.
    """
    if job.status == JobStatus.failed:
        return JobEvent(seq, "error", {"error": job.error or "failed", "from_record": True})
    fields: dict[str, Any] = {
        "finish_reason": job.finish_reason
        or ("cancelled" if job.status == JobStatus.cancelled else "stop"),
        "text": job.output_text or "",
        "usage": usage(job.prompt_tokens or 0, job.completion_tokens or 0),
        "from_record": True,
    }
    return JobEvent(seq, "done", fields)


class JobService:
    """Queue, cancel and expire jobs through the database and the event log."""

    def __init__(
        self, settings: Settings, jobs: JobStore, events: EventLog, client: redis.Redis
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.events = events
        self.redis = client

    def enqueue(self, job: Job) -> None:
        """Write ``job``'s ``queued`` event and put its message on its model's queue.

        Both in one round trip (MULTI), all or nothing. When that fails (Redis
        or the broker down) nothing was accepted: the row is deleted and the
        error raised for the caller to answer.
        """
        try:
            pipe = self.redis.pipeline(transaction=True)
            queued = JobEvent(seq=0, type="queued", fields={"model": job.model})
            self.events.append_to(pipe, job.id, [queued])
            queue_generate(pipe, self.settings, job.id, job.model)
            pipe.execute()
            log_job_event("queued", job, queue=queue_name(job.model))
        except Exception as exc:
            log_job_event("failed", job, error=f"not enqueued: {type(exc).__name__}; not kept")
            self.jobs.delete(job.id)
            raise

    def cancel(self, job_id: str) -> CancelResult:
        """Stop a job: a queued one ends at once (``done`` event, cancelled), a
        running one is asked to stop at its worker's next step (its batch slot is
        freed then), a final one is left alone.
        """
        if self.jobs.cancel_queued(job_id):
            seq = self.events.next_seq(job_id)
            self.events.append(
                job_id,
                [JobEvent(seq=seq, type="done", fields={"finish_reason": "cancelled", "text": ""})],
            )
            cancelled = self.jobs.get(job_id)
            if cancelled is not None:
                log_job_event("cancelled", cancelled, by="api")
            return "cancelled"
        job = self.jobs.get(job_id)
        if job is not None and job.status == JobStatus.running.value:
            self.events.request_cancel(job_id)
            return "cancel_requested"
        return "final"

    def expire_if_due(self, job: Job) -> bool:
        """Fail ``job`` if it is still queued past its deadline, with an ``error`` event.

        Workers do this when they take an expired job; a client waiting on a
        model with no worker at all gets its answer from here.
        """
        if job.deadline_at is None or utcnow() < job.deadline_at:
            return False
        if not self.jobs.expire_queued(job.id):
            return False
        seq = self.events.next_seq(job.id)
        self.events.append(job.id, [JobEvent(seq=seq, type="error", fields={"error": "expired"})])
        log_job_event("failed", job, error="expired")
        return True

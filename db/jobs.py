"""Job records: creation, the atomic claim, and final outcomes.

Every state change is one conditional UPDATE, so two processes racing on a job
(a duplicate delivery, a cancel against a claim) cannot both win.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update

from db.schema import Job, JobStatus, utcnow
from db.session import Database


@dataclass(frozen=True)
class JobOutcome:
    """What a worker writes when a job reaches a final state."""

    status: JobStatus
    output_text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None = None
    first_token_at: datetime | None = None


class JobStore:
    """Reads and writes job rows through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(
        self,
        *,
        job_id: str,
        model: str,
        user_id: int | None,
        messages: list[dict[str, str]] | None,
        prompt: str | None,
        params: dict[str, Any],
    ) -> Job:
        job = Job(
            id=job_id,
            model=model,
            user_id=user_id,
            messages=messages,
            prompt=prompt,
            params=params,
            status=JobStatus.queued.value,
            attempts=0,
            created_at=utcnow(),
        )
        with self.db.session() as s:
            s.add(job)
        return job

    def get(self, job_id: str) -> Job | None:
        with self.db.session() as s:
            return s.get(Job, job_id)

    def delete(self, job_id: str) -> None:
        """Remove a row whose message could not be enqueued (nothing was accepted)."""
        with self.db.session() as s:
            job = s.get(Job, job_id)
            if job is not None:
                s.delete(job)

    def claim(self, job_id: str, worker: str) -> Job | None:
        """Move a queued job to running for ``worker``; None if someone else has it.

        A duplicate delivery of a job that is already running or final loses
        this race and must be dropped by the caller.
        """
        with self.db.session() as s:
            result = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.queued.value)
                .values(
                    status=JobStatus.running.value,
                    attempts=Job.attempts + 1,
                    worker=worker,
                    started_at=utcnow(),
                )
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                return None
            return s.get(Job, job_id, populate_existing=True)

    def finish(self, job_id: str, worker: str, outcome: JobOutcome) -> bool:
        """Record the final state of a running job claimed by ``worker``."""
        with self.db.session() as s:
            result = s.execute(
                update(Job)
                .where(
                    Job.id == job_id,
                    Job.status == JobStatus.running.value,
                    Job.worker == worker,
                )
                .values(
                    status=outcome.status.value,
                    output_text=outcome.output_text,
                    finish_reason=outcome.finish_reason,
                    prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens,
                    error=outcome.error,
                    first_token_at=outcome.first_token_at,
                    finished_at=utcnow(),
                )
                .execution_options(synchronize_session=False)
            )
            return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def fail_queued(self, job_id: str, error: str) -> bool:
        """Fail a job that never started (e.g. its message could not be read)."""
        return self._end_queued(job_id, JobStatus.failed, error=error, finish_reason="error")

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel a job no worker has taken; False if it already left the queue."""
        return self._end_queued(job_id, JobStatus.cancelled, finish_reason="cancelled")

    def _end_queued(
        self, job_id: str, status: JobStatus, *, finish_reason: str, error: str | None = None
    ) -> bool:
        with self.db.session() as s:
            result = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.queued.value)
                .values(
                    status=status.value,
                    finish_reason=finish_reason,
                    error=error,
                    output_text="",
                    finished_at=utcnow(),
                )
                .execution_options(synchronize_session=False)
            )
            return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def active_counts(self) -> dict[str, dict[str, int]]:
        """Queued and running jobs per model."""
        counts: dict[str, dict[str, int]] = {}
        with self.db.session() as s:
            rows = s.execute(
                select(Job.model, Job.status, func.count())
                .where(Job.status.in_([JobStatus.queued.value, JobStatus.running.value]))
                .group_by(Job.model, Job.status)
            )
            for model, status, n in rows:
                counts.setdefault(model, {"queued": 0, "running": 0})[status] = int(n)
        return counts

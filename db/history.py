"""The farm's history in the database: one-minute rollups per model and the reaper's recoveries.

The scaler leader writes the rollups (``fleet.history``), the reaper writes a
row per job it re-queues, fails or sends again, and the operator route reads
both back by time range. The rows are plain figures; computing them is
``fleet.history``'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError

from db.schema import HistoryMinute, Job, JobRecovery, JobStatus, ScalingDecision
from db.session import Database

SERIES = (
    "queue_depth",
    "running",
    "desired",
    "ready",
    "starting",
    "tokens_per_s",
    "jobs_started",
    "jobs_finished",
    "errors",
    "ttft_p50_s",
    "ttft_p95_s",
    "queue_wait_p50_s",
    "queue_wait_p95_s",
)
"""The columns of a rollup the history route serves, in its order."""


@dataclass(frozen=True)
class GaugeSample:
    """One model's state at one scaler tick (or reaper sweep: then ``desired`` is None,
    no scaler having decided it)."""

    queue_depth: int
    running: int
    desired: int | None
    ready: int
    starting: int
    tokens_per_s: float


@dataclass(frozen=True)
class JobFigures:
    """What one model's jobs did in one minute."""

    jobs_started: int
    jobs_finished: int
    errors: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    queue_wait_p50_s: float | None
    queue_wait_p95_s: float | None


@dataclass(frozen=True)
class JobTimes:
    """The timestamps of one job that history needs."""

    model: str
    status: str
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None


class HistoryStore:
    """Reads and writes the history tables through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # --- writing (the scaler leader) ----------------------------------------------------

    def add_samples(self, minute: datetime, samples: Mapping[str, GaugeSample]) -> None:
        """Fold one tick's samples into ``minute``'s row of each model (made if missing)."""
        if not samples:
            return
        try:
            with self.db.session() as s:
                existing = {
                    row.model: row
                    for row in s.scalars(
                        select(HistoryMinute)
                        .where(HistoryMinute.minute == minute, HistoryMinute.model.in_(samples))
                        .with_for_update()
                    )
                }
                for model, sample in samples.items():
                    row = existing.get(model)
                    if row is None:
                        row = HistoryMinute(
                            model=model,
                            minute=minute,
                            samples=0,
                            queue_depth=0,
                            running=0,
                            tokens_per_s=0.0,
                            jobs_started=0,
                            jobs_finished=0,
                            errors=0,
                        )
                        s.add(row)
                    n = row.samples
                    row.tokens_per_s = (row.tokens_per_s * n + sample.tokens_per_s) / (n + 1)
                    row.samples = n + 1
                    row.queue_depth = max(row.queue_depth, sample.queue_depth)
                    row.running = max(row.running, sample.running)
                    if sample.desired is not None:  # a reaper's sample does not know it
                        row.desired = sample.desired
                    row.ready = sample.ready
                    row.starting = sample.starting
        except IntegrityError:
            # Two leaders for a moment (a handover) made the same row: the
            # winner's sample stands, this one is dropped.
            return

    def set_figures(self, minute: datetime, figures: Mapping[str, JobFigures]) -> None:
        """Set the job figures of ``minute``'s existing rows (a minute nobody sampled stays out)."""
        if not figures:
            return
        with self.db.session() as s:
            rows = s.scalars(
                select(HistoryMinute).where(
                    HistoryMinute.minute == minute, HistoryMinute.model.in_(figures)
                )
            )
            for row in rows:
                f = figures[row.model]
                row.jobs_started = f.jobs_started
                row.jobs_finished = f.jobs_finished
                row.errors = f.errors
                row.ttft_p50_s = f.ttft_p50_s
                row.ttft_p95_s = f.ttft_p95_s
                row.queue_wait_p50_s = f.queue_wait_p50_s
                row.queue_wait_p95_s = f.queue_wait_p95_s

    def job_times(self, since: datetime) -> list[JobTimes]:
        """Jobs that started or finished at or after ``since`` (each once)."""
        columns = (
            Job.model,
            Job.status,
            Job.created_at,
            Job.started_at,
            Job.first_token_at,
            Job.finished_at,
        )
        with self.db.session() as s:
            started = s.execute(select(Job.id, *columns).where(Job.started_at >= since)).all()
            finished = s.execute(select(Job.id, *columns).where(Job.finished_at >= since)).all()
        seen: dict[str, JobTimes] = {}
        for row in [*started, *finished]:
            seen[row[0]] = JobTimes(*row[1:])
        return list(seen.values())

    def record_recovery(
        self, at: datetime, job_id: str, model: str, action: str, reason: str, worker: str | None
    ) -> None:
        with self.db.session() as s:
            s.add(
                JobRecovery(
                    at=at, job_id=job_id, model=model, action=action, reason=reason, worker=worker
                )
            )

    def prune(self, before: datetime) -> int:
        """Delete rollups, recoveries and scaling decisions older than ``before``.

        Each model's newest decision is kept however old: it says why the model
        has the replicas it has. Returns the number of rows deleted.
        """
        newest = select(func.max(ScalingDecision.id)).group_by(ScalingDecision.model)
        with self.db.session() as s:
            deleted = 0
            for statement in (
                delete(HistoryMinute).where(HistoryMinute.minute < before),
                delete(JobRecovery).where(JobRecovery.at < before),
                delete(ScalingDecision).where(
                    ScalingDecision.at < before, ScalingDecision.id.not_in(newest)
                ),
            ):
                deleted += s.execute(statement).rowcount  # type: ignore[attr-defined]
            return deleted

    # --- reading (the operator route) ---------------------------------------------------

    def series(
        self, start: datetime, end: datetime, model: str | None = None
    ) -> dict[str, dict[str, list[Any]]]:
        """Per model, its rollups in ``[start, end)`` as columns: ``minute`` and :data:`SERIES`."""
        query = (
            select(HistoryMinute)
            .where(HistoryMinute.minute >= start, HistoryMinute.minute < end)
            .order_by(HistoryMinute.model, HistoryMinute.minute)
        )
        if model is not None:
            query = query.where(HistoryMinute.model == model)
        found: dict[str, dict[str, list[Any]]] = {}
        with self.db.session() as s:
            for row in s.scalars(query):
                columns = found.setdefault(row.model, {"minute": [], **{n: [] for n in SERIES}})
                columns["minute"].append(row.minute.isoformat())
                for name in SERIES:
                    columns[name].append(getattr(row, name))
        return found

    def recoveries(
        self, start: datetime, end: datetime, model: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The reaper's recoveries in ``[start, end)``, newest first."""
        query = (
            select(JobRecovery)
            .where(JobRecovery.at >= start, JobRecovery.at < end)
            .order_by(JobRecovery.at.desc(), JobRecovery.id.desc())
            .limit(limit)
        )
        if model is not None:
            query = query.where(JobRecovery.model == model)
        with self.db.session() as s:
            return [
                {
                    "at": r.at.isoformat(),
                    "job_id": r.job_id,
                    "model": r.model,
                    "action": r.action,
                    "reason": r.reason,
                    "worker": r.worker,
                }
                for r in s.scalars(query)
            ]

    def failed_jobs(
        self, start: datetime, end: datetime, model: str | None = None, limit: int = 50
    ) -> list[dict[str, Any]]:
        """Jobs that failed in ``[start, end)``, newest first (no prompt or output)."""
        query = (
            select(Job)
            .where(
                Job.status == JobStatus.failed.value,
                Job.finished_at >= start,
                Job.finished_at < end,
            )
            .order_by(Job.finished_at.desc())
            .limit(limit)
        )
        if model is not None:
            query = query.where(Job.model == model)
        with self.db.session() as s:
            return [
                {
                    "id": j.id,
                    "model": j.model,
                    "error": j.error,
                    "attempts": j.attempts,
                    "worker": j.worker,
                    "request_id": j.request_id,
                    "created_at": j.created_at.isoformat(),
                    "finished_at": j.finished_at.isoformat() if j.finished_at else None,
                }
                for j in s.scalars(query)
            ]

"""SQLAlchemy 2 schema: users, hashed API tokens, jobs.

Postgres is the source of truth for jobs; the same schema runs on SQLite for
the one-machine default.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite forgets the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Role(enum.StrEnum):
    admin = "admin"
    operator = "operator"
    user = "user"


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16), default=Role.user.value)
    # Per-user limits over the role's defaults (settings); None: the role's, 0: no limit.
    max_concurrent_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiToken(Base):
    """An API token; only its SHA-256 hash is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Job(Base):
    """One generation request and, once final, its result."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_model_status", "model", "status"),
        # The history's rollups read the jobs that started or finished lately.
        Index("ix_jobs_started_at", "started_at"),
        Index("ix_jobs_finished_at", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    user_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="SET NULL"), nullable=True, index=True
    )
    model: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.queued.value)
    messages: Mapped[list[dict[str, str]] | None] = mapped_column(JSON, nullable=True)
    prompt: Mapped[str | None] = mapped_column(Text, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    output_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # A job still queued after its deadline is never started (failed, error "expired").
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # "<scope>:<Idempotency-Key>", scope being the user id or "anon": a retried
    # submission with the same key finds this job instead of making a second one.
    idempotency_key: Mapped[str | None] = mapped_column(String(320), nullable=True, unique=True)
    # SHA-256 (hex) of the request an idempotency key was first used with: a
    # reuse of the key for another request is refused, not answered with this job.
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The X-Request-ID of the HTTP request that submitted the job (the client's
    # or one the API made): every log line of the job carries it.
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class Chat(Base):
    """A conversation of one user: its model, sampling settings and system prompt."""

    __tablename__ = "chats"
    __table_args__ = (Index("ix_chats_user_updated", "user_id", "updated_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    title: Mapped[str] = mapped_column(String(200), default="")
    model: Mapped[str | None] = mapped_column(String(64), nullable=True)
    system_prompt: Mapped[str] = mapped_column(Text, default="")
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ChatMessage(Base):
    """One turn of a chat; an assistant turn names the job that produced it."""

    __tablename__ = "chat_messages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text, default="")
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True, index=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ScalingOverride(Base):
    """Run-time changes to one model's scaling policy; a null column keeps the definition's."""

    __tablename__ = "scaling_overrides"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    min_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target_jobs_per_replica: Mapped[float | None] = mapped_column(Float, nullable=True)
    upscale_delay_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    downscale_delay_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    scale_to_zero_delay_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    manual_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    manual_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_by: Mapped[str] = mapped_column(String(128), default="")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ScalingWindow(Base):
    """A time-of-day window added at run time (definition windows live in the YAML)."""

    __tablename__ = "scaling_windows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(64), index=True)
    cron: Mapped[str] = mapped_column(String(128))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    min_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_by: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ScalingDecision(Base):
    """A change of a model's desired replicas, with the reason the scaler gave."""

    __tablename__ = "scaling_decisions"
    __table_args__ = (Index("ix_scaling_decisions_model_at", "model", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    previous: Mapped[int | None] = mapped_column(Integer, nullable=True)
    desired: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str] = mapped_column(Text, default="")
    queued: Mapped[int] = mapped_column(Integer, default=0)
    running: Mapped[int] = mapped_column(Integer, default=0)
    ready: Mapped[int] = mapped_column(Integer, default=0)
    scaler: Mapped[str] = mapped_column(String(255), default="")


class HistoryMinute(Base):
    """One model's farm state over one minute, as the scaler leader sampled it.

    The gauges (queue depth, running, replicas, tokens/s) come from the
    scaler's ticks within the minute: ``queue_depth`` and ``running`` are the
    highest seen, the replica counts the last, ``tokens_per_s`` the mean. The
    job figures come from the jobs table: queue waits of the jobs that started
    in the minute, times to first token and errors of those that finished in it.
    """

    __tablename__ = "history_minutes"
    __table_args__ = (Index("ix_history_minutes_minute", "minute"),)

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    queue_depth: Mapped[int] = mapped_column(Integer, default=0)
    running: Mapped[int] = mapped_column(Integer, default=0)
    desired: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ready: Mapped[int] = mapped_column(Integer, default=0)
    starting: Mapped[int] = mapped_column(Integer, default=0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    jobs_started: Mapped[int] = mapped_column(Integer, default=0)
    jobs_finished: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    ttft_p50_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_p95_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    queue_wait_p50_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    queue_wait_p95_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobRecovery(Base):
    """A job the reaper re-queued, failed or sent again, and why."""

    __tablename__ = "job_recoveries"
    __table_args__ = (Index("ix_job_recoveries_at", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    job_id: Mapped[str] = mapped_column(String(36))
    model: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)


class ScalingAudit(Base):
    """Who changed a scaling setting, when, and to what."""

    __tablename__ = "scaling_audit"
    __table_args__ = (Index("ix_scaling_audit_model_at", "model", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    actor: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class ModelOverride(Base):
    """Run-time changes to a model's definition (enabled, public); null keeps the YAML's."""

    __tablename__ = "model_overrides"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    enabled: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    public: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    updated_by: Mapped[str] = mapped_column(String(128), default="")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

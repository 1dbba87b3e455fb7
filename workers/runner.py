"""The job runner: one job from claim to final row, streaming events on the way.

It is what the Celery task calls, and knows nothing of Celery: claim the row
(a duplicate delivery loses the claim and is dropped), submit to the engine,
publish coalesced token events, honour cancellation, write the outcome.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from config import ModelDefinition, Settings
from db.jobs import JobOutcome, JobStore
from db.schema import Job, JobStatus
from models.engine import (
    Engine,
    EngineError,
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    TokenEvent,
)
from tasks.events import EventLog, JobEvent

log = logging.getLogger(__name__)

# How often a running job looks for a cancel request, in seconds.
CANCEL_POLL_S = 0.1


def sampling_params(definition: ModelDefinition, requested: dict[str, Any]) -> SamplingParams:
    """The request's sampling parameters over the model's defaults."""
    d = definition.sampling
    stop = requested.get("stop") or ()
    return SamplingParams(
        max_new_tokens=int(requested.get("max_new_tokens") or d.max_new_tokens),
        temperature=float(requested.get("temperature", d.temperature)),
        top_p=float(requested.get("top_p", d.top_p)),
        top_k=int(requested.get("top_k", d.top_k)),
        repetition_penalty=float(requested.get("repetition_penalty", d.repetition_penalty)),
        stop=tuple(stop),
        seed=requested.get("seed"),
    )


@dataclass
class _Stream:
    """Sequence numbers and the pending token text of one job's stream."""

    events: EventLog
    job_id: str
    next_seq: int
    pending: str = ""
    pending_since: float = 0.0

    def emit(self, kind: str, **fields: Any) -> None:
        self.flush()
        self._write([self._event(kind, fields)])

    def add_text(self, text: str) -> None:
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending += text

    def flush(self) -> None:
        if self.pending:
            event = self._event("token", {"text": self.pending})
            self.pending = ""
            self._write([event])

    def _event(self, kind: str, fields: dict[str, Any]) -> JobEvent:
        event = JobEvent(seq=self.next_seq, type=kind, fields=fields)
        self.next_seq += 1
        return event

    def _write(self, events: list[JobEvent]) -> None:
        self.events.append(self.job_id, events)


class JobRunner:
    """Runs jobs of one model on this process's engine."""

    def __init__(
        self,
        *,
        settings: Settings,
        definition: ModelDefinition,
        engine: Engine,
        jobs: JobStore,
        events: EventLog,
        worker_id: str,
    ) -> None:
        self.settings = settings
        self.definition = definition
        self.engine = engine
        self.jobs = jobs
        self.events = events
        self.worker_id = worker_id
        self.last_job: str | None = None

    def run(self, job_id: str) -> None:
        job = self.jobs.claim(job_id, self.worker_id)
        if job is None:
            log.info("job %s is not queued (duplicate delivery or cancelled); dropped", job_id)
            return
        self.last_job = job_id
        stream = _Stream(self.events, job_id, self.events.last_seq(job_id) + 1)
        stream.emit("started", attempt=job.attempts, worker=self.worker_id)
        try:
            self._generate(job, stream)
        except Exception as exc:  # the job fails; the worker keeps serving
            log.exception("job %s failed", job_id)
            self._fail(job, stream, f"{type(exc).__name__}: {exc}")

    def _encode(self, job: Job) -> list[int]:
        truncate = bool(job.params.get("truncate", False))
        if job.messages is not None:
            return self.engine.encode_chat(job.messages, truncate=truncate)
        return self.engine.encode_prompt(job.prompt or "", truncate=truncate)

    def _generate(self, job: Job, stream: _Stream) -> None:
        try:
            prompt_ids = self._encode(job)
            params = sampling_params(self.definition, job.params)
            handle = self.engine.submit(GenerationRequest(job.id, prompt_ids, params))
        except InvalidRequest as exc:
            self._fail(job, stream, str(exc))
            return
        coalesce_s = self.settings.stream_coalesce_ms / 1000
        deadline = time.monotonic() + self.settings.job_timeout_s
        next_cancel_check = time.monotonic() + CANCEL_POLL_S
        first_token_at: datetime | None = None
        timed_out = False
        while True:
            now = time.monotonic()
            wait = CANCEL_POLL_S
            if stream.pending:
                wait = max(0.0, min(wait, stream.pending_since + coalesce_s - now))
            event = handle.next_event(timeout=wait)
            now = time.monotonic()
            if isinstance(event, TokenEvent):
                if first_token_at is None and event.text:
                    first_token_at = datetime.now(UTC)
                stream.add_text(event.text)
            elif isinstance(event, FinishEvent):
                stream.flush()
                self._finish(job, stream, event, first_token_at, timed_out)
                return
            if stream.pending and now - stream.pending_since >= coalesce_s:
                stream.flush()
            if now >= next_cancel_check:
                next_cancel_check = now + CANCEL_POLL_S
                if now >= deadline and not timed_out:
                    timed_out = True
                    handle.cancel()
                elif self._cancel_requested(job.id):
                    handle.cancel()

    def _cancel_requested(self, job_id: str) -> bool:
        try:
            return self.events.cancel_requested(job_id)
        except redis.RedisError:
            return False

    def _finish(
        self,
        job: Job,
        stream: _Stream,
        event: FinishEvent,
        first_token_at: datetime | None,
        timed_out: bool,
    ) -> None:
        if event.finish_reason == "error" or timed_out:
            error = event.error or "error"
            if timed_out:
                error = f"timed out after {self.settings.job_timeout_s} s"
            self._fail(job, stream, error, event=event, first_token_at=first_token_at)
            return
        status = JobStatus.cancelled if event.finish_reason == "cancelled" else JobStatus.succeeded
        outcome = JobOutcome(
            status=status,
            output_text=event.text,
            finish_reason=event.finish_reason,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            first_token_at=first_token_at,
        )
        if not self.jobs.finish(job.id, self.worker_id, outcome):
            log.warning("job %s was taken from this worker; its result is dropped", job.id)
            return
        started = job.started_at or datetime.now(UTC)
        finished = datetime.now(UTC)
        total_s = (finished - started).total_seconds()
        stream.emit(
            "done",
            finish_reason=event.finish_reason,
            text=event.text,
            usage={
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens,
            },
            timings={
                "queue_s": round((started - job.created_at).total_seconds(), 4),
                "first_token_s": round((first_token_at - started).total_seconds(), 4)
                if first_token_at
                else None,
                "total_s": round(total_s, 4),
                "tokens_per_s": round(event.completion_tokens / total_s, 2) if total_s else None,
            },
        )

    def _fail(
        self,
        job: Job,
        stream: _Stream,
        error: str,
        *,
        event: FinishEvent | None = None,
        first_token_at: datetime | None = None,
    ) -> None:
        outcome = JobOutcome(
            status=JobStatus.failed,
            output_text=event.text if event else "",
            finish_reason="error",
            prompt_tokens=event.prompt_tokens if event else None,
            completion_tokens=event.completion_tokens if event else None,
            error=error,
            first_token_at=first_token_at,
        )
        if self.jobs.finish(job.id, self.worker_id, outcome):
            stream.emit("error", error=error)


__all__ = ["EngineError", "JobRunner", "sampling_params"]

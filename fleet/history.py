"""The history the farm keeps of itself: one-minute rollups per model, and its events.

The scaler leader calls :meth:`HistoryRecorder.record` at every tick with what
it observed of each model (queue depth, running jobs, desired, ready and
starting replicas, the tokens per second its live workers report). Since only
the leader ticks, several API processes or standby scalers never write twice.
A farm without a scaler (workers started by hand, or by Kubernetes' own
autoscaling) still keeps its history: while no scaler leads, the reaper's
sweeps record the same figures, ``desired`` left null (nobody decided it).
The recorder folds each tick into the current minute's row, computes the job
figures (queue wait and time to first token percentiles, finished jobs,
errors) of the current minute and of the minutes a tick may still complete,
and prunes rows older than ``history_retention_s`` once a minute.

A minute's gauges are the highest queue depth and running count seen, the last
replica counts and the mean tokens/s. Queue waits (submission to the start of
the latest attempt) count in the minute the job started; times to first token
and errors (jobs that ended ``failed``) in the minute it finished, because a
worker writes the first token's time with the outcome.

:func:`events` merges what the route shows as the farm's events: the
scaler's decisions (with their kind: ``manual``, ``queue``, ``window``,
``min``, ``max``, ``scale_to_zero``, ``wake``), the operators' changes
(``setting``) and the reaper's recoveries (``reaper``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from config import Settings
from db.history import GaugeSample, HistoryStore, JobFigures, JobTimes
from db.scaling import DecisionRecord
from db.schema import JobStatus

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)


# The most points one series of the history route has: a longer range is served in
# buckets of several minutes (:func:`step_for`, :func:`downsample`).
MAX_POINTS = 720
_STEPS_MIN = (1, 5, 15, 30, 60, 180, 360, 720, 1440)
_LAST = object()  # a gauge that keeps its last value in a bucket


def step_for(span: timedelta) -> timedelta:
    """The bucket a range of ``span`` is served in: one minute up to 12 hours, then
    5, 15, 30 … minutes so that a series has at most :data:`MAX_POINTS` points
    (a day: 5 minutes, a week: 15)."""
    minutes = span / MINUTE
    for step in _STEPS_MIN:
        if minutes / step <= MAX_POINTS:
            return MINUTE * step
    return MINUTE * _STEPS_MIN[-1]


def _median(values: Sequence[float]) -> float | None:
    return percentile(values, 0.5)


# How a bucket folds its minutes, per column: the highest depth and running count,
# the last replica counts, the mean rate, the sums of jobs, the median of the
# minutes' p50s and the highest of their p95s (what the minutes' rollups allow:
# the jobs' own times are not kept per minute).
_FOLDS: dict[str, Any] = {
    "queue_depth": max,
    "running": max,
    "desired": _LAST,
    "ready": _LAST,
    "starting": _LAST,
    "tokens_per_s": lambda v: round(sum(v) / len(v), 2),
    "jobs_started": sum,
    "jobs_finished": sum,
    "errors": sum,
    "ttft_p50_s": _median,
    "ttft_p95_s": max,
    "queue_wait_p50_s": _median,
    "queue_wait_p95_s": max,
}


def downsample(columns: Mapping[str, list[Any]], step: timedelta) -> dict[str, list[Any]]:
    """One model's one-minute columns (``minute`` and the rollups) in buckets of ``step``.

    A bucket starts at a multiple of ``step`` since the epoch (so a refresh
    keeps the same buckets) and holds the minutes of it that have rows; null
    values are left out of its fold, and a bucket of nulls stays null.
    """
    if step <= MINUTE:
        return {name: list(values) for name, values in columns.items()}
    step_s = int(step.total_seconds())
    folded: dict[str, list[Any]] = {name: [] for name in columns}
    groups: dict[str, list[int]] = {}
    for i, minute in enumerate(columns["minute"]):
        at = datetime.fromisoformat(minute).timestamp()
        start = datetime.fromtimestamp(at - at % step_s, tz=UTC).isoformat()
        groups.setdefault(start, []).append(i)
    for start, rows in groups.items():
        folded["minute"].append(start)
        for name, values in columns.items():
            if name == "minute":
                continue
            present = [values[i] for i in rows if values[i] is not None]
            fold = _FOLDS.get(name, _LAST)
            if not present:
                folded[name].append(None)
            elif fold is _LAST:
                folded[name].append(present[-1])
            else:
                folded[name].append(fold(present))
    return folded


def minute_of(at: datetime) -> datetime:
    """The start of the minute ``at`` falls in."""
    return at.replace(second=0, microsecond=0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def job_figures(
    jobs: Iterable[JobTimes], minutes: Sequence[datetime], models: Iterable[str]
) -> dict[datetime, dict[str, JobFigures]]:
    """Per minute of ``minutes`` and per model of ``models``: what its jobs did then."""
    wanted = set(minutes)
    waits: dict[tuple[datetime, str], list[float]] = {}
    ttfts: dict[tuple[datetime, str], list[float]] = {}
    finished: dict[tuple[datetime, str], int] = {}
    errors: dict[tuple[datetime, str], int] = {}
    for job in jobs:
        if job.started_at is not None and minute_of(job.started_at) in wanted:
            key = (minute_of(job.started_at), job.model)
            waits.setdefault(key, []).append((job.started_at - job.created_at).total_seconds())
        if job.finished_at is not None and minute_of(job.finished_at) in wanted:
            key = (minute_of(job.finished_at), job.model)
            finished[key] = finished.get(key, 0) + 1
            if job.status == JobStatus.failed.value:
                errors[key] = errors.get(key, 0) + 1
            if job.first_token_at is not None and job.started_at is not None:
                first = (job.first_token_at - job.started_at).total_seconds()
                ttfts.setdefault(key, []).append(max(0.0, first))
    result: dict[datetime, dict[str, JobFigures]] = {}
    for minute in minutes:
        per_model = result.setdefault(minute, {})
        for model in models:
            key = (minute, model)
            wait, ttft = waits.get(key, []), ttfts.get(key, [])
            per_model[model] = JobFigures(
                jobs_started=len(wait),
                jobs_finished=finished.get(key, 0),
                errors=errors.get(key, 0),
                ttft_p50_s=_rounded(percentile(ttft, 0.5)),
                ttft_p95_s=_rounded(percentile(ttft, 0.95)),
                queue_wait_p50_s=_rounded(percentile(wait, 0.5)),
                queue_wait_p95_s=_rounded(percentile(wait, 0.95)),
            )
    return result


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class HistoryRecorder:
    """Writes the rollups from the scaler leader's ticks (or, with no scaler leading, the
    reaper's sweeps, every ``interval_s``); see the module docstring."""

    def __init__(
        self, settings: Settings, store: HistoryStore, interval_s: float | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        # A tick completes the minutes since the previous tick: with ticks
        # further apart than a minute, several of them.
        interval = settings.scaler_interval_s if interval_s is None else interval_s
        self.settle = max(1, math.ceil(interval / 60))
        self._pruned: datetime | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.history_retention_s > 0

    def record(self, now: datetime, samples: Mapping[str, GaugeSample]) -> None:
        """Fold one tick into the history (nothing when ``history_retention_s`` is 0)."""
        if not self.enabled:
            return
        current = minute_of(now)
        self.store.add_samples(current, samples)
        minutes = [current - MINUTE * back for back in range(self.settle, -1, -1)]
        figures = job_figures(self.store.job_times(minutes[0]), minutes, samples)
        for minute in minutes:
            self.store.set_figures(minute, figures[minute])
        if self._pruned != current:
            self._pruned = current
            cutoff = now - timedelta(seconds=self.settings.history_retention_s)
            deleted = self.store.prune(cutoff)
            if deleted:
                log.info("history: pruned %d row(s) older than %s", deleted, cutoff.isoformat())


def decision_kind(decision: DecisionRecord) -> str:
    """What kind of scaling event a decision was (see the module docstring)."""
    if decision.reason in ("manual", "window"):
        return decision.reason
    if decision.desired == 0 and (decision.previous or 0) > 0:
        return "scale_to_zero"
    if decision.previous == 0 and decision.desired > 0 and decision.reason == "queue":
        return "wake"
    return decision.reason


def events(
    decisions: Iterable[DecisionRecord],
    audit: Iterable[Mapping[str, Any]],
    recoveries: Iterable[Mapping[str, Any]],
    limit: int,
) -> list[dict[str, Any]]:
    """The farm's events, newest first, each with ``at``, ``model``, ``kind``, ``by``, ``why``."""
    found: list[dict[str, Any]] = []
    for d in decisions:
        found.append(
            {
                "at": d.at.isoformat(),
                "model": d.model,
                "kind": decision_kind(d),
                "by": d.scaler,
                "why": d.detail,
                "previous": d.previous,
                "desired": d.desired,
                "queued": d.queued,
                "running": d.running,
                "ready": d.ready,
            }
        )
    for entry in audit:
        found.append(
            {
                "at": entry["at"],
                "model": entry["model"],
                "kind": "setting",
                "by": entry["actor"],
                "why": entry["action"],
                "details": entry["details"],
            }
        )
    for r in recoveries:
        found.append(
            {
                "at": r["at"],
                "model": r["model"],
                "kind": "reaper",
                "by": "reaper",
                "why": r["reason"],
                "action": r["action"],
                "job_id": r["job_id"],
                "worker": r["worker"],
            }
        )
    found.sort(key=lambda e: datetime.fromisoformat(e["at"]), reverse=True)
    return found[:limit]

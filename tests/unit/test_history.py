"""The history's arithmetic: percentiles, a minute's job figures, event kinds, the route's range."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from api.errors import ValidationFailed
from api.history import HistoryQuery, time_range
from db.history import JobTimes
from db.scaling import DecisionRecord
from fleet.history import (
    MAX_POINTS,
    decision_kind,
    downsample,
    events,
    job_figures,
    minute_of,
    percentile,
    step_for,
)

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
S = timedelta(seconds=1)


def test_percentiles_interpolate_between_ranks_and_are_none_without_values() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([9.0, 1.0, 7.0, 5.0], 0.5) == 6.0
    assert percentile([1.0, 5.0, 7.0, 9.0], 0.95) == pytest.approx(8.7)


def test_waits_count_where_jobs_started_ttft_and_errors_where_they_finished() -> None:
    jobs = [
        # Started in 09:00 (waited 10 s), finished in 09:01 with its first token after 2 s.
        JobTimes("m", "succeeded", T0 - 10 * S, T0 + 5 * S, T0 + 7 * S, T0 + 70 * S),
        # Started and failed in 09:01, no token.
        JobTimes("m", "failed", T0 + 60 * S, T0 + 61 * S, None, T0 + 90 * S),
        # Another model's job.
        JobTimes("other", "succeeded", T0, T0 + 1 * S, T0 + 2 * S, T0 + 3 * S),
    ]
    minutes = [T0, T0 + timedelta(minutes=1)]
    figures = job_figures(jobs, minutes, ["m", "idle"])
    first, second = figures[minutes[0]]["m"], figures[minutes[1]]["m"]
    assert (first.jobs_started, first.jobs_finished, first.errors) == (1, 0, 0)
    assert first.queue_wait_p50_s == 15.0 and first.ttft_p50_s is None
    assert (second.jobs_started, second.jobs_finished, second.errors) == (1, 2, 1)
    assert second.queue_wait_p95_s == 1.0 and second.ttft_p95_s == 2.0
    idle = figures[minutes[0]]["idle"]
    assert (idle.jobs_started, idle.errors, idle.ttft_p50_s) == (0, 0, None)
    assert "other" not in figures[minutes[0]]
    assert minute_of(T0 + 59.9 * S) == T0


def decision(previous: int | None, desired: int, reason: str) -> DecisionRecord:
    return DecisionRecord("m", T0, previous, desired, reason, "detail", 0, 0, 0, "scaler@h:1:a")


@pytest.mark.parametrize(
    ("previous", "desired", "reason", "kind"),
    [
        (0, 2, "manual", "manual"),
        (2, 0, "manual", "manual"),
        (2, 0, "window", "window"),
        (1, 0, "queue", "scale_to_zero"),
        (0, 1, "queue", "wake"),
        (None, 1, "queue", "queue"),
        (1, 2, "queue", "queue"),
        (0, 1, "min", "min"),
        (3, 2, "max", "max"),
    ],
)
def test_decision_kinds(previous: int | None, desired: int, reason: str, kind: str) -> None:
    assert decision_kind(decision(previous, desired, reason)) == kind


def test_events_merge_newest_first_and_are_capped() -> None:
    audit = [
        {"at": (T0 + 5 * S).isoformat(), "actor": "alice", "model": "m", "action": "manual",
         "details": {"replicas": 2}},
    ]  # fmt: skip
    recoveries = [
        {"at": (T0 + 9 * S).isoformat(), "job_id": "j", "model": "m", "action": "requeued",
         "reason": "worker lost", "worker": "w"},
    ]  # fmt: skip
    merged = events([decision(0, 1, "queue")], audit, recoveries, limit=10)
    assert [(e["kind"], e["by"]) for e in merged] == [
        ("reaper", "reaper"),
        ("setting", "alice"),
        ("wake", "scaler@h:1:a"),
    ]
    assert len(events([decision(0, 1, "queue")], audit, recoveries, limit=2)) == 2


NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("query", "span"),
    [
        ({}, timedelta(hours=1)),
        ({"last": "30m"}, timedelta(minutes=30)),
        ({"last": "7d"}, timedelta(days=7)),
        ({"from": "2026-12-01T11:00:00+01:00"}, timedelta(hours=2)),
    ],
)
def test_ranges_end_now_unless_told(query: dict[str, str], span: timedelta) -> None:
    start, end = time_range(HistoryQuery.model_validate(query), NOW)
    assert (end, end - start) == (NOW, span)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"last": "1y"}, "last"),
        ({"last": "1h", "from": "2026-12-01T10:00:00Z"}, "last"),
        ({"to": "2026-12-01T10:00:00Z"}, "from"),
        ({"from": "2026-12-01T10:00:00Z", "to": "2026-12-01T09:00:00Z"}, "to"),
        ({"last": "400d"}, "from"),
    ],
)
def test_bad_ranges_are_refused_naming_the_field(query: dict[str, str], field: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        time_range(HistoryQuery.model_validate(query), NOW)
    assert caught.value.field == field


def test_a_range_has_at_most_720_points_a_series() -> None:
    assert step_for(timedelta(hours=1)) == timedelta(minutes=1)
    assert step_for(timedelta(hours=12)) == timedelta(minutes=1)
    assert step_for(timedelta(days=1)) == timedelta(minutes=5)
    assert step_for(timedelta(days=7)) == timedelta(minutes=15)
    for days in (1, 7, 30, 366):
        assert timedelta(days=days) / step_for(timedelta(days=days)) <= MAX_POINTS


def test_buckets_fold_each_column_its_own_way_and_keep_gaps() -> None:
    minutes = ["2026-03-02T09:00:00+00:00", "2026-03-02T09:01:00+00:00",
               "2026-03-02T09:04:00+00:00", "2026-03-02T09:07:00+00:00"]  # fmt: skip
    columns = {
        "minute": minutes,
        "queue_depth": [3, 9, 1, 0],
        "desired": [1, 2, None, 4],
        "tokens_per_s": [10.0, 20.0, 30.0, 5.0],
        "jobs_finished": [1, 2, 3, 4],
        "ttft_p50_s": [0.1, None, 0.3, None],
        "ttft_p95_s": [0.5, None, 0.9, None],
    }
    folded = downsample(columns, timedelta(minutes=5))
    assert folded == {
        "minute": ["2026-03-02T09:00:00+00:00", "2026-03-02T09:05:00+00:00"],
        "queue_depth": [9, 0],
        "desired": [2, 4],  # the last value the bucket has
        "tokens_per_s": [20.0, 5.0],
        "jobs_finished": [6, 4],
        "ttft_p50_s": [pytest.approx(0.2), None],
        "ttft_p95_s": [0.9, None],
    }
    assert downsample(columns, timedelta(minutes=1)) == columns

"""The desired-replicas computation: a pure function of (policy, state, now)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from config.catalog import Scaling, ScheduleWindow
from fleet.policy import (
    Decision,
    Memory,
    Observation,
    Overrides,
    Policy,
    PolicyError,
    decide,
    effective_policy,
)
from fleet.schedule import (
    ScheduleError,
    Window,
    active_spans,
    parse_duration,
    validated_window,
)

# Monday 2 March 2026, 10:00 UTC (11:00 in Paris, winter time).
MONDAY_10 = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
WEEKDAYS = Window(cron="* 9-18 * * 1-5", timezone="Europe/Paris", min_replicas=4)
NIGHTS = Window(cron="* 0-6,22-23 * * *", timezone="Europe/Paris", max_replicas=1)


def policy(**kw) -> Policy:
    base = {
        "min_replicas": 0,
        "max_replicas": 10,
        "target_jobs_per_replica": 4,
        "upscale_delay_s": 0,
        "downscale_delay_s": 60,
        "scale_to_zero_delay_s": 300,
    }
    base.update(kw)
    return Policy(**base)


def run(
    p: Policy, loads: list[tuple[float, int]], start: Memory | None, t0: datetime = MONDAY_10
) -> list[Decision]:
    """Tick at each (seconds after t0, queued jobs), carrying memory like the scaler does."""
    memory = start
    decisions = []
    for seconds, queued in loads:
        d = decide(p, Observation(queued=queued), memory, t0 + timedelta(seconds=seconds))
        memory = d.memory
        decisions.append(d)
    return decisions


# --- windows ---------------------------------------------------------------------------


def test_weekday_window_is_active_in_its_timezone_at_a_frozen_clock() -> None:
    assert WEEKDAYS.active(MONDAY_10)
    # 08:30 UTC is 09:30 in Paris: inside; 07:30 UTC is 08:30 in Paris: outside.
    assert WEEKDAYS.active(MONDAY_10.replace(hour=8, minute=30))
    assert not WEEKDAYS.active(MONDAY_10.replace(hour=7, minute=30))
    # 18:59 Paris is inside, 19:00 Paris is outside.
    assert WEEKDAYS.active(MONDAY_10.replace(hour=17, minute=59, second=59))
    assert not WEEKDAYS.active(MONDAY_10.replace(hour=18, minute=0))
    saturday = MONDAY_10 + timedelta(days=5)
    assert not WEEKDAYS.active(saturday)


def test_active_spans_of_a_window_over_a_range() -> None:
    # Monday 00:00 UTC to Wednesday 00:00 UTC: Paris (UTC+1) 09:00-18:59 is 08:00-17:59 UTC.
    monday = MONDAY_10.replace(hour=0, minute=0, second=0)
    spans = active_spans(WEEKDAYS, monday, monday + timedelta(days=2), timedelta(minutes=1))
    assert spans == [
        (monday.replace(hour=8), monday.replace(hour=18)),
        (monday.replace(hour=8) + timedelta(days=1), monday.replace(hour=18) + timedelta(days=1)),
    ]
    # A range that starts inside a span and ends inside another is clipped to it.
    start, end = monday.replace(hour=12, second=30), monday.replace(hour=9) + timedelta(days=1)
    assert active_spans(WEEKDAYS, start, end, timedelta(minutes=1)) == [
        (start, monday.replace(hour=18)),
        (monday.replace(hour=8) + timedelta(days=1), end),
    ]
    # Read every 14 minutes (a week on a chart), the edges move by less than a step.
    coarse = active_spans(WEEKDAYS, monday, monday + timedelta(days=1), timedelta(minutes=14))
    assert len(coarse) == 1
    assert abs(coarse[0][0] - monday.replace(hour=8)) < timedelta(minutes=14)
    assert abs(coarse[0][1] - monday.replace(hour=18)) < timedelta(minutes=14)
    assert active_spans(WEEKDAYS, monday + timedelta(days=5), monday + timedelta(days=6),
                        timedelta(minutes=1)) == []  # fmt: skip


def test_window_follows_daylight_saving_time() -> None:
    # Monday 30 March 2026 is summer time in Paris (UTC+2): 07:30 UTC is 09:30 there.
    summer = datetime(2026, 3, 30, 7, 30, tzinfo=UTC)
    assert WEEKDAYS.active(summer)
    assert not WEEKDAYS.active(summer - timedelta(hours=1))


def test_window_min_sets_replicas_at_a_frozen_clock() -> None:
    p = policy(windows=(WEEKDAYS,))
    d = decide(p, Observation(), Memory(desired=0), MONDAY_10)
    assert (d.desired, d.reason) == (4, "window")
    assert "* 9-18 * * 1-5" in d.detail
    # Saturday: the window is closed, nothing queued; it stays at 4 until the
    # downscale delay, then holds 1 until idle long enough, then goes to zero.
    saturday = MONDAY_10 + timedelta(days=5)
    steps = run(p, [(0, 0), (59, 0), (60, 0), (299, 0), (300, 0)], Memory(desired=4), saturday)
    assert [s.desired for s in steps] == [4, 4, 1, 1, 0]


def test_overlapping_windows_take_the_largest_min_and_the_smallest_max() -> None:
    windows = (
        Window(cron="* * * * *", min_replicas=2, max_replicas=8),
        Window(cron="* 8-12 * * *", min_replicas=3),
        Window(cron="* 9-11 * * *", max_replicas=5),
        Window(cron="* 20-23 * * *", min_replicas=9),  # not active at 10:00
    )
    p = policy(windows=windows)
    idle = decide(p, Observation(), Memory(desired=0), MONDAY_10)
    assert (idle.desired, idle.reason) == (3, "window")
    busy = decide(p, Observation(queued=100), Memory(desired=3), MONDAY_10)
    assert (busy.desired, busy.reason) == (5, "window")


def test_when_min_and_max_conflict_the_ceiling_wins() -> None:
    night_min = Window(cron="* * * * *", min_replicas=3)
    night_max = Window(cron="* * * * *", max_replicas=1)
    p = policy(windows=(night_min, night_max))
    d = decide(p, Observation(), Memory(desired=3), MONDAY_10)
    assert (d.desired, d.reason) == (1, "window")
    assert "ceiling wins" in d.detail
    # Model max below a window's min: the model's max wins.
    d = decide(policy(max_replicas=2, windows=(WEEKDAYS,)), Observation(), None, MONDAY_10)
    assert (d.desired, d.reason) == (2, "max")


def test_a_window_max_cuts_at_once_and_a_window_min_rises_at_once() -> None:
    p = policy(upscale_delay_s=600, downscale_delay_s=600, windows=(NIGHTS,))
    midnight = datetime(2026, 3, 2, 23, 30, tzinfo=UTC)  # 00:30 in Paris
    d = decide(p, Observation(queued=40), Memory(desired=6), midnight)
    assert (d.desired, d.reason) == (1, "window")
    d = decide(policy(upscale_delay_s=600, windows=(WEEKDAYS,)), Observation(), None, MONDAY_10)
    assert (d.desired, d.reason) == (4, "window")


# --- clamping --------------------------------------------------------------------------


def test_queue_demand_is_clamped_to_min_and_max() -> None:
    p = policy(min_replicas=1, max_replicas=3)
    d = decide(p, Observation(queued=50), Memory(desired=1), MONDAY_10)
    assert (d.desired, d.reason) == (3, "max")
    d = decide(p, Observation(), None, MONDAY_10)
    assert (d.desired, d.reason) == (1, "min")
    d = decide(p, Observation(queued=5, running=3), Memory(desired=2), MONDAY_10)
    assert (d.desired, d.reason) == (2, "queue")
    assert "8 jobs (5 queued, 3 running)" in d.detail


def test_without_memory_the_current_count_is_the_observed_one() -> None:
    p = policy(downscale_delay_s=60)
    d = decide(p, Observation(queued=4, replicas=3), None, MONDAY_10)
    assert d.desired == 3 and d.previous is None  # holds: downscale delay not yet over


# --- manual ----------------------------------------------------------------------------


def test_manual_count_wins_until_it_expires_then_auto_resumes() -> None:
    until = MONDAY_10 + timedelta(hours=2)
    p = policy(min_replicas=1, manual_replicas=5, manual_until=until, windows=(NIGHTS,))
    d = decide(p, Observation(), Memory(desired=1), MONDAY_10)
    assert (d.desired, d.reason) == (5, "manual")
    assert until.isoformat() in d.detail
    d = decide(p, Observation(), d.memory, until - timedelta(seconds=1))
    assert (d.desired, d.reason) == (5, "manual")
    # Expired: the automatic policy resumes (and scales down after its delay).
    after = decide(p, Observation(), d.memory, until)
    assert after.reason != "manual" and after.desired == 5
    later = decide(p, Observation(), after.memory, until + timedelta(seconds=60))
    assert (later.desired, later.reason) == (1, "min")


def test_manual_without_expiry_and_manual_zero() -> None:
    p = policy(min_replicas=2, manual_replicas=0)
    d = decide(p, Observation(queued=30), Memory(desired=2), MONDAY_10 + timedelta(days=400))
    assert (d.desired, d.reason) == (0, "manual")


def test_manual_is_capped_by_max_replicas() -> None:
    d = decide(policy(max_replicas=2, manual_replicas=5), Observation(), None, MONDAY_10)
    assert (d.desired, d.reason) == (2, "max")


# --- queue-based -----------------------------------------------------------------------


def test_upscale_without_delay_is_immediate() -> None:
    steps = run(policy(), [(0, 1), (5, 9), (10, 17)], Memory(desired=0))
    assert [s.desired for s in steps] == [1, 3, 5]
    assert all(s.reason == "queue" for s in steps)


def test_upscale_delay_waits_and_rises_to_the_lowest_demand_seen() -> None:
    p = policy(upscale_delay_s=30)
    loads = [(0, 20), (10, 12), (20, 40), (30, 40), (35, 40), (65, 40)]
    steps = run(p, loads, Memory(desired=1))
    # 30 s above 1 replica, the lowest want meanwhile was 3 (12 jobs); the next
    # step waits its own delay.
    assert [s.desired for s in steps] == [1, 1, 1, 3, 3, 10]
    assert "upscale delay" in steps[1].detail


def test_a_dip_resets_the_upscale_delay() -> None:
    p = policy(upscale_delay_s=30)
    steps = run(p, [(0, 20), (20, 4), (40, 20), (60, 20), (70, 20)], Memory(desired=1))
    assert [s.desired for s in steps] == [1, 1, 1, 1, 5]


def test_from_zero_the_first_job_starts_a_worker_at_once_whatever_the_delay() -> None:
    p = policy(upscale_delay_s=600)
    d = decide(p, Observation(queued=1), Memory(desired=0), MONDAY_10)
    assert (d.desired, d.reason) == (1, "queue")
    assert "from zero" in d.detail


def test_downscale_delay_waits_and_steps_to_the_highest_demand_seen() -> None:
    p = policy(downscale_delay_s=60, scale_to_zero_delay_s=600)
    steps = run(p, [(0, 4), (30, 8), (60, 4), (90, 4), (120, 4)], Memory(desired=4))
    # 60 s below 4 replicas; the highest want in that time was 2 (8 jobs).
    assert [s.desired for s in steps] == [4, 4, 2, 2, 1]
    assert "downscale delay" in steps[1].detail


def test_scale_to_zero_has_its_own_delay() -> None:
    p = policy(downscale_delay_s=10, scale_to_zero_delay_s=100)
    steps = run(p, [(0, 0), (10, 0), (50, 0), (99, 0), (100, 0)], Memory(desired=3))
    assert [s.desired for s in steps] == [3, 1, 1, 1, 0]
    assert "before scaling to zero" in steps[2].detail


def test_a_job_resets_the_idle_time_before_zero() -> None:
    p = policy(downscale_delay_s=0, scale_to_zero_delay_s=100)
    steps = run(p, [(0, 0), (90, 1), (95, 0), (150, 0), (195, 0)], Memory(desired=1))
    assert [s.desired for s in steps] == [1, 1, 1, 1, 0]


def test_zero_delays_scale_to_zero_at_once() -> None:
    p = policy(downscale_delay_s=0, scale_to_zero_delay_s=0)
    d = decide(p, Observation(), Memory(desired=2), MONDAY_10)
    assert (d.desired, d.reason) == (0, "queue")


def test_a_missed_tick_reaches_the_same_count() -> None:
    p = policy(downscale_delay_s=60, scale_to_zero_delay_s=300)
    every_5s = run(p, [(t, 0) for t in range(0, 400, 5)], Memory(desired=3))
    two_ticks = run(p, [(0, 0), (395, 0)], Memory(desired=3))
    assert every_5s[-1].desired == two_ticks[-1].desired == 0


def test_memory_round_trips_through_json() -> None:
    m = Memory(
        desired=3, above_since=MONDAY_10, above_floor=2, below_since=None, idle_since=MONDAY_10
    )
    assert Memory.from_json(m.to_json()) == m


# --- effective policy ------------------------------------------------------------------


def test_effective_policy_merges_definition_overrides_and_windows() -> None:
    scaling = Scaling(
        min_replicas=1,
        max_replicas=4,
        windows=[ScheduleWindow(cron="* 9-18 * * 1-5", timezone="Europe/Paris", min_replicas=2)],
    )
    extra = Window(cron="* 0-6 * * *", max_replicas=1, source="schedule", id=7)
    p = effective_policy(scaling, Overrides(max_replicas=6, downscale_delay_s=5), [extra])
    assert (p.min_replicas, p.max_replicas, p.downscale_delay_s) == (1, 6, 5)
    assert p.target_jobs_per_replica == scaling.target_jobs_per_replica
    assert [w.source for w in p.windows] == ["definition", "schedule"]
    with pytest.raises(PolicyError) as err:
        effective_policy(scaling, Overrides(min_replicas=5))
    assert err.value.field == "min_replicas"


def test_validated_window_names_the_bad_field() -> None:
    with pytest.raises(ScheduleError) as err:
        validated_window("61 * * * *", "UTC", 1)
    assert err.value.field == "cron"
    with pytest.raises(ScheduleError) as err:
        validated_window("* * * * *", "Nowhere/City", 1)
    assert err.value.field == "timezone"
    assert validated_window("* 9-18 * * mon-fri", "Europe/Paris", 4).min_replicas == 4


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("15m", 900), ("2h", 7200), ("1h30m", 5400), ("45", 45)]
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "2x", "h", "0s", "2h and"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_duration(text)

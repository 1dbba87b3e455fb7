"""The desired replica count of one model: a pure function of (policy, state, now).

How the number is found, in order:

1. **Manual.** A manual count that has not expired wins over the queue, the
   windows and ``min_replicas``; only ``max_replicas`` still caps it (the hard
   ceiling of what the farm may run). After ``manual_until`` the automatic
   policy resumes by itself.
2. **Bounds.** ``lo`` is the largest of ``min_replicas`` and the ``min`` of
   every active window; ``hi`` is the smallest of ``max_replicas`` and the
   ``max`` of every active window. When ``lo > hi`` the ceiling wins
   (``hi``): a "nights at most 1" window beats a "at least 2" one.
3. **Queue.** ``ceil((queued + running) / target_jobs_per_replica)`` clamped
   into ``[lo, hi]`` is what the model *wants*.
4. **Delays.** A rise the bounds force (a window opens, min is raised) and a
   fall they force (a window's max, max is lowered) apply at once. A rise the
   queue asks for waits until the want stayed above the current count for
   ``upscale_delay_s`` and then goes to the lowest want seen meanwhile; a fall
   waits ``downscale_delay_s`` and goes to the highest want seen meanwhile;
   the last step to zero waits until the model had no job at all for
   ``scale_to_zero_delay_s``. A model at zero with a job goes to its want at
   once (nobody can serve it otherwise).

The only state carried between ticks is :class:`Memory` (the current count
and since when the want has been above, below, idle). It holds timestamps, not
events, so a missed tick, or a new scaler leader reading the same memory,
reaches the same number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from config.catalog import SCALING_TUNABLES, Scaling
from fleet.schedule import Window, active_windows

Reason = Literal["manual", "queue", "window", "min", "max"]
REASONS: tuple[Reason, ...] = ("manual", "queue", "window", "min", "max")


class PolicyError(ValueError):
    """A scaling policy change that would leave the policy inconsistent."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Overrides:
    """Run-time changes to a definition's policy; None keeps the definition's value."""

    min_replicas: int | None = None
    max_replicas: int | None = None
    target_jobs_per_replica: float | None = None
    upscale_delay_s: float | None = None
    downscale_delay_s: float | None = None
    scale_to_zero_delay_s: float | None = None
    manual_replicas: int | None = None
    manual_until: datetime | None = None


@dataclass(frozen=True)
class Policy:
    """The policy the scaler applies: definition, overrides and windows merged."""

    min_replicas: int = 0
    max_replicas: int = 1
    target_jobs_per_replica: float = 8.0
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 300.0
    scale_to_zero_delay_s: float = 900.0
    windows: tuple[Window, ...] = ()
    manual_replicas: int | None = None
    manual_until: datetime | None = None

    def manual_at(self, now: datetime) -> int | None:
        """The manual count in force at ``now``, or None (none set, or expired)."""
        if self.manual_replicas is None:
            return None
        if self.manual_until is not None and now >= self.manual_until:
            return None
        return self.manual_replicas

    def as_dict(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in SCALING_TUNABLES}
        body["windows"] = [w.as_dict() for w in self.windows]
        return body


def effective_policy(
    scaling: Scaling, overrides: Overrides | None = None, windows: Sequence[Window] = ()
) -> Policy:
    """Merge a definition's scaling, run-time overrides and run-time windows.

    Raises :class:`PolicyError` when the result is inconsistent (min above max,
    a non-positive target, a negative count or delay).
    """
    o = overrides or Overrides()
    values: dict[str, Any] = {}
    for name in SCALING_TUNABLES:
        given = getattr(o, name)
        values[name] = given if given is not None else getattr(scaling, name)
    for name in ("min_replicas", "max_replicas", "upscale_delay_s", "downscale_delay_s"):
        if values[name] < 0:
            raise PolicyError(name, "must not be negative")
    if values["scale_to_zero_delay_s"] < 0:
        raise PolicyError("scale_to_zero_delay_s", "must not be negative")
    if not values["target_jobs_per_replica"] > 0:
        raise PolicyError("target_jobs_per_replica", "must be above 0")
    if values["min_replicas"] > values["max_replicas"]:
        raise PolicyError(
            "min_replicas",
            f"min_replicas {values['min_replicas']} is above max_replicas {values['max_replicas']}",
        )
    if o.manual_replicas is not None and o.manual_replicas < 0:
        raise PolicyError("replicas", "must not be negative")
    merged = tuple(Window.of(w) for w in scaling.windows) + tuple(windows)
    return Policy(
        **values, windows=merged, manual_replicas=o.manual_replicas, manual_until=o.manual_until
    )


@dataclass(frozen=True)
class Observation:
    """What a model looks like right now."""

    queued: int = 0
    running: int = 0
    replicas: int = 0  # workers alive (starting or ready): the count when there is no memory

    @property
    def load(self) -> int:
        return self.queued + self.running


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _from_iso(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


@dataclass(frozen=True)
class Memory:
    """What the scaler keeps between ticks for one model (timestamps, not events)."""

    desired: int
    above_since: datetime | None = None  # the want has been above ``desired`` since
    above_floor: int | None = None  # the lowest want seen since ``above_since``
    below_since: datetime | None = None  # the want has been below ``desired`` since
    below_peak: int | None = None  # the highest want seen since ``below_since``
    idle_since: datetime | None = None  # no queued or running job since

    def to_json(self) -> str:
        body = asdict(self)
        for name in ("above_since", "below_since", "idle_since"):
            body[name] = _iso(body[name])
        return json.dumps(body)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Memory:
        body = json.loads(raw)
        return cls(
            desired=int(body["desired"]),
            above_since=_from_iso(body.get("above_since")),
            above_floor=body.get("above_floor"),
            below_since=_from_iso(body.get("below_since")),
            below_peak=body.get("below_peak"),
            idle_since=_from_iso(body.get("idle_since")),
        )


@dataclass(frozen=True)
class Decision:
    """The desired count, why, and the memory for the next tick."""

    desired: int
    reason: Reason
    detail: str
    memory: Memory = field(repr=False)
    previous: int | None = None

    @property
    def changed(self) -> bool:
        return self.previous != self.desired


@dataclass(frozen=True)
class _Bounds:
    lo: int
    lo_reason: Reason
    lo_detail: str
    hi: int
    hi_reason: Reason
    hi_detail: str


def _bounds(policy: Policy, now: datetime) -> _Bounds:
    lo, lo_reason, lo_detail = policy.min_replicas, "min", f"min_replicas {policy.min_replicas}"
    hi, hi_reason, hi_detail = policy.max_replicas, "max", f"max_replicas {policy.max_replicas}"
    for w in active_windows(policy.windows, now):
        if w.min_replicas is not None and w.min_replicas > lo:
            lo, lo_reason, lo_detail = w.min_replicas, "window", w.describe()
        if w.max_replicas is not None and w.max_replicas < hi:
            hi, hi_reason, hi_detail = w.max_replicas, "window", w.describe()
    return _Bounds(lo, lo_reason, lo_detail, hi, hi_reason, hi_detail)  # type: ignore[arg-type]


def _elapsed(since: datetime | None, now: datetime) -> float:
    return (now - since).total_seconds() if since is not None else 0.0


def decide(
    policy: Policy, observation: Observation, memory: Memory | None, now: datetime
) -> Decision:
    """The desired replicas of one model at ``now`` (see the module docstring)."""
    current = memory.desired if memory is not None else observation.replicas
    previous = memory.desired if memory is not None else None
    load = observation.load
    idle_since = None
    if load == 0:
        idle_since = memory.idle_since if memory is not None and memory.idle_since else now

    manual = policy.manual_at(now)
    if manual is not None:
        until = f" until {policy.manual_until.isoformat()}" if policy.manual_until else ""
        fresh = Memory(desired=manual, idle_since=idle_since)
        if manual > policy.max_replicas:
            n = policy.max_replicas
            detail = f"manual {manual}{until} capped by max_replicas {n}"
            return Decision(n, "max", detail, replace(fresh, desired=n), previous)
        return Decision(manual, "manual", f"manual {manual}{until}", fresh, previous)

    b = _bounds(policy, now)
    queue_want = math.ceil(load / policy.target_jobs_per_replica)
    want = min(max(queue_want, b.lo), b.hi)
    queue_detail = (
        f"{load} jobs ({observation.queued} queued, {observation.running} running) "
        f"/ {policy.target_jobs_per_replica:g} per replica -> {queue_want}"
    )
    if want == b.hi and (queue_want > b.hi or b.lo > b.hi):
        reason, detail = b.hi_reason, f"{b.hi_detail}; queue wants {queue_want}"
        if b.lo > b.hi:
            detail += f"; ceiling wins over {b.lo_detail}"
    elif want == b.lo and queue_want < b.lo:
        reason, detail = b.lo_reason, f"{b.lo_detail}; queue wants {queue_want}"
    else:
        reason, detail = "queue", queue_detail

    def decision(n: int, r: Reason, d: str, **mem: Any) -> Decision:
        m = Memory(desired=n, idle_since=idle_since, **mem)
        return Decision(n, r, d, m, previous)

    if want > current:
        floor = min(b.lo, b.hi)  # what the bounds force right now, without waiting
        above_since = memory.above_since if memory is not None and memory.above_since else now
        lowest = want
        if memory is not None and memory.above_floor is not None and memory.above_since:
            lowest = min(memory.above_floor, want)
        waited = _elapsed(above_since, now)
        if current == 0 and load > 0:
            return decision(want, reason, f"{detail}; from zero, at once")
        if waited >= policy.upscale_delay_s:
            return decision(max(lowest, floor), reason, detail)
        if floor > current:
            return decision(
                floor,
                b.lo_reason,
                f"{b.lo_detail}; queue rise waits for upscale delay",
                above_since=above_since,
                above_floor=lowest,
            )
        return decision(
            current,
            "queue",
            f"holding {current}: upscale delay {waited:.0f}/{policy.upscale_delay_s:g} s "
            f"(wants {want})",
            above_since=above_since,
            above_floor=lowest,
        )

    if want < current:
        ceiling = min(current, b.hi)  # what the bounds force right now, without waiting
        below_since = memory.below_since if memory is not None and memory.below_since else now
        peak = want
        if memory is not None and memory.below_peak is not None and memory.below_since:
            peak = max(memory.below_peak, want)
        waited = _elapsed(below_since, now)
        idle_for = _elapsed(idle_since, now) if idle_since is not None else -1.0
        timer_used = True  # a queue-driven step restarts the downscale timer
        if want == 0 and idle_for >= policy.scale_to_zero_delay_s:
            step, step_reason = 0, reason
            step_detail = f"{detail}; idle for {idle_for:.0f} s"
        elif waited >= policy.downscale_delay_s:
            step, step_reason, step_detail = min(ceiling, peak), reason, detail
            if step == 0 and ceiling > 0:
                step, step_reason = 1, "queue"
                step_detail = (
                    f"holding 1: idle {max(idle_for, 0):.0f}/{policy.scale_to_zero_delay_s:g} s "
                    "before scaling to zero"
                )
        else:
            step, step_reason, step_detail = ceiling, b.hi_reason, b.hi_detail
            if ceiling == want:
                step_reason, step_detail = reason, detail
            timer_used = False
        if ceiling < current and step == ceiling:  # the ceiling alone forces this step
            step_reason = b.hi_reason
            if reason != b.hi_reason:
                step_detail = f"{b.hi_detail}; queue wants {queue_want}"
            else:
                step_detail = detail
        if step < current:
            still_below = want < step
            return decision(
                step,
                step_reason,
                step_detail,
                below_since=(now if timer_used else below_since) if still_below else None,
                below_peak=(want if timer_used else peak) if still_below else None,
            )
        hold = f"holding {current}: downscale delay {waited:.0f}/{policy.downscale_delay_s:g} s"
        if timer_used:  # the delay is over; only the idle time before zero is missing
            hold = step_detail
        return decision(
            current,
            "queue",
            f"{hold} (wants {want})",
            below_since=below_since,
            below_peak=peak,
        )

    return decision(current, reason, detail)

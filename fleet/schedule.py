"""Time-of-day scaling windows: cron matching in a timezone, and operator durations.

A window is active during every minute its five-field cron expression matches
the wall clock of its timezone: ``* 9-18 * * 1-5`` in ``Europe/Paris`` is
weekdays 09:00-18:59 Paris time, daylight saving included. Matching is a pure
function of the window and an aware ``datetime``, so the scaler (and the
tests) decide from the clock alone and a missed tick changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo

from croniter import croniter
from pydantic import ValidationError

from config.catalog import ScheduleWindow

WindowSource = Literal["definition", "schedule"]


class ScheduleError(ValueError):
    """A window or a duration an operator gave cannot be used."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Window:
    """One window, from the model definition or added at run time (``id`` set)."""

    cron: str
    timezone: str = "UTC"
    min_replicas: int | None = None
    max_replicas: int | None = None
    source: WindowSource = "definition"
    id: int | None = None

    @classmethod
    def of(cls, window: ScheduleWindow, source: WindowSource = "definition") -> Window:
        return cls(
            cron=window.cron,
            timezone=window.timezone,
            min_replicas=window.min_replicas,
            max_replicas=window.max_replicas,
            source=source,
        )

    def active(self, now: datetime) -> bool:
        """True while ``now`` (an aware datetime) lies in a minute the cron matches."""
        if now.tzinfo is None:
            raise ValueError("naive datetime given to a window")
        local = now.astimezone(ZoneInfo(self.timezone))
        return bool(croniter.match(self.cron, local))

    def describe(self) -> str:
        bounds = []
        if self.min_replicas is not None:
            bounds.append(f"min {self.min_replicas}")
        if self.max_replicas is not None:
            bounds.append(f"max {self.max_replicas}")
        return f"window '{self.cron}' {self.timezone} {' '.join(bounds)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "cron": self.cron,
            "timezone": self.timezone,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
        }


def validated_window(
    cron: str,
    timezone: str = "UTC",
    min_replicas: int | None = None,
    max_replicas: int | None = None,
) -> ScheduleWindow:
    """The same checks as a definition file's window; raises :class:`ScheduleError`."""
    try:
        return ScheduleWindow(
            cron=cron, timezone=timezone, min_replicas=min_replicas, max_replicas=max_replicas
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "window"
        raise ScheduleError(field, str(first["msg"]).removeprefix("Value error, ")) from None


def active_windows(windows: Iterable[Window], now: datetime) -> list[Window]:
    """The windows active at ``now``, in the order given."""
    return [w for w in windows if w.active(now)]


def active_spans(
    window: Window, start: datetime, end: datetime, step: timedelta
) -> list[tuple[datetime, datetime]]:
    """When ``window`` is active in ``[start, end)``, as ``[from, to)`` spans, read every ``step``.

    The window is matched at the minute of ``start`` and then every ``step``
    (a step of one minute is exact; a coarser one, for a chart of days, can
    miss or stretch a span by less than a step). Spans are clipped to the range.
    """
    spans: list[tuple[datetime, datetime]] = []
    at = start.replace(second=0, microsecond=0)
    opened: datetime | None = None
    while at < end:
        if window.active(at):
            opened = opened or max(at, start)
        elif opened is not None:
            spans.append((opened, at))
            opened = None
        at += step
    if opened is not None:
        spans.append((opened, end))
    return spans


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|m|s)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``1d``, ``1h30m`` (or plain seconds) as a timedelta."""
    raw = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", raw):
        seconds = float(raw)
    else:
        parts = _DURATION.findall(raw)
        if not parts or _DURATION.sub("", raw).strip():
            raise ScheduleError("for", f"{text!r} is not a duration like 90s, 15m, 2h or 1h30m")
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds <= 0:
        raise ScheduleError("for", "the duration must be positive")
    return timedelta(seconds=seconds)

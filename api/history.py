"""``GET /v1/admin/history``: the farm's one-minute history, its events and failed jobs.

Operators and admins only. The range is ``last`` (``90m``, ``1h``, ``1d``,
``7d``: up to now) or ``from`` (and optionally ``to``, default now), ISO 8601
with a zone; neither is the last hour. What is recorded and how:
:mod:`fleet.history`. A range over 12 hours is served in buckets of several
minutes (``step_s``; a day: 5 minutes, a week: 15), at most 720 points a series.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, Response, jsonify, request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from api.auth import OPERATORS, role_required
from api.errors import ValidationFailed
from api.openapi import spec
from api.schemas import parse
from api.services import services
from db.history import HistoryStore
from db.scaling import ScalingStore
from db.schema import ScalingWindow
from fleet.history import MINUTE, downsample, step_for
from fleet.history import events as farm_events
from fleet.scaler_state import policy_for
from fleet.schedule import active_spans

bp = Blueprint("history", __name__)

_LAST = re.compile(r"^(?P<n>[1-9][0-9]{0,5})(?P<unit>[mhd])$")
_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1)}
_LONGEST = timedelta(days=366)
# A window's spans are read at most this many times over a range (a week: every 14 min).
_WINDOW_SAMPLES = 720


class HistoryQuery(BaseModel):
    """Query of ``GET /v1/admin/history``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    last: str | None = Field(
        default=None,
        max_length=8,
        description="The range up to now: minutes, hours or days (30m, 1h, 1d, 7d).",
    )
    start: AwareDatetime | None = Field(
        default=None, alias="from", description="Start of the range (ISO 8601 with a zone)."
    )
    to: AwareDatetime | None = Field(
        default=None, description="End of the range (ISO 8601 with a zone); default now."
    )
    model: str | None = Field(default=None, max_length=64, description="One model only.")
    events: int = Field(default=200, ge=0, le=1000, description="Events at most, newest first.")
    failed: int = Field(default=50, ge=0, le=1000, description="Failed jobs at most.")


def time_range(query: HistoryQuery, now: datetime) -> tuple[datetime, datetime]:
    """``[start, end)`` of a query; 422 for a malformed or empty one."""
    if query.last is not None and (query.start is not None or query.to is not None):
        raise ValidationFailed("give 'last' or 'from'/'to', not both", field="last")
    if query.start is None and query.to is not None:
        raise ValidationFailed("'to' needs 'from'", field="from")
    if query.start is not None:
        start, end = query.start.astimezone(UTC), (query.to or now).astimezone(UTC)
    else:
        match = _LAST.match(query.last or "1h")
        if match is None:
            raise ValidationFailed("last: a number and m, h or d (e.g. 1h, 7d)", field="last")
        end = now
        start = end - int(match["n"]) * _UNITS[match["unit"]]
    if start >= end:
        raise ValidationFailed("the range must end after it starts", field="to")
    if end - start > _LONGEST:
        raise ValidationFailed("the range may span 366 days at most", field="from")
    return start, end


def window_spans(
    scaling: ScalingStore, start: datetime, end: datetime, model: str | None
) -> dict[str, list[dict[str, Any]]]:
    """Per model with time-of-day windows, each window and when it was active in the range."""
    minutes = max(1, int((end - start) / MINUTE) // _WINDOW_SAMPLES)
    added: dict[str, list[ScalingWindow]] = {}
    for row in scaling.windows(model):
        added.setdefault(row.model, []).append(row)
    found: dict[str, list[dict[str, Any]]] = {}
    for definition in services().catalog:
        if model is not None and definition.name != model:
            continue
        windows = policy_for(definition.scaling, None, added.get(definition.name, [])).windows
        if windows:
            found[definition.name] = [
                {
                    **w.as_dict(),
                    "spans": [
                        [a.isoformat(), b.isoformat()]
                        for a, b in active_spans(w, start, end, minutes * MINUTE)
                    ],
                }
                for w in windows
            ]
    return found


@bp.get("/v1/admin/history")
@spec(
    "The farm's one-minute history per model, its scaling events and failed jobs",
    tags=("scaling",),
    auth="operator",
    query=HistoryQuery,
)
@role_required(*OPERATORS)
def history() -> Response:
    svc = services()
    query = parse(HistoryQuery, request.args.to_dict())
    start, end = time_range(query, datetime.now(UTC))
    store = HistoryStore(svc.db)
    scaling = ScalingStore(svc.db)
    window = {"start": start, "end": end}
    step = step_for(end - start)
    series = store.series(start, end, query.model)
    return jsonify(
        {
            "from": start.isoformat(),
            "to": end.isoformat(),
            "step_s": int(step.total_seconds()),
            "retention_s": svc.settings.history_retention_s,
            "models": {model: downsample(columns, step) for model, columns in series.items()},
            "events": farm_events(
                scaling.decisions(query.model, query.events, **window),
                scaling.audit(query.model, query.events, **window),
                store.recoveries(start, end, query.model, query.events),
                query.events,
            ),
            "failed_jobs": store.failed_jobs(start, end, query.model, query.failed),
            "windows": window_spans(scaling, start, end, query.model),
        }
    )

"""Scaling administration: a model's policy, manual replicas, schedule windows, audit.

Operators and admins only (403 for other users, 401 without a token). Every
change is recorded with the caller's user name and wakes the scaler, which
applies it at once.

GET    /v1/admin/scaling                          every model: desired vs ready, queues, decisions
GET    /v1/admin/models/<name>/scaling            policy, overrides, manual, windows, decisions
PUT    /v1/admin/models/<name>/scaling            change it (fields left out stay as they are)
GET    /v1/admin/models/<name>/scaling/audit      who changed what, newest first
GET    /v1/admin/models/<name>/schedule           windows (definition and run-time)
POST   /v1/admin/models/<name>/schedule           add a run-time window
DELETE /v1/admin/models/<name>/schedule/<id>      remove a run-time window
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, Response, jsonify, request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from api.auth import OPERATORS, caller, role_required
from api.errors import NotFound, ValidationFailed
from api.openapi import spec
from api.schemas import json_body, parse
from api.services import services
from config.catalog import SCALING_TUNABLES
from fleet.controls import ScalingControls, UnknownModel
from fleet.policy import PolicyError
from fleet.schedule import ScheduleError

bp = Blueprint("scaling", __name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScalingChange(_Body):
    """A change of policy; a tunable sent as null goes back to the definition's value.

    ``replicas`` pins the model (for ``for_s`` seconds or until ``until``,
    else until ``auto``); ``replicas: null`` or ``auto: true`` resumes the
    automatic policy.
    """

    min_replicas: int | None = Field(default=None, ge=0, le=10_000)
    max_replicas: int | None = Field(default=None, ge=0, le=10_000)
    target_jobs_per_replica: float | None = Field(default=None, gt=0, le=1_000_000)
    upscale_delay_s: float | None = Field(default=None, ge=0, le=86_400 * 7)
    downscale_delay_s: float | None = Field(default=None, ge=0, le=86_400 * 7)
    scale_to_zero_delay_s: float | None = Field(default=None, ge=0, le=86_400 * 7)
    replicas: int | None = Field(default=None, ge=0, le=10_000)
    for_s: float | None = Field(default=None, gt=0, le=86_400 * 366)
    until: AwareDatetime | None = None
    auto: bool = False

    @model_validator(mode="after")
    def _coherent(self) -> ScalingChange:
        pinned = "replicas" in self.model_fields_set and self.replicas is not None
        if self.auto and pinned:
            raise ValueError("give 'replicas' or 'auto', not both")
        if (self.for_s is not None or self.until is not None) and not pinned:
            raise ValueError("'for_s' and 'until' need 'replicas'")
        if self.for_s is not None and self.until is not None:
            raise ValueError("give 'for_s' or 'until', not both")
        return self


class WindowBody(_Body):
    cron: str = Field(min_length=1, max_length=128)
    timezone: str = Field(default="UTC", max_length=64)
    min_replicas: int | None = Field(default=None, ge=0, le=10_000)
    max_replicas: int | None = Field(default=None, ge=0, le=10_000)


def _controls() -> ScalingControls:
    svc = services()
    return ScalingControls(svc.settings, svc.catalog, svc.db, svc.redis)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a control, turning its errors into the API's."""
    try:
        return fn(*args, **kwargs)
    except UnknownModel as exc:
        raise NotFound(f"model {exc.model!r} is not served here") from None
    except (PolicyError, ScheduleError) as exc:
        raise ValidationFailed(str(exc), field=exc.field) from None


@bp.get("/v1/admin/scaling")
@spec(
    "Every model's scaling state and the scaler's recent decisions",
    tags=("scaling",),
    auth="operator",
)
@role_required(*OPERATORS)
def scaling_status() -> Response:
    decisions = request.args.get("decisions", "20")
    if not decisions.isdigit() or int(decisions) > 1000:
        raise ValidationFailed("decisions: an integer from 0 to 1000", field="decisions")
    return jsonify(_call(_controls().status, decisions=int(decisions)))


@bp.get("/v1/admin/models/<name>/scaling")
@spec("A model's scaling policy, pin and replicas", tags=("scaling",), auth="operator")
@role_required(*OPERATORS)
def get_scaling(name: str) -> Response:
    return jsonify(_call(_controls().view, name))


@bp.put("/v1/admin/models/<name>/scaling")
@spec(
    "Pin a model's replicas, go back to automatic, or change its policy",
    tags=("scaling",),
    auth="operator",
    body=ScalingChange,
)
@role_required(*OPERATORS)
def put_scaling(name: str) -> Response:
    actor = caller().user_name
    change = parse(ScalingChange, json_body())
    controls = _controls()
    _call(controls.definition, name)
    given = change.model_fields_set
    tunables = {k: getattr(change, k) for k in SCALING_TUNABLES if k in given}
    view = None
    if tunables:
        view = _call(controls.update_policy, name, tunables, actor)
    if change.auto or ("replicas" in given and change.replicas is None):
        view = _call(controls.auto, name, actor)
    elif change.replicas is not None:
        until = change.until
        if change.for_s is not None:
            until = datetime.now(UTC) + timedelta(seconds=change.for_s)
        view = _call(controls.scale, name, change.replicas, until=until, actor=actor)
    return jsonify(view if view is not None else _call(controls.view, name))


@bp.get("/v1/admin/models/<name>/scaling/audit")
@spec("Who changed a model's scaling, when and how", tags=("scaling",), auth="operator")
@role_required(*OPERATORS)
def scaling_audit(name: str) -> Response:
    return jsonify({"model": name, "entries": _call(_controls().audit, name)})


@bp.get("/v1/admin/models/<name>/schedule")
@spec("A model's run-time scaling windows", tags=("scaling",), auth="operator")
@role_required(*OPERATORS)
def list_windows(name: str) -> Response:
    return jsonify({"model": name, "windows": _call(_controls().windows, name)})


@bp.post("/v1/admin/models/<name>/schedule")
@spec(
    "Add a cron window of replicas to a model",
    tags=("scaling",),
    auth="operator",
    body=WindowBody,
    success=201,
)
@role_required(*OPERATORS)
def add_window(name: str) -> tuple[Response, int]:
    actor = caller().user_name
    body = parse(WindowBody, json_body())
    window = _call(
        _controls().add_window,
        name,
        cron=body.cron,
        timezone=body.timezone,
        min_replicas=body.min_replicas,
        max_replicas=body.max_replicas,
        actor=actor,
    )
    response = jsonify(window)
    response.headers["Location"] = f"/v1/admin/models/{name}/schedule/{window['id']}"
    return response, 201


@bp.delete("/v1/admin/models/<name>/schedule/<int:window_id>")
@spec("Remove a run-time scaling window", tags=("scaling",), auth="operator", success=204)
@role_required(*OPERATORS)
def remove_window(name: str, window_id: int) -> tuple[str, int]:
    actor = caller().user_name
    if not _call(_controls().remove_window, name, window_id, actor):
        raise NotFound(f"model {name!r} has no run-time window {window_id}")
    return "", 204

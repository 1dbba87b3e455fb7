"""Admin and operator routes: users, tokens, models.

- users and tokens (role admin): ``GET/POST /v1/admin/users``,
  ``PATCH /v1/admin/users/<name>``, ``POST /v1/admin/users/<name>/tokens``
  (the secret is in this answer only), ``GET /v1/admin/tokens[?user=]``,
  ``DELETE /v1/admin/tokens/<id>`` (revoke);
- models (role operator or admin): ``GET /v1/admin/models`` (definition, run-time
  override, live state), ``PATCH /v1/admin/models/<name>`` with ``enabled`` /
  ``public`` (stored in the database over the YAML; null goes back to the YAML).

Workers and scaling have their own routes (``api/operations.py``).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from flask import Blueprint, Response, jsonify, request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from api.auth import ADMINS, OPERATORS, caller, role_required
from api.catalog import model_states
from api.errors import Conflict, NotFound, ValidationFailed
from api.openapi import spec
from api.schemas import json_body, parse
from api.services import services
from db.accounts import DuplicateUser, TokenInfo, UnknownUser, UserInfo
from db.overrides import UNSET, ModelOverrides, apply, cache_key
from db.schema import Role, utcnow

bp = Blueprint("admin", __name__)

USER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UserCreate(_Body):
    name: str = Field(pattern=USER_NAME)
    role: Role = Role.user
    max_concurrent_jobs: int | None = Field(default=None, ge=0, le=1_000_000)
    requests_per_minute: int | None = Field(default=None, ge=0, le=1_000_000)


class UserUpdate(_Body):
    """Only the fields sent change; a limit set to null goes back to the role's."""

    role: Role | None = None
    max_concurrent_jobs: int | None = Field(default=None, ge=0, le=1_000_000)
    requests_per_minute: int | None = Field(default=None, ge=0, le=1_000_000)


class TokenCreate(_Body):
    name: str = Field(default="", max_length=64)
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)
    expires_at: AwareDatetime | None = None

    @model_validator(mode="after")
    def _one_expiry(self) -> TokenCreate:
        if self.expires_in_s is not None and self.expires_at is not None:
            raise ValueError("give at most one of 'expires_in_s' and 'expires_at'")
        return self

    def expiry(self, default_ttl_days: float) -> datetime | None:
        """The expiry asked for; without one, ``default_ttl_days`` from now.

        ``"expires_at": null`` sent explicitly asks for a token that never
        expires (as does a default of 0 days).
        """
        if self.expires_in_s is not None:
            return utcnow() + timedelta(seconds=self.expires_in_s)
        if self.expires_at is not None or "expires_at" in self.model_fields_set:
            return self.expires_at
        return utcnow() + timedelta(days=default_ttl_days) if default_ttl_days else None


class TokenQuery(_Body):
    user: str | None = Field(default=None, max_length=64)


class ModelPatch(_Body):
    """Only the fields sent change; null goes back to the definition's value."""

    enabled: bool | None = None
    public: bool | None = None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def user_view(user: UserInfo) -> dict[str, Any]:
    return {
        "id": user.id,
        "name": user.name,
        "role": user.role,
        "created_at": _iso(user.created_at),
        "limits": {
            "max_concurrent_jobs": user.max_concurrent_jobs,
            "requests_per_minute": user.requests_per_minute,
        },
    }


def token_view(token: TokenInfo) -> dict[str, Any]:
    return {
        "id": token.id,
        "user": token.user_name,
        "name": token.name,
        "prefix": token.prefix,
        "created_at": _iso(token.created_at),
        "expires_at": _iso(token.expires_at),
        "revoked_at": _iso(token.revoked_at),
        "last_used_at": _iso(token.last_used_at),
        "active": token.active(utcnow()),
    }


@bp.get("/v1/admin/users")
@spec("List users", tags=("admin",), auth="admin")
@role_required(*ADMINS)
def list_users() -> Response:
    return jsonify({"data": [user_view(u) for u in services().accounts.list_users()]})


@bp.post("/v1/admin/users")
@spec("Add a user", tags=("admin",), auth="admin", body=UserCreate, success=201)
@role_required(*ADMINS)
def add_user() -> tuple[Response, int]:
    body = parse(UserCreate, json_body())
    accounts = services().accounts
    try:
        accounts.add_user(
            body.name,
            body.role,
            max_concurrent_jobs=body.max_concurrent_jobs,
            requests_per_minute=body.requests_per_minute,
        )
    except DuplicateUser as exc:
        raise Conflict(str(exc), field="name") from None
    user = accounts.get_user(body.name)
    assert user is not None
    return jsonify(user_view(user)), 201


@bp.patch("/v1/admin/users/<name>")
@spec("Change a user's role or limits", tags=("admin",), auth="admin", body=UserUpdate)
@role_required(*ADMINS)
def update_user(name: str) -> Response:
    body = parse(UserUpdate, json_body())
    changes: dict[str, Any] = {}
    for key in ("max_concurrent_jobs", "requests_per_minute"):
        if key in body.model_fields_set:
            changes[key] = getattr(body, key)
    try:
        user = services().accounts.update_user(name, role=body.role, **changes)
    except UnknownUser as exc:
        raise NotFound(str(exc)) from None
    return jsonify(user_view(user))


@bp.post("/v1/admin/users/<name>/tokens")
@spec(
    "Issue a token for a user; the secret is shown in this answer only",
    tags=("admin",),
    auth="admin",
    body=TokenCreate,
    success=201,
)
@role_required(*ADMINS)
def create_token(name: str) -> tuple[Response, int]:
    body = parse(TokenCreate, json_body())
    expiry = body.expiry(services().settings.token_ttl_days)
    if expiry is not None and expiry <= utcnow():
        raise ValidationFailed("expires_at: must be in the future", field="expires_at")
    try:
        issued = services().accounts.issue_token(name, name=body.name, expires_at=expiry)
    except UnknownUser as exc:
        raise NotFound(str(exc)) from None
    return (
        jsonify(
            {
                "id": issued.token_id,
                "user": issued.user_name,
                "name": issued.name,
                "token": issued.secret,
                "expires_at": _iso(issued.expires_at),
            }
        ),
        201,
    )


@bp.get("/v1/admin/tokens")
@spec("List tokens (never their secrets)", tags=("admin",), auth="admin", query=TokenQuery)
@role_required(*ADMINS)
def list_tokens() -> Response:
    query = parse(TokenQuery, request.args.to_dict())
    tokens = services().accounts.list_tokens(query.user)
    return jsonify({"data": [token_view(t) for t in tokens]})


@bp.delete("/v1/admin/tokens/<int:token_id>")
@spec("Revoke a token", tags=("admin",), auth="admin")
@role_required(*ADMINS)
def revoke_token(token_id: int) -> Response:
    accounts = services().accounts
    owner = accounts.token_owner(token_id)
    if owner is None:
        raise NotFound(f"no token {token_id}")
    revoked = accounts.revoke(token_id)
    return jsonify({"id": token_id, "user": owner, "revoked": True, "changed": revoked})


def _model_view(name: str, states: dict[str, Any]) -> dict[str, Any]:
    svc = services()
    definition = svc.catalog[name]
    override = ModelOverrides(svc.db).get(name)
    effective = apply(definition, override)
    return {
        "id": name,
        "description": definition.description,
        "enabled": effective.enabled,
        "public": effective.public,
        "defaults": {"enabled": definition.enabled, "public": definition.public},
        "override": (
            {"enabled": override.enabled, "public": override.public, "by": override.updated_by}
            if override is not None
            else None
        ),
        "limits": definition.limits.model_dump(),
        "scaling": definition.scaling.model_dump(),
        "state": states.get(name),
    }


@bp.get("/v1/admin/models")
@spec("Models with their state and run-time overrides", tags=("admin",), auth="operator")
@role_required(*OPERATORS)
def list_models() -> Response:
    svc = services()
    states = model_states(svc)
    return jsonify({"data": [_model_view(d.name, states) for d in svc.catalog]})


@bp.patch("/v1/admin/models/<name>")
@spec(
    "Enable/disable a model or change its public flag",
    tags=("admin",),
    auth="operator",
    body=ModelPatch,
)
@role_required(*OPERATORS)
def patch_model(name: str) -> Response:
    principal = caller()
    svc = services()
    if name not in svc.catalog:
        raise NotFound(f"model {name!r} is not defined here")
    body = parse(ModelPatch, json_body())
    ModelOverrides(svc.db).set(
        name,
        actor=principal.user_name,
        enabled=body.enabled if "enabled" in body.model_fields_set else UNSET,
        public=body.public if "public" in body.model_fields_set else UNSET,
    )
    svc.rows.forget(cache_key(name))  # at once here; within a second in other processes
    return jsonify(_model_view(name, model_states(svc)))

"""Liveness and readiness probes."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from api.services import services

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    """The process is alive (touches no dependency)."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    """The database and Redis answer; 503 naming what does not."""
    svc = services()
    checks: dict[str, str] = {}
    try:
        svc.db.ping()
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready
        checks["database"] = f"unavailable: {type(exc).__name__}"
    try:
        svc.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return jsonify({"status": "ready" if ready else "unavailable", "checks": checks}), (
        200 if ready else 503
    )

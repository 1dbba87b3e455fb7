"""The models this farm serves, with their live state: those the caller may use."""

from __future__ import annotations

from collections import Counter
from typing import Any

from flask import Blueprint, Response, jsonify

from api.auth import optional_principal
from api.limits import count_lookup
from api.services import Services, services
from db.overrides import ModelOverrides, apply
from fleet.registry import list_workers
from fleet.scaler_state import ScalerState

bp = Blueprint("catalog", __name__)


def model_states(svc: Services) -> dict[str, dict[str, Any]]:
    """Per model: workers ready/starting, queued and running jobs."""
    counts = svc.jobs.active_counts()
    ready: Counter[str] = Counter()
    starting: Counter[str] = Counter()
    for worker in list_workers(svc.redis, svc.settings):
        if worker.lost:
            continue
        if worker.state == "ready":
            ready[worker.model] += 1
        elif worker.state == "starting":
            starting[worker.model] += 1
    desired = ScalerState(svc.redis, svc.settings).desired()
    states = {}
    for definition in svc.catalog:
        c = counts.get(definition.name, {"queued": 0, "running": 0})
        states[definition.name] = {
            # What the scaler last decided (None: no scaler has run), and why.
            "replicas_desired": desired.get(definition.name, {}).get("desired"),
            "scaling_reason": desired.get(definition.name, {}).get("reason"),
            "replicas_ready": ready[definition.name],
            "replicas_starting": starting[definition.name],
            "queue_depth": c["queued"],
            "running": c["running"],
        }
    return states


@bp.get("/v1/models")
def list_models() -> Response:
    """OpenAI's model list shape, each entry extended with Switchyard's state.

    Only the models the caller may use: enabled ones, and without a token only
    the public ones. A bad token is a 401, as everywhere. Counted as a lookup
    by the caller's limits (429 past them).
    """
    principal = optional_principal()
    count_lookup(principal)
    svc = services()
    states = model_states(svc)
    overrides = ModelOverrides(svc.db).all()
    data = []
    for d in (apply(d, overrides.get(d.name)) for d in svc.catalog):
        if not d.enabled or (principal is None and not d.public):
            continue
        data.append(
            {
                "id": d.name,
                "object": "model",
                "created": 0,
                "owned_by": "switchyard",
                "description": d.description,
                "public": d.public,
                "enabled": d.enabled,
                "backend": d.backend,
                "limits": d.limits.model_dump(),
                "state": states[d.name],
            }
        )
    return jsonify({"object": "list", "data": data})

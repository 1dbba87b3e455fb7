"""Operator routes for the farm's workers, and the reaper thread of an API process.

``GET /v1/admin/workers`` lists every worker the registry knows — live ones
with their state (``starting``, ``ready``, ``draining``, ``failed``), and
those whose heartbeat expired as ``lost`` (no longer counted as capacity,
pruned after ``worker_prune_after_s``). Admins and operators only.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, Response, jsonify

from api.auth import OPERATORS, role_required
from api.services import Services, services
from fleet.capacity import fleet, worker_status
from fleet.reaper import Reaper, ReaperLoop
from fleet.registry import RegisteredWorker, list_workers

bp = Blueprint("operations", __name__)

REAPER_EXTENSION = "switchyard.reaper"


def worker_view(report: RegisteredWorker) -> dict[str, Any]:
    """The public JSON shape of one worker."""
    return {
        "id": report.id,
        "model": report.model,
        "status": worker_status(report),
        "state": report.state,
        "lost": report.lost,
        "host": report.host,
        "pid": report.pid,
        "device": report.device,
        "busy_slots": report.busy_slots,
        "total_slots": report.total_slots,
        "tokens_per_s": report.tokens_per_s,
        "last_job": report.last_job,
        "error": report.error,
        "started_at": report.started_at,
        "heartbeat_age_s": report.heartbeat_age_s,
    }


@bp.get("/v1/admin/workers")
@role_required(*OPERATORS)
def list_all_workers() -> Response:
    svc = services()
    reports = list_workers(svc.redis, svc.settings)
    models = [
        {
            "model": c.model,
            "replicas_desired": c.desired,
            "desired_from": c.desired_from,
            "replicas_ready": c.ready,
            "replicas_starting": c.starting,
            "queue_depth": c.queued,
            "running": c.running,
        }
        for c in fleet(svc.catalog, svc.jobs, svc.redis, svc.settings, reports)
    ]
    return jsonify({"workers": [worker_view(r) for r in reports], "models": models})


def _reaper_of(svc: Services) -> Reaper:
    return Reaper(svc.settings, svc.jobs, svc.events, svc.redis)


def init_app(app: Flask, svc: Services) -> None:
    """Register the routes and, if ``reaper_in_api``, the reaper loop.

    The loop is only registered here: gunicorn's ``post_worker_init`` starts it
    in each worker after the fork (:meth:`Services.start_background`), and its
    ``worker_exit`` stops it. An app built in a test runs no reaper unless the
    test starts it.
    """
    app.register_blueprint(bp)
    if not svc.settings.reaper_in_api:
        return
    loop = ReaperLoop(svc.settings, lambda: _reaper_of(svc))
    app.extensions[REAPER_EXTENSION] = loop
    svc.background.append(loop)

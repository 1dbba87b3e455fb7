"""The farm's capacity per model: desired, ready and starting replicas, queue depth, running jobs.

And the fleet as a submission sees it (:class:`SubmissionFleet`): can a worker
of the model ever come (:func:`check_capacity`), and a wake-up for a model at
zero.

Read from where each fact lives: the job table (queued, running), the worker
heartbeats (only a live ``ready`` worker is capacity), and the scaler's
published decisions (``<prefix>:scaling:desired``, written by
:class:`fleet.scaler_state.ScalerState`); a model the scaler has not decided on
yet shows its definition's ``min_replicas``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import redis
from sqlalchemy.exc import SQLAlchemyError

from config import Catalog, ModelDefinition, Settings
from db.jobs import JobStore
from db.lookups import RowCache
from db.schema import ScalingOverride
from db.session import Database
from fleet.registry import RegisteredWorker, list_workers
from fleet.scaler_state import wake_if_idle
from jobs.errors import Unservable


@dataclass(frozen=True)
class ModelCapacity:
    """One model's line of ``switchyard models list`` and of the replica gauges."""

    model: str
    desired: int
    desired_from: str  # "scaler" or "definition"
    ready: int
    starting: int
    draining: int
    failed: int
    lost: int
    queued: int
    running: int


def worker_status(worker: RegisteredWorker) -> str:
    """``lost`` for a worker whose heartbeat expired, else its reported state.

    A worker that failed to start stays ``failed`` after it exited (until its
    entry is pruned): it was not lost, and its reason stays visible in
    ``switchyard workers``, the operator page and ``switchyard_workers``.
    """
    if worker.state == "failed":
        return worker.state
    return "lost" if worker.lost else worker.state


def scaler_desired(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """Model → replicas the scaler last decided; models it never decided on are absent."""
    found: dict[str, int] = {}
    for key, raw in client.hgetall(settings.key("scaling", "desired")).items():
        model = key.decode() if isinstance(key, bytes) else str(key)
        try:
            found[model] = int(json.loads(raw)["desired"])
        except (ValueError, KeyError, TypeError):
            continue
    return found


def fleet(
    catalog: Catalog,
    jobs: JobStore,
    client: redis.Redis,
    settings: Settings,
    workers: list[RegisteredWorker] | None = None,
) -> list[ModelCapacity]:
    """Every catalog model's capacity now, in catalog order.

    ``workers`` is :func:`list_workers`' answer when the caller already has it.
    """
    if workers is None:
        workers = list_workers(client, settings)
    by_state: dict[str, Counter[str]] = {}
    for w in workers:
        by_state.setdefault(w.model, Counter())[worker_status(w)] += 1
    counts = jobs.active_counts()
    desired = scaler_desired(client, settings)
    lines = []
    for d in catalog:
        states = by_state.get(d.name, Counter())
        c = counts.get(d.name, {})
        lines.append(
            ModelCapacity(
                model=d.name,
                desired=desired.get(d.name, d.scaling.min_replicas),
                desired_from="scaler" if d.name in desired else "definition",
                ready=states["ready"],
                starting=states["starting"],
                draining=states["draining"],
                failed=states["failed"],
                lost=states["lost"],
                queued=c.get("queued", 0),
                running=c.get("running", 0),
            )
        )
    return lines


def _max_replicas(definition: ModelDefinition, db: Database) -> int:
    """The model's maximum replicas, with a run-time scaling override if one is set."""
    try:
        with db.session() as s:
            override = s.get(ScalingOverride, definition.name)
            if override is not None and override.max_replicas is not None:
                return int(override.max_replicas)
    except SQLAlchemyError:
        # Scaling overrides are another feature's table; without it the YAML decides.
        pass
    return definition.scaling.max_replicas


LIVE_WORKER_MAX_AGE_S = 1.0
"""How long a process trusts that a model had a live worker, before reading the registry again."""


def check_capacity(
    definition: ModelDefinition,
    client: redis.Redis,
    db: Database,
    settings: Settings,
    rows: RowCache,
) -> None:
    """:class:`jobs.errors.Unservable` when no worker of ``definition`` can ever come.

    That is: no live worker and scaling allows none, or every registered worker
    failed. A model merely at zero replicas, or starting, passes: its queue
    holds the job until a worker is up. A model seen with a live worker under
    :data:`LIVE_WORKER_MAX_AGE_S` ago passes without reading the registry (a
    job sent as its last worker dies waits for the next, as any queued job does).
    """
    key = f"live:{definition.name}"
    if rows.peek(key, LIVE_WORKER_MAX_AGE_S):
        return
    # A report from another version of the worker may lack a field: it reads as its
    # default (WorkerReport.parse), so it cannot turn a submission into a 500.
    workers = [w for w in list_workers(client, settings) if w.model == definition.name]
    live = [w for w in workers if not w.lost and w.state in ("starting", "ready")]
    if live:
        rows.put(key, True)
        return
    if _max_replicas(definition, db) == 0:
        raise Unservable(
            f"model {definition.name!r} has no workers and its scaling allows none "
            "(max_replicas is 0); ask an operator to raise it"
        )
    if workers and all(w.state == "failed" for w in workers):
        reason = next((w.error for w in workers if w.error), None)
        detail = f": {reason}" if reason else ""
        raise Unservable(
            f"every worker of model {definition.name!r} failed to start{detail}",
        )


class SubmissionFleet:
    """The fleet as :meth:`jobs.service.JobService.submit` asks it (:class:`jobs.service.Fleet`)."""

    def __init__(
        self, client: redis.Redis, db: Database, settings: Settings, rows: RowCache
    ) -> None:
        self.redis = client
        self.db = db
        self.settings = settings
        self.rows = rows

    def check_capacity(self, definition: ModelDefinition) -> None:
        check_capacity(definition, self.redis, self.db, self.settings, self.rows)

    def wake_if_idle(self, model: str) -> None:
        wake_if_idle(self.redis, self.settings, model)

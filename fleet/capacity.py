"""The farm's capacity per model: desired, ready and starting replicas, queue depth, running jobs.

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

from config import Catalog, Settings
from db.jobs import JobStore
from fleet.registry import RegisteredWorker, list_workers


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

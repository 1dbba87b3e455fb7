"""What operators do to scaling, shared by the admin API and the CLI.

Every change is validated against the model's definition (the merged policy
must stay consistent), stored with an audit row naming the actor, and
followed by a wake-up so the scaler applies it at once rather than at its
next tick.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from datetime import datetime
from typing import Any

import redis

from config import Catalog, ModelDefinition, Settings
from config.catalog import SCALING_TUNABLES
from db.jobs import JobStore
from db.scaling import ScalingStore
from db.session import Database
from fleet.policy import Overrides, PolicyError, effective_policy
from fleet.registry import list_workers
from fleet.scaler_state import LeaderLock, ScalerState, policy_for
from fleet.schedule import validated_window


class UnknownModel(LookupError):
    """No model of that name in the catalog."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no model {model!r}")
        self.model = model


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class ScalingControls:
    """Read and change scaling policies, manual counts and schedule windows."""

    def __init__(
        self, settings: Settings, catalog: Catalog, db: Database, client: redis.Redis
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.store = ScalingStore(db)
        self.jobs = JobStore(db)
        self.redis = client
        self.state = ScalerState(client, settings)

    def definition(self, model: str) -> ModelDefinition:
        found = self.catalog.get(model)
        if found is None:
            raise UnknownModel(model)
        return found

    # --- reads ------------------------------------------------------------------------

    def view(self, model: str, *, decisions: int = 10) -> dict[str, Any]:
        """A model's policy: definition, overrides, effective values, manual, windows, state."""
        d = self.definition(model)
        override = self.store.override(model)
        policy = policy_for(d.scaling, override, self.store.windows(model))
        overrides = {n: getattr(override, n) for n in SCALING_TUNABLES} if override else {}
        manual = None
        if override is not None and override.manual_replicas is not None:
            manual = {
                "replicas": override.manual_replicas,
                "until": _iso(override.manual_until),
                "by": override.updated_by,
            }
        return {
            "model": model,
            "definition": d.scaling.model_dump(exclude={"windows"}),
            "overrides": {k: v for k, v in overrides.items() if v is not None},
            "effective": {k: v for k, v in policy.as_dict().items() if k != "windows"},
            "manual": manual,
            "windows": [w.as_dict() for w in policy.windows],
            "current": self.current(model),
            "decisions": [r.as_dict() for r in self.store.decisions(model, limit=decisions)],
        }

    def current(self, model: str) -> dict[str, Any]:
        """The published desired count and the live numbers of one model."""
        return self.status(models=[model])["models"][0]

    def status(self, models: list[str] | None = None, *, decisions: int = 0) -> dict[str, Any]:
        """Per model: desired (and why) vs ready/starting workers, queued and running jobs."""
        names = models if models is not None else self.catalog.names
        for name in names:
            self.definition(name)
        desired = self.state.desired()
        counts = self.jobs.active_counts()
        workers = [w for w in list_workers(self.redis, self.settings) if not w.lost]
        ready: Counter[str] = Counter(w.model for w in workers if w.state == "ready")
        starting: Counter[str] = Counter(w.model for w in workers if w.state == "starting")
        draining: Counter[str] = Counter(w.model for w in workers if w.state == "draining")
        rows = []
        for name in names:
            published = desired.get(name, {})
            c = counts.get(name, {"queued": 0, "running": 0})
            rows.append(
                {
                    "model": name,
                    "desired": published.get("desired"),
                    "reason": published.get("reason"),
                    "detail": published.get("detail"),
                    "decided_at": published.get("at"),
                    "replicas_ready": ready[name],
                    "replicas_starting": starting[name],
                    "replicas_draining": draining[name],
                    "queued": c["queued"],
                    "running": c["running"],
                }
            )
        body: dict[str, Any] = {
            "leader": LeaderLock(self.redis, self.state.lock_key, 1, "").leader(),
            "models": rows,
            "workers": [asdict(w) for w in workers if w.model in names],
        }
        if decisions:
            body["decisions"] = [r.as_dict() for r in self.store.decisions(limit=decisions)]
        return body

    def audit(self, model: str, limit: int = 50) -> list[dict[str, Any]]:
        self.definition(model)
        return self.store.audit(model, limit)

    # --- changes ----------------------------------------------------------------------

    def _within_bound(self, field: str, value: int | None) -> None:
        """PolicyError when ``value`` passes the farm's ceiling per model."""
        bound = self.settings.max_replicas_per_model
        if value is not None and value > bound:
            raise PolicyError(
                field,
                f"{value} is above the farm's limit of {bound} replicas per model "
                "(SWITCHYARD_MAX_REPLICAS_PER_MODEL)",
            )

    def update_policy(self, model: str, changes: dict[str, Any], actor: str) -> dict[str, Any]:
        """Set tunables (None restores the definition's); PolicyError if inconsistent."""
        d = self.definition(model)
        for name in changes:
            if name not in SCALING_TUNABLES:
                raise PolicyError(name, "not a scaling tunable")
        for name in ("min_replicas", "max_replicas"):
            self._within_bound(name, changes.get(name))
        override = self.store.override(model)
        merged = {n: getattr(override, n) if override else None for n in SCALING_TUNABLES}
        merged.update(changes)

        effective_policy(d.scaling, Overrides(**merged))  # raises when inconsistent
        if changes:
            self.store.update_policy(model, changes, actor)
            self.state.wake(model)
        return self.view(model)

    def scale(
        self, model: str, replicas: int, *, until: datetime | None, actor: str
    ) -> dict[str, Any]:
        """Pin ``model`` at ``replicas`` (until ``until``, or until :meth:`auto`)."""
        d = self.definition(model)
        policy = policy_for(d.scaling, self.store.override(model), [])
        if replicas < 0:
            raise PolicyError("replicas", "must not be negative")
        self._within_bound("replicas", replicas)
        if replicas > policy.max_replicas:
            raise PolicyError(
                "replicas",
                f"{replicas} is above max_replicas {policy.max_replicas}; raise it first",
            )
        self.store.set_manual(model, replicas, until, actor)
        self.state.wake(model)
        return self.view(model)

    def auto(self, model: str, actor: str) -> dict[str, Any]:
        """Hand ``model`` back to its automatic policy."""
        self.definition(model)
        self.store.clear_manual(model, actor)
        self.state.wake(model)
        return self.view(model)

    def windows(self, model: str) -> list[dict[str, Any]]:
        d = self.definition(model)
        return [w.as_dict() for w in policy_for(d.scaling, None, self.store.windows(model)).windows]

    def add_window(
        self,
        model: str,
        *,
        cron: str,
        timezone: str = "UTC",
        min_replicas: int | None = None,
        max_replicas: int | None = None,
        actor: str,
    ) -> dict[str, Any]:
        """Add a run-time window; ScheduleError names the bad field."""
        self.definition(model)
        self._within_bound("min_replicas", min_replicas)
        self._within_bound("max_replicas", max_replicas)
        w = validated_window(cron, timezone, min_replicas, max_replicas)
        row = self.store.add_window(
            model,
            cron=w.cron,
            timezone=w.timezone,
            min_replicas=w.min_replicas,
            max_replicas=w.max_replicas,
            actor=actor,
        )
        self.state.wake(model)
        return {
            "id": row.id,
            "source": "schedule",
            "cron": row.cron,
            "timezone": row.timezone,
            "min_replicas": row.min_replicas,
            "max_replicas": row.max_replicas,
        }

    def remove_window(self, model: str, window_id: int, actor: str) -> bool:
        self.definition(model)
        removed = self.store.remove_window(model, window_id, actor)
        if removed:
            self.state.wake(model)
        return removed

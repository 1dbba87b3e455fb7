"""Scaling records: run-time policy overrides, schedule windows, decisions, the audit trail.

Every change an operator makes goes through :class:`ScalingStore` together
with an audit row naming who made it, in the same transaction, so the two
can never disagree. The rows are plain data; merging them with a model's
definition is ``fleet.policy``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from config.catalog import SCALING_TUNABLES
from db.schema import ScalingAudit, ScalingDecision, ScalingOverride, ScalingWindow, utcnow
from db.session import Database


@dataclass(frozen=True)
class DecisionRecord:
    """One change of a model's desired replicas, as the scaler recorded it."""

    model: str
    at: datetime
    previous: int | None
    desired: int
    reason: str
    detail: str
    queued: int
    running: int
    ready: int
    scaler: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "at": self.at.isoformat(),
            "previous": self.previous,
            "desired": self.desired,
            "reason": self.reason,
            "detail": self.detail,
            "queued": self.queued,
            "running": self.running,
            "ready": self.ready,
            "scaler": self.scaler,
        }


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


class ScalingStore:
    """Reads and writes the scaling tables through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # --- overrides ------------------------------------------------------------------

    def overrides(self) -> dict[str, ScalingOverride]:
        """Every model's override row, by model."""
        with self.db.session() as s:
            return {row.model: row for row in s.scalars(select(ScalingOverride))}

    def override(self, model: str) -> ScalingOverride | None:
        with self.db.session() as s:
            return s.get(ScalingOverride, model)

    def _row(self, s: Session, model: str, actor: str) -> ScalingOverride:
        row = s.get(ScalingOverride, model, with_for_update=True)
        if row is None:
            row = ScalingOverride(model=model)
            s.add(row)
        row.updated_by = actor
        row.updated_at = utcnow()
        return row

    def update_policy(self, model: str, changes: dict[str, Any], actor: str) -> None:
        """Set the given tunables (None restores the definition's value); audited."""
        unknown = set(changes) - set(SCALING_TUNABLES)
        if unknown:
            raise ValueError(f"not a scaling tunable: {', '.join(sorted(unknown))}")
        with self.db.session() as s:
            row = self._row(s, model, actor)
            for name, value in changes.items():
                setattr(row, name, value)
            self._audit(s, actor, model, "policy", changes)

    def set_manual(self, model: str, replicas: int, until: datetime | None, actor: str) -> None:
        """Pin ``model`` at ``replicas`` until ``until`` (None: until set back to auto)."""
        with self.db.session() as s:
            row = self._row(s, model, actor)
            row.manual_replicas = replicas
            row.manual_until = until
            self._audit(s, actor, model, "manual", {"replicas": replicas, "until": until})

    def clear_manual(self, model: str, actor: str) -> None:
        """Hand ``model`` back to the automatic policy."""
        with self.db.session() as s:
            row = self._row(s, model, actor)
            row.manual_replicas = None
            row.manual_until = None
            self._audit(s, actor, model, "auto", {})

    # --- schedule windows -----------------------------------------------------------

    def windows(self, model: str | None = None) -> list[ScalingWindow]:
        """Run-time windows (all models, or one), oldest first."""
        query = select(ScalingWindow).order_by(ScalingWindow.id)
        if model is not None:
            query = query.where(ScalingWindow.model == model)
        with self.db.session() as s:
            return list(s.scalars(query))

    def add_window(
        self,
        model: str,
        *,
        cron: str,
        timezone: str,
        min_replicas: int | None,
        max_replicas: int | None,
        actor: str,
    ) -> ScalingWindow:
        with self.db.session() as s:
            row = ScalingWindow(
                model=model,
                cron=cron,
                timezone=timezone,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                created_by=actor,
                created_at=utcnow(),
            )
            s.add(row)
            s.flush()
            self._audit(
                s,
                actor,
                model,
                "schedule_add",
                {
                    "id": row.id,
                    "cron": cron,
                    "timezone": timezone,
                    "min_replicas": min_replicas,
                    "max_replicas": max_replicas,
                },
            )
            return row

    def remove_window(self, model: str, window_id: int, actor: str) -> bool:
        """Delete one of ``model``'s windows; False if it has no such window."""
        with self.db.session() as s:
            result = s.execute(
                delete(ScalingWindow).where(
                    ScalingWindow.id == window_id, ScalingWindow.model == model
                )
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                return False
            self._audit(s, actor, model, "schedule_remove", {"id": window_id})
            return True

    # --- decisions and audit --------------------------------------------------------

    def record_decision(self, record: DecisionRecord) -> None:
        with self.db.session() as s:
            s.add(
                ScalingDecision(
                    model=record.model,
                    at=record.at,
                    previous=record.previous,
                    desired=record.desired,
                    reason=record.reason,
                    detail=record.detail,
                    queued=record.queued,
                    running=record.running,
                    ready=record.ready,
                    scaler=record.scaler,
                )
            )

    def decisions(
        self,
        model: str | None = None,
        limit: int = 20,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[DecisionRecord]:
        """The newest decisions first (those made in ``[start, end)`` when given)."""
        query = select(ScalingDecision).order_by(ScalingDecision.id.desc()).limit(limit)
        if model is not None:
            query = query.where(ScalingDecision.model == model)
        if start is not None:
            query = query.where(ScalingDecision.at >= start)
        if end is not None:
            query = query.where(ScalingDecision.at < end)
        with self.db.session() as s:
            return [
                DecisionRecord(
                    model=r.model,
                    at=r.at,
                    previous=r.previous,
                    desired=r.desired,
                    reason=r.reason,
                    detail=r.detail,
                    queued=r.queued,
                    running=r.running,
                    ready=r.ready,
                    scaler=r.scaler,
                )
                for r in s.scalars(query)
            ]

    def audit(
        self,
        model: str | None = None,
        limit: int = 50,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """The newest audit entries first (those made in ``[start, end)`` when given)."""
        query = select(ScalingAudit).order_by(ScalingAudit.id.desc()).limit(limit)
        if model is not None:
            query = query.where(ScalingAudit.model == model)
        if start is not None:
            query = query.where(ScalingAudit.at >= start)
        if end is not None:
            query = query.where(ScalingAudit.at < end)
        with self.db.session() as s:
            return [
                {
                    "at": r.at.isoformat(),
                    "actor": r.actor,
                    "model": r.model,
                    "action": r.action,
                    "details": r.details,
                }
                for r in s.scalars(query)
            ]

    def _audit(
        self, s: Session, actor: str, model: str, action: str, details: dict[str, Any]
    ) -> None:
        s.add(
            ScalingAudit(
                at=utcnow(),
                actor=actor,
                model=model,
                action=action,
                details={k: _plain(v) for k, v in details.items()},
            )
        )

"""Run-time overrides of model definitions: enabled and public, set by operators.

The YAML file is the default; a row here wins for each column that is not
null. Every API process reads the row at each submission (one primary-key
lookup), so a change applies everywhere at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from config import ModelDefinition
from db.schema import ModelOverride, utcnow
from db.session import Database

UNSET: object = object()
"""Leave a column as it is (None resets it to the definition's value)."""


@dataclass(frozen=True)
class Override:
    model: str
    enabled: bool | None
    public: bool | None
    updated_by: str


def apply(definition: ModelDefinition, override: Override | None) -> ModelDefinition:
    """``definition`` with the override's non-null fields over it."""
    if override is None:
        return definition
    changes: dict[str, bool] = {}
    if override.enabled is not None:
        changes["enabled"] = override.enabled
    if override.public is not None:
        changes["public"] = override.public
    return definition.model_copy(update=changes) if changes else definition


def _view(row: ModelOverride) -> Override:
    return Override(
        model=row.model, enabled=row.enabled, public=row.public, updated_by=row.updated_by
    )


class ModelOverrides:
    """Override rows through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, model: str) -> Override | None:
        with self.db.session() as s:
            row = s.get(ModelOverride, model)
            return _view(row) if row is not None else None

    def all(self) -> dict[str, Override]:
        with self.db.session() as s:
            return {r.model: _view(r) for r in s.execute(select(ModelOverride)).scalars()}

    def set(
        self,
        model: str,
        *,
        actor: str,
        enabled: bool | object | None = UNSET,
        public: bool | object | None = UNSET,
    ) -> Override:
        """Change the given columns of ``model``'s override (None: back to the YAML's)."""
        with self.db.session() as s:
            row = s.get(ModelOverride, model, with_for_update=True)
            if row is None:
                row = ModelOverride(model=model, enabled=None, public=None)
                s.add(row)
            if enabled is not UNSET:
                row.enabled = enabled  # type: ignore[assignment]
            if public is not UNSET:
                row.public = public  # type: ignore[assignment]
            row.updated_by = actor
            row.updated_at = utcnow()
            s.flush()
            return _view(row)

"""Run-time overrides of model definitions: enabled and public, set by operators.

The YAML file is the default; a row here wins for each column that is not
null. An API process reads a model's row at most once per
:data:`CACHE_MAX_AGE_S` (one primary-key lookup a second, not one a
submission): an operator's change applies at once in the process that made
it and within a second everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from config import ModelDefinition
from db.schema import ModelOverride, utcnow
from db.session import Database

CACHE_MAX_AGE_S = 1.0
"""How old an API process's copy of a model's override may be."""

UNSET: object = object()
"""Leave a column as it is (None resets it to the definition's value)."""


@dataclass(frozen=True)
class Override:
    model: str
    enabled: bool | None
    public: bool | None
    updated_by: str


def cache_key(model: str) -> str:
    """The key of ``model``'s override in an API process's row cache."""
    return f"override:{model}"


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

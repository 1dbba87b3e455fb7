"""API: job deadlines and idempotency keys, per-user limits, model overrides

Revision ID: 0002_api
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_api"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("deadline_at", TS, nullable=True))
        batch.add_column(sa.Column("idempotency_key", sa.String(320), nullable=True))
        batch.create_unique_constraint("uq_jobs_idempotency_key", ["idempotency_key"])
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("max_concurrent_jobs", sa.Integer, nullable=True))
        batch.add_column(sa.Column("requests_per_minute", sa.Integer, nullable=True))
    op.create_table(
        "model_overrides",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("enabled", sa.Boolean, nullable=True),
        sa.Column("public", sa.Boolean, nullable=True),
        sa.Column("updated_by", sa.String(128), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_overrides")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("requests_per_minute")
        batch.drop_column("max_concurrent_jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_idempotency_key", type_="unique")
        batch.drop_column("idempotency_key")
        batch.drop_column("deadline_at")

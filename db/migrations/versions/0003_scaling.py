"""scaling: policy overrides, schedule windows, decisions, audit

Revision ID: 0003_scaling
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_scaling"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "scaling_overrides",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("min_replicas", sa.Integer, nullable=True),
        sa.Column("max_replicas", sa.Integer, nullable=True),
        sa.Column("target_jobs_per_replica", sa.Float, nullable=True),
        sa.Column("upscale_delay_s", sa.Float, nullable=True),
        sa.Column("downscale_delay_s", sa.Float, nullable=True),
        sa.Column("scale_to_zero_delay_s", sa.Float, nullable=True),
        sa.Column("manual_replicas", sa.Integer, nullable=True),
        sa.Column("manual_until", TS, nullable=True),
        sa.Column("updated_by", sa.String(128), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "scaling_windows",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("cron", sa.String(128), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("min_replicas", sa.Integer, nullable=True),
        sa.Column("max_replicas", sa.Integer, nullable=True),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_scaling_windows_model", "scaling_windows", ["model"])
    op.create_table(
        "scaling_decisions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("previous", sa.Integer, nullable=True),
        sa.Column("desired", sa.Integer, nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("queued", sa.Integer, nullable=False),
        sa.Column("running", sa.Integer, nullable=False),
        sa.Column("ready", sa.Integer, nullable=False),
        sa.Column("scaler", sa.String(255), nullable=False),
    )
    op.create_index("ix_scaling_decisions_model_at", "scaling_decisions", ["model", "at"])
    op.create_table(
        "scaling_audit",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("details", sa.JSON, nullable=False),
    )
    op.create_index("ix_scaling_audit_model_at", "scaling_audit", ["model", "at"])


def downgrade() -> None:
    op.drop_table("scaling_audit")
    op.drop_table("scaling_decisions")
    op.drop_table("scaling_windows")
    op.drop_table("scaling_overrides")

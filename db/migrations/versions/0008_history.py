"""history: one-minute rollups per model, the reaper's recoveries, job time indexes

Revision ID: 0008_history
Revises: 0007_request_id
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_history"
down_revision = "0007_request_id"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "history_minutes",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("minute", TS, primary_key=True),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("queue_depth", sa.Integer, nullable=False),
        sa.Column("running", sa.Integer, nullable=False),
        sa.Column("desired", sa.Integer, nullable=True),
        sa.Column("ready", sa.Integer, nullable=False),
        sa.Column("starting", sa.Integer, nullable=False),
        sa.Column("tokens_per_s", sa.Float, nullable=False),
        sa.Column("jobs_started", sa.Integer, nullable=False),
        sa.Column("jobs_finished", sa.Integer, nullable=False),
        sa.Column("errors", sa.Integer, nullable=False),
        sa.Column("ttft_p50_s", sa.Float, nullable=True),
        sa.Column("ttft_p95_s", sa.Float, nullable=True),
        sa.Column("queue_wait_p50_s", sa.Float, nullable=True),
        sa.Column("queue_wait_p95_s", sa.Float, nullable=True),
    )
    op.create_index("ix_history_minutes_minute", "history_minutes", ["minute"])
    op.create_table(
        "job_recoveries",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
    )
    op.create_index("ix_job_recoveries_at", "job_recoveries", ["at"])
    op.create_index("ix_jobs_started_at", "jobs", ["started_at"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", "jobs")
    op.drop_index("ix_jobs_started_at", "jobs")
    op.drop_table("job_recoveries")
    op.drop_table("history_minutes")

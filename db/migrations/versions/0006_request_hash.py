"""jobs.request_hash: the request an idempotency key was first used with

Revision ID: 0006_request_hash
Revises: 0005_merge
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_request_hash"
down_revision = "0005_merge"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "request_hash")

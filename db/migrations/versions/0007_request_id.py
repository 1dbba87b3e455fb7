"""jobs.request_id: the X-Request-ID of the request that submitted the job

Revision ID: 0007_request_id
Revises: 0006_request_hash
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_request_id"
down_revision = "0006_request_hash"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_id", sa.String(128), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "request_id")

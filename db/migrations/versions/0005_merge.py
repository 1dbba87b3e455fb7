"""merge the API, scaling and chats branches into one head

Revision ID: 0005_merge
Revises: 0002_api, 0003_scaling, 0004_chats
Create Date: 2026-11-29
"""

from __future__ import annotations

revision = "0005_merge"
down_revision = ("0002_api", "0003_scaling", "0004_chats")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass

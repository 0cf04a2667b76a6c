"""index the receipts that still hold a payload (payload retention walks only those)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_receipts_payload_held",
        "receipts",
        ["received_at", "id"],
        unique=False,
        postgresql_where=sa.text("payload IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_receipts_payload_held", table_name="receipts")

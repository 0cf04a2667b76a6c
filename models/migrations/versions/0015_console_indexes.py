"""console read paths: deliveries by (source, status), newest receipts first (issue 21 benchmark)

``ix_deliveries_source_status``: (source_id, status, id, receipt_id, expires_at) on the
partitioned parent (so on every partition, present and future). The console's events list
filtered by a rare status and the dead-letter preview read it with an index-only scan: the
receipt keys of one source's deliveries in one state, and the delivery ids in id order,
without touching the heap of a million rows or scanning every receipt of the source.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_deliveries_source_status",
        "deliveries",
        ["source_id", "status", "id", "receipt_id", "expires_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_deliveries_source_status", table_name="deliveries")

"""console events by source and dead: deliveries walked newest first (issue 21 benchmark)

``ix_deliveries_source_dead``: (source_id, created_at, receipt_id, expires_at) of the dead
deliveries only (partial: ``status = 'dead'``), on the partitioned parent (so on every
partition, present and future), as 0015. Partial so that the hot path does not pay for it: a
delivery's inserts and its claim and success updates never touch it, only its death (a full
index on (source_id, status, created_at, ...) was 116 MB at 1,000,000 deliveries and one more
index write per insert and status change). The console's events list filtered by source and
dead walks it backwards, index-only, and stops once it has a page: a delivery is never
created before its receipt was received (``webhooks_accept`` and ``webhooks_accept_many``
write both columns from one instant), so
every receipt behind the walk was received no later than the walk's position
(``models.event_walk.walk_by_created``). Before, every one of the source's 10,000 dead
deliveries had its receipt probed and sorted for each page.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_deliveries_source_dead",
        "deliveries",
        ["source_id", "created_at", "receipt_id", "expires_at"],
        unique=False,
        postgresql_where=sa.text("status = 'dead'"),
    )


def downgrade() -> None:
    op.drop_index("ix_deliveries_source_dead", table_name="deliveries")

"""a finished delivery has no next attempt: ``deliveries.next_attempt_at`` may be NULL

Succeeded, dead and discarded deliveries clear it (operators saw a "next attempt" on work
that was over); the sweeper's ``next_attempt_at <= now`` never matches NULL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column(
        "deliveries", "next_attempt_at", existing_type=sa.DateTime(timezone=True), nullable=True
    )
    op.execute(
        "UPDATE deliveries SET next_attempt_at = NULL"
        " WHERE status IN ('succeeded', 'dead', 'discarded')"
    )


def downgrade() -> None:
    op.execute("UPDATE deliveries SET next_attempt_at = updated_at WHERE next_attempt_at IS NULL")
    op.alter_column(
        "deliveries", "next_attempt_at", existing_type=sa.DateTime(timezone=True), nullable=False
    )

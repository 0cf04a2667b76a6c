"""each attempt records when its outcome was committed, beside when its handler returned

``attempts.committed_at``: the database's ``clock_timestamp()`` in the statement that recorded
the attempt's outcome (succeeded, retry, dead). For a success ``ended_at`` is the instant its
handler returned, that is when the downstream's 2xx arrived; ``committed_at - ended_at`` is
how long that effect stood unrecorded, the window in which a worker lost (killed, frozen,
partitioned) lets the delivery run again (issue 32: every repeat has a name). NULL for rows
written before this revision and for attempts whose worker died with the lease (``crashed``:
they never committed).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """A nullable column with no default: a catalog change, no table rewrite (every
    partition takes it from the parent)."""
    op.execute("ALTER TABLE attempts ADD COLUMN committed_at timestamptz")


def downgrade() -> None:
    op.execute("ALTER TABLE attempts DROP COLUMN committed_at")

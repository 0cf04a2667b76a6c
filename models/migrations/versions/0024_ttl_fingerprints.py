"""each receiver's and worker's dedup TTL inputs: ``ttl_fingerprints``

One row per live process, keyed by (host, pid, role): the inputs it derives every source's
dedup TTL from besides the source's own overrides (its providers' retry windows, the
queue-lag, clock-skew and replay-grace settings, the raised TTL's margin floor: ``terms``, as
JSON in seconds; ``digest``, a short hash of it), its environment, when it started and when it
was last seen, both on the database's clock. Written at the process's start and refreshed by
its heartbeat (models/ttl_fingerprints.py), deleted at a clean stop, and by maintenance once
not seen for ``WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER``. A handful of rows: no index beyond the
key.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    now = sa.text("now()")
    op.create_table(
        "ttl_fingerprints",
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("environment", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("terms", postgresql.JSONB(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.CheckConstraint("role IN ('receiver', 'worker')", name=op.f("ck_ttl_fingerprints_role")),
        sa.PrimaryKeyConstraint("host", "pid", "role", name=op.f("pk_ttl_fingerprints")),
    )


def downgrade() -> None:
    op.drop_table("ttl_fingerprints")

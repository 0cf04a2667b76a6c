"""the database's identity for claim keys, and a count of the sweeper's re-publishes

``installation`` holds one row: a random id made when this migration runs. Workers read it
once per process and put it in every fast-claim key (``claim:<installation>:<delivery>:<gen>``),
so a key left in a shared Redis by another database, or by an earlier life of this one
(dropped and recreated: delivery ids start again at 1), never matches a row of this one
(issue 19, 0b).

``deliveries.republished`` counts the sweeper's re-publishes since the row was last claimed.
A pending row re-published twice goes to the durable claim whatever its fast-claim key says:
the sweeper moves ``next_attempt_at`` ahead when it publishes, so the probe's overdue test
alone never sees such a row as overdue.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "installation",
        sa.Column("singleton", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("singleton", name=op.f("ck_installation_singleton")),
        sa.PrimaryKeyConstraint("singleton", name=op.f("pk_installation")),
    )
    # 64 random bits (gen_random_uuid is built in since Postgres 13), as 16 hex characters:
    # short, because every claim key carries it.
    op.execute("INSERT INTO installation (id) VALUES (left(md5(gen_random_uuid()::text), 16))")
    # A constant default: Postgres adds the column without rewriting the partitions.
    op.add_column(
        "deliveries",
        sa.Column("republished", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("deliveries", "republished")
    op.drop_table("installation")

"""a worker killed over one stuck handler names it: crash marks on the deliveries it held

``deliveries.crash_mark``: written by a worker's watchdog just before it kills its own process
over a handler stuck past 1.5 x the hard time limit (:mod:`tasks.pools`), for the attempt in
flight then: ``suspect`` on the stuck delivery, ``bystander`` on every other delivery that
process was running. The next claim of a lease-expired row counts a redelivery (a crash,
``max_redeliveries``) unless it is marked ``bystander``; an unmarked row (a kill -9 from
outside, no chance to name anyone) keeps the old rule. Every claim clears the mark.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: Postgres adds the column without rewriting the partitions.
    op.add_column("deliveries", sa.Column("crash_mark", sa.Text(), nullable=True))
    op.create_check_constraint("crash_mark", "deliveries", "crash_mark IN ('suspect', 'bystander')")


def downgrade() -> None:
    op.drop_constraint(op.f("ck_deliveries_crash_mark"), "deliveries", type_="check")
    op.drop_column("deliveries", "crash_mark")

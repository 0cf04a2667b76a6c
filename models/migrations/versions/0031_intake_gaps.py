"""the receivers' heartbeat segments and the errors they answered: ``intake_heartbeats``,
``intake_errors``

Issue 38 item 2 (:mod:`core.gaps`, :mod:`models.intake_gaps`). Each receiver process keeps
one row of ``intake_heartbeats`` per uninterrupted stretch in which it reached the database:
``started_at`` and ``last_seen`` on the database's clock, ``last_seen`` moved by a beat every
``WEBHOOKS_INTAKE_HEARTBEAT_PERIOD`` from a thread of its own (never per request); a beat
that finds its row's ``last_seen`` more than two periods old opens a new row. Rows are kept
after the process stops: the ranges no row covers are the times no receiver answered. A row
opened by a process whose beats failed meanwhile (it was up, the database did not answer it)
says since when, by its own clock (``unreachable_since``): the range before it is then the
database unreachable, not a receiver down.

``intake_errors`` counts the 5xx answers the receivers gave, per source public id (or
``unknown`` when the source could not be looked up), minute of the receiver's clock and kind
(``database_unreachable``: the 503 of a database that did not answer; ``errors_answered``:
any other 5xx). A receiver counts them in memory and adds its counts here when the database
answers again (an upsert that adds), so several receivers share a row.

Both are pruned by maintenance once older than the longest retry window of the sources'
providers plus a margin. Indexes: ``last_seen`` and ``minute``, which the reads and the prune
range over.

Downgrade drops both tables.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = "kind IN ('database_unreachable', 'errors_answered')"


def upgrade() -> None:
    now = sa.text("now()")
    op.create_table(
        "intake_heartbeats",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("unreachable_since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_intake_heartbeats")),
    )
    op.create_index(op.f("ix_intake_heartbeats_last_seen"), "intake_heartbeats", ["last_seen"])
    op.create_table(
        "intake_errors",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.CheckConstraint(KINDS, name=op.f("ck_intake_errors_kind")),
        sa.PrimaryKeyConstraint("source", "minute", "kind", name=op.f("pk_intake_errors")),
    )
    op.create_index(op.f("ix_intake_errors_minute"), "intake_errors", ["minute"])


def downgrade() -> None:
    op.drop_table("intake_errors")
    op.drop_table("intake_heartbeats")

"""payload shape drift: ``drift_marks``, ``drift_shapes``, ``drift_paths``, ``drift_findings``

Issue 38 item 3. A periodic learning run (beat, on a worker: tasks/drift.py) reads the
receipts accepted since its mark (``drift_marks``: one row, the last receipt id read and when
a run last claimed its period, on the database's clock), samples a few per (source, event
type), and stores each one's payload shape (core/shapes.py): per (source, event type) when it
was first and last sighted (``drift_shapes``), and per JSON key path its types and first and
last sighting and in how many learnt events it was (``drift_paths``: a path in every one,
``drift_shapes.sightings``, is one the event type always had); never a value. A path that
appears, changes type, or stops appearing is a row of ``drift_findings``, open until an
operator accepts it (``webhooks drift accept``, audited). A partial unique index keeps one
open finding per (source, event type, path, kind): two runs that see the same drift open it
once (INSERT ... ON CONFLICT DO NOTHING).

Rows cascade with their source. Downgrade drops the four tables (nothing else reads them).

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def _source_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["source_id"], ["sources.id"], name=op.f(f"fk_{table}_source_id_sources"),
        ondelete="CASCADE",
    )  # fmt: skip


def upgrade() -> None:
    op.create_table(
        "drift_marks",
        sa.Column("singleton", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("through_receipt_id", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("ran_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("singleton", name=op.f("pk_drift_marks")),
    )
    op.execute("INSERT INTO drift_marks (singleton) VALUES (true)")
    op.create_table(
        "drift_shapes",
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("first_seen", _TS, nullable=False),
        sa.Column("last_seen", _TS, nullable=False),
        sa.Column("sightings", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cut_paths", sa.BigInteger(), server_default="0", nullable=False),
        _source_fk("drift_shapes"),
        sa.PrimaryKeyConstraint("source_id", "event_type", name=op.f("pk_drift_shapes")),
    )
    op.create_table(
        "drift_paths",
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("types", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("first_seen", _TS, nullable=False),
        sa.Column("last_seen", _TS, nullable=False),
        sa.Column("sightings", sa.BigInteger(), server_default="0", nullable=False),
        _source_fk("drift_paths"),
        sa.PrimaryKeyConstraint("source_id", "event_type", "path", name=op.f("pk_drift_paths")),
    )
    op.create_table(
        "drift_findings",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("opened_at", _TS, nullable=False),
        sa.Column("accepted_at", _TS, nullable=True),
        sa.Column("accepted_by", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "kind IN ('new_path', 'type_changed', 'path_gone')", name=op.f("ck_drift_findings_kind")
        ),
        _source_fk("drift_findings"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drift_findings")),
    )
    op.create_index(
        "uq_drift_findings_open", "drift_findings", ["source_id", "event_type", "path", "kind"],
        unique=True, postgresql_where=sa.text("accepted_at IS NULL"),
    )  # fmt: skip


def downgrade() -> None:
    op.drop_table("drift_findings")
    op.drop_table("drift_paths")
    op.drop_table("drift_shapes")
    op.drop_table("drift_marks")

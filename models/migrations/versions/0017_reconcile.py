"""reconciliation (issue 22): a credential and a schedule per source, how each event arrived

- ``sources.reconcile_ciphertext``: the provider API credential reconciliation lists events
  with (``webhooks sources update SOURCE --api-key ...``), encrypted with
  ``WEBHOOKS_SECRET_KEY`` like the signing secrets; NULL: none.
- ``sources.reconcile_every_s`` (NULL: off) and ``sources.reconciled_at`` (the last
  scheduled run, claimed by a guarded UPDATE on the database's clock): beat's schedule.
- ``receipts.arrived_via``: ``webhook`` or ``reconcile``. The accept functions are unchanged:
  the column's default reads ``webhooks.arrived_via``, a setting that only reconciliation sets
  (``SET LOCAL``, inside its accept transaction); the receiver never sets it.
- ``receipts.body_digest`` may be NULL: an event recovered from a provider's API is not the
  body the provider signs and sends, so its digest compares with nothing. The accept
  functions compare digests with ``<>``, so a webhook arriving after reconciliation is a plain
  duplicate (no conflict row), and a reconciliation arriving after a webhook too.

Self-contained: another 0016 may be chained before or after it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ARRIVED_VIA_DEFAULT = (
    "coalesce(nullif(current_setting('webhooks.arrived_via', true), ''), 'webhook')"
)


def upgrade() -> None:
    op.add_column("sources", sa.Column("reconcile_ciphertext", sa.LargeBinary(), nullable=True))
    op.add_column("sources", sa.Column("reconcile_every_s", sa.BigInteger(), nullable=True))
    op.add_column("sources", sa.Column("reconciled_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        "reconcile_every", "sources", "reconcile_every_s IS NULL OR reconcile_every_s >= 60"
    )
    # A constant default first (existing rows: webhook, no table rewrite), then the one that
    # reads the setting, for the rows inserted from now on.
    op.add_column(
        "receipts",
        sa.Column("arrived_via", sa.Text(), server_default="webhook", nullable=False),
    )
    op.alter_column("receipts", "arrived_via", server_default=sa.text(ARRIVED_VIA_DEFAULT))
    op.create_check_constraint("arrived_via", "receipts", "arrived_via IN ('webhook', 'reconcile')")
    op.alter_column("receipts", "body_digest", nullable=True)


def downgrade() -> None:
    # Recovered receipts get an empty digest back (the column is NOT NULL again).
    op.execute("UPDATE receipts SET body_digest = '\\x'::bytea WHERE body_digest IS NULL")
    op.alter_column("receipts", "body_digest", nullable=False)
    op.drop_constraint(op.f("ck_receipts_arrived_via"), "receipts", type_="check")
    op.drop_column("receipts", "arrived_via")
    op.drop_constraint(op.f("ck_sources_reconcile_every"), "sources", type_="check")
    for column in ("reconciled_at", "reconcile_every_s", "reconcile_ciphertext"):
        op.drop_column("sources", column)

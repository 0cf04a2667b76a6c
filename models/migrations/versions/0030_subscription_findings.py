"""subscription findings: the provider's own view of each source's endpoint, watched

Issue 38 item 1. Beat's watchdog (:mod:`tasks.watchdog`) reads, for every source with an API
credential, the provider's view of our endpoint (Stripe's webhook endpoint, GitHub's hook) and
raises a finding when it is disabled, deleted, points elsewhere or no longer subscribes to an
event type a route listens for; a provider API that cannot be read is a finding of its own.

- ``subscription_findings``: one row per finding, ``opened_at`` and ``closed_at`` on the
  database's clock. At most one open row per (source, kind): a partial unique index, so two
  checks racing open it once (``INSERT ... ON CONFLICT DO NOTHING``) and close it once
  (``UPDATE ... WHERE closed_at IS NULL``). Deleted with their source.
- ``sources.watched_at``: the last scheduled check, claimed by a guarded UPDATE on the
  database's clock (as ``reconciled_at`` is), so a period is checked once however many
  workers run beat's task.
- ``sources.watch_view``: what the provider said at the last check that got an answer
  (status, url, events, when), shown by ``webhooks sources check`` and the console.

Self-contained: another 0028 or 0029 may be chained before or after it.

Downgrade: the table and both columns are dropped (the findings' audit rows stay).

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = "kind IN ('disabled', 'deleted', 'url_mismatch', 'events_missing', 'cannot_check')"


def upgrade() -> None:
    op.add_column("sources", sa.Column("watched_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("sources", sa.Column("watch_view", postgresql.JSONB(), nullable=True))
    op.create_table(
        "subscription_findings",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column(
            "source_id",
            sa.BigInteger(),
            sa.ForeignKey("sources.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column(
            "opened_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(KINDS, name=op.f("ck_subscription_findings_kind")),
    )
    op.create_index(
        "ix_subscription_findings_open",
        "subscription_findings",
        ["source_id", "kind"],
        unique=True,
        postgresql_where=sa.text("closed_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_subscription_findings_open", table_name="subscription_findings")
    op.drop_table("subscription_findings")
    op.drop_column("sources", "watch_view")
    op.drop_column("sources", "watched_at")

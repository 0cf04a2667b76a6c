"""a route says when and why it was disabled: ``routes.disabled_at``, ``routes.disabled_reason``

Set together with ``active = false``: by the sweep when the route's breaker stayed open longer
than ``WEBHOOKS_ROUTE_DISABLE_AFTER`` (models/route_ends.py; the reason says how long), or by
an operator's ``webhooks routes disable`` (their ``--reason``); cleared by ``routes enable``.
NULL for routes disabled before this revision (the audit log says when and why).

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nullable columns with no default: catalog changes, no table rewrite."""
    op.execute("ALTER TABLE routes ADD COLUMN disabled_at timestamptz")
    op.execute("ALTER TABLE routes ADD COLUMN disabled_reason text")


def downgrade() -> None:
    op.execute("ALTER TABLE routes DROP COLUMN disabled_reason")
    op.execute("ALTER TABLE routes DROP COLUMN disabled_at")

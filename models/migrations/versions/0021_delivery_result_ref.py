"""each delivery may keep a small result reference its handler returned

``deliveries.result_ref``: what a handler returned on success, when it returned a short text
(the id of the row it made, the downstream's order number; at most 200 printable characters,
checked by the worker before it writes). A duplicate of the event is answered with it, and
``webhooks events show`` and the console show it (issue 35 item 1: a duplicate gets the
recorded outcome). NULL for handlers that return nothing and for rows written before this
revision.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """A nullable column with no default: a catalog change, no table rewrite (every
    partition takes it from the parent)."""
    op.execute("ALTER TABLE deliveries ADD COLUMN result_ref text")


def downgrade() -> None:
    op.execute("ALTER TABLE deliveries DROP COLUMN result_ref")

"""route transforms: ``routes.transform``, the name of a registered transform

Issue 37 item 4. A route may name a transform (:mod:`tasks.transforms`): a registered Python
callable the worker runs on the event before the route's handler, which gets the body and
headers it returns; one that returns None ends the delivery ``filtered`` (the status 0027
added), one that raises or overruns ``WEBHOOKS_TRANSFORM_TIME_LIMIT`` ends it dead with
``transform_failed``. The name is checked against the registry when the route is saved
(``webhooks routes add|update --transform``); NULL: no transform.

A nullable column with no default: a catalog change, no table rewrite. The worker's claim
reads it with the route (models/transitions.py).

Downgrade: the column is dropped (routes lose their transform: the old code knows none).

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE routes ADD COLUMN transform text")


def downgrade() -> None:
    op.execute("ALTER TABLE routes DROP COLUMN transform")

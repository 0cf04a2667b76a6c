"""per-route delivery limits: an in-flight budget and a rate limit (issue 23, items 1 and 2)

``routes.max_in_flight``: deliveries of the route admitted to the broker and not finished at
once (NULL: ``WEBHOOKS_ROUTE_MAX_IN_FLIGHT``, the default budget that keeps routes fair).
``routes.rate_count`` per ``routes.rate_period_s`` seconds: the most calls the route's
downstream sees, evenly spaced (NULL: no rate limit). Admission (models/admission.py) reads
them; existing routes get the defaults.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("routes", sa.Column("max_in_flight", sa.Integer(), nullable=True))
    op.add_column("routes", sa.Column("rate_count", sa.Integer(), nullable=True))
    op.add_column("routes", sa.Column("rate_period_s", sa.Integer(), nullable=True))
    op.create_check_constraint(
        "limits",
        "routes",
        "(max_in_flight IS NULL OR max_in_flight >= 1)"
        " AND ((rate_count IS NULL AND rate_period_s IS NULL)"
        " OR (rate_count >= 1 AND rate_period_s >= 1))",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_routes_limits"), "routes", type_="check")
    for column in ("rate_period_s", "rate_count", "max_in_flight"):
        op.drop_column("routes", column)

"""a route can be paused by hand, and carries its circuit breaker (issue 23, items 3 and 4)

``routes.paused_at`` / ``pause_reason``: ``webhooks routes pause ROUTE --reason ...`` holds
the route's deliveries without attempting them until ``resume``. The breaker
(``breaker_state`` closed | open | half_open, when it opened, when the next probe is due, the
one delivery that may probe, how often it tripped) and its failure window (started at the
route's first counted failure, requests and failures since) live on the route, so every
worker and sweeper on every host reads one state, in the claim statement it already runs.
Existing routes start closed and unpaused.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("routes", sa.Column("paused_at", _TIME, nullable=True))
    op.add_column("routes", sa.Column("pause_reason", sa.Text(), nullable=True))
    op.add_column(
        "routes",
        sa.Column("breaker_state", sa.Text(), server_default="closed", nullable=False),
    )
    op.create_check_constraint(
        "breaker_state",
        "routes",
        "breaker_state IN ('closed', 'open', 'half_open')",
    )
    op.add_column("routes", sa.Column("breaker_opened_at", _TIME, nullable=True))
    op.add_column("routes", sa.Column("breaker_probe_at", _TIME, nullable=True))
    op.add_column("routes", sa.Column("probe_delivery", sa.BigInteger(), nullable=True))
    op.add_column(
        "routes", sa.Column("breaker_trips", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("routes", sa.Column("window_started_at", _TIME, nullable=True))
    op.add_column(
        "routes", sa.Column("window_requests", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column(
        "routes", sa.Column("window_failures", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_routes_breaker_state"), "routes", type_="check")
    for column in (
        "window_failures",
        "window_requests",
        "window_started_at",
        "breaker_trips",
        "probe_delivery",
        "breaker_probe_at",
        "breaker_opened_at",
        "breaker_state",
        "pause_reason",
        "paused_at",
    ):
        op.drop_column("routes", column)

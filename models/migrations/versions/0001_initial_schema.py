"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SEQUENCES = ("receipts_id_seq", "deliveries_id_seq", "attempts_id_seq")


def upgrade() -> None:
    for name in SEQUENCES:
        op.execute(sa.schema.CreateSequence(sa.Sequence(name)))
    op.create_table(
        "attempts",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('attempts_id_seq')"),
            nullable=False,
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), server_default="0", nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("error_class", sa.Text(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", "expires_at", name=op.f("pk_attempts")),
        postgresql_partition_by="RANGE (expires_at)",
    )
    op.create_index(op.f("ix_attempts_delivery_id"), "attempts", ["delivery_id"], unique=False)
    op.create_table(
        "conflicts",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body_digest", sa.LargeBinary(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conflicts")),
    )
    op.create_index(op.f("ix_conflicts_expires_at"), "conflicts", ["expires_at"], unique=False)
    op.create_table(
        "deliveries",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('deliveries_id_seq')"),
            nullable=False,
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("receipt_id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("route_id", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("redeliveries", sa.Integer(), server_default="0", nullable=False),
        sa.Column("generation", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error_class", sa.Text(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("dead_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("succeeded_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead')",
            name=op.f("ck_deliveries_status"),
        ),
        sa.PrimaryKeyConstraint("id", "expires_at", name=op.f("pk_deliveries")),
        sa.UniqueConstraint(
            "receipt_id",
            "route_id",
            "expires_at",
            name=op.f("uq_deliveries_receipt_id_route_id_expires_at"),
        ),
        postgresql_partition_by="RANGE (expires_at)",
    )
    op.create_index(
        "ix_deliveries_due",
        "deliveries",
        ["next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("status IN ('pending', 'retrying', 'processing')"),
    )
    op.create_index(
        op.f("ix_deliveries_status_source_id_route_id"),
        "deliveries",
        ["status", "source_id", "route_id"],
        unique=False,
    )
    op.create_table(
        "receipts",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('receipts_id_seq')"),
            nullable=False,
        ),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body_digest", sa.LargeBinary(), nullable=False),
        sa.Column("content_type", sa.Text(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=True),
        sa.Column("payload_dropped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("source_id", "event_id", "expires_at", name=op.f("pk_receipts")),
        postgresql_partition_by="RANGE (expires_at)",
    )
    op.create_index(op.f("ix_receipts_id"), "receipts", ["id"], unique=False)
    op.create_index(op.f("ix_receipts_received_at"), "receipts", ["received_at"], unique=False)
    op.create_table(
        "replays",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("filter", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("rerun_succeeded", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("rate", sa.Double(), nullable=True),
        sa.Column("status", sa.Text(), server_default="running", nullable=False),
        sa.Column("planned", sa.Integer(), server_default="0", nullable=False),
        sa.Column("replayed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("skipped", sa.Integer(), server_default="0", nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("via", sa.Text(), server_default="cli", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replays")),
    )
    op.create_table(
        "sources",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("public_id", sa.Text(), nullable=False),
        sa.Column("account", sa.Text(), server_default="default", nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column(
            "config",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("tolerance_s", sa.Integer(), nullable=True),
        sa.Column("max_body_bytes", sa.Integer(), nullable=True),
        sa.Column("retry_window_s", sa.BigInteger(), nullable=True),
        sa.Column("queue_lag_s", sa.BigInteger(), nullable=True),
        sa.Column("clock_skew_s", sa.BigInteger(), nullable=True),
        sa.Column("replay_grace_s", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "provider IN ('stripe', 'github', 'shopify', 'slack', 'standard', 'svix', 'hmac')",
            name=op.f("ck_sources_provider"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sources")),
        sa.UniqueConstraint("account", "name", name=op.f("uq_sources_account_name")),
        sa.UniqueConstraint("public_id", name=op.f("uq_sources_public_id")),
    )
    op.create_table(
        "subscriptions",
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("subscription_id", sa.Text(), nullable=False),
        sa.Column("customer", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("event_created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("source_id", "subscription_id", name=op.f("pk_subscriptions")),
    )
    op.create_table(
        "routes",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("handler", sa.Text(), nullable=False),
        sa.Column("events_glob", sa.Text(), server_default="*", nullable=False),
        sa.Column("events_like", sa.Text(), server_default="%", nullable=False),
        sa.Column(
            "options",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("signing_ciphertext", sa.LargeBinary(), nullable=True),
        sa.Column("max_attempts", sa.Integer(), nullable=True),
        sa.Column("max_age_s", sa.BigInteger(), nullable=True),
        sa.Column("active", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_routes_source_id_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_routes")),
    )
    op.create_index(op.f("ix_routes_source_id"), "routes", ["source_id"], unique=False)
    op.create_table(
        "source_secrets",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["source_id"],
            ["sources.id"],
            name=op.f("fk_source_secrets_source_id_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_source_secrets")),
    )
    op.create_index(
        op.f("ix_source_secrets_source_id"),
        "source_secrets",
        ["source_id"],
        unique=False,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_source_secrets_source_id"),
        table_name="source_secrets",
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
    op.drop_table("source_secrets")
    op.drop_index(op.f("ix_routes_source_id"), table_name="routes")
    op.drop_table("routes")
    op.drop_table("subscriptions")
    op.drop_table("sources")
    op.drop_table("replays")
    op.drop_index(op.f("ix_receipts_received_at"), table_name="receipts")
    op.drop_index(op.f("ix_receipts_id"), table_name="receipts")
    op.drop_table("receipts")
    op.drop_index(op.f("ix_deliveries_status_source_id_route_id"), table_name="deliveries")
    op.drop_index(
        "ix_deliveries_due",
        table_name="deliveries",
        postgresql_where=sa.text("status IN ('pending', 'retrying', 'processing')"),
    )
    op.drop_table("deliveries")
    op.drop_index(op.f("ix_conflicts_expires_at"), table_name="conflicts")
    op.drop_table("conflicts")
    op.drop_index(op.f("ix_attempts_delivery_id"), table_name="attempts")
    op.drop_table("attempts")
    for name in SEQUENCES:
        op.execute(sa.schema.DropSequence(sa.Sequence(name)))

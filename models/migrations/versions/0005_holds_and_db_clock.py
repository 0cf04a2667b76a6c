"""holds, dead-letter retention, a fencing counter that only grows, the database's clock

- ``deliveries.dead_at``: when the delivery went dead; dead letters are kept for
  ``WEBHOOKS_DEAD_LETTER_RETENTION`` from then on (backfilled from ``updated_at``), and the
  partial index ``ix_deliveries_dead`` finds them in each partition without a scan.
- ``deliveries.attempt_base``: ``attempts`` no longer restarts at a replay or re-run (it is the
  fencing token, and the attempt rows' number): the retry policy counts the attempts since
  the last replay, ``attempts - attempt_base``.
- ``discarded``: the terminal state of a dead letter an operator discarded (audited).
- ``audit_log``: who did what to which rows, and why (discards, route and source changes).
- The accept functions decide on the database's clock: ``p_now`` NULL means ``now()`` (a test
  may pin it), and a receipt is never written with an ``expires_at`` at or before that
  instant (a receiver whose clock lags would otherwise write into a day maintenance has
  passed): such an anchor falls back to ``now + ttl``. A batch is decided at one instant,
  the transaction's, for all its elements, as one-at-a-time calls at that instant would be.
- A receipt whose work is not done (a delivery pending, retrying, processing or dead) still
  deduplicates its event after its ``expires_at``, until maintenance moves it forward (its
  hold): expiry ends deduplication only for finished work.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead')"
NEW_STATES = "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead', 'discarded')"

ACCEPT_FUNCTION = """
CREATE FUNCTION webhooks_accept(
    p_source_id bigint, p_secret_id text, p_event_id text, p_event_type text,
    p_occurred_at timestamptz, p_expires_at timestamptz, p_now timestamptz,
    p_digest bytea, p_content_type text, p_payload bytea, p_grace interval, p_ttl interval
) RETURNS TABLE (authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_now timestamptz;
    v_expires timestamptz;
BEGIN
    -- Serialise the arrivals of one event: uniqueness across partitions, even when
    -- expires_at is anchored on the first arrival and so not known in advance.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_source_id::text || ':' || p_event_id, 0));
    -- The database's clock, read after the lock (a pinned instant in tests).
    v_now := coalesce(p_now, clock_timestamp());
    v_expires := CASE WHEN p_expires_at > v_now THEN p_expires_at ELSE v_now + p_ttl END;
    RETURN QUERY
    WITH authorised AS (
        SELECT 1 FROM source_secrets s
        WHERE s.id = p_secret_id AND s.source_id = p_source_id AND s.revoked_at IS NULL
    ), existing AS (
        SELECT r.body_digest FROM receipts r
        WHERE r.source_id = p_source_id AND r.event_id = p_event_id
          AND (r.expires_at > v_now OR EXISTS (
                SELECT 1 FROM deliveries d
                WHERE d.receipt_id = r.id AND d.expires_at = r.expires_at
                  AND d.status IN ('pending', 'retrying', 'processing', 'dead')))
        ORDER BY r.expires_at DESC LIMIT 1
    ), receipt AS (
        INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at,
                              received_at, body_digest, content_type, payload)
        SELECT p_source_id, p_event_id, v_expires, p_event_type, p_occurred_at,
               v_now, p_digest, p_content_type, p_payload
        WHERE EXISTS (SELECT 1 FROM authorised) AND NOT EXISTS (SELECT 1 FROM existing)
        ON CONFLICT DO NOTHING
        RETURNING receipts.id, receipts.expires_at
    ), delivery AS (
        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at)
        SELECT receipt.expires_at, receipt.id, p_source_id, rt.id, 'pending',
               v_now + p_grace, v_now, v_now
        FROM receipt JOIN routes rt
          ON rt.source_id = p_source_id AND rt.active AND p_event_type LIKE rt.events_like
        RETURNING deliveries.id
    ), conflict AS (
        INSERT INTO conflicts (source_id, event_id, expires_at, body_digest, received_at)
        SELECT p_source_id, p_event_id, v_expires, p_digest, v_now
        FROM existing
        WHERE existing.body_digest <> p_digest AND EXISTS (SELECT 1 FROM authorised)
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM authorised),
           (SELECT receipt.id FROM receipt),
           (SELECT existing.body_digest FROM existing),
           ARRAY(SELECT delivery.id FROM delivery ORDER BY delivery.id);
END
$fn$;
"""

ACCEPT_MANY_FUNCTION = """
CREATE FUNCTION webhooks_accept_many(
    p_items json, p_digests bytea[], p_payloads bytea[], p_grace interval, p_now timestamptz
) RETURNS TABLE (ord integer, authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_now timestamptz;
BEGIN
    -- The per-event locks of webhooks_accept, all of them, in one global order.
    PERFORM pg_advisory_xact_lock(k.key)
    FROM (SELECT DISTINCT hashtextextended(e.source_id::text || ':' || e.event_id, 0) AS key
          FROM json_to_recordset(p_items) AS e(source_id bigint, event_id text)
          ORDER BY 1) AS k;
    -- One instant for the whole batch, the database's, read after the locks: every element
    -- is decided as webhooks_accept would decide it at that instant.
    v_now := coalesce(p_now, clock_timestamp());
    -- A fresh snapshot, taken after the locks: arrivals that committed meanwhile are seen.
    RETURN QUERY
    WITH item AS MATERIALIZED (
        SELECT e.ord, e.source_id, e.secret_id, e.event_id, e.event_type, e.occurred_at,
               CASE WHEN e.expires_at > v_now THEN e.expires_at
                    ELSE v_now + make_interval(secs => e.ttl_s) END AS expires_at,
               e.content_type, p_digests[e.ord] AS digest, p_payloads[e.ord] AS payload
        FROM json_to_recordset(p_items) AS e(
            ord integer, source_id bigint, secret_id text, event_id text, event_type text,
            occurred_at timestamptz, expires_at timestamptz, ttl_s double precision,
            content_type text)
    ), authorised AS MATERIALIZED (
        SELECT i.ord FROM item i
        WHERE EXISTS (SELECT 1 FROM source_secrets s
                      WHERE s.id = i.secret_id AND s.source_id = i.source_id
                        AND s.revoked_at IS NULL)
    ), existing AS MATERIALIZED (
        -- The live receipt of each arrival's event, probed per arrival (index, every
        -- partition still live), never by a join over the whole table.
        SELECT i.ord, x.body_digest FROM item i
        CROSS JOIN LATERAL (
            SELECT r.body_digest FROM receipts r
            WHERE r.source_id = i.source_id AND r.event_id = i.event_id
              AND (r.expires_at > v_now OR EXISTS (
                    SELECT 1 FROM deliveries d
                    WHERE d.receipt_id = r.id AND d.expires_at = r.expires_at
                      AND d.status IN ('pending', 'retrying', 'processing', 'dead')))
            ORDER BY r.expires_at DESC LIMIT 1
        ) AS x
    ), candidate AS MATERIALIZED (
        -- The first authorised arrival of each event in the batch: the one that may insert.
        SELECT DISTINCT ON (i.source_id, i.event_id) i.*
        FROM item i JOIN authorised a ON a.ord = i.ord
        ORDER BY i.source_id, i.event_id, i.ord
    ), receipt AS (
        INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at,
                              received_at, body_digest, content_type, payload)
        SELECT c.source_id, c.event_id, c.expires_at, c.event_type, c.occurred_at,
               v_now, c.digest, c.content_type, c.payload
        FROM candidate c
        WHERE NOT EXISTS (SELECT 1 FROM existing x WHERE x.ord = c.ord)
        ON CONFLICT DO NOTHING
        RETURNING receipts.id, receipts.source_id, receipts.event_id, receipts.expires_at,
                  receipts.event_type
    ), delivery AS (
        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at)
        SELECT r.expires_at, r.id, r.source_id, rt.id, 'pending',
               v_now + p_grace, v_now, v_now
        FROM receipt r JOIN routes rt
          ON rt.source_id = r.source_id AND rt.active AND r.event_type LIKE rt.events_like
        RETURNING deliveries.id, deliveries.receipt_id
    ), prior AS MATERIALIZED (
        -- What each authorised arrival that does not insert is a duplicate of: the live
        -- receipt (the same one for every arrival of the event: one instant), or the
        -- batch's first arrival of the same event.
        SELECT i.ord, coalesce(x.body_digest, c.digest) AS body_digest
        FROM item i
        JOIN authorised a ON a.ord = i.ord
        JOIN candidate c ON c.source_id = i.source_id AND c.event_id = i.event_id
        LEFT JOIN existing x ON x.ord = i.ord
        WHERE x.ord IS NOT NULL OR c.ord <> i.ord
    ), conflict AS (
        INSERT INTO conflicts (source_id, event_id, expires_at, body_digest, received_at)
        SELECT i.source_id, i.event_id, i.expires_at, i.digest, v_now
        FROM prior p JOIN item i ON i.ord = p.ord
        WHERE p.body_digest <> i.digest
        RETURNING 1
    )
    SELECT i.ord,
           EXISTS (SELECT 1 FROM authorised a WHERE a.ord = i.ord),
           r.id,
           p.body_digest,
           coalesce((SELECT array_agg(d.id ORDER BY d.id) FROM delivery d
                     WHERE d.receipt_id = r.id), '{}')
    FROM item i
    LEFT JOIN candidate c ON c.ord = i.ord
    LEFT JOIN receipt r ON r.source_id = c.source_id AND r.event_id = c.event_id
    LEFT JOIN prior p ON p.ord = i.ord
    ORDER BY i.ord;
END
$fn$;
"""

OLD_ACCEPT = (
    "webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
    " timestamptz, bytea, text, bytea, interval)"
)
OLD_ACCEPT_MANY = "webhooks_accept_many(json, bytea[], bytea[], interval)"
NEW_ACCEPT = (
    "webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
    " timestamptz, bytea, text, bytea, interval, interval)"
)
NEW_ACCEPT_MANY = "webhooks_accept_many(json, bytea[], bytea[], interval, timestamptz)"


def _previous(filename: str, name: str) -> str:
    """A function body as an earlier revision created it (for the downgrade)."""
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"_revision_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    body: str = getattr(module, name)
    return body


def upgrade() -> None:
    op.add_column("deliveries", sa.Column("dead_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "deliveries",
        sa.Column("attempt_base", sa.Integer(), server_default="0", nullable=False),
    )
    op.execute("UPDATE deliveries SET dead_at = updated_at WHERE status = 'dead'")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", NEW_STATES)
    op.create_index(
        "ix_deliveries_dead",
        "deliveries",
        ["dead_at"],
        unique=False,
        postgresql_where=sa.text("status = 'dead'"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("target", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("via", sa.Text(), server_default="cli", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"], unique=False)
    op.execute(f"DROP FUNCTION {OLD_ACCEPT}")
    op.execute(f"DROP FUNCTION {OLD_ACCEPT_MANY}")
    op.execute(ACCEPT_FUNCTION)
    op.execute(ACCEPT_MANY_FUNCTION)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {NEW_ACCEPT_MANY}")
    op.execute(f"DROP FUNCTION {NEW_ACCEPT}")
    op.execute(_previous("0003_accept_function.py", "ACCEPT_FUNCTION"))
    op.execute(_previous("0004_accept_many.py", "ACCEPT_MANY_FUNCTION"))
    op.drop_index(op.f("ix_audit_log_at"), table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_index("ix_deliveries_dead", table_name="deliveries")
    op.execute("UPDATE deliveries SET status = 'dead' WHERE status = 'discarded'")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", OLD_STATES)
    op.drop_column("deliveries", "attempt_base")
    op.drop_column("deliveries", "dead_at")

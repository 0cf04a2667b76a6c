"""the accept prunes partitions; discards record their delivery ids

- ``webhooks_accept`` and ``webhooks_accept_many``: the live-receipt check carries a lower
  bound on ``expires_at``, the start of yesterday (UTC), so Postgres prunes every older
  receipts partition at executor start instead of opening each one (and waiting for a
  partition being dropped). A live receipt is unexpired, or expired and held; maintenance
  moves held rows out of a day at its first run after that day (models.retention), so an
  unmoved held receipt lies in yesterday's partition at the oldest while maintenance runs.
  Signatures unchanged (``CREATE OR REPLACE``).
- ``audit_discarded``: the delivery ids each audited discard changed (``audit_log`` keeps
  who, why, the filter as given and the count).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACCEPT_FUNCTION = """
CREATE OR REPLACE FUNCTION webhooks_accept(
    p_source_id bigint, p_secret_id text, p_event_id text, p_event_type text,
    p_occurred_at timestamptz, p_expires_at timestamptz, p_now timestamptz,
    p_digest bytea, p_content_type text, p_payload bytea, p_grace interval, p_ttl interval
) RETURNS TABLE (authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_now timestamptz;
    v_expires timestamptz;
    v_floor timestamptz;
BEGIN
    -- Serialise the arrivals of one event: uniqueness across partitions, even when
    -- expires_at is anchored on the first arrival and so not known in advance.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_source_id::text || ':' || p_event_id, 0));
    -- The database's clock, read after the lock (a pinned instant in tests).
    v_now := coalesce(p_now, clock_timestamp());
    v_expires := CASE WHEN p_expires_at > v_now THEN p_expires_at ELSE v_now + p_ttl END;
    -- The oldest expires_at a live receipt can have: the start of yesterday (UTC). A live
    -- receipt is unexpired, or expired and held in a day maintenance has not dropped yet
    -- (it moves the held rows out at its first run after the day ends). The bound lets
    -- Postgres prune every older partition when the statement starts.
    v_floor := date_trunc('day', v_now, 'UTC') - interval '1 day';
    RETURN QUERY
    WITH authorised AS (
        SELECT 1 FROM source_secrets s
        WHERE s.id = p_secret_id AND s.source_id = p_source_id AND s.revoked_at IS NULL
    ), existing AS (
        SELECT r.body_digest FROM receipts r
        WHERE r.source_id = p_source_id AND r.event_id = p_event_id
          AND r.expires_at >= v_floor
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
CREATE OR REPLACE FUNCTION webhooks_accept_many(
    p_items json, p_digests bytea[], p_payloads bytea[], p_grace interval, p_now timestamptz
) RETURNS TABLE (ord integer, authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_now timestamptz;
    v_floor timestamptz;
BEGIN
    -- The per-event locks of webhooks_accept, all of them, in one global order.
    PERFORM pg_advisory_xact_lock(k.key)
    FROM (SELECT DISTINCT hashtextextended(e.source_id::text || ':' || e.event_id, 0) AS key
          FROM json_to_recordset(p_items) AS e(source_id bigint, event_id text)
          ORDER BY 1) AS k;
    -- One instant for the whole batch, the database's, read after the locks: every element
    -- is decided as webhooks_accept would decide it at that instant.
    v_now := coalesce(p_now, clock_timestamp());
    -- The oldest expires_at a live receipt can have (see webhooks_accept).
    v_floor := date_trunc('day', v_now, 'UTC') - interval '1 day';
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
              AND r.expires_at >= v_floor
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


def _previous(filename: str, name: str) -> str:
    """A function body as an earlier revision created it (for the downgrade)."""
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"_revision_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    body: str = getattr(module, name)
    return body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")


def upgrade() -> None:
    op.execute(ACCEPT_FUNCTION)
    op.execute(ACCEPT_MANY_FUNCTION)
    op.create_table(
        "audit_discarded",
        sa.Column("audit_id", sa.BigInteger(), nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["audit_id"],
            ["audit_log.id"],
            name=op.f("fk_audit_discarded_audit_id_audit_log"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("audit_id", "delivery_id", name=op.f("pk_audit_discarded")),
    )


def downgrade() -> None:
    op.drop_table("audit_discarded")
    op.execute(_previous("0005_holds_and_db_clock.py", "ACCEPT_FUNCTION"))
    op.execute(_previous("0005_holds_and_db_clock.py", "ACCEPT_MANY_FUNCTION"))

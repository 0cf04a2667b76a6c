"""the receiver's group commit: many accepts in one statement and one transaction

``webhooks_accept_many(...)`` takes the arrays of a batch of concurrent requests and runs
``webhooks_accept`` (migration 0003) for each element, in one transaction: one round trip and
one commit (one WAL flush) for the whole batch instead of one per webhook. Each element keeps
its own semantics (advisory lock, live-receipt probe, revoked-secret re-check, deliveries,
conflict row); the whole batch commits or none of it does, and nothing is acknowledged before
that commit.

The per-event advisory locks are taken in one global order (the lock key, then position), so
two batches that share events wait for each other in a line, never in a cycle. Two arrivals
of one event in the same batch are serialised by that same loop: the second sees the first's
receipt and is a duplicate.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACCEPT_MANY_FUNCTION = """
CREATE OR REPLACE FUNCTION webhooks_accept_many(
    p_items json, p_digests bytea[], p_payloads bytea[], p_grace interval
) RETURNS TABLE (ord integer, authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    -- The per-event locks of webhooks_accept, all of them, in one global order.
    PERFORM pg_advisory_xact_lock(k.key)
    FROM (SELECT DISTINCT hashtextextended(e.source_id::text || ':' || e.event_id, 0) AS key
          FROM json_to_recordset(p_items) AS e(source_id bigint, event_id text)
          ORDER BY 1) AS k;
    -- A fresh snapshot, taken after the locks: arrivals that committed meanwhile are seen.
    RETURN QUERY
    WITH item AS MATERIALIZED (
        SELECT e.ord, e.source_id, e.secret_id, e.event_id, e.event_type, e.occurred_at,
               e.expires_at, e.received_at, e.content_type,
               p_digests[e.ord] AS digest, p_payloads[e.ord] AS payload
        FROM json_to_recordset(p_items) AS e(
            ord integer, source_id bigint, secret_id text, event_id text, event_type text,
            occurred_at timestamptz, expires_at timestamptz, received_at timestamptz,
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
              AND r.expires_at > i.received_at
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
               c.received_at, c.digest, c.content_type, c.payload
        FROM candidate c
        WHERE NOT EXISTS (SELECT 1 FROM existing x WHERE x.ord = c.ord)
        ON CONFLICT DO NOTHING
        RETURNING receipts.id, receipts.source_id, receipts.event_id, receipts.expires_at,
                  receipts.event_type, receipts.received_at
    ), delivery AS (
        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at)
        SELECT r.expires_at, r.id, r.source_id, rt.id, 'pending',
               r.received_at + p_grace, r.received_at, r.received_at
        FROM receipt r JOIN routes rt
          ON rt.source_id = r.source_id AND rt.active AND r.event_type LIKE rt.events_like
        RETURNING deliveries.id, deliveries.receipt_id
    ), prior AS MATERIALIZED (
        -- What each authorised arrival that does not insert is a duplicate of: the live
        -- receipt, or the batch's first arrival of the same event.
        SELECT i.ord, coalesce(x.body_digest, c.digest) AS body_digest
        FROM item i
        JOIN authorised a ON a.ord = i.ord
        JOIN candidate c ON c.source_id = i.source_id AND c.event_id = i.event_id
        LEFT JOIN existing x ON x.ord = i.ord
        WHERE x.ord IS NOT NULL OR c.ord <> i.ord
    ), conflict AS (
        INSERT INTO conflicts (source_id, event_id, expires_at, body_digest, received_at)
        SELECT i.source_id, i.event_id, i.expires_at, i.digest, i.received_at
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


def upgrade() -> None:
    op.execute(ACCEPT_MANY_FUNCTION)


def downgrade() -> None:
    op.execute("DROP FUNCTION webhooks_accept_many(json, bytea[], bytea[], interval)")

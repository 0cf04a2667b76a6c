"""the receiver's accept transaction as one server-side function

One round trip and one statement per webhook: ``SELECT * FROM webhooks_accept(...)`` in
autocommit takes the per-event advisory lock, then (in a fresh READ COMMITTED snapshot, so it
sees a concurrent arrival that committed while we waited for the lock) inserts the receipt
unless a live one exists, one delivery per matching route, and a conflict row when the body
differs. The statement is the one documented in ``ingest/store.py``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACCEPT_FUNCTION = """
CREATE OR REPLACE FUNCTION webhooks_accept(
    p_source_id bigint, p_secret_id text, p_event_id text, p_event_type text,
    p_occurred_at timestamptz, p_expires_at timestamptz, p_now timestamptz,
    p_digest bytea, p_content_type text, p_payload bytea, p_grace interval
) RETURNS TABLE (authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    -- Serialise the arrivals of one event: uniqueness across partitions, even when
    -- expires_at is anchored on the first arrival and so not known in advance.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_source_id::text || ':' || p_event_id, 0));
    RETURN QUERY
    WITH authorised AS (
        SELECT 1 FROM source_secrets s
        WHERE s.id = p_secret_id AND s.source_id = p_source_id AND s.revoked_at IS NULL
    ), existing AS (
        SELECT r.body_digest FROM receipts r
        WHERE r.source_id = p_source_id AND r.event_id = p_event_id AND r.expires_at > p_now
        ORDER BY r.expires_at DESC LIMIT 1
    ), receipt AS (
        INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at,
                              received_at, body_digest, content_type, payload)
        SELECT p_source_id, p_event_id, p_expires_at, p_event_type, p_occurred_at,
               p_now, p_digest, p_content_type, p_payload
        WHERE EXISTS (SELECT 1 FROM authorised) AND NOT EXISTS (SELECT 1 FROM existing)
        ON CONFLICT DO NOTHING
        RETURNING receipts.id, receipts.expires_at
    ), delivery AS (
        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at)
        SELECT receipt.expires_at, receipt.id, p_source_id, rt.id, 'pending',
               p_now + p_grace, p_now, p_now
        FROM receipt JOIN routes rt
          ON rt.source_id = p_source_id AND rt.active AND p_event_type LIKE rt.events_like
        RETURNING deliveries.id
    ), conflict AS (
        INSERT INTO conflicts (source_id, event_id, expires_at, body_digest, received_at)
        SELECT p_source_id, p_event_id, p_expires_at, p_digest, p_now
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


def upgrade() -> None:
    op.execute(ACCEPT_FUNCTION)


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
        " timestamptz, bytea, text, bytea, interval)"
    )

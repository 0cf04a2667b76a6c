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
    p_source_ids bigint[], p_secret_ids text[], p_event_ids text[], p_event_types text[],
    p_occurred_ats timestamptz[], p_expires_ats timestamptz[], p_nows timestamptz[],
    p_digests bytea[], p_content_types text[], p_payloads bytea[], p_grace interval
) RETURNS TABLE (ord integer, authorised boolean, receipt_id bigint, existing_digest bytea,
                 delivery_ids bigint[])
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    i integer;
BEGIN
    FOR i IN
        SELECT k.i FROM generate_subscripts(p_event_ids, 1) AS k(i)
        ORDER BY hashtextextended(p_source_ids[k.i]::text || ':' || p_event_ids[k.i], 0), k.i
    LOOP
        RETURN QUERY
        SELECT i, a.authorised, a.receipt_id, a.existing_digest, a.delivery_ids
        FROM webhooks_accept(p_source_ids[i], p_secret_ids[i], p_event_ids[i],
                             p_event_types[i], p_occurred_ats[i], p_expires_ats[i], p_nows[i],
                             p_digests[i], p_content_types[i], p_payloads[i], p_grace) AS a;
    END LOOP;
END
$fn$;
"""


def upgrade() -> None:
    op.execute(ACCEPT_MANY_FUNCTION)


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION webhooks_accept_many(bigint[], text[], text[], text[], timestamptz[],"
        " timestamptz[], timestamptz[], bytea[], text[], bytea[], interval)"
    )

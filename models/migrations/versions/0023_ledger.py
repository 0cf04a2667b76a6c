"""a processed-events ledger kept for months: ``ledger``, partitioned by month

One compact row per receipt whose work has ended (issue 35 item 2; seed 003: "the durable
audit record can live far longer, partitioned"): the scope (``source_id``), the event id and
type, the first 8 bytes of the body's SHA-256 (NULL for an event recovered through the
provider's API), when it was first accepted (``received_at``, the partition key), each
route's final outcome (``outcomes``: ``{"<route id>": "s[:result ref]" | "d[:reason]" |
"x"}``) and whether it arrived through reconciliation. Written by the statements that end a
delivery (models/ledger.py), it outlives the receipt (deleted at its dedup TTL) by months:
maintenance drops a month once it is ``WEBHOOKS_LEDGER_RETENTION`` months past.

Never a dedup key. The unique index (the 64-bit hash of the event id seeded with the source,
and ``received_at``) is only what ``ON CONFLICT`` merges a later ending of the same receipt
into: 28 bytes an entry, where (source_id, event_id, received_at) took 56.

Partitions ``ledger_pYYYYMM`` hold [that month's first day 00:00 UTC, the next month's);
``ledger_default`` catches a row of a month not laid out (maintenance lays out the months
around now), so an ending never fails for want of a partition. Months of rows written before
this revision are not backfilled.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE ledger (
            received_at timestamptz NOT NULL,
            source_id bigint NOT NULL,
            event_id text NOT NULL,
            event_type text NOT NULL,
            digest bytea,
            outcomes jsonb NOT NULL,
            via char(1) NOT NULL DEFAULT 'w'
        ) PARTITION BY RANGE (received_at)
        """
    )
    op.execute(
        "CREATE UNIQUE INDEX ux_ledger_key ON ledger"
        " (hashtextextended(event_id, source_id), received_at)"
    )
    op.execute("CREATE TABLE ledger_default PARTITION OF ledger DEFAULT")
    # This month and the next two, on the database's clock (maintenance keeps them ahead).
    op.execute(
        """
        DO $$
        DECLARE
            m timestamp;
        BEGIN
            FOR i IN 0..2 LOOP
                m := date_trunc('month', now() AT TIME ZONE 'UTC') + make_interval(months => i);
                EXECUTE format(
                    'CREATE TABLE %I PARTITION OF ledger FOR VALUES FROM (%L) TO (%L)',
                    'ledger_p' || to_char(m, 'YYYYMM'),
                    m AT TIME ZONE 'UTC', (m + interval '1 month') AT TIME ZONE 'UTC');
            END LOOP;
        END $$
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE ledger")

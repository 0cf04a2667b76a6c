"""the ledger, compact: 80-byte rows appended by each ending, kinds in a table of their own

Issue 35 item 2 set the ledger a goal of at most 120 bytes an event; 0023's layout took 171
(bench/results_ledger.txt). Where they went: the event type as text in every row (21 bytes),
the outcomes as jsonb (15), an 8-byte source id, and a unique index of 28-byte entries on
(hash, received_at) that ``ON CONFLICT`` needed to merge a later ending into the row.

- ``ledger_kinds``: one row per (source, event type, how it arrived); a ledger row names its
  kind by a 4-byte id. The ending's statement adds a kind it has not seen (models/ledger.py).
- ``ledger``: ``received_at``, ``kind``, ``event_id``, ``digest`` (the body's first 8 SHA-256
  bytes) and ``outcomes``, a text of ``<route id>.<attempt><code>[:<detail>]`` entries (code
  ``s`` succeeded, ``d`` dead, ``x`` discarded; detail the result reference or the dead
  reason) joined by U+001F, which neither can hold.
- Appended, never updated: each statement that ends deliveries of a receipt adds one row
  with their entries, and a reader merges a receipt's rows, each route's entry with the
  highest attempt number winning (models/ledger_reads.py). A replay that ends later is a
  later attempt. So no unique index: one index of 20-byte entries on the event id's 64-bit
  hash, for the operator's lookup.

Existing rows are converted (their entries take attempt 0), month by month into partitions
of the same names and bounds.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The months (and the default) of a partitioned table, renamed with a suffix, then laid out
# again under their old names and bounds beneath a new parent.
_RENAME_LEAVES = """
DO $$
DECLARE
    leaf record;
BEGIN
    FOR leaf IN
        SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = '{table}'::regclass
    LOOP
        EXECUTE format('ALTER TABLE %I RENAME TO %I', leaf.relname, leaf.relname || '{suffix}');
    END LOOP;
END $$
"""

_LAY_OUT_LIKE = """
DO $$
DECLARE
    leaf record;
BEGIN
    FOR leaf IN
        SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = '{old}'::regclass
    LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF {new} %s',
                       left(leaf.relname, -length('{suffix}')), leaf.bound);
    END LOOP;
END $$
"""


def _rebuild(new_table: str, convert: str) -> None:
    """Rename ``ledger`` and its leaves aside, create ``new_table`` (named ``ledger``) with
    leaves of the same names and bounds, fill it with ``convert`` (reading ``ledger_old``),
    drop the old one."""
    op.execute(_RENAME_LEAVES.format(table="ledger", suffix="_old"))
    op.execute("ALTER TABLE ledger RENAME TO ledger_old")
    op.execute("ALTER INDEX IF EXISTS ux_ledger_key RENAME TO ux_ledger_key_old")
    op.execute("ALTER INDEX IF EXISTS ix_ledger_event RENAME TO ix_ledger_event_old")
    op.execute(new_table)
    op.execute(_LAY_OUT_LIKE.format(old="ledger_old", new="ledger", suffix="_old"))
    op.execute(convert)
    op.execute("DROP TABLE ledger_old")


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE ledger_kinds (
            id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            source_id bigint NOT NULL,
            event_type text NOT NULL,
            via char(1) NOT NULL,
            CONSTRAINT uq_ledger_kinds UNIQUE (source_id, event_type, via)
        )
        """
    )
    op.execute(
        """
        INSERT INTO ledger_kinds (source_id, event_type, via)
        SELECT DISTINCT source_id, event_type, via FROM ledger
        """
    )
    _rebuild(
        """
        CREATE TABLE ledger (
            received_at timestamptz NOT NULL,
            kind integer NOT NULL,
            event_id text NOT NULL,
            digest bytea,
            outcomes text NOT NULL
        ) PARTITION BY RANGE (received_at);
        CREATE INDEX ix_ledger_event ON ledger (hashtextextended(event_id, 0));
        """,
        """
        INSERT INTO ledger (received_at, kind, event_id, digest, outcomes)
        SELECT o.received_at, k.id, o.event_id, o.digest,
               (SELECT string_agg(e.key || '.0' || e.value, chr(31))
                FROM jsonb_each_text(o.outcomes) AS e)
        FROM ledger_old o
        JOIN ledger_kinds k
          ON (k.source_id, k.event_type, k.via) = (o.source_id, o.event_type, o.via)
        """,
    )


def downgrade() -> None:
    # Each receipt's rows merged into one, each route's highest attempt winning (the entries'
    # attempt numbers are lost: 0023's layout has none).
    _rebuild(
        """
        CREATE TABLE ledger (
            received_at timestamptz NOT NULL,
            source_id bigint NOT NULL,
            event_id text NOT NULL,
            event_type text NOT NULL,
            digest bytea,
            outcomes jsonb NOT NULL,
            via char(1) NOT NULL DEFAULT 'w'
        ) PARTITION BY RANGE (received_at);
        CREATE UNIQUE INDEX ux_ledger_key ON ledger
            (hashtextextended(event_id, source_id), received_at);
        """,
        """
        WITH entries AS (
            SELECT o.received_at, k.source_id, o.event_id, k.event_type, o.digest, k.via,
                   substring(e FROM '^(\\d+)') AS route,
                   CAST(substring(e FROM '^\\d+\\.(\\d+)') AS integer) AS attempt,
                   substring(e FROM '^\\d+\\.\\d+(.*)$') AS outcome
            FROM ledger_old o
            JOIN ledger_kinds k ON k.id = o.kind,
            LATERAL unnest(string_to_array(o.outcomes, chr(31))) AS e
        ), latest AS (
            SELECT DISTINCT ON (received_at, source_id, event_id, route) *
            FROM entries
            ORDER BY received_at, source_id, event_id, route, attempt DESC,
                     left(outcome, 1) = 'x' DESC, left(outcome, 1) = 's' DESC
        )
        INSERT INTO ledger (received_at, source_id, event_id, event_type, digest, outcomes,
                            via)
        SELECT received_at, source_id, event_id, min(event_type), (array_agg(digest))[1],
               jsonb_object_agg(route, outcome), min(via)
        FROM latest
        GROUP BY received_at, source_id, event_id
        """,
    )
    op.execute("DROP TABLE ledger_kinds")

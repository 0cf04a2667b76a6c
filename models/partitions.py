"""Daily range partitions of receipts, deliveries and attempts on ``expires_at``.

Partition ``<table>_pYYYYMMDD`` holds rows with expires_at in [that day 00:00 UTC, next day).
Deliveries and attempts carry their receipt's ``expires_at``, so one day's three partitions
expire together. In ``delete`` retention mode there is a single ``<table>_default`` partition
(with an index on ``expires_at`` for the batched delete) instead, and expiry is a batched
delete (see :mod:`models.retention`).

Maintenance reads each partition's bounds from the catalog (``pg_class.relpartbound``), never
from its name: a partition is dropped because Postgres guarantees every row in it is below
its upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import Connection, text

from models.schema import PARTITIONED_TABLES

# Serialises layout changes (beat, the receiver's on-demand create, the CLI), so concurrent
# creators never race on the same partition name. Any constant works; this one is ours.
LAYOUT_LOCK_KEY = 0x5745_4248_4B50  # "WEBHKP"

# DDL on a partition locks its parent: give up quickly rather than queue the receiver behind
# us (the next maintenance run tries again).
LOCK_TIMEOUT = "5s"
# ``DETACH ... CONCURRENTLY`` waits for every transaction that may still see the partition
# (it blocks none of them). Past this it gives up, leaving the leaf "detach pending": the
# next run finishes it with ``FINALIZE`` (:func:`detach`).
DETACH_TIMEOUT = "60s"


@dataclass(frozen=True)
class Partition:
    table: str  # the partitioned parent
    name: str
    lower: datetime | None  # None: DEFAULT partition (or an unbounded side)
    upper: datetime | None
    detach_pending: bool = False  # a DETACH CONCURRENTLY that did not finish

    @property
    def is_default(self) -> bool:
        return self.lower is None and self.upper is None


def _day_suffix(day: date) -> str:
    return f"p{day:%Y%m%d}"


def partition_name(table: str, day: date) -> str:
    return f"{table}_{_day_suffix(day)}"


def leaf_suffix(expires_at: datetime, mode: str) -> str:
    """The suffix of the leaf partitions (of all three tables) that hold rows with this
    ``expires_at``: ``p<YYYYMMDD>`` of its UTC day, or ``default`` in delete retention mode.
    When that leaf exists Postgres guarantees the row is in it (a range partition never
    coexists with matching rows in the default one)."""
    if mode == "delete":
        return "default"
    return _day_suffix(expires_at.astimezone(UTC).date())


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


def quote(conn: Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote(name)


def lock_layout(conn: Connection) -> None:
    """Take the layout lock and the DDL lock timeout for the rest of this transaction."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LAYOUT_LOCK_KEY})


_LIST = text(
    r"""
    SELECT parent.relname, child.relname,
           (regexp_match(pg_get_expr(child.relpartbound, child.oid),
                         'FROM \(''([^'']+)''\)'))[1]::timestamptz,
           (regexp_match(pg_get_expr(child.relpartbound, child.oid),
                         'TO \(''([^'']+)''\)'))[1]::timestamptz,
           i.inhdetachpending
    FROM pg_inherits i
    JOIN pg_class child ON child.oid = i.inhrelid
    JOIN pg_class parent ON parent.oid = i.inhparent
    JOIN pg_namespace ns ON ns.oid = parent.relnamespace
    WHERE parent.relname = ANY(:tables) AND ns.nspname = current_schema()
    ORDER BY 1, 4 NULLS LAST, 2
    """
)


def list_partitions(
    conn: Connection, tables: tuple[str, ...] = PARTITIONED_TABLES
) -> list[Partition]:
    """Every partition of the partitioned tables (the daily three, unless ``tables`` names
    others: the monthly ledger) with its bounds as Postgres enforces them."""
    rows = conn.execute(_LIST, {"tables": list(tables)}).all()
    return [Partition(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]


def create_day(conn: Connection, day: date) -> list[str]:
    """Create the partitions of every partitioned table for one day (idempotent).

    Each leaf is created as a table of its own, then attached: ``ATTACH PARTITION`` takes
    SHARE UPDATE EXCLUSIVE on the parent, which no accept, claim or finish waits for, where
    ``CREATE TABLE ... PARTITION OF`` would take ACCESS EXCLUSIVE and queue every accept
    behind it (retention creates days up to ``dead_letter_retention`` ahead while the
    receiver runs). The new table is empty, so the attach validates nothing; it builds the
    parent's indexes on it."""
    lo, hi = day_bounds(day)
    attached = {p.name for p in list_partitions(conn)}
    created = []
    for table in PARTITIONED_TABLES:
        name = partition_name(table, day)
        created.append(name)
        if name in attached:
            continue
        leaf = quote(conn, name)
        conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {leaf}"
                f" (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
            )
        )
        conn.execute(
            text(
                f"ALTER TABLE {table} ATTACH PARTITION {leaf}"
                f" FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
            )
        )
    return created


def create_default(conn: Connection) -> None:
    """The delete-mode layout: one DEFAULT partition per table, indexed on expires_at so each
    batch of the delete finds its rows without scanning the table."""
    for table in PARTITIONED_TABLES:
        default = f"{table}_default"
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {default} PARTITION OF {table} DEFAULT"))
        conn.execute(
            text(f"CREATE INDEX IF NOT EXISTS ix_{default}_expires_at ON {default} (expires_at)")
        )


def drop(conn: Connection, partition: Partition) -> None:
    """Drop a leaf. A day of deliveries takes its rows' lane members (migration 0033, kept
    by row triggers, which a dropped table does not fire) with it: a dead letter past its
    retention holds its lane no more than a deleted one does. Members whose delivery still
    exists (moved elsewhere) stay."""
    conn.execute(text(f"DROP TABLE {quote(conn, partition.name)}"))
    if partition.table == "deliveries" and partition.lower is not None:
        conn.execute(
            text(
                "DELETE FROM lane_members m WHERE m.expires_at >= :lower"
                " AND (CAST(:upper AS timestamptz) IS NULL OR m.expires_at < :upper)"
                " AND NOT EXISTS (SELECT 1 FROM deliveries d"
                " WHERE d.id = m.delivery_id AND d.expires_at = m.expires_at)"
            ),
            {"lower": partition.lower, "upper": partition.upper},
        )


def detach(conn: Connection, partition: Partition) -> None:
    """Detach a leaf without blocking its parent: ``DETACH PARTITION ... CONCURRENTLY`` (not
    in a transaction block: ``conn`` is in autocommit). It takes SHARE UPDATE EXCLUSIVE on
    the parent, so accepts, claims and finishes on other days go on; it waits for the
    transactions that may still read the leaf, then it is gone from the parent. A leaf left
    pending by an earlier attempt is finished instead (``FINALIZE``)."""
    mode = "FINALIZE" if partition.detach_pending else "CONCURRENTLY"
    conn.execute(text(f"SET lock_timeout = '{DETACH_TIMEOUT}'"))
    conn.execute(
        text(f"ALTER TABLE {partition.table} DETACH PARTITION {quote(conn, partition.name)} {mode}")
    )


def reattach(conn: Connection, partition: Partition) -> None:
    """Put a detached leaf back under its parent, with the bounds it had. Its rows already
    satisfy them (DETACH CONCURRENTLY left an equivalent CHECK constraint), so nothing is
    scanned; SHARE UPDATE EXCLUSIVE on the parent, like :func:`detach`."""
    assert partition.lower is not None
    assert partition.upper is not None
    conn.execute(
        text(
            f"ALTER TABLE {partition.table} ATTACH PARTITION {quote(conn, partition.name)}"
            f" FOR VALUES FROM ('{partition.lower.isoformat()}')"
            f" TO ('{partition.upper.isoformat()}')"
        )
    )


def lock_layout_session(conn: Connection) -> None:
    """The layout lock for an autocommit connection (DETACH CONCURRENTLY cannot run in a
    transaction): held until :func:`unlock_layout_session`. Session and transaction advisory
    locks on one key exclude each other, so creators still wait for us."""
    conn.execute(text(f"SET lock_timeout = '{LOCK_TIMEOUT}'"))
    conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": LAYOUT_LOCK_KEY})


def unlock_layout_session(conn: Connection) -> None:
    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": LAYOUT_LOCK_KEY})

"""Expiry maintenance, run by beat (each run idempotent, safe to overlap or miss).

- ``partition`` mode: create daily partitions ahead (:func:`ensure_partitions`) and drop the
  ones wholly past (:func:`drop_expired_partitions`): a catalog operation, no row scan.
- ``delete`` mode: :func:`delete_expired` deletes expired rows in batches of at most
  ``delete_batch_size`` (<= 10,000) rows per statement, each batch its own short transaction.
- both: :func:`drop_payloads` drops bodies past their retention; conflicts (not partitioned)
  are deleted in batches.

A receipt is expired from ``now >= expires_at`` (the receiver deduplicates while
``now < expires_at``), so every "expired" test below is ``expires_at <= now``.
Only counts are logged, never ids or bodies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text

from models import partitions
from models.schema import PROVIDERS
from webhooks.logs import get_logger
from webhooks.settings import Settings
from webhooks.ttl import MAX_EVENT_TIME_LEAD, TtlConfigError, TtlOverrides, dedup_terms

log = get_logger("retention")

# Deleted children first: a delivery never outlives the receipt it points at.
EXPIRING_TABLES = ("attempts", "deliveries", "receipts", "conflicts")
# Partitions are dropped in the order the receiver and the workers lock the parents.
_DROP_ORDER = {"receipts": 0, "deliveries": 1, "attempts": 2}


@dataclass
class MaintenanceReport:
    mode: str
    now: datetime
    partitions_created: list[str] = field(default_factory=list)
    partitions_dropped: list[str] = field(default_factory=list)
    partitions_through: date | None = None  # last day laid out (partition mode)
    rows_deleted: dict[str, int] = field(default_factory=dict)
    delete_statements: dict[str, int] = field(default_factory=dict)
    payloads_dropped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DeleteCounts:
    rows: dict[str, int] = field(default_factory=dict)
    statements: dict[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------
# Partitions
# ----------------------------------------------------------------------------------------


def longest_ttl(engine: Engine, settings: Settings) -> timedelta:
    """The longest dedup TTL any source has, and never less than the longest a new source
    with default terms would get (the floor when there are no sources yet)."""
    floor = max(dedup_terms(p, TtlOverrides(), settings).total for p in PROVIDERS)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT DISTINCT provider, retry_window_s, queue_lag_s, clock_skew_s,"
                " replay_grace_s FROM sources"
            )
        ).all()
    longest = floor
    for provider, *seconds in rows:
        try:
            ttl = dedup_terms(provider, TtlOverrides.from_seconds(*seconds), settings)
        except TtlConfigError:
            continue  # refused by the receiver too: it never writes a receipt
        longest = max(longest, ttl.total)
    return longest


def ensure_partitions(engine: Engine, settings: Settings, now: datetime) -> list[str]:
    """Lay out the partitions receipts written from ``now`` on can need; returns those created.

    Days run from yesterday through ``now + longest TTL + MAX_EVENT_TIME_LEAD +
    partition_ahead_days``, skipping any day wholly past (upper bound <= now):
    :func:`drop_expired_partitions` would only drop it again. A receiver whose clock lags
    ours and still needs such a day gets "no partition" and calls this with its own ``now``.
    In ``delete`` mode it makes sure the DEFAULT partitions exist instead.
    """
    if settings.retention_mode == "delete":
        with engine.begin() as conn:
            partitions.lock_layout(conn)
            partitions.create_default(conn)
        return []
    horizon = now + longest_ttl(engine, settings) + MAX_EVENT_TIME_LEAD
    last = (horizon + timedelta(days=settings.partition_ahead_days)).date()
    created: list[str] = []
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        existing = {p.name for p in partitions.list_partitions(conn)}
        day = (now - timedelta(days=1)).date()
        while day <= last:
            _, upper = partitions.day_bounds(day)
            names = [partitions.partition_name(t, day) for t in _DROP_ORDER]
            if upper > now and not existing.issuperset(names):
                partitions.create_day(conn, day)
                created += [n for n in names if n not in existing]
            day += timedelta(days=1)
    if created:
        log.info("partitions_created", count=len(created), through=last.isoformat())
    return created


def drop_expired_partitions(engine: Engine, settings: Settings, now: datetime) -> list[str]:
    """Drop every partition of receipts, deliveries and attempts whose upper bound is <= now,
    all in one transaction; returns the names dropped.

    Safe by construction: Postgres enforces ``expires_at < upper`` for every row of a range
    partition, so ``upper <= now`` means every row in it has ``expires_at < now``: expired.
    A partition holding a receipt with ``expires_at > now`` has ``upper > expires_at > now``
    and is never chosen. The bounds come from the catalog, not from the partition's name;
    DEFAULT partitions have no bound and are never dropped.
    """
    if settings.retention_mode == "delete":
        return []
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        past = [
            p
            for p in partitions.list_partitions(conn)
            if p.upper is not None and p.upper <= now and p.table in _DROP_ORDER
        ]
        past.sort(key=lambda p: (_DROP_ORDER[p.table], p.upper or now))
        for partition in past:
            partitions.drop(conn, partition)
    if past:
        log.info("partitions_dropped", count=len(past))
    return [p.name for p in past]


# ----------------------------------------------------------------------------------------
# Batched delete
# ----------------------------------------------------------------------------------------


def _delete_statement(conn: Connection, leaf: str) -> Any:
    """One batch on one leaf table, found oldest first (expires_at is indexed there) and
    deleted by ctid: a TID lookup per row, never a scan of the table. A ctid is unique only
    within one table, so this runs per partition, never on a partitioned parent; the outer
    predicate repeats the expiry test so a row can never be deleted unexpired."""
    name = partitions.quote(conn, leaf)
    return text(
        f"DELETE FROM {name} WHERE ctid = ANY(ARRAY("  # noqa: S608 (catalog names, quoted)
        f" SELECT ctid FROM {name} WHERE expires_at <= :now ORDER BY expires_at LIMIT :limit"
        f")) AND expires_at <= :now"
    )


def _leaves(conn: Connection, table: str) -> list[str]:
    if table in _DROP_ORDER:
        return [p.name for p in partitions.list_partitions(conn) if p.table == table]
    return [table]


def _delete_batched(engine: Engine, table: str, now: datetime, batch: int) -> tuple[int, int]:
    """Delete expired rows of one table, ``batch`` at most per statement, each statement in
    its own transaction, partition by partition; a partition is done at its first short
    batch. Returns (rows, statements)."""
    with engine.connect() as conn:
        statements_by_leaf = [_delete_statement(conn, leaf) for leaf in _leaves(conn, table)]
    rows = statements = 0
    for statement in statements_by_leaf:
        while True:
            with engine.begin() as conn:
                deleted = conn.execute(statement, {"now": now, "limit": batch}).rowcount
            statements += 1
            rows += deleted
            if deleted < batch:
                break
    return rows, statements


def delete_expired(
    engine: Engine, settings: Settings, now: datetime, tables: tuple[str, ...] = EXPIRING_TABLES
) -> DeleteCounts:
    """The batched-delete expiry (``delete`` mode; conflicts in both modes)."""
    batch = min(settings.delete_batch_size, 10_000)
    counts = DeleteCounts()
    for table in tables:
        rows, statements = _delete_batched(engine, table, now, batch)
        counts.rows[table] = rows
        counts.statements[table] = statements
    if any(counts.rows.values()):
        log.info("rows_deleted", **{t: n for t, n in counts.rows.items() if n})
    return counts


# ----------------------------------------------------------------------------------------
# Payload retention
# ----------------------------------------------------------------------------------------

# One batch: the next ``limit`` receipts (by received_at, id) that still hold a body and were
# received before the cutoff, their deliveries locked FOR SHARE (a concurrent replay or
# re-run either committed first, and we see its non-succeeded status, or waits for us), and
# the bodies of those whose every delivery succeeded at or before the cutoff dropped.
# A receipt without deliveries (no route matched) has nothing left to do: its age counts
# from its arrival. Dead, pending, retrying and processing deliveries keep the body.
_DROP_PAYLOADS = text(
    """
    WITH candidate AS MATERIALIZED (
        SELECT id, expires_at, received_at FROM receipts
        WHERE payload IS NOT NULL AND received_at <= :cutoff
          AND (received_at, id) > (:after_received, :after_id)
        ORDER BY received_at, id
        LIMIT :limit
    ), locked AS MATERIALIZED (
        SELECT d.receipt_id, d.status, d.succeeded_at
        FROM deliveries d JOIN candidate c ON d.receipt_id = c.id AND d.expires_at = c.expires_at
        FOR SHARE OF d
    ), summary AS (
        SELECT receipt_id, bool_and(status = 'succeeded') AS all_succeeded,
               max(succeeded_at) AS last_succeeded
        FROM locked GROUP BY receipt_id
    ), done AS (
        SELECT c.id, c.expires_at FROM candidate c LEFT JOIN summary s ON s.receipt_id = c.id
        WHERE coalesce(s.all_succeeded, true)
          AND coalesce(s.last_succeeded, c.received_at) <= :cutoff
    ), dropped AS (
        UPDATE receipts r SET payload = NULL, payload_dropped_at = :now
        FROM done
        WHERE r.id = done.id AND r.expires_at = done.expires_at AND r.payload IS NOT NULL
        RETURNING r.id
    ), last AS (
        SELECT received_at, id FROM candidate ORDER BY received_at DESC, id DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM dropped), (SELECT count(*) FROM candidate),
           (SELECT received_at FROM last), (SELECT id FROM last)
    """
)

_BEFORE_EVERYTHING = datetime.fromisoformat("0001-01-01T00:00:00+00:00")


def drop_payloads(engine: Engine, settings: Settings, now: datetime) -> int:
    """Drop the bodies whose retention is over (see :data:`_DROP_PAYLOADS`); set
    ``payload_dropped_at``. Walks the candidates in keyset order, ``delete_batch_size`` per
    statement, so bodies that must stay (dead letters, work in flight) never stall the walk.
    Returns how many bodies were dropped."""
    cutoff = now - settings.payload_retention
    batch = min(settings.delete_batch_size, 10_000)
    after_received, after_id = _BEFORE_EVERYTHING, 0
    total = 0
    while True:
        with engine.begin() as conn:
            dropped, seen, last_received, last_id = conn.execute(
                _DROP_PAYLOADS,
                {
                    "cutoff": cutoff,
                    "now": now,
                    "limit": batch,
                    "after_received": after_received,
                    "after_id": after_id,
                },
            ).one()
        total += int(dropped)
        if seen < batch:
            break
        after_received, after_id = last_received, last_id
    if total:
        log.info("payloads_dropped", count=total)
    return total


# ----------------------------------------------------------------------------------------
# One maintenance run
# ----------------------------------------------------------------------------------------


def run_maintenance(engine: Engine, settings: Settings, now: datetime) -> MaintenanceReport:
    """One maintenance pass for ``settings.retention_mode`` (called by beat and the CLI)."""
    report = MaintenanceReport(mode=settings.retention_mode, now=now)
    if settings.retention_mode == "partition":
        report.partitions_created = ensure_partitions(engine, settings, now)
        report.partitions_dropped = drop_expired_partitions(engine, settings, now)
        with engine.connect() as conn:
            uppers = [p.upper for p in partitions.list_partitions(conn) if p.upper is not None]
        if uppers:
            # The last day laid out, not the exclusive bound after it.
            report.partitions_through = (max(uppers) - timedelta(days=1)).date()
        counts = delete_expired(engine, settings, now, tables=("conflicts",))
    else:
        ensure_partitions(engine, settings, now)
        counts = delete_expired(engine, settings, now)
    report.rows_deleted = counts.rows
    report.delete_statements = counts.statements
    report.payloads_dropped = drop_payloads(engine, settings, now)
    log.info(
        "maintenance",
        mode=report.mode,
        partitions_created=len(report.partitions_created),
        partitions_dropped=len(report.partitions_dropped),
        rows_deleted=sum(report.rows_deleted.values()),
        payloads_dropped=report.payloads_dropped,
    )
    return report

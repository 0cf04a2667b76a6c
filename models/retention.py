"""Expiry maintenance, run by beat (each run idempotent, safe to overlap or miss).

- ``partition`` mode: create daily partitions ahead, through the longest TTL of the existing
  sources (:func:`ensure_partitions`), drop the ones wholly past (:func:`expire_partitions`):
  a catalog operation, no row scan; and drop the empty days laid out beyond what the sources
  need (:func:`trim_layout`), which every accept's duplicate probe would otherwise open.
- ``delete`` mode: :func:`delete_expired` deletes expired rows in batches of at most
  ``delete_batch_size`` (<= 10,000) rows per statement, each batch its own short transaction.
- both: :func:`drop_payloads` drops bodies past their retention; conflicts (not partitioned)
  are deleted in batches; the processed-events ledger's months are laid out ahead and dropped
  past ``WEBHOOKS_LEDGER_RETENTION`` (:mod:`models.ledger_layout`).

A receipt is expired from ``now >= expires_at`` (the receiver deduplicates while
``now < expires_at``), so every "expired" test below is ``expires_at <= now``.

Holds: expiry ends deduplication, never work. A delivery that is pending, retrying or
processing, or dead within ``dead_letter_retention`` of its ``dead_at``, *holds* its receipt:
before rows are removed, each held receipt, all its deliveries and all their attempts are
moved forward (``expires_at`` set to :func:`~models.retention_holds.hold_end`, the last
instant of the UTC day ``HOLD_STEP`` ahead, or to the end of the dead letters' retention
when that comes sooner and nothing is unfinished). A held receipt therefore keeps
deduplicating its event; it is looked at again when its new day is past (the first run
after midnight UTC). The scan for holds reads the partial indexes ``ix_deliveries_due``
(unfinished) and ``ix_deliveries_dead``, so a day whose work all succeeded is still dropped
without a scan.

Time: every expiry decision is taken on the database's clock. ``now`` is None in production
(read with ``clock_timestamp()`` inside the deciding transaction, after the layout lock, so a
creator and a dropper serialised by that lock agree on which days are past); a test passes
an instant (:func:`core.clock.pinned`).

Only counts are logged, never ids or bodies.

The rooms: :mod:`models.retention_layout` (laying out and trimming days),
:mod:`models.retention_expiry` (partition mode's drop), :mod:`models.retention_holds` (what is
held and where it moves); this module holds delete mode, payload retention and one run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text

from core.logs import get_logger
from core.settings import Settings
from models import ledger, ledger_layout, partitions
from models.retention_expiry import expire_partitions
from models.retention_holds import (
    DROP_ORDER,
    MOVE_BATCH,
    Holds,
    database_now,
    decision_time,
    held_receipts,
    holding,
    log_holds,
    move_held,
)
from models.retention_layout import ensure_partitions, trim_layout

log = get_logger("retention")


# Deliveries first, then the attempts and receipts none of them needs any more: each later
# step refuses rows whose delivery is still there (held, or re-held by a racing replay).
EXPIRING_TABLES = ("deliveries", "attempts", "receipts", "conflicts")


# What the batched delete may remove: finished for good.
_REMOVABLE = (
    "(status IN ('succeeded', 'discarded', 'filtered') OR (status = 'dead' AND dead_at IS NOT NULL"
    " AND dead_at <= CAST(:now AS timestamptz) - :retention))"
)

_BEFORE_EVERYTHING = datetime.fromisoformat("0001-01-01T00:00:00+00:00")


@dataclass
class MaintenanceReport:
    mode: str
    now: datetime
    partitions_created: list[str] = field(default_factory=list)
    partitions_dropped: list[str] = field(default_factory=list)
    # Empty days beyond what the existing sources need, detached and dropped (trim_layout).
    partitions_trimmed: list[str] = field(default_factory=list)
    partitions_through: date | None = None  # last day laid out (partition mode)
    rows_deleted: dict[str, int] = field(default_factory=dict)
    delete_statements: dict[str, int] = field(default_factory=dict)
    payloads_dropped: int = 0
    held_receipts: int = 0  # receipts (with their deliveries, attempts) moved forward
    rows_moved: dict[str, int] = field(default_factory=dict)
    postponed: list[str] = field(default_factory=list)  # days (or receipts) left for later
    dead_letters_expired: int = 0
    # The processed-events ledger's months (models/ledger_layout.py), in either mode.
    ledger_months_created: list[str] = field(default_factory=list)
    ledger_months_dropped: list[str] = field(default_factory=list)
    ledger_default_rows_deleted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add_holds(self, holds: Holds) -> None:
        self.held_receipts = holds.receipts
        self.rows_moved = dict(holds.moved)
        self.postponed = list(holds.postponed)
        self.dead_letters_expired = holds.dead_letters_expired


@dataclass
class DeleteCounts:
    rows: dict[str, int] = field(default_factory=dict)
    statements: dict[str, int] = field(default_factory=dict)
    holds: Holds = field(default_factory=Holds)


# ----------------------------------------------------------------------------------------
# Batched delete
# ----------------------------------------------------------------------------------------


def hold_in_place(
    engine: Engine, settings: Settings, now: datetime | None
) -> tuple[datetime, Holds]:
    """Delete mode's hold step: move held expired receipts (with their deliveries and
    attempts) in the DEFAULT partitions to where their hold ends (:data:`HOLD_UNTIL`), in
    batches of short transactions; a receipt with a delivery under a live lease is left for
    a later run, whole (the batched delete refuses its siblings too). Returns the decision
    instant."""
    holds = Holds()
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = decision_time(conn, now)
        deliveries = [p.name for p in partitions.list_partitions(conn) if p.table == "deliveries"]
    for leaf in deliveries:
        after = 0
        while True:
            with engine.begin() as conn:
                held = held_receipts(conn, leaf, at, settings, after=after)
                ready = [h for h in held if not h.leased]
                holds.receipts += len(ready)
                holds.add_moved(move_held(conn, ready, _BEFORE_EVERYTHING, at))
            for h in held:
                if h.leased:
                    holds.postponed.append(f"receipt {h.receipt_id}")
                    holds.leased += h.leased
            if len(held) < MOVE_BATCH:
                break
            after = held[-1].receipt_id
    if holds.leased:
        log.info("receipt_hold_postponed", receipts=len(holds.postponed), count=holds.leased)
    return at, holds


# The predicate of each table's batch: expired, and no longer needed. Deliveries go when
# finished for good; attempts and receipts when no delivery of theirs is left (so a delivery
# a replay revived between two steps keeps its attempts and its receipt).
_DELETABLE = {
    # Nor a delivery whose receipt is still held by a sibling (a receipt the hold step left
    # for a live lease): the receipt keeps all its deliveries and their attempts.
    "deliveries": (
        f"{_REMOVABLE} AND NOT EXISTS (SELECT 1 FROM deliveries s"  # noqa: S608 (literals)
        " WHERE s.receipt_id = {leaf}.receipt_id AND s.expires_at = {leaf}.expires_at"
        f" AND {holding('s')})"
    ),
    "attempts": (
        "NOT EXISTS (SELECT 1 FROM deliveries d"
        " WHERE d.id = {leaf}.delivery_id AND d.expires_at = {leaf}.expires_at)"
    ),
    "receipts": (
        "NOT EXISTS (SELECT 1 FROM deliveries d"
        " WHERE d.receipt_id = {leaf}.id AND d.expires_at = {leaf}.expires_at)"
    ),
    "conflicts": "true",
}


def _delete_statement(conn: Connection, table: str, leaf: str) -> Any:
    """One batch on one leaf table, found oldest first (expires_at is indexed there) and
    deleted by ctid: a TID lookup per row, never a scan of the table. A ctid is unique only
    within one table, so this runs per partition, never on a partitioned parent; the outer
    predicate repeats the whole test (a row changed since the inner select is re-checked),
    so a row can never be deleted unexpired or held. Deliveries return whether each was a
    dead letter, to count those whose retention ended, and append the ledger rows of those
    filtered at the accept (their receipts are deleted by a later step)."""
    name = partitions.quote(conn, leaf)
    keep = _DELETABLE[table].format(leaf=name)
    delete = (
        f"DELETE FROM {name} WHERE ctid = ANY(ARRAY("  # noqa: S608 (catalog names, quoted)
        f" SELECT ctid FROM {name} WHERE expires_at <= :now AND {keep}"
        f" ORDER BY expires_at LIMIT :limit"
        f")) AND expires_at <= :now AND {keep}"
    )
    if table == "deliveries":
        # A delivery filtered at the accept has its ledger row appended here (models.ledger).
        return text(ledger.deleting(delete, "receipts", "status = 'dead'"))
    return text(delete)


def _leaves(conn: Connection, table: str) -> list[str]:
    if table in DROP_ORDER:
        return [p.name for p in partitions.list_partitions(conn) if p.table == table]
    return [table]


def _delete_batched(
    engine: Engine, settings: Settings, table: str, now: datetime, batch: int
) -> tuple[int, int, int]:
    """Delete expired rows of one table, ``batch`` at most per statement, each statement in
    its own transaction, partition by partition; a partition is done at its first short
    batch. Returns (rows, statements, dead letters among the rows)."""
    with engine.connect() as conn:
        statements_by_leaf = [_delete_statement(conn, table, leaf) for leaf in _leaves(conn, table)]
    params = {"now": now, "limit": batch, "retention": settings.dead_letter_retention}
    rows = statements = dead = 0
    for statement in statements_by_leaf:
        while True:
            with engine.begin() as conn:
                result = conn.execute(statement, params)
                if table == "deliveries":
                    flags = result.scalars().all()
                    deleted = len(flags)
                    dead += sum(1 for f in flags if f)
                else:
                    deleted = result.rowcount
            statements += 1
            rows += deleted
            if deleted < batch:
                break
    return rows, statements, dead


# How many expired rows :func:`count_expired` counts per table at most (a bounded read).
EXPIRED_COUNT_CAP = 10_000


def count_expired(engine: Engine, settings: Settings, now: datetime) -> dict[str, int]:
    """Delete mode: per table, the rows expired at ``now`` that the batched delete would
    remove next (its own predicate: held rows and rows whose delivery remains are not
    counted), up to :data:`EXPIRED_COUNT_CAP`. Right after a pass that kept up, 0 for rows
    expired at the pass's instant; rows that stay are expiry falling behind or failing."""
    params = {"now": now, "limit": EXPIRED_COUNT_CAP, "retention": settings.dead_letter_retention}
    out: dict[str, int] = {}
    with engine.connect() as conn:
        for table in EXPIRING_TABLES:
            total = 0
            for leaf in _leaves(conn, table):
                name = partitions.quote(conn, leaf)
                keep = _DELETABLE[table].format(leaf=name)
                total += conn.execute(
                    text(
                        f"SELECT count(*) FROM (SELECT 1 FROM {name}"  # noqa: S608 (catalog names, quoted)
                        f" WHERE expires_at <= :now AND {keep} LIMIT :limit) AS expired"
                    ),
                    params,
                ).scalar_one()
            out[table] = min(int(total), EXPIRED_COUNT_CAP)
    return out


def delete_expired(
    engine: Engine,
    settings: Settings,
    now: datetime | None,
    tables: tuple[str, ...] = EXPIRING_TABLES,
) -> DeleteCounts:
    """The batched-delete expiry (``delete`` mode; conflicts in both modes). When it expires
    deliveries, the hold step runs first, and the batches refuse held rows themselves too
    (a replay can race between the two)."""
    batch = min(settings.delete_batch_size, 10_000)
    counts = DeleteCounts()
    if "deliveries" in tables:
        at, counts.holds = hold_in_place(engine, settings, now)
    elif now is None:
        at = database_now(engine)
    else:
        at = now
    for table in tables:
        rows, statements, dead = _delete_batched(engine, settings, table, at, batch)
        counts.rows[table] = rows
        counts.statements[table] = statements
        counts.holds.dead_letters_expired += dead
    if any(counts.rows.values()):
        log.info("rows_deleted", **{t: n for t, n in counts.rows.items() if n})
    log_holds(counts.holds)
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
    WITH clock AS MATERIALIZED (
        SELECT coalesce(CAST(:now AS timestamptz), now()) AS now,
               coalesce(CAST(:now AS timestamptz), now()) - :retention AS cutoff
    ), candidate AS MATERIALIZED (
        SELECT id, expires_at, received_at FROM receipts
        WHERE payload IS NOT NULL AND received_at <= (SELECT cutoff FROM clock)
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
          AND coalesce(s.last_succeeded, c.received_at) <= (SELECT cutoff FROM clock)
    ), dropped AS (
        UPDATE receipts r SET payload = NULL, payload_dropped_at = (SELECT now FROM clock)
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


def drop_payloads(engine: Engine, settings: Settings, now: datetime | None) -> int:
    """Drop the bodies whose retention is over (see :data:`_DROP_PAYLOADS`); set
    ``payload_dropped_at``. Walks the candidates in keyset order, ``delete_batch_size`` per
    statement, so bodies that must stay (dead letters, work in flight) never stall the walk.
    ``now`` None: each statement decides on the database's clock. Returns how many bodies
    were dropped."""
    batch = min(settings.delete_batch_size, 10_000)
    after_received, after_id = _BEFORE_EVERYTHING, 0
    total = 0
    while True:
        with engine.begin() as conn:
            dropped, seen, last_received, last_id = conn.execute(
                _DROP_PAYLOADS,
                {
                    "retention": settings.payload_retention,
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


def run_maintenance(engine: Engine, settings: Settings, now: datetime | None) -> MaintenanceReport:
    """One maintenance pass for ``settings.retention_mode`` (called by beat and the CLI).
    ``now`` None (production): every step decides on the database's clock."""
    # The report's instant (each step reads its own, under its own locks).
    report = MaintenanceReport(mode=settings.retention_mode, now=now or database_now(engine))
    if settings.retention_mode == "partition":
        report.partitions_created = ensure_partitions(engine, settings, now)
        expiry = expire_partitions(engine, settings, now)
        report.partitions_dropped = expiry.dropped
        report.partitions_trimmed = trim_layout(engine, settings, now)
        report.add_holds(expiry.holds)
        with engine.connect() as conn:
            uppers = [p.upper for p in partitions.list_partitions(conn) if p.upper is not None]
        if uppers:
            # The last day laid out, not the exclusive bound after it.
            report.partitions_through = (max(uppers) - timedelta(days=1)).date()
        counts = delete_expired(engine, settings, now, tables=("conflicts",))
    else:
        ensure_partitions(engine, settings, now)
        counts = delete_expired(engine, settings, now)
        report.add_holds(counts.holds)
    report.rows_deleted = counts.rows
    report.delete_statements = counts.statements
    report.payloads_dropped = drop_payloads(engine, settings, now)
    kept = ledger_layout.maintain(engine, settings, now)
    report.ledger_months_created = kept.created
    report.ledger_months_dropped = kept.dropped
    report.ledger_default_rows_deleted = kept.default_rows_deleted
    log.info(
        "maintenance",
        mode=report.mode,
        partitions_created=len(report.partitions_created),
        partitions_dropped=len(report.partitions_dropped),
        partitions_trimmed=len(report.partitions_trimmed),
        rows_deleted=sum(report.rows_deleted.values()),
        held_receipts=report.held_receipts,
        postponed=len(report.postponed),
        dead_letters_expired=report.dead_letters_expired,
        payloads_dropped=report.payloads_dropped,
        ledger_months_dropped=len(report.ledger_months_dropped),
    )
    return report

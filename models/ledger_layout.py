"""The ledger's months (:mod:`models.ledger`, migration 0023), kept by each maintenance run in
either retention mode:

- laid out around now: the month before, this one and the next two
  (:func:`ensure_months`), each created as a table of its own and attached (SHARE UPDATE
  EXCLUSIVE on the parent: endings go on). A month whose rows already went to
  ``ledger_default`` (maintenance stopped for months, or a clock pinned far off) is left
  there: Postgres refuses to attach a range the default holds rows of;
- dropped once ``WEBHOOKS_LEDGER_RETENTION`` whole months have passed since it ended
  (:func:`drop_months`): one ``DROP TABLE`` per month, no row scan. The parent has a default
  partition, so ``DETACH ... CONCURRENTLY`` is not allowed; the drop takes ACCESS EXCLUSIVE
  on the parent for a catalog change, waiting at most :data:`DROP_LOCK_TIMEOUT` (a worker's
  ending would queue behind it) and trying again at the next run when it cannot have it;
- the default partition's rows past the same cutoff are deleted in batches.

Decided on the database's clock (read after the layout lock), or a test's pinned instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy.exc
from sqlalchemy import Connection, Engine, text

from core.logs import get_logger
from core.settings import Settings
from models import partitions
from models.retention_holds import decision_time
from models.schema import LEDGER_TABLE

log = get_logger("retention")

LEDGER_TABLES = (LEDGER_TABLE,)
DEFAULT = f"{LEDGER_TABLE}_default"
MONTHS_BEHIND = 1
MONTHS_AHEAD = 2
# How long a month's drop may wait for its lock on the parent (the endings queue behind it).
DROP_LOCK_TIMEOUT = "1s"


@dataclass
class LedgerMaintenance:
    """What one run did to the ledger."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # Months not laid out because ledger_default holds rows of them (they stay there).
    in_default: list[str] = field(default_factory=list)
    default_rows_deleted: int = 0
    # Months past retention whose drop could not have its lock this time.
    drop_postponed: list[str] = field(default_factory=list)


def month_start(at: datetime) -> datetime:
    """The first instant of ``at``'s month, UTC."""
    utc = at.astimezone(UTC)
    return datetime(utc.year, utc.month, 1, tzinfo=UTC)


def add_months(month: datetime, n: int) -> datetime:
    """The first instant of the month ``n`` months from ``month`` (a month's first instant)."""
    index = month.year * 12 + month.month - 1 + n
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def month_name(month: datetime) -> str:
    return f"{LEDGER_TABLE}_p{month:%Y%m}"


def cutoff(at: datetime, settings: Settings) -> datetime:
    """Rows received before this instant are past retention: the months ended at least
    ``ledger_retention`` whole months ago."""
    return add_months(month_start(at), -settings.ledger_retention)


def _has_rows(conn: Connection, lo: datetime, hi: datetime) -> bool:
    return (
        conn.execute(
            text(
                f"SELECT EXISTS (SELECT 1 FROM {DEFAULT}"  # noqa: S608 (a constant)
                " WHERE received_at >= :lo AND received_at < :hi)"
            ),
            {"lo": lo, "hi": hi},
        ).scalar_one()
        is True
    )


def ensure_months(engine: Engine, now: datetime | None, done: LedgerMaintenance) -> None:
    """Lay out the month before ``now``'s, its own and the next two (those missing)."""
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = decision_time(conn, now)
        attached = {p.name for p in partitions.list_partitions(conn, LEDGER_TABLES)}
        first = add_months(month_start(at), -MONTHS_BEHIND)
        for i in range(MONTHS_BEHIND + 1 + MONTHS_AHEAD):
            lo = add_months(first, i)
            hi = add_months(lo, 1)
            name = month_name(lo)
            if name in attached:
                continue
            if _has_rows(conn, lo, hi):
                done.in_default.append(name)
                continue
            try:
                with conn.begin_nested():
                    conn.execute(
                        text(
                            f"CREATE TABLE {name} (LIKE {LEDGER_TABLE}"
                            " INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
                        )
                    )
                    conn.execute(
                        text(
                            f"ALTER TABLE {LEDGER_TABLE} ATTACH PARTITION {name}"
                            f" FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
                        )
                    )
            except sqlalchemy.exc.DBAPIError as exc:
                # A row of that month reached the default meanwhile: it stays there.
                done.in_default.append(name)
                log.warning("ledger_month_not_laid_out", month=name, error=type(exc).__name__)
                continue
            done.created.append(name)
    if done.in_default:
        log.info("ledger_months_in_default", count=len(done.in_default))


def drop_months(
    engine: Engine, settings: Settings, now: datetime | None, done: LedgerMaintenance
) -> datetime:
    """Drop every month wholly before the cutoff, each in a transaction of its own; returns
    the cutoff."""
    with engine.connect() as conn:
        at = decision_time(conn, now)
        months = partitions.list_partitions(conn, LEDGER_TABLES)
    limit = cutoff(at, settings)
    for p in months:
        if p.is_default or p.upper is None or p.upper > limit:
            continue
        try:
            with engine.begin() as conn:
                partitions.lock_layout(conn)
                conn.execute(text(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
                partitions.drop(conn, p)
        except sqlalchemy.exc.OperationalError as exc:  # the lock not had in time
            done.drop_postponed.append(p.name)
            log.warning("ledger_drop_postponed", month=p.name, error=type(exc).__name__)
            continue
        done.dropped.append(p.name)
    return limit


def delete_from_default(engine: Engine, limit: datetime, batch: int) -> int:
    """The default partition's rows received before ``limit``, ``batch`` per statement."""
    total = 0
    statement = text(
        f"DELETE FROM {DEFAULT} WHERE ctid = ANY(ARRAY("  # noqa: S608 (a constant)
        f" SELECT ctid FROM {DEFAULT} WHERE received_at < :limit LIMIT :batch))"
        " AND received_at < :limit"
    )
    while True:
        with engine.begin() as conn:
            deleted = conn.execute(statement, {"limit": limit, "batch": batch}).rowcount
        total += deleted
        if deleted < batch:
            return total


def maintain(engine: Engine, settings: Settings, now: datetime | None) -> LedgerMaintenance:
    """One run's work on the ledger: months ahead, months past retention, the default's
    rows past it. Counts are logged, never event ids."""
    done = LedgerMaintenance()
    ensure_months(engine, now, done)
    limit = drop_months(engine, settings, now, done)
    done.default_rows_deleted = delete_from_default(
        engine, limit, min(settings.delete_batch_size, 10_000)
    )
    if done.created or done.dropped or done.default_rows_deleted:
        log.info(
            "ledger_maintained",
            months_created=len(done.created),
            months_dropped=len(done.dropped),
            default_rows_deleted=done.default_rows_deleted,
        )
    return done

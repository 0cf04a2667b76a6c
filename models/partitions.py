"""Daily range partitions of receipts, deliveries and attempts on ``expires_at``.

Partition ``<table>_pYYYYMMDD`` holds rows with expires_at in [that day 00:00 UTC, next day).
In ``delete`` retention mode there is a single ``<table>_default`` partition instead and expiry
is a batched delete (see :mod:`models.retention`).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from sqlalchemy import Connection, Engine, text

from models.schema import PARTITIONED_TABLES
from webhooks.settings import Settings


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


def create_day(conn: Connection, day: date) -> list[str]:
    """Create the partitions of every partitioned table for one day (idempotent)."""
    lo, hi = day_bounds(day)
    created = []
    for table in PARTITIONED_TABLES:
        name = partition_name(table, day)
        conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {table} "
                f"FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
            )
        )
        created.append(name)
    return created


def create_default(conn: Connection) -> None:
    for table in PARTITIONED_TABLES:
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {table}_default PARTITION OF {table} DEFAULT"))


def bootstrap(engine: Engine, settings: Settings, now: datetime | None = None) -> None:
    """Lay out partitions after a migration."""
    from models import retention  # noqa: PLC0415  (retention imports this module)

    with engine.begin() as conn:
        if settings.retention_mode == "delete":
            create_default(conn)
            return
    retention.ensure_partitions(engine, settings, now or datetime.now(UTC))

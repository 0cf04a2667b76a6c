"""Sizes to alert on before they turn into outages, measured by each maintenance run and
exported by the worker's metrics server (``WEBHOOKS_WORKER_METRICS_PORT``).

- **The fast tier**: keys in the claims database and Redis's memory against ``maxmemory``.
  At ``maxmemory`` Redis refuses (or evicts) claim keys: every claim degrades to Postgres
  alone, correct but slower. Both readings come from ``INFO``, constant cost whatever the
  key count (no ``SCAN``).
- **Partitions** (partition retention mode): days laid out ahead, and past days not yet
  dropped. Ahead counts whole days beyond the last day a receipt accepted now can need (its
  longest TTL plus the event-time lead); maintenance keeps it at
  ``WEBHOOKS_PARTITION_AHEAD_DAYS``, so it falls only when maintenance stops laying out, and
  below zero receipts find no partition and the receiver has to lay one out mid-request. A
  past day still present means the drop keeps failing (or is postponed).
- **Queue lag** (every mode): each source's measured p99 from receipt to final outcome over
  :data:`~core.ttl.QUEUE_LAG_WINDOW`, read from the database (:mod:`models.queue_lag`),
  beside its ``queue_lag`` term. Only measured and exported: the term stays what is
  configured (docs/retention.md).

A measurement that cannot be made (Redis or Postgres unreachable) is one logged line with
the error class; the gauges keep their last reading, and maintenance goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta

import redis
import sqlalchemy.exc
from sqlalchemy import Engine, text

from core import metrics
from core.logs import get_logger
from core.settings import Settings
from core.ttl import MAX_EVENT_TIME_LEAD, QUEUE_LAG_WINDOW, queue_lag_budget
from models import partitions, queue_lag, retention
from models.retention_layout import longest_ttl
from models.schema import PARTITIONED_TABLES

log = get_logger(__name__)

DAY = timedelta(days=1)


@dataclass(frozen=True)
class FastTier:
    keys: int  # in the claims database (WEBHOOKS_REDIS_URL's)
    used_memory: int  # bytes, the whole Redis server
    maxmemory: int  # bytes; 0: no limit set


@dataclass(frozen=True)
class PartitionDays:
    ahead: int  # whole days laid out beyond the last one a receipt accepted now can need
    past: int  # days wholly past whose partitions are still there


def measure_fast_tier(client: redis.Redis) -> FastTier:
    """Two ``INFO`` sections: constant cost, whatever the number of keys."""
    db = int(client.connection_pool.connection_kwargs.get("db", 0))
    memory = client.info("memory")
    keyspace = client.info("keyspace")
    keys = keyspace.get(f"db{db}", {})
    return FastTier(
        keys=int(keys.get("keys", 0)) if isinstance(keys, dict) else 0,
        used_memory=int(memory["used_memory"]),
        maxmemory=int(memory.get("maxmemory", 0)),
    )


def measure_partitions(engine: Engine, settings: Settings, now: datetime | None) -> PartitionDays:
    """``now`` None: the database's clock (as maintenance decides). Only a day every
    partitioned table has counts as laid out, and only the unbroken run of them from today:
    a far day made on demand for one long-TTL receipt does not hide a gap before it."""
    longest = longest_ttl(engine, settings)
    with engine.connect() as conn:
        at: datetime = now or conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        layout = partitions.list_partitions(conn)
    by_table: dict[str, set[date]] = {table: set() for table in PARTITIONED_TABLES}
    past: set[date] = set()
    for p in layout:
        if p.lower is None or p.upper is None or p.table not in by_table:
            continue  # a DEFAULT partition: no day
        by_table[p.table].add(p.lower.date())
        if p.upper <= at:
            past.add(p.lower.date())
    complete = set.intersection(*by_table.values())
    day = at.date()
    while day in complete:
        day += DAY
    needed = (at + longest + MAX_EVENT_TIME_LEAD).date()
    return PartitionDays(ahead=(day - DAY - needed).days, past=len(past))


def record_fast_tier(client: redis.Redis) -> FastTier | None:
    try:
        tier = measure_fast_tier(client)
    except redis.RedisError as exc:
        log.warning("fast_tier.unmeasured", error=exc.__class__.__name__)
        return None
    metrics.FAST_TIER_KEYS.set(tier.keys)
    metrics.FAST_TIER_USED_MEMORY.set(tier.used_memory)
    metrics.FAST_TIER_MAXMEMORY.set(tier.maxmemory)
    return tier


def record_partitions(
    engine: Engine, settings: Settings, now: datetime | None
) -> PartitionDays | None:
    if settings.retention_mode != "partition":
        return None  # delete mode has one DEFAULT partition per table: no days to count
    try:
        days = measure_partitions(engine, settings, now)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        log.warning("partitions.unmeasured", error=exc.__class__.__name__)
        return None
    metrics.PARTITION_DAYS.labels("ahead").set(days.ahead)
    metrics.PARTITION_DAYS.labels("past").set(days.past)
    return days


def record_queue_lag(
    engine: Engine, settings: Settings, now: datetime | None
) -> list[queue_lag.SourceLag] | None:
    """Each source's measured p99 queue lag (0 when it had no delivery in the window) and its
    budget, on the gauges the WebhookQueueLagOverBudget alert compares."""
    try:
        with engine.connect() as conn:
            lags = queue_lag.measure_sources(conn, now, QUEUE_LAG_WINDOW)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        log.warning("queue_lag.unmeasured", error=exc.__class__.__name__)
        return None
    for lag in lags:
        p99 = lag.measured.p99
        budget = queue_lag_budget(lag.queue_lag_override, settings)
        metrics.QUEUE_LAG_P99.labels(lag.public_id).set(0.0 if p99 is None else p99.total_seconds())
        metrics.QUEUE_LAG_MEASURED.labels(lag.public_id).set(lag.measured.at.timestamp())
        metrics.QUEUE_LAG_BUDGET.labels(lag.public_id).set(budget.total_seconds())
    over = [lag.public_id for lag in lags if _over(lag, settings)]
    if over:
        log.warning("queue_lag.over_budget", sources=over)
    return lags


def _over(lag: queue_lag.SourceLag, settings: Settings) -> bool:
    p99 = lag.measured.p99
    return p99 is not None and p99 > queue_lag_budget(lag.queue_lag_override, settings)


def record_expired(engine: Engine, settings: Settings, now: datetime) -> dict[str, int] | None:
    """Delete mode, after a maintenance run: the expired rows still there
    (:func:`models.retention.count_expired` at the run's instant) as
    ``webhooks_expired_rows{table}``; None in partition mode (whole days are dropped there:
    ``webhooks_partition_days{state="past"}`` says when they are not)."""
    if settings.retention_mode != "delete":
        return None
    try:
        counts = retention.count_expired(engine, settings, now)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        log.warning("expired_rows.unmeasured", error=exc.__class__.__name__)
        return None
    for table, rows in counts.items():
        metrics.EXPIRED_ROWS.labels(table).set(rows)
    return counts

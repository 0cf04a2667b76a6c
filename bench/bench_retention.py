"""Retention benchmark: bytes per row, and expiry by partition drop versus batched delete.

    .venv/bin/python bench/bench_retention.py [--rows 1000000] [--out bench/results_retention.txt]

Works in its own scratch database (``webhooks_bench_retention``, created from the migrations,
dropped at the end). Rows are generated server-side with ``INSERT ... SELECT generate_series``
and shaped like real receipts: 10 sources, 28-character event ids (``evt_`` + 24 hex chars,
Stripe's length), a SHA-256 digest, timestamps, a content type; expires_at spread evenly over
ten days (ten daily partitions). Each receipt has one delivery row.

1. bytes per receipt, table plus indexes (``pg_total_relation_size`` summed over the
   partitions, after VACUUM so the free-space and visibility maps are counted), without a
   payload and with a 1 KB payload; bytes per delivery row;
2. time to expire the same one million compact receipts (and their deliveries) by the two
   mechanisms, measured with the production functions, hold step included:
   :func:`models.retention.expire_partitions` (partition mode) and
   :func:`models.retention.delete_expired` (delete mode: the DEFAULT partitions with their
   expires_at index, 10,000 rows per statement). The ratio is delete / drop. Twice: with
   every delivery succeeded, and with 1% of them held (0.5% retrying, 0.5% dead within the
   dead-letter retention), which both mechanisms must keep, moving them forward.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
from sqlalchemy import Engine, text

from models import partitions, retention
from models.db import make_engine, upgrade
from models.retention import (
    delete_expired,
    drop_expired_partitions,
    ensure_partitions,
    expire_partitions,
)
from webhooks.settings import Settings

DB = "webhooks_bench_retention"
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
T0 = datetime(2030, 1, 1, tzinfo=UTC)  # synthetic "now": far from any real data
SPREAD_DAYS = 10
TTL = timedelta(days=6, minutes=10)  # Stripe's default dedup TTL

INSERT = """
INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at, received_at,
                      body_digest, content_type, payload)
SELECT 1 + i % 10,
       'evt_' || substr(md5(i::text), 1, 24),
       ts.expires_at,
       'invoice.paid',
       ts.expires_at - :ttl - interval '2 seconds',
       ts.expires_at - :ttl,
       sha256(convert_to(i::text, 'UTF8')),
       'application/json',
       CASE WHEN :with_payload
            THEN convert_to(repeat(md5(i::text), 32), 'UTF8')  -- 1,024 bytes
       END
FROM generate_series(1, :rows) AS i,
     LATERAL (SELECT :start + (i - 1) * (:spread / :rows) AS expires_at) AS ts
"""

# One delivery per receipt: succeeded, except (held) 1 in 200 retrying and 1 in 200 dead a
# day before the expiry run (within the 30-day dead-letter retention).
DELIVERIES = """
INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status, attempts,
                        next_attempt_at, created_at, updated_at, succeeded_at, dead_at,
                        dead_reason)
SELECT r.expires_at, r.id, r.source_id, r.source_id,
       CASE WHEN :held AND r.id % 200 = 0 THEN 'retrying'
            WHEN :held AND r.id % 200 = 1 THEN 'dead'
            ELSE 'succeeded' END,
       1, r.received_at + interval '1 minute', r.received_at, r.received_at + interval '1 second',
       CASE WHEN :held AND r.id % 200 IN (0, 1) THEN NULL
            ELSE r.received_at + interval '1 second' END,
       CASE WHEN :held AND r.id % 200 = 1 THEN :dead_at END,
       CASE WHEN :held AND r.id % 200 = 1 THEN 'permanent' END
FROM receipts r
"""

SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0), count(*)
FROM pg_partition_tree(CAST(:table AS regclass)) WHERE isleaf
"""


def settings(mode: str) -> Settings:
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        secret_key="bench-" + "k" * 32,  # type: ignore[arg-type]
        retention_mode=mode,  # type: ignore[arg-type]
        delete_batch_size=10_000,
    )


def drop_database() -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}"')


def insert(engine: Engine, rows: int, *, with_payload: bool) -> float:
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(
            text(INSERT),
            {
                "ttl": TTL,
                "with_payload": with_payload,
                "rows": rows,
                "start": T0 + timedelta(days=1),
                "spread": timedelta(days=SPREAD_DAYS),
            },
        )
    return time.perf_counter() - started


def insert_deliveries(engine: Engine, *, held: bool, dead_at: datetime) -> float:
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text(DELIVERIES), {"held": held, "dead_at": dead_at})
    return time.perf_counter() - started


def vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE receipts"))
        conn.execute(text("VACUUM ANALYZE deliveries"))


def size(engine: Engine, table: str = "receipts") -> tuple[int, int]:
    with engine.connect() as conn:
        total, leaves = conn.execute(text(SIZE), {"table": table}).one()
    return int(total), int(leaves)


def count(engine: Engine, table: str = "receipts") -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def held_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM deliveries WHERE status IN ('retrying', 'dead')")
            ).scalar_one()
        )


def truncate(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE receipts, deliveries, attempts"))


def held_scan_plan(engine: Engine, now: datetime) -> str:
    """How the hold step finds a day's held deliveries (EXPLAIN of the production statement on
    one leaf): the partial indexes, not a scan of the day."""
    with engine.connect() as conn:
        # A day in the middle of the spread: a full one.
        day = (T0 + timedelta(days=SPREAD_DAYS // 2)).date()
        leaf = partitions.partition_name("deliveries", day)
        sql = retention._HELD_SQL.format(deliveries=leaf)  # noqa: SLF001 (the statement itself)
        plan = conn.execute(
            text(f"EXPLAIN (FORMAT JSON) {sql}"),
            {"now": now, "retention": timedelta(days=30), "hold_end": now + timedelta(days=1)},
        ).scalar_one()
    scans: list[str] = []

    def walk(node: dict[str, object]) -> None:
        kind = str(node.get("Node Type"))
        if "Scan" in kind and kind not in ("CTE Scan", "Subquery Scan"):
            index = node.get("Index Name")
            scans.append(
                f"{kind} on {index}" if index else f"{kind} on {node.get('Relation Name')}"
            )
        for child in node.get("Plans", []):  # type: ignore[attr-defined]
            walk(child)

    walk(plan[0]["Plan"])
    return "; ".join(sorted(set(scans)))


def expire_case(
    engine: Engine, part: Settings, delete: Settings, rows: int, after: datetime, *, held: bool,
    say: Callable[[str], None],
) -> tuple[float, float]:  # fmt: skip
    """Fill both layouts with the same receipts and deliveries and expire them; returns
    (partition drop seconds, batched delete seconds)."""
    dead_at = after - timedelta(days=1)
    label = "1% held" if held else "all succeeded"

    truncate(engine)
    with engine.begin() as conn:  # partition mode only: no DEFAULT partition
        for table in ("attempts", "deliveries", "receipts"):
            conn.execute(text(f"DROP TABLE IF EXISTS {table}_default"))
    ensure_partitions(engine, part, T0)
    insert(engine, rows, with_payload=False)
    insert_deliveries(engine, held=held, dead_at=dead_at)
    vacuum(engine)
    expected_held = held_count(engine)
    if not held:
        say(f"   hold scan of a day (EXPLAIN): {held_scan_plan(engine, after)}")
    started = time.perf_counter()
    expiry = expire_partitions(engine, part, after)
    drop_seconds = time.perf_counter() - started
    left = count(engine), count(engine, "deliveries")
    assert left == (expected_held, expected_held), f"partition drop kept {left}"
    assert expiry.holds.receipts == expected_held

    truncate(engine)
    with engine.begin() as conn:
        for p in partitions.list_partitions(conn):
            partitions.drop(conn, p)
        partitions.create_default(conn)
    insert(engine, rows, with_payload=False)
    insert_deliveries(engine, held=held, dead_at=dead_at)
    vacuum(engine)
    started = time.perf_counter()
    counts = delete_expired(engine, delete, after)
    delete_seconds = time.perf_counter() - started
    left = count(engine), count(engine, "deliveries")
    assert left == (expected_held, expected_held), f"batched delete kept {left}"
    assert counts.holds.receipts == expected_held
    started = time.perf_counter()
    vacuum(engine)  # the dead tuples a delete leaves; a dropped partition leaves none
    vacuum_seconds = time.perf_counter() - started
    with engine.begin() as conn:
        for p in partitions.list_partitions(conn):
            partitions.drop(conn, p)

    say(f"   {label}: {rows:,} receipts + {rows:,} deliveries, {expected_held:,} of them held")
    say(
        f"     partition drop : {drop_seconds:8.3f} s  ({len(expiry.dropped)} partitions dropped,"
        f" {expiry.holds.receipts:,} held receipts moved with"
        f" {expiry.holds.moved['deliveries']:,} deliveries; one transaction)"
    )
    stmts = sum(counts.statements.values())
    say(
        f"     batched delete : {delete_seconds:8.3f} s  ({counts.rows['receipts']:,} receipts and"
        f" {counts.rows['deliveries']:,} deliveries in {stmts} statements of <= 10,000;"
        f" {counts.holds.receipts:,} held moved)"
    )
    say(f"     ratio delete / drop: {delete_seconds / drop_seconds:,.1f}x")
    say(f"     the VACUUM the delete leaves behind: {vacuum_seconds:.3f} s more")
    return drop_seconds, delete_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results_retention.txt")))
    args = parser.parse_args()
    rows: int = args.rows
    after = T0 + timedelta(days=SPREAD_DAYS + 2)  # every generated receipt has expired

    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    drop_database()
    part = settings("partition")
    upgrade(part)
    engine = make_engine(part, pool_size=1)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
        say(f"retention benchmark, {rows:,} receipts per measurement")
        say(f"PostgreSQL {version}, Python {platform.python_version()}, {os.cpu_count()} CPUs")
        say("")

        # Partition mode: replace the layout made at the real date by the synthetic days.
        drop_expired_partitions(engine, part, T0 - timedelta(days=2))
        ensure_partitions(engine, part, T0)

        say("1. bytes per row (table + indexes, all partitions)")
        seconds = insert(engine, rows, with_payload=False)
        insert_deliveries(engine, held=False, dead_at=T0)
        vacuum(engine)
        compact, leaves = size(engine)
        delivery_bytes, _ = size(engine, "deliveries")
        say(
            f"   inserted {count(engine):,} compact receipts in {seconds:.1f} s ({leaves} partitions)"
        )
        say(
            f"   without payload: {compact / rows:8.1f} bytes/receipt  ({compact / 2**20:,.1f} MiB)"
        )
        say(f"   one delivery row: {delivery_bytes / rows:7.1f} bytes/delivery (succeeded)")
        truncate(engine)
        seconds = insert(engine, rows, with_payload=True)
        vacuum(engine)
        with_payload, _ = size(engine)
        say(f"   inserted {rows:,} receipts with a 1 KB payload in {seconds:.1f} s")
        say(
            f"   with 1 KB payload: {with_payload / rows:7.1f} bytes/receipt  ({with_payload / 2**20:,.1f} MiB)"
        )
        say(
            f"   payload overhead: {(with_payload - compact) / rows:.1f} bytes/receipt for 1,024 bytes of body"
        )
        started = time.perf_counter()
        drop_expired_partitions(engine, part, after)
        drop_payload_seconds = time.perf_counter() - started
        say(f"   (partition drop of the 1 KB-payload set: {drop_payload_seconds:.3f} s)")
        say("")

        delete = settings("delete")
        say(f"2. expiring {rows:,} compact receipts, hold step included")
        ratios = []
        for held in (False, True):
            drop_s, delete_s = expire_case(engine, part, delete, rows, after, held=held, say=say)
            ratios.append(delete_s / drop_s)
        say(
            f"   ratio delete / drop: {ratios[0]:,.1f}x all succeeded, {ratios[1]:,.1f}x with 1% held"
        )
        say("")
        say("capacity: bytes = events_per_day x retention_days x bytes_per_receipt")
        for per_day in (100_000, 1_000_000):
            days = TTL.total_seconds() / 86400
            gib = per_day * days * compact / rows / 2**30
            gib_payload = per_day * days * with_payload / rows / 2**30
            say(
                f"   {per_day:>9,} events/day x {days:.3f} days (Stripe default TTL): "
                f"{gib:6.2f} GiB compact, {gib_payload:6.2f} GiB if every body were kept"
            )
    finally:
        engine.dispose()
        drop_database()

    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    Path(args.out).write_text(
        f"# bench/bench_retention.py, run {stamp}\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()

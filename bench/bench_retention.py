"""Retention benchmark: bytes per receipt, and expiry by partition drop versus batched delete.

    .venv/bin/python bench/bench_retention.py [--rows 1000000] [--out bench/results_retention.txt]

Works in its own scratch database (``webhooks_bench_retention``, created from the migrations,
dropped at the end). Rows are generated server-side with ``INSERT ... SELECT generate_series``
and shaped like real receipts: 10 sources, 28-character event ids (``evt_`` + 24 hex chars,
Stripe's length), a SHA-256 digest, timestamps, a content type; expires_at spread evenly over
ten days (ten daily partitions).

1. bytes per receipt, table plus indexes (``pg_total_relation_size`` summed over the
   partitions, after VACUUM so the free-space and visibility maps are counted), without a
   payload and with a 1 KB payload;
2. time to expire the same one million compact receipts by the two mechanisms, measured with
   the production functions: :func:`models.retention.drop_expired_partitions` (partition
   mode) and :func:`models.retention.delete_expired` (delete mode: the DEFAULT partition
   with its expires_at index, 10,000 rows per statement). The ratio is delete / drop.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
from sqlalchemy import Engine, text

from models import partitions
from models.db import make_engine, upgrade
from models.retention import delete_expired, drop_expired_partitions, ensure_partitions
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

SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0), count(*)
FROM pg_partition_tree('receipts') WHERE isleaf
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


def vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE receipts"))


def size(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        total, leaves = conn.execute(text(SIZE)).one()
    return int(total), int(leaves)


def count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM receipts")).scalar_one())


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

        say("1. bytes per receipt (table + indexes, all partitions)")
        seconds = insert(engine, rows, with_payload=False)
        vacuum(engine)
        compact, leaves = size(engine)
        say(
            f"   inserted {count(engine):,} compact receipts in {seconds:.1f} s ({leaves} partitions)"
        )
        say(
            f"   without payload: {compact / rows:8.1f} bytes/receipt  ({compact / 2**20:,.1f} MiB)"
        )

        started = time.perf_counter()
        dropped = drop_expired_partitions(engine, part, after)
        drop_seconds = time.perf_counter() - started
        assert count(engine) == 0, "partition drop left rows behind"

        ensure_partitions(engine, part, T0)
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
        say("")

        # Delete mode: the same compact receipts in the DEFAULT partition.
        delete = settings("delete")
        with engine.begin() as conn:
            partitions.create_default(conn)
        seconds = insert(engine, rows, with_payload=False)
        vacuum(engine)
        say(f"2. expiring {rows:,} compact receipts")
        say(f"   (delete-mode layout filled in {seconds:.1f} s)")
        started = time.perf_counter()
        counts = delete_expired(engine, delete, after, tables=("receipts",))
        delete_seconds = time.perf_counter() - started
        assert count(engine) == 0, "batched delete left rows behind"
        say(
            f"   partition drop  : {drop_seconds:8.3f} s  ({len(dropped)} partitions of receipts,"
            " deliveries, attempts; one transaction)"
        )
        say(
            f"   batched delete  : {delete_seconds:8.3f} s  ({counts.rows['receipts']:,} rows in "
            f"{counts.statements['receipts']} statements of <= 10,000)"
        )
        say(f"   ratio delete / drop: {delete_seconds / drop_seconds:,.0f}x")
        started = time.perf_counter()
        vacuum(engine)  # the dead tuples a delete leaves; a dropped partition leaves none
        say(f"   the VACUUM the delete leaves behind: {time.perf_counter() - started:.3f} s more")
        say(f"   (partition drop of the 1 KB-payload set: {drop_payload_seconds:.3f} s)")
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

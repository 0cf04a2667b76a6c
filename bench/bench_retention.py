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
   :func:`models.retention_expiry.expire_partitions` (partition mode) and
   :func:`models.retention.delete_expired` (delete mode: the DEFAULT partitions with their
   expires_at index, 10,000 rows per statement). The ratio is delete / drop. Twice: with
   every delivery succeeded, and with 1% of them held (0.5% retrying, 0.5% dead within the
   dead-letter retention), which both mechanisms must keep, moving them forward.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
from sqlalchemy import Engine, text

from core.settings import Settings
from models import partitions, retention_expiry, retention_holds
from models.db import make_engine, upgrade
from models.retention import delete_expired
from models.retention_expiry import drop_expired_partitions, expire_partitions
from models.retention_holds import database_now
from models.retention_layout import ensure_partitions

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
# day before the expiry run (within the 30-day dead-letter retention), or (filtered) 9 in 10
# kept from their work by the route's filter at the accept (attempt 0: their ledger rows are
# appended by the statement that deletes them at expiry, migration 0035).
DELIVERIES = """
INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status, attempts,
                        next_attempt_at, created_at, updated_at, succeeded_at, dead_at,
                        dead_reason)
SELECT r.expires_at, r.id, r.source_id, r.source_id,
       CASE WHEN :held AND r.id % 200 = 0 THEN 'retrying'
            WHEN :held AND r.id % 200 = 1 THEN 'dead'
            WHEN :filtered AND r.id % 10 <> 0 THEN 'filtered'
            ELSE 'succeeded' END,
       CASE WHEN :filtered AND r.id % 10 <> 0 THEN 0 ELSE 1 END,
       r.received_at + interval '1 minute', r.received_at, r.received_at + interval '1 second',
       CASE WHEN :held AND r.id % 200 IN (0, 1) THEN NULL
            WHEN :filtered AND r.id % 10 <> 0 THEN NULL
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
        secret_key="bench-" + "k" * 32,
        retention_mode=mode,
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


def insert_deliveries(
    engine: Engine, *, held: bool, dead_at: datetime, filtered: bool = False
) -> float:
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text(DELIVERIES), {"held": held, "dead_at": dead_at, "filtered": filtered})
    return time.perf_counter() - started


def lay_out(engine: Engine, part: Settings) -> None:
    """The synthetic days' partitions: maintenance's layout from T0 (as far ahead as the
    sources' TTLs ask, which no longer reaches the spread's last days), and every day the
    receipts spread over."""
    ensure_partitions(engine, part, T0)
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        for n in range(-1, SPREAD_DAYS + 2):
            partitions.create_day(conn, (T0 + timedelta(days=n)).date())


def ledger_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM ledger")).scalar_one())


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
        sql = retention_holds.HELD_SQL.format(  # noqa: SLF001 (the statement itself)
            deliveries=leaf,
            hold_until=retention_holds.HOLD_UNTIL,  # noqa: SLF001
        )
        plan = conn.execute(
            text(f"EXPLAIN (FORMAT JSON) {sql}"),
            {
                "now": now,
                "retention": timedelta(days=30),
                "step": retention_holds.HOLD_STEP,
                "after": 0,
                "batch": retention_holds.MOVE_BATCH,
            },
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
    say: Callable[[str], None], filtered: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """Fill both layouts with the same receipts and deliveries and expire them; returns
    (partition drop seconds, batched delete seconds). ``filtered``: 90% of the deliveries
    filtered at the accept, each of which must leave one ledger row in both modes."""
    dead_at = after - timedelta(days=1)
    label = "90% filtered" if filtered else "1% held" if held else "all succeeded"
    want_ledger = rows - rows // 10 if filtered else 0

    truncate(engine)
    with engine.begin() as conn:  # partition mode only: no DEFAULT partition
        for table in ("attempts", "deliveries", "receipts"):
            conn.execute(text(f"DROP TABLE IF EXISTS {table}_default"))
    lay_out(engine, part)
    insert(engine, rows, with_payload=False)
    insert_deliveries(engine, held=held, dead_at=dead_at, filtered=filtered)
    vacuum(engine)
    expected_held = held_count(engine)
    ledger_before = ledger_rows(engine)
    if not held and not filtered:
        say(f"   hold scan of a day (EXPLAIN): {held_scan_plan(engine, after)}")
    started = time.perf_counter()
    expiry = expire_partitions(engine, part, after)
    drop_seconds = time.perf_counter() - started
    left = count(engine), count(engine, "deliveries")
    assert left == (expected_held, expected_held), f"partition drop kept {left}"
    assert expiry.holds.receipts == expected_held
    assert ledger_rows(engine) - ledger_before == want_ledger, "partition drop's ledger rows"

    truncate(engine)
    with engine.begin() as conn:
        for p in partitions.list_partitions(conn):
            partitions.drop(conn, p)
        partitions.create_default(conn)
    insert(engine, rows, with_payload=False)
    insert_deliveries(engine, held=held, dead_at=dead_at, filtered=filtered)
    vacuum(engine)
    ledger_before = ledger_rows(engine)
    started = time.perf_counter()
    counts = delete_expired(engine, delete, after)
    delete_seconds = time.perf_counter() - started
    left = count(engine), count(engine, "deliveries")
    assert left == (expected_held, expected_held), f"batched delete kept {left}"
    assert counts.holds.receipts == expected_held
    assert ledger_rows(engine) - ledger_before == want_ledger, "batched delete's ledger rows"
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


def capacity(args: argparse.Namespace) -> None:
    """``--capacity``: bytes per row, and expiry by partition drop versus batched delete."""
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
        lay_out(engine, part)

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
        ratios, drops = [], []
        for held, filtered in ((False, False), (True, False), (False, True)):
            drop_s, delete_s = expire_case(
                engine, part, delete, rows, after, held=held, say=say, filtered=filtered
            )
            ratios.append(delete_s / drop_s)
            drops.append(drop_s)
        say(
            f"   ratio delete / drop: {ratios[0]:,.1f}x all succeeded, {ratios[1]:,.1f}x with 1% held,"
            f" {ratios[2]:,.1f}x with 90% filtered"
        )
        say(
            f"   90% filtered against all succeeded: the drop {drops[2] / drops[0]:,.1f}x (its"
            " filtered deliveries deleted first, each appending its ledger row)"
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


# ----------------------------------------------------------------------------------------
# The drop under load (issue 19): a day of receipts, 1% held, dropped while a real receiver
# accepts at a fixed rate.
# ----------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PORT = 18931
LOAD_SECONDS = 14.0
DROP_AT = 4.0  # seconds into the load


def bench_env(broker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.update(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        WEBHOOKS_BROKER_URL=broker,
        WEBHOOKS_REDIS_URL=broker,
        WEBHOOKS_SECRET_KEY="bench-secret-key-" + "b" * 32,
        WEBHOOKS_LOG_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    return env


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "webhooks"), *args], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout


# The day to drop: receipts spread over it, one delivery and one attempt each. Held: 1 in 200
# retrying (due in three days) and 1 in 200 dead a day ago (within the 30-day retention).
FILL_DAY = """
WITH r AS (
    INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at,
                          received_at, body_digest, content_type, payload)
    SELECT :source, 'evt_' || :tag || '_' || i, :lo + (i - 1) * (:span / :rows),
           'invoice.paid', NULL, :lo + (i - 1) * (:span / :rows) - :ttl,
           sha256(convert_to(i::text, 'UTF8')), 'application/json',
           convert_to(repeat(md5(i::text), 8), 'UTF8')
    FROM generate_series(1, :rows) AS i
    RETURNING id, expires_at, received_at
), d AS (
    INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status, attempts,
                            next_attempt_at, created_at, updated_at, succeeded_at, dead_at,
                            dead_reason)
    SELECT r.expires_at, r.id, :source, :route,
           CASE WHEN :held AND r.id % 200 = 0 THEN 'retrying'
                WHEN :held AND r.id % 200 = 1 THEN 'dead' ELSE 'succeeded' END,
           1,
           CASE WHEN :held AND r.id % 200 = 0 THEN now() + interval '3 days' END,
           r.received_at, r.received_at,
           CASE WHEN :held AND r.id % 200 IN (0, 1) THEN NULL ELSE r.received_at END,
           CASE WHEN :held AND r.id % 200 = 1 THEN now() - interval '1 day' END,
           CASE WHEN :held AND r.id % 200 = 1 THEN 'permanent' END
    FROM r
    RETURNING id, expires_at, created_at, status
)
INSERT INTO attempts (expires_at, delivery_id, number, worker, started_at, ended_at, outcome)
SELECT expires_at, id, 1, 'bench', created_at, created_at,
       CASE status WHEN 'succeeded' THEN 'succeeded' WHEN 'dead' THEN 'dead' ELSE 'retry' END
FROM d
"""


def fill_day(engine: Engine, day: date, rows: int, *, held: bool, ids: tuple[int, int]) -> int:
    """Lay out ``day`` and fill it; returns the held receipts in it."""
    lo, hi = partitions.day_bounds(day)
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        partitions.create_day(conn, day)
        conn.execute(
            text(FILL_DAY),
            {
                "source": ids[0],
                "route": ids[1],
                "tag": f"{day:%Y%m%d}{'h' if held else 's'}",
                "lo": lo,
                "span": hi - lo - timedelta(seconds=1),
                "rows": rows,
                "ttl": TTL,
                "held": held,
            },
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("receipts", "deliveries", "attempts"):
            conn.execute(text(f"VACUUM ANALYZE {partitions.partition_name(table, day)}"))
    return rows // 100 if held else 0


def load(url: str, secret: str, rate: int, seconds: float, out: Any) -> None:
    """The load generator (its own process): ``rate`` signed accepts per second, open loop,
    each request's latency measured from when it was due (no coordinated omission)."""
    import asyncio  # noqa: PLC0415

    import httpx  # noqa: PLC0415
    from standardwebhooks.webhooks import Webhook  # noqa: PLC0415

    wh = Webhook(secret)
    results: list[tuple[float, float, int]] = []

    async def one(client: httpx.AsyncClient, due: float, start: float) -> None:
        event_id = f"msg_{uuid.uuid4().hex}"
        now = datetime.now(UTC)
        body = orjson.dumps({"type": "invoice.paid", "data": {"id": event_id}}).decode()
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": wh.sign(event_id, now, body),
            "content-type": "application/json",
        }
        try:
            response = await client.post(url, content=body, headers=headers, timeout=30)
            code = response.status_code
        except httpx.HTTPError:
            code = 0
        results.append((due - start, time.perf_counter() - due, code))

    async def run() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            start = time.perf_counter()
            tasks = []
            for n in range(int(rate * seconds)):
                due = start + n / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(client, due, start)))
            await asyncio.gather(*tasks)

    asyncio.run(run())
    out.send(results)
    out.close()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def under_load(
    url: str, secret: str, rate: int, action: Callable[[], Any] | None
) -> tuple[list[tuple[float, float, int]], float, float, Any]:
    """Run the load; ``action`` (the drop) starts DROP_AT seconds in. Returns the samples,
    the action's window (seconds from the load's start) and its result."""
    ctx = multiprocessing.get_context("spawn")
    receiving, sending = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=load, args=(url, secret, rate, LOAD_SECONDS, sending))
    proc.start()
    started = time.perf_counter()
    time.sleep(DROP_AT)
    begin = time.perf_counter() - started
    result = action() if action is not None else None
    end = time.perf_counter() - started
    samples: list[tuple[float, float, int]] = receiving.recv()
    proc.join()
    return samples, begin, end, result


def window_p99(samples: list[tuple[float, float, int]], begin: float, end: float) -> float:
    """p99 of the accepts due while the drop ran (at least one second of them)."""
    end = max(end, begin + 1.0)
    return p99([latency for due, latency, _ in samples if begin <= due <= end])


def accept_plan(engine: Engine, source: int, secret_id: str) -> list[str]:
    """The accept's live-receipt probe, as Postgres runs it (auto_explain of the function's
    statement): which receipts partitions it opens."""
    lines: list[str] = []
    url = f"postgresql://postgres@127.0.0.1:5432/{DB}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: lines.extend((d.message_primary or "").splitlines()))
        conn.execute("LOAD 'auto_explain'")
        for setting in (
            "auto_explain.log_min_duration = 0",
            "auto_explain.log_nested_statements = on",
            "auto_explain.log_analyze = on",
            "auto_explain.log_timing = off",
            "auto_explain.log_level = 'notice'",
            "client_min_messages = 'notice'",
        ):
            conn.execute(f"SET {setting}")
        conn.execute(
            "SELECT * FROM webhooks_accept(%s, %s, 'evt_plan', 'invoice.paid', NULL,"
            " now() + interval '6 days', NULL, '\\x00', NULL, '\\x00', interval '1 s',"
            " interval '6 days')",
            (source, secret_id),
        )
    opened = sorted({w for line in lines for w in line.split() if w.startswith("receipts_p")})
    opened = [w for w in opened if not w.endswith("_pkey")]
    removed = [line.strip() for line in lines if "Subplans Removed" in line]
    summary = (
        f"opens {len(opened)} receipts partitions ({opened[0]} .. {opened[-1]})"
        if opened
        else "opens no receipts partition"
    )
    return [summary, *removed, *opened]


def probe_plans(engine: Engine) -> list[str]:
    """The workers' probe by id, as it is and with the bound it could carry."""
    out = []
    floor = "date_trunc('day', now(), 'UTC') - interval '1 day'"
    for label, extra in (("as is", ""), ("with the floor", f" AND d.expires_at >= {floor}")):
        with engine.connect() as conn:
            plan = conn.execute(
                text(
                    "EXPLAIN (ANALYZE, TIMING OFF, COSTS OFF, SUMMARY OFF)"
                    " SELECT d.generation, d.expires_at FROM deliveries d"
                    f" WHERE d.id = 1{extra}"
                )
            ).scalars()
            body = list(plan)
        scans = sum(1 for line in body if "Scan" in line)
        removed = [line.strip() for line in body if "Subplans Removed" in line]
        out.append(f"   probe by id, {label}: {scans} partition scans {' '.join(removed)}")
    return out


def expiries_of(engine: Engine, tag: str) -> dict[int, datetime]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, expires_at FROM receipts WHERE event_id LIKE :t"), {"t": f"evt_{tag}%"}
        ).all()
    return {int(r[0]): r[1] for r in rows}


def drop_under_load(args: argparse.Namespace) -> None:
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    drop_database()
    env = bench_env(args.redis)
    cli(env, "db", "upgrade")
    view = orjson.loads(cli(env, "sources", "add", "bench", "--provider", "standard", "--json"))
    cli(env, "routes", "add", view["id"], "--handler", "log")
    part = Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        secret_key="bench-secret-key-" + "b" * 32,
    )
    engine = make_engine(part, pool_size=2)
    log = Path(tempfile.mkdtemp(prefix="bench-retention-")) / "receiver.log"
    receiver = subprocess.Popen(  # noqa: S603
        [str(BIN / "webhooks"), "serve", "--port", str(PORT), "--workers", "1"],
        env={**env, "WEBHOOKS_ADMIN_PORT": str(PORT + 1)},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
            source, route, secret_id = conn.execute(
                text(
                    "SELECT s.id, r.id, ss.id FROM sources s JOIN routes r ON r.source_id = s.id"
                    " JOIN source_secrets ss ON ss.source_id = s.id"
                )
            ).one()
            today = conn.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()
        ids = (int(source), int(route))
        url = f"http://127.0.0.1:{PORT}/webhooks/{view['id']}"
        wait_listening(receiver, log)
        say(f"retention drop under load: a day of {args.day:,} receipts (one delivery and one")
        say(f"attempt each), dropped while a real receiver takes {args.rate} accepts/s")
        say(f"PostgreSQL {version}, Python {platform.python_version()}, {os.cpu_count()} CPUs,")
        say(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        say("")
        day = today - timedelta(days=2)  # wholly past on the database's clock

        def drop() -> tuple[float, retention_expiry.Expiry]:
            started = time.perf_counter()
            expiry = expire_partitions(engine, part, None)
            return time.perf_counter() - started, expiry

        last_run = partitions.day_bounds(day)[1] - timedelta(minutes=10)

        def day_runs() -> tuple[float, retention_expiry.Expiry]:
            """The day's last run before midnight (maintenance runs every 10 minutes):
            every held row expired by then moves; the day is not past yet."""
            started = time.perf_counter()
            expiry = expire_partitions(engine, part, last_run)
            return time.perf_counter() - started, expiry

        # Warm up the receiver and its pool; then the baseline (no drop).
        under_load(url, view["secret"], args.rate, None)
        held = fill_day(engine, day, args.day, held=True, ids=ids)
        before = expiries_of(engine, f"{day:%Y%m%d}h")
        say("1. plans while the day waits to be dropped")
        leaf = partitions.partition_name("receipts", day)
        plan = accept_plan(engine, ids[0], secret_id)
        say(f"   accept (auto_explain of webhooks_accept): {plan[0]}")
        say(f"   the past day's {leaf} opened by the accept: {any(leaf in x for x in plan)}")
        for line in probe_plans(engine):
            say(line)
        say("")
        base, begin0, _, _ = under_load(url, view["secret"], args.rate, None)
        early, ebegin, eend, (early_s, early_expiry) = under_load(
            url, view["secret"], args.rate, day_runs
        )
        samples, begin, end, (held_s, expiry) = under_load(url, view["secret"], args.rate, drop)
        fill_day(engine, day, args.day, held=False, ids=ids)
        expire_partitions(engine, part, last_run)
        clean, _, _, (clean_s, clean_expiry) = under_load(url, view["secret"], args.rate, drop)
        after = expiries_of(engine, f"{day:%Y%m%d}h")
        later = database_now(engine) + timedelta(days=1)
        second = expire_partitions(engine, part, later)
        again = expiries_of(engine, f"{day:%Y%m%d}h")

        p99_base = window_p99(base, begin0, begin0 + (end - begin))
        p99_drop = window_p99(samples, begin, end)
        p99_early = window_p99(early, ebegin, eend)
        errors = sum(1 for s in (*base, *early, *samples, *clean) if s[2] != 202)
        say("2. accept latency (open loop, from when each request was due)")
        window = max(end - begin, 1.0)
        say(f"   no drop        : p99 {p99_base * 1000:7.1f} ms  (accepts due in a {window:.2f} s")
        say("                    window at the same offset; the drop's own window below)")
        say(
            f"   during the drop: p99 {p99_drop * 1000:7.1f} ms  (the drop ran {end - begin:.2f} s;"
        )
        say(
            f"                    {len(samples):,} accepts in the run; non-202 in all runs: {errors})"
        )
        ratio = p99_drop / p99_base
        say(f"   ratio {ratio:.2f}x (floor <= 2x): {'met' if ratio <= 2 else 'NOT MET'}")
        say(f"   during the day's last run of moves: p99 {p99_early * 1000:.1f} ms"
            f" ({p99_early / p99_base:.2f}x; window of {eend - ebegin:.2f} s)")  # fmt: skip
        say("")
        say("3. the drop")
        say(f"   the day's last run before midnight moved {early_expiry.holds.receipts:,} of"
            f" {held:,} held receipts in {early_s:.3f} s")  # fmt: skip
        say(f"   drop, 1% held   : {held_s:7.3f} s  (moved the last {expiry.holds.receipts:,}:"
            f" {dict(expiry.holds.moved)}; dropped {len(expiry.dropped)} partitions)")  # fmt: skip
        say(f"   nothing held    : {clean_s:7.3f} s  (dropped {len(clean_expiry.dropped)})")
        ratio = held_s / clean_s
        say(f"   ratio {ratio:.2f}x (floor <= 1.5x): {'met' if ratio <= 1.5 else 'NOT MET'}")
        total = early_s + held_s
        say(f"   all moves counted in (the last run's and the drop's): {total:.3f} s,"
            f" {total / clean_s:.2f}x the empty drop")  # fmt: skip
        say("")
        changed = sum(1 for k, v in after.items() if before.get(k) != v)
        moved_again = sum(1 for k, v in again.items() if after.get(k) != v)
        say("4. a second drop a day later (database clock + 1 day)")
        say(f"   held receipts moved by the day's runs and its drop: {changed:,} of {len(after):,}")
        say(f"   of those, moved again a day later: {moved_again}"
            f" (second drop moved {second.holds.receipts} held receipts in all)")  # fmt: skip
        say("   dead letters now expire at dead-at + 30 d; retries on their due day")
        say("")
        say(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        receiver.terminate()
        receiver.wait(15)
        engine.dispose()
        drop_database()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    Path(args.out).write_text(
        f"# bench/bench_retention.py, run {stamp}\n" + "\n".join(lines) + "\n"
    )


def wait_listening(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", PORT)) == 0:
                return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the receiver did not start; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="the issue 9 measurements (bytes per row; drop versus delete) instead",
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--day", type=int, default=200_000, help="receipts in the dropped day")
    parser.add_argument("--rate", type=int, default=150, help="accepts per second offered")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13", help="the broker")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.capacity:
        args.out = args.out or str(Path(__file__).with_name("results_retention_capacity.txt"))
        capacity(args)
    else:
        args.out = args.out or str(Path(__file__).with_name("results_retention.txt"))
        drop_under_load(args)


if __name__ == "__main__":
    main()

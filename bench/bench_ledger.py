"""Processed-events ledger benchmark: bytes per event, and what the row costs the success.

    .venv/bin/python bench/bench_ledger.py [--rows 200000] [--timed 3000] \
        [--out bench/results_ledger.txt]

Works in its own scratch database (``webhooks_bench_ledger``, created from the migrations,
dropped at the end). Receipts are generated server-side like bench_retention.py's (10 sources,
28-character event ids: ``evt_`` + 24 hex characters, Stripe's length; a SHA-256 digest; the
event types below), each with one delivery being processed (attempt 1), so that the worker's
real success statements can end them:

1. bytes per event: every delivery ended through :func:`models.transitions.succeed_many`
   (the worker's success of a message, 16 ids a statement, on the day's leaf partitions),
   which writes the ledger rows in the same statement; then ``pg_total_relation_size`` of
   the ledger's partitions (table, index, free-space and visibility maps, after
   VACUUM) / rows, and the average width of each column;
2. the success statement's time with the ledger CTE and without it (the same statement
   built with no ledger row), one delivery a statement (a message of one id, the worker's
   single-row form), alternating the two in blocks of 100 so both see the same load:
   median and p90 per statement as the worker sees it (round trip and synchronous commit
   included), then Postgres's own execution time of each (EXPLAIN ANALYZE). The ledger adds
   work inside the statement, never a round trip.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, text

from core.settings import Settings
from models import ledger_layout, transitions
from models.db import make_engine, upgrade
from models.partitions import leaf_suffix
from models.retention_expiry import drop_expired_partitions
from models.retention_layout import ensure_partitions
from models.transitions import Claim

DB = "webhooks_bench_ledger"
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
T0 = datetime(2030, 1, 10, 12, tzinfo=UTC)  # synthetic "now": far from any real data
TTL = timedelta(days=6, minutes=10)  # Stripe's default dedup TTL
BATCH = 16  # ids a message carries at most (WEBHOOKS_DELIVERY_BATCH's ceiling)
# Stripe's commonest types, 12 to 29 characters (mean 20.3).
TYPES = (
    "invoice.paid",
    "charge.succeeded",
    "customer.updated",
    "payment_intent.succeeded",
    "checkout.session.completed",
    "customer.subscription.updated",
)

RECEIPTS = """
INSERT INTO receipts (source_id, event_id, expires_at, event_type, occurred_at, received_at,
                      body_digest, content_type)
SELECT 1 + i % 10, 'evt_' || substr(md5(:salt || i::text), 1, 24), :expires_at,
       (CAST(:types AS text[]))[1 + i % 6], :received_at - interval '2 seconds',
       :received_at + i * interval '1 millisecond', sha256(convert_to(:salt || i::text, 'UTF8')),
       'application/json'
FROM generate_series(1, :rows) AS i
"""

DELIVERIES = """
INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status, attempts,
                        next_attempt_at, lease_until, created_at, updated_at, first_attempt_at)
SELECT r.expires_at, r.id, r.source_id, r.source_id, 'processing', 1,
       r.received_at + interval '1 hour', r.received_at + interval '1 hour', r.received_at,
       r.received_at, r.received_at
FROM receipts r WHERE r.id > :after
RETURNING id, expires_at, receipt_id, source_id, route_id, created_at
"""

LEDGER_SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0),
       coalesce(sum(pg_relation_size(relid)), 0)
FROM pg_partition_tree('ledger') WHERE isleaf
"""

WIDTHS = """
SELECT avg(pg_column_size(received_at)), avg(pg_column_size(kind)),
       avg(pg_column_size(event_id)), avg(pg_column_size(digest)),
       avg(pg_column_size(outcomes)), avg(pg_column_size(l.*))
FROM ledger l
"""
KINDS = "SELECT count(*), pg_total_relation_size('ledger_kinds') FROM ledger_kinds"


# transitions.succeed's assignments: the production statement, built by the same function.
SUCCESS = (
    "status = 'succeeded', succeeded_at = :now, next_attempt_at = NULL, "
    "last_error = NULL, last_error_class = NULL, result_ref = :result_ref"
)


def settings() -> Settings:
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        secret_key="bench-" + "k" * 32,
    )


def drop_database() -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}"')


def processing(engine: Engine, rows: int, salt: str) -> list[Claim]:
    """``rows`` receipts, each with one delivery being processed: the claims that end them."""
    at = T0 + timedelta(days=1)
    with engine.begin() as conn:
        after = conn.execute(text("SELECT coalesce(max(id), 0) FROM receipts")).scalar_one()
        conn.execute(
            text(RECEIPTS),
            {
                "rows": rows,
                "salt": salt,
                "types": list(TYPES),
                "expires_at": at + TTL,
                "received_at": at,
            },
        )
        found = conn.execute(text(DELIVERIES), {"after": after}).all()
    return [
        Claim(r[0], r[1], r[2], r[3], r[4], 1, 0, 0, r[5], r[5], None, "processing", 0, at)
        for r in found
    ]


def end_all(raw: psycopg.Connection[Any], claims: list[Claim]) -> float:
    """Every claim succeeded through the worker's statement, :data:`BATCH` a statement."""
    leaf = leaf_suffix(claims[0].expires_at, "partition")
    started = time.perf_counter()
    for i in range(0, len(claims), BATCH):
        group = claims[i : i + BATCH]
        won = transitions.succeed_many(raw, [(c, c.at + timedelta(seconds=1)) for c in group],
                                       leaf=leaf)  # fmt: skip
        assert len(won) == len(group)
    return time.perf_counter() - started


def timed(raw: psycopg.Connection[Any], claims: list[Claim], *, with_ledger: bool) -> list[float]:
    """Seconds per success statement, one delivery each (the single-row form)."""
    leaf = leaf_suffix(claims[0].expires_at, "partition")
    final = transitions.ledger.succeeded() if with_ledger else None
    # The statement itself (transitions.succeed's), built with its ledger CTE and without.
    sql = transitions._finish_sql(SUCCESS, leaf, final)  # noqa: SLF001
    out = []
    for c in claims:
        started = time.perf_counter()
        assert raw.execute(sql, params(c)).fetchone() is not None
        out.append(time.perf_counter() - started)
    return out


def params(c: Claim) -> dict[str, Any]:
    return {
        "id": c.id,
        "expires_at": c.expires_at,
        "attempt": 1,
        "generation": 0,
        "now": c.at + timedelta(seconds=1),
        "outcome": "succeeded",
        "error_class": None,
        "error": None,
        "result_ref": None,
    }


def executed(
    raw: psycopg.Connection[Any], claims: list[Claim], *, with_ledger: bool
) -> list[float]:
    """Server-side execution seconds of the same statement (EXPLAIN ANALYZE's Execution Time:
    no planning, no commit, no client): what the ledger row adds inside Postgres."""
    leaf = leaf_suffix(claims[0].expires_at, "partition")
    final = transitions.ledger.succeeded() if with_ledger else None
    sql = transitions._finish_sql(SUCCESS, leaf, final)  # noqa: SLF001 (see timed)
    out = []
    for c in claims:
        plan = raw.execute("EXPLAIN (ANALYZE, TIMING OFF) " + sql, params(c)).fetchall()
        found = re.search(r"Execution Time: ([\d.]+)", "\n".join(r[0] for r in plan))
        assert found is not None
        out.append(float(found.group(1)) / 1e3)
    return out


def per_statement(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9)]
    return f"median {statistics.median(ordered) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms"


def run(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    drop_database()
    s = settings()
    upgrade(s)
    engine = make_engine(s, pool_size=2)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
        say(f"ledger benchmark, {args.rows:,} events through the worker's success statement")
        say(f"PostgreSQL {version}, Python {platform.python_version()}, {os.cpu_count()} CPUs,")
        say(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
        say("")
        drop_expired_partitions(engine, s, T0 - timedelta(days=2))
        ensure_partitions(engine, s, T0)
        ledger_layout.maintain(engine, s, T0)
        claims = processing(engine, args.rows, "a")
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            raw.autocommit = True
            seconds = end_all(raw, claims)
            raw.execute("VACUUM (ANALYZE) ledger")
            total, heap = raw.execute(LEDGER_SIZE).fetchone() or (0, 0)
            widths = raw.execute(WIDTHS).fetchone()
            rows = raw.execute("SELECT count(*) FROM ledger").fetchone()
            kinds = raw.execute(KINDS).fetchone()
        assert widths is not None
        assert rows is not None
        assert kinds is not None
        assert rows[0] == args.rows, rows
        say(
            f"1. bytes per event ({rows[0]:,} ledger rows written in {seconds:.1f} s, {BATCH} a statement)"
        )
        say(
            f"   table + index + maps: {total / args.rows:6.1f} bytes/event  ({total / 2**20:,.1f} MiB)"
        )
        say(
            f"   of which the heap:    {heap / args.rows:6.1f} bytes/event; the index and maps: {(total - heap) / args.rows:.1f}"
        )
        say(
            f"   and ledger_kinds, once: {kinds[0]} kinds (source, type, arrival) in {kinds[1] / 1024:,.0f} KiB"
        )
        names = ("received_at", "kind", "event_id", "digest", "outcomes",
                 "whole row (in memory, 4-byte varlena headers)")  # fmt: skip
        say("   average column widths (pg_column_size):")
        for name, width in zip(names, widths, strict=True):
            say(f"     {name:<46} {float(width):5.1f}")
        say(f"   goal <= 120 bytes/event: {'met' if total / args.rows <= 120 else 'NOT met'}")
        say("")

        # 2. per success statement, with and without the ledger row, in alternating blocks.
        sample = processing(engine, 2 * args.timed, "b")
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            raw.autocommit = True
            warm = processing(engine, 200, "c")
            timed(raw, warm[:100], with_ledger=True)
            timed(raw, warm[100:], with_ledger=False)
            with_l: list[float] = []
            without: list[float] = []
            block = 100
            for i in range(0, len(sample), 2 * block):
                with_l += timed(raw, sample[i : i + block], with_ledger=True)
                without += timed(raw, sample[i + block : i + 2 * block], with_ledger=False)
        say(f"2. one success statement (single-row form, {len(with_l):,} each, alternating blocks)")
        say(f"   with the ledger row:    {per_statement(with_l)}")
        say(f"   without (the same statement, no ledger CTE): {per_statement(without)}")
        extra = statistics.median(with_l) - statistics.median(without)
        say(f"   difference of the medians: {extra * 1e3:.3f} ms; round trips: 1 either way")
        more = processing(engine, 2 * args.timed, "d")
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            raw.autocommit = True
            in_with: list[float] = []
            in_without: list[float] = []
            for i in range(0, len(more), 2 * block):
                in_with += executed(raw, more[i : i + block], with_ledger=True)
                in_without += executed(raw, more[i + block : i + 2 * block], with_ledger=False)
        say("   inside Postgres (EXPLAIN ANALYZE execution time: no planning, commit or client):")
        say(f"   with the ledger row:    {per_statement(in_with)}")
        say(f"   without:                {per_statement(in_without)}")
        extra = statistics.median(in_with) - statistics.median(in_without)
        say(f"   the ledger row's own work: {extra * 1e3:.3f} ms a success (median)")
        say(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    finally:
        engine.dispose()
        drop_database()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--timed", type=int, default=3000, help="successes timed per variant")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results_ledger.txt")))
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    run(args, say)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

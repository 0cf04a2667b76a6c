"""Cost of the measured queue lag (issue 35 item 4): :mod:`models.queue_lag` on a realistic
row count.

    PYTHONPATH=. .venv/bin/python bench/bench_queue_lag.py [--per-day 1000000] [--days 2] \
        [--out bench/results_queue_lag.txt]

Works in its own scratch database (``webhooks_bench_queue_lag``, created from the migrations,
dropped at the end). Rows are generated server-side (``INSERT ... SELECT generate_series``):
``--per-day`` receipts a day over ``--days`` days before now, spread evenly over 4 sources, a
6-day TTL (Stripe's default), one delivery each: 0.1% dead (3 h after arrival), 0.5% of those
older than a day still pending (a backlog, one source's), the rest succeeded within 97 s.

Measures, on the database's clock, each three times: the maintenance read (every source,
:func:`models.queue_lag.measure_sources`) and ``ttl explain``'s (one source,
:func:`models.queue_lag.measure`), and prints the plan's index use.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from sqlalchemy import text

from core.ttl import QUEUE_LAG_WINDOW
from models import queue_lag
from models.db import make_engine, upgrade
from tests.conftest import ADMIN_DSN, make_settings

NAME = "webhooks_bench_queue_lag"

_FILL = """
INSERT INTO sources (public_id, name, provider)
SELECT 'src_bench' || i, 'bench' || i, 'stripe' FROM generate_series(1, 4) i;
INSERT INTO receipts (id, source_id, event_id, expires_at, event_type, received_at, body_digest)
SELECT g, (SELECT min(id) FROM sources) + g % 4, 'evt_' || g,
       now() - (g * interval '1 day' / {per_day}) + interval '6 days', 't',
       now() - (g * interval '1 day' / {per_day}), '\\x00'
FROM generate_series(1, {total}) g;
INSERT INTO deliveries (id, expires_at, receipt_id, source_id, route_id, status, created_at,
                        updated_at, succeeded_at, dead_at, next_attempt_at, attempts)
SELECT r.id, r.expires_at, r.id, r.source_id, 1,
       CASE WHEN r.id % 1000 = 0 THEN 'dead'
            WHEN r.id % 200 = 1 AND r.id > {per_day} THEN 'pending' ELSE 'succeeded' END,
       r.received_at, r.received_at,
       CASE WHEN r.id % 1000 = 0 OR (r.id % 200 = 1 AND r.id > {per_day}) THEN NULL
            ELSE r.received_at + (r.id % 97) * interval '1 second' END,
       CASE WHEN r.id % 1000 = 0 THEN r.received_at + interval '3 hours' END,
       CASE WHEN r.id % 200 = 1 AND r.id > {per_day} THEN now() END, 1
FROM receipts r;
ANALYZE receipts;
ANALYZE deliveries;
"""


def _drop() -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (NAME,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{NAME}"')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-day", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    settings = make_settings(database_url=f"postgresql://postgres@127.0.0.1:5432/{NAME}")
    _drop()
    upgrade(settings)
    engine = make_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
        say(f"# bench/bench_queue_lag.py, run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
        say(f"PostgreSQL {version}, Python {platform.python_version()}")
        total = args.per_day * args.days
        started = time.perf_counter()
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            conn.execute(_FILL.format(per_day=args.per_day, total=total))  # type: ignore[arg-type]
        say(
            f"filled {total:,} receipts and deliveries ({args.per_day:,} a day, {args.days} days)"
            f" in {time.perf_counter() - started:.1f} s"
        )
        with engine.connect() as conn:
            for run in range(3):
                started = time.perf_counter()
                lags = queue_lag.measure_sources(conn, None, QUEUE_LAG_WINDOW)
                took = time.perf_counter() - started
                shown = ", ".join(
                    f"{lag.public_id} p99 {lag.measured.p99} ({lag.measured.deliveries:,})"
                    for lag in lags
                )
                say(f"every source, run {run + 1}: {took:.2f} s  [{shown}]")
            one = lags[0].source_id
            for run in range(3):
                started = time.perf_counter()
                queue_lag.measure(conn, None, QUEUE_LAG_WINDOW, one)
                say(
                    f"one source (ttl explain), run {run + 1}: {time.perf_counter() - started:.2f} s"
                )
            plan = conn.execute(
                text("EXPLAIN " + str(queue_lag.ALL_SOURCES.text)),
                {"now": None, "window": QUEUE_LAG_WINDOW},
            ).scalars()
            # Index names without the day: each daily partition has its own copy.
            used = {
                re.sub(r"_p\d{8}", "", name) for name in re.findall(r"using (\S+)", "\n".join(plan))
            }
            say("indexes the plan uses (each partition's copy): " + "; ".join(sorted(used)))
    finally:
        engine.dispose()
        _drop()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

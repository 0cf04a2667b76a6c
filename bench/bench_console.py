"""Console benchmark (issue 21): the operator console's heaviest pages through its HTTP server,
with 1,000,000 receipts and 1,000,000 deliveries in the database, 10,000 of them dead.

Seeding is set-based (``generate_series``): receipts spread over the last 3 days across
``--sources`` sources, one delivery each on the source's route; every 100th delivery dead,
the rest succeeded. Then the admin plane (``ingest.admin.AdminServer``, the server
``webhooks serve`` runs) starts in this process, a session logs in, and:

  events    GET /console/events?source=S&status=dead|succeeded (the first page, 50 rows)
  preview   POST /console/dead/preview, all dead letters matching source=S (the count and
            sample of a bulk replay)
  delivery  GET /console/deliveries/ID (random ids: dead and succeeded)
  overview  GET /console/ and /console/?source=S (the counts per route over an hour and a
            day, and, from session 19, the charts of the last hour and day)
  routes    GET /console/routes and /console/routes?q=bench-1 (from session 24: a page of
            sources with their routes' forms; ``--sources`` sets how many there are)

``--events 0`` leaves out what reads events (the events list, the preview, a delivery, the
statements' plans): with many ``--sources``, the first one holds too few for 50 rows.

Targets: events p95 <= 200 ms, preview <= 500 ms, delivery p95 <= 100 ms. The plans of the
statements behind each page (captured while the page's query functions run) are printed
with EXPLAIN (ANALYZE, BUFFERS).

Usage: .venv/bin/python bench/bench_console.py [--receipts 1000000] [--requests 40]
Uses its own database (dropped after unless --keep).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import event, text  # noqa: E402

from core.crypto import SecretBox  # noqa: E402
from core.settings import Settings  # noqa: E402
from ingest.admin import AdminServer  # noqa: E402
from models import catalog, queries, route_catalog  # noqa: E402
from models import console as reads  # noqa: E402
from models.candidates import ReplayFilter  # noqa: E402
from models.db import make_engine, make_sessionmaker, upgrade  # noqa: E402
from models.queries import EventFilter  # noqa: E402

DB = "webhooks_bench_console"
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TOKEN = "bench_console_token_" + "x" * 24


def settings(port: int) -> Settings:
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        broker_url="redis://127.0.0.1:6379/0",
        redis_url="redis://127.0.0.1:6379/0",
        secret_key="bench-secret-key-" + "k" * 32,
        admin_tokens=f"bench:{TOKEN}",
        admin_port=port,
        environment="test",
    )


SEED_RECEIPTS = """
INSERT INTO receipts (id, source_id, event_id, expires_at, event_type, occurred_at,
                      received_at, body_digest, content_type, payload)
SELECT g, s.ids[1 + g % s.n], 'evt_bench_' || g,
       now() - (g * interval '259 ms') + interval '6 days',
       (ARRAY['invoice.paid','invoice.failed','order.created','order.shipped'])[1 + g % 4],
       now() - (g * interval '259 ms'), now() - (g * interval '259 ms'),
       sha256(('b' || g)::bytea), 'application/json',
       convert_to('{"id":"evt_bench_' || g || '","n":' || g || '}', 'UTF8')
FROM generate_series(1, :n) AS g,
     (SELECT array_agg(id ORDER BY id) AS ids, count(*)::int AS n FROM sources) AS s
"""

SEED_DELIVERIES = """
INSERT INTO deliveries (id, expires_at, receipt_id, source_id, route_id, status, attempts,
                        last_error_class, last_error, dead_reason, dead_at, created_at,
                        updated_at, first_attempt_at, succeeded_at)
SELECT r.id, r.expires_at, r.id, r.source_id, rt.id,
       CASE WHEN r.id % 100 = 0 THEN 'dead' ELSE 'succeeded' END, 1,
       CASE WHEN r.id % 100 = 0 THEN 'PermanentError' END,
       CASE WHEN r.id % 100 = 0 THEN 'downstream answered HTTP 410' END,
       CASE WHEN r.id % 100 = 0 THEN 'http_rejected' END,
       CASE WHEN r.id % 100 = 0 THEN r.received_at END,
       r.received_at, r.received_at, r.received_at,
       CASE WHEN r.id % 100 = 0 THEN NULL ELSE r.received_at END
FROM receipts r JOIN routes rt ON rt.source_id = r.source_id
"""

SEED_ATTEMPTS = """
INSERT INTO attempts (expires_at, delivery_id, number, worker, started_at, ended_at, outcome,
                      error_class, error_message)
SELECT d.expires_at, d.id, 1, 'bench:1', d.created_at, d.created_at + interval '40 ms',
       CASE WHEN d.status = 'dead' THEN 'dead' ELSE 'succeeded' END,
       d.last_error_class, d.last_error
FROM deliveries d
"""


# What the console's indexes cost next to the table they index (every delivery written and
# every status change writes an entry in each).
SIZES = """
SELECT p.relname, sum(pg_relation_size(i.inhrelid)) / 1048576.0
FROM pg_class p JOIN pg_inherits i ON i.inhparent = p.oid
WHERE p.relname IN ('deliveries', 'ix_deliveries_source_status', 'ix_deliveries_source_dead')
GROUP BY p.relname ORDER BY p.relname
"""


def reset_database() -> None:
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}"')


def seed(cfg: Settings, receipts: int, sources: int) -> list[str]:
    upgrade(cfg)
    engine = make_engine(cfg, pool_size=1)
    sessions = make_sessionmaker(engine)
    box = SecretBox(cfg.secret_key.get_secret_value())
    public: list[str] = []
    with sessions() as session, session.begin():
        for i in range(sources):
            source, _ = catalog.create_source(
                session, box, cfg, name=f"bench-{i}", provider="standard", account="default"
            )
            route_catalog.add_route(session, box, source, handler="log")
            public.append(source.public_id)
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text(SEED_RECEIPTS), {"n": receipts})
        conn.execute(text(SEED_DELIVERIES))
        conn.execute(text(SEED_ATTEMPTS))
        conn.execute(text("SELECT setval('receipts_id_seq', :n)"), {"n": receipts})
        conn.execute(text("SELECT setval('deliveries_id_seq', :n)"), {"n": receipts})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE receipts, deliveries, attempts")
        )
        counts = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM receipts), (SELECT count(*) FROM deliveries),"
                " (SELECT count(*) FROM deliveries WHERE status = 'dead')"
            )
        ).one()
        sizes = conn.execute(text(SIZES)).all()
    engine.dispose()
    print(
        f"seeded {counts[0]:,} receipts, {counts[1]:,} deliveries ({counts[2]:,} dead) over "
        f"{sources} sources in {time.perf_counter() - started:.1f}s"
    )
    print("sizes (all partitions): " + ", ".join(f"{name} {mb:.0f} MB" for name, mb in sizes))
    return public


def login(client: httpx.Client, base: str) -> str:
    page = client.get(f"{base}/console/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    answer = client.post(f"{base}/console/login", data={"csrf": csrf.group(1), "token": TOKEN})
    assert answer.status_code == 303, answer.status_code
    overview = client.get(f"{base}/console/")
    found = re.search(r'name="csrf" value="([^"]+)"', overview.text)
    assert found is not None
    return found.group(1)


def timed(call: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    response = call()
    return (time.perf_counter() - started) * 1000, response


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)]


def explain(cfg: Settings, work: Any, title: str) -> None:
    """Capture the statements ``work(session)`` runs, then EXPLAIN ANALYZE each."""
    engine = make_engine(cfg, pool_size=1)
    captured: list[tuple[str, Any]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def grab(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")) and "EXPLAIN" not in statement:
            captured.append((statement, params))

    sessions = make_sessionmaker(engine)
    with sessions() as session, session.begin():
        work(session)
    event.remove(engine, "before_cursor_execute", grab)
    print(f"\n--- plans: {title} ---")
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        for statement, params in captured:
            if "now()" in statement and "FROM" not in statement:
                continue
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, params)
            first = statement.strip().splitlines()[0][:100]
            print(f"> {first}")
            for (line,) in cur.fetchall():
                print("  " + line)
    finally:
        raw.close()
    engine.dispose()


# The statements before issue 21's performance work (commit 24f2fee), run verbatim on the same
# database in the same run: the baseline the new figures are a ratio of.
BASELINE_EVENTS = """
SELECT r.id, r.expires_at, s.public_id, s.name, r.event_id, r.event_type, r.received_at,
       r.occurred_at, r.payload_dropped_at
FROM receipts r JOIN sources s ON s.id = r.source_id
WHERE r.source_id = %(sid)s
  AND EXISTS (SELECT 1 FROM deliveries d WHERE d.receipt_id = r.id
              AND d.expires_at = r.expires_at AND d.status = 'dead')
ORDER BY r.received_at DESC, r.id DESC LIMIT 50
"""
BASELINE_PREVIEW = """
SELECT d.id, d.receipt_id, s.public_id, r.event_id, r.event_type,
       coalesce(rt.handler, '(route removed)'), d.status, d.generation, d.dead_reason,
       r.received_at, r.payload IS NOT NULL
FROM deliveries d
JOIN receipts r ON d.receipt_id = r.id AND d.expires_at = r.expires_at
JOIN sources s ON s.id = d.source_id
LEFT JOIN routes rt ON rt.id = d.route_id
WHERE d.status = 'dead' AND r.source_id = %(sid)s
ORDER BY d.id LIMIT 100001
"""


# The events list by source + status=dead as main ran it before migration 0016 (commit
# bd40862: console events by a rare status from ix_deliveries_source_status, every key's
# receipt probed, then sorted), verbatim: the count probe, the page, the page's counts.
MAIN_EVENTS_PROBE = """
SELECT count(*) AS count_1
FROM (SELECT deliveries.id AS id
FROM deliveries
WHERE deliveries.status = %(status_1)s::VARCHAR AND deliveries.source_id = %(source_id_1)s::BIGINT
 LIMIT %(param_1)s::INTEGER) AS anon_1
"""
MAIN_EVENTS_PAGE = """
SELECT anon_1.id, anon_1.expires_at, anon_1.source_id, anon_1.event_id, anon_1.event_type, anon_1.received_at, anon_1.occurred_at, anon_1.payload_dropped_at, sources.public_id, sources.name
FROM (SELECT DISTINCT deliveries.receipt_id AS receipt_id, deliveries.expires_at AS expires_at
FROM deliveries
WHERE deliveries.status = %(status_1)s::VARCHAR AND deliveries.source_id = %(source_id_1)s::BIGINT) AS anon_2 JOIN LATERAL (SELECT receipts.id AS id, receipts.expires_at AS expires_at, receipts.source_id AS source_id, receipts.event_id AS event_id, receipts.event_type AS event_type, receipts.received_at AS received_at, receipts.occurred_at AS occurred_at, receipts.payload_dropped_at AS payload_dropped_at
FROM receipts
WHERE receipts.id = anon_2.receipt_id AND receipts.expires_at = anon_2.expires_at AND receipts.source_id = %(source_id_2)s::BIGINT
 LIMIT %(param_1)s::INTEGER) AS anon_1 ON true JOIN sources ON sources.id = anon_1.source_id ORDER BY anon_1.received_at DESC, anon_1.id DESC
 LIMIT %(param_2)s::INTEGER
"""  # noqa: E501


def main_events(conn: psycopg.Connection[Any], sid: int) -> list[Any]:
    """main's list_events(source, status=dead) as it ran before 0016: its statements with its
    parameters (the two source lookups, sub-millisecond, left out)."""
    conn.execute(MAIN_EVENTS_PROBE, {"status_1": "dead", "source_id_1": sid, "param_1": 20001})
    page = {"status_1": "dead", "source_id_1": sid, "source_id_2": sid, "param_1": 1,
            "param_2": 50}  # fmt: skip
    rows = conn.execute(MAIN_EVENTS_PAGE, page).fetchall()
    if rows:
        pairs = ", ".join(f"(%(row_1_{i}_1)s, %(row_1_{i}_2)s)" for i in range(1, len(rows) + 1))
        keys: dict[str, Any] = {}
        for i, r in enumerate(rows, start=1):
            keys[f"row_1_{i}_1"], keys[f"row_1_{i}_2"] = r[0], r[1]
        conn.execute(
            "SELECT deliveries.receipt_id, deliveries.status, count(*) AS count_1 \n"
            "FROM deliveries \n"
            f"WHERE row(deliveries.receipt_id, deliveries.expires_at) IN ({pairs}) "
            "GROUP BY deliveries.receipt_id, deliveries.status",
            keys,
        ).fetchall()
    return rows


def baseline(cfg: Settings, source: str, runs: int) -> dict[str, list[float]]:
    """Wall time of the old statements (24f2fee), of main's events statements (bd40862) and
    of the new query functions, alternating, on one connection each (no HTTP): the same-run
    comparison."""
    engine = make_engine(cfg, pool_size=1)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        sid = catalog.get_source(session, source).id
    out: dict[str, list[float]] = {k: [] for k in ("events old", "events main", "events new",
                                                   "preview old", "preview new")}  # fmt: skip
    flt = EventFilter(source, None, "dead", limit=50)
    rflt = ReplayFilter(source, None, "dead")
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DB}") as conn:
        for _ in range(runs):
            ms, old = timed(lambda: conn.execute(BASELINE_EVENTS, {"sid": sid}).fetchall())
            out["events old"].append(ms)
            ms, before = timed(lambda: main_events(conn, sid))
            out["events main"].append(ms)
            with sessions() as session, session.begin():
                ms, new = timed(lambda session=session: queries.list_events(session, flt))
            out["events new"].append(ms)
            # The same 50 receipts in the same order, whichever statement found them.
            assert [r[0] for r in old] == [r[0] for r in before] == [e.id for e in new]
            ms, _r = timed(lambda: conn.execute(BASELINE_PREVIEW, {"sid": sid}).fetchall())
            out["preview old"].append(ms)
            with sessions() as session, session.begin():
                ms, _r = timed(lambda session=session: reads.preview(session, rflt, limit=100_001))
            out["preview new"].append(ms)
    engine.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--receipts", type=int, default=1_000_000)
    parser.add_argument("--sources", type=int, default=2)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--port", type=int, default=18091)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--events", type=int, default=1, help="0: only the pages of sources")
    args = parser.parse_args()
    cfg = settings(args.port)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (2 cores)")
    reset_database()
    public = seed(cfg, args.receipts, args.sources)
    server = AdminServer(cfg, host="127.0.0.1", port=args.port)
    server.start()
    base = f"http://127.0.0.1:{args.port}"
    try:
        time.sleep(1)
        with httpx.Client(timeout=30) as client:
            csrf = login(client, base)
            source = public[0]
            results: dict[str, list[float]] = {}
            sizes_kib: dict[str, float] = {}  # the HTML of the pages that list sources
            if args.events:
                for status in ("dead", "succeeded"):
                    url = f"{base}/console/events?source={source}&status={status}"
                    timed(lambda url=url: client.get(url))  # warm
                    runs = []
                    for _ in range(args.requests):
                        ms, response = timed(lambda url=url: client.get(url))
                        assert response.status_code == 200
                        assert response.text.count("data-receipt=") == 50
                        runs.append(ms)
                    results[f"events source+status={status}"] = runs
                form = {"csrf": csrf, "action": "replay", "scope": "all", "source": source}
                runs = []
                for _ in range(max(5, args.requests // 4)):
                    ms, response = timed(
                        lambda: client.post(f"{base}/console/dead/preview", data=form)
                    )
                    assert response.status_code == 200, response.status_code
                    count = re.search(r'id="preview-count">(\d+)<', response.text)
                    assert count is not None
                    runs.append(ms)
                assert count is not None
                results[f"dead preview (count {int(count.group(1)):,})"] = runs
            for name, url in (
                ("overview", f"{base}/console/"),
                ("overview of a source", f"{base}/console/?source={source}"),
                ("routes page", f"{base}/console/routes"),
                ("routes page, a search", f"{base}/console/routes?q=bench-1"),
            ):
                timed(lambda url=url: client.get(url))  # warm
                runs = []
                for _ in range(max(5, args.requests // 4)):
                    ms, response = timed(lambda url=url: client.get(url))
                    assert response.status_code == 200, response.status_code
                    runs.append(ms)
                results[name] = runs
                sizes_kib[name] = len(response.content) / 1024
            if args.events:
                rng = random.Random(7)
                ids = [rng.randrange(1, args.receipts + 1) for _ in range(args.requests)]
                ids[: args.requests // 2] = [100 * rng.randrange(1, args.receipts // 100) for _ in
                                             range(args.requests // 2)]  # fmt: skip
                runs = []
                for did in ids:
                    ms, response = timed(
                        lambda did=did: client.get(f"{base}/console/deliveries/{did}")
                    )
                    assert response.status_code == 200, (did, response.status_code)
                    runs.append(ms)
                results["delivery detail"] = runs
        print(f"\n{'page':<36} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
        for name, runs in results.items():
            print(
                f"{name:<36} {len(runs):>4} {statistics.median(runs):>8.1f} {p95(runs):>8.1f} "
                f"{max(runs):>8.1f}"
            )
        for name, kib in sizes_kib.items():
            print(f"{name}: {kib:,.0f} KiB of HTML")
        print(f"load average after the pages: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.events:
            same = baseline(cfg, source, max(5, args.requests // 4))
            print(
                "\nsame run, no HTTP: the old statements (24f2fee), main's events statements"
                " (bd40862, before 0016) and the new query functions"
            )
            print(f"{'query':<36} {'n':>4} {'p50 ms':>8} {'p95 ms':>8}")
            for name, runs in same.items():
                print(
                    f"{name:<36} {len(runs):>4} {statistics.median(runs):>8.1f} {p95(runs):>8.1f}"
                )
            for what, base in (("events", "old"), ("events", "main"), ("preview", "old")):
                ratio = statistics.median(same[f"{what} {base}"]) / statistics.median(
                    same[f"{what} new"]
                )
                print(f"{what}: {base} p50 / new p50 = {ratio:.1f}x")
            explain(
                cfg,
                lambda s: queries.list_events(s, EventFilter(source, None, "dead", limit=50)),
                "events source+status=dead",
            )
            explain(
                cfg,
                lambda s: reads.preview(s, ReplayFilter(source, None, "dead"), limit=100_001),
                "dead preview (console.preview: the frozen ids and the sample)",
            )
            from tasks.context import idempotency_key  # noqa: PLC0415

            explain(
                cfg,
                lambda s: queries.get_delivery(s, ids[0], key_of=idempotency_key),
                f"delivery detail ({ids[0]})",
            )
    finally:
        server.stop()
        if not args.keep:
            reset_database()


if __name__ == "__main__":
    main()

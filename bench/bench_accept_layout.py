"""The accept statement alone against the partition layout (issue 24): how the duplicate
check's cost grows with the days laid out, and what a layout-independent check would cost.

Variants, in alternating rounds on one machine, batches of ``--batch`` new events (1 KB bodies)
through ``webhooks_accept_many`` on one connection, one standard source with one route:

  wide    the layout the provider floor made: through now + the longest default TTL of any
          installed provider (Adyen, 30 d retry window) + lead + ahead days
  narrow  the layout this branch makes: through now + the source's TTL + lead + ahead days
  keyed   (prototype, on the wide layout) the live-receipt probe replaced by a primary-key
          lookup in an unpartitioned (source_id, event_id) table that the same statement
          upserts; it leaves out the held-receipt branch and the table's expiry, so it is a
          lower bound for that design's cost on new events

Usage: .venv/bin/python bench/bench_accept_layout.py [--rounds 6] [--batches 40] [--batch 32]
Its own Postgres databases (dropped after). Prints the median ms per batch of each variant.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from time import perf_counter

import orjson
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_receiver import ROOT, drop, env_for, setup_database  # noqa: E402

DBS = {"wide": "webhooks_bench_layout_wide", "narrow": "webhooks_bench_layout_narrow"}


def accept_many_sql() -> str:
    path = ROOT / "models" / "migrations" / "versions" / "0012_accept_floor_discard_ids.py"
    spec = importlib.util.spec_from_file_location("_rev0012", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    body: str = module.ACCEPT_MANY_FUNCTION
    return body


def keyed_function() -> str:
    """0012's batch function with the probe replaced by the key table (see the docstring)."""
    body = accept_many_sql().replace("webhooks_accept_many(", "bench_accept_many_keyed(")
    start = body.index("    ), existing AS MATERIALIZED (")
    end = body.index("    ), candidate AS MATERIALIZED (")
    body = (
        body[:start]
        + """    ), existing AS MATERIALIZED (
        SELECT i.ord, k.body_digest FROM item i
        JOIN bench_dedup_keys k ON k.source_id = i.source_id AND k.event_id = i.event_id
        WHERE k.expires_at > v_now
"""
        + body[end:]
    )
    anchor = "    ), delivery AS ("
    keyed = """    ), keyed AS (
        INSERT INTO bench_dedup_keys (source_id, event_id, expires_at, body_digest)
        SELECT r.source_id, r.event_id, r.expires_at, c.digest
        FROM receipt r JOIN candidate c ON c.source_id = r.source_id AND c.event_id = r.event_id
        ON CONFLICT (source_id, event_id) DO UPDATE
        SET expires_at = EXCLUDED.expires_at, body_digest = EXCLUDED.body_digest
        RETURNING 1
"""
    return body.replace(anchor, keyed + anchor, 1)


def widen(db: str) -> int:
    """Lay out the days the provider floor laid out (what ``main`` does before this branch)."""
    from core.settings import Settings  # noqa: PLC0415
    from core.ttl import MAX_EVENT_TIME_LEAD, TtlOverrides, dedup_terms, known_providers  # noqa: PLC0415
    from models import partitions  # noqa: PLC0415
    from models.db import make_engine  # noqa: PLC0415

    settings = Settings(_env_file=None)
    floor = max(dedup_terms(p, TtlOverrides(), settings).total for p in known_providers())
    engine = make_engine(settings, pool_size=1)
    made = 0
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        now = conn.exec_driver_sql("SELECT clock_timestamp()").scalar_one()
        last = (
            now + floor + MAX_EVENT_TIME_LEAD + timedelta(days=settings.partition_ahead_days)
        ).date()
        day = now.date()
        while day <= last:
            made += len(partitions.create_day(conn, day))
            day += timedelta(days=1)
    engine.dispose()
    return made


def receipts_days(conn: psycopg.Connection) -> int:
    found = conn.execute(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'receipts'::regclass"
    ).fetchone()
    assert found is not None
    return int(found[0])


def batch_params(source_id: int, secret_id: str, n: int, ttl: timedelta) -> dict[str, object]:
    items, digests, payloads = [], [], []
    for ord_ in range(1, n + 1):
        event_id = f"evt_{uuid.uuid4().hex}"
        body = orjson.dumps({"id": event_id, "type": "invoice.paid", "pad": "x" * 900})
        items.append(
            {
                "ord": ord_,
                "source_id": source_id,
                "secret_id": secret_id,
                "event_id": event_id,
                "event_type": "invoice.paid",
                "occurred_at": None,
                "expires_at": None,
                "ttl_s": ttl.total_seconds(),
                "content_type": "application/json",
            }
        )
        digests.append(hashlib.sha256(body).digest())
        payloads.append(body)
    return {
        "items": orjson.dumps(items).decode(),
        "digests": digests,
        "payloads": payloads,
        "grace": timedelta(seconds=30),
        "now": None,
    }


SQL = """
SELECT count(*) FROM {fn}(%(items)s::json, %(digests)b::bytea[], %(payloads)b::bytea[],
                          %(grace)s, %(now)s::timestamptz)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    conns: dict[str, psycopg.Connection] = {}
    ids: dict[str, tuple[int, str]] = {}
    try:
        for name, db in DBS.items():
            env = env_for(db, ROOT)
            setup_database(env, db, ROOT)
            url = env["WEBHOOKS_DATABASE_URL"]
            if name == "wide":
                os.environ["WEBHOOKS_DATABASE_URL"] = url
                os.environ.setdefault("WEBHOOKS_SECRET_KEY", env["WEBHOOKS_SECRET_KEY"])
                widen(db)
            conn = psycopg.connect(url, autocommit=True)
            row = conn.execute(
                "SELECT s.id, ss.id FROM sources s JOIN source_secrets ss ON ss.source_id = s.id"
            ).fetchone()
            assert row is not None
            ids[name] = (int(row[0]), str(row[1]))
            conns[name] = conn
        wide = conns["wide"]
        wide.execute(
            "CREATE TABLE bench_dedup_keys (source_id bigint, event_id text,"
            " expires_at timestamptz NOT NULL, body_digest bytea NOT NULL,"
            " PRIMARY KEY (source_id, event_id))"
        )
        wide.execute("CREATE INDEX ON bench_dedup_keys (expires_at)")
        wide.execute(keyed_function())
        for name, conn in conns.items():
            print(f"{name}: {receipts_days(conn)} receipts partitions", flush=True)
        variants = {
            "wide": (conns["wide"], ids["wide"], "webhooks_accept_many"),
            "narrow": (conns["narrow"], ids["narrow"], "webhooks_accept_many"),
            "keyed": (conns["wide"], ids["wide"], "bench_accept_many_keyed"),
        }
        ttl = timedelta(days=6, hours=4)
        times: dict[str, list[float]] = {v: [] for v in variants}
        order = list(variants)
        for r in range(args.rounds):
            for name in order[r % 3 :] + order[: r % 3]:
                conn, (source_id, secret_id), fn = variants[name]
                sql = SQL.format(fn=fn)
                for _ in range(3):  # warm the plan cache (PL/pgSQL goes generic after 5)
                    conn.execute(sql, batch_params(source_id, secret_id, args.batch, ttl))
                for _ in range(args.batches):
                    params = batch_params(source_id, secret_id, args.batch, ttl)
                    t0 = perf_counter()
                    (n,) = conn.execute(sql, params).fetchone() or (0,)
                    times[name].append((perf_counter() - t0) * 1000)
                    assert n == args.batch
            print(
                f"round {r + 1}: "
                + "  ".join(
                    f"{v} {statistics.median(t[-args.batches :]):.2f}" for v, t in times.items()
                )
                + f" ms/batch  load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                flush=True,
            )
        print(f"\nbatches of {args.batch} new events, {args.batches} x {args.rounds} per variant")
        base = statistics.median(times["wide"])
        for name, t in times.items():
            med = statistics.median(t)
            print(
                f"{name:8s} median {med:7.2f} ms/batch  {med / args.batch:.3f} ms/event"
                f"  ({med / base:.2f}x wide)"
            )
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for conn in conns.values():
            conn.close()
        for db in DBS.values():
            drop(db)


if __name__ == "__main__":
    main()

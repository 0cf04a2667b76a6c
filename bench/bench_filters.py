"""Route filters on the accept path (issue 37 item 1): what migration 0027's accept functions
cost a source whose routes hold no filter, against 0026's (the functions of 0018), and what a
filtered route costs.

  old        0026's ``webhooks_accept_many``, the receiver's group-commit statement
  new        0027's, no route filtered: a verdict-less join and the stale check's probe
  filtered   0027's, the source's one route filtered (half the events match): the judging in
             Python (parse once per body, one JMESPath search) plus the statement

Each round accepts ``--events`` new events in statements of ``--batch`` (the receiver's
group commit), on one connection, alternating old and new rounds on the same database (the
functions swapped by the migration's own downgrade and upgrade). The Python side is timed
apart: ``ingest.filtering.judged`` per receipt, with and without a filter.

Usage: .venv/bin/python bench/bench_filters.py [--events 4000] [--batch 16] [--rounds 3]
Uses its own database; drops it after.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
from alembic import command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.crypto import SecretBox  # noqa: E402
from core.filters import decide  # noqa: E402
from core.settings import Settings  # noqa: E402
from ingest.filtering import judged  # noqa: E402
from ingest.store import SourceRecord  # noqa: E402
from models import catalog, route_catalog  # noqa: E402
from models.accept import ACCEPT_MANY_SQL, NewReceipt, accept_many_params  # noqa: E402
from models.db import alembic_config, make_engine, make_sessionmaker, upgrade  # noqa: E402

DB = "webhooks_bench_filters"
FILTER = "body.data.object.amount >= `1000` && type == 'charge.succeeded'"
# 0026's statement (the functions of 0018).
OLD_ACCEPT_MANY_SQL = """
SELECT ord, authorised, receipt_id, existing_digest, delivery_ids, route_limits
FROM webhooks_accept_many(%(items)s::json, %(digests)b::bytea[], %(payloads)b::bytea[],
                          %(grace)s, %(now)s::timestamptz)
"""


def settings() -> Settings:
    return Settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{DB}",
        secret_key="bench-filters-" + "k" * 40,
    )


def source(s: Settings, name: str, flt: str | None) -> tuple[int, str]:
    engine = make_engine(s)
    box = SecretBox(s.secret_key.get_secret_value())
    with make_sessionmaker(engine)() as session, session.begin():
        src, created = catalog.create_source(session, box, s, name=name, provider="stripe")
        route_catalog.add_route(session, box, src, handler="log", filter=flt)
        out = (src.id, created.id)
    engine.dispose()
    return out


def receipts(source_id: int, secret_id: str, n: int) -> list[NewReceipt]:
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        event_id = f"evt_{uuid.uuid4().hex}"
        body = orjson.dumps(
            {
                "id": event_id,
                "type": "charge.succeeded",
                "data": {"object": {"id": f"ch_{i}", "amount": 500 + (i % 2) * 1000}},
            }
        )
        out.append(
            NewReceipt(
                source_id=source_id,
                secret_id=secret_id,
                event_id=event_id,
                event_type="charge.succeeded",
                occurred_at=None,
                expires_at=now + timedelta(days=4),
                received_at=None,
                digest=hashlib.sha256(body).digest(),
                content_type="application/json",
                payload=body,
                ttl=timedelta(days=4),
            )
        )
    return out


def record(source_id: int, filters: Any) -> SourceRecord:
    return SourceRecord(
        id=source_id,
        public_id="src_bench",
        name="bench",
        provider="stripe",
        config={},
        tolerance=None,
        max_body_bytes=None,
        ttl=timedelta(days=4),
        ttl_raised=False,
        secrets=(),
        loaded_at=0.0,
        filters=filters,
    )


def run(conn: psycopg.Connection[Any], sql: str, batch: list[list[NewReceipt]]) -> float:
    started = time.perf_counter()
    for group in batch:
        conn.execute(sql, accept_many_params(group, timedelta(seconds=60))).fetchall()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    s = settings()
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB}")
    upgrade(s)
    config = alembic_config(s)
    plain_id, plain_secret = source(s, "plain", None)
    filt_id, filt_secret = source(s, "filtered", FILTER)
    from core.filters import RouteFilter  # noqa: PLC0415 (after the path is set)

    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        route = conn.execute("SELECT id FROM routes WHERE source_id = %s", (filt_id,)).fetchone()
    assert route is not None
    filters = (RouteFilter(int(route[0]), "*", FILTER),)
    results: dict[str, list[float]] = {"old": [], "new": [], "filtered": []}
    for _ in range(args.rounds):
        for kind in ("old", "new", "filtered"):
            if kind == "old":
                command.downgrade(config, "0026")
            elif kind == "new":
                command.upgrade(config, "head")  # the column comes back empty: fill it again
                with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
                    conn.execute("UPDATE routes SET filter = %s WHERE id = %s", (FILTER, route[0]))
            if kind == "filtered":
                items = receipts(filt_id, filt_secret, args.events)
                rec = record(filt_id, filters)
                started = time.perf_counter()
                items = [judged(rec, r, {}) for r in items]
                judging = time.perf_counter() - started
            else:
                items = receipts(plain_id, plain_secret, args.events)
                judging = 0.0
            groups = [items[i : i + args.batch] for i in range(0, len(items), args.batch)]
            sql = OLD_ACCEPT_MANY_SQL if kind == "old" else ACCEPT_MANY_SQL
            with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
                elapsed = run(conn, sql, groups) + judging
            results[kind].append(elapsed / args.events * 1e6)
    print(f"{args.events} events a round in statements of {args.batch}, {args.rounds} rounds")
    for kind, values in results.items():
        print(
            f"  {kind:<9} {statistics.median(values):7.1f} us/event median"
            f"  (rounds: {', '.join(f'{v:.1f}' for v in values)})"
        )
    # The Python side alone, per receipt.
    plain = record(plain_id, ())
    sample = receipts(plain_id, plain_secret, 20_000)
    started = time.perf_counter()
    for r in sample:
        judged(plain, r, {})
    none_us = (time.perf_counter() - started) / len(sample) * 1e6
    started = time.perf_counter()
    for r in sample:
        replace(r, verdicts=decide(filters, r.payload, r.event_type, {}))
    one_us = (time.perf_counter() - started) / len(sample) * 1e6
    print(f"  judged(), no filter: {none_us:.2f} us/receipt; one filter: {one_us:.2f} us/receipt")
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


if __name__ == "__main__":
    main()

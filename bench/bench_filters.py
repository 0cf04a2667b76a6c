"""Route filters on the accept path (issue 37 item 1): what migration 0027's accept functions
cost a source whose routes hold no filter, against 0026's (the functions of 0018), and what a
filtered route costs.

  old        0026's ``webhooks_accept_many``, the receiver's group-commit statement
  new        0027's, no route filtered: a verdict-less join and the stale check's probe
  filtered   0027's, the source's one route filtered (``--match``: half the events match by
             default; 10 is issue 37's floor, a filter dropping 90%): the judging in Python
             (parse once per body, one JMESPath search) plus the statement
  its statement  the statement of ``filtered`` alone, the judging left out

``--events`` new events of each kind in statements of ``--batch`` (the receiver's group
commit), the three kinds alternating statement by statement on one connection (0026's
function installed beside 0027's under another name), so that the noise of a shared machine
falls on all three alike; the median statement decides. The Python side is timed apart:
``ingest.filtering.judged`` per receipt, with and without a filter.

Usage: .venv/bin/python bench/bench_filters.py [--events 16000] [--batch 16] [--match 50]
Uses its own database; drops it after.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.crypto import SecretBox  # noqa: E402
from core.filters import RouteFilter, decide  # noqa: E402
from core.settings import Settings  # noqa: E402
from ingest.filtering import judged  # noqa: E402
from ingest.store import SourceRecord  # noqa: E402
from models import catalog, route_catalog  # noqa: E402
from models.accept import ACCEPT_MANY_SQL, NewReceipt, accept_many_params  # noqa: E402
from models.db import make_engine, make_sessionmaker, upgrade  # noqa: E402

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


def receipts(source_id: int, secret_id: str, n: int, match: int = 50) -> list[NewReceipt]:
    """``n`` events, ``match`` in every 100 of them (spread evenly) matching FILTER."""
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        event_id = f"evt_{uuid.uuid4().hex}"
        body = orjson.dumps(
            {
                "id": event_id,
                "type": "charge.succeeded",
                "data": {
                    "object": {
                        "id": f"ch_{i}",
                        "amount": 1500 if (i * match) % 100 < match else 500,
                    }
                },
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


def old_function(conn: psycopg.Connection[Any]) -> None:
    """0026's ``webhooks_accept_many`` (0018's body) beside 0027's, under another name, so
    the two alternate statement by statement on one connection (the machine's noise falls
    on both alike)."""
    module = importlib.import_module("models.migrations.versions.0018_accept_route_limits")
    body: str = module.accept_many_function()
    conn.execute(body.replace("FUNCTION webhooks_accept_many(", "FUNCTION bench_accept_many_0026("))


def timed(conn: psycopg.Connection[Any], sql: str, group: list[NewReceipt]) -> float:
    started = time.perf_counter()
    conn.execute(sql, accept_many_params(group, timedelta(seconds=60))).fetchall()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=16_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--match",
        type=int,
        default=50,
        help="percent of the filtered source's events that match (issue 37's floor: 10)",
    )
    args = parser.parse_args()
    s = settings()
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB}")
    upgrade(s)
    plain_id, plain_secret = source(s, "plain", None)
    filt_id, filt_secret = source(s, "filtered", FILTER)
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        old_function(conn)
        route = conn.execute("SELECT id FROM routes WHERE source_id = %s", (filt_id,)).fetchone()
        assert route is not None
        filters = (RouteFilter(int(route[0]), "*", FILTER),)
        rec = record(filt_id, filters)
        b = args.batch
        old_items = receipts(plain_id, plain_secret, args.events)
        new_items = receipts(plain_id, plain_secret, args.events)
        filt_items = receipts(filt_id, filt_secret, args.events, args.match)
        times: dict[str, list[float]] = {"old": [], "new": [], "filtered": [], "its statement": []}
        old_sql = OLD_ACCEPT_MANY_SQL.replace("webhooks_accept_many(", "bench_accept_many_0026(")
        for i in range(0, args.events, b):
            times["old"].append(timed(conn, old_sql, old_items[i : i + b]))
            times["new"].append(timed(conn, ACCEPT_MANY_SQL, new_items[i : i + b]))
            started = time.perf_counter()
            group = [judged(rec, r, {}) for r in filt_items[i : i + b]]
            judging = time.perf_counter() - started
            statement = timed(conn, ACCEPT_MANY_SQL, group)
            times["filtered"].append(statement + judging)
            times["its statement"].append(statement)
        statuses = conn.execute(
            "SELECT status, count(*) FROM deliveries WHERE source_id = %s GROUP BY 1 ORDER BY 1",
            (filt_id,),
        ).fetchall()
    print(
        f"{args.events} events each, in statements of {b} (the receiver's group commit), the"
        " three kinds alternating statement by statement on one connection"
    )
    base = statistics.median(times["old"])
    for kind, values in times.items():
        med = statistics.median(values)
        print(
            f"  {kind:<13} {med / b * 1e6:7.1f} us/event median statement"
            f" ({(med / base - 1) * 100:+5.1f}%), {sum(values) / args.events * 1e6:7.1f} us/event"
            " in all"
        )
    print(f"  filtered source's deliveries: {dict(statuses)}")
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

"""Replay benchmark: dead deliveries replayed per second by ``models.replays.execute``, against
the bare guarded statement it is built on, measured in the same run on the same rows.

  ours   ``execute``: per delivery one transaction (payload check, guarded dead -> pending,
         audit counter), then the Celery publish of its id to Redis; the rate cap lifted
  bare   ``transitions.replay`` alone, one transaction per delivery, no audit, no publish

Each round replays the same N dead deliveries (put back to dead between rounds with the
worker's own transitions); rounds alternate and the best of each counts. The result says how
fast an uncapped replay can go on this machine, i.e. whether ``--rate`` (max
``models.replays.MAX_RATE``) is the bound an operator actually hits.

Usage: .venv/bin/python bench/bench_replays.py [--deliveries 1000] [--rounds 3]
Uses its own database and Redis DB 6; drops both after.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy.orm import Session, sessionmaker  # noqa: E402

from ingest.publisher import CeleryPublisher  # noqa: E402
from ingest.store import NewReceipt, accept_sync  # noqa: E402
from models import catalog, replays, transitions  # noqa: E402
from models.db import make_engine, make_sessionmaker, upgrade  # noqa: E402
from models.queries import ReplayFilter  # noqa: E402
from webhooks.clock import SystemClock  # noqa: E402
from webhooks.crypto import SecretBox  # noqa: E402
from webhooks.settings import Settings  # noqa: E402
from webhooks.ttl import expires_at  # noqa: E402

DB = "webhooks_bench_replays"
BROKER = "redis://127.0.0.1:6379/6"
ROUTES = 10


def settings() -> Settings:
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        broker_url=BROKER,
        redis_url=BROKER,
        secret_key="bench-secret-key-" + "b" * 32,
    )


def make_dead(s: Settings, sessions: sessionmaker[Session], n: int) -> str:
    box = SecretBox(s.secret_key.get_secret_value())
    with sessions() as session, session.begin():
        source, secret = catalog.create_source(
            session, box, s, name=f"bench-{uuid.uuid4().hex[:8]}", provider="standard"
        )
        for _ in range(ROUTES):
            catalog.add_route(session, box, source, handler="log")
        source_id, public_id = source.id, source.public_id
    ids: list[int] = []
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        for _ in range(n // ROUTES):
            now = datetime.now(UTC)
            event_id = f"evt_{uuid.uuid4().hex}"
            body = orjson.dumps({"id": event_id, "type": "bench.event"})
            outcome = accept_sync(
                conn,  # type: ignore[arg-type]
                NewReceipt(
                    source_id=source_id, secret_id=secret.id, event_id=event_id,
                    event_type="bench.event", occurred_at=None,
                    expires_at=expires_at(None, now, timedelta(days=4)), received_at=now,
                    ttl=timedelta(days=4),
                    digest=hashlib.sha256(body).digest(), content_type="application/json",
                    payload=body,
                ),
                s.publish_grace,
            )  # fmt: skip
            ids += outcome.delivery_ids
    kill(sessions, ids)
    return public_id


def kill(sessions: sessionmaker[Session], ids: list[int]) -> None:
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
        for delivery_id in ids:
            found = transitions.claim(
                session, delivery_id, now=now, lease=timedelta(minutes=1), max_redeliveries=3,
                worker="bench",
            )  # fmt: skip
            assert found is not None
            transitions.kill(session, found, now=now, reason="bench", error_class=None, error=None)


def bare_round(s: Settings, sessions: sessionmaker[Session], ids: list[int]) -> float:
    start = time.perf_counter()
    for delivery_id in ids:
        with sessions() as session, session.begin():
            assert transitions.replay(
                session, delivery_id, now=datetime.now(UTC), publish_grace=s.publish_grace
            )
    return len(ids) / (time.perf_counter() - start)


def ours_round(
    s: Settings, sessions: sessionmaker[Session], plan: replays.Plan, publisher: replays.Publish
) -> float:
    clock = SystemClock()
    start = time.perf_counter()
    replay_id = replays.start_replay(sessions, plan, now=clock.now())
    result = replays.execute(
        sessions, plan, replay_id, settings=s, clock=clock, sleep=time.sleep, publish=publisher
    )
    elapsed = time.perf_counter() - start
    assert result.replayed == plan.count, result
    assert result.publish_failed == 0
    return plan.count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deliveries", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    s = settings()
    upgrade(s)
    engine = make_engine(s, pool_size=2)
    sessions = make_sessionmaker(engine)
    client = redis.Redis.from_url(BROKER)
    publisher = CeleryPublisher(s)
    try:
        source = make_dead(s, sessions, args.deliveries)
        request = replays.ReplayRequest(
            operator="bench", reason="benchmark", via="cli", filter_as_given={"source": source},
            flt=ReplayFilter(source=source),
        )  # fmt: skip
        with sessions() as session:
            plan = replays.plan_replay(session, request)
        # The cap lifted (validate_request would refuse it): measure what the work costs.
        plan = replays.Plan(replace(request, rate=1e9), plan.candidates)
        ids = [c.delivery_id for c in plan.candidates]
        bare, ours = [], []
        for _ in range(args.rounds):
            bare.append(bare_round(s, sessions, ids))
            kill(sessions, ids)
            ours.append(ours_round(s, sessions, plan, publisher))
            kill(sessions, ids)
            client.flushdb()
        best_bare, best_ours = max(bare), max(ours)
        print(f"deliveries per round: {len(ids)}, rounds: {args.rounds}")
        print(
            f"bare guarded UPDATE:  {best_bare:8.0f} /s  (rounds: {', '.join(f'{x:.0f}' for x in bare)})"
        )
        print(
            f"replay execute:       {best_ours:8.0f} /s  (rounds: {', '.join(f'{x:.0f}' for x in ours)})"
        )
        print(f"ratio ours / bare:    {best_ours / best_bare:8.2f}")
        print(
            f"MAX_RATE (cap):       {replays.MAX_RATE:8.0f} /s  DEFAULT_RATE: {replays.DEFAULT_RATE:g} /s"
        )
    finally:
        publisher.close()
        client.flushdb()
        client.close()
        engine.dispose()
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')


if __name__ == "__main__":
    main()

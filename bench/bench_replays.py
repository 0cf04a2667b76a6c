"""Replay benchmark: dead letters re-queued per second by ``webhooks replay`` by filter
(``models.replays`` plan + ``execute``, what the CLI and the admin API run), for 100,000 dead
deliveries, against the bare per-delivery guarded statement the replay used to run.

  ours   plan by filter (the preview's count), the audit row, then ``execute``: chunks of up
         to ``MAX_CHUNK`` deliveries, each one transaction (one set-based guarded move, the
         audit counters), then the publish of each moved id to the Redis broker; at
         ``MAX_RATE`` (the cap an operator may ask for) and with the cap lifted
  bare   ``requeue.replay`` alone, one transaction per delivery, no audit, no publish
         (the old replay's floor), on the first ``--bare`` deliveries only (it is slow)

Each round replays the same dead deliveries (put back to dead between rounds with one
statement). Re-queued means moved dead -> pending and offered to admission: published at once
within the route's in-flight budget, the rest waiting as pending rows that the dispatcher
publishes at the route's limits (what drains them is not timed here). The floor (issue 23):
at least 1,000 re-queued deliveries/s for 100,000 dead letters.

Usage: .venv/bin/python bench/bench_replays.py [--deliveries 100000] [--rounds 2]
           [--broker redis://127.0.0.1:6379/6]
Uses its own database and the broker's Redis DB; drops both after.
"""

from __future__ import annotations

import argparse
import hashlib
import os
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

from sqlalchemy import text  # noqa: E402
from sqlalchemy.orm import Session, sessionmaker  # noqa: E402

from core.clock import SystemClock  # noqa: E402
from core.crypto import SecretBox  # noqa: E402
from core.settings import Settings  # noqa: E402
from core.ttl import expires_at  # noqa: E402
from models import catalog, replays, requeue, route_catalog  # noqa: E402
from models.accept import NewReceipt, accept_sync  # noqa: E402
from models.candidates import ReplayFilter  # noqa: E402
from models.db import make_engine, make_sessionmaker, upgrade  # noqa: E402
from tasks.publisher import CeleryPublisher  # noqa: E402

DB = "webhooks_bench_replays"
BROKER = "redis://127.0.0.1:6379/6"
ROUTES = 10


def settings(broker: str) -> Settings:
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        broker_url=broker,
        redis_url=broker,
        secret_key="bench-secret-key-" + "b" * 32,
    )


def make_dead(s: Settings, sessions: sessionmaker[Session], n: int) -> str:
    box = SecretBox(s.secret_key.get_secret_value())
    with sessions() as session, session.begin():
        source, secret = catalog.create_source(
            session, box, s, name=f"bench-{uuid.uuid4().hex[:8]}", provider="standard"
        )
        for _ in range(ROUTES):
            route_catalog.add_route(session, box, source, handler="log")
        source_id, public_id = source.id, source.public_id
    ids: list[int] = []
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        for _ in range(n // ROUTES):
            now = datetime.now(UTC)
            event_id = f"evt_{uuid.uuid4().hex}"
            body = orjson.dumps({"id": event_id, "type": "bench.event"})
            outcome = accept_sync(
                conn,
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
    """Every one back to dead, in one statement (setup, not measured): as the worker's
    ``transitions.kill`` leaves a row, attempts aside."""
    with sessions() as session, session.begin():
        moved = session.execute(
            text(
                "UPDATE deliveries SET status = 'dead', dead_reason = 'bench', dead_at = now(), "
                "next_attempt_at = NULL, lease_until = NULL, attempts = attempts + 1, "
                "updated_at = now() WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).rowcount  # type: ignore[attr-defined]
    assert moved == len(ids)


def bare_round(s: Settings, sessions: sessionmaker[Session], ids: list[int]) -> float:
    start = time.perf_counter()
    for delivery_id in ids:
        with sessions() as session, session.begin():
            assert requeue.replay(
                session, delivery_id, now=datetime.now(UTC), publish_grace=s.publish_grace
            )
    return len(ids) / (time.perf_counter() - start)


def ours_round(
    s: Settings,
    sessions: sessionmaker[Session],
    request: replays.ReplayRequest,
    publisher: replays.Publish,
    *,
    capped: bool,
) -> tuple[float, int]:
    """One replay by filter as the CLI runs it: plan (the preview), audit row, execute.
    Returns (re-queued per second, how many)."""
    clock = SystemClock()
    start = time.perf_counter()
    with sessions() as session:
        plan = replays.plan_replay(session, request)
    if not capped:  # validate_request refuses a rate above the cap: lift it past the plan
        plan = replays.Plan(replace(request, rate=1e9), plan.candidates)
    replay_id = replays.start_replay(sessions, plan, now=clock.now())
    result = replays.execute(
        sessions, plan, replay_id, settings=s, clock=clock, sleep=time.sleep, publish=publisher
    )
    elapsed = time.perf_counter() - start
    assert result.replayed == plan.count, result
    assert result.publish_failed == 0
    return plan.count / elapsed, plan.count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bare", type=int, default=2000)
    parser.add_argument("--broker", default=BROKER)
    args = parser.parse_args()
    s = settings(args.broker)
    upgrade(s)
    engine = make_engine(s, pool_size=2)
    sessions = make_sessionmaker(engine)
    client = redis.Redis.from_url(args.broker)
    publisher = CeleryPublisher(s)
    try:
        started = time.perf_counter()
        source = make_dead(s, sessions, args.deliveries)
        print(f"setup: {args.deliveries} dead letters in {time.perf_counter() - started:.0f} s")
        request = replays.ReplayRequest(
            operator="bench", reason="benchmark", via="cli", filter_as_given={"source": source},
            flt=ReplayFilter(source=source), rate=replays.MAX_RATE,
        )  # fmt: skip
        with sessions() as session:
            ids = [c.delivery_id for c in replays.plan_replay(session, request).candidates]
        bare = []
        capped: list[float] = []
        queued: list[int] = []
        uncapped: list[float] = []
        for _ in range(args.rounds):
            bare.append(bare_round(s, sessions, ids[: args.bare]))
            kill(sessions, ids[: args.bare])
            for out, cap in ((capped, True), (uncapped, False)):
                rate, count = ours_round(s, sessions, request, publisher, capped=cap)
                assert count == len(ids)
                queued.append(int(client.llen("deliveries")))
                out.append(rate)
                kill(sessions, ids)
                client.flushdb()
        load = os.getloadavg()
        print(f"dead letters replayed by filter per round: {len(ids)}, rounds: {args.rounds}")
        print(f"load average after (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"replay at MAX_RATE ({replays.MAX_RATE:.0f}/s): {max(capped):8.0f} /s  "
              f"(rounds: {', '.join(f'{x:.0f}' for x in capped)})")  # fmt: skip
        print(f"replay, cap lifted:          {max(uncapped):8.0f} /s  "
              f"(rounds: {', '.join(f'{x:.0f}' for x in uncapped)})")  # fmt: skip
        print(f"bare per-delivery UPDATE:    {max(bare):8.0f} /s  "
              f"(first {min(args.bare, len(ids))} only; rounds: "
              f"{', '.join(f'{x:.0f}' for x in bare)})")  # fmt: skip
        print(f"messages in the broker after each replay (the budget admitted): {queued}")
        print(f"floor: 1000 /s -> {'met' if max(capped) >= 1000 else 'NOT met'}")
    finally:
        publisher.close()
        client.flushdb()
        client.close()
        engine.dispose()
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')


if __name__ == "__main__":
    main()

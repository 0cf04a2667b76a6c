"""Worker benchmark: events per second from a queued delivery to ``succeeded``, against a
bare Celery no-op task drained by the same worker settings on the same broker.

Both targets run as ``celery worker -P threads -c 50``, the product's default (or
``--pool``/``--concurrency``) with the pipeline's Celery configuration (Redis broker, acks_late, prefetch 1, time limits, task
events) and the same log level:

  ours   ``celery -A tasks worker``: fast claim (Redis), durable claim (Postgres), a ``noop``
         handler, success committed, claim promoted; one receipt + delivery row per event
  bare   ``celery -A bench.noop_app worker``: a task that returns at once

Throughput: N events are queued before the worker starts (ours: published by the receiver's
publisher, ``--batch`` delivery ids per message, and again one per message); the clock runs
from the first message taken to the last one done (``succeeded`` rows for ours; an empty queue with nothing
unacknowledged for bare). Rounds alternate between the targets; the best round counts.
Latency: events are then accepted at half of our measured rate (every 2 ms what has come due,
in one statement, as the receiver's group commit does) and handed to the receiver's
publisher; p50/p99 of ``succeeded_at - received_at`` (both the database's clock).

Usage: .venv/bin/python bench/bench_workers.py [--events 2000] [--rounds 2] [--seconds 10]
       [--pool threads --concurrency 50]   (both targets; BENCH_REDIS_PORT picks the Redis)
       [--batch N]   (ids per message; default WEBHOOKS_DELIVERY_BATCH)
Uses its own database and Redis DBs 8 (broker) and 9 (claims); drops them after.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

from ingest.publisher import Publisher  # noqa: E402
from ingest.store import ACCEPT_MANY_SQL, NewReceipt, accept_many_params, decide_many  # noqa: E402
from models import catalog  # noqa: E402
from models.db import make_engine, make_sessionmaker, upgrade  # noqa: E402
from tasks.config import DELIVERIES_QUEUE, Dispatch, create_app  # noqa: E402
from webhooks.crypto import SecretBox  # noqa: E402
from webhooks.settings import Settings  # noqa: E402
from webhooks.ttl import expires_at  # noqa: E402

BIN = Path(sys.executable).parent
DB = "webhooks_bench_workers"
REDIS_PORT = os.environ.get("BENCH_REDIS_PORT", "6379")
BROKER = f"redis://127.0.0.1:{REDIS_PORT}/8"
CLAIMS = f"redis://127.0.0.1:{REDIS_PORT}/9"
# Both targets run this pool and concurrency (--pool, --concurrency).
POOL = {"pool": "threads", "concurrency": "50"}
NOOP_TASK = "bench.noop"
# Latency phase: events sent before the measured ones (a fresh worker opens its connections
# and starts its threads); they are not in the percentiles.
WARMUP_S = 2.0
# Latency phase: how often the load loop accepts what has come due since.
TICK_S = 0.002
ENV = {
    "WEBHOOKS_DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{DB}",
    "WEBHOOKS_BROKER_URL": BROKER,
    "WEBHOOKS_REDIS_URL": CLAIMS,
    "WEBHOOKS_SECRET_KEY": "bench-secret-key-" + "w" * 32,
    "WEBHOOKS_LOG_LEVEL": "INFO",
}


def settings() -> Settings:
    return Settings(
        database_url=ENV["WEBHOOKS_DATABASE_URL"],
        broker_url=BROKER,
        redis_url=CLAIMS,
        secret_key=ENV["WEBHOOKS_SECRET_KEY"],  # type: ignore[arg-type]
    )


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.update(ENV)
    env["PYTHONPATH"] = str(ROOT)
    return env


class Worker:
    def __init__(self, app: str, logdir: Path) -> None:
        self.log = logdir / f"{app.replace('.', '_')}-{uuid.uuid4().hex[:6]}.log"
        self.out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "celery"), "-A", app, "worker", "-Q", DELIVERIES_QUEUE, "-P", POOL["pool"],
             "-c", POOL["concurrency"], "-n", f"bench-{uuid.uuid4().hex[:6]}@%h", "--without-mingle",
             "--without-gossip", "-l", "INFO"],
            env={**worker_env(), "WEBHOOKS_WORKER_POOL": POOL["pool"],
                 "WEBHOOKS_WORKER_CONCURRENCY": POOL["concurrency"]}, stdout=self.out, stderr=subprocess.STDOUT, cwd=logdir,
        )  # fmt: skip

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


def queue_length(client: redis.Redis) -> int:
    return int(client.llen(DELIVERIES_QUEUE))


def wait_first_taken(client: redis.Redis, total: int, worker: Worker) -> float:
    while queue_length(client) >= total:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited: see {worker.log}")
        time.sleep(0.002)
    return time.perf_counter()


def bare_round(app: Celery, client: redis.Redis, n: int, logdir: Path) -> float:
    client.flushdb()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            app.send_task(NOOP_TASK, args=[i], queue=DELIVERIES_QUEUE, producer=producer)
    worker = Worker("bench.noop_app", logdir)
    try:
        start = wait_first_taken(client, n, worker)
        while queue_length(client) or client.hlen("unacked"):
            time.sleep(0.005)
        return n / (time.perf_counter() - start)
    finally:
        worker.stop()


def receipt(source: tuple[int, str]) -> NewReceipt:
    now = datetime.now(UTC)
    event_id = f"evt_{uuid.uuid4().hex}"
    body = orjson.dumps({"id": event_id, "type": "bench.event", "data": {"n": 1}})
    return NewReceipt(
        source_id=source[0],
        secret_id=source[1],
        event_id=event_id,
        event_type="bench.event",
        occurred_at=None,
        expires_at=expires_at(None, now, timedelta(days=4)),
        ttl=timedelta(days=4),
        received_at=None,  # stamped by the accept statement, on the database's clock
        digest=hashlib.sha256(body).digest(),
        content_type="application/json",
        payload=body,
    )


def accept(
    s: Settings, conn: psycopg.Connection[object], source: tuple[int, str], n: int
) -> list[int]:
    """``n`` events accepted in one statement, as the receiver's group commit does."""
    receipts = [receipt(source) for _ in range(n)]
    rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params(receipts, s.publish_grace)).fetchall()
    return [o.delivery_ids[0] for o in decide_many(receipts, rows)]  # type: ignore[arg-type]


def succeeded(conn: psycopg.Connection[object], ids: list[int]) -> int:
    """How many of ``ids`` succeeded (ids are consecutive: a range keeps the poll cheap)."""
    row = conn.execute(
        "SELECT count(*) FROM deliveries WHERE status = 'succeeded' AND id BETWEEN %s AND %s",
        (min(ids), max(ids)),
    ).fetchone()
    return int(row[0])  # type: ignore[index]


def ours_round(
    s: Settings, client: redis.Redis, conn: psycopg.Connection[object],
    source: tuple[int, str], n: int, logdir: Path, batch: int,
) -> float:  # fmt: skip
    """Published by the receiver's publisher, ``batch`` delivery ids per message (what it
    packs when deliveries arrive together; 1: one message per delivery)."""
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    ids = [i for k in range(0, n, 100) for i in accept(s, conn, source, min(100, n - k))]
    publisher = Publisher(s.model_copy(update={"delivery_batch": batch}))
    try:
        for start in range(0, n, 500):
            publisher.publish_sync([Dispatch(i) for i in ids[start : start + 500]])
    finally:
        publisher.close()
        publisher.app.close()
    messages = -(-n // batch)
    while queue_length(client) < messages:
        time.sleep(0.01)
    worker = Worker("tasks", logdir)
    try:
        start = wait_first_taken(client, messages, worker)
        while succeeded(conn, ids) < n:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited: see {worker.log}")
            time.sleep(0.05)
        return n / (time.perf_counter() - start)
    finally:
        worker.stop()


def latency(
    s: Settings, conn: psycopg.Connection[object], source: tuple[int, str],
    rate: float, seconds: float, logdir: Path,
) -> tuple[float, float, int]:  # fmt: skip
    """Accepted and handed to the receiver's publisher one by one at ``rate`` (it packs
    what arrives close together, WEBHOOKS_PUBLISH_LINGER) for ``WARMUP_S`` + ``seconds``;
    the percentiles of the events after the warm-up."""
    seconds += WARMUP_S
    worker = Worker("tasks", logdir)
    publisher = Publisher(s)
    try:
        while "ready." not in worker.log.read_text(errors="replace"):
            time.sleep(0.05)
        ids: list[int] = []
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            # What is due by now, accepted in one statement (as the receiver's group commit
            # would) and handed to the publisher together, every TICK_S at most.
            due = int(elapsed * rate) + 1 - len(ids)
            if due > 0:
                accepted = accept(s, conn, source, due)
                publisher.submit("bench", [Dispatch(i) for i in accepted])
                ids += accepted
            time.sleep(TICK_S)
        deadline = time.monotonic() + 120
        while succeeded(conn, ids) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop()
        publisher.close()
        publisher.app.close()
    # After the warm-up: a fresh worker's first deliveries open its connections and threads.
    rows = conn.execute(
        "SELECT extract(epoch FROM d.succeeded_at - r.received_at) FROM deliveries d "
        "JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at "
        "WHERE d.id = ANY(%s) AND d.status = 'succeeded' "
        "AND r.received_at >= (SELECT min(received_at) FROM receipts r2 "
        "                      JOIN deliveries d2 ON d2.receipt_id = r2.id "
        "                      WHERE d2.id = ANY(%s)) + %s * interval '1s'",
        (ids, ids, WARMUP_S),
    ).fetchall()
    values = sorted(float(r[0]) for r in rows)  # type: ignore[index]
    q = statistics.quantiles(values, n=100)
    return q[49], q[98], len(values)


def setup(s: Settings) -> tuple[int, str]:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    upgrade(s)
    engine = make_engine(s, pool_size=1)
    try:
        with make_sessionmaker(engine)() as session, session.begin():
            box = SecretBox(s.secret_key.get_secret_value())
            source, secret = catalog.create_source(
                session, box, s, name="bench", provider="standard"
            )
            catalog.add_route(session, box, source, handler="noop")
            return source.id, secret.id
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", default="50")
    parser.add_argument(
        "--batch", type=int, default=None, help="ids per message (default: the setting's)"
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results_workers.txt")
    args = parser.parse_args()
    POOL.update(pool=args.pool, concurrency=args.concurrency)

    os.environ.update(ENV)
    s = settings()
    source = setup(s)
    app = create_app(s)
    client = redis.Redis.from_url(BROKER)
    logdir = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    batch = args.batch or s.deliveries_per_message
    ours_rates: list[float] = []
    single_rates: list[float] = []
    bare_rates: list[float] = []
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        for _ in range(args.rounds):
            bare_rates.append(bare_round(app, client, args.events, logdir))
            ours_rates.append(ours_round(s, client, conn, source, args.events, logdir, batch))
            single_rates.append(ours_round(s, client, conn, source, args.events, logdir, 1))
        ours, single, bare = max(ours_rates), max(single_rates), max(bare_rates)
        p50, p99, count = latency(s, conn, source, ours / 2, args.seconds, logdir)
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    lines = [
        f"bench_workers: {args.events} events per round, {args.rounds} rounds, "
        f"-P {args.pool} -c {args.concurrency} (both), {os.cpu_count()} CPUs, "
        f"{datetime.now(UTC):%Y-%m-%d}",
        "target                   events/s (best)  rounds",
        f"ours, {batch:3d} ids/message {ours:14.0f}  {', '.join(f'{r:.0f}' for r in ours_rates)}",
        f"ours,   1 id/message  {single:14.0f}  {', '.join(f'{r:.0f}' for r in single_rates)}",
        f"bare                  {bare:14.0f}  {', '.join(f'{r:.0f}' for r in bare_rates)}",
        f"ratio ours/bare: {ours / bare:.2f} at {batch} ids/message (floor 1.0), "
        f"{single / bare:.2f} at 1",
        f"latency receipt->succeeded at {ours / 2:.0f} events/s offered for {args.seconds:.0f} s "
        f"after {WARMUP_S:.0f} s of warm-up "
        f"({count} events, published as they came, linger {s.publish_linger * 1000:.0f} ms): "
        f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms (floor 50 ms)",
    ]
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()

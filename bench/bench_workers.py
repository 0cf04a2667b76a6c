"""Worker benchmark: events per second from a queued delivery to ``succeeded``, against a
bare Celery no-op task drained by the same worker settings on the same broker.

Both targets run as ``celery worker -P threads -c 50``, the product's default (or
``--pool``/``--concurrency``) with the pipeline's Celery configuration (Redis broker, acks_late, prefetch 1, time limits, task
events) and the same log level:

  ours   ``celery -A tasks worker``: fast claim (Redis), durable claim (Postgres), a ``noop``
         handler, success committed, claim promoted; one receipt + delivery row per event
  bare   ``celery -A bench.noop_app worker``: a task that returns at once

Throughput: N events are queued before the worker starts (ours: published by the receiver's
publisher, ``--batch`` delivery ids per message, and again one per message; and a third time
as the sweeper publishes a backlog whose messages were lost, with the code's own
``sweep_once``, as retries, sweeps and replays are the sources of messages of one id); the clock runs
from the first message taken to the last one done (``succeeded`` rows for ours; an empty queue with nothing
unacknowledged for bare). A fourth drain: retries due at once (each delivery's first attempt
failed, its retry waiting for admission), admitted and published by the worker's own
dispatcher. Rounds alternate between the targets; the best round counts.
Latency: events are then accepted at half of our measured rate (every 2 ms what has come due,
in one statement, as the receiver's group commit does) and handed to the receiver's
publisher; p50/p99 of ``succeeded_at - received_at`` (both the database's clock).

CPU: each drain also reports its worker's CPU per event (user + system of the worker's
process, /proc) and the machine's (every core's busy time, /proc/stat: the worker, Postgres
and Redis together), steadier than events/s on a shared machine.

Against a revision (``--against REV``): ours is also run from a git worktree of REV (its own
publisher, accept statement, migrations and worker), in alternating order with this tree,
``--rounds`` times each, every run in its own process with its own bare round; bare always
runs this tree's ``bench/noop_app.py``, so both trees are held to one ceiling. Prints each
run, the means and this tree's ratio to REV's (ours/bare and CPU per event).

Usage: .venv/bin/python bench/bench_workers.py [--events 2000] [--rounds 2] [--seconds 10]
       [--pool threads --concurrency 50]   (both targets; BENCH_REDIS_PORT picks the Redis)
       [--batch N]   (ids per message; default WEBHOOKS_DELIVERY_BATCH)
       [--against REV]   (this tree against REV's code, alternating runs)
Uses its own database (webhooks_bench_workers_PORT, or BENCH_DB) and Redis DBs 8 (broker) and
9 (claims); drops them after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from typing import Any, NamedTuple

import orjson
import psycopg
import redis
from celery import Celery
from compat import (
    ACCEPT_MANY_SQL,
    CODE,
    DELIVER_TASK,
    DELIVERIES_QUEUE,
    ROOT,
    Admission,
    Dispatch,
    NewReceipt,
    Publisher,
    SecretBox,
    Settings,
    accept_many_params,
    add_route,
    build_runtime,
    create_app,
    create_source,
    decide_many,
    expires_at,
    make_engine,
    make_sessionmaker,
    message,
    sweep_once,
    target,
    upgrade,
)
from revisions import remove_worktree, worktree

# compat: the code whose publisher, accept and worker "ours" runs: this tree, or (a run of
# --against) a worktree of another revision (BENCH_CODE), each name at its path there. Bare
# always runs this tree's bench/noop_app.py.

BIN = Path(sys.executable).parent
REDIS_PORT = os.environ.get("BENCH_REDIS_PORT", "6379")
# Its own database per bench Redis port (BENCH_DB overrides): two benches run side by side on
# one machine (each with its BENCH_REDIS_PORT) never drop each other's database.
DB = os.environ.get("BENCH_DB", f"webhooks_bench_workers_{REDIS_PORT}")
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
        secret_key=ENV["WEBHOOKS_SECRET_KEY"],
    )


def worker_env(code: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEBHOOKS_", "BENCH_CODE"))}
    env.update(ENV)
    env["PYTHONPATH"] = str(code)
    return env


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads: the threads pool)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    """Busy CPU seconds of every core since boot (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Drain(NamedTuple):
    rate: float  # events/s
    worker_ms: float  # the worker's CPU ms per event
    machine_ms: float  # the machine's busy CPU ms per event


class Clock:
    """A drain's wall clock and CPU counters, from the first message taken."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.wall, self.worker, self.machine = time.perf_counter(), process_cpu(pid), machine_cpu()

    def stop(self, n: int) -> Drain:
        wall = time.perf_counter() - self.wall
        worker, machine = process_cpu(self.pid) - self.worker, machine_cpu() - self.machine
        return Drain(n / wall, 1000 * worker / n, 1000 * machine / n)


class Worker:
    def __init__(self, app: str, logdir: Path, code: Path = CODE) -> None:
        self.log = logdir / f"{app.replace('.', '_')}-{uuid.uuid4().hex[:6]}.log"
        self.out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "celery"), "-A", app, "worker", "-Q", DELIVERIES_QUEUE, "-P", POOL["pool"],
             "-c", POOL["concurrency"], "-n", f"bench-{uuid.uuid4().hex[:6]}@%h", "--without-mingle",
             "--without-gossip", "-l", "INFO"],
            env={**worker_env(code), "WEBHOOKS_WORKER_POOL": POOL["pool"],
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


def wait_first_taken(client: redis.Redis, total: int, worker: Worker) -> Clock:
    while queue_length(client) >= total:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited: see {worker.log}")
        time.sleep(0.002)
    return Clock(worker.proc.pid)


def bare_round(app: Celery, client: redis.Redis, n: int, logdir: Path) -> Drain:
    client.flushdb()
    with app.producer_or_acquire() as producer:
        for i in range(n):
            app.send_task(NOOP_TASK, args=[i], queue=DELIVERIES_QUEUE, producer=producer)
    worker = Worker("bench.noop_app", logdir, ROOT)
    try:
        clock = wait_first_taken(client, n, worker)
        while queue_length(client) or client.hlen("unacked"):
            time.sleep(0.005)
        return clock.stop(n)
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


def drain_queued(
    client: redis.Redis, conn: psycopg.Connection[object], ids: list[int], messages: int,
    logdir: Path,
) -> Drain:  # fmt: skip
    """Start ours' worker on the ``messages`` queued and time it until every id succeeded."""
    worker = Worker(target("worker"), logdir)
    try:
        return until_succeeded(conn, ids, worker, wait_first_taken(client, messages, worker))
    finally:
        worker.stop()


def until_succeeded(
    conn: psycopg.Connection[object], ids: list[int], worker: Worker, clock: Clock
) -> Drain:
    """``clock`` stopped once every one of ``ids`` succeeded."""
    while succeeded(conn, ids) < len(ids):
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited: see {worker.log}")
        time.sleep(0.05)
    return clock.stop(len(ids))


def ours_round(
    s: Settings, client: redis.Redis, conn: psycopg.Connection[object],
    source: tuple[int, str], n: int, logdir: Path, batch: int,
) -> Drain:  # fmt: skip
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
    return drain_queued(client, conn, ids, messages, logdir)


def swept_round(
    s: Settings, app: Celery, client: redis.Redis, conn: psycopg.Connection[object],
    source: tuple[int, str], n: int, logdir: Path,
) -> Drain:  # fmt: skip
    """Deliveries whose messages were lost (pending past the publish grace), published as
    the sweeper publishes them: the code's own ``sweep_once`` (this tree's groups them, in
    messages of up to WEBHOOKS_DELIVERY_BATCH ids; before, one id per message), sent with
    ``send_task`` as the sweep task's ``apply_async`` does. Admission off for the pick, so
    that the whole backlog is published at once (with it, the dispatcher publishes what the
    routes' budgets hold back, in groups)."""
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    ids = [i for k in range(0, n, 100) for i in accept(s, conn, source, min(100, n - k))]
    conn.execute(
        "UPDATE deliveries SET next_attempt_at = now() - interval '1 minute' "
        "WHERE id BETWEEN %s AND %s",
        (min(ids), max(ids)),
    )

    def publish(picked: Any) -> None:  # this tree: a group; before: one Dispatch
        group = [picked] if isinstance(picked, Dispatch) else list(picked)
        args, options = message(group, s)
        app.send_task(DELIVER_TASK, args=args, queue=DELIVERIES_QUEUE, **options)

    rt = build_runtime(s.model_copy(update={"admission": False}))
    try:
        while sweep_once(rt, publish):
            pass
    finally:
        rt.close()
    return drain_queued(client, conn, ids, queue_length(client), logdir)


def retried_round(
    s: Settings, client: redis.Redis, conn: psycopg.Connection[object],
    source: tuple[int, str], n: int, logdir: Path,
) -> Drain:  # fmt: skip
    """Retries due at once, as when a downstream comes back after an outage: each delivery's
    first attempt failed (``retrying``, one attempt, due now) and its retry waits for
    admission, as ``tasks/steps/record.py`` schedules it; the worker's dispatcher admits them
    within the route's budget and publishes what it admits together (retries, the sweeper
    and replays were the sources of one-id messages). The clock runs from the first delivery
    the worker claims."""
    client.flushdb()
    claims = redis.Redis.from_url(CLAIMS)
    claims.flushdb()
    ids = [i for k in range(0, n, 100) for i in accept(s, conn, source, min(100, n - k))]
    conn.execute(
        "UPDATE deliveries SET status = 'retrying', attempts = 1, "
        "next_attempt_at = now() - interval '1 second' WHERE id BETWEEN %s AND %s",
        (min(ids), max(ids)),
    )
    admission = Admission(claims)
    for delivery_id in ids:
        admission.schedule(delivery_id, 0.0)
    worker = Worker(target("worker"), logdir)
    try:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM deliveries WHERE status <> 'retrying' "
                "AND id BETWEEN %s AND %s",
                (min(ids), max(ids)),
            ).fetchone()
            if row and row[0]:  # type: ignore[index]
                break
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited: see {worker.log}")
            time.sleep(0.002)
        return until_succeeded(conn, ids, worker, Clock(worker.proc.pid))
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
    worker = Worker(target("worker"), logdir)
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
            source, secret = create_source(session, box, s, name="bench", provider="standard")
            add_route(session, box, source, handler="noop")
            return source.id, secret.id
    finally:
        engine.dispose()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds of bare, ours at the batch and ours at one id, then the latency
    phase, with the code of ``CODE``; each drain as (events/s, worker CPU ms, machine CPU ms)."""
    os.environ.update(ENV)
    s = settings()
    source = setup(s)
    app = create_app(s)
    client = redis.Redis.from_url(BROKER)
    logdir = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    batch = args.batch or s.deliveries_per_message
    drains: dict[str, list[Drain]] = {
        "ours": [], "single": [], "swept": [], "retried": [], "bare": []
    }  # fmt: skip
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        for _ in range(args.rounds):
            drains["bare"].append(bare_round(app, client, args.events, logdir))
            drains["ours"].append(ours_round(s, client, conn, source, args.events, logdir, batch))
            drains["single"].append(ours_round(s, client, conn, source, args.events, logdir, 1))
            drains["swept"].append(swept_round(s, app, client, conn, source, args.events, logdir))
            drains["retried"].append(retried_round(s, client, conn, source, args.events, logdir))
        best = {k: max(v) for k, v in drains.items()}
        p50, p99, count = latency(s, conn, source, best["ours"].rate / 2, args.seconds, logdir)
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    return {
        "batch": batch,
        "linger_ms": s.publish_linger * 1000,
        "drains": {k: [list(d) for d in v] for k, v in drains.items()},
        "latency": [p50, p99, count],
    }


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    drains = {k: [Drain(*d) for d in v] for k, v in result["drains"].items()}
    ours, single, swept, retried, bare = (
        max(drains[k]) for k in ("ours", "single", "swept", "retried", "bare")
    )
    batch = result["batch"]
    p50, p99, count = result["latency"]

    def row(label: str, key: str, best: Drain) -> str:
        rates = ", ".join(f"{d.rate:.0f}" for d in drains[key])
        return f"{label} {best.rate:14.0f}  {best.worker_ms:9.2f} {best.machine_ms:10.2f}  {rates}"

    return "\n".join(
        [
            f"bench_workers: {args.events} events per round, {args.rounds} rounds, "
            f"-P {args.pool} -c {args.concurrency} (both), {os.cpu_count()} CPUs, "
            f"{datetime.now(UTC):%Y-%m-%d}",
            "target                 events/s (best)  CPU ms/event: worker machine  rounds",
            row(f"ours, {batch:3d} ids/message", "ours", ours),
            row("ours,   1 id/message ", "single", single),
            row("ours, as swept       ", "swept", swept),
            row("ours, retries due    ", "retried", retried),
            row("bare                 ", "bare", bare),
            f"ratio ours/bare: {ours.rate / bare.rate:.2f} at {batch} ids/message (floor 1.0), "
            f"{single.rate / bare.rate:.2f} at 1, {swept.rate / bare.rate:.2f} as the sweeper "
            f"publishes a lost backlog, {retried.rate / bare.rate:.2f} as the dispatcher admits "
            "retries due at once",
            f"latency receipt->succeeded at {ours.rate / 2:.0f} events/s offered for "
            f"{args.seconds:.0f} s after {WARMUP_S:.0f} s of warm-up ({count} events, published "
            f"as they came, linger {result['linger_ms']:.0f} ms): "
            f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms (floor 50 ms)",
        ]
    )


def child(args: argparse.Namespace, code: Path, out: Path) -> dict[str, Any]:
    """One run of this script, one round, with ``code``'s publisher, accept and worker."""
    command = [sys.executable, __file__, "--events", str(args.events), "--rounds", "1",
               "--seconds", str(args.seconds), "--pool", args.pool, "--concurrency",
               args.concurrency, "--json", str(out)]  # fmt: skip
    if args.batch:
        command += ["--batch", str(args.batch)]
    subprocess.run(command, check=True, env={**os.environ, "BENCH_CODE": str(code)})
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def against(args: argparse.Namespace) -> str:
    """This tree and ``args.against``'s code in alternating runs (this tree first in odd
    pairs, REV first in even ones): each run's figures, the means, and the ratios."""
    rev, made = worktree(args.against)
    trees = {"this": ROOT, "rev": rev}
    runs: dict[str, list[dict[str, Drain]]] = {"this": [], "rev": []}
    tmp = Path(tempfile.mkdtemp(prefix="bench-workers-against-"))
    lines = [
        f"bench_workers against {args.against} ({rev}): {args.events} events per drain, "
        f"{args.rounds} runs each, alternating, -P {args.pool} -c {args.concurrency}, "
        f"{os.cpu_count()} CPUs, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "run      ours batch/1 id/swept/retried ev/s   bare ev/s   "
        "ratio batch / 1 / swept / retried   CPU ms/event at the batch: worker machine",
    ]
    try:
        for k in range(args.rounds):
            for name in ("this", "rev") if k % 2 == 0 else ("rev", "this"):
                result = child(args, trees[name], tmp / f"{name}-{k}.json")
                d = {key: Drain(*v[0]) for key, v in result["drains"].items()}
                runs[name].append(d)
                lines.append(
                    f"{name:5s} {k + 1:2d}  {d['ours'].rate:7.0f} {d['single'].rate:5.0f}"
                    f" {d['swept'].rate:5.0f} {d['retried'].rate:5.0f}   "
                    f"{d['bare'].rate:9.0f}   "
                    f"{d['ours'].rate / d['bare'].rate:5.2f} / "
                    f"{d['single'].rate / d['bare'].rate:4.2f} / "
                    f"{d['swept'].rate / d['bare'].rate:4.2f} / "
                    f"{d['retried'].rate / d['bare'].rate:4.2f}   "
                    f"{d['ours'].worker_ms:17.3f} {d['ours'].machine_ms:7.3f}"
                )
                print(lines[-1], flush=True)
    finally:
        if made:
            remove_worktree(rev)

    def mean(name: str, f: Any) -> float:
        return statistics.fmean(f(d) for d in runs[name])

    measures = {
        "ours/bare at the batch": lambda d: d["ours"].rate / d["bare"].rate,
        "ours/bare at 1 id": lambda d: d["single"].rate / d["bare"].rate,
        "ours/bare as swept": lambda d: d["swept"].rate / d["bare"].rate,
        "ours/bare with retries due at once": lambda d: d["retried"].rate / d["bare"].rate,
        "ours events/s at the batch": lambda d: d["ours"].rate,
        "ours events/s at 1 id": lambda d: d["single"].rate,
        "bare events/s": lambda d: d["bare"].rate,
    }
    for label, f in measures.items():
        this, other = mean("this", f), mean("rev", f)
        lines.append(f"mean {label}: {this:.2f} against {other:.2f} ({this / other:.2f}x)")
    costs = {
        "worker CPU ms/event at the batch": lambda d: d["ours"].worker_ms,
        "machine CPU ms/event at the batch": lambda d: d["ours"].machine_ms,
        "worker CPU ms/event at 1 id": lambda d: d["single"].worker_ms,
        "machine CPU ms/event at 1 id": lambda d: d["single"].machine_ms,
        "worker CPU ms/event as swept": lambda d: d["swept"].worker_ms,
        "worker CPU ms/event with retries due at once": lambda d: d["retried"].worker_ms,
    }
    for label, f in costs.items():
        this, other = mean("this", f), mean("rev", f)
        lines.append(
            f"mean {label}: {this:.3f} against {other:.3f} ({this / other:.2f}x: below 1 is cheaper)"
        )
    return "\n".join(lines)


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
    parser.add_argument("--against", metavar="REV", help="also run ours with this git rev's code")
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results_workers.txt")
    args = parser.parse_args()
    POOL.update(pool=args.pool, concurrency=args.concurrency)

    if args.json is not None:  # one run for --against: figures for the parent
        args.json.write_text(json.dumps(measure(args)))
        return
    text = against(args) if args.against else report(args, measure(args))
    print(text)
    args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()

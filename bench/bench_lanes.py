"""Lanes benchmark (issue 37 item 2's floor): a route with ``--order-key`` over 1,000 keys
drains at least 0.8x the same route without one.

Two sources, each with one ``noop`` route: ``plain`` (unordered) and ``laned``
(``--order-key body.key``). Each round accepts N events per source (``key`` = i mod 1,000, so
N / 1,000 events per key, interleaved as independent entities arrive), in statements of 100
as the receiver's group commit does (the laned source's order keys computed by
:func:`core.filters.decide`, as the receiver does), publishes them with the receiver's
publisher (WEBHOOKS_DELIVERY_BATCH ids per message), then starts bench_workers' worker
(``-P threads -c 50``) and times it from the first message taken until every delivery
succeeded. Rounds alternate plain / laned; the best round of each counts.

Against a revision (``--against REV``): each round runs this script twice, one round each,
in child processes, once with this tree's code and once with a git worktree of REV's
(``BENCH_CODE``, as bench_workers does; this tree first in odd rounds, REV first in even
ones; a directory instead of REV: that checkout as it is, e.g. a ``git archive`` export), and
reports each tree's laned/plain ratio: the fix against the code before it, in one
run on one machine.

Usage: BENCH_REDIS_PORT=6395 .venv/bin/python bench/bench_lanes.py [--events 5000]
       [--rounds 2] [--against REV|DIR]
Uses bench_workers' database and Redis DBs 8 and 9 of BENCH_REDIS_PORT (default 6379: give
your own bench Redis); drops them after. Results go on top of bench/results_lanes.txt,
older ones below a ``# earlier:`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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
from bench_workers import (
    BROKER,
    CLAIMS,
    DB,
    ENV,
    ROOT,
    Drain,
    drain_queued,
    queue_length,
    settings,
)
from compat import (
    ACCEPT_MANY_SQL,
    Dispatch,
    NewReceipt,
    Publisher,
    SecretBox,
    Settings,
    accept_many_params,
    add_route,
    create_source,
    decide_many,
    expires_at,
    make_engine,
    make_sessionmaker,
    upgrade,
)
from revisions import remove_worktree, worktree

from core.filters import decide
from models.accept import route_filters_sync

KEYS = 1000


def setup(s: Settings) -> dict[str, tuple[int, str]]:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    upgrade(s)
    engine = make_engine(s, pool_size=1)
    out = {}
    try:
        with make_sessionmaker(engine)() as session, session.begin():
            box = SecretBox(s.secret_key.get_secret_value())
            for name, key in (("plain", None), ("laned", "body.key")):
                source, secret = create_source(session, box, s, name=name, provider="standard")
                add_route(session, box, source, handler="noop", order_key=key)
                out[name] = (source.id, secret.id)
        return out
    finally:
        engine.dispose()


def receipts(
    conn: psycopg.Connection[object], source: tuple[int, str], start: int, n: int
) -> list[NewReceipt]:
    routes = route_filters_sync(conn, source[0])  # type: ignore[arg-type]
    out = []
    now = datetime.now(UTC)
    for i in range(start, start + n):
        event_id = f"evt_{uuid.uuid4().hex}"
        body = orjson.dumps({"id": event_id, "key": f"cus_{i % KEYS}", "data": {"n": i}})
        out.append(
            NewReceipt(
                source_id=source[0],
                secret_id=source[1],
                event_id=event_id,
                event_type="bench.event",
                occurred_at=None,
                expires_at=expires_at(None, now, timedelta(days=4)),
                ttl=timedelta(days=4),
                received_at=None,
                digest=hashlib.sha256(body).digest(),
                content_type="application/json",
                payload=body,
                verdicts=decide(routes, body, "bench.event", {}),
            )
        )
    return out


def round_(
    s: Settings,
    client: redis.Redis,
    conn: psycopg.Connection[object],
    source: tuple[int, str],
    n: int,
    logdir: Path,
) -> Drain:
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    ids: list[int] = []  # every delivery
    published: list[int] = []  # what the accept returns to publish (a laned one: lane heads)
    for k in range(0, n, 100):
        batch = receipts(conn, source, k, min(100, n - k))
        rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params(batch, s.publish_grace)).fetchall()
        outcomes = decide_many(batch, rows)  # type: ignore[arg-type]
        published += [i for o in outcomes for i in o.delivery_ids]
        found = conn.execute(
            "SELECT id FROM deliveries WHERE receipt_id = ANY(%s) ORDER BY id",
            ([o.receipt_id for o in outcomes],),
        ).fetchall()
        ids += [int(r[0]) for r in found]  # type: ignore[index]
    publisher = Publisher(s)
    try:
        for start in range(0, len(published), 500):
            publisher.publish_sync([Dispatch(i) for i in published[start : start + 500]])
    finally:
        publisher.close()
        publisher.app.close()
    messages = -(-len(published) // s.deliveries_per_message)
    while queue_length(client) < messages:
        time.sleep(0.01)
    return drain_queued(client, conn, ids, messages, logdir)


def measure(args: argparse.Namespace) -> dict[str, list[Drain]]:
    """``args.rounds`` rounds, plain and laned alternating, with this process's code."""
    os.environ.update(ENV)
    s = settings()
    sources = setup(s)
    client = redis.Redis.from_url(BROKER)
    logdir = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    drains: dict[str, list[Drain]] = {"plain": [], "laned": []}
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        for _ in range(args.rounds):
            for name in ("plain", "laned"):
                drain = round_(s, client, conn, sources[name], args.events, logdir)
                drains[name].append(drain)
                print(f"{name}: {drain.rate:.0f} events/s, worker {drain.worker_ms:.3f} ms/event")
    client.flushdb()
    redis.Redis.from_url(CLAIMS).flushdb()
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    return drains


def report(args: argparse.Namespace, drains: dict[str, list[Drain]]) -> str:
    best = {k: max(v) for k, v in drains.items()}
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"bench_lanes: {args.events} events per drain over {KEYS} keys, {args.rounds} rounds"
        f" alternating, -P threads -c 50, {os.cpu_count()} CPUs, {when}",
        *(
            f"{k:6} " + "  ".join(f"{d.rate:7.0f} ev/s {d.worker_ms:.3f} ms" for d in v)
            for k, v in drains.items()
        ),
        f"best laned/plain: {best['laned'].rate:.0f} / {best['plain'].rate:.0f} events/s"
        f" = {best['laned'].rate / best['plain'].rate:.2f}x (floor 0.8x)",
    ]
    return "\n".join(lines)


def child(args: argparse.Namespace, code: Path, out: Path) -> dict[str, list[Drain]]:
    """One round of this script in a child process with ``code``'s accept and worker."""
    command = [sys.executable, __file__, "--events", str(args.events), "--rounds", "1",
               "--json", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "BENCH_CODE": str(code)})
    found = json.loads(out.read_text())
    return {k: [Drain(*d) for d in v] for k, v in found.items()}


def against(args: argparse.Namespace) -> str:
    """This tree and ``args.against``'s code in alternating rounds; each tree's best
    laned/plain ratio (the floor's figure) and its rounds."""
    given = Path(args.against)
    # A directory: that checkout as it is (a private export: a worktree of a commit is
    # shared by every bench of the same commit on this machine, and removed by whichever
    # ends first).
    rev, made = (given.resolve(), False) if given.is_dir() else worktree(args.against)
    trees = {"this": ROOT, "rev": rev}
    runs: dict[str, dict[str, list[Drain]]] = {t: {"plain": [], "laned": []} for t in trees}
    tmp = Path(tempfile.mkdtemp(prefix="bench-lanes-against-"))
    try:
        for k in range(args.rounds):
            for name in ("this", "rev") if k % 2 == 0 else ("rev", "this"):
                found = child(args, trees[name], tmp / f"{name}-{k}.json")
                for kind, drains in found.items():
                    runs[name][kind] += drains
    finally:
        if made:
            remove_worktree(rev)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"bench_lanes against {args.against} ({rev.name}): {args.events} events per drain"
        f" over {KEYS} keys, {args.rounds} rounds alternating trees, -P threads -c 50,"
        f" {os.cpu_count()} CPUs, {when}",
    ]
    ratios = {}
    for name, label in (("this", "this tree"), ("rev", args.against)):
        best = {k: max(v) for k, v in runs[name].items()}
        ratios[name] = best["laned"].rate / best["plain"].rate
        lines += [
            f"{label}:",
            *(
                f"  {k:6} " + "  ".join(f"{d.rate:7.0f} ev/s {d.worker_ms:.3f} ms" for d in v)
                for k, v in runs[name].items()
            ),
            f"  best laned/plain: {best['laned'].rate:.0f} / {best['plain'].rate:.0f}"
            f" events/s = {ratios[name]:.2f}x (floor 0.8x)",
        ]
    lines.append(
        f"laned/plain, this tree against {args.against}: {ratios['this']:.2f}x against"
        f" {ratios['rev']:.2f}x"
    )
    return "\n".join(lines)


def record(path: Path, text: str) -> None:
    """The newest results on top; the ones before below a ``# earlier:`` line."""
    before = path.read_text() if path.exists() else ""
    path.write_text(text + "\n\n" + ("# earlier:\n" + before if before else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--against", metavar="REV", help="also run REV's code (or a checkout's), alternating"
    )
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # a child's figures
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results_lanes.txt")
    args = parser.parse_args()
    if args.json is not None:
        drains = measure(args)
        args.json.write_text(json.dumps({k: [list(d) for d in v] for k, v in drains.items()}))
        return
    text = against(args) if args.against else report(args, measure(args))
    print(text)
    record(args.output, text)


if __name__ == "__main__":
    main()

"""Forward benchmark: events accepted by the real receiver and delivered by ``forward`` to a
local downstream that answers 200 after a fixed delay, beside a bare Celery forwarder.

  ours   the receiver (uvicorn, ``ingest.app``) accepts signed Standard Webhooks requests;
         ``celery -A tasks worker -P <pool> -c <n>`` runs ``forward`` (fast claim, durable
         claim, signed POST, success committed) to the downstream
  bare   ``celery -A bench.forward_app worker``: a task that POSTs the same body with httpx,
         the same Celery configuration and broker, nothing else

The downstream (``bench/downstream_app.py``, uvicorn) answers after ``--delays`` ms (10, 100
and 500 by default). For each delay, in one run and interleaved (bare, ours, bare, ours...):

  drain      N events queued with the worker stopped (ours: accepted by the receiver), then
             the worker starts; events/s from the first message taken to the N-th done,
             the worker's CPU seconds per event (all its processes) and its RSS at the end
  sustained  the worker running and events arriving at a fixed rate (ours: POSTed to the
             receiver) for 3 s of warm-up plus ``--seconds``: events/s done, and latency
             after the warm-up: ours receipt -> succeeded (the database's timestamps), bare
             publish -> downstream answered

Against a revision (``--against REV``): ours also runs from a git worktree of REV (its own
receiver, worker, migrations and database, with this venv), in alternating order with this
tree, ``--rounds`` times per delay; bare runs once per round from this tree, the ceiling both
are held to. Prints each run, the means, and this tree's ratio to REV's (ours/bare events/s,
the worker's CPU per event), then both at one sustained rate. ``--env`` is this tree's only.

Usage: .venv/bin/python bench/bench_forward.py [--events 2000] [--delays 10,100,500]
       [--pool threads --concurrency 50] [--bare-pool threads --bare-concurrency 100]
       [--against REV --rounds 3]   (this tree against REV's code, alternating runs)
Uses its own database and Redis DBs 8 (broker) and 9 (claims) of --redis-port (6394).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
import psycopg
import redis
from celery import Celery
from compat import DELIVERIES_QUEUE, ROOT, Settings, cli, create_app, target
from revisions import remove_worktree, worktree
from standardwebhooks.webhooks import Webhook

BIN = Path(sys.executable).parent
DB = "webhooks_bench_forward"
RECEIVER_PORT = 18802
DOWNSTREAM_PORT = 18801
FORWARD_TASK = "bench.forward"
HOOK = f"http://127.0.0.1:{DOWNSTREAM_PORT}/hook"
# Sustained phase: events sent before the measured ones (a fresh worker's first calls open
# its connections); they count in done/s, not in the latencies.
WARMUP_S = 3.0


def base_env(redis_port: int, db: str = DB, code: Path = ROOT) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEBHOOKS_", "BENCH_CODE"))}
    env.update(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{db}",
        WEBHOOKS_BROKER_URL=f"redis://127.0.0.1:{redis_port}/8",
        WEBHOOKS_REDIS_URL=f"redis://127.0.0.1:{redis_port}/9",
        WEBHOOKS_SECRET_KEY="bench-secret-key-" + "f" * 32,
        WEBHOOKS_LOG_LEVEL="WARNING",
        WEBHOOKS_LOG_JSON="true",
        PYTHONPATH=str(code),
    )
    return env


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def uvicorn(
    app: str, port: int, env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """``app`` from ``cwd`` (uvicorn puts its working directory first on sys.path)."""
    cmd = [str(BIN / "uvicorn"), app, "--port", str(port), "--loop", "uvloop", "--http",
           "httptools", "--no-access-log", "--log-level", "warning", "--backlog", "4096",
           "--timeout-keep-alive", "300"]  # fmt: skip
    if app.endswith("app_from_env"):
        cmd.insert(1, "--factory")
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=cwd)  # noqa: S603
    wait_port(port, proc, app)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tree(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid)], check=False, capture_output=True, text=True
    ).stdout
    return [pid] + [int(p) for p in out.split()]


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    """Busy CPU seconds of every core since boot (/proc/stat: all but idle and iowait): the
    worker, Postgres, Redis, the receiver, the downstream and the load generator together."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu() -> dict[int, tuple[str, int, float]]:
    """Every process's (command name, parent, CPU seconds so far), from /proc."""
    found: dict[int, tuple[str, int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, rest = (entry / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        found[int(entry.name)] = (
            head.split("(", 1)[1],
            int(fields[1]),
            (int(fields[11]) + int(fields[12])) / tick,
        )
    return found


# The process groups CPU is split into: the worker and the receiver by process tree, the
# downstream by its pid, Postgres and Redis by command name, this script; "other" is the
# rest of the machine's busy CPU (/proc/stat), so the groups add up to the machine figure:
# other processes, the kernel's own work, and processes that exited within the span.
GROUPS = ("worker", "receiver", "downstream", "postgres", "redis", "bench", "other")
_ROLE_PIDS: dict[str, int] = {}


def group_of(pid: int, procs: dict[int, tuple[str, int, float]]) -> str:
    name = procs[pid][0]
    if name.startswith("postgres"):
        return "postgres"
    if name.startswith("redis-server"):
        return "redis"
    if pid == os.getpid():
        return "bench"
    roots = {v: k for k, v in _ROLE_PIDS.items()}
    seen = pid
    for _ in range(6):
        if seen in roots:
            return roots[seen]
        seen = procs.get(seen, ("", 0, 0.0))[1]
        if seen <= 1:
            break
    return "other"


def group_cpu() -> dict[str, float]:
    """CPU seconds so far per group, for the processes alive now (a process that exits
    between two readings loses its share: the groups' sum is checked against /proc/stat)."""
    procs = process_cpu()
    totals = dict.fromkeys(GROUPS, 0.0)
    for pid, (_, _, cpu) in procs.items():
        totals[group_of(pid, procs)] += cpu
    return totals


def rss_mib(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


class Worker:
    def __init__(self, app: str, pool: str, concurrency: int, env: dict[str, str], logdir: Path):
        self.log = logdir / f"{app.replace('.', '_')}-{uuid.uuid4().hex[:6]}.log"
        self.out = self.log.open("wb")
        env = {**env, "WEBHOOKS_WORKER_POOL": pool, "WEBHOOKS_WORKER_CONCURRENCY": str(concurrency)}
        self.name = f"bench-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        self.proc = subprocess.Popen(
            [str(BIN / "celery"), "-A", app, "worker", "-Q", DELIVERIES_QUEUE, "-P", pool,
             "-c", str(concurrency), "-n", self.name,
             "--without-mingle", "--without-gossip", "-l", "WARNING"],
            env=env, stdout=self.out, stderr=subprocess.STDOUT, cwd=logdir,
        )  # fmt: skip

    def wait_ready(self, app: Celery) -> None:
        """Answers a ping: consuming (its log says "ready." at INFO only)."""
        while not app.control.ping(destination=[self.name], timeout=0.5):
            self.check()

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited: see {self.log}")

    def stop(self) -> None:
        stop(self.proc)
        self.out.close()


@dataclass
class Drain:
    rate: float
    cpu_ms: float
    rss: float
    # From the worker's start to the first message taken (its boot: imports, connections),
    # which the figures above leave out; the earlier measure of ours counted it (see drain).
    boot_s: float = 0.0
    boot_cpu_s: float = 0.0
    n: int = 0
    # The whole machine's busy CPU per event over the same span (every process: the worker's
    # own is cpu_ms); steadier than events/s on a shared machine.
    machine_ms: float = 0.0
    # CPU ms per event per process group (GROUPS) over the same span.
    groups: dict[str, float] = field(default_factory=dict)

    def split(self) -> str:
        return " ".join(f"{g} {self.groups.get(g, 0.0):.2f}" for g in GROUPS)

    @property
    def rate_with_boot(self) -> float:
        return self.n / (self.n / self.rate + self.boot_s)

    @property
    def cpu_ms_with_boot(self) -> float:
        return self.cpu_ms + 1000 * self.boot_cpu_s / self.n


@dataclass
class Sustained:
    offered: float
    done_rate: float
    p50_ms: float
    p99_ms: float
    count: int
    # A downstream's 2xx to its success's commit, p99 (attempts.committed_at - ended_at);
    # None for a tree before 0020, or for bare Celery, which records nothing.
    commit_p99_ms: float | None = None


# One kept-alive client for the script's own calls to the downstream. Until 2026-12-07 each
# call was ``httpx.get``, a new client and TLS context every time: bare's drain polls the
# count 50 times a second, and that cost this script 2.4 ms of CPU per event, about 40% of
# a core taken from bare's worker (its figures were low by that much).
_stats_client = httpx.Client(base_url=f"http://127.0.0.1:{DOWNSTREAM_PORT}")


def downstream_count() -> int:
    """How many requests the downstream answered (``/stats?count``: no latencies)."""
    return int(_stats_client.get("/stats", params={"count": "1"}).json()["count"])


def downstream_stats() -> dict[str, object]:
    result: dict[str, object] = _stats_client.get("/stats").json()
    return result


def reset_downstream() -> None:
    _stats_client.delete("/stats")


class Lane:
    """One keep-alive HTTP/1.1 connection to the receiver, written to and read from directly:
    httpx cost the load generator 2-3 ms of CPU per request, which on this 2-core machine
    capped the sender near 300 requests/s and took CPU from the receiver and the worker."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls) -> Lane:
        return cls(*await asyncio.open_connection("127.0.0.1", RECEIVER_PORT))

    async def post(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


class Sender:
    """Signs and POSTs events to the receiver (``sent_at`` in each body, for the downstream)."""

    def __init__(self, source: str, secret: str) -> None:
        self.path = f"/webhooks/{source}"
        self.webhook = Webhook(secret)

    def _request(self) -> bytes:
        event_id = f"msg_{uuid.uuid4().hex}"
        now = datetime.now(UTC)
        body = orjson.dumps(
            {"type": "bench.event", "sent_at": time.time(), "data": {"id": event_id, "n": 1}}
        )
        head = (
            f"POST {self.path} HTTP/1.1\r\nhost: 127.0.0.1:{RECEIVER_PORT}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"webhook-id: {event_id}\r\nwebhook-timestamp: {int(now.timestamp())}\r\n"
            f"webhook-signature: {self.webhook.sign(event_id, now, body.decode())}\r\n\r\n"
        )
        return head.encode() + body

    async def _post(self, lane: Lane) -> None:
        status = await lane.post(self._request())
        if status >= 300:
            raise RuntimeError(f"receiver answered {status}")

    async def _lanes(self, count: int, work: object) -> None:
        lanes = [await Lane.open() for _ in range(count)]
        try:
            await asyncio.gather(*(work(lane) for lane in lanes))  # type: ignore[operator]
        finally:
            for lane in lanes:
                lane.close()

    async def burst(self, n: int, concurrency: int = 32) -> None:
        left = iter(range(n))

        async def lane(conn: Lane) -> None:
            for _ in left:
                await self._post(conn)

        await self._lanes(concurrency, lane)

    async def paced(self, rate: float, seconds: float, lanes: int = 32) -> int:
        """``rate`` requests/s for ``seconds``, each sent at its due time by the first free
        of ``lanes`` connections."""
        total = int(rate * seconds)
        slots = iter(range(total))
        start = time.perf_counter()

        async def lane(conn: Lane) -> None:
            for i in slots:
                pause = start + i / rate - time.perf_counter()
                if pause > 0:
                    await asyncio.sleep(pause)
                await self._post(conn)

        await self._lanes(lanes, lane)
        return total


def succeeded(conn: psycopg.Connection[object]) -> int:
    row = conn.execute("SELECT count(*) FROM deliveries WHERE status = 'succeeded'").fetchone()
    return int(row[0])  # type: ignore[index]


def claimed(conn: psycopg.Connection[object]) -> bool:
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM deliveries WHERE status <> 'pending')")
    return bool(row.fetchone()[0])  # type: ignore[index]


def queued(client: redis.Redis) -> int:
    return int(client.llen(DELIVERIES_QUEUE))


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def drain(worker: Worker, n: int, taken: Callable[[], bool], done: object) -> Drain:
    """Events/s and CPU per event from the first message the worker takes (``taken``) to the
    n-th event done. Before 2026-12-02 (session 9) ours' clock started when its worker was
    launched: its check, ``queued >= n``, never held for ours (the receiver packs several ids
    in a message, and admission keeps most of them out of the broker), so ours' figures
    counted the worker's boot (about 1 CPU second, 1.3-3.5 s on this machine) and bare's did
    not. Both measures are reported (``rate_with_boot``)."""
    launched, boot_cpu0 = time.perf_counter(), cpu_seconds(worker.proc.pid)
    while not taken():
        worker.check()
        time.sleep(0.002)
    _ROLE_PIDS["worker"] = worker.proc.pid
    groups0 = group_cpu()
    start, cpu0, machine0 = time.perf_counter(), cpu_seconds(worker.proc.pid), machine_cpu()
    while done() < n:  # type: ignore[operator]
        worker.check()
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    cpu, rss = cpu_seconds(worker.proc.pid) - cpu0, rss_mib(worker.proc.pid)
    machine = machine_cpu() - machine0
    groups1 = group_cpu()
    split = {g: 1000 * (groups1[g] - groups0[g]) / n for g in GROUPS if g != "other"}
    split["other"] = 1000 * machine / n - sum(split.values())
    progress(f"drained {n} in {elapsed:.1f} s")
    return Drain(
        n / elapsed,
        1000 * cpu / n,
        rss,
        start - launched,
        cpu0 - boot_cpu0,
        n,
        1000 * machine / n,
        split,
    )


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:  # a starved run (a busy machine) measured too few to tell: no figure
        return float("nan"), float("nan")
    q = statistics.quantiles(sorted(values), n=100)
    return 1000 * q[49], 1000 * q[98]


class Bench:
    """Ours with ``code``'s worker on ``env``'s database; bare (this tree's) beside it."""

    def __init__(
        self, args: argparse.Namespace, env: dict[str, str], logdir: Path, code: Path = ROOT
    ) -> None:
        self.args, self.env, self.logdir, self.code = args, env, logdir, code
        self.broker = redis.Redis.from_url(env["WEBHOOKS_BROKER_URL"])
        self.claims = redis.Redis.from_url(env["WEBHOOKS_REDIS_URL"])
        settings = Settings(
            database_url=env["WEBHOOKS_DATABASE_URL"],
            broker_url=env["WEBHOOKS_BROKER_URL"],
            redis_url=env["WEBHOOKS_REDIS_URL"],
            secret_key=env["WEBHOOKS_SECRET_KEY"],
        )
        self.app: Celery = create_app(settings)
        self.dsn = settings.psycopg_dsn

    def _fresh(self, conn: psycopg.Connection[object]) -> None:
        self.broker.flushdb()
        self.claims.flushdb()
        conn.execute("TRUNCATE attempts, deliveries, receipts")
        reset_downstream()

    def bare_worker(self) -> Worker:
        a = self.args
        return Worker("bench.forward_app", a.bare_pool, a.bare_concurrency, self.env, self.logdir)

    def ours_worker(self) -> Worker:
        app = target("worker", self.code)
        return Worker(app, self.args.pool, self.args.concurrency, self.env, self.logdir)

    def receiver(self) -> subprocess.Popen[bytes]:
        """``code``'s receiver (``ingest.app`` or where it moved), on ``env``'s database."""
        app = target("receiver", self.code)
        proc = uvicorn(app, RECEIVER_PORT, self.env, self.logdir / "receiver.log", self.code)
        _ROLE_PIDS["receiver"] = proc.pid
        return proc

    @contextmanager
    def running(self) -> Iterator[None]:
        """The receiver up for one run of ours (--against: each tree's for its own runs)."""
        receiver = self.receiver()
        try:
            yield
        finally:
            stop(receiver)

    def publish_bare(self, n: int) -> None:
        with self.app.producer_or_acquire() as producer:
            for _ in range(n):
                body = orjson.dumps({"sent_at": time.time()}).decode()
                self.app.send_task(
                    FORWARD_TASK, args=[HOOK, body], queue=DELIVERIES_QUEUE, producer=producer
                )

    def bare_drain(self, conn: psycopg.Connection[object]) -> Drain:
        n = self.args.events
        self._fresh(conn)
        self.publish_bare(n)
        worker = self.bare_worker()
        try:
            return drain(worker, n, lambda: queued(self.broker) < n, downstream_count)
        finally:
            worker.stop()

    def ours_drain(self, conn: psycopg.Connection[object], sender: Sender) -> Drain:
        n = self.args.events
        self._fresh(conn)
        asyncio.run(sender.burst(n))
        # The receiver's messages carry several ids, and with admission most deliveries wait
        # outside the broker: the first message is taken when the queue gets shorter (or,
        # with nothing queued, when a delivery leaves pending).
        initial = queued(self.broker)

        def taken() -> bool:
            return queued(self.broker) < initial if initial else claimed(conn)

        worker = self.ours_worker()
        try:
            return drain(worker, n, taken, lambda: succeeded(conn))
        finally:
            worker.stop()

    def bare_sustained(self, conn: psycopg.Connection[object], rate: float) -> Sustained:
        self._fresh(conn)
        worker = self.bare_worker()
        try:
            worker.wait_ready(self.app)
            interval, sent, start = 1.0 / rate, 0, time.perf_counter()
            warm = int(rate * WARMUP_S)
            with self.app.producer_or_acquire() as producer:
                while time.perf_counter() - start < self.args.seconds + WARMUP_S:
                    pause = start + sent * interval - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    body = orjson.dumps({"sent_at": time.time()}).decode()
                    self.app.send_task(
                        FORWARD_TASK, args=[HOOK, body], queue=DELIVERIES_QUEUE, producer=producer
                    )
                    sent += 1
            while downstream_count() < sent:
                worker.check()
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        finally:
            worker.stop()
        latencies = [float(x) for x in downstream_stats()["latencies"]]  # type: ignore[attr-defined]
        # In answer order, near enough to sending order at these rates: skip the warm-up.
        p50, p99 = percentiles(latencies[warm:])
        return Sustained(rate, sent / elapsed, p50, p99, sent - warm)

    def ours_sustained(
        self, conn: psycopg.Connection[object], sender: Sender, rate: float
    ) -> Sustained:
        self._fresh(conn)
        worker = self.ours_worker()
        try:
            worker.wait_ready(self.app)
            start = time.perf_counter()
            sent = asyncio.run(sender.paced(rate, self.args.seconds + WARMUP_S))
            while succeeded(conn) < sent:
                worker.check()
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        finally:
            worker.stop()
        rows = conn.execute(
            "SELECT extract(epoch FROM d.succeeded_at - r.received_at) FROM deliveries d "
            "JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at "
            "WHERE d.status = 'succeeded' "
            "AND r.received_at >= (SELECT min(received_at) FROM receipts) + %s * interval '1s'",
            (WARMUP_S,),
        ).fetchall()
        p50, p99 = percentiles([float(r[0]) for r in rows])  # type: ignore[index]
        return Sustained(rate, sent / elapsed, p50, p99, len(rows), commit_p99(conn))


def commit_p99(conn: psycopg.Connection[object]) -> float | None:
    """p99 of the time from a handler's return (its downstream's 2xx) to the commit of its
    success, in ms, over this run's successes; None where the tree records no commit time."""
    try:
        rows = conn.execute(
            "SELECT extract(epoch FROM committed_at - ended_at) FROM attempts"
            " WHERE outcome = 'succeeded' AND committed_at IS NOT NULL"
        ).fetchall()
    except psycopg.errors.UndefinedColumn:
        return None
    if not rows:
        return None
    return percentiles([max(0.0, float(r[0])) for r in rows])[1]  # type: ignore[index]


def _commit(s: Sustained) -> str:
    return "n/a" if s.commit_p99_ms is None else f"{s.commit_p99_ms:.1f} ms"


def drop(db: str) -> None:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def setup(env: dict[str, str], db: str = DB, code: Path = ROOT) -> tuple[str, str]:
    """``db`` migrated by ``code`` (its CLI, PYTHONPATH in ``env``); a source and its route."""
    drop(db)

    def run(*argv: str) -> str:
        return subprocess.run(  # noqa: S603
            [*cli(code), *argv], env=env, check=True, capture_output=True, text=True, cwd=code
        ).stdout

    run("db", "upgrade")
    view = orjson.loads(run("sources", "add", "bench", "--provider", "standard", "--json"))
    run(
        "routes", "add", view["id"], "--handler", "forward",
        "--option", f"url={HOOK}", "--option", "allow_private=true",
    )  # fmt: skip
    return view["id"], view["secret"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--delays", default="10,100,500")
    parser.add_argument("--rate", type=float, default=300.0, help="sustained phase, events/s")
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--bare-pool", default="threads")
    parser.add_argument("--bare-concurrency", type=int, default=100)
    parser.add_argument("--batch", type=int, default=None, help="WEBHOOKS_DELIVERY_BATCH")
    parser.add_argument("--linger", type=float, default=None, help="WEBHOOKS_PUBLISH_LINGER")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="WEBHOOKS_X=VALUE",
        help="a setting for ours' receiver and worker (a value to try; this tree's only with "
        "--against)",
    )
    parser.add_argument("--against", metavar="REV", help="also run ours with this git rev's code")
    parser.add_argument("--redis-port", type=int, default=6394)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results_forward.txt")
    args = parser.parse_args()

    env = base_env(args.redis_port)
    if args.batch is not None:
        env["WEBHOOKS_DELIVERY_BATCH"] = str(args.batch)
    if args.linger is not None:
        env["WEBHOOKS_PUBLISH_LINGER"] = str(args.linger)
    if args.against:
        text = against(args, env)
        print(text)
        args.output.write_text(text + "\n")
        return
    env.update(item.split("=", 1) for item in args.env)
    os.environ.update(env)
    source, secret = setup(env)
    logdir = Path(tempfile.mkdtemp(prefix="bench-forward-"))
    bench = Bench(args, env, logdir)
    sender = Sender(source, secret)
    receiver = bench.receiver()
    lines = [
        f"bench_forward: {args.events} events per drain, {args.rounds} round(s), "
        f"ours -P {args.pool} -c {args.concurrency}, bare -P {args.bare_pool} "
        f"-c {args.bare_concurrency}, 1 receiver process, {os.cpu_count()} CPUs, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f}",
    ]
    try:
        with psycopg.connect(bench.dsn, autocommit=True) as conn:
            for delay in [int(d) for d in args.delays.split(",")]:
                downstream = uvicorn(
                    "bench.downstream_app:app",
                    DOWNSTREAM_PORT,
                    {**env, "BENCH_DELAY_MS": str(delay)},
                    logdir / "downstream.log",
                )
                _ROLE_PIDS["downstream"] = downstream.pid
                try:
                    bare: list[Drain] = []
                    ours: list[Drain] = []
                    for _ in range(args.rounds):
                        bare.append(bench.bare_drain(conn))
                        ours.append(bench.ours_drain(conn, sender))
                    best_bare = max(bare, key=lambda d: d.rate)
                    best_ours = max(ours, key=lambda d: d.rate)
                    rate = min(args.rate, 0.9 * best_ours.rate)
                    s_bare = bench.bare_sustained(conn, rate)
                    s_ours = bench.ours_sustained(conn, sender, rate)
                finally:
                    stop(downstream)
                lines += report(delay, bare, ours, best_bare, best_ours, s_bare, s_ours)
                print("\n".join(lines[-10:]), flush=True)
    finally:
        stop(receiver)
    drop(DB)
    bench.broker.flushdb()
    bench.claims.flushdb()
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text + "\n")


def against(args: argparse.Namespace, env: dict[str, str]) -> str:
    """Per delay and round: bare once (this tree), then ours from this tree and from REV's
    worktree (this tree first in even rounds, REV first in odd ones), each with its own
    receiver (up for its own runs only) and database; then one sustained rate for all three."""
    rev, made = worktree(args.against)
    trees = {"this": ROOT, "rev": rev}
    logdir = Path(tempfile.mkdtemp(prefix="bench-forward-against-"))
    benches: dict[str, Bench] = {}
    senders: dict[str, Sender] = {}
    for name, code in trees.items():
        db = DB if name == "this" else f"{DB}_rev"
        tree_env = base_env(args.redis_port, db, code)
        # --batch and --linger for both trees; --env is a value to try on this tree's only.
        tree_env.update((k, v) for k, v in env.items() if k.endswith(("_BATCH", "_LINGER")))
        if name == "this":
            tree_env.update(item.split("=", 1) for item in args.env)
        source, secret = setup(tree_env, db, code)
        benches[name], senders[name] = Bench(args, tree_env, logdir, code), Sender(source, secret)
    os.environ.update(benches["this"].env)
    this = benches["this"]
    lines = [
        f"bench_forward against {args.against} ({rev}): {args.events} events per drain, "
        f"{args.rounds} run(s) each per delay, alternating, bare once per round (this tree), "
        f"ours -P {args.pool} -c {args.concurrency}, bare -P {args.bare_pool} "
        f"-c {args.bare_concurrency}, 1 receiver process, {os.cpu_count()} CPUs, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f}",
        f"logs: {logdir}",
    ]

    try:
        with (
            psycopg.connect(this.dsn, autocommit=True) as this_conn,
            psycopg.connect(benches["rev"].dsn, autocommit=True) as rev_conn,
        ):
            conns = {"this": this_conn, "rev": rev_conn}
            for i, delay in enumerate(int(d) for d in args.delays.split(",")):
                lines += ["", f"downstream delay {delay} ms",
                          "  run      ours ev/s  bare ev/s  ours/bare  worker CPU ms/event: ours"
                          " bare  ours RSS MiB  machine CPU ms/event: ours bare"]  # fmt: skip
                print("\n".join(lines[-3:]), flush=True)
                downstream = uvicorn(
                    "bench.downstream_app:app", DOWNSTREAM_PORT,
                    {**this.env, "BENCH_DELAY_MS": str(delay)}, logdir / "downstream.log",
                )  # fmt: skip
                _ROLE_PIDS["downstream"] = downstream.pid
                runs: dict[str, list[tuple[Drain, Drain]]] = {"this": [], "rev": []}
                sustained: dict[str, Sustained] = {}
                try:
                    for k in range(args.rounds):
                        bare = this.bare_drain(this_conn)
                        for name in ("this", "rev") if k % 2 == 0 else ("rev", "this"):
                            with benches[name].running():
                                d = benches[name].ours_drain(conns[name], senders[name])
                            runs[name].append((d, bare))
                            lines.append(
                                f"  {name:5s} {k + 1:2d} {d.rate:9.0f} {bare.rate:10.0f}"
                                f" {d.rate / bare.rate:10.2f} {d.cpu_ms:26.2f} {bare.cpu_ms:5.2f}"
                                f" {d.rss:13.0f} {d.machine_ms:27.2f} {bare.machine_ms:5.2f}"
                            )
                            lines.append(f"    CPU ms/event by group: ours {d.split()}")
                            lines.append(f"                           bare {bare.split()}")
                            print("\n".join(lines[-3:]), flush=True)
                    slowest = min(max(d.rate for d, _ in runs[n]) for n in runs)
                    rate = min(args.rate, 0.9 * slowest)
                    sustained["bare"] = this.bare_sustained(this_conn, rate)
                    for name in ("this", "rev") if i % 2 == 0 else ("rev", "this"):
                        with benches[name].running():
                            s = benches[name].ours_sustained(conns[name], senders[name], rate)
                        sustained[name] = s
                finally:
                    stop(downstream)
                means = compare(args.against, runs, sustained)
                lines += means
                print("\n".join(means), flush=True)
    finally:
        for name, b in benches.items():
            drop(DB if name == "this" else f"{DB}_rev")
            b.broker.flushdb()
            b.claims.flushdb()
        if made:
            remove_worktree(rev)
    return "\n".join(lines)


def compare(
    rev: str, runs: dict[str, list[tuple[Drain, Drain]]], sustained: dict[str, Sustained]
) -> list[str]:
    """The means of each tree's runs and this tree's ratio to REV's."""

    def mean(name: str, f: Callable[[Drain, Drain], float]) -> float:
        return statistics.fmean(f(d, bare) for d, bare in runs[name])

    lines = []
    for label, f, note in (
        ("ours/bare events/s", lambda d, b: d.rate / b.rate, ""),
        ("ours events/s", lambda d, b: d.rate, ""),
        ("worker CPU ms/event", lambda d, b: d.cpu_ms, ": below 1 is cheaper"),
        ("machine CPU ms/event", lambda d, b: d.machine_ms, ": below 1 is cheaper"),
        ("ours/bare worker CPU per event", lambda d, b: d.cpu_ms / b.cpu_ms, ""),
    ):
        this, other = mean("this", f), mean("rev", f)
        lines.append(
            f"  mean {label}: {this:.2f} against {rev}'s {other:.2f} ({this / other:.2f}x{note})"
        )
    s = sustained
    lines += [
        f"  sustained at {s['this'].offered:.0f} events/s offered: receipt->succeeded p50 / p99"
        f" this tree {s['this'].p50_ms:.0f} / {s['this'].p99_ms:.0f} ms"
        f" ({s['this'].done_rate:.0f} done/s), {rev} {s['rev'].p50_ms:.0f} /"
        f" {s['rev'].p99_ms:.0f} ms ({s['rev'].done_rate:.0f} done/s)",
        f"    2xx->committed p99 this tree {_commit(s['this'])}, {rev} {_commit(s['rev'])}",
        f"    bare publish->answered p50 / p99 {s['bare'].p50_ms:.0f} / {s['bare'].p99_ms:.0f} ms"
        f" ({s['bare'].done_rate:.0f} done/s)",
    ]
    return lines


def report(
    delay: int,
    bare: list[Drain],
    ours: list[Drain],
    best_bare: Drain,
    best_ours: Drain,
    s_bare: Sustained,
    s_ours: Sustained,
) -> list[str]:
    def rounds(ds: list[Drain]) -> str:
        return ", ".join(f"{d.rate:.0f}" for d in ds)

    return [
        "",
        f"downstream delay {delay} ms",
        "  drain      events/s (best; rounds)   CPU ms/event   worker RSS MiB   machine CPU ms/event",
        f"  ours       {best_ours.rate:8.0f} ({rounds(ours)})"
        f"{best_ours.cpu_ms:>18.2f}{best_ours.rss:>17.0f}{best_ours.machine_ms:>23.2f}",
        f"  bare       {best_bare.rate:8.0f} ({rounds(bare)})"
        f"{best_bare.cpu_ms:>18.2f}{best_bare.rss:>17.0f}{best_bare.machine_ms:>23.2f}",
        f"  CPU ms/event by group: ours {best_ours.split()}",
        f"                         bare {best_bare.split()}",
        f"  ratio ours/bare: {best_ours.rate / best_bare.rate:.2f} events/s, "
        f"{best_ours.cpu_ms / best_bare.cpu_ms:.2f} CPU per event",
        f"  ours with its worker's boot counted (the measure before session 9): "
        f"{best_ours.rate_with_boot:.0f} events/s, {best_ours.cpu_ms_with_boot:.2f} CPU ms/event, "
        f"ratio {best_ours.rate_with_boot / best_bare.rate:.2f}; boot {best_ours.boot_s:.2f} s, "
        f"{best_ours.boot_cpu_s:.2f} CPU s",
        f"  sustained at {s_ours.offered:.0f} events/s offered for the run's seconds: "
        f"ours {s_ours.done_rate:.0f} done/s, receipt->succeeded p50 {s_ours.p50_ms:.0f} ms "
        f"p99 {s_ours.p99_ms:.0f} ms ({s_ours.count} events), 2xx->committed p99 "
        f"{_commit(s_ours)}",
        f"                 bare {s_bare.done_rate:.0f} done/s, publish->downstream answered "
        f"p50 {s_bare.p50_ms:.0f} ms p99 {s_bare.p99_ms:.0f} ms ({s_bare.count} events)",
        "",
    ]


if __name__ == "__main__":
    main()

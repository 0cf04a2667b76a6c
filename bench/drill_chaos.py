#!/usr/bin/env python3
"""The single-host chaos drill (issue 32): every process on one host, faults to the processes.

Everything runs on ONE host: a network namespace the drill creates (``whd-chaos``), in which
every process of the pipeline and its services listens on the namespace's own loopback. That
is one host with a private network: the standard ports (Postgres 5432, Redis 6379, the
receiver's 8000) are free in it whatever the machine runs, the machine's shared Postgres and
Redis (which the tests use) cannot be reached from it, no traffic leaves it, and cleaning up
is killing ``ip netns pids whd-chaos`` and deleting the namespace (no process can escape it).
It shares ``bench/drill_hosts.py``'s pieces, its ``whd-`` prefix and its lock (one drill at a
time on a machine), so either drill removes what the other left after a crash.

    postgres     a private cluster (initdb into a temporary directory), 127.0.0.1:5432
    redis        a private redis-server, 127.0.0.1:6379: broker (db 0), claim tier (db 1)
    downstream   records every call (Idempotency-Key, event id, arrival, answer, and the
                 calling process, found from the connection's socket in /proc), 200 after 20 ms
    receiver     ``webhooks serve`` (one process)
    w1, w2       ``celery -A tasks worker -P threads -c 16`` (each runs its dispatcher thread)
    beat         ``celery -A tasks beat`` (sweeper, maintenance)
    sender       a provider-like sender: Stripe-signed events at 40/s, retried on non-2xx,
                 connection errors and its 10 s timeout (backoff 0.5 s to 16 s, jittered),
                 plus re-sends of 10% of the events it already had a 2xx for (1-8 s after),
                 as providers do: each must be answered from the record (200 duplicate)

Budgets are drill_hosts' shortened by one second so that an 18 s freeze outlasts a lease:
handler I/O 2 s < soft 3 s < hard 4 s < lease (4 x hard) 16 s < visibility 60 s, record retry
8 s, sweep every 2 s, publish grace 5 s.

The faults, each on a schedule while events flow (``--faults`` picks some): FLUSHDB of the
claim tier and of the broker, every database connection terminated (pg_terminate_backend),
redis-server paused 5 s (SIGSTOP/SIGCONT), kill -9 of each worker process and of the receiver
(each started again 1 s later, as a supervisor would; a worker is killed the moment the
downstream sees a call of its), a worker frozen 18 s with a call in flight (SIGSTOP of its
process, longer than its lease), a Postgres crash (SIGQUIT of the postmaster: immediate
shutdown, then started again, crash recovery). Run as root::

    make drill-chaos                                  # 2,200 events, every fault, ~2.5 min
    make drill-chaos DRILL_ARGS=--short               # 1,600 events, every fault, <= 3 min
    .venv/bin/python bench/drill_chaos.py --faults pg-crash,flush-broker

The report (``bench/results_drill_chaos.txt``, the timeline ``bench/drill_chaos.png``) gives
per fault the events accepted, lost, called downstream more than once, and the latency while
it held and after; every repeat with each call's time, the commit's time and its named window
from the pipeline's own records (attempts and their committed_at, ``delivery.lease_taken_over``
and ``delivery.record_abandoned`` log lines, ``webhooks_repeat_windows_total``). Exit 1 if an
acknowledged event was lost. docs/reliability.md says what each fault means for an operator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drill_hosts import (
    PG_BIN,
    PG_PORT,
    PYTHON,
    REDIS_PORT,
    ROOT,
    VENV_BIN,
    Cluster,
    Fault,
    Proc,
    database_url,
    drain,
    fmt_ms,
    http_ok,
    in_ns,
    interrupts_as_exceptions,
    now,
    our_namespaces,
    pct,
    pipeline_env,
    psql,
    read_jsonl,
    run,
    serve_downstream,
    start_postgres,
    start_redis,
    stripe_headers,
    teardown_network,
    wait_for,
)
from drill_hosts import (
    setup_database as setup_pipeline_database,
)

HOST = "chaos"  # the one host: network namespace whd-chaos
NS = "whd-" + HOST
LOOPBACK = "127.0.0.1"
RECEIVER_PORT = 8000
DOWN_PORT = 9000
WORKERS = ("w1", "w2")
# Budgets: handler I/O 2 s < soft 3 s < hard 4 s < lease (4 x hard) 16 s < visibility 60 s.
HARD_LIMIT = 4.0
LEASE = 4 * HARD_LIMIT
SENDER_TIMEOUT = 10.0
RESTART_AFTER = 1.0  # a supervisor's restart delay
FREEZE = 18.0
REDIS_PAUSE = 5.0
RESEND_SHARE = 0.10

# The named windows (issue 32): the only ways a delivery may reach its downstream twice.
COMMIT_IMPOSSIBLE = "2xx received, commit impossible"
LEASE_TAKEN_OVER = "lease taken over"
ANSWER_TIMED_OUT = "answer timed out"
UNATTRIBUTED = "UNATTRIBUTED"
# Faults after which the floor allows no repeat at all.
ZERO_REPEAT_FAULTS = ("flush-claims", "flush-broker", "terminate-connections", "pg-crash")

# Offsets (s from the sender's start) of each fault: full 2,200 events (55 s), short 1,600
# (40 s). The four the floor wants alone (no repeat after any of them) are 5 s (short 3 s)
# apart from any other; the workers are killed one after the other, then w2 is frozen once it
# calls again, and the receiver is killed while w2 is frozen (it touches neither the workers
# nor the database).
FULL_SCHEDULE = {
    "flush-claims": 8.0,
    "flush-broker": 13.0,
    "terminate-connections": 18.0,
    "pg-crash": 23.0,
    "redis-pause": 29.0,
    "kill-worker-1": 38.0,
    "kill-worker-2": 42.0,
    "freeze-worker": 46.0,
    "kill-receiver": 50.0,
}
SHORT_SCHEDULE = {
    "flush-claims": 4.0,
    "flush-broker": 7.0,
    "terminate-connections": 10.0,
    "pg-crash": 13.0,
    "redis-pause": 17.0,
    "kill-worker-1": 24.0,
    "kill-worker-2": 27.0,
    "freeze-worker": 30.0,
    "kill-receiver": 33.0,
}


def ns_run(*cmd: str) -> str:
    return run(in_ns(HOST, *cmd), quiet=True)


def redis_cli(*args: str) -> str:
    return ns_run("redis-cli", "-h", LOOPBACK, "-p", str(REDIS_PORT), *args)


def sql(statement: str) -> str:
    return psql(statement, HOST, LOOPBACK)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (from /proc's parent links)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                children[int(stat.rpartition(")")[2].split()[1])].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


@dataclass
class ChaosCluster(Cluster):
    """drill_hosts' Cluster on one host: processes told apart by name, and every start of a
    pipeline process with a metrics directory of its own (a worker empties its directory's
    parent of dead workers' files at start, which would drop a killed worker's counts)."""

    name_of_pid: dict[int, str] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)
    # Faults run in threads of their own while the main thread restarts what exits.
    lock: threading.RLock = field(default_factory=threading.RLock)

    def check_exits(self, t0: float) -> None:
        with self.lock:
            super().check_exits(t0)

    def start(self, proc: Proc, extra_env: dict[str, str] | None = None) -> None:
        with self.lock:
            self._start(proc, extra_env)

    def _start(self, proc: Proc, extra_env: dict[str, str] | None) -> None:
        extra = dict(extra_env or {})
        if proc.name in (*WORKERS, "receiver", "beat"):
            directory = self.tmp / "metrics" / f"{proc.name}-{self.starts[proc.name]}"
            directory.mkdir(parents=True)
            extra["WEBHOOKS_METRICS_DIR"] = str(directory)
        self.starts[proc.name] += 1
        super().start(proc, extra)
        assert proc.popen is not None
        self.name_of_pid[proc.popen.pid] = proc.name

    def named(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def pid(self, name: str) -> int:
        popen = self.named(name).popen
        assert popen is not None
        return popen.pid

    def signal_proc(self, name: str, sig: int) -> None:
        proc = self.named(name)
        if proc.popen is None:
            return
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.ended_by_drill.add(proc.popen.pid)
        # The process itself at once (a worker is killed with a call in flight: its answer
        # comes 20 ms later), then anything under it (a scan of /proc takes a while).
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, sig)
        for pid in descendants(proc.popen.pid)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self, name: str) -> None:
        self.signal_proc(name, signal.SIGKILL)
        popen = self.named(name).popen
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(5)


# ---------------------------------------------------------------------------------------------
# The faults.


def postmaster_pid(c: ChaosCluster) -> int:
    return int((c.tmp / "pgdata" / "postmaster.pid").read_text().split()[0])


def pg_ready() -> bool:
    probe = in_ns(
        HOST, str(PG_BIN / "pg_isready"), "-h", LOOPBACK, "-p", str(PG_PORT), "-U", "postgres"
    )
    return subprocess.run(probe, check=False, capture_output=True).returncode == 0


def make_faults(c: ChaosCluster) -> dict[str, Fault]:
    def nothing(_: ChaosCluster) -> None:
        return None

    def flush(db: str) -> Callable[[ChaosCluster], None]:
        return lambda _: (redis_cli("-n", db, "FLUSHDB"), None)[1]

    def terminate(_: ChaosCluster) -> None:
        out = sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        by_name["terminate-connections"].what += f" ({out.strip()} terminated)"

    def kill(name: str) -> Callable[[ChaosCluster], None]:
        return lambda cl: cl.kill(name)

    def start(name: str) -> Callable[[ChaosCluster], None]:
        return lambda cl: cl.start(cl.named(name))

    def sig(name: str, signum: int) -> Callable[[ChaosCluster], None]:
        return lambda cl: cl.signal_proc(name, signum)

    def crash_pg(cl: ChaosCluster) -> None:
        proc = cl.named("postgres")
        assert proc.popen is not None
        cl.ended_by_drill.add(proc.popen.pid)
        os.kill(postmaster_pid(cl), signal.SIGQUIT)  # immediate shutdown: no checkpoint
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(15)

    def start_pg(cl: ChaosCluster) -> None:
        cl.start(cl.named("postgres"))
        wait_for("postgres after its crash", pg_ready, 60)

    faults = [
        Fault("flush-claims", HOST, 0, "FLUSHDB of the claim tier (redis db 1: fast claims, admission)",
              flush("1"), nothing),
        Fault("flush-broker", HOST, 0, "FLUSHDB of the broker (redis db 0: queued messages)",
              flush("0"), nothing),
        Fault("terminate-connections", HOST, 0, "pg_terminate_backend of every client connection",
              terminate, nothing),
        Fault("pg-crash", HOST, RESTART_AFTER, "Postgres crashed (SIGQUIT of the postmaster: immediate"
              " shutdown), started again 1 s after it exited (crash recovery)", crash_pg, start_pg),
        Fault("redis-pause", HOST, REDIS_PAUSE, "redis-server paused 5 s (SIGSTOP, SIGCONT)",
              lambda cl: cl.signal_proc("redis", signal.SIGSTOP),
              lambda cl: cl.signal_proc("redis", signal.SIGCONT)),
        Fault("kill-worker-1", "w1", RESTART_AFTER, "kill -9 of worker w1 the moment the downstream"
              " sees a call of its, started again 1 s later", kill("w1"), start("w1"), when_busy=True),
        Fault("freeze-worker", "w2", FREEZE, f"worker w2 frozen {FREEZE:.0f} s (SIGSTOP), past its lease"
              f" ({LEASE:.0f} s), the moment the downstream sees a call of its", sig("w2", signal.SIGSTOP),
              sig("w2", signal.SIGCONT), when_busy=True),
        Fault("kill-receiver", "receiver", RESTART_AFTER, "kill -9 of the receiver, started again 1 s later",
              kill("receiver"), start("receiver")),
        Fault("kill-worker-2", "w2", RESTART_AFTER, "kill -9 of worker w2 the moment the downstream"
              " sees a call of its, started again 1 s later", kill("w2"), start("w2"), when_busy=True),
    ]  # fmt: skip
    by_name = {f.name: f for f in faults}
    return by_name


# ---------------------------------------------------------------------------------------------
# Setup.


def chaos_env(tmp: Path, concurrency: int) -> dict[str, str]:
    return {
        **pipeline_env(tmp, concurrency, "redis"),
        "WEBHOOKS_DATABASE_URL": database_url(LOOPBACK, PG_PORT),
        "WEBHOOKS_REDIS_URL": f"redis://{LOOPBACK}:{REDIS_PORT}/1",
        "WEBHOOKS_BROKER_URL": f"redis://{LOOPBACK}:{REDIS_PORT}/0",
        "WEBHOOKS_HANDLER_IO_TIMEOUT": "2",
        "WEBHOOKS_SOFT_TIME_LIMIT": "3",
        "WEBHOOKS_HARD_TIME_LIMIT": str(HARD_LIMIT),
    }


def setup_database(c: ChaosCluster) -> None:
    setup_pipeline_database(c, HOST, f"http://{LOOPBACK}:{DOWN_PORT}/hook")


def start_pipeline(c: ChaosCluster, concurrency: int) -> None:
    logs = c.tmp / "logs"
    py, me = str(PYTHON), str(Path(__file__).resolve())
    c.start(Proc(HOST, "downstream", [py, me, "downstream", "--out", str(c.tmp / "downstream.jsonl")],
                 dict(os.environ), logs / "downstream.log"))  # fmt: skip
    serve = [str(VENV_BIN / "webhooks"), "serve", "--host", LOOPBACK, "--port", str(RECEIVER_PORT)]
    c.start(Proc(HOST, "receiver", serve, c.env, logs / "receiver.log"))
    for name in WORKERS:
        cmd = [str(VENV_BIN / "celery"), "-A", "tasks", "worker", "-Q", "deliveries,maintenance",
               "-P", "threads", "-c", str(concurrency), "-n", f"worker@{name}",
               "--loglevel", "WARNING"]  # fmt: skip
        c.start(Proc(HOST, name, cmd, c.env, logs / f"{name}.log"))
    cmd = [str(VENV_BIN / "celery"), "-A", "tasks", "beat", "-s", str(c.tmp / "beat-schedule"),
           "--loglevel", "WARNING"]  # fmt: skip
    c.start(Proc(HOST, "beat", cmd, c.env, logs / "beat.log"))
    base = f"http://{LOOPBACK}"
    wait_for("receiver", lambda: http_ok(HOST, f"{base}:{RECEIVER_PORT}/healthz"), 60)
    wait_for("downstream", lambda: http_ok(HOST, f"{base}:{DOWN_PORT}/"), 20)


# ---------------------------------------------------------------------------------------------
# Which worker made a downstream call: the downstream records the caller's port (nothing
# more: a lookup in its request path slowed its answers past the handlers' I/O timeout), and
# the drill maps ports to workers from the workers' own sockets.


class PortOwners:
    """Local port -> worker, from each worker process's sockets (/proc/<pid>/fd) and its
    namespace's TCP table (/proc/<pid>/net/tcp): sampled every 50 ms and on demand. The
    forward handler opens a connection per call (20 ms here), so a sample sees some calls
    only: a call is named only by a sighting of its port while it was open, else ``?``."""

    def __init__(self, c: ChaosCluster) -> None:
        self.c = c
        self.owner: dict[int, str] = {}
        self.sightings: dict[int, list[tuple[float, str]]] = defaultdict(list)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="port-owners", daemon=True)

    def sample(self, names: Sequence[str] = WORKERS) -> None:
        for name in names:
            popen = self.c.named(name).popen
            if popen is None or popen.poll() is not None:
                continue
            try:
                fds = list(Path(f"/proc/{popen.pid}/fd").iterdir())
                table = Path(f"/proc/{popen.pid}/net/tcp").read_text().splitlines()[1:]
            except OSError:
                continue
            held = set()
            for fd in fds:
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
            for line in table:
                parts = line.split()
                if int(parts[2].rpartition(":")[2], 16) == DOWN_PORT and (
                    f"socket:[{parts[9]}]" in held
                ):
                    port = int(parts[1].rpartition(":")[2], 16)
                    self.owner[port] = name
                    self.sightings[port].append((now(), name))

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.sample()

    def name(self, peer: str) -> str:
        port = peer.removeprefix("port:")
        return self.owner.get(int(port), "?") if port.isdigit() else "?"

    def caller(self, call: dict[str, Any]) -> str:
        """The worker seen holding the call's port while the call was open, else ``?``."""
        port = call["peer"].removeprefix("port:")
        seen = self.sightings.get(int(port), []) if port.isdigit() else []
        names = {n for t, n in seen if call["t"] - 0.05 <= t <= call["t_resp"] + 0.05}
        return names.pop() if len(names) == 1 else "?"

    def wait_call_from(self, name: str, arrivals: Path, timeout: float) -> bool:
        """Until the downstream logs a call's arrival from worker ``name`` (True), or
        ``timeout``: the moment to kill or freeze it with a call in flight."""
        deadline = now() + timeout
        with arrivals.open() as log:
            log.seek(0, os.SEEK_END)
            pending = ""
            while now() < deadline:
                pending += log.read()
                *lines, pending = pending.split("\n")
                peers = [line.rpartition(" ")[2] for line in lines]
                if peers and any(self.name(peer) == name for peer in peers):
                    return True
                if peers:
                    self.sample([name])
                    if any(self.name(peer) == name for peer in peers):
                        return True
                time.sleep(0.001)
        return False


# ---------------------------------------------------------------------------------------------
# The sender: a provider, with its retries and its re-sends of acknowledged events.


async def send_events(
    url: str, path: str, rate: float, total: int, start_at: float, out: Path, give_up_at: float,
    resend_share: float, seed: int,
) -> None:  # fmt: skip
    import httpx  # noqa: PLC0415  (only the sender needs it)

    secret = os.environ["WHD_SECRET"]
    rng = random.Random(seed)  # noqa: S311
    resend = set(rng.sample(range(total), int(total * resend_share)))
    sink = out.open("a", buffering=1)
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=50)
    client = httpx.AsyncClient(base_url=url, timeout=SENDER_TIMEOUT, limits=limits)

    async def deliver(event_id: str, body: bytes, kind: str) -> bool:
        tries = 0
        while True:
            t0 = now()
            status, error, answer = 0, "", ""
            try:
                resp = await client.post(path, content=body, headers=stripe_headers(secret, body))
                status = resp.status_code
                with contextlib.suppress(ValueError, AttributeError):
                    answer = str(resp.json().get("status", ""))
            except httpx.TimeoutException:
                error = "timeout"
            except httpx.HTTPError as exc:
                error = type(exc).__name__
            ok = 200 <= status < 300
            sink.write(json.dumps({"event": event_id, "kind": kind, "try": tries, "t0": t0,
                                   "t1": now(), "status": status, "answer": answer,
                                   "error": error, "ok": ok}) + "\n")  # fmt: skip
            if ok:
                return True
            tries += 1
            if now() > give_up_at:
                return False
            await asyncio.sleep(min(16.0, 0.5 * 2**tries) * (0.5 + rng.random() / 2))

    async def one(n: int) -> None:
        event_id = f"evt_drill_{n:06d}"
        body = json.dumps(
            {"id": event_id, "object": "event", "api_version": "2024-06-20", "created": int(now()),
             "type": "invoice.paid", "livemode": False, "pending_webhooks": 1,
             "data": {"object": {"id": f"in_{n}", "object": "invoice", "amount_due": 100}}},
            indent=2,
        ).encode()  # fmt: skip
        if await deliver(event_id, body, "send") and n in resend:
            # A provider that did not see our 2xx (or resends anyway) sends the same event again.
            await asyncio.sleep(1 + 7 * rng.random())
            await deliver(event_id, body, "resend")

    tasks: list[asyncio.Task[None]] = []
    for n in range(total):
        delay = start_at + n / rate - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    await client.aclose()
    sink.close()


# ---------------------------------------------------------------------------------------------
# What happened.


def db_dump() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    deliveries = sql(
        "SELECT coalesce(json_agg(x), '[]') FROM (SELECT d.id, d.status, d.attempts,"
        " r.event_id AS event, extract(epoch FROM r.received_at)::float8 AS received,"
        " extract(epoch FROM d.succeeded_at)::float8 AS succeeded"
        " FROM deliveries d JOIN receipts r ON r.id = d.receipt_id) x"
    )
    attempts = sql(
        "SELECT coalesce(json_agg(x), '[]') FROM (SELECT a.delivery_id AS delivery, a.number,"
        " a.worker, a.outcome, a.error_class AS error, left(a.error_message, 40) AS message,"
        " extract(epoch FROM a.started_at)::float8 AS started,"
        " extract(epoch FROM a.ended_at)::float8 AS ended,"
        " extract(epoch FROM a.committed_at)::float8 AS committed FROM attempts a) x"
    )
    receipts = sql(
        "SELECT coalesce(json_object_agg(event_id, n), '{}') FROM"
        " (SELECT event_id, count(*) AS n FROM receipts GROUP BY event_id) x"
    )
    return json.loads(deliveries or "[]"), json.loads(attempts or "[]"), json.loads(receipts)


def not_succeeded() -> int | None:
    try:
        return int(sql("SELECT count(*) FROM deliveries WHERE status <> 'succeeded'").strip())
    except (RuntimeError, ValueError):
        return None


def read_logs(logs: Path) -> list[dict[str, Any]]:
    """Every JSON line of the pipeline's processes, with its process (``proc``) and epoch."""
    from datetime import datetime  # noqa: PLC0415

    out = []
    for name in (*WORKERS, "receiver", "beat"):
        path = logs / f"{name}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                row = json.loads(line)
                row["proc"] = name
                row["at"] = datetime.fromisoformat(row["timestamp"]).timestamp()
                out.append(row)
    return out


def read_counters(metrics: Path, family: str, label: str) -> Counter[str]:
    """A counter summed over every process start's multi-process files, by one label."""
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

    total: Counter[str] = Counter()
    for directory in sorted(metrics.glob("*")):
        for path in [directory, *directory.glob("*")]:
            if not path.is_dir() or not any(path.glob("*.db")):
                continue
            for metric in MultiProcessCollector(None, path=str(path)).collect():
                for sample in metric.samples:
                    if sample.name == family:
                        total[sample.labels.get(label, "")] += int(sample.value)
    return total


def leaks(c: ChaosCluster) -> list[str]:
    """Log lines that carry a secret or an event's payload (there must be none)."""
    needles = {"source secret": c.secret, "secret key": c.env["WEBHOOKS_SECRET_KEY"],
               "payload": '"amount_due"', "payload (escaped)": '\\"amount_due\\"'}  # fmt: skip
    found = []
    for path in sorted((c.tmp / "logs").glob("*.log")):
        if path.stem in ("sender", "downstream"):
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.name}: {what}" for what, needle in needles.items() if needle in text]
    return found


@dataclass
class Outcome:
    text: str
    lost: int
    accepted: int
    repeats: int
    series: dict[str, Any]


def attribute(
    d: dict[str, Any], atts: list[dict[str, Any]], logs: list[dict[str, Any]]
) -> tuple[str, list[str]]:
    """The named window of a repeated delivery, from what the pipeline recorded: a success
    whose commit was abandoned (record_abandoned) and then taken over, a lease taken over from
    a lost worker (the earlier attempt crashed, delivery.lease_taken_over), or a retry after an
    answer that timed out."""
    did = d["id"]
    abandoned = [r for r in logs if r["event"] == "delivery.record_abandoned"
                 and did in (r.get("delivery_ids") or [])]  # fmt: skip
    taken = [r for r in logs if r["event"] == "delivery.lease_taken_over"
             and r.get("delivery_id") == did]  # fmt: skip
    crashed = [a for a in atts if a["outcome"] == "crashed"]
    timed_out = [a for a in atts if a["outcome"] == "retry" and (
        a["error"] == "SoftTimeLimitExceeded"
        or (a["message"] or "").startswith(("timeout:", "hard_time_limit:")))]  # fmt: skip
    evidence = [f"{r['proc']} {r['event']} {r.get('action', '')} tries={r.get('tries')}"
                for r in abandoned]  # fmt: skip
    evidence += [f"{r['proc']} delivery.lease_taken_over attempt={r.get('attempt')}" for r in taken]
    evidence += [f"{r['proc']} {r['event']} attempt={r.get('attempt')}" for r in logs
                 if r["event"] in ("delivery.lease_lost", "delivery.fenced") and r.get("delivery_id") == did]  # fmt: skip
    if abandoned and (crashed or taken):
        return COMMIT_IMPOSSIBLE, evidence
    if crashed and taken:
        return LEASE_TAKEN_OVER, evidence
    if timed_out:
        return ANSWER_TIMED_OUT, [*evidence, f"attempt {timed_out[0]['number']} timed out"]
    if crashed:
        return LEASE_TAKEN_OVER + " (attempt crashed, no log line)", evidence
    return UNATTRIBUTED, evidence


def analyse(
    t0: float, faults: list[Fault], c: ChaosCluster, args: argparse.Namespace, owners: PortOwners
) -> Outcome:
    tmp = c.tmp

    def proc_of(worker: str | None) -> str:
        pid = (worker or "").rpartition(":")[2]
        return c.name_of_pid.get(int(pid), worker or "?") if pid.isdigit() else worker or "?"

    def caller(call: dict[str, Any]) -> str:
        return owners.caller(call)

    def rel(t: float | None) -> str:
        return "-" if t is None else f"{t - t0:.2f}s"

    tries = read_jsonl(tmp / "sender.jsonl")
    calls = sorted(read_jsonl(tmp / "downstream.jsonl"), key=lambda x: x["t"])
    # A call whose body was cut off (its worker killed while sending it) has no readable event
    # id: its key names the event (another call of the key carries it).
    event_of_key = {x["key"]: x["event"] for x in calls if x["event"]}
    for x in calls:
        x["cut"] = not x["event"]
        x["event"] = x["event"] or event_of_key.get(x["key"], "")
    deliveries, attempts, receipts = db_dump()
    logs = read_logs(tmp / "logs")
    windows_metric = read_counters(tmp / "metrics", "webhooks_repeat_windows_total", "cause")
    duplicates_logged = sum(
        1 for r in logs if r["event"] == "webhook" and r.get("outcome") == "duplicate"
    )

    accepted: dict[str, float] = {}
    offered: set[str] = set()
    failed_tries: Counter[str] = Counter()
    resends: Counter[str] = Counter()
    resent: dict[str, dict[str, Any]] = {}
    for tr in tries:
        if tr["kind"] == "send":
            offered.add(tr["event"])
            if tr["ok"]:
                accepted.setdefault(tr["event"], tr["t1"])
        elif tr["ok"]:
            resent[tr["event"]] = tr
            resends[f"{tr['status']} {tr['answer']}"] += 1
        if not tr["ok"]:
            failed_tries[tr["error"] or str(tr["status"])] += 1
    # A try the sender saw fail (a 503, a receiver killed before it answered) whose receipt was
    # committed: its next try is answered from the record.
    first_dup = sum(
        1 for tr in tries if tr["kind"] == "send" and tr["ok"] and tr["answer"] == "duplicate"
    )
    resends_unanswered = len({tr["event"] for tr in tries if tr["kind"] == "resend"} - set(resent))
    by_event = {d["event"]: d for d in deliveries}
    attempts_of: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for a in sorted(attempts, key=lambda a: a["number"]):
        attempts_of[a["delivery"]].append(a)
    calls_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    keys_of_event: dict[str, set[str]] = defaultdict(set)
    for call in calls:
        calls_of[call["key"]].append(call)
        keys_of_event[call["event"]].add(call["key"])
    first_call = {ev: min(calls_of[k][0]["t"] for k in keys) for ev, keys in keys_of_event.items()}
    latency = {ev: t - by_event[ev]["received"] for ev, t in first_call.items()
               if ev in by_event and by_event[ev]["received"] is not None}  # fmt: skip
    lost_db = sorted(ev for ev in accepted if by_event.get(ev, {}).get("status") != "succeeded")
    lost_down = sorted(ev for ev in accepted if ev not in first_call)
    lost = sorted(set(lost_db) | set(lost_down))
    repeats = {k: v for k, v in calls_of.items() if len(v) > 1}
    multi_key = sorted(ev for ev, keys in keys_of_event.items() if len(keys) > 1)
    multi_receipt = sorted(ev for ev, n in receipts.items() if n > 1)
    late = [call for call in calls if (d := by_event.get(call["event"])) is not None
            and d["succeeded"] is not None and call["t"] > d["succeeded"] + 0.01]  # fmt: skip
    # 2xx -> committed: the succeeded attempt's commit against the downstream's last answer.
    lag: list[float] = []
    for ev, d in by_event.items():
        won = [a for a in attempts_of.get(d["id"], []) if a["outcome"] == "succeeded"]
        answered = [x["t_resp"] for k in keys_of_event.get(ev, ()) for x in calls_of[k]]
        if won and won[-1]["committed"] and answered:
            # The winning attempt's own call (a lost worker's earlier answer is not its 2xx).
            before = [
                t for t in answered if won[-1]["started"] - 0.05 <= t <= won[-1]["committed"] + 0.05
            ]
            if before:
                lag.append(max(0.0, won[-1]["committed"] - max(before)))

    windows = [(f.name, f.applied_at, max(f.reverted_at, f.applied_at + 0.5)) for f in faults]

    def fault_of(first: float, second: float) -> str:
        for name, a, b in windows:  # held when the first call was made
            if a - 0.5 <= first <= b:
                return name
        best = "no fault"  # else: the latest fault whose lease-long aftermath holds the second
        for name, a, b in windows:
            if a <= second <= b + LEASE + 10:
                best = name
        return best

    repeat_rows = []
    for key, key_calls in sorted(repeats.items(), key=lambda kv: kv[1][0]["t"]):
        d = by_event.get(key_calls[0]["event"], {})
        atts = attempts_of.get(int(d.get("id") or 0), [])
        window, evidence = attribute(d, atts, logs) if d else (UNATTRIBUTED, [])
        if d.get("succeeded") and any(x["t"] > d["succeeded"] + 0.01 for x in key_calls):
            window += " (a call sent after the success committed: the lost worker's, on its return)"
        repeat_rows.append((key, key_calls, d, atts, window, evidence,
                            fault_of(key_calls[0]["t"], key_calls[1]["t"])))  # fmt: skip

    lines: list[str] = []
    p = lines.append
    n_acc = max(1, len(accepted))
    p(f"single-host chaos drill, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t0))}")
    p(f"one host (network namespace {NS}, loopback): postgres, redis (broker db 0, claim tier"
      f" db 1), downstream, receiver, workers w1 w2 ({args.concurrency} threads), beat, sender")  # fmt: skip
    p(f"lease {LEASE:.0f} s (hard limit {HARD_LIMIT:.0f} s), record retry 8 s; sender"
      f" {args.events} events at {args.rate:g}/s, timeout {SENDER_TIMEOUT:.0f} s, retries with"
      f" backoff, re-sends {RESEND_SHARE:.0%} of the acknowledged events 1-8 s after their 2xx")  # fmt: skip
    p("")
    p(
        f"offered {len(offered)}, accepted {len(accepted)}, not accepted {len(offered - set(accepted))}"
    )
    p(f"lost (accepted, not succeeded in the database or never called downstream): {len(lost)}"
      f" (not succeeded {len(lost_db)}, never called {len(lost_down)});"
      f" deliveries not succeeded at the end: {sum(1 for d in deliveries if d['status'] != 'succeeded')}")  # fmt: skip
    p(f"re-sends of acknowledged events: {sum(resends.values())} answered"
      f" ({', '.join(f'{k}: {n}' for k, n in sorted(resends.items()))}), {resends_unanswered} never"
      f" answered; first sends answered 200 duplicate after a failed try (its receipt had committed):"
      f" {first_dup}; the receiver's duplicate answers (log) {duplicates_logged}; events with more"
      f" than one receipt: {len(multi_receipt)}; events called under more than one key: {len(multi_key)}")  # fmt: skip
    p(f"downstream calls {len(calls)} for {len(calls_of)} keys; keys called more than once:"
      f" {len(repeats)} = {100 * len(repeats) / n_acc:.3f}% of accepted events"
      f" (floor 0.2%: {'met' if 100 * len(repeats) / n_acc <= 0.2 else 'NOT MET'});"
      f" resets seen by the downstream {sum(1 for x in calls if x['reset'])}")  # fmt: skip
    named = Counter(row[4] for row in repeat_rows)
    p("repeats by named window: " + (", ".join(f"{k} {n}" for k, n in named.items()) or "none")
      + f"; unattributed {named.get(UNATTRIBUTED, 0)}")  # fmt: skip
    p(f"webhooks_repeat_windows_total (windows opened, summed over every process start):"
      f" {dict(windows_metric) or 0}; delivery.lease_taken_over lines"
      f" {sum(1 for r in logs if r['event'] == 'delivery.lease_taken_over')},"
      f" delivery.record_abandoned lines {sum(1 for r in logs if r['event'] == 'delivery.record_abandoned')}")  # fmt: skip
    p(f"calls started after their delivery's success was committed: {len(late)}"
      + "".join(f"; {x['event']} at {rel(x['t'])} (success committed {rel(by_event[x['event']]['succeeded'])})" for x in late[:10]))  # fmt: skip
    p(f"sender's failed tries: {dict(failed_tries.most_common()) or 0}")
    all_lat = list(latency.values())
    p(f"latency receipt -> first downstream call: p50 {fmt_ms(pct(all_lat, 50))} ms,"
      f" p99 {fmt_ms(pct(all_lat, 99))} ms, max {fmt_ms(max(all_lat, default=math.nan))} ms")  # fmt: skip
    p(f"downstream 2xx -> success committed (attempts.committed_at): p50 {fmt_ms(pct(lag, 50))} ms,"
      f" p99 {fmt_ms(pct(lag, 99))} ms, max {fmt_ms(max(lag, default=math.nan))} ms")  # fmt: skip
    leaked = leaks(c)
    p(f"log lines with a secret or a payload: {len(leaked)}" + (f" ({', '.join(leaked)})" if leaked else ""))  # fmt: skip
    if c.exits:
        p("processes that exited by themselves (started again, as a supervisor would): "
          + "; ".join(f"{name} at {t:.1f}s, status {code}" for t, _, name, code in c.exits))  # fmt: skip
    p("")
    first_fault = min((a for _, a, _ in windows), default=t0 + args.events / args.rate)
    base = [latency[ev] for ev, t in accepted.items() if t < first_fault and ev in latency]
    p(
        f"before the first fault: latency p50 {fmt_ms(pct(base, 50))} ms, p99 {fmt_ms(pct(base, 99))} ms"
    )
    p("")
    p("per fault (times from the sender's start; during: events accepted from 1 s before the"
      " fault to its end, at least 1 s; after: from its end to 1 s before the next fault, at most 10 s;"
      " latency: receipt -> first downstream call)")  # fmt: skip
    p(
        "(no-2xx gap / no-call gap: the longest time without a 2xx to the sender / without a"
        " downstream call, from the fault to 10 s after its end)"
    )
    p(f"{'fault':22} {'at':>6} {'held':>5} {'acc':>4} {'failed':>6} {'lost':>4} {'rep':>3}"
      f" {'p50 ms':>7} {'p99 ms':>7} {'after p50':>9} {'after p99':>9} {'no-2xx gap':>10} {'no-call gap':>11}")  # fmt: skip
    ok_times = sorted(tr["t1"] for tr in tries if tr["ok"])
    call_times = sorted(x["t"] for x in calls)

    def longest_gap(times: list[float], a: float, b: float) -> float:
        inside = [a, *(t for t in times if a <= t <= b), b]
        return max(y - x for x, y in itertools.pairwise(inside))

    starts = sorted(f.applied_at for f in faults)
    rep_of_fault = Counter(row[6] for row in repeat_rows)
    per_fault_rows = []
    for f in faults:
        a, b = f.applied_at, max(f.reverted_at, f.applied_at + 1.0)
        nxt = min([s for s in starts if s > f.applied_at] + [b + 10.0])
        during = [ev for ev, t in accepted.items() if a - 1 <= t < b]
        after = [ev for ev, t in accepted.items() if b <= t < max(b, min(nxt - 1, b + 10.0))]
        lat_d = [latency[ev] for ev in during if ev in latency]
        lat_a = [latency[ev] for ev in after if ev in latency]
        failed = sum(1 for tr in tries if a <= tr["t0"] < b and not tr["ok"])
        n_lost = sum(1 for ev in lost if a - 1 <= accepted[ev] < b + 10)
        per_fault_rows.append((f.name, len(during), n_lost, rep_of_fault.get(f.name, 0)))
        p(f"{f.name:22} {a - t0:6.1f} {f.reverted_at - f.applied_at if f.reverted_at else 0:5.1f}"
          f" {len(during):4d} {failed:6d} {n_lost:4d} {rep_of_fault.get(f.name, 0):3d}"
          f" {fmt_ms(pct(lat_d, 50)):>7} {fmt_ms(pct(lat_d, 99)):>7} {fmt_ms(pct(lat_a, 50)):>9}"
          f" {fmt_ms(pct(lat_a, 99)):>9} {longest_gap(ok_times, a, b + 10):9.1f}s"
          f" {longest_gap(call_times, a, b + 10):10.1f}s")  # fmt: skip
    p(
        f"{'no fault':22} {'':>6} {'':>5} {'':>4} {'':>6} {'':>4} {rep_of_fault.get('no fault', 0):3d}"
    )
    for f in faults:
        p(f"  {f.name}: {f.what}")
    p("")
    zero = [f.name for f in faults if f.name in ZERO_REPEAT_FAULTS]
    bad_zero = [name for name in zero if rep_of_fault.get(name, 0)]
    p("against issue 32's floor:")
    p(
        f"  0 acknowledged events lost, every delivery succeeded: {'met' if not lost and not lost_db else 'NOT MET'}"
    )
    p(f"  repeats <= 0.2% of events: {100 * len(repeats) / n_acc:.3f}%,"
      f" {'met' if 100 * len(repeats) / n_acc <= 0.2 else 'NOT MET'}")  # fmt: skip
    p(
        f"  every repeat attributed to a named window: {'met' if not named.get(UNATTRIBUTED) else 'NOT MET'}"
    )
    p(f"  0 repeats after {', '.join(zero) or '(none run)'}: "
      + ("met" if not bad_zero else f"NOT MET ({', '.join(bad_zero)})"))  # fmt: skip
    p(
        f"  (also) 0 calls started after their delivery's success committed: {'met' if not late else f'NOT MET ({len(late)})'}"
    )
    p("")
    p("warnings and errors the pipeline logged from each fault to the next (process event xN):")
    for f in faults:
        a = f.applied_at
        nxt = min([s for s in starts if s > a] + [max(f.reverted_at, a) + 10.0])
        seen = Counter(f"{r['proc']} {r['event']}" for r in logs
                       if r.get("level") in ("warning", "error", "critical") and a <= r["at"] < nxt)  # fmt: skip
        p(f"  {f.name:22} " + (", ".join(f"{k} x{n}" for k, n in sorted(seen.items())) or "none"))
    p("")
    if repeat_rows:
        p("repeated downstream calls (same Idempotency-Key): calls (time, calling process, answer"
          " time), the success's commit, the attempts the database holds, the evidence in the logs:")  # fmt: skip
    for _key, key_calls, d, atts, window, evidence, fault in repeat_rows:
        p(f"- {key_calls[0]['event']} (delivery {d.get('id')}): {window}; fault {fault}")
        p("    calls: " + ", ".join(
            f"{rel(x['t'])} by {caller(x)} (2xx sent {rel(x['t_resp'])}{', reset' if x['reset'] else ''}{', body cut off' if x['cut'] else ''})"
            for x in key_calls) + f"; success committed {rel(d.get('succeeded'))}")  # fmt: skip
        for att in atts:
            p(f"    attempt {att['number']} on {proc_of(att['worker'])}: started {rel(att['started'])},"
              f" ended {rel(att['ended'])}, committed {rel(att['committed'])},"
              f" {att['outcome'] or 'open'}{' ' + att['error'] if att['error'] else ''}")  # fmt: skip
        for line in evidence:
            p(f"    log: {line}")
    if lost:
        p(f"lost events ({len(lost)}): " + ", ".join(
            f"{ev} ({by_event.get(ev, {}).get('status', 'no row')})" for ev in lost[:30]))  # fmt: skip
    succeeded_at = [d["succeeded"] for d in deliveries if d["succeeded"] is not None]
    series = {"t0": t0, "accepted": list(accepted.values()), "succeeded": succeeded_at,
              "latency": [(accepted[ev], latency[ev]) for ev in accepted if ev in latency],
              "windows": windows}  # fmt: skip
    return Outcome("\n".join(lines) + "\n", len(lost), len(accepted), len(repeats), series)


def plot(series: dict[str, Any], png: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415  (dev extra, only for the picture)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    t0: float = series["t0"]
    end = int(max([*series["accepted"], *series["succeeded"], t0 + 1]) - t0) + 2
    acc, ok = [0] * end, [0] * end
    lat: list[list[float]] = [[] for _ in range(end)]
    for t in series["accepted"]:
        acc[min(end - 1, max(0, int(t - t0)))] += 1
    for t in series["succeeded"]:
        ok[min(end - 1, max(0, int(t - t0)))] += 1
    for t, v in series["latency"]:
        lat[min(end - 1, max(0, int(t - t0)))].append(v)
    xs = list(range(end))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
    ax1.plot(xs, acc, label="accepted/s (2xx to the sender)", linewidth=0.9)
    ax1.plot(xs, ok, label="succeeded/s (success committed)", linewidth=0.9)
    ax1.set_ylabel("events/s")
    p99 = [pct(v, 99) * 1000 if v else math.nan for v in lat]
    ax2.plot(xs, p99, color="tab:red", linewidth=0.9,
             label="p99 latency by second accepted, receipt -> first downstream call")  # fmt: skip
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("seconds from the sender's start")
    colours = plt.get_cmap("tab10")
    for i, (name, a, b) in enumerate(series["windows"]):
        for ax in (ax1, ax2):
            ax.axvspan(a - t0, max(b, a + 0.4) - t0, color=colours(i % 10), alpha=0.25,
                       label=name if ax is ax1 else None)  # fmt: skip
    ax1.legend(loc="upper left", fontsize=7, ncol=4)
    ax2.legend(loc="upper left", fontsize=7)
    ax1.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The drill.


def run_faults(c: ChaosCluster, faults: list[Fault], t0: float, owners: PortOwners) -> None:
    """Each fault in a thread of its own (one waiting for a call in flight never delays
    another's revert): applied at its time (a when_busy one the moment the downstream sees a
    call of its worker, within 5 s), reverted its duration after it was applied. Meanwhile a
    process that exits by itself is started again, as a supervisor would."""
    errors: list[str] = []

    def one(f: Fault) -> None:
        try:
            time.sleep(max(0.0, t0 + f.start - now()))
            busy = ""
            if f.when_busy:
                seen = owners.wait_call_from(f.host, c.tmp / "arrivals.log", 5.0)
                busy = " (a call in flight)" if seen else " (no call of its seen within 5 s)"
                f.what += busy
            f.applied_at = now()
            f.apply(c)
            print(f"  {now() - t0:6.1f}s {f.name}{busy}", flush=True)
            time.sleep(max(0.0, f.applied_at + f.duration - now()))
            f.revert(c)
            f.reverted_at = now()
            if f.duration:
                print(f"  {now() - t0:6.1f}s {f.name} over", flush=True)
        except Exception as exc:
            errors.append(f"{f.name}: {type(exc).__name__}: {exc}")
            print(f"  {now() - t0:6.1f}s {f.name} FAILED: {exc}", flush=True)

    threads = [threading.Thread(target=one, args=(f,), name=f.name, daemon=True) for f in faults]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.1)
        c.check_exits(t0)
    if errors:
        raise RuntimeError("faults failed: " + "; ".join(errors))


def drill(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("the drill makes a network namespace: run it as root", file=sys.stderr)
        return 2
    schedule = SHORT_SCHEDULE if args.short else FULL_SCHEDULE
    chosen = list(schedule) if args.faults is None else [
        n.strip() for n in args.faults.split(",") if n.strip() not in ("", "none")]  # fmt: skip
    unknown = [n for n in chosen if n not in schedule]
    if unknown:
        print(f"unknown faults {unknown}; known: {', '.join(schedule)}", file=sys.stderr)
        return 2
    lock_file = (Path(tempfile.gettempdir()) / "whd-drill.lock").open("w")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another drill is running (it holds /tmp/whd-drill.lock)", file=sys.stderr)
        return 2
    leftovers = our_namespaces()
    if leftovers:
        print(f"removing leftovers of an earlier drill: {' '.join(leftovers)}", flush=True)
        teardown_network()
    tmp = Path(tempfile.mkdtemp(prefix="whd-chaos-"))
    tmp.chmod(0o755)
    (tmp / "logs").mkdir()
    (tmp / "arrivals.log").touch()
    c = ChaosCluster(tmp, chaos_env(tmp, args.concurrency))
    owners = PortOwners(c)
    t_begin = now()
    status = 1
    try:
        with interrupts_as_exceptions():
            print(f"drill: one host ({NS}), logs in {tmp / 'logs'}", flush=True)
            run(["ip", "netns", "add", NS])
            run(["ip", "-n", NS, "link", "set", "lo", "up"])
            start_postgres(c, HOST, LOOPBACK)
            start_redis(c, HOST, LOOPBACK)
            setup_database(c)
            start_pipeline(c, args.concurrency)
            faults_all = make_faults(c)
            faults = [faults_all[n] for n in chosen]
            for f in faults:
                f.start = schedule[f.name]
            t0 = now() + 3
            duration = args.events / args.rate
            give_up = t0 + duration + args.drain
            sender = Proc(HOST, "sender", [str(PYTHON), str(Path(__file__).resolve()), "sender",
                          "--url", f"http://{LOOPBACK}:{RECEIVER_PORT}", "--path", c.source_path,
                          "--rate", str(args.rate), "--events", str(args.events),
                          "--start-at", str(t0), "--give-up-at", str(give_up),
                          "--out", str(tmp / "sender.jsonl")],
                          {**os.environ, "WHD_SECRET": c.secret}, tmp / "logs" / "sender.log")  # fmt: skip
            c.start(sender)
            print(f"drill: pipeline up in {t0 - t_begin:.0f} s; sending {args.events} events at"
                  f" {args.rate:g}/s; faults: {', '.join(chosen) or 'none'}", flush=True)  # fmt: skip
            owners.thread.start()
            run_faults(c, faults, t0, owners)
            drain(c, sender, t0, args.drain, args.settle, not_succeeded, poll=1.0)
            owners.stop.set()
            outcome = analyse(t0, faults, c, args, owners)
            out_txt, out_png = Path(args.results), Path(args.png)
            out_txt.write_text(f"$ {' '.join(['bench/drill_chaos.py', *sys.argv[1:]])}\n" + outcome.text
                               + f"wall time {now() - t_begin:.0f} s\n")  # fmt: skip
            plot(outcome.series, out_png, f"single-host chaos drill: {args.events} events at {args.rate:g}/s"
                 f" (+{RESEND_SHARE:.0%} re-sends), lease {LEASE:.0f} s; accepted {outcome.accepted},"
                 f" lost {outcome.lost}, repeated {outcome.repeats}")  # fmt: skip
            print(outcome.text)
            print(f"wrote {out_txt} and {out_png} ({now() - t_begin:.0f} s); logs: {tmp / 'logs'}")
            status = 1 if outcome.lost else 0
    except KeyboardInterrupt:
        print("\ndrill interrupted: cleaning up", file=sys.stderr, flush=True)
        status = 130
    finally:
        owners.stop.set()
        with contextlib.suppress(Exception):  # thaw what a fault left stopped, then stop all
            for proc in c.procs:
                c.signal_proc(proc.name, signal.SIGCONT)
            c.stop_all()
        teardown_network()
        shutil.rmtree(tmp / "pgdata", ignore_errors=True)
        if our_namespaces():
            print(f"namespaces left behind: {our_namespaces()}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode")
    parser.add_argument(
        "--short", action="store_true", help="<= 3 minutes: 1,600 events, every fault"
    )
    parser.add_argument(
        "--faults", default=None, help="comma-separated faults, or none (default: all)"
    )
    parser.add_argument(
        "--events", type=int, default=None, help="events to send (2,200; short 1,600)"
    )
    parser.add_argument("--rate", type=float, default=40.0, help="events per second")
    parser.add_argument(
        "--drain", type=float, default=90.0, help="most seconds to wait for every delivery"
    )
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds for late calls after the drain"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="threads per worker")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results_drill_chaos.txt"))
    parser.add_argument("--png", default=str(ROOT / "bench" / "drill_chaos.png"))
    down = sub.add_parser("downstream", help="(internal) the recording downstream")
    down.add_argument("--out", type=Path, required=True)
    send = sub.add_parser("sender", help="(internal) the provider-like sender")
    send.add_argument("--url", required=True)
    send.add_argument("--path", required=True)
    send.add_argument("--rate", type=float, required=True)
    send.add_argument("--events", type=int, required=True)
    send.add_argument("--start-at", type=float, required=True)
    send.add_argument("--give-up-at", type=float, required=True)
    send.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.mode == "downstream":
        serve_downstream(LOOPBACK, DOWN_PORT, args.out, 0.02, lambda peer: f"port:{peer[1]}")
        return 0
    if args.mode == "sender":
        asyncio.run(send_events(args.url, args.path, args.rate, args.events, args.start_at,
                                args.out, args.give_up_at, RESEND_SHARE, 32))  # fmt: skip
        return 0
    if args.events is None:
        args.events = 1600 if args.short else 2200
    return drill(args)


if __name__ == "__main__":
    sys.exit(main())

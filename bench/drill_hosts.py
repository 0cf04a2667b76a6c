#!/usr/bin/env python3
"""The multi-host drill (issue 32, item 1): hosts as network namespaces, faults between them.

Every host is a Linux network namespace the drill creates (``whd-*``), joined by veth pairs to
one bridge that lives in a namespace of its own (``whd-net``); addresses are in 10.231.0.0/24,
which exists only inside those namespaces. Nothing is sent to any address outside them.

    pg       a private Postgres cluster (initdb into a temporary directory)
    redis    a private redis-server: the broker (db 0) and the claim tier (db 1)
    down     the downstream: records every call (Idempotency-Key, event id, arrival), 200 after 20 ms
    r1, r2   receivers (``webhooks serve``)
    w1-w3    workers (``celery -A tasks worker``; each runs its dispatcher thread)
    beat     ``celery -A tasks beat`` (sweeper, maintenance)
    sender   a provider-like sender: Stripe-signed events, retried on non-2xx or timeout (10 s)
             with backoff, spread over both receivers

Faults run on a schedule while events flow (``--faults``), and the report gives, per fault
window, the events accepted, lost, called downstream more than once (each call's time and the
commit's), and the latency while the fault held and after. Run as root::

    make drill-hosts                    # every fault, about 7 minutes
    .venv/bin/python bench/drill_hosts.py --short        # a <= 3 minute version
    .venv/bin/python bench/drill_hosts.py --broker rabbitmq   # a private rabbitmq-server as broker

The script also runs inside the namespaces as its own helpers (``downstream``, ``sender``, and
``slowlink``, the slow lossy relay between w3 and Postgres: this kernel has no netem).
docs/reliability.md says what each fault means for an operator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = VENV_BIN / "python"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PREFIX = "whd-"
NET_NS = "whd-net"
BRIDGE = "whd-br0"
SUBNET = "10.231.0"
HOSTS: dict[str, int] = {
    "pg": 2,
    "redis": 3,
    "rabbit": 5,
    "down": 4,
    "r1": 11,
    "r2": 12,
    "w1": 21,
    "w2": 22,
    "w3": 23,
    "beat": 31,
    "sender": 41,
}
HOST_OF_IP: dict[str, str] = {f"{SUBNET}.{n}": h for h, n in HOSTS.items()}
WORKERS = ("w1", "w2", "w3")
RECEIVERS = ("r1", "r2")
PG_PORT = 5432
REDIS_PORT = 6379
RECEIVER_PORT = 8000
DOWN_PORT = 9000
DB_NAME = "webhooks"
# Worker budgets: handler I/O 3 s < soft 4 s < hard 5 s < lease (4 x hard) 20 s < visibility 60 s.
HARD_LIMIT = 5.0
LEASE = 4 * HARD_LIMIT
SENDER_TIMEOUT = 10.0
# The worker host whose Postgres traffic goes through the slow-link relay.
SLOW_HOST = "w3"


def ip_of(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


def ns_of(host: str) -> str:
    return PREFIX + host


def now() -> float:
    return time.time()


def run(cmd: Sequence[str], *, check: bool = True, quiet: bool = False) -> str:
    """Run a command to completion; its output, or an error naming it."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed ({proc.returncode}): {proc.stderr.strip()}")
    if not quiet and proc.returncode != 0:
        print(f"  (ignored) {' '.join(cmd[:6])}: {proc.stderr.strip()}", flush=True)
    return proc.stdout


def in_ns(host: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns_of(host), *cmd]


# ---------------------------------------------------------------------------------------------
# The network: namespaces, veth pairs, one bridge in its own namespace.


def our_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"], check=False, quiet=True)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def kill_namespace_pids(name: str, sig: int = signal.SIGKILL) -> int:
    out = run(["ip", "netns", "pids", name], check=False, quiet=True)
    count = 0
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), sig)
            count += 1
    return count


def teardown_network() -> None:
    """Kill every process left in a whd- namespace and delete the namespaces (and so their
    veths and the bridge)."""
    names = our_namespaces()
    for name in names:
        kill_namespace_pids(name, signal.SIGCONT)
        kill_namespace_pids(name)
    if names:
        time.sleep(0.3)
    for name in names:
        for _ in range(20):
            if not run(["ip", "netns", "pids", name], check=False, quiet=True).split():
                break
            kill_namespace_pids(name)
            time.sleep(0.2)
        run(["ip", "netns", "del", name], check=False)


def setup_network() -> None:
    run(["ip", "netns", "add", NET_NS])
    run(["ip", "-n", NET_NS, "link", "set", "lo", "up"])
    run(["ip", "-n", NET_NS, "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "-n", NET_NS, "link", "set", BRIDGE, "up"])
    for host in HOSTS:
        ns = ns_of(host)
        run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Both ends are made inside namespaces: nothing of ours appears in the root namespace.
        run(
            [
                "ip",
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                ns,
                "netns",
                NET_NS,
            ]
        )
        run(["ip", "-n", ns, "addr", "add", f"{ip_of(host)}/24", "dev", "eth0"])
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        run(["ip", "-n", NET_NS, "link", "set", ns, "master", BRIDGE])
        run(["ip", "-n", NET_NS, "link", "set", ns, "up"])


# ---------------------------------------------------------------------------------------------
# Processes on the hosts.


@dataclass
class Proc:
    host: str
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None


@dataclass
class Cluster:
    tmp: Path
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    # Every pid the drill started, by host: an attempt's worker (hostname:pid) names its host.
    host_of_pid: dict[int, str] = field(default_factory=dict)
    ended_by_drill: set[int] = field(default_factory=set)
    exits: list[tuple[float, str, str, int]] = field(default_factory=list)
    # Start a process that exited by itself again, as a supervisor would (compose's restart:).
    supervise: bool = True
    source_path: str = ""
    secret: str = ""
    route_id: int = 0

    def start(self, proc: Proc, extra_env: dict[str, str] | None = None) -> None:
        env = {**proc.env, **(extra_env or {})}
        with proc.log.open("ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')} ---\n".encode())
            log.flush()
            proc.popen = subprocess.Popen(  # noqa: S603
                in_ns(proc.host, *proc.cmd),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
            )
        self.host_of_pid[proc.popen.pid] = proc.host
        if proc not in self.procs:
            self.procs.append(proc)

    def host_procs(self, host: str) -> list[Proc]:
        return [p for p in self.procs if p.host == host]

    def signal_host(self, host: str, sig: int) -> int:
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.ended_by_drill.update(
                p.popen.pid for p in self.host_procs(host) if p.popen is not None
            )
        return kill_namespace_pids(ns_of(host), sig)

    def check_exits(self, t0: float) -> None:
        """Note each process that exited without the drill stopping it (once)."""
        for proc in self.procs:
            if proc.popen is None or proc.popen.pid in self.ended_by_drill or proc.name == "sender":
                continue
            code = proc.popen.poll()
            if code is not None:
                self.ended_by_drill.add(proc.popen.pid)
                self.exits.append((now() - t0, proc.host, proc.name, code))
                again = " (started again)" if self.supervise else ""
                print(
                    f"  {now() - t0:6.1f}s {proc.name} on {proc.host} exited by itself ({code}){again}"
                )
                if self.supervise:
                    self.start(proc)

    def reap(self, host: str, timeout: float) -> None:
        deadline = now() + timeout
        for proc in self.host_procs(host):
            if proc.popen is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - now()))
        if run(["ip", "netns", "pids", ns_of(host)], check=False, quiet=True).split():
            self.signal_host(host, signal.SIGKILL)
            time.sleep(0.3)
        for proc in self.host_procs(host):
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(2)

    def restart_host(self, host: str, extra_env: dict[str, str] | None, graceful: bool) -> None:
        if graceful:
            # The relay is the host's network: it goes last, as a host's network would.
            for proc in self.host_procs(host):
                if proc.name != "slowlink" and proc.popen is not None:
                    self.ended_by_drill.add(proc.popen.pid)
                    proc.popen.terminate()
            for proc in self.host_procs(host):
                if proc.name != "slowlink" and proc.popen is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.popen.wait(15.0)
            self.signal_host(host, signal.SIGTERM)
            self.reap(host, 5.0)
        else:
            self.signal_host(host, signal.SIGKILL)
            self.reap(host, 2.0)
        for proc in self.host_procs(host):
            self.start(proc, extra_env)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.terminate()
        deadline = now() + 15
        for proc in reversed(self.procs):
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(max(0.1, deadline - now()))
                if proc.popen.poll() is None:
                    proc.popen.kill()


def wait_for(what: str, probe: Callable[[], bool], timeout: float) -> None:
    deadline = now() + timeout
    while now() < deadline:
        if probe():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")


def psql(sql: str, host: str = "pg", addr: str | None = None) -> str:
    """One statement on the private cluster, run from ``host`` (tuples only); ``addr``: the
    cluster's address (default: ``host``'s)."""
    return run(
        in_ns(
            host, "runuser", "-u", "postgres", "--", "psql", "-h", addr or ip_of(host),
            "-p", str(PG_PORT), "-U", "postgres", "-d", DB_NAME, "-At", "-c", sql,
        ),
        quiet=True,
    )  # fmt: skip


def start_postgres(cluster: Cluster, host: str = "pg", addr: str | None = None) -> Proc:
    """A private cluster on ``host`` (a namespace), listening on ``addr`` (default: the
    host's address); its process, which the single-host drill crashes and starts again."""
    addr = addr or ip_of(host)
    data = cluster.tmp / "pgdata"
    sock = cluster.tmp / "pgsock"
    for path in (data, sock):
        path.mkdir(mode=0o700)
        shutil.chown(path, "postgres", "postgres")
    run(["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data),
         "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])  # fmt: skip
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"listen_addresses = '{addr}'\nport = {PG_PORT}\n"
            f"unix_socket_directories = '{sock}'\nmax_connections = 300\n"
            "shared_buffers = 128MB\nlog_min_messages = warning\n"
        )
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {SUBNET}.0/24 trust\n")
    proc = Proc(host, "postgres", ["runuser", "-u", "postgres", "--",
                str(PG_BIN / "postgres"), "-D", str(data)], dict(os.environ),
                cluster.tmp / "logs" / "pg.log")  # fmt: skip
    cluster.start(proc)
    isready = in_ns(host, str(PG_BIN / "pg_isready"), "-h", addr, "-p", str(PG_PORT))
    wait_for(
        "postgres",
        lambda: subprocess.run(isready, check=False, capture_output=True).returncode == 0,
        30,
    )
    return proc


def start_redis(cluster: Cluster, host: str = "redis", addr: str | None = None) -> Proc:
    addr = addr or ip_of(host)
    cmd = ["redis-server", "--bind", addr, "--port", str(REDIS_PORT), "--save", "",
           "--appendonly", "no", "--protected-mode", "no", "--dir", str(cluster.tmp)]  # fmt: skip
    proc = Proc(host, "redis", cmd, dict(os.environ), cluster.tmp / "logs" / "redis.log")
    cluster.start(proc)
    ping = in_ns(host, "redis-cli", "-h", addr, "-p", str(REDIS_PORT), "ping")
    wait_for(
        "redis",
        lambda: b"PONG" in subprocess.run(ping, check=False, capture_output=True).stdout,
        15,
    )
    return proc


RABBIT_PORT = 5672
RABBIT_NODE = "whd@localhost"


def rabbit_env(tmp: Path) -> dict[str, str]:
    """A private RabbitMQ node: its own node name, port, cookie, mnesia and log directories
    (none of /etc/rabbitmq or /var/lib/rabbitmq is used), listening on the rabbit host only."""
    home = tmp / "rabbit"
    return {
        **os.environ,
        "HOME": str(home),
        "RABBITMQ_CONF_ENV_FILE": str(home / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
        "RABBITMQ_NODENAME": RABBIT_NODE,
        "RABBITMQ_NODE_PORT": str(RABBIT_PORT),
        "RABBITMQ_DIST_PORT": "25672",
        "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
        "RABBITMQ_LOG_BASE": str(home / "log"),
        "RABBITMQ_PID_FILE": str(home / "rabbit.pid"),
    }


def start_rabbit(cluster: Cluster) -> None:
    home = cluster.tmp / "rabbit"
    (home / "mnesia").mkdir(parents=True)
    (home / "log").mkdir()
    cookie = home / ".erlang.cookie"
    cookie.write_text(secrets.token_hex(16))
    cookie.chmod(0o400)
    (home / "rabbitmq-env.conf").write_text("")
    (home / "enabled_plugins").write_text("[].\n")
    (home / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = {ip_of('rabbit')}:{RABBIT_PORT}\nloopback_users = none\n"
    )
    cmd = ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
    env = rabbit_env(cluster.tmp)
    cluster.start(Proc("rabbit", "rabbitmq", cmd, env, cluster.tmp / "logs" / "rabbit.log"))
    probe = in_ns(
        "sender", str(PYTHON), "-c",
        f"import socket; socket.create_connection(('{ip_of('rabbit')}', {RABBIT_PORT}), 1)",
    )  # fmt: skip
    wait_for(
        "rabbitmq",
        lambda: subprocess.run(probe, check=False, capture_output=True).returncode == 0,
        90,
    )


def database_url(host: str, port: int) -> str:
    return f"postgresql+psycopg://postgres@{host}:{port}/{DB_NAME}"


def pipeline_env(tmp: Path, concurrency: int, broker: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    empty = tmp / "empty.env"
    empty.touch()
    return {
        **base,
        "WEBHOOKS_ENV_FILE": str(empty),
        "WEBHOOKS_ENVIRONMENT": "development",
        "WEBHOOKS_DATABASE_URL": database_url(ip_of("pg"), PG_PORT),
        "WEBHOOKS_REDIS_URL": f"redis://{ip_of('redis')}:{REDIS_PORT}/1",
        "WEBHOOKS_BROKER_URL": (
            f"amqp://guest:guest@{ip_of('rabbit')}:{RABBIT_PORT}//"
            if broker == "rabbitmq"
            else f"redis://{ip_of('redis')}:{REDIS_PORT}/0"
        ),
        "WEBHOOKS_SECRET_KEY": secrets.token_urlsafe(48),
        "WEBHOOKS_LOG_JSON": "true",
        "WEBHOOKS_LOG_LEVEL": "INFO",
        "WEBHOOKS_HANDLER_IO_TIMEOUT": str(HARD_LIMIT * 0.6),
        "WEBHOOKS_SOFT_TIME_LIMIT": str(HARD_LIMIT * 0.8),
        "WEBHOOKS_HARD_TIME_LIMIT": str(HARD_LIMIT),
        "WEBHOOKS_VISIBILITY_TIMEOUT": "60",
        "WEBHOOKS_RECORD_RETRY_SECONDS": "8",
        "WEBHOOKS_SWEEP_INTERVAL": "2s",
        "WEBHOOKS_PUBLISH_GRACE": "5s",
        "WEBHOOKS_DB_CONNECT_TIMEOUT": "2",
        "WEBHOOKS_WORKER_CONCURRENCY": str(concurrency),
        "PYTHONUNBUFFERED": "1",
    }


def http_ok(host: str, url: str) -> bool:
    probe = in_ns(host, "curl", "-s", "-o", "/dev/null", "-m", "2", "-w", "%{http_code}", url)
    out = subprocess.run(probe, capture_output=True, text=True, check=False).stdout
    return out.startswith("2")


def setup_database(cluster: Cluster, host: str = "beat", downstream: str | None = None) -> None:
    """The schema, the drill's source and its forward route to ``downstream`` (default: the
    down host), through the project's CLI run on ``host``."""

    def webhooks(*args: str) -> str:
        proc = subprocess.run(
            in_ns(host, str(VENV_BIN / "webhooks"), *args),
            env=cluster.env,
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"webhooks {args[0]} {args[1]} failed: {proc.stderr.strip()[-400:]}")
        return proc.stdout

    webhooks("db", "upgrade")
    source = json.loads(
        webhooks("sources", "add", "drill", "--provider", "stripe", "--json", "--as", "drill")
    )
    cluster.secret = str(source["secret"])
    cluster.source_path = str(source["url_path"])
    url = downstream or f"http://{ip_of('down')}:{DOWN_PORT}/hook"
    route = json.loads(
        webhooks(
            "routes", "add", "drill", "--handler", "forward", "--json", "--as", "drill",
            "--option", f"url={url}", "--option", "allow_http=true", "--option", "allow_private=true",
        )
    )  # fmt: skip
    cluster.route_id = int(route["id"])


def start_pipeline(cluster: Cluster, concurrency: int) -> None:
    logs = cluster.tmp / "logs"
    py = str(PYTHON)
    me = str(Path(__file__).resolve())
    down = Proc("down", "downstream", [py, me, "downstream", "--bind", ip_of("down"),
                "--port", str(DOWN_PORT), "--out", str(cluster.tmp / "downstream.jsonl")],
                dict(os.environ), logs / "down.log")  # fmt: skip
    cluster.start(down)
    for host in RECEIVERS:
        env = {**cluster.env, "WEBHOOKS_METRICS_DIR": str(cluster.tmp / f"metrics-{host}")}
        Path(env["WEBHOOKS_METRICS_DIR"]).mkdir()
        cmd = [
            str(VENV_BIN / "webhooks"),
            "serve",
            "--host",
            ip_of(host),
            "--port",
            str(RECEIVER_PORT),
        ]
        cluster.start(Proc(host, "receiver", cmd, env, logs / f"{host}.log"))
    for host in WORKERS:
        env = {**cluster.env, "WEBHOOKS_METRICS_DIR": str(cluster.tmp / f"metrics-{host}")}
        Path(env["WEBHOOKS_METRICS_DIR"]).mkdir()
        if host == SLOW_HOST:
            relay = [py, me, "slowlink", "--port", str(SLOW_PORT), "--target", ip_of("pg")]
            cluster.start(
                Proc(host, "slowlink", relay, dict(os.environ), logs / f"{host}-slowlink.log")
            )
            env["WEBHOOKS_DATABASE_URL"] = database_url("127.0.0.1", SLOW_PORT)
        cmd = [str(VENV_BIN / "celery"), "-A", "tasks", "worker", "-Q", "deliveries,maintenance",
               "-P", "threads", "-c", str(concurrency), "-n", f"worker@{ns_of(host)}",
               "--loglevel", "WARNING"]  # fmt: skip
        cluster.start(Proc(host, "worker", cmd, env, logs / f"{host}.log"))
    env = {**cluster.env, "WEBHOOKS_METRICS_DIR": str(cluster.tmp / "metrics-beat")}
    Path(env["WEBHOOKS_METRICS_DIR"]).mkdir()
    cmd = [str(VENV_BIN / "celery"), "-A", "tasks", "beat", "-s", str(cluster.tmp / "beat-schedule"),
           "--loglevel", "WARNING"]  # fmt: skip
    cluster.start(Proc("beat", "beat", cmd, env, logs / "beat.log"))
    for host in RECEIVERS:
        url = f"http://{ip_of(host)}:{RECEIVER_PORT}/healthz"
        wait_for(f"receiver {host}", lambda h=host, u=url: http_ok("sender", u), 60)  # type: ignore[misc]
    wait_for("downstream", lambda: http_ok("sender", f"http://{ip_of('down')}:{DOWN_PORT}/"), 20)


# ---------------------------------------------------------------------------------------------
# Faults.


@dataclass
class Fault:
    name: str
    host: str
    duration: float
    what: str
    apply: Callable[[Cluster], None]
    revert: Callable[[Cluster], None]
    # Applied the moment the downstream sees a call from ``host`` (within 5 s of the
    # planned time): a host frozen or killed with a downstream call in flight.
    when_busy: bool = False
    start: float = 0.0  # planned offset from the sender's start (s)
    applied_at: float = 0.0  # epoch seconds, as applied
    reverted_at: float = 0.0


def blackhole(
    host: str, *targets: str
) -> tuple[Callable[[Cluster], None], Callable[[Cluster], None]]:
    def apply(_: Cluster) -> None:
        for target in targets:
            run(["ip", "-n", ns_of(host), "route", "add", "blackhole", f"{ip_of(target)}/32"])

    def revert(_: Cluster) -> None:
        for target in targets:
            run(
                ["ip", "-n", ns_of(host), "route", "del", "blackhole", f"{ip_of(target)}/32"],
                check=False,
            )

    return apply, revert


SLOW_PORT = 6432


def slow_link(host: str) -> tuple[Callable[[Cluster], None], Callable[[Cluster], None]]:
    """100 ms +- 20 ms each way, and 2% of segments held a retransmit timeout more, between
    ``host`` and Postgres. This kernel has no ``netem`` qdisc (only htb, tbf, pfifo), so the
    link is a userspace relay on the host's own loopback (``slowlink``), which that host's
    processes always reach Postgres through: transparent until SIGUSR1, again after SIGUSR2."""

    def relay(c: Cluster, signum: int) -> None:
        for proc in c.host_procs(host):
            if proc.name == "slowlink" and proc.popen is not None:
                proc.popen.send_signal(signum)

    return (lambda c: relay(c, signal.SIGUSR1)), (lambda c: relay(c, signal.SIGUSR2))


async def serve_slow_link(listen_port: int, target: str, target_port: int, loss: float) -> None:
    degraded = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, degraded.set)
    loop.add_signal_handler(signal.SIGUSR2, degraded.clear)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        last = 0.0
        try:
            while data := await reader.read(65536):
                due = loop.time()
                if degraded.is_set():
                    due += max(0.0, random.gauss(0.1, 0.02))
                    if random.random() < loss:  # noqa: S311  (a lost segment: one RTO)
                        due += 0.2 + random.random() * 0.2  # noqa: S311
                last = max(last, due)
                queue.put_nowait((last, data))
        except OSError:
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await sender
            with contextlib.suppress(OSError):
                writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=256)
    async with server:
        await server.serve_forever()


def wait_busy(arrivals: Path, peer: str, timeout: float) -> bool:
    """Until the downstream logs a call's arrival from ``peer`` (True), or ``timeout``."""
    deadline = now() + timeout
    with arrivals.open() as log:
        log.seek(0, os.SEEK_END)
        pending = ""
        while now() < deadline:
            pending += log.read()
            *lines, pending = pending.split("\n")
            if any(line.endswith(" " + peer) for line in lines):
                return True
            time.sleep(0.001)
    return False


def faketime_env(offset: str) -> dict[str, str]:
    import libfaketime  # type: ignore[import-untyped]  # noqa: PLC0415  (dev extra)

    _, env = libfaketime.get_reload_information()
    return {**{str(k): str(v) for k, v in env.items()}, "FAKETIME": offset}


def make_faults(short: bool, broker: str = "redis") -> dict[str, Fault]:
    def restart(host: str, extra: dict[str, str] | None) -> Callable[[Cluster], None]:
        return lambda c: c.restart_host(host, extra, graceful=True)

    def kill(host: str) -> Callable[[Cluster], None]:
        def apply(c: Cluster) -> None:
            c.signal_host(host, signal.SIGCONT)
            c.signal_host(host, signal.SIGKILL)
            c.reap(host, 2.0)

        return apply

    def start(host: str) -> Callable[[Cluster], None]:
        def revert(c: Cluster) -> None:
            for proc in c.host_procs(host):
                c.start(proc)

        return revert

    def sig(host: str, signum: int) -> Callable[[Cluster], None]:
        return lambda c: (c.signal_host(host, signum), None)[1]

    lease_plus = LEASE + (8 if short else 10)
    faults = [
        Fault("pg-cut-worker", "w1", lease_plus, "worker host w1 cut off from Postgres only",
              *blackhole("w1", "pg")),
        Fault("redis-cut-worker", "w2", 20, "worker host w2 cut off from Redis (claims) and the broker only",
              *blackhole("w2", "redis", *(["rabbit"] if broker == "rabbitmq" else []))),
        Fault("pg-cut-receiver", "r1", 15, "receiver host r1 cut off from Postgres",
              *blackhole("r1", "pg")),
        Fault("slow-link-worker-pg", "w3", 30, "100 ms +- 20 ms each way and 2% of segments held"
              " one retransmit timeout more, between worker host w3 and Postgres", *slow_link("w3")),
        Fault("clock-ahead", "w3", 40, "worker host w3 restarted with its clock 2 min ahead (libfaketime)",
              restart("w3", faketime_env("+2m")), restart("w3", None)),
        Fault("freeze-host", "w2", lease_plus - 2, "worker host w2 frozen (SIGSTOP of all its pids) past a lease, with a call in flight",
              sig("w2", signal.SIGSTOP), sig("w2", signal.SIGCONT), when_busy=True),
        Fault("kill-host", "w3" if short else "w1", 5, "a worker host killed (SIGKILL of all its pids) with a call in flight, started 5 s later",
              kill("w3" if short else "w1"), start("w3" if short else "w1"), when_busy=True),
    ]  # fmt: skip
    return {f.name: f for f in faults}


SHORT_FAULTS = ("pg-cut-worker", "freeze-host", "kill-host")


# ---------------------------------------------------------------------------------------------
# The downstream (runs inside the down namespace).


def serve_downstream(
    bind: str,
    port: int,
    out: Path,
    delay: float,
    peer_of: Callable[[tuple[str, int]], str] | None = None,
) -> None:
    """Every call recorded twice: its arrival at once (``arrivals.log`` beside ``out``, which
    the drill watches to freeze or kill a host while it has a call in flight), and the whole
    record once answered. ``peer_of`` names the caller (default: its address)."""
    lock = threading.Lock()
    sink = out.open("a", buffering=1)
    live = (out.parent / "arrivals.log").open("a", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            arrived = now()
            peer = peer_of(self.client_address) if peer_of else self.client_address[0]
            with lock:
                live.write(f"{arrived:.6f} {peer}\n")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            key = self.headers.get("Idempotency-Key") or ""
            try:
                event = str(json.loads(body).get("id", ""))
            except ValueError:
                event = ""
            time.sleep(delay)
            reset = False
            try:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.wfile.flush()
            except OSError:
                reset = True
            record = {"key": key, "event": event, "t": arrived, "t_resp": now(),
                      "peer": peer, "reset": reset}  # fmt: skip
            with lock:
                sink.write(json.dumps(record) + "\n")

    server = ThreadingHTTPServer((bind, port), Handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    sink.close()


# ---------------------------------------------------------------------------------------------
# The sender (runs inside the sender namespace).


def stripe_headers(secret: str, body: bytes) -> dict[str, str]:
    """``Stripe-Signature: t=..,v1=..`` as Stripe signs: HMAC-SHA256 of ``t.body`` under the
    whole ``whsec_`` secret."""
    ts = int(now())
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return {
        "Stripe-Signature": f"t={ts},v1={mac}",
        "Content-Type": "application/json; charset=utf-8",
    }


async def send_events(
    receivers: list[str], path: str, rate: float, duration: float, start_at: float,
    out: Path, give_up_at: float,
) -> None:  # fmt: skip
    import httpx  # noqa: PLC0415  (only the sender needs it)

    secret = os.environ["WHD_SECRET"]
    sink = out.open("a", buffering=1)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    clients = [
        httpx.AsyncClient(base_url=r, timeout=SENDER_TIMEOUT, limits=limits) for r in receivers
    ]
    total = int(rate * duration)

    async def one(n: int) -> None:
        event_id = f"evt_drill_{n:06d}"
        created = int(now())
        body = json.dumps(
            {"id": event_id, "object": "event", "api_version": "2024-06-20", "created": created,
             "type": "invoice.paid", "livemode": False, "pending_webhooks": 1,
             "data": {"object": {"id": f"in_{n}", "object": "invoice", "amount_due": 100}}},
            indent=2,
        ).encode()  # fmt: skip
        tries = 0
        while True:
            which = (n + tries) % len(clients)
            t0 = now()
            status, error = 0, ""
            try:
                resp = await clients[which].post(
                    path, content=body, headers=stripe_headers(secret, body)
                )
                status = resp.status_code
            except httpx.TimeoutException:
                error = "timeout"
            except httpx.HTTPError as exc:
                error = type(exc).__name__
            t1 = now()
            ok = 200 <= status < 300
            sink.write(json.dumps({"event": event_id, "try": tries, "recv": which, "t0": t0,
                                   "t1": t1, "status": status, "error": error, "ok": ok}) + "\n")  # fmt: skip
            if ok:
                return
            tries += 1
            if now() > give_up_at:
                return
            await asyncio.sleep(min(16.0, 0.5 * 2**tries) * (0.5 + random.random() / 2))  # noqa: S311

    tasks: list[asyncio.Task[None]] = []
    for n in range(total):
        delay = start_at + n / rate - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    for client in clients:
        await client.aclose()
    sink.close()


# ---------------------------------------------------------------------------------------------
# What happened: the sender's, the downstream's and the database's records.


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def db_dump() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    deliveries = psql(
        "SELECT coalesce(json_agg(x), '[]') FROM (SELECT d.id, d.status, d.attempts, d.generation,"
        " d.redeliveries, d.last_error_class AS error, r.event_id AS event,"
        " extract(epoch FROM r.received_at)::float8 AS received,"
        " extract(epoch FROM d.succeeded_at)::float8 AS succeeded"
        " FROM deliveries d JOIN receipts r ON r.id = d.receipt_id) x"
    )
    attempts = psql(
        "SELECT coalesce(json_agg(x), '[]') FROM (SELECT a.delivery_id AS delivery, a.number,"
        " a.worker, a.outcome, a.error_class AS error,"
        " extract(epoch FROM a.started_at)::float8 AS started,"
        " extract(epoch FROM a.ended_at)::float8 AS ended FROM attempts a) x"
    )
    return json.loads(deliveries or "[]"), json.loads(attempts or "[]")


def pending_count() -> int | None:
    try:
        out = psql("SELECT count(*) FROM deliveries WHERE status <> 'succeeded'")
        return int(out.strip())
    except (RuntimeError, ValueError):
        return None


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def fmt_ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f}"


@dataclass
class Outcome:
    text: str
    lost: int
    accepted: int
    repeats: int
    # What a test asserts (``--json``): repeats outside the named window, calls that started
    # after their delivery's success committed, processes that exited by themselves, and per
    # fault the delivered/s while it held and in the gap after, against the baseline's.
    unnamed: list[str] = field(default_factory=list)
    late: int = 0
    exits: int = 0
    baseline_delivered: float = 0.0
    delivered: dict[str, tuple[float, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "lost": self.lost,
            "repeats": self.repeats,
            "unnamed": self.unnamed,
            "late": self.late,
            "exits": self.exits,
            "baseline_delivered": self.baseline_delivered,
            "delivered": self.delivered,
        }


def analyse(
    t0: float, faults: list[Fault], cluster: Cluster, gap: float, args: argparse.Namespace
) -> tuple[Outcome, dict[str, Any]]:
    tmp = cluster.tmp

    def worker_host(worker: str | None) -> str:
        pid = (worker or "").rpartition(":")[2]
        return cluster.host_of_pid.get(int(pid), worker or "?") if pid.isdigit() else worker or "?"

    tries = read_jsonl(tmp / "sender.jsonl")
    calls = read_jsonl(tmp / "downstream.jsonl")
    deliveries, attempts = db_dump()
    accepted: dict[str, float] = {}
    offered: set[str] = set()
    sender_errors: Counter[str] = Counter()
    for tr in tries:
        offered.add(tr["event"])
        if tr["ok"]:
            accepted.setdefault(tr["event"], tr["t1"])
        else:
            sender_errors[tr["error"] or str(tr["status"])] += 1
    by_event: dict[str, dict[str, Any]] = {d["event"]: d for d in deliveries}
    attempts_of: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in attempts:
        attempts_of[row["delivery"]].append(row)
    calls_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in sorted(calls, key=lambda c: c["t"]):
        calls_of[c["key"]].append(c)
    first_call: dict[str, float] = {}
    for key_calls in calls_of.values():
        ev = key_calls[0]["event"]
        first_call[ev] = min(first_call.get(ev, math.inf), key_calls[0]["t"])
    latency: dict[str, float] = {}
    for ev, t in first_call.items():
        d = by_event.get(ev)
        if d is not None and d["received"] is not None:
            latency[ev] = t - d["received"]
    lost_db = sorted(ev for ev in accepted if by_event.get(ev, {}).get("status") != "succeeded")
    lost_down = sorted(ev for ev in accepted if ev not in first_call)
    lost = sorted(set(lost_db) | set(lost_down))
    repeats = {k: v for k, v in calls_of.items() if len(v) > 1}

    def rel(t: float | None) -> str:
        return "-" if t is None else f"{t - t0:7.2f}s"

    windows = [(f.name, f.applied_at, f.reverted_at or f.applied_at + f.duration) for f in faults]

    def window_of(first: float, second: float) -> str:
        """The fault that held when the first call was made (its commit is what failed),
        else the one whose lease-long aftermath the second call falls in."""
        for name, a, b in windows:
            if a - 0.5 <= first <= b:
                return name
        best = "no fault"
        for name, a, b in windows:
            if a <= second <= b + LEASE + 10:
                best = name
        return best

    lines: list[str] = []
    p = lines.append
    p(f"multi-host drill, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t0))}")
    p(f"hosts: pg, redis, down, r1 r2 (receivers), w1 w2 w3 (workers, {args.concurrency} threads),"
      f" beat, sender; claim tier redis, broker {args.broker}")  # fmt: skip
    p(f"lease {LEASE:.0f} s (hard limit {HARD_LIMIT:.0f} s), sender {args.rate:g} events/s for"
      f" {args.duration:.0f} s, timeout {SENDER_TIMEOUT:.0f} s, retries with backoff")  # fmt: skip
    p("")
    p(
        f"offered {len(offered)}, accepted {len(accepted)}, not accepted {len(offered - set(accepted))}"
    )
    p(f"lost (accepted, not succeeded in the database or never called downstream): {len(lost)}"
      f" (not succeeded {len(lost_db)}, never called {len(lost_down)})")  # fmt: skip
    p(f"downstream calls {len(calls)} for {len(calls_of)} keys; keys called more than once:"
      f" {len(repeats)} ({100 * len(repeats) / max(1, len(accepted)):.2f}% of accepted),"
      f" resets seen by the downstream {sum(1 for c in calls if c['reset'])}")  # fmt: skip
    # A call that starts after its delivery's success committed: a worker calling for a lease
    # it has lost (the downstream's clock and the database's are this machine's one clock).
    late = [
        c for c in calls
        if (d := by_event.get(c["event"])) is not None and d["succeeded"] is not None
        and c["t"] > d["succeeded"] + 0.01
    ]  # fmt: skip
    p(f"calls started after their delivery's success was committed: {len(late)}"
      + "".join(f"; {c['event']} from {HOST_OF_IP.get(c['peer'], c['peer'])} at {c['t'] - t0:.2f}s"
                for c in late[:10]))  # fmt: skip
    p(f"sender's failed tries: {dict(sender_errors.most_common())}")
    all_lat = list(latency.values())
    p(f"latency receipt -> first downstream call: p50 {fmt_ms(pct(all_lat, 50))} ms,"
      f" p99 {fmt_ms(pct(all_lat, 99))} ms, max {fmt_ms(max(all_lat, default=math.nan))} ms")  # fmt: skip
    lag_of: dict[str, float] = {}
    event_calls = calls_by_event(calls_of)
    for ev, d in by_event.items():
        if d["succeeded"] is None:
            continue
        ev_calls = [c for c in event_calls.get(ev, []) if c["t_resp"] <= d["succeeded"] + 0.05]
        if ev_calls:
            lag_of[ev] = d["succeeded"] - ev_calls[-1]["t_resp"]
    lag = list(lag_of.values())
    p(f"downstream 2xx -> success committed: p50 {fmt_ms(pct(lag, 50))} ms, p99 {fmt_ms(pct(lag, 99))} ms,"
      f" max {fmt_ms(max(lag, default=math.nan))} ms (downstream clock vs database clock, one host)")  # fmt: skip
    p("")
    baseline_end = min((a for _, a, _ in windows), default=t0 + args.duration)
    base_lat = [
        latency[ev] for ev, t in accepted.items() if t0 <= t < baseline_end and ev in latency
    ]
    base_rate = len([1 for t in accepted.values() if t0 + 3 <= t < baseline_end]) / max(
        1.0, baseline_end - t0 - 3
    )
    base_lag = [lag_of[ev] for ev, t in accepted.items() if t0 <= t < baseline_end and ev in lag_of]

    def delivered_rate(a: float, b: float) -> float:
        return sum(1 for t in first_call.values() if a <= t < b) / max(0.1, b - a)

    p(f"baseline (before the first fault): accepted {base_rate:.1f}/s, delivered"
      f" {delivered_rate(t0 + 3, baseline_end):.1f}/s, latency p50 {fmt_ms(pct(base_lat, 50))} ms,"
      f" p99 {fmt_ms(pct(base_lat, 99))} ms; 2xx -> committed p99 {fmt_ms(pct(base_lag, 99))} ms")  # fmt: skip
    p("")
    p("per fault window (times from the sender's start):")
    p(
        "(acc: accepted while it held; dlv/s: first downstream calls per second; latency of the"
        " events accepted while it held; after: the next gap seconds)"
    )
    header = (f"{'fault':19} {'held':>13} {'acc':>5} {'acc/s':>5} {'dlv/s':>5} {'lost':>4} {'rep':>3}"
              f" {'p50ms':>6} {'p99ms':>6} {'after p99':>9} {'after dlv/s':>11}")  # fmt: skip
    p(header)
    repeat_window: dict[str, str] = {}
    for key, key_calls in repeats.items():
        repeat_window[key] = window_of(key_calls[0]["t"], key_calls[1]["t"])
    for f in faults:
        a, b = f.applied_at, f.reverted_at or f.applied_at + f.duration
        during = [ev for ev, t in accepted.items() if a <= t < b]
        after = [ev for ev, t in accepted.items() if b <= t < b + gap]
        lat_d = [latency[ev] for ev in during if ev in latency]
        lat_a = [latency[ev] for ev in after if ev in latency]
        n_lost = sum(1 for ev in lost if a <= accepted[ev] < b + gap)
        n_rep = sum(1 for w in repeat_window.values() if w == f.name)
        p(f"{f.name:19} {a - t0:5.1f}-{b - t0:5.1f}s {len(during):5d} {len(during) / max(0.1, b - a):5.1f}"
          f" {delivered_rate(a, b):5.1f} {n_lost:4d} {n_rep:3d} {fmt_ms(pct(lat_d, 50)):>6}"
          f" {fmt_ms(pct(lat_d, 99)):>6} {fmt_ms(pct(lat_a, 99)):>9} {delivered_rate(b, b + gap):11.1f}")  # fmt: skip
    no_fault = sum(1 for w in repeat_window.values() if w == "no fault")
    p(f"{'no fault':19} {'':>13} {'':>5} {'':>5} {'':>5} {'':>4} {no_fault:3d}")
    for f in faults:
        p(f"  {f.name}: {f.what}")
    p("")
    p("the sender's tries while each fault held (answer time median / p99 in ms, failures):")
    for f in faults:
        a, b = f.applied_at, f.reverted_at or f.applied_at + f.duration
        held = [tr for tr in tries if a <= tr["t0"] < b]
        parts = []
        for i, host in enumerate(RECEIVERS):
            mine = [tr for tr in held if tr["recv"] == i]
            took = [tr["t1"] - tr["t0"] for tr in mine]
            failed = Counter(tr["error"] or str(tr["status"]) for tr in mine if not tr["ok"])
            parts.append(f"{host} {len(mine)} tries, {fmt_ms(pct(took, 50))}/{fmt_ms(pct(took, 99))}"
                         f" ms, failed {dict(failed) or 0}")  # fmt: skip
        p(f"  {f.name:18} " + "; ".join(parts))
    p("")
    p("warnings and errors the pipeline logged while each fault held and the gap after it:")
    logged = read_warnings(tmp / "logs")
    for f in faults:
        a, b = f.applied_at, f.reverted_at or f.applied_at + f.duration
        seen = Counter(f"{host} {event}" for t, host, event in logged if a <= t < b + gap)
        p(f"  {f.name:18} " + (", ".join(f"{k} x{n}" for k, n in sorted(seen.items())) or "none"))
    p("  (the clock-ahead host's own lines carry its clock, 2 min ahead, and may land elsewhere)")
    p("")
    if cluster.exits:
        p(
            "processes that exited by themselves (the drill did not stop them)"
            + (
                "; the drill started each again, as a supervisor would:"
                if cluster.supervise
                else ":"
            )
        )
        for t, host, name, code in cluster.exits:
            p(f"  {t:7.1f}s {name} on {host}, exit status {code}")
        p("")
    if lost:
        p(f"lost events ({len(lost)}): " + ", ".join(
            f"{ev} ({by_event.get(ev, {}).get('status', 'no row')})" for ev in lost[:30]))  # fmt: skip
        p("")
    if repeats:
        p("repeated downstream calls (same Idempotency-Key), with the attempts the database holds:")
    for key, key_calls in sorted(repeats.items(), key=lambda kv: kv[1][0]["t"]):
        ev = key_calls[0]["event"]
        d = by_event.get(ev, {})
        p(f"- {ev} (delivery {d.get('id')}, window {repeat_window[key]}): calls at "
          + ", ".join(f"{rel(c['t'])} from {HOST_OF_IP.get(c['peer'], c['peer'])}{' (reset)' if c['reset'] else ''}" for c in key_calls)
          + f"; succeeded committed at {rel(d.get('succeeded'))}")  # fmt: skip
        for att in sorted(attempts_of.get(int(d.get("id") or 0), []), key=lambda x: x["number"]):
            p(f"    attempt {att['number']} on {worker_host(att['worker'])}: started {rel(att['started'])},"
              f" ended {rel(att['ended'])}, {att['outcome'] or 'open'}"
              f"{' ' + att['error'] if att['error'] else ''}")  # fmt: skip

    # The named window (issue 32): each call but the last belongs to an attempt whose worker
    # lost its lease with the call made (killed, frozen, cut off: ``crashed`` when the next
    # claim took the lease over, or, when no claim took it over before the worker woke, a
    # ``retry`` that outlived the lease: its call timed out across the freeze, and no healthy
    # attempt outlives a lease four times the hard limit) and the last attempt succeeded.
    def lost_its_lease(att: dict[str, Any]) -> bool:
        if att["outcome"] == "crashed":
            return True
        lasted = (att["ended"] or 0.0) - (att["started"] or 0.0)
        return att["outcome"] == "retry" and att["ended"] is not None and lasted > LEASE

    unnamed = []
    for key_calls in repeats.values():
        d = by_event.get(key_calls[0]["event"], {})
        tries_of = sorted(attempts_of.get(int(d.get("id") or 0), []), key=lambda x: x["number"])
        named = (
            len(tries_of) >= len(key_calls)
            and all(lost_its_lease(att) for att in tries_of[:-1])
            and tries_of[-1]["outcome"] == "succeeded"
        )
        if not named:
            unnamed.append(key_calls[0]["event"])
    outcome = Outcome(
        "\n".join(lines) + "\n",
        len(lost),
        len(accepted),
        len(repeats),
        unnamed=sorted(unnamed),
        late=len(late),
        exits=len(cluster.exits),
        baseline_delivered=round(delivered_rate(t0 + 3, baseline_end), 2),
        delivered={
            f.name: (
                round(delivered_rate(a, b), 2),
                round(delivered_rate(b, b + gap), 2),
            )
            for f in faults
            for a, b in [(f.applied_at, f.reverted_at or f.applied_at + f.duration)]
        },
    )
    series = {
        "accepted": accepted,
        "first_call": first_call,
        "latency": latency,
        "t0": t0,
        "windows": windows,
    }
    return outcome, series


def read_warnings(logs: Path) -> list[tuple[float, str, str]]:
    """(time, host, event) of every warning or error line of the pipeline's JSON logs."""
    from datetime import datetime  # noqa: PLC0415

    out = []
    for path in sorted(logs.glob("*.log")):
        host = path.stem
        if host not in HOSTS or host in ("pg", "redis", "down", "sender"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"level":"info"' in line:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                row = json.loads(line)
                if row.get("level") in ("warning", "error", "critical"):
                    at = datetime.fromisoformat(row["timestamp"]).timestamp()
                    out.append((at, host, str(row["event"])))
    return out


def calls_by_event(calls_of: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for key_calls in calls_of.values():
        for c in key_calls:
            out[c["event"]].append(c)
    return out


def plot(series: dict[str, Any], png: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415  (dev extra, only for the picture)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    t0: float = series["t0"]
    accepted: dict[str, float] = series["accepted"]
    first_call: dict[str, float] = series["first_call"]
    latency: dict[str, float] = series["latency"]
    end = int(max([*accepted.values(), *first_call.values(), t0 + 1]) - t0) + 1
    acc = [0] * end
    dlv = [0] * end
    lat: list[list[float]] = [[] for _ in range(end)]
    for t in accepted.values():
        acc[max(0, int(t - t0))] += 1
    for ev, t in first_call.items():
        i = int(t - t0)
        if 0 <= i < end:
            dlv[i] += 1
            if ev in latency:
                lat[i].append(latency[ev])
    xs = list(range(end))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
    ax1.plot(xs, acc, label="accepted/s (2xx to the sender)", linewidth=0.9)
    ax1.plot(xs, dlv, label="delivered/s (first downstream call)", linewidth=0.9)
    ax1.set_ylabel("events/s")
    p99 = [pct(v, 99) * 1000 if v else math.nan for v in lat]
    ax2.plot(xs, p99, color="tab:red", linewidth=0.9, label="p99 latency, receipt -> downstream")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("seconds from the sender's start")
    colours = plt.get_cmap("tab10")
    for i, (name, a, b) in enumerate(series["windows"]):
        for ax in (ax1, ax2):
            ax.axvspan(
                a - t0, b - t0, color=colours(i % 10), alpha=0.18, label=name if ax is ax1 else None
            )
    ax1.legend(loc="upper left", fontsize=7, ncol=3)
    ax2.legend(loc="upper left", fontsize=7)
    ax1.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The drill.


@contextlib.contextmanager
def interrupts_as_exceptions() -> Iterator[None]:
    def raise_interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def drain(
    cluster: Cluster,
    sender: Proc,
    t0: float,
    most: float,
    settle: float,
    left_of: Callable[[], int | None],
    *,
    poll: float,
) -> None:
    """Wait for the sender to finish, then up to ``most`` seconds for every delivery to
    succeed (``left_of``: how many have not, None while that cannot be read), then ``settle``
    seconds for late calls; processes that exit meanwhile are reported (and started again)."""
    assert sender.popen is not None
    while sender.popen.poll() is None:
        time.sleep(0.5)
        cluster.check_exits(t0)
    print(f"  {now() - t0:6.1f}s sender done; waiting for every delivery to succeed", flush=True)
    deadline = now() + most
    left = left_of()
    while now() < deadline and (left is None or left > 0):
        time.sleep(poll)
        cluster.check_exits(t0)
        left = left_of()
    print(f"  {now() - t0:6.1f}s not succeeded: {left}; {settle:.0f} s for late calls", flush=True)
    time.sleep(settle)


def drill(args: argparse.Namespace) -> int:
    global HARD_LIMIT, LEASE  # noqa: PLW0603 (the budgets every part of the drill reads)
    if os.geteuid() != 0:
        print("the drill makes network namespaces: run it as root", file=sys.stderr)
        return 2
    HARD_LIMIT, LEASE = args.hard_limit, 4 * args.hard_limit
    faults_all = make_faults(args.short, args.broker)
    if args.faults is None:
        chosen = list(SHORT_FAULTS) if args.short else list(faults_all)
    else:
        chosen = [n.strip() for n in args.faults.split(",") if n.strip() not in ("", "none")]
    unknown = [n for n in chosen if n not in faults_all]
    if unknown:
        print(f"unknown faults {unknown}; known: {', '.join(faults_all)}", file=sys.stderr)
        return 2
    faults = [faults_all[n] for n in chosen]
    gap = args.gap
    offset = args.warmup
    for f in faults:
        f.start = offset
        offset += f.duration + gap
    if args.duration is None:
        args.duration = offset
    # One drill at a time on a machine: the next one removes the whd- namespaces it finds.
    lock = Path(tempfile.gettempdir()) / "whd-drill.lock"
    lock_file = lock.open("w")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another drill is running (it holds {lock})", file=sys.stderr)
        return 2
    leftovers = our_namespaces()
    if leftovers:
        print(f"removing leftovers of an earlier drill: {' '.join(leftovers)}", flush=True)
        teardown_network()
    tmp = Path(tempfile.mkdtemp(prefix="whd-drill-"))
    tmp.chmod(0o755)
    (tmp / "logs").mkdir()
    cluster = Cluster(tmp, pipeline_env(tmp, args.concurrency, args.broker))
    cluster.supervise = not args.no_supervise
    applied: list[Fault] = []
    t_begin = now()
    status = 1
    try:
        with interrupts_as_exceptions():
            print(f"drill: network, logs in {tmp / 'logs'}", flush=True)
            setup_network()
            start_postgres(cluster)
            start_redis(cluster)
            if args.broker == "rabbitmq":
                start_rabbit(cluster)
            setup_database(cluster)
            start_pipeline(cluster, args.concurrency)
            t0 = now() + 3
            give_up = t0 + args.duration + args.drain
            receivers = ",".join(f"http://{ip_of(h)}:{RECEIVER_PORT}" for h in RECEIVERS)
            sender = Proc("sender", "sender", [str(PYTHON), str(Path(__file__).resolve()), "sender",
                          "--receivers", receivers, "--path", cluster.source_path,
                          "--rate", str(args.rate), "--duration", str(args.duration),
                          "--start-at", str(t0), "--give-up-at", str(give_up),
                          "--out", str(tmp / "sender.jsonl")],
                          {**os.environ, "WHD_SECRET": cluster.secret}, tmp / "logs" / "sender.log")  # fmt: skip
            cluster.start(sender)
            print(f"drill: pipeline up in {t0 - t_begin:.0f} s; sending {args.rate:g}/s for "
                  f"{args.duration:.0f} s; faults: {', '.join(chosen) or 'none'}", flush=True)  # fmt: skip
            schedule: list[tuple[float, str, Fault]] = []
            for f in faults:
                schedule += [(t0 + f.start, "apply", f), (t0 + f.start + f.duration, "revert", f)]
            schedule.sort(key=lambda s: s[0])
            for at, action, f in schedule:
                while now() < at:
                    time.sleep(min(0.2, at - now()))
                    cluster.check_exits(t0)
                if action == "apply":
                    if f.when_busy:
                        wait_busy(tmp / "arrivals.log", ip_of(f.host), 5.0)
                    f.applied_at = now()
                    f.apply(cluster)
                    applied.append(f)
                    print(f"  {now() - t0:6.1f}s {f.name}: {f.what}", flush=True)
                else:
                    f.revert(cluster)
                    f.reverted_at = now()
                    applied.remove(f)
                    print(f"  {now() - t0:6.1f}s {f.name} over", flush=True)
            drain(cluster, sender, t0, args.drain, args.settle, pending_count, poll=2.0)
            outcome, series = analyse(t0, faults, cluster, gap, args)
            out_txt = Path(args.results)
            out_png = Path(args.png)
            header = f"$ {' '.join(['bench/drill_hosts.py', *sys.argv[1:]])}\n"
            out_txt.write_text(header + outcome.text)
            if args.json:
                Path(args.json).write_text(json.dumps(outcome.summary(), indent=1) + "\n")
            plot(series, out_png, f"multi-host drill: {args.rate:g} events/s, lease {LEASE:.0f} s, "
                 f"accepted {outcome.accepted}, lost {outcome.lost}, repeated {outcome.repeats}")  # fmt: skip
            print(outcome.text)
            print(f"wrote {out_txt} and {out_png}; the processes' logs: {tmp / 'logs'}")
            status = 1 if outcome.lost else 0
    except KeyboardInterrupt:
        print("\ndrill interrupted: cleaning up", file=sys.stderr, flush=True)
        status = 130
    finally:
        for f in applied:
            with contextlib.suppress(Exception):
                f.revert(cluster)
        with contextlib.suppress(Exception):
            for host in HOSTS:
                cluster.signal_host(host, signal.SIGCONT)
            cluster.stop_all()
        teardown_network()
        shutil.rmtree(tmp / "pgdata", ignore_errors=True)
        remaining = our_namespaces()
        if remaining:
            print(f"namespaces left behind: {remaining}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode")
    parser.add_argument("--short", action="store_true", help="a <= 3 minute run with three faults")
    parser.add_argument(
        "--faults",
        default=None,
        help="comma-separated faults, or none (default: all, or the short set)",
    )
    parser.add_argument("--rate", type=float, default=40.0, help="events per second")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of sending (default: the schedule's)"
    )
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the first fault")
    parser.add_argument(
        "--gap", type=float, default=None, help="seconds between faults (the 'after' window)"
    )
    parser.add_argument(
        "--drain", type=float, default=None, help="most seconds to wait for every delivery"
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds for late calls after the drain"
    )
    parser.add_argument(
        "--broker", choices=("redis", "rabbitmq"), default="redis",
        help="the broker: redis (the claim tier's server) or a private rabbitmq-server",
    )  # fmt: skip
    parser.add_argument(
        "--no-supervise", action="store_true",
        help="leave a process that exits by itself down (default: start it again, as a supervisor would)",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="threads per worker")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results_drill_hosts.txt"))
    parser.add_argument("--png", default=str(ROOT / "bench" / "drill_hosts.png"))
    parser.add_argument("--json", help="also write the figures a test checks to this file")
    parser.add_argument(
        "--hard-limit", type=float, default=HARD_LIMIT,
        help="the handlers' hard time limit in seconds; the lease is 4x, the faults past a"
        " lease as long as it asks (default 5: a 20 s lease)",
    )  # fmt: skip
    down = sub.add_parser("downstream", help="(internal) the recording downstream")
    down.add_argument("--bind", required=True)
    down.add_argument("--port", type=int, required=True)
    down.add_argument("--out", type=Path, required=True)
    down.add_argument("--delay", type=float, default=0.02)
    slow = sub.add_parser("slowlink", help="(internal) the slow, lossy relay to Postgres")
    slow.add_argument("--port", type=int, required=True)
    slow.add_argument("--target", required=True)
    slow.add_argument("--loss", type=float, default=0.02)
    send = sub.add_parser("sender", help="(internal) the provider-like sender")
    send.add_argument("--receivers", required=True)
    send.add_argument("--path", required=True)
    send.add_argument("--rate", type=float, required=True)
    send.add_argument("--duration", type=float, required=True)
    send.add_argument("--start-at", type=float, required=True)
    send.add_argument("--give-up-at", type=float, required=True)
    send.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.mode == "downstream":
        serve_downstream(args.bind, args.port, args.out, args.delay)
        return 0
    if args.mode == "slowlink":
        asyncio.run(serve_slow_link(args.port, args.target, PG_PORT, args.loss))
        return 0
    if args.mode == "sender":
        asyncio.run(send_events(args.receivers.split(","), args.path, args.rate, args.duration,
                                args.start_at, args.out, args.give_up_at))  # fmt: skip
        return 0
    if args.warmup is None:
        args.warmup = 12.0 if args.short else 20.0
    if args.gap is None:
        args.gap = 15.0 if args.short else 20.0
    if args.drain is None:
        args.drain = 60.0 if args.short else 180.0
    return drill(args)


if __name__ == "__main__":
    sys.exit(main())

"""HTTP clients side by side for the forward path (issue 33 item 1): the client process's CPU
per request and its requests/s, each client configured as ``forward`` must be: a timeout on
connect and on read, a cap on connections, redirects off, every response read whole.

  httpx-sync      an httpx.Client per thread: today's ``forward`` (tasks/handlers/forward.py
                  lends each running call a client of its own)
  httpx-shared    one httpx.Client shared by the threads (its pool holds every connection)
  httpcore-sync   httpcore.ConnectionPool in threads (what httpx.Client wraps)
  urllib3         urllib3.PoolManager in threads (block=True, retries=False, redirect=False)
  httpx-async     httpx.AsyncClient, one asyncio loop, one task per request in flight
  httpcore-async  httpcore.AsyncConnectionPool, one asyncio loop
  aiohttp         aiohttp.ClientSession with a TCPConnector(limit=C), one asyncio loop
  aiohttp-uvloop  the same on uvloop

Each client runs in a fresh process (``--worker``): it opens its connections with a warm-up
of ``--warmup`` requests (at least two per connection), then sends ``--requests`` POSTs of a 1 KB JSON body with forward's
headers, ``--concurrency`` in flight, and reports its own CPU seconds (user + system over all
its threads, from the kernel) per request and its requests/s. The downstream
(``bench/downstream_app.py`` under uvicorn with httptools on uvloop) answers 200 after
``--delays`` ms (0: as fast as it can, the client's cost alone; 100: forward's usual case, many
requests waiting). Clients run in a different order each round; the table gives medians and
each client's CPU per request as a ratio of today's (httpx-sync) in the same run. Before the
rounds, wrk measures the downstream alone at delay 0 (the ceiling): a client can only be seen
if the downstream outruns it.

How each client would keep forward's address guard (resolved addresses checked at connect
time, so DNS cannot swap them): httpx and httpcore through a network backend whose
``connect_tcp`` checks the address (today's ``_CheckedTransport``); aiohttp through a resolver
(``AbstractResolver``) that drops refused addresses before the connector dials them; urllib3
through a connection class whose ``_new_conn`` checks the address it connects to.

Usage: .venv/bin/python bench/bench_http_clients.py [--requests 4000] [--concurrency 64]
       [--delays 0,100] [--rounds 3] [--clients httpx-sync,aiohttp,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PORT = 18831
URL = f"http://127.0.0.1:{PORT}/hook"
CLIENTS = (
    "httpx-sync",
    "httpx-shared",
    "httpcore-sync",
    "urllib3",
    "httpx-async",
    "httpcore-async",
    "aiohttp",
    "aiohttp-uvloop",
)
BASELINE = "httpx-sync"
CONNECT_S, READ_S = 5.0, 10.0


def _body() -> bytes:
    return json.dumps({"sent_at": time.time(), "data": "x" * 960}).encode()


HEADERS = {
    "content-type": "application/json",
    "user-agent": "webhook-pipeline-forward",
    "webhook-id": "evt_0123456789abcdefghij",
    "webhook-timestamp": "1765000000",
    "webhook-signature": "v1," + "A" * 44,
    "idempotency-key": "dlv_0123456789abcdefghij",
}


# -- the clients (run inside a --worker process) ----------------------------------------------


def _threaded(n: int, concurrency: int, one: Callable[[], int]) -> None:
    """``n`` calls of ``one`` from ``concurrency`` threads; each must answer 200."""
    left = [n]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def lane() -> None:
        while True:
            with lock:
                if left[0] == 0 or errors:
                    return
                left[0] -= 1
            try:
                status = one()
                if status != 200:
                    raise RuntimeError(f"status {status}")
            except BaseException as exc:  # reported after the run
                errors.append(exc)
                return

    threads = [threading.Thread(target=lane) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


async def _gathered(n: int, concurrency: int, one: Callable[[], Any]) -> None:
    left = [n]

    async def lane() -> None:
        while left[0]:
            left[0] -= 1
            status = await one()
            if status != 200:
                raise RuntimeError(f"status {status}")

    await asyncio.gather(*(lane() for _ in range(concurrency)))


def _sync_client(name: str, concurrency: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(run(n), close) for a client used from threads."""
    if name in ("httpx-sync", "httpx-shared"):
        import httpx

        def make() -> httpx.Client:
            return httpx.Client(
                timeout=httpx.Timeout(READ_S, connect=CONNECT_S),
                limits=httpx.Limits(
                    max_connections=concurrency, max_keepalive_connections=concurrency
                ),
                follow_redirects=False,
            )

        shared = make()
        local = threading.local()
        clients = [shared]

        def own() -> httpx.Client:
            client: httpx.Client | None = getattr(local, "client", None)
            if client is None:
                client = local.client = make()
                clients.append(client)
            return client

        pick = (lambda: shared) if name == "httpx-shared" else own

        def one() -> int:
            response = pick().post(URL, content=_body(), headers=HEADERS)
            response.read()
            return response.status_code

        def close() -> None:
            for client in clients:
                client.close()

        return (lambda n: _threaded(n, concurrency, one)), close
    if name == "httpcore-sync":
        import httpcore

        pool = httpcore.ConnectionPool(max_connections=concurrency)
        ext = {"timeout": {"connect": CONNECT_S, "read": READ_S, "write": READ_S, "pool": READ_S}}

        def one_core() -> int:
            response = pool.request("POST", URL, headers=HEADERS, content=_body(), extensions=ext)
            return response.status

        return (lambda n: _threaded(n, concurrency, one_core)), pool.close
    if name == "urllib3":
        import urllib3

        manager = urllib3.PoolManager(
            maxsize=concurrency,
            block=True,
            timeout=urllib3.Timeout(connect=CONNECT_S, read=READ_S),
            retries=False,
        )

        def one_u3() -> int:
            response = manager.request("POST", URL, body=_body(), headers=HEADERS, redirect=False)
            return response.status

        return (lambda n: _threaded(n, concurrency, one_u3)), manager.clear
    raise ValueError(name)


async def _async_run(name: str, n_warm: int, n: int, concurrency: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``n`` requests after ``n_warm``, on the running loop."""
    close: Callable[[], Any]
    if name == "httpx-async":
        import httpx

        client = httpx.AsyncClient(
            timeout=httpx.Timeout(READ_S, connect=CONNECT_S),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            follow_redirects=False,
        )

        async def one() -> int:
            response = await client.post(URL, content=_body(), headers=HEADERS)
            await response.aread()
            return response.status_code

        close = client.aclose
    elif name == "httpcore-async":
        import httpcore

        pool = httpcore.AsyncConnectionPool(max_connections=concurrency)
        ext = {"timeout": {"connect": CONNECT_S, "read": READ_S, "write": READ_S, "pool": READ_S}}

        async def one() -> int:
            response = await pool.request(
                "POST", URL, headers=HEADERS, content=_body(), extensions=ext
            )
            return response.status

        close = pool.aclose
    elif name.startswith("aiohttp"):
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency),
            timeout=aiohttp.ClientTimeout(total=READ_S, sock_connect=CONNECT_S),
        )

        async def one() -> int:
            async with session.post(
                URL, data=_body(), headers=HEADERS, allow_redirects=False
            ) as response:
                await response.read()
                return response.status

        close = session.close
    else:
        raise ValueError(name)
    await _gathered(n_warm, concurrency, one)
    cpu0, wall0 = _cpu(), time.perf_counter()
    await _gathered(n, concurrency, one)
    cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
    await close()
    return cpu, wall


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def worker(name: str, n_warm: int, n: int, concurrency: int) -> None:
    if name in ("httpx-sync", "httpx-shared", "httpcore-sync", "urllib3"):
        run, close = _sync_client(name, concurrency)
        run(n_warm)
        cpu0, wall0 = _cpu(), time.perf_counter()
        run(n)
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
        close()
    elif name == "aiohttp-uvloop":
        import uvloop

        cpu, wall = uvloop.run(_async_run(name, n_warm, n, concurrency))
    else:
        cpu, wall = asyncio.run(_async_run(name, n_warm, n, concurrency))
    print(json.dumps({"client": name, "rate": n / wall, "cpu_ms": 1000 * cpu / n}))


# -- the driver ----------------------------------------------------------------------------


def _wait_port(proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the downstream exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", PORT)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("the downstream did not start")


def _downstream(delay_ms: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BENCH_DELAY_MS": str(delay_ms), "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).parent / "uvicorn"), "bench.downstream_app:app",
           "--port", str(PORT), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
           "--log-level", "warning", "--backlog", "4096", "--timeout-keep-alive", "300"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)  # noqa: S603
    _wait_port(proc)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ceiling(tmp: Path) -> str:
    """wrk's requests/s against the downstream at delay 0 (the most it answers)."""
    if shutil.which("wrk") is None:
        return "wrk not installed: ceiling not measured"
    script = tmp / "post.lua"
    body = _body().decode().replace("\\", "\\\\").replace('"', '\\"')
    script.write_text(f'wrk.method = "POST"\nwrk.body = "{body}"\n'
                      'wrk.headers["content-type"] = "application/json"\n')  # fmt: skip
    out = subprocess.run(
        ["wrk", "-t1", "-c64", "-d4s", "-s", str(script), URL],  # noqa: S607
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    rate = next(line for line in out.splitlines() if line.startswith("Requests/sec"))
    return f"wrk against the downstream at delay 0: {rate.split()[-1]} req/s (the ceiling)"


def _one(name: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    # Warm-up opens every connection (twice the lanes' requests), so the measured part opens none.
    warmup = max(args.warmup, 2 * concurrency)
    cmd = [sys.executable, __file__, "--worker", name, "--requests", str(args.requests),
           "--warmup", str(warmup), "--concurrency", str(concurrency)]  # fmt: skip
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)  # noqa: S603
    if done.returncode != 0:  # reported in the table as failed, with its last line
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"client": name, "rate": 0.0, "cpu_ms": float("nan"), "error": last[:120]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--delays", default="0,100", help="the downstream's delays, ms")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.warmup, args.requests, args.concurrency)
        return
    clients = [c for c in args.clients.split(",") if c]
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown or BASELINE not in clients:
        parser.error(f"--clients: unknown {unknown}; known {CLIENTS}, {BASELINE} required")
    print(f"bench_http_clients: {args.requests} POSTs of 1 KB per run after {args.warmup} "
          f"of warm-up, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)  # fmt: skip
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmpdir:
        tmp = Path(tmpdir)
        for delay in (int(d) for d in args.delays.split(",")):
            # At a delay, enough in flight that the downstream's wait is not what limits.
            concurrency = args.concurrency if delay == 0 else max(args.concurrency, 256)
            proc = _downstream(delay, tmp / "downstream.log")
            try:
                if delay == 0:
                    print(_ceiling(tmp), flush=True)
                runs: dict[str, list[dict[str, Any]]] = {c: [] for c in clients}
                for r in range(args.rounds):
                    order = clients[r % len(clients) :] + clients[: r % len(clients)]
                    for name in order:
                        result = _one(name, args, concurrency)
                        runs[name].append(result)
                        failed = f"  FAILED: {result['error']}" if "error" in result else ""
                        print(f"delay {delay:>3} ms  round {r + 1}  {name:<15} "
                              f"{result['rate']:8.0f} req/s  {result['cpu_ms']:.3f} ms CPU/req"
                              f"{failed}", flush=True)  # fmt: skip
            finally:
                _stop(proc)
            _table(delay, concurrency, runs)


def _table(delay: int, concurrency: int, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Medians over each client's runs that finished; a client's failed runs are counted."""
    ok = {name: [r for r in results if "error" not in r] for name, results in runs.items()}
    cpu = {name: statistics.median(r["cpu_ms"] for r in rs) for name, rs in ok.items() if rs}
    base = cpu.get(BASELINE)
    print(f"\ndelay {delay} ms, {concurrency} in flight: medians over the rounds")
    print(f"{'client':<15} {'req/s':>8} {'CPU ms/req':>11} {'CPU / ' + BASELINE:>17}")
    for name in sorted(cpu, key=cpu.__getitem__):
        rate = statistics.median(r["rate"] for r in ok[name])
        ratio = f"{cpu[name] / base:16.2f}x" if base else "  (no baseline)"
        failed = len(runs[name]) - len(ok[name])
        note = f"  ({failed} of {len(runs[name])} runs failed)" if failed else ""
        print(f"{name:<15} {rate:8.0f} {cpu[name]:11.3f} {ratio}{note}")
    for name in sorted(set(runs) - set(cpu)):
        print(f"{name:<15} every run failed: {runs[name][-1]['error']}")
    print(flush=True)


if __name__ == "__main__":
    main()

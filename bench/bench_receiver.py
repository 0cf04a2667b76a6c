"""Receiver benchmark: durable accepts per second and latency, against three baselines.

Every target runs under uvicorn (uvloop, httptools; ours through `webhooks serve`, as deployed,
with its server limits) with the same number of processes and is
loaded by wrk on loopback with pre-signed Standard Webhooks requests (1 KB JSON bodies, every
request a new event id). Targets, measured side by side in the same run, in alternating rounds:

  ours          the pipeline's receiver: verify, one transaction (receipt + delivery), publish
  naive         FastAPI + HMAC check + task.delay(payload), no database
  naive_insert  the same + one INSERT per request (SQLAlchemy session in the threadpool)
  bare          a bare ASGI app that returns 200

Usage: .venv/bin/python bench/bench_receiver.py [--seconds 8] [--connections 32] [--workers 2]
Needs wrk (Debian package ``wrk``). Uses its own database and Redis DB 13; drops them after.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson
import psycopg
import redis
from standardwebhooks.webhooks import Webhook

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DB = "webhooks_bench_receiver"
BROKER = "redis://127.0.0.1:6379/13"
PORT = 18765

LUA = r"""
local reqs = {}
local n = 0
local i = 0
wrapped = false
init = function(args)
  local f = assert(io.open(args[1], "r"))
  for line in f:lines() do
    local id, ts, sig, path, body = line:match("^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$")
    n = n + 1
    reqs[n] = wrk.format("POST", path, {
      ["Content-Type"] = "application/json",
      ["webhook-id"] = id, ["webhook-timestamp"] = ts, ["webhook-signature"] = sig,
    }, body)
  end
  f:close()
end
request = function()
  i = i + 1
  if i > n then i = 1 end
  return reqs[i]
end
"""


def env_for(secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.update(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        WEBHOOKS_BROKER_URL=BROKER,
        WEBHOOKS_REDIS_URL="redis://127.0.0.1:6379/12",
        WEBHOOKS_SECRET_KEY="bench-secret-key-" + "b" * 32,
        WEBHOOKS_LOG_LEVEL="INFO",
        BENCH_SECRET=secret,
        PYTHONPATH=str(ROOT),
    )
    return env


def setup_database(env: dict[str, str]) -> tuple[str, str]:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    subprocess.run(
        [str(BIN / "webhooks"), "db", "upgrade"], env=env, check=True, capture_output=True
    )
    out = subprocess.run(
        [str(BIN / "webhooks"), "sources", "add", "bench", "--provider", "standard", "--json"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    view = orjson.loads(out)
    subprocess.run(
        [str(BIN / "webhooks"), "routes", "add", view["id"], "--handler", "log"],
        env=env,
        check=True,
        capture_output=True,
    )
    return view["id"], view["secret"]


def write_requests(path: Path, secret: str, url_path: str, count: int) -> None:
    wh = Webhook(secret)
    now = datetime.now(UTC)
    ts = str(int(now.timestamp()))
    pad = "x" * 860
    with path.open("w") as f:
        for _ in range(count):
            event_id = f"msg_{uuid.uuid4().hex}"
            body = orjson.dumps(
                {
                    "type": "invoice.paid",
                    "timestamp": now.isoformat(),
                    "data": {"id": event_id, "pad": pad},
                }
            ).decode()
            sig = wh.sign(event_id, now, body)
            f.write(f"{event_id}\t{ts}\t{sig}\t{url_path}\t{body}\n")


def start(target: str, env: dict[str, str], workers: int, log: Path) -> subprocess.Popen[bytes]:
    if target == "ours":
        # As deployed: `webhooks serve` (uvicorn with the receiver's server limits, and the
        # admin address beside it on PORT + 1).
        cmd = [str(BIN / "webhooks"), "serve", "--port", str(PORT), "--workers", str(workers)]
        env = {**env, "WEBHOOKS_ADMIN_PORT": str(PORT + 1)}
        proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT
        )  # noqa: S603
        return _wait_listening(proc, target, log)
    app = f"bench.naive_apps:{target}"
    cmd = [
        str(BIN / "uvicorn"),
        "--factory",
        app,
        "--port",
        str(PORT),
        "--workers",
        str(workers),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)  # noqa: S603
    return _wait_listening(proc, target, log)


def _wait_listening(
    proc: subprocess.Popen[bytes], target: str, log: Path
) -> subprocess.Popen[bytes]:
    deadline = time.monotonic() + 20
    import socket

    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", PORT)) == 0:
                time.sleep(0.5)
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{target} did not start; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wrk(script: Path, requests: Path, seconds: int, connections: int, url: str) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            "-s",
            str(script),
            url,
            "--",
            str(requests),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout

    def latency(label: str) -> float:
        m = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "rps": rps,
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
        "total": total,
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": 1 if errors else 0,
    }


def receipts() -> int:
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DB}") as conn:
        return int(conn.execute("SELECT count(*) FROM receipts").fetchone()[0])  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument(
        "--targets", default="bare,naive,naive_insert,ours", help="comma-separated subset"
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install wrk")

    tmp = Path(tempfile.mkdtemp(prefix="bench-receiver-"))
    env = env_for("placeholder")
    source_id, secret = setup_database(env)
    env = env_for(secret)
    script = tmp / "requests.lua"
    script.write_text(LUA)
    broker = redis.Redis.from_url(BROKER)
    results: dict[str, list[dict[str, float]]] = {t: [] for t in args.targets.split(",")}
    for rnd in range(args.rounds):
        for target in results:
            path = f"/webhooks/{source_id}" if target == "ours" else "/webhook"
            reqs = tmp / f"{target}-{rnd}.tsv"
            write_requests(reqs, secret, path, args.requests)
            proc = start(target, env, args.workers, tmp / f"{target}.log")
            try:
                before = receipts()
                r = wrk(script, reqs, args.seconds, args.connections, f"http://127.0.0.1:{PORT}")
                if target == "ours":
                    r["durable"] = receipts() - before
            finally:
                stop(proc)
                broker.flushdb()
            if r["total"] > args.requests:
                print(
                    f"warning: {target} wrapped around its {args.requests} requests",
                    file=sys.stderr,
                )
            results[target].append(r)
            print(
                f"round {rnd + 1} {target:13s} {r['rps']:9.0f} req/s  p50 {r['p50_ms']:.2f} ms  "
                f"p99 {r['p99_ms']:.2f} ms  non-2xx {int(r['non2xx'])}",
                flush=True,
            )

    if set(results) != {"bare", "naive", "naive_insert", "ours"}:
        for t, rs in results.items():
            print(f"{t}: median {statistics.median(x['rps'] for x in rs):.0f} req/s")
        return
    med = {t: statistics.median(x["rps"] for x in rs) for t, rs in results.items()}
    p50 = {t: statistics.median(x["p50_ms"] for x in rs) for t, rs in results.items()}
    p99 = {t: statistics.median(x["p99_ms"] for x in rs) for t, rs in results.items()}
    ours = results["ours"]
    # Every acknowledged request has its receipt (requests still in flight when wrk stops
    # may add receipts that no counted response acknowledged).
    durable_ok = all(int(r["durable"]) >= int(r["total"]) - int(r["non2xx"]) for r in ours)
    print()
    print(
        f"receiver benchmark: {args.workers} uvicorn processes per target, wrk 1 thread "
        f"{args.connections} connections, {args.seconds}s x {args.rounds} rounds, 1 KB Standard Webhooks bodies"
    )
    print(f"cpu cores: {os.cpu_count()}")
    print(f"{'target':14s} {'req/s (median)':>15s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for t in results:
        print(f"{t:14s} {med[t]:15.0f} {p50[t]:8.2f} {p99[t]:8.2f}")
    print(
        f"every 2xx of ours is a durable receipt: {durable_ok} "
        f"({[int(r['durable']) for r in ours]} receipts for {[int(r['total'] - r['non2xx']) for r in ours]} 2xx)"
    )
    print(f"ratio ours / naive_insert (b): {med['ours'] / med['naive_insert']:.2f}  (floor 1.5)")
    print(f"ratio ours / naive (a):        {med['ours'] / med['naive']:.2f}  (floor 1.0)")
    print(f"ratio ours / bare (c):         {med['ours'] / med['bare']:.2f}")
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Fairness benchmark (issue 23): one worker host as the README runs it (the receiver, one
``celery -A tasks worker -Q deliveries,maintenance -P threads -c 50`` and beat), a local
downstream (``bench/fairness_downstream.py``) with a delay per route, real signed requests.

  noisy neighbour  a burst of ``--burst`` events (6,000) from one sender to a route whose
                   downstream takes 200 ms, while another sender sends 4 events/s to its own
                   route (10 ms) for ``--quiet-seconds``. Floor: the quiet sender's maximum
                   receipt -> downstream latency (the receipt's received_at, the downstream's
                   arrival, one host's clock) at most 1 s. Also p50 / p99, and how long the
                   burst took to drain.
  outage           a downstream that answers 503 for 45 s while its sender sends 10 events/s
                   for 20 s (and a quiet sender 4 events/s to a healthy route throughout),
                   retry timing shrunk: base 1 s, cap 4 s (WEBHOOKS_RETRY_BASE / _CAP), the
                   breaker's probe interval 5 s and the sweep interval 2 s, so that 45 s
                   stands for hours at the defaults. Floors: once the breaker opened, at most
                   1 call/s reaches the failing downstream; nothing goes dead; the backlog is
                   delivered within 30 s of recovery; the quiet sender within 1 s.

``--compare DIR`` also runs the receiver, worker and beat of another checkout (e.g. main,
made with ``git worktree add``) for the same noisy-neighbour drill, this tree's first, so the
improvement is a ratio in one run. ``--against REV`` makes that checkout (a git worktree of
REV, bench/revisions.py) and runs the drill ``--rounds`` times per tree in alternating order
(this tree first in odd rounds, REV first in even ones), then the outage once per tree
(unless ``--skip-outage``); it prints each run, the means and this tree's ratio to REV's (the
quiet sender's max and p99, the burst's drain time, the outage's figures). Each checkout's
code is found through bench/compat.py (its receiver's module path, its CLI).

Usage: .venv/bin/python bench/bench_fairness.py [--compare /tmp/main-wt] [--burst 6000]
       [--against REV --rounds 2]
Uses its own database and Redis DBs 12 (broker) and 13 (claims) of --redis-port (6394).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat import cli, target  # noqa: E402
from revisions import remove_worktree, worktree  # noqa: E402

from bench import bench_forward  # noqa: E402
from bench.bench_forward import Sender, stop, uvicorn  # noqa: E402

BIN = Path(sys.executable).parent
DB = "webhooks_bench_fairness"
RECEIVER_PORT = 18812
DOWNSTREAM_PORT = 18811
DOWNSTREAM = f"http://127.0.0.1:{DOWNSTREAM_PORT}"
DELAYS = "noisy=200,quiet=10,failing=10,healthy=10"


def env_for(code: Path, redis_port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.update(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{DB}",
        WEBHOOKS_BROKER_URL=f"redis://127.0.0.1:{redis_port}/12",
        WEBHOOKS_REDIS_URL=f"redis://127.0.0.1:{redis_port}/13",
        WEBHOOKS_SECRET_KEY="bench-secret-key-" + "f" * 32,
        WEBHOOKS_LOG_LEVEL="WARNING",
        WEBHOOKS_LOG_JSON="true",
        WEBHOOKS_PORT=str(RECEIVER_PORT),
        PYTHONPATH=str(code),
        **extra,
    )
    return env


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


class Pipeline:
    """Receiver, worker and beat of one checkout on a fresh database."""

    def __init__(self, code: Path, env: dict[str, str], logdir: Path) -> None:
        self.code, self.env, self.logdir = code, env, logdir
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        for url in (env["WEBHOOKS_BROKER_URL"], env["WEBHOOKS_REDIS_URL"]):
            client = redis.Redis.from_url(url)
            client.flushdb()
            client.close()
        self.cli("db", "upgrade")
        self.procs: list[subprocess.Popen[bytes]] = []

    def cli(self, *argv: str) -> str:
        return subprocess.run(
            [*cli(self.code), *argv], env=self.env, check=True, capture_output=True,
            text=True, cwd=self.code,
        ).stdout  # fmt: skip

    def sender(self, name: str, path: str) -> tuple[Sender, int]:
        view = orjson.loads(self.cli("sources", "add", name, "--provider", "standard", "--json"))
        self.cli(
            "routes", "add", view["id"], "--handler", "forward",
            "--option", f"url={DOWNSTREAM}/{path}", "--option", "allow_private=true",
        )  # fmt: skip
        return Sender(view["id"], view["secret"]), 0

    def start(self) -> None:
        bench_forward.RECEIVER_PORT = RECEIVER_PORT  # the senders' lanes
        # From the checkout's directory: uvicorn puts its working directory first on sys.path
        # (before 2026-12-04 the receiver ran from this tree's, whatever the checkout).
        app = target("receiver", self.code)
        self.procs.append(
            uvicorn(app, RECEIVER_PORT, self.env, self.logdir / "rx.log", cwd=self.code)
        )
        celery = [str(BIN / "celery"), "-A", target("worker", self.code)]
        for name, argv in (
            ("worker", [*celery, "worker", "-Q", "deliveries,maintenance", "-P", "threads",
                        "-c", "50", "-n", "fair@%h", "--loglevel", "WARNING"]),
            ("beat", [*celery, "beat", "-s", str(self.logdir / "beat-schedule"),
                      "--loglevel", "WARNING"]),
        ):  # fmt: skip
            out = (self.logdir / f"{name}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.code
                )  # noqa: S603
            )
        time.sleep(4.0)  # the worker's pool and dispatcher up (one warm-up event follows)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)

    def statuses(self) -> dict[str, int]:
        with psycopg.connect(self.env["WEBHOOKS_DATABASE_URL"]) as conn:
            rows = conn.execute("SELECT status, count(*) FROM deliveries GROUP BY 1").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def received(self) -> dict[str, float]:
        with psycopg.connect(self.env["WEBHOOKS_DATABASE_URL"]) as conn:
            rows = conn.execute(
                "SELECT event_id, extract(epoch FROM received_at) FROM receipts"
            ).fetchall()
        return {str(r[0]): float(r[1]) for r in rows}

    def breaker_opened(self) -> float | None:
        with psycopg.connect(self.env["WEBHOOKS_DATABASE_URL"]) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM min(breaker_opened_at)) FROM routes"
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])


def calls() -> list[list[Any]]:
    found: list[list[Any]] = httpx.get(f"{DOWNSTREAM}/stats", timeout=30).json()["calls"]
    return found


def peaks() -> dict[str, int]:
    found: dict[str, int] = httpx.get(f"{DOWNSTREAM}/stats", timeout=30).json()["peak"]
    return found


def latencies(path: str, received: dict[str, float]) -> list[float]:
    """Receipt -> downstream arrival of each event's first successful call on ``path``."""
    first: dict[str, float] = {}
    for name, arrived, status, event_id in calls():
        if name == path and status == 200 and event_id in received:
            first.setdefault(event_id, arrived)
    return [first[e] - received[e] for e in first]


def pct(values: list[float], q: int) -> float:
    return (
        statistics.quantiles(sorted(values), n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


@dataclass
class Noisy:
    label: str
    quiet_p50: float
    quiet_p99: float
    quiet_max: float
    quiet_n: int
    burst_drained_s: float
    noisy_peak: int


def wait_done(pipe: Pipeline, total: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        done = pipe.statuses()
        if done.get("succeeded", 0) + done.get("dead", 0) >= total:
            return time.monotonic() - start
        time.sleep(0.5)
    raise RuntimeError(f"not done after {timeout}s: {pipe.statuses()}")


def noisy_neighbour(label: str, code: Path, args: argparse.Namespace, logdir: Path) -> Noisy:
    budget = {} if args.budget is None else {"WEBHOOKS_ROUTE_MAX_IN_FLIGHT": str(args.budget)}
    pipe = Pipeline(code, env_for(code, args.redis_port, budget), logdir)
    noisy, _ = pipe.sender("noisy", "noisy")
    quiet, _ = pipe.sender("quiet", "quiet")
    httpx.delete(f"{DOWNSTREAM}/stats")
    pipe.start()
    try:
        asyncio.run(quiet.burst(2, concurrency=1))  # warm-up: connections open
        wait_done(pipe, 2, 30)
        httpx.delete(f"{DOWNSTREAM}/stats")
        progress(f"{label}: burst of {args.burst} beside 4 events/s for {args.quiet_seconds}s")
        start = time.monotonic()

        async def both() -> int:
            burst = asyncio.create_task(noisy.burst(args.burst))
            await asyncio.sleep(0.5)  # the burst is arriving: the trickle starts behind it
            sent = await quiet.paced(4.0, args.quiet_seconds, lanes=4)
            await burst
            return sent

        sent = asyncio.run(both())
        wait_done(pipe, args.burst + sent + 2, 900)
        drained = time.monotonic() - start
        received = pipe.received()
        quiet_lat = latencies("quiet", received)
        out = Noisy(
            label,
            pct(quiet_lat, 50),
            pct(quiet_lat, 99),
            max(quiet_lat),
            len(quiet_lat),
            drained,
            peaks().get("noisy", 0),
        )
        progress(f"{label}: {out}")
        return out
    finally:
        pipe.stop()


@dataclass
class Outage:
    opened_after_s: float | None
    calls_failing_total: int
    calls_failing_after_open: int
    worst_second_after_open: int
    after_open_per_s: float
    dead: int
    statuses: dict[str, int]
    backlog_after_recovery_s: float
    quiet_p50: float
    quiet_p99: float
    quiet_max: float


def outage(code: Path, args: argparse.Namespace, logdir: Path) -> Outage:
    extra = {
        "WEBHOOKS_RETRY_BASE": "1",
        "WEBHOOKS_RETRY_CAP": "4",
        "WEBHOOKS_BREAKER_PROBE_INTERVAL": "5",
        "WEBHOOKS_SWEEP_INTERVAL": "2",
    }
    pipe = Pipeline(code, env_for(code, args.redis_port, extra), logdir)
    failing, _ = pipe.sender("failing", "failing")
    healthy, _ = pipe.sender("healthy", "healthy")
    httpx.delete(f"{DOWNSTREAM}/stats")
    pipe.start()
    try:
        asyncio.run(healthy.burst(2, concurrency=1))
        wait_done(pipe, 2, 30)
        httpx.delete(f"{DOWNSTREAM}/stats")
        start = time.time()
        recovery = start + 45.0
        httpx.post(f"{DOWNSTREAM}/control", params={"path": "failing", "until": recovery})
        progress("outage: 503 for 45 s, 10 events/s for 20 s, 4 events/s healthy for 50 s")

        async def both() -> int:
            sent = await asyncio.gather(
                failing.paced(10.0, 20.0, lanes=4), healthy.paced(4.0, 50.0, lanes=4)
            )
            return sum(sent)

        sent = asyncio.run(both())
        wait_done(pipe, sent + 2, 300)
        received = pipe.received()
        made = calls()
        failing_calls = [c for c in made if c[0] == "failing"]
        opened = pipe.breaker_opened()
        after_open = [c for c in failing_calls if opened is not None and opened <= c[1] < recovery]
        per_second: dict[int, int] = {}
        for c in after_open:
            per_second[int(c[1] - (opened or 0))] = per_second.get(int(c[1] - (opened or 0)), 0) + 1
        # Sliding one-second windows over the calls after the opening, up to the recovery.
        times = sorted(c[1] for c in after_open)
        worst = max((sum(1 for t in times if s <= t < s + 1.0) for s in times), default=0)
        delivered = [c[1] for c in failing_calls if c[2] == 200]
        statuses = pipe.statuses()
        quiet_lat = latencies("healthy", received)
        out = Outage(
            None if opened is None else opened - start,
            len(failing_calls),
            len(after_open),
            worst,
            len(after_open) / max(1e-9, recovery - (opened or recovery)),
            statuses.get("dead", 0),
            statuses,
            (max(delivered) - recovery) if delivered else float("inf"),
            pct(quiet_lat, 50),
            pct(quiet_lat, 99),
            max(quiet_lat),
        )
        progress(f"outage: {out}")
        return out
    finally:
        pipe.stop()


def met(ok: bool) -> str:
    return "floor met" if ok else "floor NOT met"


def noisy_lines(args: argparse.Namespace, runs: list[Noisy]) -> list[str]:
    lines = [
        "",
        f"noisy neighbour: {args.burst} events to a 200 ms downstream, beside 4 events/s to"
        f" a 10 ms one for {args.quiet_seconds:.0f} s; in-flight budget"
        f" {args.budget or 'default (WEBHOOKS_ROUTE_MAX_IN_FLIGHT)'}",
        "  run              quiet p50 ms  p99 ms  max ms  (events)  burst drained s"
        "  noisy peak concurrency",
    ]
    for r in runs:
        lines.append(
            f"  {r.label:<16} {1000 * r.quiet_p50:>12.0f} {1000 * r.quiet_p99:>7.0f}"
            f" {1000 * r.quiet_max:>7.0f}  ({r.quiet_n:>4})  {r.burst_drained_s:>15.1f}"
            f"  {r.noisy_peak:>22}"
        )
    return lines


def outage_lines(label: str, o: Outage) -> list[str]:
    return [
        "",
        f"outage ({label}): /failing answers 503 for 45 s; its sender 10 events/s for 20 s; a"
        " quiet sender 4 events/s to /healthy for 50 s; retry base 1 s cap 4 s, probe interval"
        " 5 s, sweep 2 s",
        f"  breaker opened {o.opened_after_s:.1f} s into the outage"
        if o.opened_after_s is not None
        else "  breaker never opened",
        f"  calls to the failing downstream: {o.calls_failing_total} in all,"
        f" {o.calls_failing_after_open} between the opening and the recovery"
        f" ({o.after_open_per_s:.2f}/s; busiest 1-s window {o.worst_second_after_open}):"
        f" {met(o.worst_second_after_open <= 1)} (<= 1 call/s)",
        f"  dead: {o.dead} ({o.statuses}): {met(o.dead == 0)}",
        f"  backlog delivered {o.backlog_after_recovery_s:.1f} s after the recovery:"
        f" {met(o.backlog_after_recovery_s <= 30.0)} (<= 30 s)",
        f"  quiet sender p50 {1000 * o.quiet_p50:.0f} ms p99 {1000 * o.quiet_p99:.0f} ms"
        f" max {1000 * o.quiet_max:.0f} ms: {met(o.quiet_max <= 1.0)} (<= 1 s)",
    ]


def ratio(label: str, this: float, other: float, rev: str) -> str:
    """A time of this tree's against REV's: the ratio (below 1: this tree is faster) and
    the speed (REV's time / this tree's: the acceptance's "at least 0.95x main's")."""
    return (
        f"  {label}: {this:.3f} against {rev}'s {other:.3f}: {this / other:.2f}x"
        f" (speed {other / this:.2f}x {rev}'s)"
        if this > 0 and other > 0
        else f"  {label}: {this:.3f} against {rev}'s {other:.3f}"
    )


def against(args: argparse.Namespace, logdir: Path, lines: list[str]) -> None:
    """The drill ``args.rounds`` times per tree, alternating; then the outage once each."""
    rev, made = worktree(args.against)
    trees = {"this tree": ROOT, args.against: rev}
    lines.append(f"against {args.against} ({rev}), {args.rounds} run(s) each, alternating")
    try:
        runs: dict[str, list[Noisy]] = {name: [] for name in trees}
        ran: list[Noisy] = []  # in the order they ran
        for k in range(args.rounds):
            for name in list(trees) if k % 2 == 0 else list(reversed(trees)):
                ran.append(noisy_neighbour(f"{name} {k + 1}", trees[name], args, logdir))
                runs[name].append(ran[-1])
        lines += noisy_lines(args, ran)
        means = {
            name: {
                "quiet max s": statistics.fmean(r.quiet_max for r in rs),
                "quiet p99 s": statistics.fmean(r.quiet_p99 for r in rs),
                "quiet p50 s": statistics.fmean(r.quiet_p50 for r in rs),
                "burst drained s": statistics.fmean(r.burst_drained_s for r in rs),
            }
            for name, rs in runs.items()
        }
        lines.append(f"  means, this tree against {args.against}:")
        lines += [
            ratio(key, means["this tree"][key], means[args.against][key], args.against)
            for key in means["this tree"]
        ]
        print("\n".join(lines), flush=True)
        if not args.skip_outage:
            outages = {name: outage(code, args, logdir) for name, code in trees.items()}
            for name, o in outages.items():
                lines += outage_lines(name, o)
            this, other = outages["this tree"], outages[args.against]
            lines.append(f"  outage, this tree against {args.against}:")
            lines += [
                ratio("calls/s to the failing downstream while open", this.after_open_per_s,
                      other.after_open_per_s, args.against),
                ratio("backlog delivered after the recovery s", this.backlog_after_recovery_s,
                      other.backlog_after_recovery_s, args.against),
                ratio("quiet sender max s", this.quiet_max, other.quiet_max, args.against),
                f"  dead: {this.dead} against {other.dead}",
            ]  # fmt: skip
    finally:
        if made:
            remove_worktree(rev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--burst", type=int, default=6000)
    parser.add_argument("--quiet-seconds", type=float, default=30.0)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout (main)")
    parser.add_argument("--against", metavar="REV", help="this tree against REV's code")
    parser.add_argument("--rounds", type=int, default=2, help="--against: drills per tree")
    parser.add_argument("--skip-outage", action="store_true")
    parser.add_argument(
        "--budget", type=int, default=None, help="WEBHOOKS_ROUTE_MAX_IN_FLIGHT (noisy drill)"
    )
    parser.add_argument("--redis-port", type=int, default=6394)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results_fairness.txt")
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    downstream = uvicorn(
        "bench.fairness_downstream:app",
        DOWNSTREAM_PORT,
        {**os.environ, "BENCH_PATH_DELAYS": DELAYS, "PYTHONPATH": str(ROOT)},
        logdir / "downstream.log",
    )
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    lines = [
        f"bench_fairness: this tree ({commit}), one worker host as the README runs it (receiver,"
        f" worker -P threads -c 50, beat), {os.cpu_count()} CPUs,"
        f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f}",
        f"logs: {logdir}",
    ]
    try:
        if args.against:
            against(args, logdir, lines)
        else:
            single(args, logdir, lines)
    finally:
        stop(downstream)
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text + "\n")


def single(args: argparse.Namespace, logdir: Path, lines: list[str]) -> None:
    """This tree (and ``--compare``'s checkout once), then this tree's outage."""
    runs = [noisy_neighbour("this tree", ROOT, args, logdir)]
    if args.compare is not None:
        main_commit = subprocess.run(
            ["git", "-C", str(args.compare), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        runs.append(noisy_neighbour(f"main {main_commit}", args.compare, args, logdir))
    lines += noisy_lines(args, runs)
    ours = runs[0]
    lines.append(f"  this tree: quiet max {1000 * ours.quiet_max:.0f} ms <= 1000 ms: "
                 f"{met(ours.quiet_max <= 1.0)}")  # fmt: skip
    if len(runs) > 1:
        base = runs[1]
        lines.append(
            f"  ratio main/this tree: quiet max {base.quiet_max / ours.quiet_max:.1f}x,"
            f" p50 {base.quiet_p50 / ours.quiet_p50:.1f}x, p99"
            f" {base.quiet_p99 / ours.quiet_p99:.1f}x lower here; burst drain time"
            f" {ours.burst_drained_s / base.burst_drained_s:.2f}x main's"
        )
    print("\n".join(lines), flush=True)
    if not args.skip_outage:
        lines += outage_lines("this tree", outage(ROOT, args, logdir))


if __name__ == "__main__":
    main()

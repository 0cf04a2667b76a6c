"""Where a one-id message's CPU goes (issue 33 item 2): py-spy (GIL samples, 200 Hz, 6 s) on
the worker of ``bench_workers``' bare no-op drain and of its one-id drain (ours), N messages
each, the same settings; writes each profile (collapsed stacks) under ``--out`` and prints
the share of samples of the parts named below, per drain.

Usage: BENCH_REDIS_PORT=6394 .venv/bin/python bench/profile_one_id.py [--events 3000]
       [--out /tmp/profile-one-id]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_workers as bw  # noqa: E402 (after the path it is found on)

SPY = Path(sys.executable).parent / "py-spy"
PARTS = {
    "Celery's consumer (receive, ack, events)": "Consumer.start",
    "the task's body": "apply_target",
    "ours: deliver_message": "deliver_message",
    "ours: the shared claim": "claim_alone",
    "ours: the shared finish": "finish_alone",
    "kombu's QoS.ack": "QoS.ack",
}


def spied(out: Path, wait: Any) -> Any:
    def wrapped(client: redis.Redis, total: int, worker: bw.Worker) -> Any:
        clock = wait(client, total, worker)
        target = out / f"{worker.log.stem}.txt"
        subprocess.Popen(  # noqa: S603 (our own py-spy on our own worker)
            [str(SPY), "record", "--pid", str(worker.proc.pid), "--duration", "6", "--rate",
             "200", "--gil", "--nonblocking", "--format", "raw", "-o", str(target)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return clock

    return wrapped


def shares(path: Path) -> tuple[int, dict[str, float]]:
    total, found = 0, collections.Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        for part, frame in PARTS.items():
            if f";{frame} (" in f";{stack}":
                found[part] += n
    return total, {p: found[p] / max(1, total) for p in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile-one-id"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bw.wait_first_taken = spied(args.out, bw.wait_first_taken)
    os.environ.update(bw.ENV)
    s = bw.settings()
    source = bw.setup(s)
    client = redis.Redis.from_url(bw.BROKER)
    logdir = Path(tempfile.mkdtemp(prefix="profile-one-id-"))
    with psycopg.connect(s.psycopg_dsn, autocommit=True) as conn:
        bare = bw.bare_round(bw.create_app(s), client, args.events, logdir)
        ours = bw.ours_round(s, client, conn, source, args.events, logdir, 1)
    time.sleep(7)  # the profiles finish
    print(f"bare {bare.rate:.0f} ev/s {bare.worker_ms:.2f} ms worker CPU/message")
    print(f"ours at 1 id {ours.rate:.0f} ev/s {ours.worker_ms:.2f} ms worker CPU/message")
    for path in sorted(args.out.glob("*.txt")):
        total, found = shares(path)
        print(f"{path.name}: {total} GIL samples")
        for part, share in found.items():
            if share:
                print(f"  {100 * share:5.1f}%  {part}")


if __name__ == "__main__":
    main()

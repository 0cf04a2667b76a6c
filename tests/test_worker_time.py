"""Time and fencing across hosts (issue 9): leases on the database's clock, a stale fast-claim
key, and kill -9 at the two moments that matter for an HTTP downstream.

Real ``celery -A tasks worker`` processes; a worker's clock is moved with libfaketime (the
``libfaketime`` package ships the preload library), never with sleeps.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import libfaketime
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.messages import Dispatch
from tasks.pipeline import deliver_one, run
from tasks.runtime import Runtime, build_runtime
from tasks.sweeper import sweep_once
from tests.factories import accept_event, make_source
from tests.handlers_for_tests import KILL_AFTER_COMMIT_DIR
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.workers import (
    CLAIMS_URL,
    Broker,
    Worker,
    attempts,
    delivery,
    effects,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

ROUTE_SECRET = "whsec_Q2xvY2tzRGlzYWdyZWVCdXRUaGVEYXRhYmFzZURlY2lkZXM="

# Long enough for a second worker to start while the first is still in its handler:
# handler 12 s < soft 18 s < hard 20 s < processing TTL (the lease) 80 s < visibility 120 s.
SLOW: dict[str, Any] = {"soft_time_limit": 18.0, "hard_time_limit": 20.0, "visibility_timeout": 120}


def faketime_env(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock moved by ``offset``."""
    _, env = libfaketime.get_reload_information()
    return {**env, "FAKETIME": offset}


def test_a_worker_whose_clock_runs_ahead_never_takes_a_live_lease(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Worker B's clock is 5 minutes ahead, more than the 80 s lease, and its claim tier is
    unreachable (it fails open to Postgres alone). It receives a duplicate message for the
    delivery worker A is still running. Judged on B's clock the lease would be over; judged
    on the database's it is live: B skips it, A's attempt is not marked crashed, the
    redelivery count does not move and the handler ran once."""
    settings = worker_settings(**SLOW)
    source = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "slow_effect", "options": {"marker_dir": str(tmp_path), "sleep": "12"}}
        ],
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    # One slot: busy with the handler, so the duplicate goes to the other worker.
    with running_worker("on-time", tmp_path, concurrency=1, **SLOW) as on_time:
        broker.publish(delivery_id)
        wait_for(lambda: list(tmp_path.glob(f"{delivery_id}.1.*")), timeout=30, what="the handler")
        with running_worker(
            "ahead",
            tmp_path,
            extra_env=faketime_env("+5m"),
            redis_url="redis://127.0.0.1:1/0",  # nothing listens: the claim tier is down
            **SLOW,
        ) as ahead:
            broker.publish(delivery_id)  # on-time is busy (prefetch 1): ahead takes it

            def skipped() -> bool:
                return any(
                    line.get("event") == "delivery.not_claimed"
                    and line.get("delivery_id") == delivery_id
                    for line in ahead.json_lines()
                )

            wait_for(skipped, timeout=30, what="the duplicate to be skipped")
            row = wait_status(engine, delivery_id, "succeeded", timeout=60)
            ahead_lines = ahead.json_lines()
        assert on_time.alive()
    broker.close()

    # The faked clock really was ahead, and the claim tier really was down.
    stamps = [datetime.fromisoformat(line["timestamp"]) for line in ahead_lines]
    assert stamps
    assert min(stamps) > datetime.now(UTC) + timedelta(minutes=3)
    assert any(line.get("event") == "claim.degraded" for line in ahead_lines)
    # Our duplicate, and usually one more: kombu's Redis transport judges the visibility
    # timeout of unacked messages on B's clock too, and restores on-time's running message.
    skips = [line for line in ahead_lines if line.get("event") == "delivery.not_claimed"]
    assert skips
    assert {line["outcome"] for line in skips} == {"skipped"}
    # Once: one handler start, one effect, one attempt, no redelivery.
    assert len(list(tmp_path.glob(f"{delivery_id}.*"))) == 1
    assert [e.attempt for e in effects(engine, delivery_id)] == [1]
    assert (row.attempts, row.redeliveries) == (1, 0)
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "succeeded")]


# -- a fast-claim key that outlived its row's truth ---------------------------------------


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = build_runtime(worker_settings(), worker="stale-key-test")
    yield rt
    rt.close()


def _no_publish(delivery_id: int, countdown: float) -> None:
    pass


def test_a_held_fast_claim_key_never_hides_an_overdue_row(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime
) -> None:
    """A confirmed key (as a success leaves it) for a delivery whose row is still pending:
    the success commit was lost (failover to an asynchronous replica, a restore). Once the
    row is past its publish grace the worker asks Postgres and delivers it; a row within its
    grace is left to the key, as a copy racing a live claim should be."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    client = redis.Redis.from_url(CLAIMS_URL)
    try:
        # Accepted a minute ago: its publish grace (1 s) is long over.
        overdue = accept_event(settings, source, now=datetime.now(UTC) - timedelta(minutes=1))[
            1
        ].delivery_ids[0]
        fresh = accept_event(settings, source)[1].delivery_ids[0]  # within its grace
        for delivery_id in (overdue, fresh):
            client.set(
                runtime.claims.key(delivery_id, 0), "confirmed-by-a-lost-success", px=86_400_000
            )

        assert deliver_one(runtime, fresh, publish_retry=_no_publish) == "duplicate"
        assert delivery(engine, fresh).status == "pending"
        assert deliver_one(runtime, overdue, publish_retry=_no_publish) == "succeeded"
        assert delivery(engine, overdue).status == "succeeded"
        assert len(effects(engine, overdue)) == 1
        # The key now stands for the real success (ours), for the dedup TTL.
        assert client.get(runtime.claims.key(overdue, 0)) != b"confirmed-by-a-lost-success"
        assert deliver_one(runtime, overdue, publish_retry=_no_publish) == "duplicate"
        assert len(effects(engine, overdue)) == 1
    finally:
        client.close()


def test_the_same_holds_on_a_pinned_clock(engine: Engine, sessions: sessionmaker[Session]) -> None:
    """The overdue test of the worker's first read uses the pinned instant when a test pins
    one: an hour later, the fresh row is overdue too."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    client = redis.Redis.from_url(CLAIMS_URL)
    later = build_runtime(
        settings, clock=FrozenClock(datetime.now(UTC) + timedelta(hours=1)), worker="later"
    )
    try:
        client.set(later.claims.key(delivery_id, 0), "held", px=86_400_000)
        assert deliver_one(later, delivery_id, publish_retry=_no_publish) == "succeeded"
    finally:
        later.close()
        client.close()


def test_a_held_key_yields_to_postgres_from_the_sweepers_second_republish(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The sweeper moves next_attempt_at a grace ahead as it re-publishes, so the copy it
    sends never finds its row overdue: after the first re-publish the key still decides (a
    copy racing a live claim looks the same), after the second Postgres does. One delivery
    alone and one in a list of ids (a batch of one: the same probe)."""
    # Publish grace 1 s. Without admission: the sweeper's picks are published as they come
    # (with it, a picked row stays in its route's in-flight set until the dispatcher's
    # reconcile frees it as lost, tests/test_route_limits.py; the claim's rule is the same).
    # A sweep picks the oldest due first, at most WEBHOOKS_SWEEP_BATCH: after the first
    # re-publish these rows are due only a grace ahead, behind every row that earlier tests
    # of this process left due, so the batch must reach past all of those.
    settings = worker_settings(admission=False, sweep_batch=1_000_000)
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    alone, in_batch = (accept_event(settings, source)[1].delivery_ids[0] for _ in range(2))
    with engine.begin() as conn:  # due for the first sweep whatever the accept set
        conn.execute(
            text("UPDATE deliveries SET next_attempt_at = now() - interval '10 years'"
                 " WHERE id = ANY(:ids)"),
            {"ids": [alone, in_batch]},
        )  # fmt: skip
    start = datetime.now(UTC)
    first, second = (
        build_runtime(settings, clock=FrozenClock(start + timedelta(seconds=s)), worker=f"at-{s}")
        for s in (2, 4)
    )
    published: list[int] = []

    def publish(group: Sequence[Dispatch]) -> None:
        published.extend(d.delivery_id for d in group)

    client = redis.Redis.from_url(CLAIMS_URL)
    try:
        for delivery_id in (alone, in_batch):
            client.set(first.claims.key(delivery_id, 0), "lost-success", px=86_400_000)
        sweep_once(first, publish)  # 2 s on: past the grace, re-published once
        assert deliver_one(first, alone, publish_retry=_no_publish) == "duplicate"
        assert [r.outcome for r in run(first, [in_batch], publish_retry=_no_publish)] == [
            "duplicate"
        ]
        sweep_once(second, publish)  # a grace later: re-published twice
        assert deliver_one(second, alone, publish_retry=_no_publish) == "succeeded"
        assert [r.outcome for r in run(second, [in_batch], publish_retry=_no_publish)] == [
            "succeeded"
        ]
    finally:
        client.close()
        first.close()
        second.close()
    assert published.count(alone) == published.count(in_batch) == 2
    for delivery_id in (alone, in_batch):
        assert delivery(engine, delivery_id).republished == 0  # the claim starts it again
        assert len(effects(engine, delivery_id)) == 1


# -- kill -9 where an HTTP downstream can see it twice ------------------------------------


class BlockingDownstream:
    """Records every request's idempotency key; holds the first one until released."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.first_arrived = threading.Event()
        self.release = threading.Event()
        downstream = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                downstream.keys.append(self.headers["idempotency-key"])
                if len(downstream.keys) == 1:
                    downstream.first_arrived.set()
                    downstream.release.wait(60)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def __enter__(self) -> BlockingDownstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.loopback.close()


def _forward_delivery(
    sessions: sessionmaker[Session], url: str, **overrides: Any
) -> tuple[int, Any]:
    remember(ROUTE_SECRET)
    settings = worker_settings(**overrides)
    source = make_source(
        sessions,
        settings,
        routes=[
            {
                "handler": "forward",
                "options": {"url": url, "secret": ROUTE_SECRET, "allow_private": "true"},
            }
        ],
    )
    return accept_event(settings, source)[1].delivery_ids[0], settings


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_kill_9_in_the_middle_of_a_forward_call(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, pool: str
) -> None:
    """The process running the call dies while the downstream holds its request (prefork:
    the pool child; threads: the worker itself, and another worker takes over): the next
    attempt calls it again with the same idempotency key, and the delivery succeeds once."""
    with BlockingDownstream() as downstream:
        delivery_id, settings = _forward_delivery(sessions, downstream.url)
        broker = Broker(settings)
        with running_worker("forwarder", tmp_path, pool=pool) as worker, running_beat(tmp_path):
            broker.publish(delivery_id)
            assert downstream.first_arrived.wait(30)
            if pool == "prefork":
                [child] = worker.pool_pids()
                os.kill(child, signal.SIGKILL)
                downstream.release.set()
                row = wait_status(engine, delivery_id, "succeeded", timeout=90)
            else:
                worker.kill_all()
                downstream.release.set()
                with running_worker("forwarder-2", tmp_path, pool=pool):
                    row = wait_status(engine, delivery_id, "succeeded", timeout=90)
        broker.close()
    assert len(downstream.keys) == 2
    assert len(set(downstream.keys)) == 1  # the same key on both calls
    assert (row.attempts, row.redeliveries) == (2, 1)
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [(1, "crashed"), (2, "succeeded")]


def _copy_skipped(worker: Worker, delivery_id: int) -> bool:
    return any(
        line.get("event") == "delivery.not_claimed" and line.get("delivery_id") == delivery_id
        for line in worker.json_lines()
    )


def test_kill_9_of_a_thread_worker_after_the_success_commit_before_the_broker_ack(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The default pool (threads): the worker process itself dies right after committing the
    success, before the ack. A copy of the message, as a redelivery brings it, reaches
    another worker and finds the work done: one downstream call, one attempt."""
    with BlockingDownstream() as downstream:
        downstream.release.set()  # answer at once
        delivery_id, settings = _forward_delivery(sessions, downstream.url)
        broker = Broker(settings)
        kill_dir = tmp_path / "kills"
        kill_dir.mkdir()
        with running_worker(
            "committer", tmp_path, pool="threads", extra_env={KILL_AFTER_COMMIT_DIR: str(kill_dir)}
        ) as worker:
            broker.publish(delivery_id)
            wait_for(
                lambda: list(kill_dir.glob(f"{delivery_id}.killed")), timeout=30, what="the kill"
            )
            row = wait_status(engine, delivery_id, "succeeded", timeout=30)
            wait_for(lambda: not worker.alive(), timeout=30, what="the worker to die")
        with running_worker("second", tmp_path, pool="threads") as second:
            broker.publish(delivery_id)
            wait_for(lambda: _copy_skipped(second, delivery_id), timeout=30, what="the copy")
        broker.close()
    assert len(downstream.keys) == 1
    assert (row.attempts, row.redeliveries) == (1, 0)
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "succeeded")]


def test_kill_9_after_the_success_commit_before_the_broker_ack(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Prefork: the pool process dies right after committing the success, before its message
    is acknowledged: the broker redelivers it, and the copy finds the work done. The
    downstream was called once; the delivery is succeeded once, with one attempt."""
    with BlockingDownstream() as downstream:
        downstream.release.set()  # answer at once
        delivery_id, settings = _forward_delivery(sessions, downstream.url)
        broker = Broker(settings)
        kill_dir = tmp_path / "kills"
        kill_dir.mkdir()
        with running_worker(
            "committer", tmp_path, pool="prefork", extra_env={KILL_AFTER_COMMIT_DIR: str(kill_dir)}
        ) as worker:
            broker.publish(delivery_id)
            killed = wait_for(
                lambda: list(kill_dir.glob(f"{delivery_id}.killed")), timeout=30, what="the kill"
            )
            row = wait_status(engine, delivery_id, "succeeded", timeout=30)
            wait_for(
                lambda: "exited with 'signal 9 (SIGKILL)'" in worker.output(),
                timeout=30,
                what="the pool to see its process killed",
            )
            # Whether the broker redelivers the unacknowledged message is Celery's call (a
            # job whose process it finds dead only at the hard limit is acked as failed):
            # send the copy a redelivery would bring, as at-least-once brokers may.
            broker.publish(delivery_id)

            def copy_skipped() -> bool:
                return any(
                    line.get("event") == "delivery.not_claimed"
                    and line.get("delivery_id") == delivery_id
                    for line in worker.json_lines()
                )

            wait_for(copy_skipped, timeout=30, what="the redelivered copy")
            assert int(killed[0].read_text()) not in worker.pool_pids()  # it really died
        broker.close()
    assert len(downstream.keys) == 1
    assert (row.attempts, row.redeliveries) == (1, 0)
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "succeeded")]

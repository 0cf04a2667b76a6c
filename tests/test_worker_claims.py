"""The two claim tiers under duplicates: two workers racing on 20 copies of one message, a
flushed Redis, and a stopped Redis (broker on RabbitMQ so that only the claim tier is down)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.messages import DELIVERIES_QUEUE, MAINTENANCE_QUEUE
from models.installation import installation_id
from tasks.claims import claim_key
from tasks.config import create_app
from tests.conftest import REDIS_PORT, free_port
from tests.factories import accept_event, make_source
from tests.workers import (
    AMQP_URL,
    CLAIMS_URL,
    Broker,
    Worker,
    attempts,
    broker_idle,
    effects,
    flush_redis,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

# The machine's Redis (6379) restarts as its service does; a suite's own Redis on another
# port restarts in /tmp.
_REDIS_DIR, _REDIS_LOG = (
    ("/var/lib/redis", "/var/log/redis/ci.log")
    if REDIS_PORT == 6379
    else ("/tmp", f"/tmp/redis-{REDIS_PORT}.log")  # noqa: S108
)
REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", str(REDIS_PORT),
    "--save", "", "--appendonly", "no", "--dir", _REDIS_DIR, "--logfile", _REDIS_LOG,
]  # fmt: skip


def _one_delivery(sessions: sessionmaker[Session], handler: str, **options: str) -> int:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": handler, "options": options}])
    _, outcome = accept_event(settings, source)
    return outcome.delivery_ids[0]


def test_two_workers_and_the_same_delivery_published_20_times_give_one_effect(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    # The first attempt sleeps, so copies arrive while it is still running.
    delivery_id = _one_delivery(sessions, "slow_effect", marker_dir=str(tmp_path), sleep="1")
    broker = Broker(worker_settings())
    with (
        running_worker("a", tmp_path, concurrency=2) as a,
        running_worker("b", tmp_path, concurrency=2) as b,
    ):
        for _ in range(20):
            broker.publish(delivery_id)
        wait_status(engine, delivery_id, "succeeded")
        wait_for(broker_idle, timeout=30, what="all 20 copies to be consumed")
        received = [w.output().count("Task webhooks.deliver[") for w in (a, b)]
    broker.close()

    assert len(effects(engine, delivery_id)) == 1
    assert [x.outcome for x in attempts(engine, delivery_id)] == ["succeeded"]
    # Both workers took copies: the race was real.
    assert all(n > 0 for n in received), received


def test_redis_flushed_between_two_deliveries_of_one_message_gives_no_second_effect(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    delivery_id = _one_delivery(sessions, "effect")
    claims = redis.Redis.from_url(CLAIMS_URL)
    key = claim_key(installation_id(engine), delivery_id, 0)
    with running_worker("flush", tmp_path) as worker:
        broker = Broker(worker_settings())
        broker.publish(delivery_id)
        wait_status(engine, delivery_id, "succeeded")
        # Success promoted the fast claim to the source's dedup TTL (days, not seconds).
        wait_for(lambda: claims.ttl(key) > 86400, timeout=10, what="confirm")
        broker.close()
        # Our pipeline's whole Redis state (claims and broker) is gone. FLUSHDB on our two
        # databases, not FLUSHALL: the server is shared with other test runs.
        flush_redis()
        assert claims.exists(key) == 0
        again = Broker(worker_settings())  # declares the queue bindings again
        again.publish(delivery_id)
        wait_for(
            lambda: "delivery.not_claimed" in worker.output() and broker_idle(),
            timeout=30,
            what="the second copy to be refused",
        )
        again.close()
    claims.close()

    assert len(effects(engine, delivery_id)) == 1
    assert [x.outcome for x in attempts(engine, delivery_id)] == ["succeeded"]
    refused = [
        line
        for line in worker.json_lines()
        if line.get("event") == "delivery.not_claimed" and line.get("delivery_id") == delivery_id
    ]
    # The fast tier admitted the copy (its key was gone); the durable claim refused it.
    assert [line["outcome"] for line in refused] == ["skipped"]


# The short sweep settings: a sweep every 2 s, each pick re-published 3 s later at most.
SWEEP: dict[str, Any] = {
    "sweep_interval": timedelta(seconds=2),
    "publish_grace": timedelta(seconds=3),
}


def test_a_stale_key_holds_a_pending_delivery_one_sweep_and_one_grace_at_most(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """A confirmed key (days long) for a delivery Postgres shows pending: a success whose
    commit a restore or failover lost. Each sweep moves the row's next_attempt_at a grace
    ahead as it re-publishes it, so the worker's probe never saw it overdue and the key held
    it for days. From the sweeper's second re-publish, Postgres' claim decides."""
    settings = worker_settings(**SWEEP)
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]  # published by the sweeper
    key = claim_key(installation_id(engine), delivery_id, 0)
    claims = redis.Redis.from_url(CLAIMS_URL)
    claims.set(key, "confirmed-by-a-lost-success", px=6 * 86_400_000)

    def refused(worker: Worker) -> list[str]:
        return [
            line["outcome"]
            for line in worker.json_lines()
            if line.get("event") == "delivery.not_claimed"
            and line.get("delivery_id") == delivery_id
        ]

    try:
        with running_worker("stale", tmp_path, **SWEEP) as worker, running_beat(tmp_path, **SWEEP):
            # The sweeper's first re-publish: the key still says duplicate.
            wait_for(lambda: refused(worker), timeout=60, what="the first re-publish")
            first_refusal = time.monotonic()
            wait_status(engine, delivery_id, "succeeded", timeout=2 + 3 + 4)
            took = time.monotonic() - first_refusal
            assert claims.get(key) != b"confirmed-by-a-lost-success"  # ours, for the dedup TTL
    finally:
        claims.close()

    assert took <= 2 + 3 + 4, took  # one sweep interval plus the grace, and 4 s of slack
    assert refused(worker) == ["duplicate"]
    assert len(effects(engine, delivery_id)) == 1
    stale = [ln for ln in worker.json_lines() if ln.get("event") == "claim.stale_key"]
    assert [ln["delivery_id"] for ln in stale] == [delivery_id]


@pytest.fixture
def rabbit_queues() -> Iterator[None]:
    def purge() -> None:
        with Connection(AMQP_URL) as conn:
            for queue in (DELIVERIES_QUEUE, MAINTENANCE_QUEUE):
                conn.SimpleQueue(queue).clear()

    purge()
    yield
    purge()


def _redis_up() -> bool:
    client = redis.Redis(host="127.0.0.1", port=REDIS_PORT, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.usefixtures("rabbit_queues")
def test_redis_stopped_events_still_processed_once_on_the_durable_tier(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings(broker_url=AMQP_URL)
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    ids = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(3)]
    port = free_port()
    overrides: dict[str, Any] = {
        "broker_url": AMQP_URL,
        "worker_metrics_port": port,
        "metrics_dir": str(tmp_path),
    }
    with running_worker("noredis", tmp_path, **overrides) as worker:
        broker = Broker(settings)
        try:
            subprocess.run(["redis-cli", "-p", str(REDIS_PORT), "shutdown", "nosave"], check=False)
            wait_for(lambda: not _redis_up(), timeout=10, what="Redis to stop")
            for delivery_id in ids:
                broker.publish(delivery_id)
            broker.publish(ids[0])  # and a duplicate, refused by Postgres alone
            for delivery_id in ids:
                wait_status(engine, delivery_id, "succeeded", timeout=60)
            wait_for(
                lambda: (
                    worker.output().count("Task webhooks.deliver[") >= 4
                    and "delivery.not_claimed" in worker.output()
                ),
                timeout=30,
                what="the duplicate to be refused",
            )
            metrics = _scrape(port)
        finally:
            if not _redis_up():
                subprocess.run(REDIS_START, check=True)
            wait_for(_redis_up, timeout=20, what="Redis to restart")
            broker.close()

    for delivery_id in ids:
        assert len(effects(engine, delivery_id)) == 1
    assert _sample(metrics, "webhooks_degraded_claims_total") >= 4
    assert 'webhooks_claims_total{result="degraded"}' in metrics
    assert any(line.get("event") == "claim.degraded" for line in worker.json_lines())


@pytest.mark.usefixtures("rabbit_queues")
def test_a_worker_whose_old_connection_still_holds_its_control_queue_starts_and_consumes(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """After a partition from RabbitMQ heals, the broker may still hold the worker's old
    connection, consuming its remote-control queue, while the worker reconnects. Here that
    old connection is real: it declared the queue as the worker does and consumes from it.
    The worker then starts, declares the same queue, and consumes deliveries, where an
    exclusive control queue made it exit on RESOURCE_LOCKED (issue 32's multi-host drill)."""
    settings = worker_settings(broker_url=AMQP_URL)
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    name = f"stale-{uuid.uuid4().hex[:8]}"
    app = create_app(settings)
    queue = app.control.mailbox.get_queue(f"{name}@{socket.gethostname()}")
    with (
        Connection(AMQP_URL) as old,
        old.Consumer(queue, callbacks=[lambda body, msg: None]),  # declared, consuming: held
        running_worker(name, tmp_path, broker_url=AMQP_URL) as worker,
    ):
        broker = Broker(settings)
        try:
            broker.publish(delivery_id)
            wait_status(engine, delivery_id, "succeeded", timeout=60)
        finally:
            broker.close()
        log = worker.output()
    app.close()
    assert "RESOURCE_LOCKED" not in log, log[-3000:]
    assert len(effects(engine, delivery_id)) == 1

"""Worker metrics move as events flow through a real prefork worker with several processes,
and the main process's /metrics endpoint adds up every process's share. The delivery counters
carry the source's public id (issue 35 item 6)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.messages import DELIVERIES_QUEUE, MAINTENANCE_QUEUE, Dispatch
from core.settings import Settings
from models import transitions
from tasks.pipeline import deliver_one
from tasks.runtime import build_runtime
from tests.conftest import BIN, free_port, wait_for_port
from tests.factories import accept_event, make_source
from tests.leakcheck import remember
from tests.operators_support import accept, flush, ops_env, ops_settings, source_with
from tests.workers import Broker, Worker, attempts, wait_for, wait_status, worker_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def ops() -> Iterator[Settings]:
    settings = ops_settings()
    flush(settings)
    yield settings
    flush(settings)


def scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def family(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every sample of ``name``, by its exact label set."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


def labelled(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


@pytest.mark.usefixtures("clean_worker_state")  # flaky_n's effects table
def test_worker_metrics_add_up_across_worker_processes(
    tmp_path: Path, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    port = free_port()
    root = tmp_path / "metrics"
    queues = f"{DELIVERIES_QUEUE},{MAINTENANCE_QUEUE}"
    cmd = [
        str(BIN / "celery"), "-A", "tasks", "worker", "-Q", queues,
        "-P", "prefork", "-c", "2", "--max-tasks-per-child", "1", "-n", "metrics@%h",
        "--without-mingle", "--without-gossip", "-l", "INFO",
    ]  # fmt: skip
    # Every task runs in a fresh pool process (--max-tasks-per-child 1), so each count below
    # is the sum over as many processes, most of them exited by the time we scrape.
    worker = Worker(
        "worker-metrics",
        cmd,
        # -P prefork must match the setting (tasks.pools.check_pool).
        ops_env(worker_metrics_port=port, metrics_dir=str(root), worker_pool="prefork"),
        tmp_path,
    )
    broker = Broker(ops)
    try:
        worker.wait_ready()
        wait_for_port(port, worker.proc)
        directory = root / f"worker-{worker.pid}"
        assert directory.is_dir()
        before = scrape(port)
        assert family(before, "webhooks_deliveries_total") == {}  # labelled: none until counted

        source = source_with(sessions, ops, "log")
        ids = [accept(ops, source)[0] for _ in range(6)]
        for delivery in ids:
            broker.publish(delivery)
        for delivery in ids:
            wait_status(engine, delivery, "succeeded", timeout=60)

        def counted(name: str, expected: float, **labels: str) -> Samples:
            def check() -> Samples | None:
                now = scrape(port)
                return now if value(now, name, **labels) == expected else None

            result: Samples = wait_for(check, timeout=20, what=f"{name} {labels} == {expected}")
            return result

        a = source.public_id
        after = counted("webhooks_deliveries_total", 6, outcome="succeeded", source=a)
        assert value(after, "webhooks_claims_total", result="first") == 6
        assert value(after, "webhooks_receipt_to_success_seconds_count") == 6
        workers = {a.worker for d in ids for a in attempts(engine, d)}
        assert len(workers) >= 2, workers  # several processes really did the work
        assert len(list(directory.glob("counter_*.db"))) >= 3  # main process + pool children

        # A second message for a delivery that succeeded: the fast claim says duplicate.
        broker.publish(ids[0])
        # Not claimed, its source not read (the message carries its id alone): source="".
        dup = counted("webhooks_claims_total", 1, result="duplicate")
        assert value(dup, "webhooks_deliveries_total", outcome="duplicate", source="") == 1
        assert value(dup, "webhooks_deliveries_total", outcome="succeeded", source=a) == 6

        # A handler that fails permanently: a dead letter, by reason and source.
        dead_source = source_with(sessions, ops, "permanent")
        [dead] = accept(ops, dead_source)
        broker.publish(dead)
        reason = wait_status(engine, dead, "dead", timeout=60).dead_reason
        b = dead_source.public_id
        counted("webhooks_dead_letters_total", 1, reason=reason, source=b)

        # A handler that fails once: a retry, then a success, of a third source.
        flaky = make_source(
            sessions, ops, routes=[{"handler": "flaky_n", "options": {"failures": "1"}}]
        )
        remember(flaky.secret)
        [retried] = accept(ops, flaky)
        broker.publish(retried)
        wait_status(engine, retried, "succeeded", timeout=60)
        c = flaky.public_id
        final = counted("webhooks_deliveries_total", 1, outcome="succeeded", source=c)
        # The exact label sets: each counter's every sample names its source.
        assert family(final, "webhooks_deliveries_total") == {
            labelled(outcome="succeeded", source=a): 6,
            labelled(outcome="duplicate", source=""): 1,
            labelled(outcome="dead", source=b): 1,
            labelled(outcome="retry", source=c): 1,
            labelled(outcome="succeeded", source=c): 1,
        }
        assert family(final, "webhooks_retries_total") == {labelled(source=c): 1}
        assert family(final, "webhooks_dead_letters_total") == {
            labelled(reason=reason, source=b): 1
        }
        assert value(final, "webhooks_claims_total", result="first") == 9
        assert value(final, "webhooks_degraded_claims_total") == 0
    finally:
        broker.close()
        worker.stop()
    assert not (root / f"worker-{worker.pid}").exists()  # removed at shutdown


def _no_publish(dispatch: Dispatch, countdown: float) -> None:
    pass


@pytest.mark.usefixtures("clean_worker_state")
def test_a_crash_looped_dead_letter_is_counted_under_its_source(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The claim that finds one crash too many makes the delivery dead (``crashed``) without
    running it: counted under its source like any dead letter. Two claims whose leases ran
    out stand for two workers that died holding it; the worker's own code (this process, the
    clock pinned past the second lease) claims it a third time."""
    settings = worker_settings(max_redeliveries=2)
    source = source_with(sessions, settings, "log")
    [delivery_id] = accept_event(settings, source)[1].delivery_ids
    with engine.connect() as conn:
        start: datetime = conn.execute(text("SELECT now()")).scalar_one()
    lease = timedelta(seconds=settings.processing_ttl)
    for crash in range(2):
        with sessions() as session, session.begin():
            transitions.claim(
                session, delivery_id, now=start + crash * (lease + timedelta(seconds=1)),
                lease=lease, max_redeliveries=2, worker=f"died-{crash}",
            )  # fmt: skip
    labels = {"reason": "crashed", "source": source.public_id}
    assert REGISTRY.get_sample_value("webhooks_dead_letters_total", labels) is None
    rt = build_runtime(
        settings, clock=FrozenClock(start + 2 * (lease + timedelta(seconds=1))), worker="third"
    )
    try:
        assert deliver_one(rt, delivery_id, publish_retry=_no_publish) == "dead"
    finally:
        rt.close()
    assert REGISTRY.get_sample_value("webhooks_dead_letters_total", labels) == 1
    dead = {"outcome": "dead", "source": source.public_id}
    assert REGISTRY.get_sample_value("webhooks_deliveries_total", dead) == 1


def test_worker_metrics_listen_on_the_admin_host_not_the_receivers(tmp_path: Path) -> None:
    """Issue 18, item 8: the worker's /metrics binds WEBHOOKS_ADMIN_HOST (here 127.0.0.2), not
    WEBHOOKS_HOST (127.0.0.3, the public receiver's address)."""
    port = free_port()
    cmd = [
        str(BIN / "celery"), "-A", "tasks", "worker", "-Q", DELIVERIES_QUEUE,
        "-P", "threads", "-c", "1", "-n", "metrics-host@%h",
        "--without-mingle", "--without-gossip", "-l", "INFO",
    ]  # fmt: skip
    env = ops_env(
        worker_metrics_port=port,
        metrics_dir=str(tmp_path / "metrics"),
        worker_pool="threads",
        host="127.0.0.3",
        admin_host="127.0.0.2",
    )
    worker = Worker("worker-metrics-host", cmd, env, tmp_path)
    try:
        worker.wait_ready()

        def listening() -> bool | None:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.2", port)) == 0 or None

        wait_for(listening, timeout=20, what="worker metrics on 127.0.0.2")
        scraped = httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=10)
        assert scraped.status_code == 200
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.3", port)) != 0
    finally:
        worker.stop()

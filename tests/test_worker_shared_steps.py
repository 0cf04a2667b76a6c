"""Messages of one bare id share their claim and their success with the other threads of
the worker reaching them at once (tasks/steps/together.py, issue 33 item 2), and keep every
guarantee of a message alone: each delivery's handler runs once, each message reports its
own delivery's outcome (what Flower shows), two processes claiming the same ids through the
durable claim alone (separate fast tiers) never both win, and countdown retries (bare-id
messages) are each delivered once more, no more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from tests.conftest import REDIS, free_port
from tests.factories import accept_event, make_source
from tests.workers import (
    Broker,
    broker_idle,
    flush_redis,
    running_worker,
    scrape_metrics,
    wait_for,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

# A second fast tier: the other worker of the two-process test never sees the first's keys.
OTHER_CLAIMS_URL = f"{REDIS}/12"


def _deliveries(sessions: sessionmaker[Session], n: int, handler: str, **options: str) -> list[int]:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": handler, "options": options}])
    return [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]


def _calls(marker_dir: Path, delivery_id: int) -> list[Path]:
    """The touch handler's calls of this delivery (one marker file per attempt and pid)."""
    return sorted(marker_dir.glob(f"{delivery_id}.*"))


def _rows(engine: Engine, ids: list[int]) -> dict[int, tuple[str, int, int]]:
    """Each delivery's status, attempts and attempt rows."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT d.id, d.status, d.attempts, "
                "(SELECT count(*) FROM attempts a WHERE a.delivery_id = d.id) "
                "FROM deliveries d WHERE d.id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    return {int(r[0]): (str(r[1]), int(r[2]), int(r[3])) for r in rows}


def _all_succeeded(engine: Engine, ids: list[int]) -> bool | None:
    rows = _rows(engine, ids)
    return all(status == "succeeded" for status, _, _ in rows.values()) or None


def _shared(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], step: str
) -> tuple[float, float]:
    def value(counted: str) -> float:
        key = ("webhooks_shared_steps_total", (("counted", counted), ("step", step)))
        return samples.get(key, 0.0)

    return value("requests"), value("calls")


def test_bare_id_messages_share_claims_and_each_runs_its_handler_once(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """120 bare-id messages (60 deliveries, 2 copies each) queued before a 16-thread worker
    starts: the claims are shared (fewer runs than messages), every delivery's handler is
    called once, and each message's Celery result is its own: 60 say succeeded, 60 do not."""
    markers = tmp_path / "markers"
    markers.mkdir()
    ids = _deliveries(sessions, 60, "touch", marker_dir=str(markers))
    broker = Broker(worker_settings())
    for _ in range(2):
        for delivery_id in ids:
            broker.publish(delivery_id)
    broker.close()
    port = free_port()
    with running_worker(
        "shared",
        tmp_path,
        pool="threads",
        concurrency=16,
        worker_metrics_port=port,
        metrics_dir=str(tmp_path / "metrics"),
    ) as worker:
        wait_for(lambda: _all_succeeded(engine, ids), timeout=90, what="60 deliveries to succeed")
        wait_for(broker_idle, timeout=60, what="all 120 messages to be consumed")
        samples = scrape_metrics(port)
        output = worker.output()
    assert all(len(_calls(markers, i)) == 1 for i in ids), "a handler ran twice or never"
    assert set(_rows(engine, ids).values()) == {("succeeded", 1, 1)}
    claim_requests, claim_calls = _shared(samples, "claim")
    assert claim_requests == 120  # every message's claim went through the shared step
    assert 0 < claim_calls < claim_requests  # and some shared one statement
    succeed_requests, succeed_calls = _shared(samples, "succeed")
    assert succeed_requests == 60
    assert 0 < succeed_calls <= 60
    # What Flower shows per message: 60 successes, and the 60 copies that found theirs done.
    results = re.findall(
        r"Task webhooks\.deliver\[[^\]]+\] succeeded in [0-9.]+s: '([^']*)'", output
    )
    assert len(results) == 120
    assert results.count("succeeded") == 60
    assert all(r.startswith(("duplicate", "skipped")) for r in results if r != "succeeded")


def test_two_processes_with_separate_fast_tiers_claim_each_bare_id_once(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Two workers, each with its own fast-claim Redis, so only the guarded claim statement
    (shared by each worker's threads) stands between them: 40 deliveries published 3 times
    each as bare ids, their first calls slow enough to overlap. Each handler runs once."""
    markers = tmp_path / "markers"
    markers.mkdir()
    ids = _deliveries(sessions, 40, "touch", marker_dir=str(markers), sleep="0.3")
    flush_redis(OTHER_CLAIMS_URL)
    try:
        with (
            running_worker("pair-a", tmp_path, pool="threads", concurrency=12) as a,
            running_worker(
                "pair-b", tmp_path, pool="threads", concurrency=12, redis_url=OTHER_CLAIMS_URL
            ) as b,
        ):
            broker = Broker(worker_settings())  # both ready: both take their share
            for _ in range(3):
                for delivery_id in ids:
                    broker.publish(delivery_id)
            broker.close()
            wait_for(
                lambda: _all_succeeded(engine, ids), timeout=90, what="40 deliveries to succeed"
            )
            wait_for(broker_idle, timeout=60, what="all 120 messages to be consumed")
            taken = [w.output().count("Task webhooks.deliver[") for w in (a, b)]
    finally:
        flush_redis(OTHER_CLAIMS_URL)
    assert all(taken), f"both workers took messages: {taken}"
    assert all(len(_calls(markers, i)) == 1 for i in ids), "a delivery ran in both or twice"
    assert set(_rows(engine, ids).values()) == {("succeeded", 1, 1)}


def test_countdown_retries_as_bare_ids_are_each_delivered_once_more(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Admission off: each failed first attempt publishes its retry as a countdown message of
    one bare id, the source of such messages. 30 deliveries whose first attempt fails: each
    is retried once, its effect written once, and each message's RETRY names its own
    delivery (Flower's text)."""
    ids = _deliveries(sessions, 30, "flaky_n", failures="1")
    broker = Broker(worker_settings())
    for delivery_id in ids:
        broker.publish(delivery_id)
    broker.close()
    with running_worker(
        "retries", tmp_path, pool="threads", concurrency=16, admission=False
    ) as worker:
        wait_for(lambda: _all_succeeded(engine, ids), timeout=90, what="30 retries to succeed")
        wait_for(broker_idle, timeout=60, what="every retry message to be consumed")
        output = worker.output()
    assert set(_rows(engine, ids).values()) == {("succeeded", 2, 2)}
    with engine.connect() as conn:
        effects = conn.execute(
            text("SELECT delivery_id, count(*) FROM test_effects WHERE delivery_id = ANY(:ids) "
                 "GROUP BY delivery_id"),
            {"ids": ids},
        ).all()  # fmt: skip
    assert {int(d): int(n) for d, n in effects} == dict.fromkeys(ids, 1)
    for delivery_id in ids:
        retries = re.findall(rf"\] retry: [^\n]*delivery {delivery_id} attempt 1 failed", output)
        assert len(retries) == 1, f"delivery {delivery_id}: {len(retries)} RETRY lines of its own"

"""kill -9 in the middle of a handler, of the pool child and of the whole worker, and a
delivery that keeps killing its worker. Real ``celery -A tasks worker`` processes, real
Postgres and Redis; the sweeper runs under a real ``celery -A tasks beat``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import accept_event, make_source
from tests.handlers_for_tests import EFFECTS_DDL
from tests.workers import (
    Broker,
    attempts,
    effects,
    flush_redis,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _clean(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    flush_redis()


def _slow_delivery(sessions: sessionmaker[Session], tmp_path: Path, sleep: float) -> int:
    settings = worker_settings()
    source = make_source(
        sessions,
        settings,
        routes=[
            {
                "handler": "slow_effect",
                "options": {"marker_dir": str(tmp_path), "sleep": str(sleep)},
            }
        ],
    )
    _, outcome = accept_event(settings, source)
    return outcome.delivery_ids[0]


def _handler_started(tmp_path: Path, delivery_id: int) -> int:
    """Wait for the first attempt's marker; returns the pid of the process running it."""
    markers = wait_for(
        lambda: sorted(tmp_path.glob(f"{delivery_id}.1.*")), timeout=30, what="the handler to start"
    )
    return int(markers[0].name.rsplit(".", 1)[1])


def test_kill_9_of_the_pool_child_mid_handler_has_the_effect_exactly_once(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    delivery_id = _slow_delivery(sessions, tmp_path, sleep=2.0)
    broker = Broker(worker_settings())
    with running_worker("child", tmp_path) as worker, running_beat(tmp_path):
        broker.publish(delivery_id)
        child = _handler_started(tmp_path, delivery_id)
        assert child in worker.pool_pids()
        os.kill(child, signal.SIGKILL)  # its effect row is written but not committed
        row = wait_status(engine, delivery_id, "succeeded", timeout=90)
        assert worker.alive()
        assert child not in worker.pool_pids()
    broker.close()

    done = effects(engine, delivery_id)
    assert len(done) == 1
    assert (done[0].attempt, done[0].pid != child) == (2, True)
    assert (row.attempts, row.redeliveries) == (2, 1)
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [(1, "crashed"), (2, "succeeded")]
    assert tries[0].error_class == "WorkerLost"
    assert all(a.ended_at is not None for a in tries)


def test_kill_9_of_the_whole_worker_mid_handler_a_second_worker_finishes_it(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    delivery_id = _slow_delivery(sessions, tmp_path, sleep=2.0)
    broker = Broker(worker_settings())
    with running_worker("doomed", tmp_path) as doomed:
        broker.publish(delivery_id)
        _handler_started(tmp_path, delivery_id)
        doomed.kill_all()
        assert not doomed.alive()
        assert wait_status(engine, delivery_id, "processing").attempts == 1
    with running_worker("rescuer", tmp_path) as rescuer, running_beat(tmp_path):
        row = wait_status(engine, delivery_id, "succeeded", timeout=90)
        rescuer_pids = set(rescuer.pool_pids())
    broker.close()

    done = effects(engine, delivery_id)
    assert len(done) == 1
    assert done[0].pid in rescuer_pids
    assert row.attempts == 2
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [(1, "crashed"), (2, "succeeded")]
    assert tries[0].worker != tries[1].worker


def test_a_delivery_that_keeps_killing_its_worker_goes_dead_as_crashed(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    # The handler ignores the soft limit; the hard limit (3 s) kills its process each time.
    settings = worker_settings(max_redeliveries=1)
    source = make_source(sessions, settings, routes=[{"handler": "hang"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(worker_settings(max_redeliveries=1))
    with (
        running_worker("loop", tmp_path, max_redeliveries=1) as worker,
        running_beat(tmp_path, max_redeliveries=1),
    ):
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "dead", timeout=90)
        assert worker.alive()
    broker.close()

    assert (row.dead_reason, row.redeliveries) == ("crashed", 1)
    assert effects(engine, delivery_id) == []
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "crashed")]

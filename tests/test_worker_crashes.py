"""kill -9 in the middle of a handler, of the pool child and of the whole worker, and a
delivery that keeps killing its worker. Real ``celery -A tasks worker`` processes, real
Postgres and Redis; the sweeper runs under a real ``celery -A tasks beat``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import accept_event, make_source
from tests.workers import (
    Broker,
    attempts,
    effects,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]


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
    # A pool child exists under prefork only (threads and gevent run in the worker itself).
    with running_worker("child", tmp_path, pool="prefork") as worker, running_beat(tmp_path):
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
        rescuer_pids = {rescuer.pid, *rescuer.pool_pids()}
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
    # The handler ignores the soft limit; under prefork the hard limit (3 s) kills its
    # process each time (threads and gevent: the next tests).
    settings = worker_settings(max_redeliveries=1)
    source = make_source(sessions, settings, routes=[{"handler": "hang"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(worker_settings(max_redeliveries=1))
    with (
        running_worker("loop", tmp_path, pool="prefork", max_redeliveries=1) as worker,
        running_beat(tmp_path, max_redeliveries=1),
    ):
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "dead", timeout=90)
        assert worker.alive()
        [dead] = wait_for(
            lambda: [
                line
                for line in worker.json_lines()
                if line.get("event") == "delivery.dead" and line.get("delivery_id") == delivery_id
            ],
            timeout=30,
            what="the crash loop's delivery.dead line",
        )
    broker.close()

    # The line says where the delivery belongs and how old its event is, as every other
    # transition's line does (seed 004: attempt, age, scope).
    assert (dead["reason"], dead["redeliveries"]) == ("crashed", 1)
    assert (dead["source"], dead["route_id"]) == (source.public_id, source.route_ids[0])
    assert dead["event_age_s"] >= 0
    assert (row.dead_reason, row.redeliveries) == ("crashed", 1)
    assert effects(engine, delivery_id) == []
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "crashed")]


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_handler_that_never_returns_is_stopped_at_the_hard_limit_and_retried(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, pool: str
) -> None:
    # ``hang`` swallows the soft limit (2.5 s) and sleeps on. Neither Celery pool stops it by
    # itself the way prefork does (tasks.pools): each attempt must end at the hard limit
    # (3 s) as a failed attempt, retried at once, with the worker alive, until the attempts
    # (4) are spent.
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "hang"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with running_worker("stuck", tmp_path, pool=pool) as worker:
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "dead", timeout=60)
        assert worker.alive()
        assert any(line.get("event") == "delivery.hard_time_limit" for line in worker.json_lines())
    broker.close()

    assert (row.dead_reason, row.attempts, row.redeliveries) == ("max_attempts", 4, 0)
    tries = attempts(engine, delivery_id)
    assert [a.outcome for a in tries] == ["retry", "retry", "retry", "dead"]
    for attempt in tries:
        assert attempt.error_message.startswith("hard_time_limit: hard time limit (3.0s)")
        # Stopped at the hard limit, counted from the handler's start (after the claim,
        # which started_at stamps), not at the soft one (2.5 s) and well before the threads
        # watchdog's kill (1.5 x hard = 4.5 s). Under gevent it was counted from the task's
        # start, before the claim: a slow claim on a loaded host cut it to 1.3 s.
        assert 2.6 <= (attempt.ended_at - attempt.started_at).total_seconds() <= 4.5
    assert effects(engine, delivery_id) == []  # its writes were rolled back each time


def test_a_thread_stuck_in_a_c_call_past_the_hard_limit_kills_its_worker(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    # time.sleep(600) in a thread: no exception reaches it until the call returns. At 1.5 x
    # the hard limit the watchdog kills the worker, which is prefork's crash path: the lease
    # runs out, the sweeper republishes, another worker runs attempt 2.
    delivery_id = _slow_delivery(sessions, tmp_path, sleep=600)
    broker = Broker(worker_settings())
    with running_worker("frozen", tmp_path, pool="threads") as frozen:
        broker.publish(delivery_id)
        _handler_started(tmp_path, delivery_id)
        wait_for(lambda: not frozen.alive(), timeout=60, what="the watchdog to kill the worker")
        assert frozen.proc.returncode == -signal.SIGKILL
        assert any(line.get("event") == "worker.handler_stuck" for line in frozen.json_lines())
    with running_worker("rescuer", tmp_path, pool="threads"), running_beat(tmp_path):
        row = wait_status(engine, delivery_id, "succeeded", timeout=90)
    broker.close()

    assert [e.attempt for e in effects(engine, delivery_id)] == [2]
    assert (row.attempts, row.redeliveries) == (2, 1)
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [(1, "crashed"), (2, "succeeded")]


def test_a_gevent_handler_spinning_on_the_cpu_kills_its_worker_at_the_hard_limit(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    # A CPU loop never yields: no gevent.Timeout can fire and every greenlet is frozen. The
    # watchdog thread sees the event loop stalled for the hard limit (3 s) and kills the
    # worker: prefork's crash path (lease, sweeper, another worker runs attempt 2).
    settings = worker_settings()
    source = make_source(
        sessions, settings, routes=[{"handler": "spin", "options": {"marker_dir": str(tmp_path)}}]
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with running_worker("spinner", tmp_path, pool="gevent") as spinner:
        broker.publish(delivery_id)
        wait_for((tmp_path / f"{delivery_id}.spin").exists, timeout=90, what="the spin")
        # The watchdog kills at 3 s of a blocked loop; the wait only bounds a failure.
        wait_for(lambda: not spinner.alive(), timeout=60, what="the watchdog to kill the worker")
        assert spinner.proc.returncode == -signal.SIGKILL
        assert any(
            line.get("event") == "worker.event_loop_blocked" for line in spinner.json_lines()
        )
    with running_worker("rescuer", tmp_path, pool="gevent"), running_beat(tmp_path):
        row = wait_status(engine, delivery_id, "succeeded", timeout=90)
    broker.close()

    assert [e.attempt for e in effects(engine, delivery_id)] == [2]
    assert (row.attempts, row.redeliveries) == (2, 1)

"""Retries with jittered backoff, dead letters, and the sweeper, through real workers."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from models import requeue
from tasks.policy import RetryPolicy, backoff_bound
from tests.factories import accept_event, make_source
from tests.leakcheck import remember
from tests.workers import (
    Broker,
    attempts,
    delivery,
    effects,
    retry_logs,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]


def test_a_handler_failing_three_times_succeeds_on_the_fourth_attempt_with_jittered_delays(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    overrides: dict[str, Any] = {
        "retry_seed": 1234,
        "retry_base": timedelta(seconds=0.5),
        "retry_cap": timedelta(seconds=4),
        "max_attempts": 5,
    }
    settings = worker_settings(**overrides)
    source = make_source(
        sessions, settings, routes=[{"handler": "flaky_n", "options": {"failures": "3"}}]
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    # One pool process: its seeded random source draws only for this delivery.
    with running_worker("jitter", tmp_path, **overrides) as worker:
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "succeeded")
    broker.close()

    assert row.attempts == 4
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [
        (1, "retry"), (2, "retry"), (3, "retry"), (4, "succeeded"),
    ]  # fmt: skip
    assert all(a.error_class == "RetryableError" for a in tries[:3])
    assert len(effects(engine, delivery_id)) == 1

    retries = retry_logs(worker, delivery_id)
    delays = [line["delay_s"] for line in retries]
    # Each transition's line carries its scope and its event's age (seed 004), the same
    # source and route every time, the age growing with the attempts.
    [success] = [
        line
        for line in worker.json_lines()
        if line.get("event") == "delivery.succeeded" and line.get("delivery_id") == delivery_id
    ]
    lines = [*retries, success]
    assert [line["attempt"] for line in lines] == [1, 2, 3, 4]
    assert {(line["source"], line["route_id"]) for line in lines} == {
        (source.public_id, source.route_ids[0])
    }
    ages = [line["event_age_s"] for line in lines]
    assert 0 <= ages[0] < ages[1] < ages[2] < ages[3]
    policy = RetryPolicy.for_route(settings)
    bounds = [backoff_bound(policy, n).total_seconds() for n in (1, 2, 3)]
    assert bounds == [0.5, 1.0, 2.0]
    assert all(0 <= d <= b for d, b in zip(delays, bounds, strict=True))
    seeded = random.Random(1234)
    assert delays == pytest.approx([seeded.uniform(0, b) for b in bounds], abs=1e-6)
    # Each retry was claimed no earlier than its delay allowed.
    for before, after, delay in zip(tries, tries[1:], delays, strict=False):
        assert after.started_at >= before.ended_at + timedelta(seconds=delay)


def test_a_handler_that_always_fails_goes_dead_after_max_attempts_while_others_flow(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    overrides: dict[str, Any] = {
        "max_attempts": 3,
        "retry_seed": 2,
        "retry_base": timedelta(seconds=1),
    }
    settings = worker_settings(**overrides)
    failing_source = make_source(sessions, settings, routes=[{"handler": "always_fail"}])
    good_source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    body = b'{"card": "4000-0000-0000-0002", "id": "evt_always"}'
    remember(body)
    failing = accept_event(settings, failing_source, body=body)[1].delivery_ids[0]
    goods = [accept_event(settings, good_source)[1].delivery_ids[0] for _ in range(5)]
    broker = Broker(settings)
    with running_worker("failing", tmp_path, **overrides):
        broker.publish(failing)
        for delivery_id in goods:
            broker.publish(delivery_id)
        row = wait_status(engine, failing, "dead")
        good_rows = [wait_status(engine, d, "succeeded") for d in goods]
    broker.close()

    assert (row.dead_reason, row.attempts, row.last_error_class) == (
        "max_attempts",
        3,
        "RuntimeError",
    )
    # The handler's message quoted the body: neither it nor the body is stored.
    assert "4000-0000" not in (row.last_error or "")
    assert (row.last_error or "").startswith("RuntimeError raised at ")
    tries = attempts(engine, failing)
    assert [a.outcome for a in tries] == ["retry", "retry", "dead"]
    # Every other event succeeded while the failing one was still being retried.
    assert all(g.succeeded_at < tries[-1].started_at for g in good_rows)
    assert all(len(effects(engine, d)) == 1 for d in goods)


def test_a_permanent_error_goes_dead_after_one_attempt(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "permanent"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with running_worker("permanent", tmp_path):
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "dead")
    broker.close()

    assert (row.dead_reason, row.attempts) == ("permanent", 1)
    assert row.last_error_class == "PermanentError"
    assert row.last_error == "test_permanent: this event can never be handled"
    assert [a.outcome for a in attempts(engine, delivery_id)] == ["dead"]


def test_the_flaky_demo_handler_goes_dead_then_succeeds_once_replayed(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "flaky"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with running_worker("flaky", tmp_path):
        broker.publish(delivery_id)
        assert wait_status(engine, delivery_id, "dead").dead_reason == "permanent"
        with sessions() as session, session.begin():
            assert requeue.replay(
                session, delivery_id, now=datetime.now(UTC), publish_grace=timedelta(seconds=30)
            )
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "succeeded")
    broker.close()
    # The policy's count starts again at the replay; the attempt number (the fence) goes on.
    assert (row.attempts, row.attempt_base) == (2, 1)
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [
        (1, "dead"),
        (2, "succeeded"),
    ]


def test_a_publish_lost_after_the_commit_is_delivered_by_the_sweeper(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    # Committed like the receiver does, but its message never published.
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    assert delivery(engine, delivery_id).status == "pending"
    with running_worker("swept", tmp_path) as worker, running_beat(tmp_path) as beat:
        row = wait_status(engine, delivery_id, "succeeded")
        assert "webhooks.sweep" in beat.output()
        # The other maintenance task runs on the same queue (beat sends it every 10 min).
        broker = Broker(settings)
        broker.maintenance()
        wait_for(lambda: "maintenance.done" in worker.output(), timeout=30, what="maintenance")
        broker.close()
    assert row.attempts == 1
    assert len(effects(engine, delivery_id)) == 1


def test_a_delay_too_long_for_a_countdown_is_left_to_the_sweeper(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    # I/O 0.5 < soft 0.8 < hard 1 < processing TTL 4 < visibility 6: countdowns up to 5 s.
    overrides: dict[str, Any] = {
        "handler_io_timeout": 0.5,
        "soft_time_limit": 0.8,
        "hard_time_limit": 1.0,
        "visibility_timeout": 6.0,
        "retry_cap": timedelta(seconds=10),
        # Without admission (WEBHOOKS_ADMISSION=false, or Redis failing open) a retry is a
        # countdown message or, past the broker's limit, the sweeper's; with it, a retry
        # waits in admission (tests/test_route_limits.py).
        "admission": False,
    }
    settings = worker_settings(**overrides)
    assert settings.max_countdown == 5.0
    source = make_source(
        sessions, settings, routes=[{"handler": "retry_after", "options": {"delay": "5.5"}}]
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with (
        running_worker("long", tmp_path, **overrides) as worker,
        running_beat(tmp_path, **overrides),
    ):
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "succeeded")
    broker.close()

    [retry] = retry_logs(worker, delivery_id)
    assert (retry["via"], retry["delay_s"]) == ("sweeper", 5.5)
    tries = attempts(engine, delivery_id)
    assert [a.outcome for a in tries] == ["retry", "succeeded"]
    assert tries[1].started_at >= tries[0].ended_at + timedelta(seconds=5.5)
    assert row.attempts == 2

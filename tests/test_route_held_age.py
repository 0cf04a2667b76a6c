"""A pause by hand does not age work into the dead letters (issue 23 item 4): a delivery's
max_age counts from its route's last resume, never across the pause. An open breaker is no
such hold (issue 34 item 3: nothing lives for ever): its close is no release, and its open
time counts (tests/test_route_ends.py for deliveries it holds and probes past max_age). Real
Postgres and Redis, the worker's own delivery code, time pinned with the injected clock
(which stands for the database's clock in every guarded statement)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.messages import Dispatch
from models import breaker, catalog
from tasks.pipeline import deliver_one
from tasks.runtime import build_runtime
from tests.factories import accept_event, make_source
from tests.workers import delivery, worker_settings


def _no_publish(dispatch: Dispatch, countdown: float) -> None:
    pass


def test_max_age_counts_from_the_routes_release_not_across_a_pause(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    settings = worker_settings(max_attempts=10)
    source = make_source(
        sessions, settings, routes=[{"handler": "always_fail", "max_age": timedelta(hours=1)}]
    )
    (route_id,) = source.route_ids
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    start = datetime.now(UTC)

    def attempt(at: timedelta) -> str:
        rt = build_runtime(settings, clock=FrozenClock(start + at), worker=f"age-{at}")
        try:
            return deliver_one(rt, delivery_id, publish_retry=_no_publish)
        finally:
            rt.close()

    assert attempt(timedelta(seconds=1)) == "retry"  # the first attempt: age 0
    # Paused a minute later for three hours (an outage held by hand).
    with sessions() as s, s.begin():
        breaker.set_paused(
            s, route_id, True, catalog.Change("ops", "outage"), now=start + timedelta(minutes=1)
        )
    with sessions() as s, s.begin():
        breaker.set_paused(
            s, route_id, False, catalog.Change("ops", "back"), now=start + timedelta(hours=3)
        )
    # 3 h 10 min after the first attempt, 10 min after the release: a retry, not dead by age.
    assert attempt(timedelta(hours=3, minutes=10)) == "retry"
    assert delivery(engine, delivery_id).status == "retrying"
    # The age still counts after the release: 1 h 20 min later it is dead by max_age.
    assert attempt(timedelta(hours=4, minutes=20)) == "dead"
    row = delivery(engine, delivery_id)
    assert (row.status, row.dead_reason) == ("dead", "max_age")


def test_a_breakers_close_is_no_release_max_age_counts_across_the_open_breaker(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Issue 34 replaced issue 23's rule for the breaker: its close (a half-open success) no
    longer restarts the age, so a delivery whose route was open five hours, past its one-hour
    max_age, goes dead at its next failure (before, it had a full max_age again after the
    close: an open breaker kept it alive past its max_age)."""
    settings = worker_settings(max_attempts=10)
    source = make_source(
        sessions, settings, routes=[{"handler": "always_fail", "max_age": timedelta(hours=1)}]
    )
    (route_id,) = source.route_ids
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    start = datetime.now(UTC)

    def attempt(at: timedelta) -> str:
        rt = build_runtime(settings, clock=FrozenClock(start + at), worker=f"age-{at}")
        try:
            return deliver_one(rt, delivery_id, publish_retry=_no_publish)
        finally:
            rt.close()

    assert attempt(timedelta(seconds=1)) == "retry"
    # The breaker was open and closed again by a probe's success 5 hours later.
    closed_at = start + timedelta(hours=5)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE routes SET breaker_state = 'half_open' WHERE id = %(id)s", {"id": route_id}
        )
        change = breaker.record_success(
            conn,
            route_id,
            breaker.Thresholds.of(settings),
            state=breaker.HALF_OPEN,
            window_failures=0,
            now=closed_at,
        )
    assert change is not None
    assert change.after == "closed"
    with psycopg.connect(settings.psycopg_dsn) as conn:
        released = conn.execute(
            "SELECT released_at FROM routes WHERE id = %(id)s", {"id": route_id}
        ).fetchone()
    assert released == (None,)
    assert attempt(timedelta(hours=5, minutes=10)) == "dead"
    row = delivery(engine, delivery_id)
    assert (row.status, row.dead_reason) == ("dead", "max_age")

"""The route circuit breaker and pausing by hand (issue 23, items 3 and 4): real Postgres, real
workers, a real local downstream for ``forward``."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import admission, breaker, catalog, requeue, transitions
from models.breaker import Thresholds
from tests.factories import accept_event, make_source
from tests.loopback import Loopback, Quiet
from tests.operators_support import cli, ops_env
from tests.workers import (
    CLAIMS_URL,
    Broker,
    Worker,
    attempts,
    delivery,
    running_worker,
    wait_for,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

LIMITS = Thresholds(timedelta(minutes=1), 3, 0.7, timedelta(seconds=30), 5, timedelta(minutes=1))
# A quiet route's thresholds: the ratio needs 10 requests, which one delivery never makes in
# a window; a streak of 5 failures over at least a minute opens it.
QUIET = Thresholds(timedelta(minutes=1), 10, 0.7, timedelta(seconds=30), 5, timedelta(minutes=1))
# Short breaker timings for the workers: three failures in a minute open it, one probe a second.
BREAKER: dict[str, Any] = {
    "breaker_min_requests": 3,
    "breaker_failure_ratio": 0.7,
    "breaker_window": timedelta(minutes=1),
    "breaker_probe_interval": timedelta(seconds=1),
    "max_attempts": 2,
}


class Downstream:
    """A local HTTP downstream answering ``status``, recording when each call came."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.calls: list[float] = []
        server = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                server.calls.append(time.monotonic())
                self.send_response(server.status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def close(self) -> None:
        self.loopback.close()


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    server = Downstream(503)
    yield server
    server.close()


def _route(engine: Engine, route_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM routes WHERE id = :id"), {"id": route_id}).one()


def _forwarding(sessions: sessionmaker[Session], settings: Settings, downstream: Downstream) -> Any:
    """A source with one route that forwards to the local downstream."""
    route = {"handler": "forward", "options": {"url": downstream.url, "allow_private": "true"}}
    return make_source(sessions, settings, routes=[route])


def _statuses(engine: Engine, ids: list[int]) -> dict[int, str]:
    return {i: delivery(engine, i).status for i in ids}


def _attempt_rows(engine: Engine, ids: list[int]) -> int:
    return sum(len(attempts(engine, i)) for i in ids)


def _claimed_after_opening(engine: Engine, route_id: int, ids: list[int]) -> list[Any]:
    """Start times of the attempts claimed after the route's breaker first opened."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT a.started_at FROM attempts a, routes g"
                    " WHERE a.delivery_id = ANY(:ids) AND g.id = :route"
                    " AND a.started_at > g.breaker_opened_at ORDER BY a.started_at"
                ),
                {"ids": ids, "route": route_id},
            ).scalars()
        )


def _accept(settings: Settings, source: Any, n: int) -> list[int]:
    return [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]


# -- the statements, with the time pinned ---------------------------------------------------


def _fail(
    settings: Settings, route_id: int, now: Any, limits: Thresholds = LIMITS
) -> breaker.BreakerChange | None:
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        return breaker.record_failure(conn, route_id, limits, now=now)


def _moved(settings: Settings, route_id: int, now: Any) -> tuple[str, str]:
    """One downstream failure on a quiet route's thresholds: (state before, state after)."""
    change = _fail(settings, route_id, now, QUIET)
    assert change is not None, "the route is gone"
    return change.before, change.after


def _succeed(settings: Settings, route_id: int, now: Any, window_failures: int) -> None:
    """A success as a claim made after ``window_failures`` failures saw the route."""
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        breaker.record_success(
            conn, route_id, QUIET, state="closed", window_failures=window_failures, now=now
        )


def _db_now(sessions: sessionmaker[Session]) -> Any:
    with sessions() as s:
        return s.execute(text("SELECT now()")).scalar_one()


def test_an_open_breaker_holds_claims_without_an_attempt_and_probes_once_per_interval(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 3)
    now = _db_now(sessions) + timedelta(minutes=1)
    changes = [_fail(settings, route_id, now) for _ in range(3)]
    assert [c.after for c in changes if c] == ["closed", "closed", "open"]
    route = _route(engine, route_id)
    assert (route.breaker_state, route.breaker_trips) == ("open", 1)

    def claim(delivery_id: int, at: Any) -> transitions.Claim | None:
        with sessions() as s, s.begin():
            return transitions.claim(
                s, delivery_id, now=at, lease=timedelta(minutes=4), max_redeliveries=3, worker="w"
            )

    # Open: nothing is claimed, no attempt row, attempts unchanged, and the sweeper skips them.
    assert [claim(i, now) for i in ids] == [None, None, None]
    assert _attempt_rows(engine, ids) == 0
    assert {delivery(engine, i).attempts for i in ids} == {0}
    # (Other tests' rows share this database: only this test's deliveries and route count.)
    with sessions() as s, s.begin():
        due = requeue.due_for_publish(s, now=now, grace=timedelta(0), limit=10_000)
    assert [row for row in due if row[0] in ids] == []

    def probes(at: Any) -> list[breaker.Probe]:
        with sessions() as s, s.begin():
            picked = breaker.pick_probes(
                s, now=at, interval=LIMITS.probe_interval, grace=timedelta(0)
            )
        return [p for p in picked if p.route_id == route_id]

    assert probes(now) == []  # the probe is due one interval after opening
    later = now + LIMITS.probe_interval
    (probe,) = probes(later)
    assert (probe.route_id, probe.delivery_id) == (route_id, ids[0])  # the oldest waiting
    assert probes(later) == []
    assert probes(later + timedelta(seconds=29)) == []
    assert _route(engine, route_id).breaker_state == "half_open"
    # Half-open: only the probe is claimable.
    assert claim(ids[1], later) is None
    assert claim(ids[0], later) is not None
    assert _attempt_rows(engine, ids) == 1
    # The probe failed: open again, the next probe one interval later.
    assert (c := _fail(settings, route_id, later)) is not None
    assert c.after == "open"
    assert _route(engine, route_id).breaker_trips == 2
    assert probes(later + timedelta(seconds=29)) == []
    assert len(probes(later + LIMITS.probe_interval)) == 1


def test_failures_below_the_ratio_or_the_minimum_keep_it_closed(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    now = _db_now(sessions)
    _fail(settings, route_id, now)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        for _ in range(3):  # successes inside the open window count as requests
            breaker.record_success(
                conn, route_id, LIMITS, state="closed", window_failures=1, now=now
            )
    _fail(settings, route_id, now)
    route = _route(engine, route_id)
    assert (route.breaker_state, route.window_requests, route.window_failures) == ("closed", 5, 2)
    # Past the window the count starts again at the next failure.
    _fail(settings, route_id, now + timedelta(minutes=2))
    route = _route(engine, route_id)
    assert (route.breaker_state, route.window_requests, route.window_failures) == ("closed", 1, 1)


def test_a_quiet_routes_streak_of_failures_opens_its_breaker_once_it_spans_a_minute(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """One delivery alone never makes the ratio's 10 requests in a window, and its later
    attempts come further apart than the window: without the streak it would spend its whole
    max_attempts on the outage and go dead (issue 23 item 4)."""
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    now = _db_now(sessions)
    # Five failures in 40 s: a streak, but not yet over the span. Closed.
    for seconds in (0, 10, 20, 30, 40):
        assert _moved(settings, route_id, now + timedelta(seconds=seconds)) == (
            "closed",
            "closed",
        ), seconds
    route = _route(engine, route_id)
    assert (route.window_requests, route.window_failures) == (5, 5)
    # Three minutes on, past the one-minute window: a window in which every request failed
    # has not expired, and the sixth failure opens the breaker.
    assert _moved(settings, route_id, now + timedelta(minutes=3)) == ("closed", "open")
    route = _route(engine, route_id)
    assert (route.breaker_state, route.breaker_trips) == ("open", 1)


def test_a_burst_within_the_span_keeps_it_closed_and_a_success_ends_the_streak(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """A busy route's burst of failures among claims made before its window opened (their
    successes are not counted) must not open it: the span. A success ends a streak, even
    past the window's minute, and the window then expires as any other."""
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    now = _db_now(sessions)
    for _ in range(8):  # more than the streak, all in one instant: not over the span
        assert _moved(settings, route_id, now) == ("closed", "closed")
    # Two minutes on (past the window): the streak's window is still open, so a success
    # counts in it and ends the streak.
    _succeed(settings, route_id, now + timedelta(minutes=2), window_failures=8)
    route = _route(engine, route_id)
    assert (route.breaker_state, route.window_requests, route.window_failures) == ("closed", 9, 8)
    # Without that success this failure would be the ninth of a streak over three minutes;
    # with it, the window has expired and the count starts again.
    assert _moved(settings, route_id, now + timedelta(minutes=3)) == ("closed", "closed")
    route = _route(engine, route_id)
    assert (route.window_requests, route.window_failures) == (1, 1)


def test_probes_take_the_held_backlog_in_turn_so_one_refused_delivery_cannot_shut_the_route(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """A failed probe is not an attempt: were the oldest waiting delivery always the probe,
    one the downstream always refuses (a poison payload) would keep its route shut for its
    whole max_age while the others would succeed."""
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 3)
    now = _db_now(sessions) + timedelta(minutes=1)
    for _ in range(3):
        _fail(settings, route_id, now)
    assert _route(engine, route_id).breaker_state == "open"

    def probe(at: Any) -> int | None:
        with sessions() as s, s.begin():
            picked = breaker.pick_probes(
                s, now=at, interval=LIMITS.probe_interval, grace=timedelta(0)
            )
        (mine,) = [p for p in picked if p.route_id == route_id]
        return mine.delivery_id

    at = now + LIMITS.probe_interval
    assert probe(at) == ids[0]  # at first the oldest
    # The probe is claimed, its call fails: recorded as a failed probe (uncounted), and the
    # breaker reopens.
    with sessions() as s, s.begin():
        found = transitions.claim(
            s, ids[0], now=at, lease=timedelta(minutes=4), max_redeliveries=3, worker="w"
        )
        assert found is not None
        transitions.retry_later(
            s,
            found,
            now=at,
            next_attempt_at=at,
            error_class="DownstreamError",
            error="downstream answered HTTP 503",
            uncounted=True,
        )
    _fail(settings, route_id, at)
    picks = []
    for n in range(1, 5):  # each later probe: the waiting delivery touched longest ago
        picks.append(probe(at + n * LIMITS.probe_interval))
    assert picks == [ids[1], ids[2], ids[0], ids[1]], picks
    assert delivery(engine, ids[0]).attempts == 1  # its one failed probe


# -- real workers, a real downstream --------------------------------------------------------


def test_a_failing_downstream_opens_the_breaker_probes_once_a_second_then_drains_none_dead(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    settings = worker_settings(**BREAKER)
    source = _forwarding(sessions, settings, downstream)
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 6)
    broker = Broker(settings)
    with running_worker("breaker", tmp_path, **BREAKER) as worker:
        for delivery_id in ids:
            broker.publish(delivery_id)
        wait_for(
            lambda: _route(engine, route_id).breaker_state != "closed",
            timeout=30,
            what="the breaker to open",
        )
        opened = time.monotonic()

        def probed(n: int) -> bool:
            broker.sweep()
            return len([t for t in downstream.calls if t > opened + 0.5]) >= n

        wait_for(lambda: probed(3), timeout=30, what="three probes", interval=0.2)
        # At most one call per probe interval (1 s) reaches the failing downstream. The
        # probes are the attempts claimed after the breaker opened, on the database's clock:
        # not the calls the test saw after it noticed the opening (an attempt claimed just
        # before the opening may reach the downstream after that, on a busy machine).
        probes = _claimed_after_opening(engine, route_id, ids)
        assert len(probes) >= 2, probes
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(probes)]
        assert min(gaps) > 0.8, gaps
        # Every call is an attempt row, and an open-breaker wait wrote none: the held
        # deliveries' retries wait for admission (models/admission.py), which admits nothing
        # of a held route, so they are not even published. (A probe claimed this instant has
        # its row before its call arrives: polled until both agree.)
        wait_for(
            lambda: _attempt_rows(engine, ids) == len(downstream.calls),
            timeout=10,
            what="every attempt's call to arrive",
            interval=0.05,
        )
        gate = admission.Admission(redis.Redis.from_url(CLAIMS_URL))
        try:
            waiting = set(ids) & set(gate.members() + gate.scheduled_due(most=100_000))
        finally:
            gate.client.close()
        assert waiting, "the held deliveries wait in admission"
        # max_attempts is 2 and the probe failed at least twice: the outage spent no budget.
        assert "dead" not in _statuses(engine, ids).values()
        assert _route(engine, route_id).breaker_trips >= 3
        downstream.status = 200

        def drained() -> bool:
            broker.sweep()
            return set(_statuses(engine, ids).values()) == {"succeeded"}

        wait_for(drained, timeout=60, what="the backlog to drain", interval=0.25)
        # The breaker's line is written after the commit the wait above saw: wait for it too.
        wait_for(
            lambda: "route.breaker_closed" in _events(worker),
            timeout=10,
            what="the worker's route.breaker_closed line",
        )
        assert "route.breaker_opened" in _events(worker)
    broker.close()
    assert _route(engine, route_id).breaker_state == "closed"


def test_a_quiet_routes_outage_longer_than_its_whole_schedule_sends_nothing_dead(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    """One event on a route, its downstream answering 503 for longer than the delivery's
    whole retry schedule (8 attempts at base 0.25 s, cap 1 s: about 3 s). Its 8 requests can
    never make the ratio's 10; the streak (5 failures over at least 0.5 s here) opens the
    breaker before the attempts run out, probes go out once a second, and the delivery is
    made once the downstream is back. Before the streak, this delivery went dead by
    max_attempts."""
    quiet: dict[str, Any] = {
        "retry_base": timedelta(seconds=0.25),
        "retry_cap": timedelta(seconds=1),
        "max_attempts": 8,
        "breaker_min_requests": 10,
        "breaker_window": timedelta(minutes=1),
        "breaker_streak": 5,
        "breaker_streak_span": timedelta(seconds=0.5),
        "breaker_probe_interval": timedelta(seconds=1),
    }
    settings = worker_settings(**quiet)
    source = _forwarding(sessions, settings, downstream)
    (route_id,) = source.route_ids
    (delivery_id,) = _accept(settings, source, 1)
    broker = Broker(settings)
    with running_worker("quiet", tmp_path, **quiet) as worker:
        broker.publish(delivery_id)
        wait_for(
            lambda: _route(engine, route_id).breaker_state != "closed",
            timeout=30,
            what="the breaker to open",
        )
        spent = delivery(engine, delivery_id).attempts
        assert 5 <= spent < 8, spent
        opened = time.monotonic()

        def outlasted() -> bool:
            # Probes once a second (the sweeper names them), for longer than the whole
            # schedule would have taken: at least 4 calls after the opening.
            broker.sweep()
            return len([t for t in downstream.calls if t > opened]) >= 4

        wait_for(outlasted, timeout=30, what="four probes", interval=0.2)
        assert delivery(engine, delivery_id).status != "dead"
        probes = _claimed_after_opening(engine, route_id, [delivery_id])
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(probes)]
        assert len(probes) >= 3, probes
        assert min(gaps) > 0.8, gaps
        downstream.status = 200

        def delivered() -> bool:
            broker.sweep()
            return delivery(engine, delivery_id).status == "succeeded"

        wait_for(delivered, timeout=30, what="the delivery once the downstream is back")
        # The breaker's line is written after the commit the wait above saw: wait for it too.
        wait_for(
            lambda: "route.breaker_closed" in _events(worker),
            timeout=10,
            what="the worker's route.breaker_closed line",
        )
        assert "route.breaker_opened" in _events(worker)
    broker.close()
    # Exactly one successful call: every other call was a failed attempt or a failed probe.
    assert _attempt_rows(engine, [delivery_id]) == len(downstream.calls)
    assert _route(engine, route_id).breaker_state == "closed"


def test_a_permanent_4xx_does_not_trip_the_breaker(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    downstream.status = 400
    settings = worker_settings(**BREAKER)
    source = _forwarding(sessions, settings, downstream)
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 5)
    broker = Broker(settings)
    with running_worker("breaker4xx", tmp_path, **BREAKER):
        for delivery_id in ids:
            broker.publish(delivery_id)
        wait_for(
            lambda: set(_statuses(engine, ids).values()) == {"dead"},
            timeout=30,
            what="the 4xx deliveries to go dead",
        )
    broker.close()
    route = _route(engine, route_id)
    assert (route.breaker_state, route.window_failures, route.breaker_trips) == ("closed", 0, 0)


def test_a_paused_route_makes_no_attempt_until_resumed_and_both_are_audited(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    downstream.status = 200
    settings = worker_settings()
    source = _forwarding(sessions, settings, downstream)
    (route_id,) = source.route_ids
    change = catalog.Change("alice", "downstream maintenance until 14:00")
    with sessions() as s, s.begin():
        breaker.set_paused(s, route_id, True, change, now=None)
    with sessions() as s, s.begin(), pytest.raises(catalog.CatalogError, match="already paused"):
        breaker.set_paused(s, route_id, True, change, now=None)
    ids = _accept(settings, source, 3)
    broker = Broker(settings)
    with running_worker("paused", tmp_path) as worker:
        for delivery_id in ids:
            broker.publish(delivery_id)

        def all_held() -> bool:
            broker.sweep()
            held = [
                line
                for line in worker.json_lines()
                if line.get("event") == "delivery.not_claimed" and line.get("outcome") == "held"
            ]
            return len(held) >= len(ids)

        wait_for(all_held, timeout=30, what="the paused route's deliveries to be held")
        assert set(_statuses(engine, ids).values()) == {"pending"}
        assert _attempt_rows(engine, ids) == 0
        assert downstream.calls == []
        with sessions() as s, s.begin():
            resumed = breaker.set_paused(
                s, route_id, False, catalog.Change("bob", "maintenance over"), now=None
            )
        assert resumed.unfinished == 3

        def delivered() -> bool:
            broker.sweep()
            return set(_statuses(engine, ids).values()) == {"succeeded"}

        wait_for(delivered, timeout=30, what="the resumed route to drain", interval=0.25)
    broker.close()
    with sessions() as s:
        audit = _audit_of(s, route_id)
    assert [(a.action, a.operator, a.reason) for a in audit[:2]] == [
        ("route.resume", "bob", "maintenance over"),
        ("route.pause", "alice", "downstream maintenance until 14:00"),
    ]


def _audit_of(session: Session, route_id: int) -> list[catalog.AuditRecord]:
    """This route's audit rows, most recent first (other tests' rows may carry a pinned
    clock's later instants, and would sort first in the whole log)."""
    rows = catalog.list_audit(session, action="route.", limit=1000)
    return [a for a in rows if a.target.get("route") == route_id]


def test_routes_pause_show_list_and_resume_from_the_cli(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    env = {**ops_env(), "COLUMNS": "250"}

    def run(*args: str) -> Any:
        done = cli(*args, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    refused = cli("routes", "pause", str(route_id), env=env)
    assert refused.returncode == 1
    assert "--reason is required" in refused.stderr
    assert _route(engine, route_id).paused_at is None  # nothing changed
    run("routes", "pause", str(route_id), "--reason", "downstream migration", "--as", "alice")
    shown = json.loads(run("routes", "show", str(route_id), "--json").stdout)
    assert shown["paused"] is True
    assert shown["pause_reason"] == "downstream migration"
    assert shown["breaker"]["state"] == "closed"
    (listed,) = json.loads(run("routes", "list", source.public_id, "--json").stdout)
    assert listed["paused"] is True
    assert "paused, closed" in run("routes", "list", source.public_id).stdout
    run("routes", "resume", str(route_id), "--as", "bob")
    again = cli("routes", "resume", str(route_id), env=env)
    assert again.returncode == 1
    assert "not paused" in again.stderr
    assert json.loads(run("routes", "show", str(route_id), "--json").stdout)["paused"] is False
    with sessions() as s:
        audit = _audit_of(s, route_id)
    assert [(a.action, a.operator, a.via) for a in audit[:2]] == [
        ("route.resume", "bob", "cli"),
        ("route.pause", "alice", "cli"),
    ]


def _events(worker: Worker) -> list[Any]:
    return [line.get("event") for line in worker.json_lines()]

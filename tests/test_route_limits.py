"""Fairness across routes and per-route limits (issue 23, items 1 and 2): real Postgres, real
workers (each runs its dispatcher), the receiver's real publisher, a real local downstream
that counts calls and concurrency per route."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.publisher import Publisher
from models import admission, breaker, catalog
from tasks.config import Dispatch
from tests.factories import accept_event, make_source
from tests.handlers_for_tests import EFFECTS_DDL
from tests.operators_support import cli, ops_env
from tests.workers import (
    CLAIMS_URL,
    effects,
    flush_redis,
    running_beat,
    running_worker,
    wait_for,
    worker_settings,
)
from webhooks.settings import Settings

pytestmark = pytest.mark.slow


class Downstream:
    """Answers 200 after ``delay[path]`` seconds; records each call's (path, start, end)."""

    def __init__(self, delays: dict[str, float]) -> None:
        self.delays = delays
        self.calls: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                start = time.monotonic()
                self.rfile.read(int(self.headers["content-length"]))
                time.sleep(server.delays.get(self.path, 0.0))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                with server._lock:
                    server.calls.append((self.path, start, time.monotonic()))

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def route(self, path: str) -> dict[str, Any]:
        return {"handler": "forward", "options": {"url": self.base + path, "allow_private": "true"}}

    def of(self, path: str) -> list[tuple[float, float]]:
        return sorted((s, e) for p, s, e in self.calls if p == path)

    def peak(self, path: str) -> int:
        edges = sorted(
            [(s, 1) for s, _ in self.of(path)] + [(e, -1) for _, e in self.of(path)],
            key=lambda x: (x[0], x[1]),
        )
        level = top = 0
        for _, step in edges:
            level += step
            top = max(top, level)
        return top

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    server = Downstream({"/burst": 0.2, "/quiet": 0.01, "/limited": 0.05})
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _clean() -> None:
    flush_redis()


def _accept(settings: Settings, source: Any, n: int) -> list[int]:
    return [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]


def _statuses(engine: Engine, ids: list[int]) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
        ).all()
    return {r[0] for r in rows}


def _limits(sessions: sessionmaker[Session], route_id: int, **values: Any) -> None:
    with sessions() as s, s.begin():
        breaker.set_limits(s, route_id, catalog.Change("test", "limits"), now=None, **values)


# -- parsing ---------------------------------------------------------------------------------


def test_rate_and_budget_parse_or_refuse_clearly() -> None:
    assert admission.parse_rate("50/s") == admission.Rate(50, 1)
    assert admission.parse_rate("3000/m") == admission.Rate(3000, 60)
    assert admission.parse_rate("none") is None
    assert admission.parse_max_in_flight("7") == 7
    assert admission.parse_max_in_flight("none") is None
    for bad in ("50", "0/s", "5/d", "-1/s", "fast"):
        with pytest.raises(admission.LimitError, match="rate limit"):
            admission.parse_rate(bad)
    for bad in ("0", "-3", "x", "1.5"):
        with pytest.raises(admission.LimitError, match="max in flight"):
            admission.parse_max_in_flight(bad)


# -- fairness --------------------------------------------------------------------------------


def test_a_burst_on_one_route_leaves_a_trickle_on_another_on_time(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    """60 deliveries on a route whose downstream takes 200 ms, four slots: without admission
    the trickle waits behind three seconds of backlog. With a budget of 2 it never waits."""
    overrides: dict[str, Any] = {"delivery_batch": 1, "route_max_in_flight": 2}
    settings = worker_settings(**overrides)
    burst = make_source(sessions, settings, routes=[downstream.route("/burst")])
    quiet = make_source(sessions, settings, routes=[downstream.route("/quiet")])
    burst_ids = _accept(settings, burst, 60)
    publisher = Publisher(settings)
    sent: list[float] = []
    with running_worker("fair", tmp_path, concurrency=4, **overrides):
        publisher.submit("burst", [Dispatch(i) for i in burst_ids])
        time.sleep(0.3)  # the burst is in: the trickle starts behind it
        quiet_ids = []
        for _ in range(8):
            (i,) = _accept(settings, quiet, 1)
            sent.append(time.monotonic())
            publisher.submit("quiet", [Dispatch(i)])
            quiet_ids.append(i)
            time.sleep(0.25)
        wait_for(
            lambda: _statuses(engine, quiet_ids) == {"succeeded"}, timeout=30, what="the trickle"
        )
        late = [c[0] - s for s, c in zip(sent, downstream.of("/quiet"), strict=True)]
        assert max(late) < 1.0, late
        assert downstream.peak("/burst") <= 2
        wait_for(
            lambda: _statuses(engine, burst_ids) == {"succeeded"}, timeout=60, what="the burst"
        )
    publisher.close()
    assert len(downstream.of("/burst")) == 60


# -- limits, measured at the downstream ------------------------------------------------------


def test_rate_and_in_flight_limits_hold_at_the_downstream_and_waiting_is_no_attempt(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, downstream: Downstream
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[downstream.route("/limited")])
    (route_id,) = source.route_ids
    _limits(sessions, route_id, max_in_flight=3, rate=admission.Rate(20, 1))
    ids = _accept(settings, source, 60)
    publisher = Publisher(settings)
    with running_worker("limits", tmp_path, concurrency=8):
        publisher.submit("limited", [Dispatch(i) for i in ids])
        wait_for(lambda: _statuses(engine, ids) == {"succeeded"}, timeout=60, what="the drain")
    publisher.close()
    starts = [s for s, _ in downstream.of("/limited")]
    assert len(starts) == 60
    assert downstream.peak("/limited") <= 3
    # No one-second window holds more than the rate + 5%.
    busiest = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert busiest <= 21, busiest
    # Waiting for the limits is not an attempt: one attempt row each.
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT max(attempts), count(*) FROM deliveries WHERE id = ANY(:ids)"),
            {"ids": ids},
        ).one()
        tries = conn.execute(
            text("SELECT count(*) FROM attempts WHERE delivery_id = ANY(:ids)"), {"ids": ids}
        ).scalar_one()
    assert (rows[0], tries) == (1, 60)


# -- crashes and a Redis flush ---------------------------------------------------------------


def test_kill_9_of_a_worker_and_its_dispatcher_mid_drain_then_a_redis_flush_lose_nothing(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path
) -> None:
    settings = worker_settings()
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    (route_id,) = source.route_ids
    _limits(sessions, route_id, max_in_flight=2, rate=admission.Rate(4, 1))
    ids = _accept(settings, source, 40)
    publisher = Publisher(settings)
    # The beat's sweeper is part of the recovery: it re-publishes what the killed worker held
    # and offers the rows that were waiting when the flush emptied admission's sets.
    with (
        running_worker("a", tmp_path, concurrency=4) as a,
        running_worker("b", tmp_path, concurrency=4),
        running_beat(tmp_path),
    ):
        publisher.submit("crash", [Dispatch(i) for i in ids])

        def done() -> int:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        text(
                            "SELECT count(*) FROM deliveries WHERE id = ANY(:ids)"
                            " AND status = 'succeeded'"
                        ),
                        {"ids": ids},
                    ).scalar_one()
                )

        wait_for(lambda: done() >= 8, timeout=30, what="the drain to start")
        assert done() < 40  # mid-drain: the rate limit spreads it over ten seconds
        os.kill(a.pid, signal.SIGKILL)
        for pid in a.pool_pids():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: done() >= 20, timeout=60, what="the drain to go on without a")
        flush_redis(CLAIMS_URL)  # admission's sets and rate state gone
        wait_for(lambda: done() == 40, timeout=90, what="the rest after the flush")
    publisher.close()
    assert all(len(effects(engine, i)) == 1 for i in ids)


def test_after_a_flush_reconcile_counts_the_processing_rows_and_leaves_pending_ones_to_the_sweeper(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """The re-learn must not publish around the sweeper: a pending row's message may still be
    in the broker, and the sweeper's pick is what moves its next_attempt_at and counts its
    re-publish (the worker's claim relies on both)."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    (route_id,) = source.route_ids
    pending, working = _accept(settings, source, 2)
    with engine.begin() as conn:  # both due; one claimed by a live worker
        conn.execute(
            text("UPDATE deliveries SET next_attempt_at = now() - interval '1 minute'"
                 " WHERE id = ANY(:ids)"),
            {"ids": [pending, working]},
        )  # fmt: skip
        conn.execute(
            text("UPDATE deliveries SET status = 'processing',"
                 " lease_until = now() + interval '1 minute' WHERE id = :id"),
            {"id": working},
        )  # fmt: skip
    flush_redis(CLAIMS_URL)
    client = redis.Redis.from_url(CLAIMS_URL)
    gate = admission.Admission(client)
    try:
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            admission.reconcile(conn, gate, grace=settings.publish_grace)
        assert gate.in_flight()[route_id] == {working: pytest.approx(gate.now_ms(), abs=5000)}
        assert gate.counts(route_id) == (1, 0)  # the pending one waits for no dispatcher
        assert route_id not in gate.waiting_routes()
    finally:
        client.close()


# -- the command line ------------------------------------------------------------------------


def test_routes_update_sets_limits_audited_shows_them_and_refuses_bad_input(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = make_source(sessions, settings)
    (route_id,) = source.route_ids
    env = {**ops_env(), "COLUMNS": "250"}

    def show() -> dict[str, Any]:
        done = cli("routes", "show", str(route_id), "--json", env=env)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout)["limits"])

    assert show() == {"max_in_flight": None, "rate_limit": None}
    for args, message in (
        (["--rate-limit", "fast"], "rate limit 'fast'"),
        (["--max-in-flight", "0"], "must be 1 to 100000"),
        ([], "nothing to change"),
    ):
        bad = cli("routes", "update", str(route_id), *args, env=env)
        assert bad.returncode == 1, bad.stdout
        assert message in bad.stderr
        assert show() == {"max_in_flight": None, "rate_limit": None}  # nothing changed
    done = cli(
        "routes", "update", str(route_id), "--rate-limit", "3000/m", "--max-in-flight", "5",
        "--reason", "downstream asked", "--as", "alice", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert show() == {"max_in_flight": 5, "rate_limit": "3000/m"}
    listed = cli("routes", "list", source.public_id, env=env).stdout
    assert "5 in flight, rate 3000/m" in listed
    cli("routes", "update", str(route_id), "--rate-limit", "none", "--max-in-flight", "none",
        env=env)  # fmt: skip
    assert show() == {"max_in_flight": None, "rate_limit": None}
    with sessions() as s:
        audit = catalog.list_audit(s, action="route.limits", limit=100)
    # Only this route's rows: the other tests' limits share the database.
    ours = [a for a in audit if a.target["route"] == route_id]
    assert [a.operator for a in ours][-1] == "alice"  # most recent first: alice's is older
    assert [a.target["after"] for a in ours] == [
        {"max_in_flight": None, "rate_limit": None},
        {"max_in_flight": 5, "rate_limit": "3000/m"},
    ]

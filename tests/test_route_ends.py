"""Every route and delivery ends (issue 34 item 3): an open breaker never keeps a delivery
alive past its max_age (held, or picked as the probe), and a route whose breaker stays open
past WEBHOOKS_ROUTE_DISABLE_AFTER is disabled, audited, alerted and shown, its waiting
deliveries dead (``route_disabled``) and replayable once it is enabled again.

Real Postgres and Redis throughout. The sweep's and the worker's own code run either in a
real ``celery worker`` process (the database's clock; time moved by moving the rows' own
instants back: a delivery's first attempt, a breaker's opening) or in this process with the
injected clock pinned (:class:`core.clock.FrozenClock`, which stands for the database's clock
in every guarded statement). Never a sleep."""

from __future__ import annotations

import html
import re
import secrets
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.messages import Dispatch
from core.settings import Settings
from models import breaker, catalog, requeue, route_catalog
from tasks.pipeline import deliver_one
from tasks.runtime import build_runtime
from tasks.sweeper import sweep_once
from tests.factories import MadeSource, accept_event, make_source
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.operators_support import cli, ops_receiver
from tests.workers import (
    Broker,
    delivery,
    running_worker,
    wait_for,
    worker_env,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

HOUR = timedelta(hours=1)
# The finding's route (issue 34): 8 attempts; three failures in a minute open the breaker;
# one probe a second.
OUTAGE: dict[str, Any] = {
    "max_attempts": 8,
    "breaker_min_requests": 3,
    "breaker_failure_ratio": 0.7,
    "breaker_window": timedelta(minutes=1),
    "breaker_probe_interval": timedelta(seconds=1),
}


class Down:
    """A local downstream that always answers 503, counting the calls."""

    def __init__(self) -> None:
        self.status = 503
        self.calls = 0
        server = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                server.calls += 1
                self.send_response(server.status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def close(self) -> None:
        self.loopback.close()


@pytest.fixture
def down() -> Iterator[Down]:
    server = Down()
    yield server
    server.close()


def _no_publish(dispatch: Dispatch, countdown: float) -> None:
    pass


def _db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value: datetime = conn.execute(text("SELECT now()")).scalar_one()
        return value


def _route(engine: Engine, route_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM routes WHERE id = :id"), {"id": route_id}).one()


def _open(
    engine: Engine,
    route_id: int,
    *,
    at: datetime,
    probe: int | None = None,
    probe_in: timedelta = timedelta(days=30),
) -> None:
    """The route's breaker opened at ``at`` (half-open with ``probe`` as its probe); its next
    probe ``probe_in`` after ``at`` (default: far away, so only what the test does happens)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE routes SET breaker_state = :state, breaker_opened_at = :at,"
                " breaker_probe_at = :at + :probe_in, probe_delivery = :probe,"
                " breaker_trips = breaker_trips + 1 WHERE id = :id"
            ),
            {
                "state": "open" if probe is None else "half_open",
                "at": at,
                "probe": probe,
                "probe_in": probe_in,
                "id": route_id,
            },
        )


def _sweep(settings: Settings, at: datetime) -> list[int]:
    """One sweep of the worker's own code, at the pinned instant ``at``."""
    rt = build_runtime(settings, clock=FrozenClock(at), worker=f"sweep-{at.isoformat()}")
    published: list[int] = []

    def publish(group: Sequence[Dispatch]) -> None:
        published.extend(d.delivery_id for d in group)

    try:
        sweep_once(rt, publish)
    finally:
        rt.close()
    return published


def _source(sessions: sessionmaker[Session], settings: Settings, **route: Any) -> MadeSource:
    return make_source(sessions, settings, routes=[{"handler": "always_fail", **route}])


def _accept(settings: Settings, source: MadeSource, n: int) -> list[int]:
    return [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]


def _dead_letters(reason: str, source: MadeSource) -> float:
    """This process's ``webhooks_dead_letters_total`` of one reason and source (issue 35
    item 6: the sweep's dead letters name their source too)."""
    labels = {"reason": reason, "source": source.public_id}
    return REGISTRY.get_sample_value("webhooks_dead_letters_total", labels) or 0.0


def _open_for(last_error: str) -> int:
    found = re.search(r"the breaker had been open for (\d+) s \(since ", last_error)
    assert found, last_error
    return int(found.group(1))


# -- max_age bounds a delivery's life whatever the breaker does ------------------------------


def test_the_sweep_sends_deliveries_an_open_breaker_held_past_max_age_to_the_dead_letters(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Held behind an open breaker (never claimed, so never asked about their age by a failed
    attempt), deliveries past their route's max_age go dead, ``expired``, and the dead letter
    says how long the route had been open. A route paused by hand keeps its deliveries (an
    operator's hold), and the sweep never touches a closed route's (the worker's policy
    decides there). Before issue 34 they waited for ever."""
    settings = worker_settings()
    held, paused, closed = (_source(sessions, settings, max_age=HOUR) for _ in range(3))
    held_ids = _accept(settings, held, 2)
    (paused_id,) = _accept(settings, paused, 1)
    (closed_id,) = _accept(settings, closed, 1)
    start = _db_now(engine)
    # Its probes due (the expiry runs with them, once per probe interval a route).
    _open(engine, held.route_ids[0], at=start, probe_in=timedelta(0))
    _open(engine, paused.route_ids[0], at=start, probe_in=timedelta(0))
    with sessions() as s, s.begin():
        breaker.set_paused(s, paused.route_ids[0], True, catalog.Change("ops", "hold"), now=start)

    _sweep(settings, start + timedelta(minutes=59))
    assert {delivery(engine, i).status for i in [*held_ids, paused_id, closed_id]} == {"pending"}
    assert _dead_letters("expired", held) == 0

    _sweep(settings, start + timedelta(minutes=61))
    assert _dead_letters("expired", held) == 2  # counted under their source
    assert _dead_letters("expired", paused) == _dead_letters("expired", closed) == 0
    for delivery_id in held_ids:
        row = delivery(engine, delivery_id)
        assert (row.status, row.dead_reason) == ("dead", "expired")
        assert row.last_error.startswith("expired: its max_age (3600 s) passed"), row.last_error
        assert row.last_error_class == "BreakerOpen"  # never attempted: no error of its own
        assert _open_for(row.last_error) == 61 * 60
    assert delivery(engine, paused_id).status == "pending"
    assert delivery(engine, closed_id).status == "pending"
    # A dead letter like any: replayable (the same downstream key).
    with sessions() as s, s.begin():
        assert requeue.replay(s, held_ids[0], now=None, publish_grace=timedelta(seconds=1))
    assert delivery(engine, held_ids[0]).status == "pending"


def test_a_breaker_probe_that_fails_past_max_age_goes_dead_expired(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The probe of a half-open route is a delivery like the others: its failure is not
    counted against max_attempts (the outage is not its budget), but it ages. Before issue 34
    a failed probe was never dead by age, so a downstream that always failed was probed for
    ever, 2,880 calls a day at the default interval."""
    settings = worker_settings(max_attempts=10)
    source = make_source(
        sessions, settings, routes=[{"handler": "downstream_down", "max_age": HOUR}]
    )
    (route_id,) = source.route_ids
    (delivery_id,) = _accept(settings, source, 1)
    start = _db_now(engine)

    def attempt(at: timedelta) -> str:
        rt = build_runtime(settings, clock=FrozenClock(start + at), worker=f"probe-{at}")
        try:
            return deliver_one(rt, delivery_id, publish_retry=_no_publish)
        finally:
            rt.close()

    assert attempt(timedelta(seconds=1)) == "retry"  # its first attempt: the age starts
    _open(engine, route_id, at=start + timedelta(seconds=2), probe=delivery_id)
    # A probe failing within its max_age: retried, not counted.
    assert attempt(timedelta(minutes=30)) == "retry"
    row = delivery(engine, delivery_id)
    assert (row.status, row.attempts - row.attempt_base) == ("retrying", 1)
    # Probed again two hours on: past its max_age, dead, saying how long the route was open.
    _open(engine, route_id, at=start + timedelta(seconds=2), probe=delivery_id)
    assert attempt(timedelta(hours=2)) == "dead"
    row = delivery(engine, delivery_id)
    assert (row.status, row.dead_reason) == ("dead", "expired")
    assert _dead_letters("expired", source) == 1
    assert _open_for(row.last_error) == 2 * 3600 - 2
    assert row.last_error.endswith("last error: http_5xx: downstream answered HTTP 503")


def _backdate(engine: Engine, ids: list[int], route_id: int, by: timedelta) -> None:
    """Time moved on the database's clock for these rows: their first attempt (and creation)
    and their route's breaker opening ``by`` earlier."""
    with engine.begin() as conn:
        if ids:
            conn.execute(
                text(
                    "UPDATE deliveries SET created_at = created_at - :by,"
                    " first_attempt_at = first_attempt_at - :by WHERE id = ANY(:ids)"
                ),
                {"by": by, "ids": ids},
            )
        conn.execute(
            text("UPDATE routes SET breaker_opened_at = breaker_opened_at - :by WHERE id = :id"),
            {"by": by, "id": route_id},
        )


def _probes(engine: Engine, route_id: int, ids: list[int]) -> int:
    """Attempts claimed after the route's breaker opened: its probes."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM attempts a, routes g WHERE a.delivery_id = ANY(:ids)"
                    " AND g.id = :route AND a.started_at > g.breaker_opened_at"
                ),
                {"ids": ids, "route": route_id},
            ).scalar_one()
        )


def test_a_downstream_that_always_fails_is_probed_until_max_age_then_never_again(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, down: Down
) -> None:
    """The finding, in a real worker: a downstream answering 503 to everything, 8 attempts,
    a max_age. The breaker opens, probes fail; once the deliveries are past their max_age
    (their first attempt and the opening moved two hours back) the worker's sweep sends them
    to the dead letters, ``expired``, and the downstream is never called again. Before
    issue 34 they stayed ``retrying``, probed for ever."""
    settings = worker_settings(**OUTAGE)
    route = {
        "handler": "forward",
        "options": {"url": down.url, "allow_private": "true"},
        "max_age": HOUR,
    }
    source = make_source(sessions, settings, routes=[route])
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 4)
    broker = Broker(settings)
    try:
        with running_worker("expire", tmp_path, **OUTAGE) as worker:
            for delivery_id in ids:
                broker.publish(delivery_id)
            wait_for(
                lambda: _route(engine, route_id).breaker_state != "closed",
                timeout=30,
                what="the breaker to open",
            )

            def probed() -> bool:
                broker.sweep()
                return _probes(engine, route_id, ids) >= 2

            wait_for(probed, timeout=30, what="two failed probes", interval=0.3)
            assert "dead" not in {delivery(engine, i).status for i in ids}
            _backdate(engine, ids, route_id, 2 * HOUR)

            def ended() -> bool:
                broker.sweep()
                return {delivery(engine, i).status for i in ids} == {"dead"}

            wait_for(ended, timeout=30, what="every delivery to end", interval=0.3)
            rows = [delivery(engine, i) for i in ids]
            assert {r.dead_reason for r in rows} == {"expired"}
            assert all(_open_for(r.last_error) >= 2 * 3600 for r in rows)
            shown = cli("deliveries", "show", str(ids[0]), env=worker_env(**OUTAGE))
            assert shown.returncode == 0, shown.stderr
            assert "dead: expired" in shown.stdout
            assert "the breaker had been open for" in " ".join(shown.stdout.split())
            # Nothing left to probe: the sweeps go on, the downstream is not called again.
            calls = down.calls
            for _ in range(3):
                before = _route(engine, route_id).breaker_probe_at

                def looked(before: Any = before) -> bool:
                    broker.sweep()
                    return bool(_route(engine, route_id).breaker_probe_at != before)

                wait_for(looked, timeout=15, what="a sweep to look at the route", interval=0.3)
            assert down.calls == calls
            assert _route(engine, route_id).probe_delivery is None
            assert "sweep.expired" in [line.get("event") for line in worker.json_lines()]
    finally:
        broker.close()


# -- a route open longer than WEBHOOKS_ROUTE_DISABLE_AFTER is disabled -----------------------


def _disabled_count(route_id: int) -> float:
    value = REGISTRY.get_sample_value("webhooks_routes_disabled_total", {"route": str(route_id)})
    return value or 0.0


def test_the_sweep_disables_a_route_open_past_the_setting_but_never_a_paused_one(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """At the default WEBHOOKS_ROUTE_DISABLE_AFTER (5 days, Svix's figure), in this process
    with the clock pinned: the route open longer is disabled (counted by
    webhooks_routes_disabled_total), its waiting deliveries dead with route_disabled; a
    route paused by hand is not, and once resumed its open time counts from the resume."""
    settings = worker_settings()
    assert settings.route_disable_after == timedelta(days=5)
    # The stale route's deliveries live longer than the route stays open (max_age 10 days):
    # they end by the disabling, not by their age.
    stale = _source(sessions, settings, max_age=timedelta(days=10))
    paused = _source(sessions, settings)
    stale_ids = _accept(settings, stale, 2)
    (paused_id,) = _accept(settings, paused, 1)
    start = _db_now(engine)
    for source in (stale, paused):
        _open(engine, source.route_ids[0], at=start)
    with sessions() as s, s.begin():
        breaker.set_paused(s, paused.route_ids[0], True, catalog.Change("ops", "hold"), now=start)
    (stale_route,) = stale.route_ids
    counted = _disabled_count(stale_route)

    _sweep(settings, start + timedelta(days=4, hours=23))
    assert _route(engine, stale_route).active

    after = start + timedelta(days=5, minutes=1)
    _sweep(settings, after)
    assert _dead_letters("route_disabled", stale) == 2  # counted under their source
    route = _route(engine, stale_route)
    assert (route.active, route.disabled_at, route.breaker_state) == (False, after, "closed")
    assert route.disabled_reason.startswith("breaker open longer than 5d:"), route.disabled_reason
    assert _open_for(route.disabled_reason) == 5 * 86400 + 60
    for delivery_id in stale_ids:
        row = delivery(engine, delivery_id)
        assert (row.status, row.dead_reason) == ("dead", "route_disabled")
        assert row.last_error.startswith("route_disabled: breaker open longer than 5d"), row
    assert _disabled_count(stale_route) == counted + 1
    # The paused route: still active, its delivery held.
    assert _route(engine, paused.route_ids[0]).active
    assert delivery(engine, paused_id).status == "pending"
    # Resumed: its breaker's open time (and its delivery's age) count from the resume.
    with sessions() as s, s.begin():
        breaker.set_paused(s, paused.route_ids[0], False, catalog.Change("ops", "back"), now=after)
    _sweep(settings, after + timedelta(days=1))
    assert _route(engine, paused.route_ids[0]).active
    assert delivery(engine, paused_id).status == "pending"


def _audit_rows(engine: Engine, route_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT * FROM audit_log WHERE action LIKE 'route.%'"
                    " AND (target->>'route')::bigint = :route ORDER BY id"
                ),
                {"route": route_id},
            )
        )


def test_a_route_open_too_long_is_disabled_audited_logged_shown_then_enabled_and_replayed(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, down: Down
) -> None:
    """A real worker, a downstream answering 503, WEBHOOKS_ROUTE_DISABLE_AFTER an hour and the
    breaker's opening moved two hours back: the worker's sweep disables the route (audited as
    ``sweeper``, one ``route.disabled`` line), its waiting deliveries go dead with
    route_disabled, and `webhooks routes show` says when and why. Fixed, enabled by an
    operator and replayed with the existing tool, every one is delivered."""
    overrides = {**OUTAGE, "route_disable_after": HOUR}
    settings = worker_settings(**overrides)
    route = {"handler": "forward", "options": {"url": down.url, "allow_private": "true"}}
    source = make_source(sessions, settings, routes=[route])
    (route_id,) = source.route_ids
    ids = _accept(settings, source, 3)
    broker = Broker(settings)
    env = worker_env(**overrides)
    try:
        with running_worker("disable", tmp_path, **overrides) as worker:
            for delivery_id in ids:
                broker.publish(delivery_id)
            wait_for(
                lambda: _route(engine, route_id).breaker_state != "closed",
                timeout=30,
                what="the breaker to open",
            )
            # No probe from here on (so none is in flight), and nothing running.
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "UPDATE routes SET breaker_probe_at = now() + interval '1 day'"
                        " WHERE id = :id"
                    ),
                    {"id": route_id},
                )
            wait_for(
                lambda: "processing" not in {delivery(engine, i).status for i in ids},
                timeout=30,
                what="no attempt in flight",
            )
            _backdate(engine, [], route_id, 2 * HOUR)

            def disabled() -> bool:
                broker.sweep()
                return not _route(engine, route_id).active

            wait_for(disabled, timeout=30, what="the route to be disabled", interval=0.3)
            row = _route(engine, route_id)
            assert row.disabled_at is not None
            assert row.disabled_reason.startswith("breaker open longer than 1h:")
            assert _open_for(row.disabled_reason) >= 2 * 3600
            dead = [delivery(engine, i) for i in ids]
            assert {(d.status, d.dead_reason) for d in dead} == {("dead", "route_disabled")}
            (audit,) = [a for a in _audit_rows(engine, route_id) if a.action == "route.disable"]
            assert (audit.operator, audit.via) == ("sweeper", "sweep")
            assert audit.reason == row.disabled_reason
            assert audit.target["dead"] == 3
            # (An earlier test's route left open is disabled too: its own line.)
            lines = [
                line
                for line in worker.json_lines()
                if line.get("event") == "route.disabled" and line["route_id"] == route_id
            ]
            assert [(line["dead"], line["source"]) for line in lines] == [(3, source.public_id)]
            shown = cli("routes", "show", str(route_id), env=env)
            assert shown.returncode == 0, shown.stderr
            assert "disabled since " in shown.stdout
            assert "breaker open longer than 1h" in shown.stdout
            # Fixed: an operator enables it and replays its dead letters.
            down.status = 200
            enabled = cli("routes", "enable", str(route_id), "--reason", "fixed", env=env)
            assert enabled.returncode == 0, enabled.stderr
            assert _route(engine, route_id).disabled_at is None
            replayed = cli(
                "replay", *map(str, ids), "--reason", "downstream fixed", "--yes", env=env
            )
            assert replayed.returncode == 0, replayed.stdout + replayed.stderr

            def delivered() -> bool:
                broker.sweep()
                return {delivery(engine, i).status for i in ids} == {"succeeded"}

            wait_for(delivered, timeout=60, what="the replayed deliveries", interval=0.3)
    finally:
        broker.close()


CONSOLE_TOKEN = "adm_ends_" + secrets.token_urlsafe(24)
remember(CONSOLE_TOKEN)


def _console_pages(admin_url: str, *paths: str) -> list[str]:
    """Console pages, logged in with a named admin token (plain HTTP: the login form's CSRF
    token, then the session cookie)."""
    with httpx.Client(base_url=admin_url, follow_redirects=True, timeout=30) as client:
        form = client.get("/console/login").text
        found = re.search(r'name="csrf" value="([^"]+)"', form)
        assert found, form
        answer = client.post(
            "/console/login", data={"csrf": found.group(1), "token": CONSOLE_TOKEN}
        )
        assert answer.status_code == 200, answer.status_code
        pages = [client.get(path) for path in paths]
        assert [page.status_code for page in pages] == [200] * len(paths)
        return [page.text for page in pages]


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_the_console_shows_a_route_the_sweep_disabled_with_when_and_why(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The routes page says when and why; the dead letter's page says why too."""
    settings = worker_settings()
    source = _source(sessions, settings)
    (route_id,) = source.route_ids
    (delivery_id,) = _accept(settings, source, 1)
    start = _db_now(engine)
    _open(engine, route_id, at=start)
    _sweep(settings, start + timedelta(days=6))
    assert not _route(engine, route_id).active
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"dora:{CONSOLE_TOKEN}") as api:
        routes, letter = _console_pages(
            api.admin_url, "/console/routes", f"/console/deliveries/{delivery_id}"
        )
    row = re.search(rf'<tr data-route="{route_id}">(.*?)</tr>', routes, re.S)
    assert row, routes
    cell = _text(row.group(1))
    assert "disabled since " in cell, cell
    assert "breaker open longer than 5d: the breaker had been open for 518400 s" in cell, cell
    why = re.search(r'<dd id="last-error">(.*?)</dd>', letter, re.S)
    assert why, letter
    assert _text(why.group(1)).startswith(
        "RouteDisabled: route_disabled: breaker open longer than 5d: the breaker had been open"
    ), why.group(1)


def test_an_operators_disable_records_when_and_why_and_enable_clears_them_as_a_release(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The operator's `routes disable` says when and why too (shown like the sweep's), and
    `routes enable` clears both and counts as a release: a breaker left open from before is
    judged afresh by WEBHOOKS_ROUTE_DISABLE_AFTER, not disabled again at the next sweep."""
    settings = worker_settings()
    source = _source(sessions, settings)
    (route_id,) = source.route_ids
    start = _db_now(engine)
    _open(engine, route_id, at=start - timedelta(days=9))
    with sessions() as s, s.begin():
        route_catalog.set_route_active(
            s, route_id, False, catalog.Change("ops", "downstream retired"), now=start
        )
    row = _route(engine, route_id)
    assert (row.active, row.disabled_at, row.disabled_reason) == (
        False,
        start,
        "downstream retired",
    )
    with sessions() as s, s.begin():
        route_catalog.set_route_active(s, route_id, True, catalog.Change("ops", "back"), now=start)
    row = _route(engine, route_id)
    assert (row.active, row.disabled_at, row.disabled_reason, row.released_at) == (
        True,
        None,
        None,
        start,
    )
    _sweep(settings, start + timedelta(days=1))
    assert _route(engine, route_id).active
    _sweep(settings, start + timedelta(days=5, minutes=1))
    assert not _route(engine, route_id).active

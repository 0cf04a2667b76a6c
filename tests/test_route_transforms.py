"""Route transforms (issue 37 item 4): ``webhooks routes add|update --transform NAME``.

The time limit is measured on real threads (pure). The rest runs the real thing: a Celery
worker forwarding to a local downstream stand-in over loopback, real Postgres and Redis, the
``webhooks`` CLI, the receiver's admin API and console.
"""

from __future__ import annotations

import json
import secrets as pysecrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks.webhooks import Webhook

from core.crypto import generate_secret
from core.docs import TOPICS
from core.settings import Settings
from models.db import alembic_config
from tasks.context import Event, EventMeta
from tasks.transforms import (
    TransformDropped,
    Transformed,
    TransformFailed,
    TransformTimeLimit,
    apply,
    load_transforms,
)
from tests.conftest import TEST_DB
from tests.factories import accept_event, make_source
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.operators_support import cli, console_login, ops_env, ops_receiver, ops_settings
from tests.processes import Receiver
from tests.retention_support import own_database
from tests.transforms_for_tests import SECRET_WORDS, reshape, spins
from tests.workers import Broker, delivery, running_worker, wait_status, worker_settings

MODULES = ["tests.handlers_for_tests", "tests.transforms_for_tests"]
LIMIT = 0.3  # the workers' WEBHOOKS_TRANSFORM_TIME_LIMIT here
TOKEN = "adm_transforms_" + pysecrets.token_urlsafe(24)
remember(TOKEN)


def _event(body: bytes, event_type: str = "test.event") -> Event:
    now = datetime.now(UTC)
    meta = EventMeta(1, 1, "src_x", "standard", "evt_1", event_type, None, now, "application/json")
    return Event(meta, body)


# -- the time limit, on real threads ---------------------------------------------------------


def _stopped_after(limit: float) -> tuple[float, BaseException]:
    started = time.monotonic()
    try:
        apply(spins, "spins", _event(b'{"data": {"n": 1}}'), limit)
    except TransformFailed as exc:
        return time.monotonic() - started, exc
    raise AssertionError("the runaway transform returned")


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_the_time_limit_stops_a_runaway_transform(where: str) -> None:
    """A loop of Python code that swallows every Exception is stopped at its limit, in the
    calling thread and in a handler's pool thread; what it raised is named, nothing else."""
    if where == "main thread":
        took, exc = _stopped_after(0.2)
    else:
        with ThreadPoolExecutor(1) as pool:
            took, exc = pool.submit(_stopped_after, 0.2).result(timeout=30)
    assert isinstance(exc, TransformFailed)
    assert exc.raised == "TransformTimeLimit"
    assert exc.reason == "transform_failed"
    # Measured here: stopped 0.2 s + 5-15 ms (the watchdog's 5 ms tick and a GIL switch);
    # the bound leaves room for a loaded machine.
    assert 0.2 <= took < 0.2 + 0.5, took


def test_a_limit_never_lands_after_the_transform_returned() -> None:
    """Transforms that finish around their limit: each returns or fails inside ``apply``,
    and no limit ever lands in the caller's code afterwards."""
    body = b'{"data": {"n": 1}}'
    outcomes = {"ok": 0, "late": 0}
    for _ in range(300):
        try:
            apply(reshape, "reshape", _event(body), 0.0005)
            outcomes["ok"] += 1
        except TransformFailed:
            outcomes["late"] += 1
        # A stray limit would land in this loop of the caller's own code.
        deadline = time.monotonic() + 0.002
        while time.monotonic() < deadline:
            pass
    assert sum(outcomes.values()) == 300


def test_what_a_transform_returns_is_what_the_handler_gets() -> None:
    body = b'{"data": {"n": 7}}'
    shaped = apply(reshape, "reshape", _event(body), 1.0)
    assert json.loads(shaped.body) == {"kind": "test.event", "n": 7, "reshaped": True}
    assert dict(shaped.headers) == {"x-tenant": "acme"}
    assert shaped.meta.content_type == "application/json"
    with pytest.raises(TransformDropped):
        apply(reshape, "reshape", _event(b'{"data": {"n": 1, "drop": true}}'), 1.0)
    # A header the handler sets itself, or one that cannot be sent: refused, named.
    for headers in ({"webhook-signature": "v1,x"}, {"x-a": "line\nbreak"}, {"bad name": "x"}):
        with pytest.raises(TransformFailed) as refused:
            apply(lambda _e, h=headers: Transformed(b"x", h), "t", _event(body), 1.0)
        assert "returned an unsendable" in str(refused.value)
    with pytest.raises(TransformFailed) as wrong:
        apply(lambda _e: {"not": "Transformed"}, "t", _event(body), 1.0)  # type: ignore[arg-type, return-value]
    assert wrong.value.raised == "dict"
    with pytest.raises(TransformTimeLimit):  # a BaseException: no `except Exception` takes it
        raise TransformTimeLimit


def test_transforms_register_like_handlers() -> None:
    registry = load_transforms(MODULES)
    assert {"data_object", "reshape", "explodes", "spins"} <= set(registry.names())
    with pytest.raises(ValueError, match=r"unknown transform 'reshap': did you mean 'reshape'"):
        registry.require("reshap")


# -- a real worker forwarding to a downstream stand-in ------------------------------------------


class Recording:
    """A local downstream answering 200 and keeping every request's body and headers."""

    def __init__(self) -> None:
        self.got: list[tuple[bytes, dict[str, str]]] = []
        server = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                server.got.append((body, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def close(self) -> None:
        self.loopback.close()


@pytest.fixture
def downstream() -> Iterator[Recording]:
    server = Recording()
    yield server
    server.close()


@pytest.mark.slow
@pytest.mark.usefixtures("clean_worker_state")
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_transform_reshapes_the_forward_drops_or_fails_its_delivery(
    sessions: sessionmaker[Session],
    engine: Engine,
    tmp_path: Path,
    downstream: Recording,
    pool: str,
) -> None:
    """Under the threads pool the transform runs in a handler thread; under prefork, a lone
    delivery's runs in the child's main thread: the limit stops the runaway in both."""
    settings = worker_settings(handler_modules=MODULES, transform_time_limit=LIMIT)
    whsec = generate_secret("standard")
    forward = {"url": downstream.url, "allow_private": "true"}
    made = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "forward", "options": {**forward, "secret": whsec}, "transform": "reshape"},
            {"handler": "forward", "options": dict(forward), "transform": "explodes"},
            {"handler": "forward", "options": dict(forward), "transform": "spins"},
        ],
    )
    shaped_route, explodes_route, spins_route = made.route_ids
    _, kept = accept_event(settings, made, body={"data": {"n": 41}, "secret": SECRET_WORDS})
    _, dropped = accept_event(settings, made, body={"data": {"n": 2, "drop": True}})
    kept_ids, dropped_ids = list(kept.delivery_ids), list(dropped.delivery_ids)
    broker = Broker(settings)
    with running_worker(
        "transforms", tmp_path, pool=pool, handler_modules=MODULES, transform_time_limit=LIMIT
    ) as worker:
        for delivery_id in kept_ids + dropped_ids:
            broker.publish(delivery_id)
        done = {i: wait_status(engine, i, ("succeeded", "dead", "filtered")) for i in kept_ids}
        dropped_rows = {i: wait_status(engine, i, ("filtered", "dead")) for i in dropped_ids}
        lines = worker.json_lines()
    broker.close()

    # Each route's delivery by its route (the accept's ids need not follow the routes' order).
    kept_by = {row.route_id: row for row in done.values()}
    dropped_by = {row.route_id: row for row in dropped_rows.values()}
    assert set(kept_by) == set(dropped_by) == set(made.route_ids)

    # The reshaped event reached the downstream: its body is the transform's, signed as sent.
    assert kept_by[shaped_route].status == "succeeded"
    assert len(downstream.got) == 1
    body, headers = downstream.got[0]
    assert json.loads(body) == {"kind": "test.event", "n": 41, "reshaped": True}
    assert headers["x-tenant"] == "acme"
    assert headers["content-type"] == "application/json"
    Webhook(whsec).verify(body, headers)  # raises unless the signature covers this body

    # Raising: dead at once, transform_failed, the exception's class and never its message.
    failed = kept_by[explodes_route]
    assert (failed.status, failed.dead_reason, failed.attempts) == ("dead", "transform_failed", 1)
    assert failed.last_error_class == "KeyError"
    assert SECRET_WORDS not in (failed.last_error or "")
    assert "transform 'explodes' raised KeyError" in failed.last_error
    # A runaway: stopped at its limit, dead the same way.
    runaway = kept_by[spins_route]
    assert (runaway.status, runaway.dead_reason) == ("dead", "transform_failed")
    assert runaway.last_error_class == "TransformTimeLimit"
    with engine.connect() as conn:
        took = conn.execute(
            text(
                "SELECT extract(epoch FROM ended_at - started_at) FROM attempts"
                " WHERE delivery_id = :d"
            ),
            {"d": runaway.id},
        ).scalar_one()
    assert LIMIT <= float(took) < LIMIT + 2.0, took

    # None: every route's delivery of the dropped event ends filtered, its handler not called
    # (the transforms that raise still raise on it).
    shaped_drop = dropped_by[shaped_route]
    assert shaped_drop.status == "filtered"
    assert shaped_drop.last_error == f"route {shaped_route}: transform reshape dropped the event"
    assert [dropped_by[r].status for r in (explodes_route, spins_route)] == ["dead", "dead"]
    assert len(downstream.got) == 1  # only the kept event was ever sent
    events = [(line.get("event"), line.get("transform")) for line in lines]
    assert ("delivery.filtered", "reshape") in events
    assert not any(SECRET_WORDS in json.dumps(line) for line in lines)
    assert delivery(engine, shaped_drop.id).attempts == 1


# -- saving a route: the CLI, the admin API, the console ------------------------------------


@pytest.fixture(scope="module")
def ops() -> Settings:
    return ops_settings(handler_modules=MODULES)


@pytest.fixture(scope="module")
def rcv(ops: Settings) -> Iterator[Receiver]:
    with ops_receiver(
        None, WEBHOOKS_ADMIN_TOKENS=f"tim:{TOKEN}", WEBHOOKS_HANDLER_MODULES=json.dumps(MODULES)
    ) as running:
        yield running


def _routes(engine: Engine, source_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, handler, transform, options FROM routes WHERE source_id = :s"
                    " ORDER BY id"
                ),
                {"s": source_id},
            )
        )


@pytest.mark.slow
def test_an_unknown_transform_is_refused_and_a_route_shows_its_transform_everywhere(
    rcv: Receiver, sessions: sessionmaker[Session], ops: Settings, engine: Engine
) -> None:
    made = make_source(sessions, ops, routes=[{"handler": "log", "filter": "type == 'a'"}])
    remember(made.secret)
    env = {**ops_env(handler_modules=MODULES), "COLUMNS": "200"}
    before = _routes(engine, made.id)

    added = cli(
        "routes", "add", made.public_id, "--handler", "log", "--transform", "reshap", env=env
    )
    assert added.returncode == 1
    assert added.stderr.strip().count("\n") == 0, added.stderr  # one line
    assert "unknown transform 'reshap': did you mean 'reshape'? registered: " in added.stderr
    assert "data_object, explodes, reshape, spins" in added.stderr
    assert added.stderr.rstrip().endswith(f"(see {TOPICS['transforms'].path})"), added.stderr
    route = made.route_ids[0]
    updated = cli("routes", "update", str(route), "--transform", "nope", "--reason", "t", env=env)
    assert updated.returncode == 1
    assert "unknown transform 'nope'" in updated.stderr
    assert _routes(engine, made.id) == before

    good = cli(
        "routes", "add", made.public_id, "--handler", "log", "--transform", "reshape", env=env
    )
    assert good.returncode == 0, good.stderr
    assert "transform: reshape" in good.stdout
    changed = cli(
        "routes", "update", str(route), "--transform", "data_object", "--reason", "t", env=env
    )
    assert changed.returncode == 0, changed.stderr
    assert ": transform data_object" in changed.stdout
    routes = _routes(engine, made.id)
    assert [r.transform for r in routes] == ["data_object", "reshape"]

    shown = cli("routes", "show", str(route), env=env)
    assert "transform: data_object" in shown.stdout
    assert "filter: type == 'a'" in shown.stdout
    listed = json.loads(cli("routes", "list", made.public_id, "--json", env=env).stdout)
    assert [v["transform"] for v in listed] == ["data_object", "reshape"]
    table = cli("routes", "list", made.public_id, env=env).stdout
    assert "transform: reshape" in table

    api = httpx.get(
        f"{rcv.admin_url}/admin/routes/{route}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert api.status_code == 200, api.text
    view = api.json()
    assert (view["route"], view["handler"], view["filter"], view["transform"]) == (
        route,
        "log",
        "type == 'a'",
        "data_object",
    )
    assert view["breaker"]["state"] == "closed"

    cleared = cli("routes", "update", str(route), "--transform", "none", "--reason", "t", env=env)
    assert cleared.returncode == 0, cleared.stderr
    with httpx.Client(timeout=30) as http:
        login = console_login(http, rcv.admin_url, TOKEN)
        assert login.status_code in (302, 303), login.status_code
        page = http.get(f"{rcv.admin_url}/console/routes").text
    assert 'transform: <span class="mono">reshape</span>' in page
    assert '<option value="reshape">reshape</option>' in page
    with engine.connect() as conn:
        audited = conn.execute(
            text(
                "SELECT target->>'before', target->>'after' FROM audit_log"
                " WHERE action = 'route.transform' AND (target->>'route')::bigint = :r ORDER BY id"
            ),
            {"r": route},
        ).all()
    assert [tuple(a) for a in audited] == [(None, "data_object"), ("data_object", None)]


def test_migration_0029_goes_down_and_up_again() -> None:
    """Downgrade drops the column (routes lose their transform); upgrade brings it back, and
    the worker's claim reads it again."""
    with own_database(f"{TEST_DB}_transforms_0029") as (settings, engine, sessions):
        make_source(sessions, settings, routes=[{"handler": "log", "transform": "reshape"}])
        config = alembic_config(settings)
        command.downgrade(config, "0027")
        with engine.connect() as conn:
            columns = conn.execute(
                text(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_name = 'routes' AND column_name = 'transform'"
                )
            ).all()
        assert columns == []
        command.upgrade(config, "head")
        with engine.begin() as conn:
            conn.execute(text("UPDATE routes SET transform = 'reshape'"))
            assert conn.execute(text("SELECT transform FROM routes")).scalars().all() == ["reshape"]

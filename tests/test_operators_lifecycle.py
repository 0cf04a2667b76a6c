"""Routes and sources that can be fixed (issue 10): `routes add` refuses an unknown handler,
`handlers list`, `routes disable|enable|remove`, `sources disable|enable` (410 Gone, nothing
written, what was accepted still runs), every change audited; a worker that lacks a handler an
active route names says so once at start. Real Postgres, the real CLI, receiver and worker.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SecretBox
from core.settings import Settings
from models import catalog, route_catalog
from tests.conftest import count_rows
from tests.factories import MadeSource
from tests.operators_support import (
    OPS,
    accept,
    cli,
    kill,
    ops_env,
    source_with,
    status_of,
    succeed,
)
from tests.processes import receiver
from tests.signing import sign
from tests.workers import Broker, running_worker, wait_status

pytestmark = pytest.mark.timeout(180)


def env(**extra: str) -> dict[str, str]:
    return {**ops_env(), "COLUMNS": "250", **extra}


def run(*args: str) -> Any:
    done = cli(*args, env=env())
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def refused(*args: str) -> str:
    """A refusal: exit 1, one line on stderr, no traceback; returns that line."""
    done = cli(*args, env=env())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def audit_rows(engine: Engine, action_prefix: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT * FROM audit_log WHERE action LIKE :a ORDER BY id"),
                {"a": action_prefix + "%"},
            )
        )


def routes_of(engine: Engine, source: MadeSource) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, handler, active FROM routes WHERE source_id = :s ORDER BY id"),
                {"s": source.id},
            )
        )


def test_routes_add_refuses_an_unknown_handler_listing_the_registered_ones(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    before = routes_of(engine, source)
    line = refused("routes", "add", source.public_id, "--handler", "nosuch")
    assert "unknown handler 'nosuch'" in line
    for name in ("forward", "log", "noop", "stripe_subscription", "effect"):
        assert name in line
    assert "did you mean 'forward'" in refused(
        "routes", "add", source.public_id, "--handler", "Forward"
    )
    assert routes_of(engine, source) == before  # nothing written
    # A handler of a module in WEBHOOKS_HANDLER_MODULES is known.
    added = json.loads(
        run("routes", "add", source.public_id, "--handler", "effect", "--json").stdout
    )
    assert added["handler"] == "effect"

    listed = json.loads(run("handlers", "list", "--json").stdout)
    by_name = {h["name"]: h for h in listed["handlers"]}
    assert by_name["forward"]["origin"] == "built-in"
    assert by_name["effect"]["origin"] == "WEBHOOKS_HANDLER_MODULES"
    assert by_name["log"]["summary"]
    assert added["id"] in by_name["effect"]["active_routes"]
    human = run("handlers", "list").stdout
    assert "stripe_subscription" in human
    assert "built-in" in human
    # Issue 20: docstrings' reStructuredText markers are not printed raw.
    assert by_name["forward"]["summary"].startswith("Built-in forward: POST")
    assert "``" not in human
    assert "Built-in forward: POST" in human


def test_route_disable_enable_remove_are_guarded_and_audited(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log", "noop")
    log_route, noop_route = source.route_ids
    [pending_log, pending_noop] = accept(ops, source)

    assert "--reason is required" in refused("routes", "disable", str(noop_route))
    done = run("routes", "disable", str(noop_route), "--reason", "typo", "--as", "alice")
    assert f"route {noop_route} (noop for * on {source.public_id}) disabled" in done.stdout
    assert "1 of its deliveries are not finished" in done.stdout
    assert "already disabled" in refused("routes", "disable", str(noop_route), "--reason", "again")
    assert "no such route: 999999999" in refused("routes", "disable", "999999999", "--reason", "x")
    # A disabled route gets no delivery for new events; the other route still does.
    [only] = accept(ops, source)
    with sessions() as session:
        assert queries_route_of(session, only) == log_route

    # Removing a route with unfinished or dead deliveries is refused: they stay runnable.
    line = refused("routes", "remove", str(noop_route), "--reason", "typo")
    assert "1 unfinished" in line
    assert "disable it instead" in line
    kill(sessions, [pending_noop])
    assert "1 dead" in refused("routes", "remove", str(noop_route), "--reason", "typo")

    # Enable again, then once it is done, remove it.
    run("routes", "enable", str(noop_route), "--reason", "fixed", "--operator", "bob")
    assert "already enabled" in refused("routes", "enable", str(noop_route), "--reason", "x")
    run("dead", "discard", str(pending_noop), "--reason", "not needed", "--yes")
    succeed(sessions, [pending_log])
    run("routes", "remove", str(noop_route), "--reason", "not needed")
    assert [r.id for r in routes_of(engine, source)] == [log_route]
    assert "no such route" in refused("routes", "remove", str(noop_route), "--reason", "x")
    # Its finished delivery keeps its history, the route shown as removed.
    shown = json.loads(run("deliveries", "show", str(pending_noop), "--json").stdout)
    assert (shown["route_active"], shown["delivery"]["handler"]) == (None, "(route removed)")
    assert "(removed)" in run("deliveries", "show", str(pending_noop)).stdout
    assert "(route removed)" in run("events", "show", f"delivery:{pending_log}").stdout

    mine = [r for r in audit_rows(engine, "route.") if r.target.get("route") == noop_route]
    assert [(r.action, r.operator, r.reason, r.via) for r in mine] == [
        ("route.add", mine[0].operator, "route added", "cli"),  # issue 20: adding is audited
        ("route.disable", "alice", "typo", "cli"),
        ("route.enable", "bob", "fixed", "cli"),
        ("route.remove", mine[3].operator, "not needed", "cli"),
    ]
    assert mine[0].target == {
        "route": noop_route,
        "source": source.public_id,
        "handler": "noop",
        "events": "*",
    }
    listed = json.loads(run("audit", "list", "--action", "route", "--json").stdout)
    assert {a["id"] for a in listed} >= {r.id for r in mine}


def queries_route_of(session: Session, delivery_id: int) -> int:
    return int(
        session.execute(
            text("SELECT route_id FROM deliveries WHERE id = :id"), {"id": delivery_id}
        ).scalar_one()
    )


def test_enabling_a_route_whose_handler_is_not_registered_is_refused(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    box = SecretBox(ops.secret_key.get_secret_value())
    with sessions() as session, session.begin():  # as made before routes were validated
        route, _ = route_catalog.add_route(
            session, box, catalog.get_source(session, source.public_id), handler="gone"
        )
        route_id = route.id
    run("routes", "disable", str(route_id), "--reason", "its handler was uninstalled")
    assert "unknown handler 'gone'" in refused("routes", "enable", str(route_id), "--reason", "try")
    assert not {r.id: r.active for r in routes_of(engine, source)}[route_id]


def _post(url: str, source: MadeSource) -> tuple[str, httpx.Response]:
    event_id = f"evt_{uuid.uuid4().hex}"
    headers, body = sign(source.provider, source.secret, event_id=event_id)
    return event_id, httpx.post(url, content=body, headers=headers, timeout=10)


def test_a_disabled_source_answers_410_writes_nothing_and_its_accepted_work_still_runs(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine, tmp_path: Path
) -> None:
    source = source_with(sessions, ops, "log")
    [pending] = accept(ops, source)
    stranger = source_with(sessions, ops, "log")
    with sessions() as session, session.begin():  # a route naming a handler no one has
        route_catalog.add_route(
            session,
            SecretBox(ops.secret_key.get_secret_value()),
            catalog.get_source(session, stranger.public_id),
            handler="not_deployed",
        )

    done = run("sources", "disable", source.public_id, "--reason", "provider paused")
    assert "410 Gone" in done.stdout
    assert "1 unfinished delivery still run" in done.stdout
    assert "already disabled" in refused("sources", "disable", source.name, "--reason", "again")
    assert "no such source" in refused("sources", "disable", "src_nope", "--reason", "x")
    [shown] = [
        s
        for s in json.loads(run("sources", "list", "--json").stdout)
        if s["id"] == source.public_id
    ]
    assert shown["active"] is False

    cache = {"WEBHOOKS_SOURCE_CACHE_TTL": "PT0S"}  # each request reads the source
    with receiver(
        WEBHOOKS_BROKER_URL=OPS["broker_url"], WEBHOOKS_REDIS_URL=OPS["redis_url"], **cache
    ) as running:
        url = f"{running.url}/webhooks/{source.public_id}"
        before = count_rows(engine, "receipts", "deliveries")
        _, gone = _post(url, source)
        assert (gone.status_code, gone.json()) == (410, {"error": "source disabled"})
        assert count_rows(engine, "receipts", "deliveries") == before  # nothing written

        run("sources", "enable", source.public_id, "--reason", "provider back")
        event_id, back = _post(url, source)
        assert back.status_code == 202, back.text
        accepted = json.loads(
            run("events", "show", event_id, "--source", source.public_id, "--json").stdout
        )
        assert len(accepted["deliveries"]) == 1

    actions = [
        (r.action, r.reason)
        for r in audit_rows(engine, "source.")
        if r.target.get("source") == source.public_id
    ]
    assert actions == [
        ("source.add", "source added"),  # issue 20: creating it is audited too
        ("source.disable", "provider paused"),
        ("source.enable", "provider back"),
    ]

    # Accepted while enabled, delivered although the source was disabled meanwhile; and the
    # worker names, once at its start, the active route whose handler it lacks.
    run("sources", "disable", source.public_id, "--reason", "paused again")
    with running_worker("lifecycle", tmp_path, **OPS) as worker:
        broker = Broker(ops)
        try:
            broker.publish(pending)
        finally:
            broker.close()
        wait_status(engine, pending, "succeeded", timeout=30)
        unknown = [
            line
            for line in worker.json_lines()
            if line.get("event") == "route.unknown_handler"
            and line.get("source") == stranger.public_id
        ]
    assert len(unknown) == 1, worker.output()
    assert unknown[0]["handler"] == "not_deployed"
    assert "routes disable" in unknown[0]["fix"]
    assert status_of(engine, [pending]) == {pending: "succeeded"}

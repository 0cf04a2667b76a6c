"""Issue 36 item 1: the CLI's read commands start fast because they import only what they need.

Each read command runs in a real process against the suite's migrated database, and reports
from inside that process which modules it imported: never SQLAlchemy, Celery, Kombu, the
worker's package or a provider's module (``events show`` reads its event's own provider's
rules: that one module only). The plain-psycopg reads (:mod:`models.reads`) answer as the ORM
queries the admin API and the console use (:mod:`models.queries` and its neighbours), compared
here on one database. No timing is asserted: bench/bench_cli.py measures it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import typer
import typer.main
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import ledger_reads, pg, queries, reads, route_catalog
from models.queries import EventFilter
from tests.conftest import test_env
from tests.factories import MadeSource, accept_event, make_source
from webhooks.cli import COMMANDS, app

# What no read command may import (a prefix of a module's name).
FORBIDDEN = ("sqlalchemy", "celery", "kombu", "alembic", "tasks", "ingest", "models.schema")
# The provider package's own modules; every other core.providers.X is one provider's.
FRAMEWORK = {
    "base",
    "contract",
    "descriptions",
    "parsing",
    "registry",
    "reconcile_options",
    "signatures",
}

_PROBE = """
import json, sys
sys.argv = ["webhooks", *sys.argv[1:]]
from webhooks.cli import main
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _run(*args: str) -> tuple[int, str, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        env=test_env(COLUMNS="200"), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return int(report["code"]), proc.stdout, list(report["modules"])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN)]


def _providers(modules: list[str]) -> set[str]:
    return {
        m.split(".")[2]
        for m in modules
        if m.startswith("core.providers.") and m.split(".")[2] not in FRAMEWORK
    }


def test_the_command_table_is_what_every_module_registers() -> None:
    """The lazy root lists each command where its module's ``register`` puts it, in the order
    Typer listed them when every module was registered at import."""
    eager = typer.Typer()
    # The order webhooks/cli/__init__.py registered them in before it was lazy.
    for module in (
        "db",
        "sources",
        "source_secrets",
        "routes",
        "send",
        "providers",
        "pipeline",
        "operators",
        "retention",
        "reconcile",
        "gaps",
        "drift",
    ):
        __import__(f"webhooks.cli.{module}", fromlist=["register"]).register(eager)
    assert list(typer.main.get_group(eager).commands) == [name for name, _ in COMMANDS]
    assert list(typer.main.get_command(app).commands) == [name for name, _ in COMMANDS]  # type: ignore[attr-defined]


def _dead(settings: Settings, event_id: str) -> int:
    """Makes the event's delivery dead (as a worker's last attempt would); its id."""
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "UPDATE deliveries d SET status = 'dead', dead_reason = 'max_attempts',"
            " last_error_class = 'HTTPError', next_attempt_at = NULL, dead_at = now()"
            " FROM receipts r WHERE r.id = d.receipt_id AND r.expires_at = d.expires_at"
            " AND r.event_id = %s RETURNING d.id",
            (event_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture(scope="module")
def seeded(sessions: sessionmaker[Session], settings: Settings) -> dict[str, Any]:
    """A Stripe source with a route, two events (one's delivery dead) and a GitHub source."""
    stripe = make_source(sessions, settings, provider="stripe")
    make_source(sessions, settings, provider="github", routes=[])
    now = datetime.now(UTC)
    kept, _ = accept_event(settings, stripe, event_type="invoice.paid", now=now)
    dead, _ = accept_event(settings, stripe, event_type="invoice.failed", now=now)
    return {"source": stripe, "kept": kept, "dead": dead, "delivery": _dead(settings, dead)}


def _read_commands(seeded: dict[str, Any]) -> list[list[str]]:
    source: MadeSource = seeded["source"]
    return [
        ["events", "list"],
        ["events", "list", "--status", "dead", "--source", source.public_id, "--json"],
        ["events", "show", seeded["dead"], "--source", source.public_id],
        ["deliveries", "show", str(seeded["delivery"])],
        ["dead", "list"],
        ["sources", "list", "--wide"],
        ["routes", "list"],
        ["routes", "list", source.public_id, "--json"],
        ["gaps"],
        ["gaps", "--since", "2h", "--json"],
        ["drift", "list"],
        ["drift", "list", "--source", source.public_id, "--json"],
    ]


def test_read_commands_import_neither_the_orm_nor_celery_nor_the_providers(
    seeded: dict[str, Any],
) -> None:
    for args in _read_commands(seeded):
        code, out, modules = _run(*args)
        assert code == 0, (args, out)
        assert _heavy(modules) == [], args
        # events show judges the event's type by its own provider's rules: Stripe's module.
        expected = {"stripe"} if args[:2] == ["events", "show"] else set()
        assert _providers(modules) == expected, args
    # What they print is read: the dead letter, its delivery, both sources.
    assert seeded["dead"] in _run("events", "list")[1]
    assert "max_attempts" in _run("dead", "list")[1]
    assert str(seeded["delivery"]) in _run("deliveries", "show", str(seeded["delivery"]))[1]


def test_a_read_commands_errors_import_no_orm_either() -> None:
    """Not found, a bad id and an unknown source: one error line, exit 1, still light."""
    for args, line in (
        (["events", "show", "receipt:999999999"], "no such event"),
        (["deliveries", "show", "nope"], "not a delivery id"),
        (["routes", "list", "no-such-source"], "no such source"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, *args],
            env=test_env(COLUMNS="200"), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        report = json.loads(proc.stderr.strip().splitlines()[-1])
        assert report["code"] == 1, args
        assert line in proc.stderr, (args, proc.stderr)
        assert _heavy(report["modules"]) == [], args


def test_plain_reads_use_the_orm_reads_constants() -> None:
    from models import catalog, event_walk

    assert reads.KEY_SAMPLE == catalog.KEY_SAMPLE
    assert reads.RARE_STATUS_ROWS == event_walk.RARE_STATUS_ROWS
    assert (reads.WALK_FIRST_BATCH, reads.WALK_GROWTH) == (
        event_walk.WALK_FIRST_BATCH,
        event_walk.WALK_GROWTH,
    )


def test_plain_reads_answer_as_the_orm_queries(
    seeded: dict[str, Any], sessions: sessionmaker[Session], settings: Settings
) -> None:
    source: MadeSource = seeded["source"]
    since = datetime.now(UTC) - timedelta(hours=1)
    filters = [
        EventFilter(),
        EventFilter(source=source.public_id),
        EventFilter(source=source.name, event_type="invoice.*", since=since, limit=1),
        EventFilter(status="dead"),  # every key probed
        EventFilter(status="dead", source=source.public_id),  # the dead-letter walk
        EventFilter(status="pending", source=source.public_id),
    ]
    with pg.connect(settings) as conn, sessions() as session:
        for flt in filters:
            assert reads.list_events(conn, flt) == queries.list_events(session, flt), flt
        for ref, ref_source in (
            (seeded["dead"], source.public_id),
            (f"event:{seeded['kept']}", None),
            (f"delivery:{seeded['delivery']}", None),
            ("receipt:999999999", None),
            ("evt_nowhere", source.public_id),
        ):
            try:
                orm: Any = ledger_reads.get_event(session, ref, source=ref_source)
            except queries.NotFoundError as exc:
                with pytest.raises(queries.NotFoundError, match=str(exc)):
                    reads.get_event_or_ledger(conn, ref, source=ref_source)
                continue
            assert reads.get_event_or_ledger(conn, ref, source=ref_source) == orm, ref
        delivery = str(seeded["delivery"])
        assert reads.get_delivery(conn, delivery) == queries.get_delivery(session, delivery)
        assert reads.dead_letters(conn) == queries.dead_letters(session)
        routes = route_catalog.list_all_routes(session)
        plain = reads.list_all_routes(conn)
        assert [(r.source_public_id, r.id, r.options) for r in plain] == [
            (s.public_id, r.id, r.options) for s, r in routes
        ]

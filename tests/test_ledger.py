"""The processed-events ledger (issue 35 item 2): one compact row per receipt whose work ended,
written by the statement that ends it, kept by month for ``WEBHOOKS_LEDGER_RETENTION``, read by
``webhooks events show`` and the console once the receipt has expired, and never a dedup key.

The worker's own path runs in this process on the suite's database (the pipeline's ``run``,
its statements counted). Everything that moves time runs on a database of this module's own
(maintenance drops every day and month its pinned clock has passed), at pinned instants
in 2023-2024, in the style of tests/test_retention.py.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import ledger, ledger_layout, ledger_reads, requeue, route_ends, transitions
from models.db import alembic_config
from models.retention import run_maintenance
from models.retention_layout import ensure_partitions
from tasks.pipeline import run
from tasks.runtime import Runtime, build_runtime
from tests.conftest import BIN, TEST_DB
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, accept_event, make_source
from tests.leakcheck import remember
from tests.operators_support import console_login
from tests.processes import receiver
from tests.retention_support import TTL, accept, claim, kill, own_database
from tests.workers import wait_for, worker_settings

LEDGER_DB = f"{TEST_DB}_ledger"
T = datetime(2023, 1, 15, 12, tzinfo=UTC)  # a receipt's arrival, laid out by each test
SEC = timedelta(seconds=1)
DAY = timedelta(days=1)
CONSOLE_TOKEN = "adm_ledger_" + secrets.token_urlsafe(24)
remember(CONSOLE_TOKEN)


@pytest.fixture(scope="module")
def own() -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    with own_database(LEDGER_DB) as made:
        yield made


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    made = build_runtime(worker_settings(), worker="ledger-test")
    yield made
    made.close()


def _no_publish(delivery_id: int, countdown: float) -> None:
    raise AssertionError("nothing here retries")


@dataclass(frozen=True)
class Kept:
    """One receipt as the ledger keeps it: its rows merged (models.ledger_reads.merged)."""

    event_id: str
    received_at: datetime
    outcomes: dict[str, str]  # {"<route id>": "s[:ref]" | "d[:reason]" | "x"}
    digest: bytes | None
    via: str
    part: str
    rows: int


def ledger_of(engine: Engine, source: MadeSource) -> list[Kept]:
    """The source's receipts in the ledger, oldest first, with the partition they are in."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT l.event_id, l.received_at, l.outcomes, l.digest, k.via,"
                " l.tableoid::regclass::text AS part FROM ledger l"
                " JOIN ledger_kinds k ON k.id = l.kind WHERE k.source_id = :s"
                " ORDER BY l.received_at"
            ),
            {"s": source.id},
        ).all()
    receipts: dict[tuple[str, datetime], list[Any]] = {}
    for r in found:
        receipts.setdefault((r.event_id, r.received_at), []).append(r)
    kept = []
    for (event_id, received_at), rows in receipts.items():
        final = ledger_reads.merged([r.outcomes for r in rows])
        kept.append(
            Kept(
                event_id,
                received_at,
                {
                    str(e.route_id): e.code + ("" if e.detail is None else f":{e.detail}")
                    for e in final.values()
                },
                rows[0].digest,
                rows[0].via,
                rows[0].part,
                len(rows),
            )
        )
    return kept


def succeed_with(
    sessions: sessionmaker[Session], delivery_id: int, at: datetime, ref: str | None = None
) -> None:
    found = claim(sessions, delivery_id, at)
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=at, result_ref=ref)


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=subprocess_env(WEBHOOKS_DATABASE_URL=settings.psycopg_dsn),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# ------------------------------------------------------------------------------------------
# Written by the statement that ends the work
# ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("clean_worker_state")
@pytest.mark.parametrize("n", [1, 3], ids=["one-id", "three-ids"])
def test_the_workers_success_writes_the_ledger_row_in_its_own_statement(
    sessions: sessionmaker[Session],
    engine: Engine,
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    """The worker's message, as the task runs it: still its probe, its claim and its success
    (three statements, no more), and each event's ledger row with its result reference is
    there once the success is."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "result_ref"}])
    warm = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    assert [r.outcome for r in run(runtime, warm, publish_retry=_no_publish, alone=n == 1)] == [
        "succeeded"
    ] * n
    events = [accept_event(settings, source) for _ in range(n)]
    ids = [outcome.delivery_ids[0] for _, outcome in events]
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def counted(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query))
        return execute(cur, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted)
    reports = run(runtime, ids, publish_retry=_no_publish, alone=n == 1)
    monkeypatch.undo()
    assert [r.outcome for r in reports] == ["succeeded"] * n
    assert len(sent) == 3, sent
    assert "INSERT INTO ledger" in sent[-1]
    (route_id,) = source.route_ids
    rows = {r.event_id: r for r in ledger_of(engine, source)}
    for event_id, _ in events:
        assert rows[event_id].outcomes == {str(route_id): f"s:ref-{event_id}"}
        assert len(rows[event_id].digest) == 8
        assert rows[event_id].via == "w"


def test_a_success_whose_ledger_row_fails_is_not_recorded(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Atomic: on the worker's autocommit connection, a ledger write that fails fails the
    success with it (the delivery stays processing, its attempt open), and the same
    success goes through once the ledger takes rows again."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    (delivery_id,) = accept_event(settings, source)[1].delivery_ids
    found = claim(sessions, delivery_id, datetime.now(UTC))
    refuse = f"""
        CREATE FUNCTION ledger_refuse_{source.id}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.kind IN (SELECT id FROM ledger_kinds WHERE source_id = {source.id}) THEN
                RAISE EXCEPTION 'ledger refused';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER ledger_refuse_{source.id} BEFORE INSERT ON ledger FOR EACH ROW
            EXECUTE FUNCTION ledger_refuse_{source.id}();
    """
    with engine.begin() as conn:
        conn.execute(text(refuse))
    try:
        with (
            psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw,
            pytest.raises(psycopg.errors.RaiseException, match="ledger refused"),
        ):
            transitions.succeed(raw, found, now=datetime.now(UTC))
        with engine.connect() as conn:
            status, open_attempts = conn.execute(
                text(
                    "SELECT d.status, (SELECT count(*) FROM attempts a WHERE a.delivery_id = d.id"
                    " AND a.ended_at IS NULL) FROM deliveries d WHERE d.id = :id"
                ),
                {"id": delivery_id},
            ).one()
        assert (status, open_attempts) == ("processing", 1)
        assert ledger_of(engine, source) == []
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER ledger_refuse_{source.id} ON ledger"))
            conn.execute(text(f"DROP FUNCTION ledger_refuse_{source.id}()"))
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        transitions.succeed(raw, found, now=datetime.now(UTC))
    assert [r.outcomes for r in ledger_of(engine, source)] == [{str(source.route_ids[0]): "s"}]


def test_a_dead_letter_is_an_outcome_a_replay_that_succeeds_overwrites_and_each_route_merges(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Two routes: one dead (its reason kept), one succeeded, in one row; the dead one
    replayed and succeeded turns to ``s``; a discarded dead letter is ``x``; the sweep's
    ``expired`` ending is a dead letter too."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "log"}, {"handler": "log"}])
    first, second = source.route_ids
    now = datetime.now(UTC)
    event_id, outcome = accept_event(settings, source)
    dead, done = outcome.delivery_ids
    kill(sessions, dead, now)
    assert [r.outcomes for r in ledger_of(engine, source)] == [{str(first): "d:permanent"}]
    succeed_with(sessions, done, now + SEC, "order-1")
    assert [r.outcomes for r in ledger_of(engine, source)] == [
        {str(first): "d:permanent", str(second): "s:order-1"}
    ]
    with sessions() as session, session.begin():
        assert requeue.replay(session, dead, now=now + 2 * SEC, publish_grace=SEC)
    succeed_with(sessions, dead, now + 3 * SEC)
    (row,) = ledger_of(engine, source)
    assert (row.event_id, row.outcomes) == (event_id, {str(first): "s", str(second): "s:order-1"})
    assert row.rows == 3  # appended by each ending, never updated: the replay's attempt wins

    other = make_source(sessions, settings)
    (to_discard,) = accept_event(settings, other)[1].delivery_ids
    kill(sessions, to_discard, now)
    with sessions() as session, session.begin():
        assert requeue.discard(session, [to_discard], now=now + SEC) == [to_discard]
    assert [r.outcomes for r in ledger_of(engine, other)] == [{str(other.route_ids[0]): "x"}]

    held = make_source(sessions, settings)
    (waiting,) = accept_event(settings, held)[1].delivery_ids
    with sessions() as session, session.begin():
        session.execute(
            text("UPDATE routes SET breaker_state = 'open', breaker_opened_at = :at WHERE id = :r"),
            {"at": now - timedelta(days=9), "r": held.route_ids[0]},
        )
        session.execute(
            text("UPDATE deliveries SET created_at = :at WHERE id = :d"),
            {"at": now - timedelta(days=9), "d": waiting},
        )
        expired = route_ends.expire_held(session, now=now, max_age=timedelta(days=3), limit=10)
    assert [e.delivery_id for e in expired] == [waiting]
    assert [r.outcomes for r in ledger_of(engine, held)] == [{str(held.route_ids[0]): "d:expired"}]

    # A crash loop's dead letter, decided inside the claim: the worker's one more statement.
    looped = make_source(sessions, settings)
    (crashing,) = accept_event(settings, looped)[1].delivery_ids
    claim(sessions, crashing, now)
    with sessions() as session, session.begin():
        verdict = transitions.claim(
            session, crashing, now=now + timedelta(hours=1), lease=SEC, max_redeliveries=1,
            worker="test",
        )  # fmt: skip
        assert verdict is not None
        assert verdict.crashed_too_often
        assert ledger.record(session, [crashing]) == 1
    assert [r.outcomes for r in ledger_of(engine, looped)] == [
        {str(looped.route_ids[0]): "d:crashed"}
    ]


def test_two_endings_that_meet_a_new_kind_at_once_both_append_their_rows(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """The first ending of a source's event type adds its kind (ledger_kinds). Two endings in
    two transactions that both meet it new: the second waits on the first's insert, and once
    that commits it still names the kind (the kind's ``DO UPDATE``), where a plain ``DO
    NOTHING`` would have left its row without a kind, and its success would have failed."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    now = datetime.now(UTC)
    first, second = (
        claim(sessions, accept_event(settings, source)[1].delivery_ids[0], now) for _ in range(2)
    )
    with (
        psycopg.connect(settings.psycopg_dsn) as holding,
        psycopg.connect(settings.psycopg_dsn, autocommit=True) as racing,
    ):
        transitions.succeed(holding, first, now=now + SEC)  # its kind inserted, not committed
        ended: list[set[int]] = []
        worker = threading.Thread(
            target=lambda: ended.append(transitions.succeed_many(racing, [(second, now + SEC)]))
        )
        worker.start()
        waiting = "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = %s"
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as watch:
            wait_for(
                lambda: watch.execute(waiting, (racing.info.backend_pid,)).fetchone() == (1,),
                timeout=30,
                what="the second ending to wait on the first's kind",
            )
        holding.commit()
        worker.join(30)
    assert ended == [{second.id}]
    kept = ledger_of(engine, source)
    assert sorted(k.outcomes[str(source.route_ids[0])] for k in kept) == ["s", "s"]
    with engine.connect() as conn:
        kinds = conn.execute(
            text("SELECT count(*) FROM ledger_kinds WHERE source_id = :s"), {"s": source.id}
        ).scalar_one()
    assert kinds == 1


def test_the_compact_layout_keeps_what_the_first_layout_held() -> None:
    """Migration 0026 converts 0023's rows (one per receipt, outcomes as jsonb) into the
    compact layout, in partitions of the same names, and its downgrade converts them back."""
    name = f"{TEST_DB}_ledger_0026"
    with own_database(name) as (settings, engine, _):
        config = alembic_config(settings)
        command.downgrade(config, "0025")
        old_rows = [
            (T, 7, "evt_a", "invoice.paid", b"\x01" * 8, {"3": "s:inv_1", "4": "d:permanent"}),
            (T + SEC, 7, "evt_b", "invoice.paid", None, {"3": "x"}),
            (T + 40 * DAY, 8, "evt_a", "charge.refunded", b"\x02" * 8, {"5": "s"}),
        ]
        ledger_layout.ensure_months(engine, T + 40 * DAY, ledger_layout.LedgerMaintenance())
        with engine.begin() as conn:
            months = partitions_of(conn)
            for at, source_id, event_id, event_type, digest, outcomes in old_rows:
                conn.execute(
                    text(
                        "INSERT INTO ledger (received_at, source_id, event_id, event_type,"
                        " digest, outcomes, via) VALUES (:at, :s, :e, :t, :d, :o, :v)"
                    ),
                    {"at": at, "s": source_id, "e": event_id, "t": event_type, "d": digest,
                     "o": json.dumps(outcomes), "v": "r" if digest is None else "w"},
                )  # fmt: skip
        command.upgrade(config, "0026")
        with engine.connect() as conn:
            assert partitions_of(conn) == months
            converted = conn.execute(
                text(
                    "SELECT l.received_at, k.source_id, l.event_id, k.event_type, l.digest,"
                    " l.outcomes, k.via FROM ledger l JOIN ledger_kinds k ON k.id = l.kind"
                    " ORDER BY l.received_at"
                )
            ).all()
        assert [
            (r[0], r[1], r[2], r[3], r[4] and bytes(r[4]), {
                str(e.route_id): e.code + (f":{e.detail}" if e.detail else "")
                for e in ledger_reads.merged([r[5]]).values()
            }, r[6])
            for r in converted
        ] == [(*row, "r" if row[4] is None else "w") for row in old_rows]  # fmt: skip
        command.downgrade(config, "0025")
        with engine.connect() as conn:
            back = conn.execute(
                text(
                    "SELECT received_at, source_id, event_id, event_type, digest, outcomes"
                    " FROM ledger ORDER BY received_at"
                )
            ).all()
            assert partitions_of(conn) == months
        assert [(*r[:4], r[4] and bytes(r[4]), r[5]) for r in back] == old_rows


def partitions_of(conn: Any) -> list[tuple[str, str]]:
    """The ledger's leaves and their bounds."""
    return [
        (str(r[0]), str(r[1]))
        for r in conn.execute(
            text(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
                " JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = 'ledger'::regclass ORDER BY c.relname"
            )
        ).all()
    ]


# ------------------------------------------------------------------------------------------
# Kept by month, past the receipt; never a dedup key
# ------------------------------------------------------------------------------------------


def test_maintenance_drops_a_month_once_it_is_past_the_ledger_retention(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """Months around now laid out; January 2023 kept through February 2024 (13 whole months
    after it ended) and dropped on 1 March 2024, by partition; a row of a month never laid
    out (in the default partition) deleted by the same cutoff."""
    settings, engine, sessions = own
    assert settings.ledger_retention == 13
    report = run_maintenance(engine, settings, T)
    assert {"ledger_p202212", "ledger_p202301", "ledger_p202302", "ledger_p202303"} <= set(
        report.ledger_months_created
    )
    source = make_source(sessions, settings)
    remember(source.secret)
    _, outcome = accept_event(settings, source, event_id="evt_jan", now=T, ttl=TTL)
    succeed_with(sessions, outcome.delivery_ids[0], T + SEC)
    stray = T - timedelta(days=200)  # June 2022: no month of its own, the default holds it
    ensure_partitions(engine, settings, stray)  # its receipt's days (not the ledger's months)
    _, outcome = accept_event(settings, source, event_id="evt_stray", now=stray, ttl=TTL)
    succeed_with(sessions, outcome.delivery_ids[0], stray + SEC)
    assert [(r.event_id, r.part) for r in ledger_of(engine, source)] == [
        ("evt_stray", "ledger_default"),
        ("evt_jan", "ledger_p202301"),
    ]

    last_day_kept = datetime(2024, 3, 1, tzinfo=UTC) - SEC
    kept = ledger_layout.maintain(engine, settings, last_day_kept)
    assert "ledger_p202301" not in kept.dropped
    assert [r.event_id for r in ledger_of(engine, source)] == ["evt_jan"]  # the stray: gone
    assert kept.default_rows_deleted == 1

    dropped = run_maintenance(engine, settings, last_day_kept + SEC)
    assert "ledger_p202301" in dropped.ledger_months_dropped
    assert "ledger_p202302" not in dropped.ledger_months_dropped
    assert ledger_of(engine, source) == []
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('ledger_p202301')")).scalar_one() is None


def test_an_expired_event_is_shown_from_the_ledger_and_its_redelivery_is_new_work(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """After maintenance passed the receipt's dedup TTL (the pinned clock): `events show`
    (text and --json) and the console find the event in the ledger and say so; the same
    event sent again is accepted as new work, with a ledger row of its own once it ends."""
    settings, engine, sessions = own
    source = make_source(sessions, settings, routes=[{"handler": "log"}])
    remember(source.secret)
    (route_id,) = source.route_ids
    event_id = f"evt_{secrets.token_hex(6)}"
    arrived = T + timedelta(days=40)  # late February 2023
    run_maintenance(engine, settings, arrived)  # its days and months laid out
    status, ids = accept(settings, source, event_id, arrived)
    assert status == "accepted"
    succeed_with(sessions, ids[0], arrived + SEC, "inv_77")
    assert accept(settings, source, event_id, arrived + TTL - SEC)[0] == "duplicate"

    after_ttl = arrived + TTL + timedelta(days=2)
    run_maintenance(engine, settings, after_ttl)
    with engine.connect() as conn:
        assert (
            conn.execute(
                text("SELECT count(*) FROM receipts WHERE source_id = :s"), {"s": source.id}
            ).scalar_one()
            == 0
        )

    shown = cli(settings, "events", "show", event_id)
    assert shown.returncode == 0, shown.stderr
    assert "receipt expired; from the ledger" in shown.stdout
    assert re.search(rf"route {route_id} log: succeeded \(result inv_77\)", shown.stdout)
    as_json = cli(settings, "events", "show", f"event:{event_id}", "--json")
    assert as_json.returncode == 0, as_json.stderr
    found = json.loads(as_json.stdout)
    assert (found["found_in"], found["source"], len(found["runs"])) == (
        "ledger",
        source.public_id,
        1,
    )
    assert found["runs"][0]["outcomes"] == [
        {
            "route_id": route_id,
            "handler": "log",
            "status": "succeeded",
            "result_ref": "inv_77",
            "dead_reason": None,
        }
    ]
    missing = cli(settings, "events", "show", "evt_never_seen")
    assert missing.returncode != 0
    assert "no such event" in missing.stdout + missing.stderr

    with (
        receiver(
            WEBHOOKS_DATABASE_URL=settings.psycopg_dsn,
            WEBHOOKS_ADMIN_TOKENS=f"lee:{CONSOLE_TOKEN}",
        ) as api,
        httpx.Client(timeout=30) as http,
    ):
        assert console_login(http, api.admin_url, CONSOLE_TOKEN).status_code == 303
        page = http.get(f"{api.admin_url}/console/events", params={"q": event_id},
                        follow_redirects=True)  # fmt: skip
        assert page.status_code == 200
        assert page.url.path == "/console/ledger"
        assert "receipt expired; from the ledger" in page.text
        assert "inv_77" in page.text

    # Never a dedup key: the ledger row is there, and the event is new work all the same.
    again = after_ttl + timedelta(hours=1)
    status, fresh = accept(settings, source, event_id, again)
    assert status == "accepted"
    assert fresh != ids
    succeed_with(sessions, fresh[0], again + SEC)
    assert [r.received_at for r in ledger_of(engine, source)] == [arrived, again]

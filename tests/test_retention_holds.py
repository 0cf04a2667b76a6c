"""Retention holds (issue 9): expiry never removes unfinished work or dead letters.

In-process tests inject the clock (an explicit ``now``, standing for the database's) and
work in March-April 2025, days no other test writes to. The black-box test runs
``webhooks maintenance run`` as a subprocess under libfaketime with its process clock ten
days ahead; expiry is decided on the database's clock, so only finished work may go.
"""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import libfaketime  # type: ignore[import-untyped]
import psycopg
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import partitions, queries, requeue, retention_holds, transitions
from models.partitions import leaf_suffix
from models.retention import run_maintenance
from models.retention_holds import hold_end
from models.retention_layout import ensure_partitions
from tests.conftest import BIN, run_each
from tests.factories import MadeSource, make_source
from tests.retention_fixtures import (  # noqa: F401 (fixtures: this module's own database)
    retention_engine,
    retention_sessions,
    retention_settings,
)
from tests.retention_support import (
    DAY,
    LEASE,
    SEC,
    TTL,
    accept,
    claim,
    env_for,
    kill,
    new_source,
    retry_later,
    rows_of,
    succeed,
)

T0 = datetime(2025, 3, 1, 9, tzinfo=UTC)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def count_deliveries(engine: Engine, source: MadeSource) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM deliveries WHERE source_id = :s"), {"s": source.id}
            ).scalar_one()
        )


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Recorder:
    """Stands in for the retention module's logger: keeps (event, fields) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.lines if event == name]


def database_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    return now


def run_cli(
    settings: Settings, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=env or env_for(settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def json_logs(stderr: str) -> list[dict[str, Any]]:
    lines = []
    for line in stderr.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


# ------------------------------------------------------------------------------------------
# Unfinished work is held, stays deduplicated and is delivered
# ------------------------------------------------------------------------------------------


def test_retrying_delivery_is_held_deduplicated_and_delivered_ten_days_later(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """Accepted on day 0 with a 4-day TTL, still retrying on day 10 (the downstream was down):
    maintenance holds it once, to the day its retry is due, a re-sent copy is a duplicate after the original expiry, and
    on day 10 the worker's own claim finds it with its payload and delivers it. A succeeded
    sibling event received with it is expired on schedule."""
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    status, (retried,) = accept(settings, source, "evt_retry", T0)
    assert status == "accepted"
    status, (done,) = accept(settings, source, "evt_done", T0)
    assert status == "accepted"
    succeed(sessions, done, T0 + SEC)
    due = T0 + 10 * DAY
    retry_later(sessions, retried, T0 + SEC, due)

    held_days = []
    for day in range(1, 11):
        now = T0 + day * DAY
        report = run_maintenance(engine, settings, now)
        rows = rows_of(engine, source)
        row = rows["evt_retry"]
        # Deduplicated every day: within its TTL, and from the run that saw it expire on.
        assert row.expires_at > now, day
        assert (row.has_payload, row.statuses, row.attempts) == (True, ("retrying",), 1), day
        if report.held_receipts:
            held_days.append(day)
            # Moved once, to the end of the day its retry is due (not one day at a time).
            assert row.expires_at == partitions.day_bounds(due.date())[1] - timedelta.resolution
        # The succeeded event goes once its day is past, and only then.
        assert ("evt_done" in rows) == (day <= 4), day
        if day == 6:  # two days past the original expiry: a re-sent copy is a duplicate
            assert accept(settings, source, "evt_retry", now + timedelta(hours=1))[0] == (
                "duplicate"
            )
    assert held_days == [4]  # the first run at or after its original expiry, and only then

    # Day 10, the retry is due: the worker's claim (probe, then the leaf statement) finds the
    # delivery and its event's payload where the holds moved them.
    now = due + timedelta(minutes=1)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        probe = raw.execute(
            "SELECT generation, expires_at FROM deliveries WHERE id = %s", (retried,)
        ).fetchone()
        assert probe is not None
        generation, expires_at = probe
        claimed = transitions.claim_with_event(
            raw,
            retried,
            generation=generation,
            expires_at=expires_at,
            now=now,
            lease=LEASE,
            max_redeliveries=3,
            worker="test",
            leaf=leaf_suffix(expires_at, "partition"),
        )
    assert claimed is not None
    found, event = claimed
    assert event.receipt_found
    assert event.payload is not None
    assert json.loads(bytes(event.payload))["id"] == "evt_retry"
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=now + SEC)

    # Finished: expired at the end of its last hold, like any finished event.
    run_maintenance(engine, settings, now + 3 * DAY)
    assert rows_of(engine, source) == {}
    assert count_deliveries(engine, source) == 0


def test_pending_delivery_and_its_succeeded_sibling_are_held_together(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    source = new_source(
        sessions,
        settings,
        made,
        routes=[{"handler": "log"}, {"handler": "log"}],
    )
    ensure_partitions(engine, settings, T0)
    status, (first, second) = accept(settings, source, "evt_split", T0)
    assert status == "accepted"
    succeed(sessions, first, T0 + SEC)
    now = T0 + TTL + DAY
    report = run_maintenance(engine, settings, now)
    row = rows_of(engine, source)["evt_split"]
    assert row.statuses == ("succeeded", "pending")
    assert row.attempts == 1
    assert row.has_payload
    assert row.expires_at == hold_end(now)
    assert report.rows_moved == {"receipts": 1, "deliveries": 2, "attempts": 1}
    # The pending one is still claimable by id (the sweeper's path).
    claim(sessions, second, now + SEC)


# ------------------------------------------------------------------------------------------
# Dead letters: kept for their retention, then expired, logged and counted
# ------------------------------------------------------------------------------------------


def test_dead_letter_is_kept_for_its_retention_then_expired_logged_and_counted(
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    made: list[MadeSource],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings.dead_letter_retention == timedelta(days=30)  # the default
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    (dead,) = accept(settings, source, "evt_dead", T0)[1]
    (replayed,) = accept(settings, source, "evt_replayed", T0)[1]
    died = T0 + timedelta(hours=1)  # day 1
    kill(sessions, dead, died)
    kill(sessions, replayed, died)
    recorder = Recorder()
    monkeypatch.setattr(retention_holds, "log", recorder)  # where the expiry is logged
    before = sample("webhooks_dead_letters_discarded_total", via="retention")

    # A run on each day something changes for these two (a run on another day only drops and
    # lays out days that hold neither): day 3, before they expire; day 4, they expire (at the
    # run's instant) and move to the end of their retention; day 5, the day they expired
    # from is past and dropped; day 10, they are listed.
    for day in (3, 4, 5, 10):
        run_maintenance(engine, settings, T0 + day * DAY)
    # Day 10: both listed as dead letters, with their receipts and payloads.
    with sessions() as session:
        groups = queries.dead_letters(session, source=source.public_id)
    assert sum(g.count for g in groups) == 2
    assert {i for g in groups for i in g.sample_ids} == {dead, replayed}
    assert all(r.has_payload for r in rows_of(engine, source).values())
    # One is replayed on day 10 and keeps its downstream key (generation 0).
    day10 = T0 + 10 * DAY
    with sessions() as session, session.begin():
        assert requeue.replay(session, replayed, now=day10, publish_grace=SEC)
    again = claim(sessions, replayed, day10 + SEC)
    assert again.generation == 0
    with sessions() as session, session.begin():
        transitions.succeed(session, again, now=day10 + 2 * SEC)

    # Day 11, the first run after the replay; day 20, midway; day 29, the eve of the day it
    # moved to; day 30, that day (today for the run), an hour before its retention ends.
    for day in (11, 20, 29, 30):
        run_maintenance(engine, settings, T0 + day * DAY)
        assert "evt_dead" in rows_of(engine, source), day  # within its retention
    assert recorder.events("dead_letters_expired") == []
    assert sample("webhooks_dead_letters_discarded_total", via="retention") == before
    # Its retention ends on day 31 at 10:00; its (moved) day is past on day 32.
    assert rows_of(engine, source)["evt_dead"].expires_at == died + timedelta(days=30)
    report = run_maintenance(engine, settings, T0 + 31 * DAY)
    assert report.dead_letters_expired == 1
    assert rows_of(engine, source) == {}
    assert count_deliveries(engine, source) == 0
    with sessions() as session:
        assert queries.dead_letters(session, source=source.public_id) == []
    # Logged with its count only, and counted.
    (line,) = recorder.events("dead_letters_expired")
    assert line == {"count": 1}
    assert sample("webhooks_dead_letters_discarded_total", via="retention") == before + 1


# ------------------------------------------------------------------------------------------
# A live lease (partition mode): tests/test_retention_moves.py
# ------------------------------------------------------------------------------------------


def test_delete_mode_live_lease_is_neither_moved_nor_deleted(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """The hold step leaves a leased receipt where it is; the batches' own predicates then
    refuse its delivery, attempts and receipt although they are expired."""
    settings, engine, sessions = delete_mode
    source = make_source(sessions, settings)
    (leased,) = accept(settings, source, "evt_leased", T0)[1]
    (done,) = accept(settings, source, "evt_done", T0)[1]
    succeed(sessions, done, T0 + SEC)
    now = T0 + TTL + timedelta(hours=1)
    running = claim(sessions, leased, now - timedelta(minutes=1))

    report = run_maintenance(engine, settings, now)

    assert report.postponed == [f"receipt {rows_receipt_id(engine, 'evt_leased', source)}"]
    assert report.held_receipts == 0
    assert report.rows_deleted == {"deliveries": 1, "attempts": 1, "receipts": 1, "conflicts": 0}
    row = rows_of(engine, source)["evt_leased"]
    assert (row.expires_at, row.statuses, row.attempts) == (T0 + TTL, ("processing",), 1)
    assert "evt_done" not in rows_of(engine, source)
    # The worker finishes (its statement names expires_at: the row did not move); then the
    # event is finished work and goes.
    with sessions() as session, session.begin():
        transitions.succeed(session, running, now=now + SEC)
    report = run_maintenance(engine, settings, now + timedelta(minutes=10))
    assert report.rows_deleted["deliveries"] == 1
    assert rows_of(engine, source) == {}


def rows_receipt_id(engine: Engine, event_id: str, source: MadeSource) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT id FROM receipts WHERE source_id = :s AND event_id = :e"),
                {"s": source.id, "e": event_id},
            ).scalar_one()
        )


# ------------------------------------------------------------------------------------------
# Operator discard (CLI, audited)
# ------------------------------------------------------------------------------------------


def test_dead_discard_cli_previews_then_discards_with_an_audit_row(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    source = new_source(sessions, settings, made)
    other = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, None)
    dead = [accept(settings, source, f"evt_d{n}", None)[1][0] for n in range(3)]
    (pending,) = accept(settings, source, "evt_pending", None)[1]
    (elsewhere,) = accept(settings, other, "evt_other", None)[1]
    now = database_now(engine)
    for delivery in [*dead, elsewhere]:
        kill(sessions, delivery, now)

    # The calls that change nothing run two at a time (tests/conftest.py's run_each).
    by_source = ("--source", source.public_id)
    listed, preview, reversed_range, narrowed, elsewhere_type, refused, no_reason = run_each(
        partial(run_cli, settings, "dead", *args)
        for args in [
            ("list", *by_source, "--json"),
            ("discard", *by_source, "--dry-run", "--json"),
            ("discard", *by_source, "--type", "test.*", "--since", "1h", "--until",
             "2000-01-01", "--dry-run", "--json"),
            ("discard", *by_source, "--type", "test.*", "--since", "1h", "--dry-run", "--json"),
            ("discard", *by_source, "--type", "other.*", "--since", "1h", "--dry-run"),
            ("discard", str(pending), "--reason", "x", "--yes"),
            ("discard", *by_source, "--yes"),
        ]
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert sum(g["count"] for g in json.loads(listed.stdout)) == 3
    assert preview.returncode == 0, preview.stderr
    assert json.loads(preview.stdout)["preview"]["count"] == 3
    assert reversed_range.returncode == 1  # --since after --until: refused, nothing read
    assert json.loads(narrowed.stdout)["preview"]["count"] == 3
    assert elsewhere_type.returncode == 0, elsewhere_type.stderr
    assert "nothing to discard" in elsewhere_type.stdout
    # A pending delivery is not a dead letter: refused by id, nothing changed.
    assert refused.returncode == 1
    assert "not a dead letter" in refused.stderr
    assert no_reason.returncode == 1
    assert "--reason is required" in no_reason.stderr
    assert _statuses(engine, [*dead, pending, elsewhere]) == (["dead"] * 3 + ["pending", "dead"])

    done = run_cli(
        settings,
        "dead",
        "discard",
        "--source",
        source.public_id,
        "--operator",
        "alice",
        "--reason",
        "customer deleted the integration",
        "--yes",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)["result"]
    assert (result["planned"], result["discarded"]) == (3, 3)
    assert _statuses(engine, [*dead, pending, elsewhere]) == (
        ["discarded"] * 3 + ["pending", "dead"]
    )
    with engine.connect() as conn:
        audit = conn.execute(
            text(
                "SELECT id, operator, action, target, reason, count, via, at FROM audit_log"
                " WHERE target->>'source' = :p AND action = 'discard'"
            ),
            {"p": source.public_id},
        ).one()
    assert audit.id == result["audit_id"]
    assert (audit.operator, audit.action, audit.reason, audit[5], audit.via) == (
        "alice",
        "discard",
        "customer deleted the integration",
        3,
        "cli",
    )
    assert audit.target == {"source": source.public_id}
    assert abs(audit.at - now) < timedelta(minutes=5)
    # Logged with counts, no delivery id, no event id.
    (line,) = [x for x in json_logs(done.stderr) if x.get("event") == "dead_letters_discarded"]
    assert (line["count"], line["via"]) == (3, "cli")
    assert not any(f"evt_d{n}" in done.stderr for n in range(3))
    # Nothing left to discard: a second run changes nothing and says so.
    again = run_cli(
        settings, "dead", "discard", "--source", source.public_id, "--reason", "again", "--yes"
    )
    assert again.returncode == 0
    assert "nothing to discard" in again.stdout


def _statuses(engine: Engine, ids: list[int]) -> list[str]:
    with engine.connect() as conn:
        found: dict[int, str] = dict(
            conn.execute(
                text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
            ).all()
        )
    return [found[i] for i in ids]


def test_operator_discard_is_counted(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    from models import discards  # noqa: PLC0415

    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, None)
    (delivery,) = accept(settings, source, "evt_counted", None)[1]
    kill(sessions, delivery, database_now(engine))
    before = sample("webhooks_dead_letters_discarded_total", via="operator")
    request = discards.DiscardRequest(
        operator="bob",
        reason="test",
        via="cli",
        filter_as_given={"source": source.public_id},
        ids=(delivery,),
    )
    with sessions() as session, session.begin():
        plan = discards.plan_discard(session, request)
        result = discards.execute_discard(session, plan, now=None)
    discards.record_discarded(result, "cli")
    assert result.discarded == 1
    assert sample("webhooks_dead_letters_discarded_total", via="operator") == before + 1


# ------------------------------------------------------------------------------------------
# The database's clock
# ------------------------------------------------------------------------------------------


def test_ensure_partitions_on_the_database_clock_never_creates_a_past_day(
    engine: Engine, settings: Settings
) -> None:
    """A process whose clock lags three days (libfaketime) lays out partitions with
    ``now=None``: the database's clock decides, so no day it creates is already past."""
    run_maintenance(engine, settings, None)  # past days dropped: one re-created would show
    env = lagging_env(settings, "-3d")
    assert _process_clock(env) < database_now(engine) - timedelta(days=2)
    script = (
        "from models.db import make_engine; from models.retention_layout import ensure_partitions;"
        "from core.settings import load_settings; s = load_settings();"
        "print(len(ensure_partitions(make_engine(s, pool_size=1), s, None)))"
    )
    done = subprocess.run(
        [str(BIN / "python"), "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    now = database_now(engine)
    with engine.connect() as conn:
        layout = partitions.list_partitions(conn)
    past = [p.name for p in layout if p.upper is not None and p.upper <= now]
    assert past == []
    yesterday = (now - DAY).date()
    assert partitions.partition_name("receipts", yesterday) not in {p.name for p in layout}


def lagging_env(settings: Settings, offset: str) -> dict[str, str]:
    """The test environment with the process clock moved by ``offset`` (libfaketime)."""
    env = env_for(settings)
    env.update(libfaketime.get_reload_information()[1])
    env["FAKETIME"] = offset
    return env


def _process_clock(env: dict[str, str]) -> datetime:
    done = subprocess.run(
        [str(BIN / "python"), "-c", "import datetime; print(datetime.datetime.now(datetime.UTC))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return datetime.fromisoformat(done.stdout.strip())


# ------------------------------------------------------------------------------------------
# Black box: `webhooks maintenance run` with its process clock ten days ahead
# ------------------------------------------------------------------------------------------


def test_maintenance_run_ten_days_ahead_removes_only_finished_work(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    source = new_source(sessions, settings, made)
    db_now = database_now(engine)
    old = db_now - timedelta(days=12)  # expired 8 days ago, by the database's clock
    ancient = db_now - timedelta(days=40)  # died 39 days ago: past the 30-day retention
    ensure_partitions(engine, settings, ancient)
    ensure_partitions(engine, settings, old)
    ids = {}
    for name, at in [
        ("old_succeeded", old),
        ("old_retrying", old),
        ("old_pending", old),
        ("old_dead", old),
        ("ancient_dead", ancient),
    ]:
        status, (ids[name],) = accept(settings, source, name, at)
        assert status == "accepted"
    succeed(sessions, ids["old_succeeded"], old + SEC)
    retry_later(sessions, ids["old_retrying"], old + SEC, db_now + timedelta(hours=1))
    kill(sessions, ids["old_dead"], old + timedelta(minutes=1))
    kill(sessions, ids["ancient_dead"], ancient + timedelta(minutes=1))
    for name in ("current_succeeded", "current_pending"):  # accepted now, expiring in 4 days
        status, (ids[name],) = accept(settings, source, name, None)
        assert status == "accepted"
    succeed(sessions, ids["current_succeeded"], database_now(engine))
    before = rows_of(engine, source)
    assert all(before[n].expires_at <= db_now for n in before if not n.startswith("current"))

    env = lagging_env(settings, "+10d")
    assert _process_clock(env) > database_now(engine) + timedelta(days=9)
    done = run_cli(settings, "maintenance", "run", "--json", env=env)

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    after = rows_of(engine, source)
    assert set(after) == {
        "old_retrying",
        "old_pending",
        "old_dead",
        "current_succeeded",
        "current_pending",
    }
    end = database_now(engine)
    for name in ("old_retrying", "old_pending"):
        row = after[name]
        assert db_now < row.expires_at <= end + 2 * DAY, name  # moved forward, held
    # The dead letter moved once, to the end of its retention.
    assert after["old_dead"].expires_at == old + timedelta(minutes=1, days=30)
    for name in ("old_retrying", "old_pending", "old_dead"):
        row = after[name]
        assert row.has_payload, name
        assert (row.statuses, row.attempts) == (before[name].statuses, before[name].attempts)
    for name in ("current_succeeded", "current_pending"):
        assert after[name] == before[name], name  # untouched: the +10 days were ignored
    assert report["held_receipts"] >= 3
    assert report["dead_letters_expired"] >= 1
    assert datetime.fromisoformat(report["now"]) < db_now + DAY  # the database's instant
    expired = [x for x in json_logs(done.stderr) if x.get("event") == "dead_letters_expired"]
    assert expired
    assert all(set(x) <= {"event", "count", "level", "timestamp"} for x in expired)
    assert "ancient_dead" not in done.stderr

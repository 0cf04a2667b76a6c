"""Issue 38 item 3: payload shape drift on real Postgres (and a real worker for the beat
task's claim). Events with a new key path, a removed path and a type change each make one
finding; two learning runs at once open each finding once and learn each receipt once;
`webhooks drift accept` closes the findings, changes the learnt shape and is audited; bad
input is one line and changes nothing. No sleeps: the instant findings are judged at is
passed in (the database's clock otherwise)."""

from __future__ import annotations

import json
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.messages import DRIFT_TASK, MAINTENANCE_QUEUE
from core.settings import Settings
from models import drift, pg
from tests.conftest import BIN, free_port, test_env, wait_for_port
from tests.factories import MadeSource, accept_event, make_source
from tests.workers import Broker, running_worker, scrape_metrics, wait_for, worker_settings

ABSENT = timedelta(days=7)
TYPE = "invoice.paid"


def learn(settings: Settings, now: datetime | None = None) -> drift.LearnReport:
    with pg.connect(settings) as conn:
        return drift.learn_due(conn, every=timedelta(0), sample=50, absent=ABSENT, now=now)


def findings(settings: Settings, source: MadeSource, *, open_only: bool = True) -> list[Any]:
    with psycopg.connect(settings.psycopg_dsn) as conn:
        return conn.execute(
            "SELECT event_type, path, kind, detail, accepted_at, accepted_by FROM drift_findings"
            " WHERE source_id = %s AND (NOT %s OR accepted_at IS NULL) ORDER BY path, kind",
            (source.id, open_only),
        ).fetchall()


def kinds(rows: list[Any]) -> list[tuple[str, str]]:
    return [(r[1], r[2]) for r in rows]


def send(settings: Settings, source: MadeSource, data: dict[str, Any], at: datetime) -> str:
    event_id, _ = accept_event(
        settings, source, event_type=TYPE, body={"type": TYPE, "data": data}, now=at
    )
    return event_id


@pytest.fixture
def source(sessions: sessionmaker[Session], settings: Settings) -> MadeSource:
    return make_source(sessions, settings, routes=[])


def test_a_new_path_a_type_change_and_a_removed_path_each_make_one_finding(
    source: MadeSource, settings: Settings
) -> None:
    base = datetime.now(UTC)
    send(
        settings,
        source,
        {"id": "in_1", "amount": 1200, "note": "private text"},
        base - timedelta(hours=3),
    )
    learn(settings)
    assert findings(settings, source) == []  # the first shape is the baseline

    # A new path (extra), and amount now a string; note is still there.
    send(
        settings,
        source,
        {"id": "in_2", "amount": "1200", "note": "n", "extra": True},
        base - timedelta(hours=2),
    )
    # From here on note is no longer sent.
    send(settings, source, {"id": "in_3", "amount": 5, "extra": False}, base - timedelta(hours=1))
    learn(settings)
    assert kinds(findings(settings, source)) == [
        ("data.amount", "type_changed"),
        ("data.extra", "new_path"),
    ]
    # Six days on, note is not yet gone; seven days after its last sighting it is.
    learn(settings, now=base + timedelta(days=6))
    assert len(findings(settings, source)) == 2
    learn(settings, now=base - timedelta(hours=2) + ABSENT)
    rows = findings(settings, source)
    assert kinds(rows) == [
        ("data.amount", "type_changed"),
        ("data.extra", "new_path"),
        ("data.note", "path_gone"),
    ]
    # Later runs (and the same drift seen again) open nothing more: one finding each.
    send(
        settings, source, {"id": "in_4", "amount": "7", "extra": True}, base - timedelta(minutes=2)
    )
    learn(settings, now=base + timedelta(days=9))
    learn(settings, now=base + timedelta(days=10))
    assert findings(settings, source) == rows
    # Each finding's opening is audited once, under the learning run.
    with psycopg.connect(settings.psycopg_dsn) as conn:
        opened = conn.execute(
            "SELECT target->>'path', target->>'kind', operator, via FROM audit_log"
            " WHERE action = 'drift.open' AND target->>'source' = %s ORDER BY 1",
            (source.public_id,),
        ).fetchall()
    assert [tuple(r) for r in opened] == [
        ("data.amount", "type_changed", "drift", "drift"),
        ("data.extra", "new_path", "drift", "drift"),
        ("data.note", "path_gone", "drift", "drift"),
    ]
    # No value is stored anywhere: only types and dates.
    assert not any("1200" in r[3] or "private" in r[3] for r in rows)
    with psycopg.connect(settings.psycopg_dsn) as conn:
        stored = conn.execute(
            "SELECT path, types FROM drift_paths WHERE source_id = %s ORDER BY path", (source.id,)
        ).fetchall()
    assert {r[0]: r[1] for r in stored}["data.amount"] == ["integer", "string"]
    assert "in_1" not in repr(stored)
    assert "private" not in repr(stored)


def test_two_learning_runs_at_once_open_each_finding_once_and_learn_each_receipt_once(
    source: MadeSource, settings: Settings
) -> None:
    base = datetime.now(UTC)
    send(settings, source, {"id": "a", "amount": 1}, base - timedelta(minutes=5))
    learn(settings)
    for i in range(3):
        send(
            settings,
            source,
            {"id": f"b{i}", "amount": "x", "new": i},
            base - timedelta(minutes=4 - i),
        )
    reports: list[drift.LearnReport] = []
    with psycopg.connect(settings.psycopg_dsn) as holder:
        # Hold the mark's row so both runs are waiting on it at once, then let them go.
        holder.execute("SELECT 1 FROM drift_marks FOR UPDATE")
        threads = [
            threading.Thread(target=lambda: reports.append(learn(settings))) for _ in range(2)
        ]
        for t in threads:
            t.start()

        def both_waiting() -> bool:
            # Autocommit: pg_stat_activity is read once per transaction.
            with psycopg.connect(settings.psycopg_dsn, autocommit=True) as watcher:
                row = watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                    " AND query LIKE %s",
                    ("%UPDATE drift_marks SET ran_at%",),
                ).fetchone()
            return row is not None and row[0] >= 2

        wait_for(both_waiting, timeout=30, what="both learning runs waiting on the mark")
        holder.commit()
        for t in threads:
            t.join(timeout=60)
    assert len(reports) == 2
    assert kinds(findings(settings, source)) == [
        ("data.amount", "type_changed"),
        ("data.new", "new_path"),
    ]
    # The second run found the mark moved past these receipts: each was learnt once.
    assert sorted(r.read > 0 for r in reports) == [False, True]
    with psycopg.connect(settings.psycopg_dsn) as conn:
        row = conn.execute(
            "SELECT sightings FROM drift_shapes WHERE source_id = %s AND event_type = %s",
            (source.id, TYPE),
        ).fetchone()
    assert row is not None
    assert row[0] == 4


def test_a_receipt_is_learnt_once_settled_so_none_is_left_behind_the_mark(
    source: MadeSource, settings: Settings
) -> None:
    """A receipt received less than SETTLE ago is left to the next run: one numbered below it
    may still be committing, and the mark must not pass it."""
    base = datetime.now(UTC)
    send(settings, source, {"id": "a", "v": 1}, base - timedelta(minutes=5))
    learn(settings)
    fresh = send(settings, source, {"id": "b", "v": 1, "fresh": 1}, base)
    learn(settings)
    assert findings(settings, source) == []
    with psycopg.connect(settings.psycopg_dsn) as conn:
        row = conn.execute(
            "SELECT m.through_receipt_id < r.id FROM drift_marks m, receipts r"
            " WHERE r.event_id = %s",
            (fresh,),
        ).fetchone()
        assert row is not None
        assert row[0]  # the mark stopped short of it
        # A minute later (the database's view: its received_at moved back), it is learnt.
        conn.execute(
            "UPDATE receipts SET received_at = received_at - interval '2 minutes'"
            " WHERE event_id = %s",
            (fresh,),
        )
        conn.commit()
    learn(settings)
    assert kinds(findings(settings, source)) == [("data.fresh", "new_path")]


def test_a_period_is_learnt_once_however_many_runs_ask(settings: Settings) -> None:
    with pg.connect(settings) as conn:
        conn.execute("UPDATE drift_marks SET ran_at = NULL")
        conn.commit()
        first = drift.learn_due(conn, every=timedelta(hours=1), sample=5, absent=ABSENT)
        second = drift.learn_due(conn, every=timedelta(hours=1), sample=5, absent=ABSENT)
    assert (first.claimed, second.claimed) == (True, False)


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(COLUMNS="200"), capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


def audit_rows(settings: Settings) -> list[Any]:
    with psycopg.connect(settings.psycopg_dsn) as conn:
        return conn.execute(
            "SELECT operator, action, target, reason, count FROM audit_log"
            " WHERE action = 'drift.accept' ORDER BY id"
        ).fetchall()


def test_drift_accept_closes_the_findings_changes_the_shape_and_is_audited(
    source: MadeSource, settings: Settings
) -> None:
    base = datetime.now(UTC)
    send(settings, source, {"id": "a", "gone_soon": 1}, base - timedelta(hours=2))
    learn(settings)
    send(settings, source, {"id": "b", "added": "s"}, base - timedelta(hours=1))
    learn(settings, now=base + ABSENT)
    assert kinds(findings(settings, source)) == [
        ("data.added", "new_path"),
        ("data.gone_soon", "path_gone"),
    ]

    listed = webhooks("drift", "list", "--source", source.public_id, "--json")
    assert listed.returncode == 0, listed.stderr
    assert {(f["path"], f["kind"]) for f in json.loads(listed.stdout)} == {
        ("data.added", "new_path"),
        ("data.gone_soon", "path_gone"),
    }

    # Bad input: one line, exit 1, nothing changed.
    before = (findings(settings, source, open_only=False), audit_rows(settings))
    for args, line in (
        (["drift", "accept", "no-such-source", "--reason", "r", "--yes"], "no such source"),
        (["drift", "accept", source.public_id, "--yes"], "--reason is required"),
        (
            ["drift", "accept", source.public_id, "--type", "nope.*", "--reason", "r", "--yes"],
            "no open drift findings",
        ),
        (["drift", "list", "--since", "yesterday-ish"], "not a time"),
        (["drift", "list", "--source", "no-such-source"], "no such source"),
    ):
        bad = webhooks(*args)
        assert bad.returncode == 1, (args, bad.stdout)
        assert len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)
        assert line in bad.stderr.lower() or line in bad.stderr, (args, bad.stderr)
        assert "Traceback" not in bad.stderr
    assert (findings(settings, source, open_only=False), audit_rows(settings)) == before

    done = webhooks(
        "drift", "accept", source.public_id, "--reason", "API version 2026-12", "--yes",
        "--operator", "ana", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["accepted"] == 2
    assert findings(settings, source) == []
    closed = findings(settings, source, open_only=False)
    assert [(r[1], r[5]) for r in closed] == [("data.added", "ana"), ("data.gone_soon", "ana")]
    audit = audit_rows(settings)[len(before[1]) :]
    assert len(audit) == 1
    assert audit[0][0] == "ana"
    assert audit[0][3] == "API version 2026-12"
    assert audit[0][4] == 2
    assert audit[0][2]["source"] == source.public_id
    # The accepted shape: the gone path left it, so learning again reopens nothing.
    with psycopg.connect(settings.psycopg_dsn) as conn:
        paths = [r[0] for r in conn.execute(
            "SELECT path FROM drift_paths WHERE source_id = %s ORDER BY path", (source.id,)
        )]  # fmt: skip
    assert "data.gone_soon" not in paths
    assert "data.added" in paths
    send(settings, source, {"id": "c", "added": "t"}, base - timedelta(minutes=2))
    learn(settings, now=base + ABSENT)
    assert findings(settings, source) == []
    # Accepting again: nothing open, one line, no second audit row.
    again = webhooks("drift", "accept", source.public_id, "--reason", "r", "--yes")
    assert again.returncode == 1
    assert "no open drift findings" in again.stderr
    assert len(audit_rows(settings)) == len(before[1]) + 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_beat_s_drift_task_on_a_real_worker_learns_a_period_once(
    source: MadeSource, settings: Settings, tmp_path: Path
) -> None:
    """Two deliveries of the task (two beats, or one firing twice) to a worker with two pool
    processes: one run claims the period and learns; the other does nothing."""
    base = datetime.now(UTC)
    send(settings, source, {"id": "a", "v": 1}, base - timedelta(minutes=3))
    learn(settings)
    send(settings, source, {"id": "b", "v": "1"}, base - timedelta(minutes=2))
    with pg.connect(settings) as conn:
        conn.execute("UPDATE drift_marks SET ran_at = NULL")
        conn.commit()
    broker = Broker(worker_settings(drift_every=timedelta(hours=1)))
    port = free_port()
    try:
        with running_worker(
            "drift", tmp_path, pool="prefork", concurrency=2, queues=MAINTENANCE_QUEUE,
            drift_every=timedelta(hours=1), admission=False, worker_metrics_port=port,
            metrics_dir=str(tmp_path / "metrics"),
        ) as worker:  # fmt: skip
            wait_for_port(port, worker.proc)
            for _ in range(2):
                broker.app.send_task(DRIFT_TASK, queue=MAINTENANCE_QUEUE)

            def both_ran() -> list[Any] | None:
                done = [
                    line for line in worker.json_lines() if line.get("event") == "drift.learned"
                ]
                finished = worker.output().count(f"Task {DRIFT_TASK}[")
                return done if finished >= 4 else None  # received + succeeded, twice

            learned = wait_for(both_ran, timeout=120, what="both drift runs")
            samples = scrape_metrics(port)
    finally:
        broker.close()
    assert len(learned) == 1
    assert learned[0]["read"] >= 1
    assert kinds(findings(settings, source)) == [("data.v", "type_changed")]
    # The open findings' gauge, on the worker's /metrics (0 for the kinds with none open).
    gauge = "webhooks_drift_findings"
    assert samples[(gauge, (("kind", "type_changed"), ("source", source.public_id)))] == 1
    assert samples[(gauge, (("kind", "new_path"), ("source", source.public_id)))] == 0
    assert samples[("webhooks_job_period_seconds", (("job", "drift"),))] == 3600


def test_routes_add_and_update_set_the_drift_quarantine_audited(
    source: MadeSource, settings: Settings
) -> None:
    added = webhooks(
        "routes", "add", source.public_id, "--handler", "log", "--quarantine-drift", "--json"
    )
    assert added.returncode == 0, added.stderr
    route_id = json.loads(added.stdout)["id"]

    def option() -> Any:
        with psycopg.connect(settings.psycopg_dsn) as conn:
            row = conn.execute("SELECT options FROM routes WHERE id = %s", (route_id,)).fetchone()
        assert row is not None
        return row[0].get("quarantine_drift")

    assert option() == "true"
    off = webhooks(
        "routes", "update", str(route_id), "--no-quarantine-drift", "--reason", "reports only"
    )
    assert off.returncode == 0, off.stderr
    assert "drift quarantine off" in off.stdout
    assert option() is None
    with psycopg.connect(settings.psycopg_dsn) as conn:
        audited = conn.execute(
            "SELECT reason, target->>'after' FROM audit_log"
            " WHERE action = 'route.quarantine_drift' AND (target->>'route')::bigint = %s",
            (route_id,),
        ).fetchall()
    assert [tuple(r) for r in audited] == [("reports only", "false")]
    # An unknown route: one line, nothing written.
    bad = webhooks("routes", "update", "999999999", "--quarantine-drift", "--reason", "r")
    assert bad.returncode == 1
    assert len(bad.stderr.strip().splitlines()) == 1
    assert "no such route" in bad.stderr


def test_a_bad_drift_setting_is_one_line_and_nothing_runs(settings: Settings) -> None:
    def mark() -> Any:
        with psycopg.connect(settings.psycopg_dsn) as conn:
            return conn.execute("SELECT ran_at, through_receipt_id FROM drift_marks").fetchone()

    before = mark()
    for name, value in (
        ("WEBHOOKS_DRIFT_EVERY", "soon"),
        ("WEBHOOKS_DRIFT_EVERY", "0s"),
        ("WEBHOOKS_DRIFT_ABSENT_DAYS", "0"),
        ("WEBHOOKS_DRIFT_SAMPLE", "many"),
    ):
        proc = subprocess.run(
            [str(BIN / "webhooks"), "drift", "learn"], env=test_env(**{name: value}),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 1, (name, value, proc.stdout)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (name, value, proc.stderr)
        assert name in lines[0] or name.removeprefix("WEBHOOKS_").lower() in lines[0].lower()
        assert "Traceback" not in proc.stderr
    assert mark() == before

"""An effect already made is committed, not repeated (issue 19): deliveries whose handlers
have called their downstream while the database's connections are terminated, or while
Postgres is stopped and started again, record their success once it is back, and the
downstream is called once. Real ``celery -A tasks worker`` processes, a real Postgres fault,
and one message of several deliveries beside messages of one."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tests.workers import (
    Worker,
    attempts,
    delivery,
    new_dispatches,
    publish_one_message,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

# Time limits long enough for a Postgres restart inside one attempt (the lease, 4 x hard,
# is then 100 s: a repeat by lease could not hide inside the test's wait).
LIMITS = {"soft_time_limit": 20.0, "hard_time_limit": 25.0, "visibility_timeout": 200.0}
CLUSTER = ["15", "main"]
PID_FILE = Path("/var/lib/postgresql/15/main/postmaster.pid")


def _terminate_all(engine: Engine) -> None:
    """Every connection to the test database but the asking one, as a failover would."""
    dsn = worker_settings().psycopg_dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def _calls(marks: Path, delivery_id: int) -> list[str]:
    return sorted(p.name for p in marks.glob(f"{delivery_id}.*"))


def _run_through_fault(
    tmp_path: Path,
    sessions: sessionmaker[Session],
    engine: Engine,
    fault: Callable[[Path, Worker], None],
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    routes = [("gate", {"marker_dir": str(marks)})] * 6
    dispatches = new_dispatches(sessions, routes, **LIMITS)
    publish_one_message(dispatches[:4])  # one message of four deliveries
    publish_one_message(dispatches[4:5])  # and two of one each
    publish_one_message(dispatches[5:])
    with running_worker("faults", tmp_path, **LIMITS) as worker:
        ids = [d.delivery_id for d in dispatches]
        wait_for(
            lambda: all(_calls(marks, i) for i in ids),
            timeout=30,
            what="every handler to have made its effect and wait at the gate",
        )
        fault(marks, worker)
        for i in ids:
            wait_status(engine, i, "succeeded", timeout=60)
        log = worker.output()
    for i in ids:
        assert len(_calls(marks, i)) == 1, (i, _calls(marks, i))  # the downstream once
        assert [a.outcome for a in attempts(engine, i)] == ["succeeded"]
        assert delivery(engine, i).attempts == 1
    assert "Traceback" not in log, log[-4000:]
    assert "delivery.record_retry" in log  # the fault did land between effect and commit


def test_terminated_connections_between_effect_and_commit_repeat_nothing(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    def fault(marks: Path, worker: Worker) -> None:
        _terminate_all(engine)
        (marks / "open").write_text("")

    _run_through_fault(tmp_path, sessions, engine, fault)


# It stops and starts the machine's Postgres: marked serial, for runs in several processes
# when no other test is running.
@pytest.mark.serial
def test_postgres_restart_between_effect_and_commit_repeats_nothing(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    def fault(marks: Path, worker: Worker) -> None:
        subprocess.run(["pg_ctlcluster", *CLUSTER, "stop", "-m", "fast"], check=True)
        try:
            (marks / "open").write_text("")
            # Postgres stays down until the worker has tried to record and failed.
            wait_for(
                lambda: "delivery.record_retry" in worker.output(),
                timeout=30,
                what="the worker to retry recording while Postgres is down",
            )
        finally:
            subprocess.run(["pg_ctlcluster", *CLUSTER, "start"], check=True)

    _run_through_fault(tmp_path, sessions, engine, fault)


# It crashes the machine's Postgres: serial, like the restart above.
@pytest.mark.serial
def test_a_claim_survives_a_postgres_crash_right_after_it(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Postgres crashes (immediate shutdown) milliseconds after the claim, right after the
    handler made its effect: the claim was durable when the handler started, so after crash
    recovery the row is still this attempt's and its success is recorded, the downstream
    called once. An asynchronous claim commit came back unclaimed (attempts 0, pending) and
    the delivery was called a second time (issue 32's repeats at a Postgres crash)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    options = {"marker_dir": str(marks), "pid_file": str(PID_FILE)}
    (dispatch,) = new_dispatches(sessions, [("crash_postgres", options)], **LIMITS)
    delivery_id = dispatch.delivery_id
    publish_one_message([dispatch])
    with running_worker("crash", tmp_path, **LIMITS) as worker:
        wait_for(lambda: _calls(marks, delivery_id), timeout=30, what="the effect and the crash")
        try:
            wait_for(
                lambda: "delivery.record_retry" in worker.output(),
                timeout=30,
                what="the worker to retry recording while Postgres is down",
            )
        except TimeoutError as exc:
            raise AssertionError(worker.output()[-3000:]) from exc
        finally:
            subprocess.run(["pg_ctlcluster", *CLUSTER, "start"], check=True)
        wait_for(
            lambda: delivery_row(delivery_id) is not None,
            timeout=60,
            what="Postgres to accept connections again",
        )
        row = delivery_row(delivery_id)
        # Crash recovery kept the claim: the row is this attempt's (or already succeeded).
        assert row is not None, "the delivery is gone"
        assert row[1] == 1, row
        wait_status(engine, delivery_id, "succeeded", timeout=60)
        log = worker.output()
    assert _calls(marks, delivery_id) == [f"{delivery_id}.1"]
    assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]
    assert "Traceback" not in log, log[-4000:]


def delivery_row(delivery_id: int) -> tuple[str, int] | None:
    """(status, attempts) of the delivery, or None while Postgres does not answer."""
    try:
        with psycopg.connect(worker_settings().psycopg_dsn, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT status, attempts FROM deliveries WHERE id = %s", (delivery_id,)
            ).fetchone()
    except psycopg.OperationalError:
        return None
    return None if row is None else (str(row[0]), int(row[1]))

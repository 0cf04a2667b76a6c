"""The worker's database connections (issue 3): no ping per task, so a pooled connection that
died while idle must cost nothing but a fresh connection; statements run on the delivery's
leaf partitions, and on the parents when that leaf does not exist."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from prometheus_client import REGISTRY
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import deliveries
from tasks.pipeline import COALESCE, deliver_one, run
from tasks.runtime import Runtime, build_runtime
from tasks.steps.run import in_waves
from tests.factories import accept_event, make_source
from tests.netproxy import CuttableProxy
from tests.workers import attempts, delivery, wait_for, worker_settings

pytestmark = pytest.mark.usefixtures("clean_worker_state")


def _no_publish(delivery_id: int, countdown: float) -> None:
    raise AssertionError("nothing here retries")


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    made = build_runtime(worker_settings(), worker="conn-test")
    yield made
    made.close()


def _backend_pids(settings: Settings) -> set[int]:
    """Idle client backends of the test database other than the asking connection."""
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            " AND state = 'idle'"
        ).fetchall()
    return {int(r[0]) for r in rows}


def _run(runtime: Runtime, ids: list[int]) -> list[str]:
    """A message of these ids, as the task runs it: one bare id, or a list."""
    reports = run(runtime, ids, publish_retry=_no_publish, alone=len(ids) == 1)
    return [r.outcome for r in reports]


def _kill_idle_backends(settings: Settings) -> None:
    """Postgres restarted under the idle pool: every idle backend of this database goes away."""
    victims = _backend_pids(settings)
    assert victims
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        for pid in victims:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


# A message of one id and one of three: one code path, each guarantee tested for both.
SIZES = pytest.mark.parametrize("n", [1, 3])


@SIZES
def test_pooled_connections_killed_while_idle_cost_one_fresh_connection(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime, n: int
) -> None:
    """The message's first read finds the dead connection; every pooled one is discarded and
    the message starts again once, on a fresh connection: each delivery succeeds once."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    first = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    assert _run(runtime, first) == ["succeeded"] * n
    _kill_idle_backends(settings)
    second = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    assert _run(runtime, second) == ["succeeded"] * n
    for delivery_id in second:
        assert delivery(engine, delivery_id).status == "succeeded"
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]


@SIZES
def test_statements_fall_back_to_the_parents_when_the_leaf_is_missing(
    engine: Engine, sessions: sessionmaker[Session], n: int
) -> None:
    # Delete-mode settings name the `*_default` leaves, which this partition-mode database
    # does not have: the claims and the successes must still land, through the parents.
    settings = worker_settings(retention_mode="delete")
    source = make_source(sessions, settings)
    ids = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    deliveries._MISSING_LEAVES.discard("default")
    made = build_runtime(settings, worker="leafless")
    try:
        if n == 1:
            assert _run(made, ids) == ["succeeded"]
        else:  # a repeated id and a missing one beside them
            assert _run(made, [*ids, ids[0], 10**12]) == ["succeeded"] * n + ["missing"]
    finally:
        made.close()
    assert "default" in deliveries._MISSING_LEAVES
    deliveries._MISSING_LEAVES.discard("default")
    for delivery_id in ids:
        assert delivery(engine, delivery_id).status == "succeeded"
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]


def test_in_partition_mode_the_leaves_exist_and_are_used(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings)
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    before = set(deliveries._MISSING_LEAVES)
    assert deliver_one(runtime, delivery_id, publish_retry=_no_publish) == "succeeded"
    assert before == deliveries._MISSING_LEAVES  # no fallback was needed
    assert delivery(engine, delivery_id).status == "succeeded"


def test_leaf_statements_name_only_that_days_partitions() -> None:
    """The claim and success statements, in their one-row and their many-row forms."""
    from models.transitions import (  # noqa: PLC0415
        _claim_many_sql,
        _claim_sql,
        _finish_sql,
        _succeed_many_sql,
    )

    leaf = "p20261204"
    claims = (_claim_sql(worker=True, leaf=leaf), _claim_many_sql(leaf))
    successes = (_finish_sql("status = 'succeeded'", leaf), _succeed_many_sql(leaf))
    for sql in claims + successes:
        assert "UPDATE deliveries_p20261204 AS deliveries SET" in sql
        assert "UPDATE attempts_p20261204 AS attempts SET" in sql
    for sql in claims:
        assert "INSERT INTO attempts_p20261204 AS attempts" in sql
        assert "JOIN receipts_p20261204 r" in sql
    parents = _claim_sql(worker=True) + _claim_many_sql(None) + _succeed_many_sql(None)
    assert "_p2026" not in parents
    assert "UPDATE deliveries SET" in parents
    with pytest.raises(ValueError, match="not a partition suffix"):
        _claim_sql(worker=True, leaf="x; DROP TABLE")
    with pytest.raises(ValueError, match="not a partition suffix"):
        _claim_many_sql("x; DROP TABLE")


@SIZES
def test_postgres_unreachable_fails_the_message_and_leaves_nothing_behind(
    engine: Engine, sessions: sessionmaker[Session], n: int
) -> None:
    base = worker_settings()
    source = make_source(sessions, base)
    ids = [accept_event(base, source)[1].delivery_ids[0] for _ in range(n)]
    proxy = CuttableProxy(5432)
    settings = worker_settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{base.database_name()}",
        db_connect_timeout=1.0,
    )
    made = build_runtime(settings, worker="cut-off")
    try:
        warm = [accept_event(base, source)[1].delivery_ids[0] for _ in range(n)]
        assert _run(made, warm) == ["succeeded"] * n  # pooled connections
        proxy.cut()
        # The pooled connection is found dead, and so is the fresh one: the task fails.
        with pytest.raises((psycopg.OperationalError, sqlalchemy.exc.OperationalError)):
            _run(made, ids)
        # Nothing changed: still pending, no attempt, and no fast-claim key to block a retry.
        for delivery_id in ids:
            assert delivery(engine, delivery_id).status == "pending"
            assert attempts(engine, delivery_id) == []
            assert made.redis.keys(made.claims.key(delivery_id, 0)) == []
        proxy.restore()
        assert _run(made, ids) == ["succeeded"] * n
    finally:
        made.close()
        proxy.close()
    for delivery_id in ids:
        assert delivery(engine, delivery_id).status == "succeeded"


def _record_retries() -> float:
    return REGISTRY.get_sample_value("webhooks_record_retries_total", {"action": "succeed"}) or 0.0


@SIZES
def test_a_success_meeting_a_dead_database_is_recorded_once_it_is_back_not_repeated(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, n: int
) -> None:
    """Issue 19: the handlers have made their effect (``gate``: a call, then a wait) when
    every database connection of the worker is cut. Their success is not given back: its
    record is retried on fresh connections until the database is reachable again, then
    commits. One attempt and one call each."""
    base = worker_settings()
    marks = tmp_path / "marks"
    marks.mkdir()
    route = {"handler": "gate", "options": {"marker_dir": str(marks)}}
    source = make_source(sessions, base, routes=[route])
    ids = [accept_event(base, source)[1].delivery_ids[0] for _ in range(n)]
    proxy = CuttableProxy(5432)
    settings = worker_settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{base.database_name()}",
        db_connect_timeout=1.0,
        record_retry_seconds=30.0,
    )
    made = build_runtime(settings, worker="record-retry")
    outcomes: list[list[str]] = []
    runner = threading.Thread(target=lambda: outcomes.append(_run(made, ids)))
    try:
        runner.start()
        wait_for(
            lambda: len(list(marks.glob("*.*.*"))) == n,
            timeout=30,
            what="every handler to have made its effect",
        )
        proxy.cut()
        retried = _record_retries()
        (marks / "open").write_text("")
        wait_for(
            lambda: _record_retries() > retried,
            timeout=30,
            what="the success's record to fail and be tried again",
        )
        proxy.restore()
        runner.join(timeout=40)
    finally:
        proxy.restore()
        runner.join(timeout=40)
        made.close()
        proxy.close()
    assert outcomes == [["succeeded"] * n]
    for delivery_id in ids:
        assert delivery(engine, delivery_id).status == "succeeded"
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]
        assert len(list(marks.glob(f"{delivery_id}.*"))) == 1  # one call


_REFUSE_FINISH = """
CREATE SEQUENCE IF NOT EXISTS test_finish_refused;
CREATE OR REPLACE FUNCTION test_refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.id = {victim} AND NEW.status <> 'processing' THEN
        PERFORM nextval('test_finish_refused');  -- not rolled back: the test sees it fired
        RAISE EXCEPTION 'test: finishing delivery refused';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_refuse_finish BEFORE UPDATE ON deliveries
    FOR EACH ROW EXECUTE FUNCTION test_refuse_finish();
"""


def test_a_finishing_error_while_batch_mates_run_leaves_none_of_them_claimed_and_forgotten(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Issue 19: one delivery of a message returns at once and recording its outcome fails on
    a database error that is not a lost connection (a trigger refuses every update of its row
    past the claim: its success, then its failure's record). Its two batch-mates are still in
    their handlers. They are waited for and their successes recorded before the error is
    raised; the refused one keeps its lease (as after a crash). Before, the error escaped at
    once and the batch-mates stayed processing until their leases ran out: a second call."""
    settings = worker_settings()
    marks = tmp_path / "marks"
    marks.mkdir()
    quick = make_source(
        sessions, settings, routes=[{"handler": "touch", "options": {"marker_dir": str(marks)}}]
    )
    gated = make_source(
        sessions, settings, routes=[{"handler": "gate", "options": {"marker_dir": str(marks)}}]
    )
    victim = accept_event(settings, quick)[1].delivery_ids[0]
    mates = [accept_event(settings, gated)[1].delivery_ids[0] for _ in range(2)]
    made = build_runtime(settings, worker="finish-refused")
    raised: list[BaseException] = []

    def message() -> None:
        try:
            run(made, [victim, *mates], publish_retry=_no_publish)
        except BaseException as exc:  # noqa: BLE001 (what the task would raise)
            raised.append(exc)

    def refused() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.exec_driver_sql("SELECT is_called FROM test_finish_refused").scalar_one()
            )

    runner = threading.Thread(target=message)
    with engine.begin() as conn:
        conn.exec_driver_sql(_REFUSE_FINISH.format(victim=int(victim)))
    try:
        runner.start()
        wait_for(refused, timeout=30, what="the victim's finish to be refused")
        assert {p.name.split(".")[0] for p in marks.glob("*.*.*")} == {
            str(i) for i in (victim, *mates)
        }  # every handler made its call; the two mates wait at the gate
        (marks / "open").write_text("")
        runner.join(timeout=30)
        assert not runner.is_alive()
    finally:
        (marks / "open").write_text("")
        runner.join(timeout=30)
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER IF EXISTS test_refuse_finish ON deliveries")
            conn.exec_driver_sql("DROP FUNCTION IF EXISTS test_refuse_finish()")
            conn.exec_driver_sql("DROP SEQUENCE IF EXISTS test_finish_refused")
        made.close()
    assert len(raised) == 1
    assert "refused" in str(raised[0])
    for delivery_id in mates:
        assert delivery(engine, delivery_id).status == "succeeded"
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]
    assert delivery(engine, victim).status == "processing"  # its lease hands it on
    assert len(list(marks.glob("*.*.*"))) == 3  # one call each


def test_a_later_partitions_claim_failing_leaves_no_earlier_claim_forgotten(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Issue 19: a batch spanning two days' partitions claims them group by group. When the
    second group's claim fails (a real Postgres error: its row is locked by another
    transaction past the worker's lock_timeout), the first group's committed claims still
    run and succeed, and the second group is left as it was: pending, no attempt, no fast
    claim held."""
    from sqlalchemy import event  # noqa: PLC0415

    settings = worker_settings()
    source = make_source(sessions, settings)
    first = accept_event(settings, source, ttl=timedelta(days=4))[1].delivery_ids[0]
    second = accept_event(settings, source, ttl=timedelta(days=6))[1].delivery_ids[0]
    made = build_runtime(settings, worker="partial-claim")

    @event.listens_for(made.engine, "connect")
    def _short_lock_wait(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.execute("SET lock_timeout = '300ms'")
        dbapi_conn.commit()

    made.engine.dispose()  # connections opened before the listener (build_runtime reads)
    try:
        with psycopg.connect(settings.psycopg_dsn) as locker:
            locker.execute("SELECT 1 FROM deliveries WHERE id = %s FOR UPDATE", (second,))
            outcomes = _run(made, [first, second])
        assert outcomes == ["succeeded", "unclaimed"]
        assert delivery(engine, first).status == "succeeded"
        assert delivery(engine, second).status == "pending"
        assert attempts(engine, second) == []
        assert made.redis.keys(made.claims.key(second, 0)) == []
        assert _run(made, [second]) == ["succeeded"]  # nothing holds it back afterwards
    finally:
        made.close()


class _RoundTrips:
    """Counts, in this process, the SQL statements sent through psycopg (each ``execute``, and
    each COMMIT or ROLLBACK of an open transaction) and the Redis round trips (each packed
    send: a pipeline is one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import redis.connection  # noqa: PLC0415

        self.sql: list[str] = []
        self.redis = 0
        counter = self
        execute, commit, rollback = (
            psycopg.Cursor.execute,
            psycopg.Connection.commit,
            psycopg.Connection.rollback,
        )
        send = redis.connection.AbstractConnection.send_packed_command

        def counted_execute(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            counter.sql.append(" ".join(str(query).split()))
            return execute(cur, query, *args, **kwargs)

        def ending(original: Any, word: str) -> Any:
            def end(conn: Any) -> None:
                if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    counter.sql.append(word)
                original(conn)

            return end

        def counted_send(conn: Any, *args: Any, **kwargs: Any) -> None:
            counter.redis += 1
            send(conn, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", counted_execute)
        monkeypatch.setattr(psycopg.Connection, "commit", ending(commit, "COMMIT"))
        monkeypatch.setattr(psycopg.Connection, "rollback", ending(rollback, "ROLLBACK"))
        monkeypatch.setattr(
            redis.connection.AbstractConnection, "send_packed_command", counted_send
        )


@SIZES
def test_a_message_costs_three_statements_and_two_redis_round_trips(
    sessions: sessionmaker[Session], runtime: Runtime, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """The measured floor (bench_workers at 1 and 16 ids per message): a message's probe,
    its guarded claim and its guarded success, each one autocommit statement whatever its
    size, and its fast claims taken then promoted, one Redis round trip each. For one id,
    the one-row statements and plain Redis commands (as on main before the one path)."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    warm = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    ids = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(n)]
    assert _run(runtime, warm) == ["succeeded"] * n  # pooled connections, cached plans
    counted = _RoundTrips(monkeypatch)
    assert _run(runtime, ids) == ["succeeded"] * n
    monkeypatch.undo()
    assert len(counted.sql) == 3, counted.sql
    assert counted.redis == 2
    one_row = n == 1
    assert ("= ANY(" not in counted.sql[0]) is one_row, counted.sql
    assert ("unnest" not in " ".join(counted.sql[1:])) is one_row, counted.sql


def test_a_bare_id_runs_its_handler_in_the_calling_thread_a_list_in_a_handler_thread(
    runtime: Runtime,
) -> None:
    """A message of one bare id carries its handler's own Celery limits (a prefork child
    enforces them with signals in its main thread), so the calling thread runs the handler;
    a list, even of one, carries the batch backstop and each handler gets a thread and
    limits of its own (tasks.pools). pytest runs this in the main thread, as a prefork
    child runs its task."""
    assert threading.current_thread() is threading.main_thread()

    def job() -> threading.Thread:
        return threading.current_thread()

    assert list(in_waves(runtime, [job], COALESCE, inline=True)) == [[(0, threading.main_thread())]]
    ((index, ran_in),) = next(iter(in_waves(runtime, [job], COALESCE)))
    assert index == 0
    assert ran_in is not threading.main_thread()
    assert isinstance(ran_in, threading.Thread)
    assert ran_in.name.startswith("handler")

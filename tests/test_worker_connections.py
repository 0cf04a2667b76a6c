"""The worker's database connections (issue 3): no ping per task, so a pooled connection that
died while idle must cost nothing but a fresh connection; statements run on the delivery's
leaf partitions, and on the parents when that leaf does not exist."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tasks import deliver as deliver_module
from tasks.deliver import deliver_one
from tasks.runtime import Runtime, build_runtime
from tests.factories import accept_event, make_source
from tests.netproxy import CuttableProxy
from tests.workers import attempts, delivery, flush_redis, worker_settings
from webhooks.settings import Settings


def _no_publish(delivery_id: int, countdown: float) -> None:
    raise AssertionError("nothing here retries")


@pytest.fixture(autouse=True)
def _clean() -> None:
    flush_redis()  # fast-claim keys of earlier runs name the same delivery ids


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


def test_a_pooled_connection_killed_while_idle_costs_one_fresh_connection(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings)
    first = accept_event(settings, source)[1].delivery_ids[0]
    assert deliver_one(runtime, first, publish_retry=_no_publish) == "succeeded"

    # Postgres restarted under the idle pool: every idle backend of this database goes away.
    victims = _backend_pids(settings)
    assert victims
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        for pid in victims:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    second = accept_event(settings, source)[1].delivery_ids[0]
    assert deliver_one(runtime, second, publish_retry=_no_publish) == "succeeded"
    assert delivery(engine, second).status == "succeeded"
    assert [a.outcome for a in attempts(engine, second)] == ["succeeded"]


def test_statements_fall_back_to_the_parents_when_the_leaf_is_missing(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    # Delete-mode settings name the `*_default` leaves, which this partition-mode database
    # does not have: the claim and the success must still land, through the parents.
    settings = worker_settings(retention_mode="delete")
    source = make_source(sessions, settings)
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    deliver_module._MISSING_LEAVES.discard("default")
    made = build_runtime(settings, worker="leafless")
    try:
        assert deliver_one(made, delivery_id, publish_retry=_no_publish) == "succeeded"
    finally:
        made.close()
    assert "default" in deliver_module._MISSING_LEAVES
    deliver_module._MISSING_LEAVES.discard("default")
    assert delivery(engine, delivery_id).status == "succeeded"
    assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]


def test_in_partition_mode_the_leaves_exist_and_are_used(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings)
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    before = set(deliver_module._MISSING_LEAVES)
    assert deliver_one(runtime, delivery_id, publish_retry=_no_publish) == "succeeded"
    assert before == deliver_module._MISSING_LEAVES  # no fallback was needed
    assert delivery(engine, delivery_id).status == "succeeded"


def test_leaf_statements_name_only_that_days_partitions() -> None:
    from models.transitions import _claim_sql, _finish_sql  # noqa: PLC0415

    claim = _claim_sql(worker=True, leaf="p20261204")
    finish = _finish_sql("status = 'succeeded'", "p20261204")
    assert "UPDATE deliveries_p20261204 AS deliveries SET" in claim
    assert "UPDATE attempts_p20261204 AS attempts SET" in claim
    assert "INSERT INTO attempts_p20261204 AS attempts" in claim
    assert "JOIN receipts_p20261204 r" in claim
    assert "UPDATE deliveries_p20261204 AS deliveries SET" in finish
    assert "UPDATE attempts_p20261204 AS attempts SET" in finish
    parents = _claim_sql(worker=True)
    assert "_p2026" not in parents
    assert "UPDATE deliveries SET" in parents
    with pytest.raises(ValueError, match="not a partition suffix"):
        _claim_sql(worker=True, leaf="x; DROP TABLE")


def test_postgres_unreachable_fails_the_task_and_leaves_nothing_behind(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    base = worker_settings()
    source = make_source(sessions, base)
    delivery_id = accept_event(base, source)[1].delivery_ids[0]
    proxy = CuttableProxy(5432)
    settings = worker_settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{base.database_name()}",
        db_connect_timeout=1.0,
    )
    made = build_runtime(settings, worker="cut-off")
    try:
        warm = accept_event(base, source)[1].delivery_ids[0]
        assert deliver_one(made, warm, publish_retry=_no_publish) == "succeeded"  # pooled
        proxy.cut()
        # The pooled connection is found dead, and so is the fresh one: the task fails.
        with pytest.raises((psycopg.OperationalError, sqlalchemy.exc.OperationalError)):
            deliver_one(made, delivery_id, publish_retry=_no_publish)
        # Nothing changed: still pending, no attempt, and no fast-claim key to block a retry.
        assert delivery(engine, delivery_id).status == "pending"
        assert attempts(engine, delivery_id) == []
        assert made.redis.keys(made.claims.key(delivery_id, 0)) == []
        proxy.restore()
        assert deliver_one(made, delivery_id, publish_retry=_no_publish) == "succeeded"
    finally:
        made.close()
        proxy.close()
    assert delivery(engine, delivery_id).status == "succeeded"


def _batch(runtime: Runtime, ids: list[int]) -> list[str]:
    from tasks.batch import run_batch  # noqa: PLC0415

    return [r.outcome for r in run_batch(runtime, ids, publish_retry=_no_publish)]


def test_a_batch_after_its_pooled_connections_died_costs_one_fresh_connection(
    engine: Engine, sessions: sessionmaker[Session], runtime: Runtime
) -> None:
    """A message of several deliveries (tasks.batch) recovers the same way: its first read
    finds the dead connection and the batch starts again once, on a fresh one."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    first = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(3)]
    assert _batch(runtime, first) == ["succeeded"] * 3
    victims = _backend_pids(settings)
    assert victims
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        for pid in victims:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    second = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(3)]
    assert _batch(runtime, second) == ["succeeded"] * 3
    for delivery_id in second:
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]


def test_batch_statements_fall_back_to_the_parents_when_the_leaf_is_missing(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    settings = worker_settings(retention_mode="delete")
    source = make_source(sessions, settings)
    ids = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(3)]
    deliver_module._MISSING_LEAVES.discard("default")
    made = build_runtime(settings, worker="leafless-batch")
    try:
        assert _batch(made, [*ids, ids[0], 10**12]) == ["succeeded"] * 3 + ["missing"]
    finally:
        made.close()
    assert "default" in deliver_module._MISSING_LEAVES
    deliver_module._MISSING_LEAVES.discard("default")
    for delivery_id in ids:
        assert delivery(engine, delivery_id).status == "succeeded"
        assert [a.outcome for a in attempts(engine, delivery_id)] == ["succeeded"]


def test_batch_leaf_statements_name_only_that_days_partitions() -> None:
    from models.transitions import _claim_many_sql, _succeed_many_sql  # noqa: PLC0415

    for sql in (_claim_many_sql("p20261204"), _succeed_many_sql("p20261204")):
        assert "UPDATE deliveries_p20261204 AS deliveries SET" in sql
        assert "UPDATE attempts_p20261204 AS attempts SET" in sql
    assert "JOIN receipts_p20261204 r" in _claim_many_sql("p20261204")
    assert "INSERT INTO attempts_p20261204 AS attempts" in _claim_many_sql("p20261204")
    assert "_p2026" not in _claim_many_sql(None) + _succeed_many_sql(None)
    with pytest.raises(ValueError, match="not a partition suffix"):
        _claim_many_sql("x; DROP TABLE")


def test_postgres_unreachable_fails_a_batch_and_leaves_nothing_behind(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    base = worker_settings()
    source = make_source(sessions, base)
    ids = [accept_event(base, source)[1].delivery_ids[0] for _ in range(3)]
    proxy = CuttableProxy(5432)
    settings = worker_settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{base.database_name()}",
        db_connect_timeout=1.0,
    )
    made = build_runtime(settings, worker="cut-off-batch")
    try:
        warm = [accept_event(base, source)[1].delivery_ids[0] for _ in range(2)]
        assert _batch(made, warm) == ["succeeded"] * 2  # pooled connections
        proxy.cut()
        with pytest.raises((psycopg.OperationalError, sqlalchemy.exc.OperationalError)):
            _batch(made, ids)
        # Nothing changed: all still pending, no attempt, no fast-claim key to block a retry.
        for delivery_id in ids:
            assert delivery(engine, delivery_id).status == "pending"
            assert attempts(engine, delivery_id) == []
            assert made.redis.keys(made.claims.key(delivery_id, 0)) == []
        proxy.restore()
        assert _batch(made, ids) == ["succeeded"] * 3
    finally:
        made.close()
        proxy.close()


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
            outcomes = _batch(made, [first, second])
        assert outcomes == ["succeeded", "unclaimed"]
        assert delivery(engine, first).status == "succeeded"
        assert delivery(engine, second).status == "pending"
        assert attempts(engine, second) == []
        assert made.redis.keys(f"claim:{second}:*") == []
        assert _batch(made, [second]) == ["succeeded"]  # nothing holds it back afterwards
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
            counter.sql.append(" ".join(str(query).split())[:60])
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
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted_send)


def test_a_message_of_one_id_costs_three_statements_and_two_redis_round_trips(
    sessions: sessionmaker[Session], runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measured floor of a lone delivery (bench_workers at 1 id per message): its probe,
    its guarded claim and its guarded success, each one autocommit statement, and its fast
    claim taken then promoted, one Redis command each. Nothing else on the way."""
    settings = worker_settings()
    source = make_source(sessions, settings)
    warm, delivery_id = (accept_event(settings, source)[1].delivery_ids[0] for _ in range(2))
    assert deliver_one(runtime, warm, publish_retry=_no_publish) == "succeeded"  # pooled
    counted = _RoundTrips(monkeypatch)
    assert deliver_one(runtime, delivery_id, publish_retry=_no_publish) == "succeeded"
    monkeypatch.undo()
    assert len(counted.sql) == 3, counted.sql
    assert counted.redis == 2

"""The delivery state machine's guarded statements, against real Postgres."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH, MAX_CACHED_STATEMENT_PARAMS
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import requeue, statements, transitions
from tests.factories import accept_event, make_source

T0 = datetime.now(UTC).replace(microsecond=0)
LEASE = timedelta(minutes=4)


def new_delivery(sessions: sessionmaker[Session], settings: Settings) -> int:
    made = make_source(sessions, settings)
    _, outcome = accept_event(settings, made, now=T0)
    (delivery_id,) = outcome.delivery_ids
    return delivery_id


def claim(
    sessions: sessionmaker[Session], delivery_id: int, now: datetime
) -> transitions.Claim | None:
    with sessions() as s, s.begin():
        return transitions.claim(
            s, delivery_id, now=now, lease=LEASE, max_redeliveries=3, worker="w"
        )


def attempts(sessions: sessionmaker[Session], delivery_id: int) -> list[tuple[int, str | None]]:
    with sessions() as s:
        rows = s.execute(
            text("SELECT number, outcome FROM attempts WHERE delivery_id = :d ORDER BY id"),
            {"d": delivery_id},
        ).all()
    return [(r[0], r[1]) for r in rows]


def test_claim_is_exclusive_and_records_the_attempt(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    delivery_id = new_delivery(sessions, settings)
    first = claim(sessions, delivery_id, T0)
    assert first is not None
    assert (first.status, first.attempt) == ("processing", 1)
    assert claim(sessions, delivery_id, T0 + timedelta(seconds=1)) is None  # live lease
    assert attempts(sessions, delivery_id) == [(1, None)]


def test_expired_lease_counts_a_crash_and_fences_the_old_attempt(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    delivery_id = new_delivery(sessions, settings)
    old = claim(sessions, delivery_id, T0)
    new = claim(sessions, delivery_id, T0 + LEASE)
    assert old is not None
    assert new is not None
    assert (new.attempt, new.redeliveries) == (2, 1)
    with sessions() as s, s.begin(), pytest.raises(transitions.IllegalTransition):
        transitions.succeed(s, old, now=T0 + LEASE)
    with sessions() as s, s.begin():
        transitions.succeed(s, new, now=T0 + LEASE)
    assert attempts(sessions, delivery_id) == [(1, "crashed"), (2, "succeeded")]
    assert claim(sessions, delivery_id, T0 + 2 * LEASE) is None  # done


def test_crash_loop_goes_dead(sessions: sessionmaker[Session], settings: Settings) -> None:
    delivery_id = new_delivery(sessions, settings)
    now = T0
    verdicts = []
    for _ in range(4):
        found = claim(sessions, delivery_id, now)
        assert found is not None
        verdicts.append(found.status)
        now += LEASE
    assert verdicts == ["processing", "processing", "processing", "dead"]
    with sessions() as s:
        row = s.execute(
            text("SELECT status, dead_reason FROM deliveries WHERE id = :d"), {"d": delivery_id}
        ).one()
    assert tuple(row) == ("dead", "crashed")


def test_replay_only_from_dead_restarts_the_age_clock_and_continues_the_fence(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    delivery_id = new_delivery(sessions, settings)
    found = claim(sessions, delivery_id, T0)
    assert found is not None
    with sessions() as s, s.begin():
        assert not requeue.replay(s, delivery_id, now=T0, publish_grace=timedelta(0))  # not dead
        transitions.kill(s, found, now=T0, reason="permanent", error_class="E", error="boom")
    later = T0 + timedelta(days=3)
    with sessions() as s, s.begin():
        assert requeue.replay(s, delivery_id, now=later, publish_grace=timedelta(0))
        assert not requeue.replay(s, delivery_id, now=later, publish_grace=timedelta(0))  # once
    again = claim(sessions, delivery_id, later)
    assert again is not None
    assert again.attempt == found.attempt + 1  # the fencing token only grows
    assert again.attempts_in_run == 1  # the policy counts from the replay
    assert again.generation == found.generation  # same downstream key
    assert again.first_attempt_at == later  # max age counts from the replay
    assert again.at == later  # decided at the pinned instant
    with sessions() as s:
        dead_at = s.execute(
            text("SELECT dead_at FROM deliveries WHERE id = :d"), {"d": delivery_id}
        ).scalar_one()
    assert dead_at is None  # a replayed delivery is no longer a dead letter
    assert attempts(sessions, delivery_id) == [(1, "dead"), (2, None)]


def test_a_worker_frozen_before_a_replay_cannot_commit_after_it(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    delivery_id = new_delivery(sessions, settings)
    frozen = claim(sessions, delivery_id, T0)  # attempt 1, then the worker freezes
    assert frozen is not None
    later = T0 + LEASE + timedelta(seconds=1)
    taken = claim(sessions, delivery_id, later)  # lease expired: attempt 2
    assert taken is not None
    with sessions() as s, s.begin():
        transitions.kill(s, taken, now=later, reason="permanent", error_class="E", error="x")
    with sessions() as s, s.begin():
        assert requeue.replay(s, delivery_id, now=later, publish_grace=timedelta(0))
    running = claim(sessions, delivery_id, later)  # after the replay: attempt 3, not 1
    assert running is not None
    assert (running.attempt, running.attempts_in_run) == (3, 1)
    with sessions() as s, s.begin(), pytest.raises(transitions.IllegalTransition):
        transitions.succeed(s, frozen, now=later)  # the frozen worker wakes up
    assert attempts(sessions, delivery_id) == [(1, "crashed"), (2, "dead"), (3, None)]
    with sessions() as s, s.begin():
        transitions.succeed(s, running, now=later)  # the live attempt still finishes
    assert attempts(sessions, delivery_id) == [(1, "crashed"), (2, "dead"), (3, "succeeded")]


def test_rerun_only_from_succeeded_and_bumps_the_generation(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    delivery_id = new_delivery(sessions, settings)
    found = claim(sessions, delivery_id, T0)
    assert found is not None
    with sessions() as s, s.begin():
        assert not requeue.rerun(s, delivery_id, now=T0, publish_grace=timedelta(0))  # processing
        transitions.succeed(s, found, now=T0)
        assert requeue.rerun(s, delivery_id, now=T0, publish_grace=timedelta(0))
    again = claim(sessions, delivery_id, T0)
    assert again is not None
    assert again.generation == found.generation + 1
    assert (again.attempt, again.attempts_in_run) == (2, 1)


def test_claim_in_its_partition(sessions: sessionmaker[Session], settings: Settings) -> None:
    import psycopg  # noqa: PLC0415

    delivery_id = new_delivery(sessions, settings)
    with sessions() as s:
        expires_at, generation = s.execute(
            text("SELECT expires_at, generation FROM deliveries WHERE id = :d"),
            {"d": delivery_id},
        ).one()

    def worker_claim(conn: psycopg.Connection[Any], at: datetime) -> transitions.Claim | None:
        claimed = transitions.claim_with_event(
            conn,
            delivery_id,
            generation=generation,
            expires_at=at,
            now=T0,
            lease=LEASE,
            max_redeliveries=3,
            worker="w",
        )
        return None if claimed is None else claimed[0]

    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        wrong = worker_claim(conn, expires_at + timedelta(days=1))
        assert wrong is None
        found = worker_claim(conn, expires_at)
        assert found is not None
        assert found.expires_at == expires_at
    assert attempts(sessions, delivery_id) == [(1, None)]


def test_the_workers_claim_requires_its_generation_and_returns_the_event(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    import psycopg  # noqa: PLC0415

    from models.partitions import leaf_suffix  # noqa: PLC0415

    ids = [new_delivery(sessions, settings) for _ in range(2)]
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        results = []
        for delivery_id, leaf in zip(ids, ("leaf", None), strict=True):
            row = conn.execute(
                "SELECT generation, expires_at FROM deliveries WHERE id = %s", (delivery_id,)
            ).fetchone()
            assert row is not None
            generation, expires_at = row

            def run(gen: int, *, at: datetime = T0, **_: object) -> object:
                return transitions.claim_with_event(
                    conn,
                    delivery_id,  # noqa: B023 (called within this iteration)
                    generation=gen,
                    expires_at=expires_at,  # noqa: B023
                    now=at,
                    lease=LEASE,
                    max_redeliveries=3,
                    worker="w",
                    leaf=None if leaf is None else leaf_suffix(expires_at, "partition"),  # noqa: B023
                )

            assert run(generation + 1) is None  # a message of another generation claims nothing
            claimed = run(generation)
            assert claimed is not None
            found, event = claimed  # type: ignore[misc]
            assert (found.id, found.status, found.attempt) == (delivery_id, "processing", 1)
            assert event.route_found
            assert event.receipt_found
            assert event.handler == "log"
            assert event.payload is not None
            assert event.event_type == "test.event"
            assert run(generation, at=T0 + timedelta(seconds=1)) is None  # live lease
            results.append((found.status, found.attempt, event.handler, event.event_type))
    assert results[0] == results[1]  # on the leaf partitions as on the parents
    assert attempts(sessions, ids[0]) == attempts(sessions, ids[1]) == [(1, None)]


def test_a_finished_delivery_has_no_next_attempt(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    done, dead = new_delivery(sessions, settings), new_delivery(sessions, settings)
    for delivery_id, finish in ((done, "succeed"), (dead, "kill")):
        found = claim(sessions, delivery_id, T0)
        assert found is not None
        with sessions() as s, s.begin():
            if finish == "succeed":
                transitions.succeed(s, found, now=T0)
            else:
                transitions.kill(s, found, now=T0, reason="permanent", error_class="E", error="x")
    with sessions() as s:
        rows = s.execute(
            text(
                "SELECT status, next_attempt_at, lease_until FROM deliveries WHERE id IN (:a, :b)"
            ),
            {"a": done, "b": dead},
        ).all()
    assert sorted(tuple(r) for r in rows) == [("dead", None, None), ("succeeded", None, None)]
    with sessions() as s, s.begin():
        assert requeue.replay(s, dead, now=T0, publish_grace=timedelta(seconds=30))
        due = s.execute(
            text("SELECT next_attempt_at FROM deliveries WHERE id = :d"), {"d": dead}
        ).scalar_one()
    assert due == T0 + timedelta(seconds=30)  # a replay schedules it again


@pytest.mark.parametrize("on_leaf", [True, False])
def test_a_batch_claim_and_success_guard_every_row_on_its_own(
    sessions: sessionmaker[Session], settings: Settings, on_leaf: bool
) -> None:
    """claim_many_with_event / succeed_many (a message of several deliveries): each row is
    claimed, crashed-over or refused by the same guard as alone, and each success is fenced
    by its own attempt."""
    import dataclasses  # noqa: PLC0415

    import psycopg  # noqa: PLC0415

    from models.partitions import leaf_suffix  # noqa: PLC0415

    pending, live, expired, done, stale = (new_delivery(sessions, settings) for _ in range(5))
    assert claim(sessions, live, T0) is not None  # a live lease: refused
    assert claim(sessions, expired, T0 - LEASE) is not None  # its worker died: crashed over
    finished = claim(sessions, done, T0 - LEASE)
    assert finished is not None
    with sessions() as s, s.begin():
        transitions.succeed(s, finished, now=T0 - LEASE)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        wanted = []
        for delivery_id in (pending, live, expired, done, stale):
            row = conn.execute(
                "SELECT generation, expires_at FROM deliveries WHERE id = %s", (delivery_id,)
            ).fetchone()
            assert row is not None
            # ``stale``: the message was published before a re-run (another generation).
            generation = row[0] + (1 if delivery_id == stale else 0)
            wanted.append(transitions.Wanted(delivery_id, generation, row[1]))
        leaf = leaf_suffix(wanted[0].expires_at, "partition") if on_leaf else None
        claimed = transitions.claim_many_with_event(
            conn, wanted, now=T0, lease=LEASE, max_redeliveries=3, worker="w", leaf=leaf
        )
        by_id = {found.id: (found, event) for found, event in claimed}
        assert sorted(by_id) == sorted([pending, expired])
        assert (by_id[pending][0].attempt, by_id[pending][0].redeliveries) == (1, 0)
        assert (by_id[expired][0].attempt, by_id[expired][0].redeliveries) == (2, 1)
        assert all(e.receipt_found and e.handler == "log" for _, e in claimed)
        assert len({found.at for found, _ in claimed}) == 1  # one statement, one instant
        # A fenced-out success (another attempt's number) moves nothing; the others do.
        fenced = dataclasses.replace(by_id[expired][0], attempt=1)
        won = transitions.succeed_many(
            conn,
            [(by_id[pending][0], T0 + timedelta(seconds=1)), (fenced, T0 + timedelta(seconds=1))],
            leaf=leaf,
        )
        assert won == {pending}
        assert transitions.succeed_many(conn, [(by_id[pending][0], T0)], leaf=leaf) == set()
    assert attempts(sessions, pending) == [(1, "succeeded")]
    assert attempts(sessions, expired) == [(1, "crashed"), (2, None)]
    assert attempts(sessions, live) == [(1, None)]
    assert attempts(sessions, stale) == []


def test_compact_drops_comments_and_spaces_outside_quotes_only(
    sessions: sessionmaker[Session],
) -> None:
    """What Postgres reads is unchanged: quoted text keeps its spaces and its ``--``, a
    comment no longer reaches past its line once lines are joined, and escape strings or
    dollar quoting (not parsed here) leave the statement as it was."""
    sql = """
        SELECT 'a  b -- not a comment' AS "odd  name",  -- a comment, 'with a quote
               2 - -1 AS n /* a block
               comment */, 'it''s' AS q
    """
    compacted = statements.compact(sql)
    assert compacted == (
        "SELECT 'a  b -- not a comment' AS \"odd  name\", 2 - -1 AS n , 'it''s' AS q"
    )
    with sessions() as session:
        assert session.execute(text(compacted)).one() == session.execute(text(sql)).one()
    for untouched in ("SELECT E'a\\'  b'", "SELECT $$a  b$$"):
        assert statements.compact(untouched) == untouched


@pytest.mark.parametrize("leaf", [None, "p20261211", "default"], ids=["any", "day", "default"])
def test_the_workers_statements_fit_psycopgs_cache(leaf: str | None) -> None:
    """psycopg converts a statement's placeholders once only when it is at most
    MAX_CACHED_STATEMENT_LENGTH bytes with at most MAX_CACHED_STATEMENT_PARAMS parameters;
    past that it converted the claim and success statements again on every run."""
    built = {
        "claim": transitions._claim_sql(worker=True, leaf=leaf),
        "claim_many": transitions._claim_many_sql(leaf),
        "succeed_many": transitions._succeed_many_sql(leaf),
    }
    for name, sql in built.items():
        assert len(sql.encode()) <= MAX_CACHED_STATEMENT_LENGTH, name
        assert len(set(re.findall(r"%\((\w+)\)s", sql))) <= MAX_CACHED_STATEMENT_PARAMS, name

"""The lanes' members table and the claim's lane trigger (migration 0033, models/lanes.py):
``lane_members`` is the lane as ``deliveries`` holds it after every statement, the claim of a
lane's delivery is checked again under its lane's lock (two connections racing across an
operator's replay never take two deliveries of one key), on the claim's own clock, and the
migration backfills the table and goes down cleanly. Real Postgres, real statements."""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from models import lanes, partitions, requeue, transitions
from models.db import alembic_config, make_engine, make_sessionmaker, upgrade
from tests.conftest import ADMIN_DSN, make_settings
from tests.lanes_support import accept, delivery_of, lane_source
from tests.workers import worker_settings

NOWHERE = "http://127.0.0.1:9/hook"  # never called: these tests run no handler

_OPEN_ROWS = """
    SELECT id, route_id, lane_key, status, lease_until, next_attempt_at, expires_at
    FROM deliveries WHERE lane_key IS NOT NULL
      AND status IN ('pending', 'processing', 'retrying', 'dead')
    ORDER BY id
"""
_MEMBERS = """
    SELECT delivery_id, route_id, lane_key, status, lease_until, next_attempt_at, expires_at
    FROM lane_members ORDER BY delivery_id
"""


def assert_members_match(engine: Engine) -> int:
    """Every unfinished laned delivery is a member, with its status, lease and due time, and
    nothing else is: returns how many."""
    with engine.connect() as conn:
        want = [tuple(r) for r in conn.execute(text(_OPEN_ROWS)).all()]
        have = [tuple(r) for r in conn.execute(text(_MEMBERS)).all()]
    assert have == want
    return len(have)


def claim(session: Session, delivery_id: int, **kw: object) -> transitions.Claim | None:
    return transitions.claim(
        session,
        delivery_id,
        now=kw.get("now"),  # type: ignore[arg-type]
        lease=timedelta(seconds=30),
        max_redeliveries=3,
        worker="lanes-test",
    )


def status_of(engine: Engine, *ids: int) -> list[str]:
    with engine.connect() as conn:
        found = dict(
            conn.execute(
                text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": list(ids)}
            ).all()
        )
    return [str(found[i]) for i in ids]


def test_a_claim_racing_an_older_replayed_one_of_its_lane_never_runs_beside_it(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """--lane-on-dead skip: the first delivery of a key is dead, so the second may run. Its
    claim is made on one connection and not yet committed while, on another, an operator
    replays the first (older: it takes the head back) and claims it: refused (the lane's
    claim is in flight), and once the second's claim commits, refused again (it processes
    under a live lease) until that lease is over on the claim's clock. The members follow
    every step. (0028's guard, reading the claim's snapshot only, took both.)"""
    settings = worker_settings()
    source = lane_source(sessions, NOWHERE, lane_on_dead="skip")
    a = delivery_of(settings, accept(settings, source, {"key": "race", "seq": 0})[1])
    b = delivery_of(settings, accept(settings, source, {"key": "race", "seq": 1})[1])
    with sessions() as session, session.begin():
        assert claim(session, b) is None  # behind a pending head
        first = claim(session, a)
        assert first is not None
        transitions.kill(
            session, first, now=first.at, reason="permanent", error_class="E", error="no"
        )
    assert assert_members_match(engine) >= 2

    holder = sessions()
    try:
        holder.begin()
        second = claim(holder, b)
        assert second is not None  # the dead one does not hold a skip lane
        with sessions() as session, session.begin():
            assert requeue.replay(session, a, now=None, publish_grace=timedelta(0))
        with sessions() as session, session.begin():
            assert claim(session, a) is None  # b's claim holds the lane's lock
        holder.commit()
    finally:
        holder.close()
    assert status_of(engine, a, b) == ["pending", "processing"]
    assert assert_members_match(engine) >= 2
    assert second.lease_until is not None
    with sessions() as session, session.begin():
        assert claim(session, a) is None  # b runs under a live lease
        assert claim(session, a, now=second.lease_until - timedelta(seconds=1)) is None
    with sessions() as session, session.begin():
        again = claim(session, a, now=second.lease_until + timedelta(seconds=1))
        assert again is not None  # b's lease is over on the claim's clock (b's worker died)
    assert status_of(engine, a, b) == ["processing", "processing"]
    assert assert_members_match(engine) >= 2
    with sessions() as session, session.begin():
        transitions.succeed(session, again, now=again.at)
    assert status_of(engine, a, b) == ["succeeded", "processing"]
    assert assert_members_match(engine) >= 1


def test_lane_members_follow_every_end_and_a_dropped_day_takes_its_members(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Each ending (succeeded, retrying, dead, superseded, filtered, discarded) moves the
    members as it moves the deliveries; the next head read and the refused-claim read find
    the lane through them; a day's partition dropped takes its rows' members along."""
    settings = worker_settings()
    source = lane_source(sessions, NOWHERE)
    ids = [
        delivery_of(settings, accept(settings, source, {"key": "ends", "seq": n})[1])
        for n in range(6)
    ]
    lane = (source.route_ids[0], "ends")
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        assert [h.delivery_id for h in lanes.next_heads(raw, [lane], now=None)] == [ids[0]]
        assert set(lanes.waiting(raw, ids, now=None)) == set(ids[1:])
    ends = {
        0: lambda s, f: transitions.succeed(s, f, now=f.at),
        1: lambda s, f: transitions.supersede(s, f, now=f.at, newer_event_id="evt_x"),
        2: lambda s, f: transitions.filter_out(s, f, now=f.at, reason="drop"),
        3: lambda s, f: transitions.kill(s, f, now=f.at, reason="permanent", error_class=None,
                                         error=None),
    }  # fmt: skip
    for n, end in ends.items():
        with sessions() as session, session.begin():
            found = claim(session, ids[n])
            assert found is not None, n
            assert claim(session, ids[n + 1]) is None
            end(session, found)
        assert assert_members_match(engine) >= 1
    assert status_of(engine, *ids[:4]) == ["succeeded", "superseded", "filtered", "dead"]
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        assert lanes.next_heads(raw, [lane], now=None) == []  # a dead letter blocks
        assert lanes.blocked(raw)[lane[0]] == 1
    with sessions() as session, session.begin():
        assert requeue.discard(session, [ids[3]], now=None) == [ids[3]]
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        assert [h.delivery_id for h in lanes.next_heads(raw, [lane], now=None)] == [ids[4]]
    with sessions() as session, session.begin():
        found = claim(session, ids[4])
        assert found is not None
        transitions.retry_later(
            session, found, now=found.at, next_attempt_at=found.at + timedelta(hours=1),
            error_class="E", error="later",
        )  # fmt: skip
    assert assert_members_match(engine) >= 2
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as raw:
        assert lanes.next_heads(raw, [lane], now=None) == []  # not due yet
        assert set(lanes.waiting(raw, ids, now=None)) == {ids[5]}

    # A day dropped whole: its rows' members go with it, the others stay.
    with engine.connect() as conn:
        day = conn.execute(
            text("SELECT expires_at FROM deliveries WHERE id = :id"), {"id": ids[5]}
        ).scalar_one()
        leaf = next(
            p
            for p in partitions.list_partitions(conn)
            if p.table == "deliveries" and p.lower is not None and p.lower <= day < p.upper  # type: ignore[operator]
        )
    ghost = f"lane_ghost_{uuid.uuid4().hex[:8]}"  # stands for the day's leaf, detached
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ghost} (id bigint)"))
        conn.execute(
            text("INSERT INTO lane_members SELECT -1, 0, 'ghost', 'dead', NULL, NULL, :at"),
            {"at": day},
        )
        partitions.drop(conn, partitions.Partition("deliveries", ghost, leaf.lower, leaf.upper))
        left = (
            conn.execute(
                text(
                    "SELECT delivery_id FROM lane_members WHERE delivery_id = ANY(:ids) ORDER BY 1"
                ),
                {"ids": [-1, *ids]},
            )
            .scalars()
            .all()
        )
    assert left == ids[4:]  # the ghost went; the rows still in deliveries stayed
    assert_members_match(engine)


def test_migration_0033_backfills_the_members_and_goes_down_cleanly() -> None:
    """A database with unfinished laned deliveries at 0032 (0028's guard, reading
    ``deliveries``), upgraded: every one is a member, the lane holds as before; downgraded:
    table, triggers and functions gone, 0028's guard back and still holding the lane."""
    name = f"webhooks_lanes_{uuid.uuid4().hex[:8]}"
    settings = make_settings(database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
    config = alembic_config(settings)
    try:
        upgrade(settings)
        command.downgrade(config, "0032")
        engine = make_engine(settings, pool_size=1)
        try:
            sessions = make_sessionmaker(engine)
            source = lane_source(sessions, NOWHERE, settings=settings)
            ids = [
                delivery_of(settings, accept(settings, source, {"key": k, "seq": n})[1])
                for n in range(3)
                for k in ("m", "n")
            ]
            with engine.begin() as conn:  # one of key m processing, as a worker left it
                conn.execute(
                    text("UPDATE deliveries SET status = 'processing', attempts = 1,"
                         " lease_until = now() + interval '1 hour' WHERE id = :id"),
                    {"id": ids[0]},
                )  # fmt: skip
            engine.dispose()
            command.upgrade(config, "head")
            assert assert_members_match(engine) == 6
            with sessions() as session, session.begin():
                assert claim(session, ids[2]) is None  # behind the processing one
                assert claim(session, ids[3]) is None  # behind key n's head
                assert claim(session, ids[1]) is not None  # key n's head
            engine.dispose()
            command.downgrade(config, "0032")
            with engine.connect() as conn:
                assert conn.execute(text("SELECT to_regclass('lane_members')")).scalar() is None
                triggers = conn.execute(
                    text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lane_%'")
                ).scalar_one()
                assert triggers == 0
                clear = conn.execute(
                    text("SELECT webhooks_lane_clear(:r, 'm', :id, now())"),
                    {"r": source.route_ids[0], "id": ids[2]},
                ).scalar_one()
                assert clear is False  # 0028's guard, on deliveries
        finally:
            engine.dispose()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

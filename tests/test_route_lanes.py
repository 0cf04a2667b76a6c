"""Ordered lanes per entity and stale events superseded (issue 37 items 2 and 3; migration
0028, models/lanes.py). Real worker processes, real Postgres and Redis, a real downstream
over loopback that records, per key, the calls it holds at once and their order."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import Dispatch
from core.settings import Settings
from core.states import DeliveryStatus
from models import admission, breaker, lanes, requeue, transitions
from models.catalog import CatalogError, Change
from models.route_catalog import set_lanes
from tasks.publisher import Publisher
from tests import transforms_for_tests
from tests.conftest import REDIS_PORT
from tests.factories import MadeSource, make_source
from tests.lanes_support import accept, delivery_of, lane_source
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.netproxy import CuttableProxy
from tests.operators_support import cli, ops_env, ops_settings
from tests.workers import (
    CLAIMS_URL,
    Broker,
    Worker,
    flush_redis,
    publish_one_message,
    running_worker,
    wait_for,
    worker_settings,
)

# A loaded 2-core machine: a call's I/O timeout well above the downstream's hold, so no
# timeout opens the route's breaker (which would hold every lane).
ROOMY: dict[str, Any] = {
    "handler_io_timeout": 5.0,
    "soft_time_limit": 8.0,
    "hard_time_limit": 10.0,
    "visibility_timeout": 60.0,
}

TRANSFORM_MODULES = ["tests.handlers_for_tests", "tests.transforms_for_tests"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]


class LaneDownstream:
    """Answers each POST after ``hold`` seconds: 422 (permanent) for a body whose ``fail``
    is true, else 200. Records per key the calls it holds at once (their peak), the order
    of the ``seq`` it was sent (each idempotency key once: a repeat after a kill -9 is the
    same call again), every idempotency key, and the peak of calls held overall."""

    def __init__(self, hold: float = 0.01) -> None:
        self.hold = hold
        self.lock = threading.Lock()
        self.in_flight: dict[str, int] = defaultdict(int)
        self.key_peak: dict[str, int] = defaultdict(int)
        self.order: dict[str, list[int]] = defaultdict(list)
        self.seen: set[str] = set()
        self.calls: list[str] = []
        self.event_ids: list[str] = []
        self.holding = 0
        self.peak = 0
        server = self

        class Handler(Quiet):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
                key, idem = str(body.get("key")), str(self.headers.get("idempotency-key"))
                with server.lock:
                    server.calls.append(idem)
                    server.event_ids.append(str(body.get("id")))
                    server.in_flight[key] += 1
                    server.key_peak[key] = max(server.key_peak[key], server.in_flight[key])
                    server.holding += 1
                    server.peak = max(server.peak, server.holding)
                    if idem not in server.seen:
                        server.seen.add(idem)
                        server.order[key].append(int(body.get("seq", -1)))
                time.sleep(server.hold)
                with server.lock:
                    server.in_flight[key] -= 1
                    server.holding -= 1
                self.send_response(422 if body.get("fail") else 200)
                self.send_header("content-length", "0")
                self.end_headers()

        # Every slot of two workers may connect at once: the default backlog (5) drops
        # connections, and a client's SYN retry takes a second.
        self.loopback = Loopback(Handler, "/hook", backlog=512)
        self.url = self.loopback.url

    def close(self) -> None:
        self.loopback.close()


@pytest.fixture
def downstream() -> Iterator[LaneDownstream]:
    server = LaneDownstream()
    yield server
    server.close()


def publish(dispatches: list[Dispatch], per_message: int = 16) -> None:
    for i in range(0, len(dispatches), per_message):
        publish_one_message(dispatches[i : i + per_message])


def statuses(engine: Engine, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
        ).all()
    return {int(r[0]): str(r[1]) for r in rows}


def count_status(engine: Engine, ids: list[int], status: str) -> int:
    return sum(1 for s in statuses(engine, ids).values() if s == status)


def row(engine: Engine, delivery_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT * FROM deliveries WHERE id = :id"), {"id": delivery_id}
        ).one()


def events(
    settings: Settings, source: MadeSource, keys: int, per_key: int, **extra: Any
) -> tuple[list[Dispatch], dict[int, tuple[str, int]]]:
    """``per_key`` events for each of ``keys`` keys, accepted round by round (key 0 seq 0,
    key 1 seq 0, ..., key 0 seq 1, ...): each key's events interleaved with the others'."""
    out, lane_of = [], {}
    # One connection for them all: a connection a call cost this test most of its time.
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        for seq in range(per_key):
            for k in range(keys):
                out.append(accepted(settings, source, conn, f"k{k}", seq, extra))
                lane_of[out[-1].delivery_id] = (f"k{k}", seq)
    return out, lane_of


def accepted(
    settings: Settings,
    source: MadeSource,
    conn: psycopg.Connection[Any],
    key: str,
    seq: int,
    extra: dict[str, Any],
) -> Dispatch:
    """One event of ``key`` accepted on ``conn``; its dispatch as the receiver makes it."""
    body = {"key": key, "seq": seq, **extra}
    event_id, outcome = accept(settings, source, body, conn=conn)
    delivery_id = delivery_of(settings, outcome, conn)
    # What the receiver publishes: only a lane's head (seq 0 here); the rest are
    # published by the end of the one ahead of them.
    assert outcome.delivery_ids == ((delivery_id,) if seq == 0 else ())
    return Dispatch(delivery_id, event_id, source.public_id)


def test_200_keys_by_5_events_run_one_at_a_time_per_key_in_order_and_keys_in_parallel(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream, tmp_path: Path
) -> None:
    """1,000 events over 200 keys, published in messages of 16 as the receiver does, run by
    two worker processes: never two calls of one key at once (across both processes), each
    key's events in the order accepted, different keys at once, each event called once."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url)
    dispatches, lane_of = events(settings, source, keys=200, per_key=5)
    ids = [d.delivery_id for d in dispatches]
    with engine.connect() as conn:
        keyed = conn.execute(
            text("SELECT count(*) FROM deliveries WHERE id = ANY(:ids) AND lane_key LIKE 'k%'"),
            {"ids": ids},
        ).scalar_one()
    assert keyed == 1000  # the receiver's key, written by the accept
    publish([d for d in dispatches if lane_of[d.delivery_id][1] == 0])  # as the receiver
    common = {"pool": "threads", "concurrency": 8, "route_max_in_flight": 64, **ROOMY}
    with (
        running_worker("lanes-a", tmp_path, **common),
        running_worker("lanes-b", tmp_path, **common),
    ):
        wait_for(
            lambda: count_status(engine, ids, "succeeded") == 1000,
            timeout=240,
            what="1,000 ordered deliveries succeeded",
        )
    assert max(downstream.key_peak.values()) == 1, "two calls of one key at once"
    assert len(downstream.order) == 200
    assert all(order == [0, 1, 2, 3, 4] for order in downstream.order.values())
    assert downstream.peak > 1, "different keys never ran at once"
    assert len(downstream.calls) == 1000 == len(set(downstream.calls))  # each once


def test_a_lanes_next_head_takes_its_predecessors_slot_so_the_route_keeps_its_budget(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """A laned route with an in-flight budget of 2 and 8 keys x 3 events, the heads offered
    through admission as the receiver does (2 admitted, 6 waiting): each next head is
    published in its predecessor's admission slot, so the downstream never holds more than
    2 calls of the route at once while the dispatcher admits the waiting heads as slots
    free, every key runs in order, and the route's in-flight set ends empty (no head left
    counted, none counted twice). Before the hand-over, a next head went out beside
    admission: the dispatcher filled the slot its predecessor left with a waiting head, and
    the route ran 3 and more calls at once."""
    downstream = LaneDownstream(hold=0.15)
    try:
        settings = worker_settings()
        source = lane_source(sessions, downstream.url)
        (route_id,) = source.route_ids
        with sessions() as s, s.begin():
            breaker.set_limits(s, route_id, Change("test", "limits"), max_in_flight=2, now=None)
        dispatches, lane_of = events(settings, source, keys=8, per_key=3)
        ids = [d.delivery_id for d in dispatches]
        gate = admission.Admission(redis.Redis.from_url(CLAIMS_URL))
        publisher = Publisher(settings)
        try:
            with running_worker("budget", tmp_path, pool="threads", concurrency=8, **ROOMY):
                publisher.submit("heads", [d for d in dispatches if lane_of[d.delivery_id][1] == 0])
                wait_for(
                    lambda: count_status(engine, ids, "succeeded") == 24,
                    timeout=120,
                    what="24 ordered deliveries succeeded",
                )
                wait_for(
                    lambda: gate.counts(route_id) == (0, 0),
                    timeout=30,
                    what="the route's in-flight and waiting sets empty",
                )
        finally:
            publisher.close()
            gate.client.close()
    finally:
        downstream.close()
    assert downstream.peak <= 2, "the route ran past its in-flight budget of 2"
    assert all(order == [0, 1, 2] for order in downstream.order.values())
    assert len(downstream.order) == 8
    assert len(downstream.calls) == 24 == len(set(downstream.calls))  # each once


def test_a_next_head_whose_publish_fails_with_the_broker_down_is_published_by_the_sweeper(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The worker reaches its broker (Redis) through a proxy that is cut while a lane's
    first call is in flight: the end commits, the next head's publish fails (one line, no
    traceback), and the head leaves the admission slot it was handed, so once the broker is
    back the sweeper publishes it: the lane finishes in order, each event called once, and
    the worker logs no traceback for the lost broker."""
    downstream = LaneDownstream(hold=1.0)
    proxy = CuttableProxy(REDIS_PORT)
    broker = Broker(worker_settings())
    try:
        settings = worker_settings()
        source = lane_source(sessions, downstream.url)
        ids = [
            delivery_of(settings, accept(settings, source, {"key": "k", "seq": n})[1])
            for n in range(2)
        ]
        publish([Dispatch(ids[0])])
        cut_broker = {"broker_url": f"redis://127.0.0.1:{proxy.port}/10"}
        with running_worker(
            "cut", tmp_path, pool="threads", concurrency=4, **cut_broker, **ROOMY
        ) as worker:
            wait_for(lambda: len(downstream.calls) == 1, timeout=30, what="the first call")
            proxy.cut()
            wait_for(
                lambda: "delivery.lane_publish_failed" in _events(worker),
                timeout=60,
                what="the next head's publish to fail",
            )
            assert statuses(engine, ids) == {ids[0]: "succeeded", ids[1]: "pending"}
            proxy.restore()

            def swept() -> bool:
                broker.sweep()
                return row(engine, ids[1]).status == "succeeded"

            wait_for(swept, timeout=90, what="the sweeper to publish the head", interval=1.0)
            (failed,) = [
                line
                for line in worker.json_lines()
                if line.get("event") == "delivery.lane_publish_failed"
            ]
            assert "exception" not in failed, failed  # a handled condition: no traceback
            # The thread pool cannot cancel a running task on the broker's loss: not asked to.
            assert "NotImplementedError" not in worker.output()
    finally:
        broker.close()
        proxy.close()
        downstream.close()
    assert downstream.order["k"] == [0, 1]
    assert len(downstream.calls) == 2 == len(set(downstream.calls))


def test_a_dead_event_blocks_only_its_own_key_and_no_attempt_is_spent_waiting(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream, tmp_path: Path
) -> None:
    """--lane-on-dead block: key ``bad``'s first event is refused by the downstream (dead);
    its second waits in its lane (never called, no attempt spent) while key ``good`` runs in
    order; the lane counts as blocked; discarding the dead one lets the next run."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url, lane_on_dead="block")
    plan = [("bad", 0, True), ("good", 0, False), ("bad", 1, False), ("good", 1, False)]
    ids = []
    for key, seq, fail in plan:
        _, outcome = accept(settings, source, {"key": key, "seq": seq, "fail": fail})
        ids.append(delivery_of(settings, outcome))
    bad0, good0, bad1, good1 = ids
    publish([Dispatch(i) for i in ids], per_message=1)
    with running_worker("block", tmp_path, pool="threads", concurrency=4):
        wait_for(
            lambda: (
                statuses(engine, [bad0, good0, good1])
                == {bad0: "dead", good0: "succeeded", good1: "succeeded"}
            ),
            timeout=60,
            what="the good key done and the bad key's first dead",
        )
        # The sweeper's pick, made due an hour ahead: lane heads only, so not bad1.
        with sessions() as session, session.begin():
            picked = requeue.due_for_publish(
                session,
                now=datetime.now(UTC) + timedelta(hours=1),
                grace=timedelta(seconds=1),
                limit=100,
            )
        assert bad1 not in {p.delivery_id for p in picked}
        broker = Broker(settings)
        try:
            assert row(engine, bad1).status == "pending"
            assert row(engine, bad1).attempts == 0  # refused by its lane: no attempt spent
            assert downstream.order["bad"] == [0]  # bad1 never called
            assert downstream.order["good"] == [0, 1]
            with engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert raw is not None
                assert lanes.blocked(raw).get(source.route_ids[0]) == 1
            with sessions() as session, session.begin():
                assert requeue.discard(session, [bad0], now=None) == [bad0]
            # The operator's discard opened the lane: the sweep finds its head.
            broker.sweep()
            wait_for(lambda: row(engine, bad1).status == "succeeded", timeout=60, what="bad1 ran")
        finally:
            broker.close()
    assert downstream.order["bad"] == [0, 1]
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        assert source.route_ids[0] not in lanes.blocked(raw)


def test_skip_lets_a_dead_events_successors_run_and_a_replay_retakes_its_place(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream, tmp_path: Path
) -> None:
    """--lane-on-dead skip: the dead first event no longer holds its lane, so the next runs
    (published at once by the end of the one before, no sweep needed)."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url, lane_on_dead="skip")
    ids = []
    for seq, fail in ((0, True), (1, False), (2, False)):
        _, outcome = accept(settings, source, {"key": "k", "seq": seq, "fail": fail})
        ids.append(delivery_of(settings, outcome))
    publish([Dispatch(i) for i in ids], per_message=1)
    with running_worker(
        "skip", tmp_path, pool="threads", concurrency=4, sweep_interval=timedelta(hours=1)
    ):
        wait_for(
            lambda: (
                statuses(engine, ids) == {ids[0]: "dead", ids[1]: "succeeded", ids[2]: "succeeded"}
            ),
            timeout=60,
            what="the dead one skipped",
        )
    assert downstream.order["k"] == [0, 1, 2]
    assert max(downstream.key_peak.values()) == 1


def test_a_delivery_its_transform_drops_publishes_its_lanes_next_head_at_once(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream, tmp_path: Path
) -> None:
    """A lane's first event dropped by the route's transform (filtered, the handler never
    called): the worker that ended it publishes the lane's next head right after, as any
    other ending does (LANE_MOVES), so the lane drains with no sweep (the sweeper runs
    hourly here) and only the first delivery is ever published from outside."""
    settings = worker_settings(handler_modules=TRANSFORM_MODULES)
    source = lane_source(sessions, downstream.url, transform=transforms_for_tests.reshape.__name__)
    ids = []
    for seq in range(3):
        body = {"key": "t", "seq": seq, "data": {"n": seq, "drop": seq == 0}}
        ids.append(delivery_of(settings, accept(settings, source, body)[1]))
    publish([Dispatch(ids[0])])
    with running_worker(
        "filtered",
        tmp_path,
        pool="threads",
        concurrency=4,
        sweep_interval=timedelta(hours=1),
        handler_modules=TRANSFORM_MODULES,
    ):
        wait_for(
            lambda: (
                statuses(engine, ids)
                == {ids[0]: "filtered", ids[1]: "succeeded", ids[2]: "succeeded"}
            ),
            timeout=60,
            what="the lane drained past its filtered head",
        )
    assert len(downstream.calls) == 2  # the dropped one never called
    assert max(downstream.key_peak.values()) == 1


def test_a_kill_9_mid_lane_and_a_redis_flush_keep_order_and_once_only(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """A worker killed with -9 while calls of many lanes are in flight, then Redis (broker,
    claims, admission) flushed: a new worker and the sweeper finish every lane, each key's
    events in order, no two calls of one key at once, and every event has one success (a
    call repeated after the kill carries the same idempotency key)."""
    downstream = LaneDownstream(hold=0.3)
    try:
        settings = worker_settings()
        source = lane_source(sessions, downstream.url)
        dispatches, _ = events(settings, source, keys=20, per_key=4)
        ids = [d.delivery_id for d in dispatches]
        publish(dispatches)  # every one (the heads, and copies of the others: refused)
        with running_worker("kill", tmp_path, pool="threads", concurrency=8) as worker:
            wait_for(lambda: len(downstream.calls) >= 25, timeout=60, what="lanes under way")
            worker.kill_all()
        flush_redis()
        with running_worker("after", tmp_path, pool="threads", concurrency=8):
            broker = Broker(settings)
            try:

                def done() -> bool:
                    broker.sweep()
                    return count_status(engine, ids, "succeeded") == len(ids)

                wait_for(done, timeout=180, what="every lane finished", interval=1.0)
            finally:
                broker.close()
        assert all(order == [0, 1, 2, 3] for order in downstream.order.values())
        assert len(downstream.order) == 20
        assert max(downstream.key_peak.values()) == 1
        assert len(downstream.seen) == len(ids)  # one idempotency key per event
        with engine.connect() as conn:
            successes = conn.execute(
                text(
                    "SELECT count(*) FROM attempts WHERE delivery_id = ANY(:ids)"
                    " AND outcome = 'succeeded'"
                ),
                {"ids": ids},
            ).scalar_one()
        assert successes == len(ids)
    finally:
        downstream.close()


def test_supersede_records_an_older_event_after_a_newer_one_and_never_calls_it(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream, tmp_path: Path
) -> None:
    """Key ``a``: the newer event accepted first, then an older one: the older is recorded
    superseded (naming the newer event) and its handler never called; counted per route.
    Key ``b``: older then newer: both delivered, in order. A superseded event named by its
    id is replayed on purpose, and then delivered."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url, supersede=True)
    t = datetime.now(UTC).replace(microsecond=0)
    newer_a, out_newer_a = accept(settings, source, {"key": "a", "seq": 1}, occurred_at=t)
    older_a, out_older_a = accept(
        settings, source, {"key": "a", "seq": 0}, occurred_at=t - timedelta(minutes=5)
    )
    _, out_older_b = accept(
        settings, source, {"key": "b", "seq": 0}, occurred_at=t - timedelta(minutes=5)
    )
    _, out_newer_b = accept(settings, source, {"key": "b", "seq": 1}, occurred_at=t)
    ids = [
        delivery_of(settings, out_newer_a),
        delivery_of(settings, out_older_a),
        delivery_of(settings, out_older_b),
        delivery_of(settings, out_newer_b),
    ]
    publish([Dispatch(i) for i in ids], per_message=1)
    with running_worker("supersede", tmp_path, pool="threads", concurrency=4):
        want = {ids[0]: "succeeded", ids[1]: "superseded", ids[2]: "succeeded", ids[3]: "succeeded"}
        wait_for(lambda: statuses(engine, ids) == want, timeout=60, what="supersede decided")
        superseded = row(engine, ids[1])
        assert superseded.last_error == f"superseded by event {newer_a}"
        assert superseded.last_error_class == "superseded"
        assert older_a not in downstream.event_ids  # its handler never called
        assert downstream.order["a"] == [1]
        assert downstream.order["b"] == [0, 1]
        # Replayed on purpose (named by its id): it runs now, whatever is newer.
        with sessions() as session, session.begin():
            moved = requeue.replay_many(
                session,
                [(ids[1], DeliveryStatus.SUPERSEDED)],
                now=None,
                publish_grace=timedelta(seconds=0),
            )
        assert moved == {ids[1]}
        with sessions() as session, session.begin():
            session.execute(
                text("UPDATE routes SET supersede = false WHERE id = :r"),
                {"r": source.route_ids[0]},
            )
        broker = Broker(settings)
        try:
            broker.publish(ids[1])
        finally:
            broker.close()
        wait_for(lambda: row(engine, ids[1]).status == "succeeded", timeout=60, what="replayed")
    assert older_a in downstream.event_ids


def test_supersede_needs_an_order_key_and_a_signed_event_time(
    sessions: sessionmaker[Session],
) -> None:
    """--supersede without --order-key, or on a source whose provider signs no event time
    (GitHub), is refused with one line, and nothing is saved."""
    settings = worker_settings()
    with pytest.raises(CatalogError, match="needs --order-key"):
        make_source(sessions, settings, routes=[{"handler": "log", "supersede": True}])
    with pytest.raises(CatalogError, match="github events carry no event time"):
        make_source(
            sessions,
            settings,
            provider="github",
            routes=[{"handler": "log", "order_key": "body.id", "supersede": True}],
        )
    with pytest.raises(CatalogError, match="order key refused at position"):
        make_source(sessions, settings, routes=[{"handler": "log", "order_key": "body.("}])


def test_a_changed_order_key_is_stale_for_an_accept_judged_before(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream
) -> None:
    """An accept that did not compute a route's order key as it now stands writes nothing
    and answers stale (the receiver reads its routes again), as for a filter."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url)
    _, outcome = accept(settings, source, {"key": "x"}, judged=False)
    assert outcome.status == "stale"
    with sessions() as session, session.begin():
        change = Change("test", "key changed")
        set_lanes(session, source.route_ids[0], change, order_key="body.other", now=None)
    _, outcome = accept(settings, source, {"key": "x", "other": "y"})
    assert outcome.status == "accepted"
    assert row(engine, outcome.delivery_ids[0]).lane_key == "y"
    _, outcome = accept(settings, source, {"key": "x"})  # no value: unordered
    assert row(engine, outcome.delivery_ids[0]).lane_key is None


def test_two_concurrent_claims_never_take_two_deliveries_of_one_lane(
    engine: Engine, sessions: sessionmaker[Session], downstream: LaneDownstream
) -> None:
    """The claim statement itself, raced: for 40 lanes of two pending deliveries each, two
    threads on two connections claim the first and the second of a lane at the same
    instant (a barrier), in both orders: the second is never claimed while the first is
    unfinished; the first always is."""
    settings = worker_settings()
    source = lane_source(sessions, downstream.url)
    pairs = []
    for k in range(40):
        a = delivery_of(settings, accept(settings, source, {"key": f"r{k}", "seq": 0})[1])
        b = delivery_of(settings, accept(settings, source, {"key": f"r{k}", "seq": 1})[1])
        pairs.append((a, b))

    def claim(delivery_id: int, barrier: threading.Barrier, out: dict[int, bool]) -> None:
        with sessions() as session, session.begin():
            barrier.wait()
            found = transitions.claim(
                session,
                delivery_id,
                now=None,
                lease=timedelta(seconds=30),
                max_redeliveries=3,
                worker="race",
            )
            out[delivery_id] = found is not None

    for n, (a, b) in enumerate(pairs):
        barrier, out = threading.Barrier(2), {}
        order = (b, a) if n % 2 else (a, b)
        threads = [threading.Thread(target=claim, args=(i, barrier, out)) for i in order]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert out == {a: True, b: False}, (a, b, out)


def test_the_cli_refuses_supersede_on_an_unsigned_time_and_shows_the_lanes(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """``routes add --supersede`` on a GitHub source (no signed event time): one line saying
    so, exit 1, nothing saved; an ordered route's lanes in ``routes show`` and ``routes list
    --json``."""
    ops = ops_settings()
    env = ops_env()
    github = make_source(sessions, ops, provider="github", routes=[])
    remember(github.secret)
    refused = cli(
        "routes", "add", github.public_id, "--handler", "log", "--order-key", "body.id",
        "--supersede", env=env,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0, refused.stderr  # one line
    assert "--supersede refused: github events carry no event time" in refused.stderr
    with engine.connect() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM routes WHERE source_id = :s"), {"s": github.id}
        ).scalar_one()
    assert count == 0
    stripe = make_source(sessions, ops, provider="stripe", routes=[])
    remember(stripe.secret)
    added = cli(
        "routes", "add", stripe.public_id, "--handler", "log", "--order-key",
        "body.data.object.customer", "--supersede", "--lane-on-dead", "skip", "--json", env=env,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    route = orjson.loads(added.stdout)
    assert (route["order_key"], route["lane_on_dead"], route["supersede"]) == (
        "body.data.object.customer",
        "skip",
        True,
    )
    shown = cli("routes", "show", str(route["id"]), env=env)
    assert "lanes: order key body.data.object.customer, on dead: skip, supersede" in shown.stdout
    listed = orjson.loads(cli("routes", "list", stripe.public_id, "--json", env=env).stdout)
    assert listed[0]["order_key"] == "body.data.object.customer"


def _events(worker: Worker) -> list[Any]:
    return [line.get("event") for line in worker.json_lines()]

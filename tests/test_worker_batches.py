"""Several deliveries in one message (issue 12, tasks.pipeline): each keeps its own attempt,
retry and dead-letter fate, its effect happens once through kill -9 before and after the
batch's success commit, a stuck handler fails alone at the hard limit, and two workers
racing copies of one batch with the fast tier down still give one success each. Real
``celery -A tasks worker`` processes on the default pool unless a test names one; real
Postgres and Redis; messages published by the receiver's own publisher."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import DELIVERIES_QUEUE
from tasks.runtime import build_runtime
from tasks.sweeper import sweep_once
from tests.factories import accept_event, make_source
from tests.handlers_for_tests import KILL_AFTER_COMMIT_DIR
from tests.workers import (
    BROKER_URL,
    attempts,
    delivery,
    effects,
    new_dispatches,
    publish_one_message,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]


def _calls(marker_dir: Path, delivery_id: int) -> list[tuple[int, str]]:
    """The ``touch`` handler's calls of one delivery: (attempt, idempotency key)."""
    return sorted(
        (int(p.name.split(".")[1]), p.read_text()) for p in marker_dir.glob(f"{delivery_id}.*")
    )


def test_each_delivery_of_a_batch_keeps_its_own_fate(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    marks = str(tmp_path)
    effect, touched, flaky, doomed = new_dispatches(
        sessions,
        [
            ("effect", {}),
            ("touch", {"marker_dir": marks}),
            ("flaky_n", {"failures": "2"}),
            ("permanent", {}),
        ],
    )
    publish_one_message([effect, touched, flaky, doomed])
    with running_worker("fates", tmp_path) as worker:
        done = [wait_status(engine, d.delivery_id, "succeeded") for d in (effect, touched, flaky)]
        dead = wait_status(engine, doomed.delivery_id, "dead")
        assert worker.alive()

    assert [row.attempts for row in done] == [1, 1, 3]
    assert len(effects(engine, effect.delivery_id)) == 1
    assert [a for a, _ in _calls(tmp_path, touched.delivery_id)] == [1]
    flaky_tries = attempts(engine, flaky.delivery_id)
    assert [(a.number, a.outcome) for a in flaky_tries] == [
        (1, "retry"),
        (2, "retry"),
        (3, "succeeded"),
    ]
    assert len(effects(engine, flaky.delivery_id)) == 1
    assert (dead.attempts, dead.dead_reason) == (1, "permanent")
    assert [a.outcome for a in attempts(engine, doomed.delivery_id)] == ["dead"]
    # One claim statement and one success statement served the batch: the first attempts
    # of all four share the claim's instant, and the two recorded together their end.
    firsts = {
        d.delivery_id: attempts(engine, d.delivery_id)[0] for d in (effect, touched, flaky, doomed)
    }
    assert len({a.started_at for a in firsts.values()}) == 1
    assert len({a.worker for a in firsts.values()}) == 1


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_kill_9_mid_batch_then_each_effect_exactly_once(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, pool: str
) -> None:
    """kill -9 of the worker (and, under prefork, its pool child with it) while every
    handler of a batch is running: a second worker and the sweeper finish each delivery,
    its database effect once, its outside effect with one idempotency key."""
    marks = tmp_path / "marks"
    marks.mkdir()
    slow = [("slow_effect", {"marker_dir": str(marks), "sleep": "2"})] * 3
    touch = [("touch", {"marker_dir": str(marks), "sleep": "2"})] * 2
    batch = new_dispatches(sessions, slow + touch)
    ids = [d.delivery_id for d in batch]
    publish_one_message(batch)
    with running_worker("doomed", tmp_path, pool=pool) as doomed:
        wait_for(
            lambda: all(list(marks.glob(f"{i}.1.*")) for i in ids),
            timeout=30,
            what="every handler of the batch to start",
        )
        doomed.kill_all()
        assert [delivery(engine, i).status for i in ids] == ["processing"] * 5
    with running_worker("rescuer", tmp_path, pool=pool), running_beat(tmp_path):
        rows = [wait_status(engine, i, "succeeded", timeout=90) for i in ids]

    assert [(r.attempts, r.redeliveries) for r in rows] == [(2, 1)] * 5
    for i in ids:
        assert [(a.number, a.outcome) for a in attempts(engine, i)] == [
            (1, "crashed"),
            (2, "succeeded"),
        ]
    for d in batch[:3]:
        assert [e.attempt for e in effects(engine, d.delivery_id)] == [2]
    for d in batch[3:]:
        calls = _calls(marks, d.delivery_id)
        assert [a for a, _ in calls] == [1, 2]
        assert len({key for _, key in calls}) == 1  # the downstream sees one key


def test_kill_9_after_the_batch_success_commit_before_the_ack(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The worker dies right after one statement recorded the batch's successes, before the
    broker ack: the copy a redelivery brings finds every delivery done and calls nothing."""
    marks = tmp_path / "marks"
    marks.mkdir()
    kills = tmp_path / "kills"
    kills.mkdir()
    batch = new_dispatches(sessions, [("touch", {"marker_dir": str(marks)})] * 4)
    ids = [d.delivery_id for d in batch]
    publish_one_message(batch)
    with running_worker(
        "committer", tmp_path, extra_env={KILL_AFTER_COMMIT_DIR: str(kills)}
    ) as worker:
        wait_for(lambda: list(kills.glob("*.killed")), timeout=30, what="the kill")
        wait_for(lambda: not worker.alive(), timeout=30, what="the worker to die")
    rows = [delivery(engine, i) for i in ids]
    assert [(r.status, r.attempts) for r in rows] == [("succeeded", 1)] * 4
    publish_one_message(batch)  # the copy a redelivery brings
    with running_worker("second", tmp_path) as second:

        def skipped() -> bool:
            return any(
                line.get("event") == "delivery.not_claimed" and line.get("delivery_id") == ids[-1]
                for line in second.json_lines()
            )

        wait_for(skipped, timeout=30, what="the copy to be skipped")
    for i in ids:
        assert [a for a, _ in _calls(marks, i)] == [1]
        assert [(a.number, a.outcome) for a in attempts(engine, i)] == [(1, "succeeded")]
        assert delivery(engine, i).succeeded_at == rows[ids.index(i)].succeeded_at


@pytest.mark.parametrize("pool", ["threads", "prefork", "gevent"])
def test_a_stuck_handler_fails_alone_at_the_hard_limit(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, pool: str
) -> None:
    """One handler of a batch never returns (and swallows the soft limit): under every pool
    it is stopped at the hard limit (3 s) and its delivery retried, while its batch-mates'
    successes are recorded long before, with one attempt each."""
    marks = str(tmp_path)
    batch = new_dispatches(
        sessions,
        [("hang_once", {}), ("effect", {}), ("touch", {"marker_dir": marks}), ("effect", {})],
    )
    stuck, *mates = batch
    publish_one_message(batch)
    with running_worker("stuck-batch", tmp_path, pool=pool) as worker:
        row = wait_status(engine, stuck.delivery_id, "succeeded", timeout=60)
        assert worker.alive()
    tries = attempts(engine, stuck.delivery_id)
    assert [(a.number, a.outcome) for a in tries] == [(1, "retry"), (2, "succeeded")]
    assert tries[0].error_message.startswith("hard_time_limit: hard time limit (3.0s)")
    assert 2.6 <= (tries[0].ended_at - tries[0].started_at).total_seconds() <= 4.5
    assert (row.attempts, row.redeliveries) == (2, 0)
    assert [e.attempt for e in effects(engine, stuck.delivery_id)] == [2]
    for mate in mates:
        [only] = attempts(engine, mate.delivery_id)
        assert only.outcome == "succeeded"
        assert only.ended_at < tries[0].ended_at  # not held back by the stuck one


def test_two_workers_racing_copies_of_a_batch_with_redis_down_give_one_success_each(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The fast tier unreachable (fail open, degraded): two workers claim copies of the same
    batch at once in Postgres; each row is claimed once, each effect written once."""
    down = {"redis_url": "redis://127.0.0.1:1/0", "redis_socket_timeout": 0.2}
    batch = new_dispatches(
        sessions, [("slow_effect", {"marker_dir": str(tmp_path), "sleep": "0.5"})] * 6
    )
    ids = [d.delivery_id for d in batch]
    publish_one_message(batch, copies=6)
    with (
        running_worker("racer-a", tmp_path, **down) as a,
        running_worker("racer-b", tmp_path, **down) as b,
    ):
        rows = [wait_status(engine, i, "succeeded", timeout=60) for i in ids]
        wait_for(
            lambda: redis.Redis.from_url(BROKER_URL).llen(DELIVERIES_QUEUE) == 0,
            timeout=30,
            what="every copy to be taken",
        )
        degraded = [
            line for w in (a, b) for line in w.json_lines() if line.get("event") == "claim.degraded"
        ]
        assert degraded
    for i, row in zip(ids, rows, strict=True):
        assert len(effects(engine, i)) == 1
        assert row.attempts == 1
        assert [a.outcome for a in attempts(engine, i)] == ["succeeded"]


def test_the_sweeper_publishes_its_pick_in_messages_of_several_ids_a_lost_lease_alone(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The sweeper's pick (messages lost, retries due) goes out as the receiver's does: in
    messages of up to WEBHOOKS_DELIVERY_BATCH ids, so a worker pays its per-message cost once
    per message. A delivery whose worker died holding its lease goes alone, so that a handler
    that kills its worker takes no batch-mate with it next time."""
    # Admission off: the pick is published whole. The pick is exactly these 40 rows: the
    # oldest due first (rows earlier tests of this process left due come after them).
    settings = worker_settings(admission=False, sweep_batch=40)
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    ids = [accept_event(settings, source)[1].delivery_ids[0] for _ in range(40)]
    crashed = ids.pop()
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE deliveries SET next_attempt_at = now() - interval '10 years'"
                 " WHERE id = ANY(:ids)"),
            {"ids": [*ids, crashed]},
        )  # fmt: skip
        conn.execute(
            text("UPDATE deliveries SET status = 'processing',"
                 " lease_until = now() - interval '1 second' WHERE id = :id"),
            {"id": crashed},
        )  # fmt: skip
    rt = build_runtime(settings)
    messages: list[list[int]] = []
    try:
        sweep_once(rt, lambda group: messages.append([d.delivery_id for d in group]))
    finally:
        rt.close()
    assert messages.count([crashed]) == 1
    # (A breaker probe of a route an earlier test left open would be a message of its own.)
    grouped = [m for m in messages if set(m) & set(ids)]
    assert sorted(i for m in grouped for i in m) == sorted(ids)  # each once
    batch = settings.deliveries_per_message
    assert len(grouped) == -(-len(ids) // batch)  # 39 ids at 16: 13, 13, 13
    assert max(len(m) for m in grouped) <= batch
    with engine.begin() as conn:  # no later sweep of this test process picks them up
        conn.execute(
            text("UPDATE deliveries SET status = 'discarded' WHERE id = ANY(:ids)"),
            {"ids": [*ids, crashed]},
        )

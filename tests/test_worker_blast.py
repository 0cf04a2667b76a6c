"""A small blast radius (issue 23, item 5): a handler stuck past what the pool can interrupt
gets its worker killed by the watchdog, which names it first (tasks.crashes), so only it
spends its crash budget (``max_redeliveries``) and ends dead as ``crashed``, while the
innocent deliveries killed with it succeed with their budget untouched. A kill -9 from
outside names nobody (every redelivery counts, as before), but the requeued copy of a batch
then runs each of its deliveries alone. Real ``celery -A tasks worker`` processes, a real
``celery -A tasks beat``, real Postgres and Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import Dispatch
from tasks.publisher import Publisher
from tests.workers import (
    Worker,
    attempts,
    delivery,
    new_dispatches,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

# The stuck delivery gets two crashes: the first beside its batch-mates, the second alone.
BUDGET = {"max_redeliveries": 2}


def _publish(dispatches: list[Dispatch]) -> None:
    """Through the receiver's publisher: deliveries published together are one message."""
    publisher = Publisher(worker_settings(**BUDGET))
    try:
        publisher.publish_sync(dispatches)
    finally:
        publisher.close()
        publisher.app.close()


def _killed_by_watchdog(worker: Worker) -> dict[str, Any]:
    """Wait for the worker's watchdog to kill it; its kill line."""
    wait_for(lambda: not worker.alive(), timeout=30, what="the watchdog to kill the worker")
    [line] = [
        line
        for line in worker.json_lines()
        if line.get("event") in ("worker.handler_stuck", "worker.event_loop_blocked")
    ]
    return line


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_stuck_handler_spends_only_its_own_crash_budget(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path, pool: str
) -> None:
    """``wedge`` blocks in a C call on every attempt: its worker's watchdog kills the worker
    each time. The three ``touch`` deliveries in flight on that worker at the first kill are
    killed with it. Only the stuck one's redeliveries count: it is isolated (republished
    alone), killed a second worker alone, and goes dead as ``crashed`` at its own limit (2);
    the others succeed with no redelivery counted, never dead.

    gevent: the innocents share the stuck one's message (its batch-mates), frozen mid-handler
    by the blocked event loop. threads: a batch-mate of the stuck one finishes long before the
    kill at 1.5 x the hard limit, so the innocents in flight then are another message's,
    started once the stuck handler passed its soft limit (2.5 s)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    [stuck] = new_dispatches(sessions, [("wedge", {"marker_dir": str(marks)})], **BUDGET)
    innocents = new_dispatches(
        sessions, [("touch", {"marker_dir": str(marks), "sleep": "2.2"})] * 3, **BUDGET
    )
    ids = [d.delivery_id for d in innocents]
    with running_worker("first", tmp_path, pool=pool, **BUDGET) as first:
        if pool == "gevent":
            _publish([stuck, *innocents])
        else:
            _publish([stuck])
            wait_for((marks / f"{stuck.delivery_id}.1.soft").exists, timeout=30, what="soft")
            _publish(innocents)
            wait_for(
                lambda: all(list(marks.glob(f"{i}.1.*")) for i in ids),
                timeout=10,
                what="the innocents to start",
            )
        kill = _killed_by_watchdog(first)
        assert kill["suspects"] == [stuck.delivery_id]
        assert kill["bystanders"] == 3
        marked = [line for line in first.json_lines() if line.get("event") == "worker.crash_marked"]
        assert [(m["suspects"], sorted(m["bystanders"]), m["marked"]) for m in marked] == [
            ([stuck.delivery_id], ids, 4)
        ]
    assert [delivery(engine, i).status for i in [stuck.delivery_id, *ids]] == ["processing"] * 4

    # The sweeper republishes each lease-expired row alone: the stuck one kills a second
    # worker, alone this time; the innocents succeed (their first attempt crashed, uncounted).
    with (
        running_worker("second", tmp_path, pool=pool, **BUDGET) as second,
        running_beat(tmp_path, **BUDGET),
    ):
        wait_for((marks / f"{stuck.delivery_id}.2.wedged").exists, timeout=60, what="attempt 2")
        again = _killed_by_watchdog(second)
        assert again["suspects"] == [stuck.delivery_id]
    with running_worker("third", tmp_path, pool=pool, **BUDGET), running_beat(tmp_path, **BUDGET):
        dead = wait_status(engine, stuck.delivery_id, "dead", timeout=60)
        rows = [wait_status(engine, i, "succeeded", timeout=60) for i in ids]

    assert (dead.dead_reason, dead.redeliveries) == ("crashed", 2)
    assert [(a.number, a.outcome) for a in attempts(engine, stuck.delivery_id)] == [
        (1, "crashed"),
        (2, "crashed"),
    ]
    assert not list(marks.glob(f"{stuck.delivery_id}.3.*"))  # dead at the claim: never run
    for i, row in zip(ids, rows, strict=True):
        assert row.redeliveries == 0  # old rule: 1 each (a crash counted for a bystander)
        assert row.dead_at is None
        tries = attempts(engine, i)
        assert tries[0].outcome == "crashed"
        assert tries[-1].outcome == "succeeded"
        assert {a.outcome for a in tries} <= {"crashed", "succeeded"}


def test_after_a_kill_9_from_outside_the_batch_copy_runs_each_delivery_alone(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """kill -9 of the whole worker mid-batch: nothing named, so each redelivery counts (the
    old rule). The copy of the batch message the broker brings back, once the leases ran out,
    claims none of them together: it publishes each alone, and each is claimed by the message
    that carries it alone."""
    marks = tmp_path / "marks"
    marks.mkdir()
    batch = new_dispatches(
        sessions, [("touch", {"marker_dir": str(marks), "sleep": "2"})] * 4, **BUDGET
    )
    ids = [d.delivery_id for d in batch]
    _publish(batch)
    with running_worker("doomed", tmp_path, pool="threads", **BUDGET) as doomed:
        wait_for(
            lambda: all(list(marks.glob(f"{i}.1.*")) for i in ids),
            timeout=30,
            what="every handler of the batch to start",
        )
        doomed.kill_all()
    assert len({attempts(engine, i)[0].started_at for i in ids}) == 1  # one claim statement

    def leases_expired() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT bool_and(lease_until <= now()) FROM deliveries WHERE id = ANY(:i)"
                    ),
                    {"i": ids},
                ).scalar_one()
            )

    wait_for(leases_expired, timeout=30, what="the dead worker's leases to run out")
    _publish(batch)  # the copy the broker brings back (no beat: no sweeper to isolate them)
    with running_worker("rescuer", tmp_path, pool="threads", **BUDGET) as rescuer:
        rows = [wait_status(engine, i, "succeeded", timeout=60) for i in ids]
        isolated = sorted(
            line["delivery_id"]
            for line in rescuer.json_lines()
            if line.get("event") == "delivery.not_claimed" and line.get("outcome") == "isolated"
        )
    assert isolated == ids
    assert [(r.attempts, r.redeliveries) for r in rows] == [(2, 1)] * 4
    tries = [attempts(engine, i) for i in ids]
    assert [[a.outcome for a in t] for t in tries] == [["crashed", "succeeded"]] * 4
    # Each was then claimed by a message of its own (``isolated`` above). Messages of one id
    # in flight at once may share one claim statement (tasks/steps/together.py), which does
    # not join their messages: each succeeded on its own, with its own second attempt (the
    # outcomes above).

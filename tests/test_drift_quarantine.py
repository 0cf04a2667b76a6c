"""Issue 38 item 3, the quarantine: a route with ``--quarantine-drift`` holds exactly the
deliveries whose event drifted from the accepted shape (held: drift, no call made, no attempt
spent; a new path, a new type, or the lack of a path every learnt event had), and `webhooks
drift accept` releases them: each then runs once. A route without the
option runs the same drifted events at once (drift only reports). `webhooks replay ID` runs
one held delivery despite its drift, and only it. Real worker, real sweeper (the accept makes
held deliveries due; the sweep publishes them)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Row, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import SystemClock
from core.messages import Dispatch
from models import drift, pg, replays, transitions
from tests.conftest import BIN, test_env
from tests.factories import accept_event, make_source
from tests.workers import (
    Broker,
    attempts,
    delivery,
    effects,
    running_worker,
    wait_status,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

TYPE = "invoice.paid"


def test_a_quarantined_route_holds_exactly_the_drifted_events_until_drift_accept(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings(publish_grace=timedelta(seconds=0))
    source = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "effect", "options": {"quarantine_drift": "true"}},
            {"handler": "effect"},  # no option: drift only reports
        ],
    )
    quarantined, plain = source.route_ids
    now = datetime.now(UTC)

    def send(data: dict[str, object], minutes: int) -> dict[int, int]:
        _, outcome = accept_event(
            settings, source, event_type=TYPE, body={"type": TYPE, "data": data},
            now=now - timedelta(minutes=minutes),
        )  # fmt: skip
        return {delivery(engine, d).route_id: d for d in outcome.delivery_ids}

    baseline = send({"id": "a", "amount": 1}, 10)
    with pg.connect(settings) as conn:
        drift.learn_due(conn, every=timedelta(0), sample=20, absent=timedelta(days=7))
    same = send({"id": "b", "amount": 2}, 9)
    new_path = send({"id": "c", "amount": 3, "extra": True}, 8)
    new_type = send({"id": "d", "amount": "4"}, 7)
    broker = Broker(settings)
    try:
        with running_worker("quarantine", tmp_path, publish_grace=timedelta(seconds=0)):
            for d in [*baseline.values(), *same.values(), *new_path.values(), *new_type.values()]:
                broker.publish(d)
            for d in [*baseline.values(), *same.values()]:
                wait_status(engine, d, "succeeded")
            # Without the option the drifted events run at once.
            wait_status(engine, new_path[plain], "succeeded")
            wait_status(engine, new_type[plain], "succeeded")
            # With it they are held: no call, no attempt spent, due only at the recheck.
            for d in (new_path[quarantined], new_type[quarantined]):
                row = wait_status(engine, d, "retrying")
                assert row.last_error_class == drift.HELD_CLASS
                assert row.last_error.startswith("held: drift")
                assert row.next_attempt_at > datetime.now(UTC) + timedelta(hours=23)
                assert row.attempt_base == 1  # the hold did not count
                assert effects(engine, d) == []
            assert "extra" in delivery(engine, new_path[quarantined]).last_error
            assert "amount" in delivery(engine, new_type[quarantined]).last_error

            # The learning run reports the drift; the operator accepts it.
            with pg.connect(settings) as conn:
                drift.learn_due(conn, every=timedelta(0), sample=20, absent=timedelta(days=7))
            accepted = subprocess.run(
                [str(BIN / "webhooks"), "drift", "accept", source.public_id, "--reason",
                 "API 2026-12 adds extra, amount as string", "--yes", "--json"],
                env=test_env(), capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert accepted.returncode == 0, accepted.stderr
            assert json.loads(accepted.stdout)["accepted"] == 2
            for d in (new_path[quarantined], new_type[quarantined]):
                broker.sweep()
                wait_status(engine, d, "succeeded", tick=broker.sweep)

            # A drifted event no learning run has read yet (no finding to accept): held; the
            # accept learns its shape from the held event itself and releases it.
            late = send({"id": "f", "amount": 5, "late": [1]}, 1)
            for d in late.values():
                broker.publish(d)
            wait_status(engine, late[plain], "succeeded")
            assert wait_status(engine, late[quarantined], "retrying").last_error_class == (
                drift.HELD_CLASS
            )
            again = subprocess.run(
                [str(BIN / "webhooks"), "drift", "accept", source.public_id, "--reason",
                 "late field", "--yes", "--json"],
                env=test_env(), capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert again.returncode == 0, again.stderr
            assert json.loads(again.stdout)["accepted"] == 0
            assert json.loads(again.stdout)["released"] == 1
            broker.sweep()
            wait_status(engine, late[quarantined], "succeeded", tick=broker.sweep)

            # An event that lacks a path every learnt event of its type had (amount, in all
            # of the ALWAYS_AFTER or more learnt so far): held; accepted, released, run once.
            lacking = send({"id": "g", "late": [2]}, 1)
            for d in lacking.values():
                broker.publish(d)
            wait_status(engine, lacking[plain], "succeeded")
            row = wait_status(engine, lacking[quarantined], "retrying")
            assert row.last_error_class == drift.HELD_CLASS
            assert "lacks path data.amount" in row.last_error
            third = subprocess.run(
                [str(BIN / "webhooks"), "drift", "accept", source.public_id, "--reason",
                 "amount is optional", "--yes", "--json"],
                env=test_env(), capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert third.returncode == 0, third.stderr
            assert json.loads(third.stdout)["released"] == 1
            broker.sweep()
            wait_status(engine, lacking[quarantined], "succeeded", tick=broker.sweep)
    finally:
        broker.close()
    # Nothing lost, nothing run twice: every delivery of both routes ran its handler once.
    everything = [
        *baseline.values(), *same.values(), *new_path.values(), *new_type.values(),
        *late.values(), *lacking.values(),
    ]  # fmt: skip
    for d in everything:
        assert delivery(engine, d).status == "succeeded"
        assert len(effects(engine, d)) == 1, d
    holds = (new_path[quarantined], new_type[quarantined], late[quarantined], lacking[quarantined])
    held = [a for d in holds for a in attempts(engine, d)]
    assert [a.error_class for a in held if a.outcome == "retry"] == [drift.HELD_CLASS] * 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _replays(engine: Engine) -> list[Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT * FROM replays ORDER BY id")))


def test_a_held_delivery_replayed_by_its_id_runs_once_and_only_it(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """`webhooks replay ID` of a delivery held for drift: audited, moved by its guarded
    UPDATE, run once by the worker despite the drift (the handler sees it); a filter replay
    never selects a held delivery; the same drift in another event of the route is still
    held, before and after; a retrying delivery that is not held is refused as before."""
    settings = worker_settings(publish_grace=timedelta(seconds=0))
    source = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "effect", "options": {"quarantine_drift": "true"}},
            # Fails its first attempt asking for an hour: retrying, not held.
            {"handler": "retry_after", "options": {"delay": "3600"}},
        ],
    )
    quarantined, later = source.route_ids
    now = datetime.now(UTC)

    events: dict[int, str] = {}

    def send(data: dict[str, object], minutes: int) -> dict[int, int]:
        event_id, outcome = accept_event(
            settings, source, event_type=TYPE, body={"type": TYPE, "data": data},
            now=now - timedelta(minutes=minutes),
        )  # fmt: skip
        events.update(dict.fromkeys(outcome.delivery_ids, event_id))
        return {delivery(engine, d).route_id: d for d in outcome.delivery_ids}

    send({"id": "a", "amount": 1}, 10)
    with pg.connect(settings) as conn:
        drift.learn_due(conn, every=timedelta(0), sample=20, absent=timedelta(days=7))
    first = send({"id": "b", "amount": 2, "extra": True}, 8)
    second = send({"id": "c", "amount": 3, "extra": True}, 7)
    replayed, kept = first[quarantined], second[quarantined]
    broker = Broker(settings)
    try:
        with running_worker(
            "drift-replay", tmp_path, publish_grace=timedelta(seconds=0),
            retry_cap=timedelta(hours=2),  # the hour retry_after asks for is kept
        ):  # fmt: skip
            for d in (replayed, kept, first[later]):
                broker.publish(d)
            for d in (replayed, kept):
                assert wait_status(engine, d, "retrying").last_error_class == drift.HELD_CLASS
            not_held = wait_status(engine, first[later], "retrying")
            assert not_held.last_error_class != drift.HELD_CLASS
            audits = len(_replays(engine))

            # A replay by filter never selects a held delivery (dead ones, or succeeded).
            blanket = _cli("replay", "--source", source.public_id, "--reason", "all dead",
                           "--yes", "--json")  # fmt: skip
            assert blanket.returncode == 0, blanket.stderr
            assert json.loads(blanket.stdout)["preview"]["count"] == 0
            by_status = _cli("replay", "--source", source.public_id, "--status", "retrying",
                             "--reason", "all held", "--yes", "--json")  # fmt: skip
            assert by_status.returncode != 0
            assert "retrying" in by_status.stderr + by_status.stdout

            # Not held and not dead: refused as before, nothing changed, no audit row.
            busy = _cli("replay", str(first[later]), "--reason", "run it now", "--yes", "--json")
            assert busy.returncode != 0
            assert "still being worked on" in busy.stderr + busy.stdout
            assert delivery(engine, first[later]).status == "retrying"
            assert len(_replays(engine)) == audits
            for d in (replayed, kept):
                assert delivery(engine, d).last_error_class == drift.HELD_CLASS
                assert effects(engine, d) == []

            # Named by its id: replayed, audited, run once on the shape it has.
            ran = _cli("replay", str(replayed), "--reason", "extra is harmless here",
                       "--as", "ops-jo", "--yes", "--json")  # fmt: skip
            assert ran.returncode == 0, ran.stderr
            result = json.loads(ran.stdout)["result"]
            assert (result["replayed"], result["skipped"]) == (1, 0)
            done = wait_status(engine, replayed, "succeeded", tick=broker.sweep)
            assert done.generation == 0  # the hold made no call: the same downstream key
            ran_effects = effects(engine, replayed)
            assert len(ran_effects) == 1
            assert ran_effects[0].handler == "effect"
            assert ran_effects[0].event_id == events[replayed]
            audit = _replays(engine)[-1]
            assert len(_replays(engine)) == audits + 1
            assert (audit.operator, audit.reason) == ("ops-jo", "extra is harmless here")
            assert (audit.planned, audit.replayed, audit.skipped) == (1, 1, 0)
            assert audit.filter["ids"] == [replayed]

            # The replay accepted nothing: the other event with the same drift stays held,
            # and one arriving after the replay is held too.
            late = send({"id": "d", "amount": 4, "extra": True}, 1)[quarantined]
            broker.publish(late)
            row = wait_status(engine, late, "retrying")
            assert row.last_error_class == drift.HELD_CLASS
            assert "extra" in row.last_error
            for d in (kept, late):
                assert delivery(engine, d).last_error_class == drift.HELD_CLASS
                assert effects(engine, d) == []
            with pg.connect(settings) as conn:
                assert drift.held_count(conn, source.id, TYPE) == 2
    finally:
        broker.close()
    held = [a.outcome for a in attempts(engine, replayed)]
    assert held == ["retry", "succeeded"]  # the hold, then the replayed attempt: no other call


def test_a_replay_that_loses_to_the_recheck_claim_moves_nothing(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """The race with the worker: the replay planned a held delivery, the worker's recheck
    claimed it first (processing). The replay's guarded UPDATE does not move it (no second
    run, no mark for the attempt in flight), and says why; the audit row counts the skip."""
    settings = worker_settings(publish_grace=timedelta(seconds=0))
    source = make_source(
        sessions, settings, routes=[{"handler": "effect", "options": {"quarantine_drift": "true"}}]
    )
    now = datetime.now(UTC)
    _, outcome = accept_event(
        settings, source, event_type=TYPE, body={"type": TYPE, "data": {"n": 1}}, now=now
    )
    (held,) = outcome.delivery_ids
    # Held as the worker holds it: claimed, then handed back as retrying DriftHeld.
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, held, now=None, lease=timedelta(minutes=5), max_redeliveries=5, worker="t"
        )
        assert found is not None
        transitions.retry_later(
            session, found, now=found.at, next_attempt_at=found.at + drift.HOLD_RECHECK,
            error_class=drift.HELD_CLASS, error="held: drift (new path data.n)", uncounted=True,
        )  # fmt: skip
    request = replays.ReplayRequest(
        operator="ops", reason="run it", via="cli", filter_as_given={"ids": [held]}, ids=(held,)
    )
    with sessions() as session:
        plan = replays.plan_replay(session, request)
    assert [c.held_for_drift for c in plan.candidates] == [True]
    # The recheck, a day later on the claim's clock, takes it first.
    with sessions() as session, session.begin():
        recheck = transitions.claim(
            session, held, now=found.at + drift.HOLD_RECHECK, lease=timedelta(minutes=5),
            max_redeliveries=5, worker="t",
        )  # fmt: skip
        assert recheck is not None
    published: list[int] = []

    def publish(dispatches: Sequence[Dispatch]) -> bool:
        published.extend(d.delivery_id for d in dispatches)
        return True

    replay_id = replays.start_replay(sessions, plan, now=now)
    result = replays.execute(
        sessions, plan, replay_id, settings=settings, clock=SystemClock(),
        sleep=lambda _: None, publish=publish,
    )  # fmt: skip
    assert (result.replayed, result.skipped, published) == (0, 1, [])
    assert "no longer held for drift" in result.skips[0].reason
    row = delivery(engine, held)
    assert (row.status, row.last_error_class) == ("processing", drift.HELD_CLASS)
    audit = _replays(engine)[-1]
    assert (audit.id, audit.replayed, audit.skipped) == (replay_id, 0, 1)

"""Issue 38 item 3, the quarantine: a route with ``--quarantine-drift`` holds exactly the
deliveries whose event drifted from the accepted shape (held: drift, no call made, no attempt
spent; a new path, a new type, or the lack of a path every learnt event had), and `webhooks
drift accept` releases them: each then runs once. A route without the
option runs the same drifted events at once (drift only reports). Real worker, real sweeper
(the accept makes held deliveries due; the sweep publishes them)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from models import drift, pg
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

"""Replays end to end: dead letters replayed by the CLI and by the admin API and processed by a
real ``celery -A tasks worker`` (prefork, two processes), concurrent replays racing for one
delivery, and ``--rerun-succeeded`` giving the downstream a new idempotency key."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.conftest import BIN
from tests.handlers_for_tests import EFFECTS_DDL
from tests.leakcheck import log_file, remember
from tests.operators_support import (
    OPS,
    accept,
    cli,
    kill,
    ops_env,
    ops_receiver,
    replay_rows,
    source_with,
)
from tests.processes import Receiver
from tests.workers import Broker, Worker, attempts, effects, running_worker, wait_for, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "adm_e2e_" + secrets.token_urlsafe(24)  # random: a repeated one is refused
remember(TOKEN)


@pytest.fixture(scope="module")
def worker(
    ops: Settings, tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> Iterator[Worker]:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    with running_worker("ops", tmp_path_factory.mktemp("ops-worker"), concurrency=2, **OPS) as w:
        yield w


@pytest.fixture(scope="module")
def broker(ops: Settings) -> Iterator[Broker]:
    b = Broker(ops)
    yield b
    b.close()


@pytest.fixture(scope="module")
def api(ops: Settings) -> Iterator[Receiver]:
    # A named token: the audit records its name as the operator.
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"dora:{TOKEN}") as running:
        yield running


def _dead_by_worker(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine, broker: Broker
) -> int:
    """An event whose handler ("flaky", the demo handler) fails until replayed: dead."""
    source = source_with(sessions, ops, "flaky")
    [delivery] = accept(ops, source)
    broker.publish(delivery)
    row = wait_status(engine, delivery, "dead", timeout=30)
    assert row.dead_reason is not None
    return delivery


def test_dead_delivery_replayed_by_the_cli_is_processed_by_a_real_worker(
    worker: Worker, broker: Broker, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    delivery = _dead_by_worker(ops, sessions, engine, broker)
    out = cli(
        "replay", str(delivery), "--reason", "flaky handler fixed", "--as", "carol", "--yes",
        env=ops_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "1 replayed, 0 skipped of 1 planned" in out.stdout
    wait_status(engine, delivery, "succeeded", timeout=30)

    tries = attempts(engine, delivery)
    assert [a.outcome for a in tries] == ["dead", "succeeded"]
    # Same key generation on both tries: the downstream saw the same idempotency key.
    assert {a.generation for a in tries} == {0}
    [audit] = [r for r in replay_rows(engine, operator="carol") if r.filter == {"ids": [delivery]}]
    assert (audit.reason, audit.via, audit.status, audit.rerun_succeeded) == (
        "flaky handler fixed",
        "cli",
        "done",
        False,
    )
    assert (audit.planned, audit.replayed, audit.skipped) == (1, 1, 0)
    assert audit.started_at <= audit.ended_at <= tries[-1].ended_at


def test_dead_delivery_replayed_by_the_api_is_processed_by_a_real_worker(
    worker: Worker,
    broker: Broker,
    api: Receiver,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
) -> None:
    delivery = _dead_by_worker(ops, sessions, engine, broker)
    with engine.connect() as conn:
        source = conn.execute(
            text(
                "SELECT s.public_id FROM deliveries d JOIN sources s ON s.id = d.source_id "
                "WHERE d.id = :d"
            ),
            {"d": delivery},
        ).scalar_one()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    created = httpx.post(
        f"{api.admin_url}/admin/replays",
        json={"reason": "incident 7 resolved", "source": source, "rate": 5},
        headers=auth,
        timeout=10,
    )
    assert created.status_code == 202, created.text
    body = created.json()
    assert body["preview"]["count"] == 1
    replay_id = body["replay"]["id"]
    assert body["replay"]["status"] == "running"

    def finished() -> dict[str, object] | None:
        progress = httpx.get(f"{api.admin_url}/admin/replays/{replay_id}", headers=auth, timeout=10)
        assert progress.status_code == 200
        data: dict[str, object] = progress.json()
        return data if data["status"] != "running" else None

    progress = wait_for(finished, timeout=30, what="the API replay to finish")
    assert (progress["status"], progress["planned"], progress["replayed"], progress["skipped"]) == (
        "done",
        1,
        1,
        0,
    )
    wait_status(engine, delivery, "succeeded", timeout=30)
    assert [a.outcome for a in attempts(engine, delivery)] == ["dead", "succeeded"]
    [audit] = replay_rows(engine, id=replay_id)
    assert (audit.operator, audit.reason, audit.via) == ("dora", "incident 7 resolved", "api")
    assert audit.filter == {"source": source, "status": "dead"}
    assert audit.rate == 5
    assert audit.ended_at is not None


def test_concurrent_replays_of_one_delivery_run_it_once(
    worker: Worker, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "effect")
    [delivery] = accept(ops, source)
    kill(sessions, [delivery])
    racers: list[subprocess.Popen[str]] = []
    # Hold the row so both replays reach the guarded UPDATE and wait there together.
    with engine.connect() as holder:
        holder.execute(text("SELECT id FROM deliveries WHERE id = :d FOR UPDATE"), {"d": delivery})
        for name in ("p1", "p2"):
            racers.append(
                subprocess.Popen(  # noqa: S603
                    [
                        str(BIN / "webhooks"),
                        "replay",
                        str(delivery),
                        "--reason",
                        "race",
                        "--as",
                        name,
                        "--yes",
                        "--json",
                    ],
                    env=ops_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )

        def both_blocked() -> bool:
            # A fresh connection each time: pg_stat_activity is a snapshot within a transaction.
            with engine.connect() as probe:
                waiting = probe.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                        "AND position('UPDATE deliveries' in query) > 0"
                    )
                ).scalar_one()
            return bool(waiting >= 2)

        wait_for(both_blocked, timeout=60, what="both replays to wait on the row")
        holder.rollback()
    outputs = [p.communicate(timeout=60) for p in racers]
    for i, (stdout, stderr) in enumerate(outputs):
        log_file(f"cli-race-{i}").write_text(stdout + stderr)
    results = [json.loads(stdout)["result"] for stdout, _ in outputs]
    assert sorted(r["replayed"] for r in results) == [0, 1]
    assert sorted(p.returncode for p in racers) == [0, 1]
    [loser] = [r for r in results if r["skipped"]]
    assert "no longer dead" in loser["skips"][0]["reason"]

    wait_status(engine, delivery, "succeeded", timeout=30)
    time.sleep(1)  # room for a second run, were there one
    assert len(effects(engine, delivery)) == 1
    assert [a.outcome for a in attempts(engine, delivery)] == ["dead", "succeeded"]
    audits = [r for r in replay_rows(engine, reason="race") if r.filter == {"ids": [delivery]}]
    assert sorted((a.replayed, a.skipped) for a in audits) == [(0, 1), (1, 0)]


def test_rerun_succeeded_gives_the_downstream_a_new_key(
    worker: Worker, broker: Broker, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "effect")
    [delivery] = accept(ops, source)
    broker.publish(delivery)
    wait_status(engine, delivery, "succeeded", timeout=30)
    [first] = effects(engine, delivery)

    plain = cli("replay", str(delivery), "--reason", "again", "--yes", env=ops_env())
    assert plain.returncode == 1
    assert "already succeeded" in plain.stderr
    assert "--rerun-succeeded" in plain.stderr

    rerun = cli(
        "replay", str(delivery), "--reason", "customer asked", "--rerun-succeeded", "--yes",
        "--as", "erin", env=ops_env(),
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr

    def second_effect() -> bool:
        return len(effects(engine, delivery)) == 2

    wait_for(second_effect, timeout=30, what="the re-run's effect")
    wait_status(engine, delivery, "succeeded", timeout=30)
    first_again, second = effects(engine, delivery)
    assert first_again.idempotency_key == first.idempotency_key
    assert (first.generation, second.generation) == (0, 1)
    assert second.idempotency_key != first.idempotency_key
    [audit] = replay_rows(engine, operator="erin")
    assert (audit.rerun_succeeded, audit.replayed, audit.reason) == (True, 1, "customer asked")

"""``webhooks demo`` runs to its summary against the pipeline the README's run command starts
(``make run`` = ``webhooks run``: migrate, receiver, worker, beat, Flower), on a database that
does not exist beforehand, as on a fresh machine. Flower asks for basic auth and shows the
deliver tasks with their argument: a delivery id, nothing else."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from sqlalchemy import Engine, text

from models.installation import installation_id
from tasks.claims import claim_key
from tests import conftest
from tests.conftest import ADMIN_DSN, BIN, free_port, wait_for_port
from tests.leakcheck import remember
from tests.operators_support import OPS, cli, flush, ops_env, ops_receiver, ops_settings
from tests.workers import Process, running_worker, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO_DB = "webhooks_test_ops_demo"
PASSWORD = "flower-" + "p" * 16
remember(PASSWORD)


def _drop_demo_db() -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DEMO_DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{DEMO_DB}"')


@pytest.fixture
def fresh() -> Iterator[None]:
    _drop_demo_db()
    flush(ops_settings())
    yield
    flush(ops_settings())
    _drop_demo_db()


def _run_env(port: int, flower_port: int, metrics_port: int) -> dict[str, str]:
    return conftest.test_env(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{DEMO_DB}",
        WEBHOOKS_BROKER_URL=OPS["broker_url"],
        WEBHOOKS_REDIS_URL=OPS["redis_url"],
        WEBHOOKS_PORT=str(port),
        WEBHOOKS_FLOWER_PORT=str(flower_port),
        WEBHOOKS_FLOWER_PASSWORD=PASSWORD,
        WEBHOOKS_WORKER_METRICS_PORT=str(metrics_port),
        WEBHOOKS_ADMIN_PORT=str(free_port()),  # not the default 8001: suites run side by side
    )


def test_demo_runs_to_its_summary_against_webhooks_run(fresh: None, tmp_path: Path) -> None:
    port, flower_port, metrics_port = free_port(), free_port(), free_port()
    env = _run_env(port, flower_port, metrics_port)
    pipeline = Process("webhooks-run", [str(BIN / "webhooks"), "run"], env, tmp_path)
    try:
        wait_for_port(port, pipeline.proc, timeout=90)
        wait_for_port(flower_port, pipeline.proc, timeout=90)

        demo = cli("demo", "--timeout", "90", env=env, timeout=240)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        out = demo.stdout
        assert "summary" in out
        assert "5 (4 events + 1 provider retry)" in out
        assert "4 accepted" in out
        assert "1 duplicate" in out
        assert "4 succeeded: 3 first time, 1 after replay" in out
        assert "dead" in out  # the flaky delivery was shown dead before the replay
        # It ends pointing at the Flower row of its dead letter: that task's own page.
        [line] = [ln for ln in out.splitlines() if "dead letter:" in ln]
        row_url = re.search(r"http://\S+/task/([0-9a-f-]{36})", line)
        assert row_url is not None, line
        dead_id = int(re.search(r"delivery (\d+)", line).group(1))  # type: ignore[union-attr]
        assert f"deliveries show {dead_id}" in line

        # The audit trail has the demo's replay, as the CLI shows it.
        audit = cli("replays", "list", "--json", env=env)
        [replay] = json.loads(audit.stdout)
        assert (replay["replayed"], replay["via"], replay["status"]) == (1, "cli", "done")
        assert replay["reason"].startswith("webhooks demo")

        # Flower: basic auth from settings; deliver tasks carry the delivery id only.
        flower = f"http://127.0.0.1:{flower_port}"
        assert httpx.get(f"{flower}/api/tasks", timeout=10).status_code == 401
        auth = ("admin", PASSWORD)

        def ids_of(task: dict[str, object]) -> list[int]:
            args = task["args"]
            assert isinstance(args, str)
            # Delivery ids only, never a payload: "(7,)", or "([7, 8],)" for a message the
            # publisher packed under load.
            assert re.fullmatch(r"\((\[\d+(, \d+)*\]|\d+),\)", args), args
            return [int(i) for i in re.findall(r"\d+", args)]

        def deliver_tasks() -> list[dict[str, object]] | None:
            response = httpx.get(f"{flower}/api/tasks", auth=auth, timeout=10)
            assert response.status_code == 200
            found = [t for t in response.json().values() if t.get("name") == "webhooks.deliver"]
            ids = [i for t in found for i in ids_of(t)]
            # Every delivery of the demo (4), and the dead one twice: its failure and its replay.
            return found if len(set(ids)) >= 4 and ids.count(dead_id) >= 2 else None

        tasks = wait_for(deliver_tasks, timeout=30, what="Flower to list the deliver tasks")
        failed = httpx.get(
            f"{flower}/api/task/info/{row_url.group(1)}", auth=auth, timeout=10
        ).json()
        assert failed["state"] == "FAILURE"
        assert dead_id in ids_of(failed)  # its own message, or one the publisher packed
        assert "DeadLetter" in failed["exception"]
        assert all(ids_of(task) for task in tasks)
    finally:
        pipeline.stop(timeout=30)
    assert pipeline.proc.returncode is not None


def _demo_with_its_pipeline(tmp_path: Path, timeout: int) -> str:
    """``webhooks run`` (without Flower), then ``webhooks demo``; the demo's output."""
    port = free_port()
    env = _run_env(port, free_port(), free_port())
    pipeline = Process("webhooks-run", [str(BIN / "webhooks"), "run", "--no-flower"], env, tmp_path)
    try:
        wait_for_port(port, pipeline.proc, timeout=90)
        demo = cli("demo", "--timeout", str(timeout), env=env, timeout=4 * timeout)
    finally:
        pipeline.stop(timeout=30)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    return demo.stdout


def test_demo_succeeds_on_a_database_dropped_and_recreated_under_the_same_redis(
    fresh: None, tmp_path: Path
) -> None:
    """A new user's steps: drop the database, `make run` (it recreates it), `webhooks demo`.
    Redis keeps the first life's confirmed claim keys, days long, and delivery ids start
    again at 1; the keys carry the installation id, so they never match the second life's
    deliveries. (With the default sweep settings, the sweeper's fallback alone would take two
    publish graces, 60 s, and more than the demo's stage.)"""
    assert "4 succeeded" in _demo_with_its_pipeline(tmp_path, 90)
    claims = redis.Redis.from_url(OPS["redis_url"])
    try:
        first_life = [k for k in claims.scan_iter("claim:*") if claims.ttl(k) > 86400]
        assert len(first_life) >= 4, first_life  # the confirmed keys of the four deliveries
        _drop_demo_db()
        assert "4 succeeded: 3 first time, 1 after replay" in _demo_with_its_pipeline(tmp_path, 60)
        # Both lives' keys are there, side by side.
        assert len(list(claims.scan_iter("claim:*"))) >= 2 * len(first_life)
    finally:
        claims.close()


# -- the demo's timeout names what holds the deliveries -------------------------------------


@pytest.fixture
def ops_redis() -> Iterator[None]:
    flush(ops_settings())
    yield
    flush(ops_settings())


@pytest.mark.usefixtures("ops_redis")
def test_demo_timeout_without_a_worker_says_no_worker_answered() -> None:
    with ops_receiver(None) as running:
        demo = cli("demo", "--receiver", running.url, "--timeout", "3", env=ops_env())
    assert demo.returncode == 1
    assert "did not get there within 3s: no worker answered a ping" in demo.stderr, demo.stderr


def _next_delivery_ids(engine: Engine, n: int) -> list[int]:
    with engine.connect() as conn:
        last, called = conn.execute(
            text("SELECT last_value, is_called FROM deliveries_id_seq")
        ).one()
    start = last + 1 if called else last
    return list(range(start, start + n))


@pytest.mark.usefixtures("ops_redis")
def test_demo_timeout_with_a_worker_and_held_keys_says_the_keys_say_duplicate(
    engine: Engine, tmp_path: Path
) -> None:
    """Keys held for the demo's coming deliveries (as a restore leaves them): the worker
    answers and refuses every copy as a duplicate; the hint says so, not "no worker"."""
    ids = _next_delivery_ids(engine, 4)
    claims = redis.Redis.from_url(OPS["redis_url"])
    installation = installation_id(engine)
    try:
        for delivery_id in ids:
            claims.set(claim_key(installation, delivery_id, 0), "lost-success", px=86_400_000)
    finally:
        claims.close()
    with (
        running_worker("demo-held", tmp_path, **OPS) as worker,
        ops_receiver(None) as running,
    ):
        demo = cli("demo", "--receiver", running.url, "--timeout", "4", env=ops_env())
        refused = [
            ln["delivery_id"]
            for ln in worker.json_lines()
            if ln.get("event") == "delivery.not_claimed" and ln.get("outcome") == "duplicate"
        ]
    assert demo.returncode == 1
    message = " ".join(demo.stderr.split())
    assert "no worker answered" not in message
    assert f"deliveries {', '.join(map(str, ids))} pending while a worker answered" in message
    assert "fast-claim keys in Redis say duplicate" in message
    assert sorted(set(refused)) == ids

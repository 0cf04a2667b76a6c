"""Flower tells the truth (issue 10): a real worker's task events say RETRY for an attempt that
will be retried, FAILURE for a dead letter, SUCCESS for a real success, and a result that
marks a duplicate copy; a real Flower shows the same through its HTTP API, with the delivery
id, event id and source on every row, never a payload."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.messages import DELIVER_TASK, Dispatch
from tasks.config import create_app
from tasks.publisher import Publisher
from tests.conftest import BIN, free_port, wait_for_port
from tests.factories import accept_event, make_source
from tests.leakcheck import remember
from tests.workers import (
    Process,
    running_worker,
    wait_for,
    wait_status,
    worker_env,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

FLOWER_AUTH = ("ops", "flower-" + "s" * 20)


class EventLog:
    """Celery's own event receiver, on the broker the worker publishes its events to."""

    def __init__(self) -> None:
        self.app = create_app(worker_settings())
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def _run(self) -> None:
        with self.app.connection() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self._ready.set()
            while not self._stop.is_set():
                try:
                    for _ in receiver.consume(limit=None, timeout=0.5, wakeup=False):
                        if self._stop.is_set():
                            break
                except TimeoutError:
                    continue

    @contextmanager
    def listening(self) -> Iterator[EventLog]:
        self._thread.start()
        assert self._ready.wait(10)
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)
            self.app.close()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]


@contextmanager
def running_flower(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = worker_env()
    # Credentials from the environment, never the command line (visible in ps).
    env["FLOWER_BASIC_AUTH"] = ":".join(FLOWER_AUTH)
    remember(FLOWER_AUTH[1])
    flower = Process(
        "flower",
        [str(BIN / "celery"), "-A", "tasks", "flower", f"--port={port}", "--address=127.0.0.1"],
        env,
        tmp_path,
    )
    try:
        wait_for_port(port, flower.proc, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        flower.stop()


def test_task_states_tell_retry_failure_success_and_duplicate(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    flaky = make_source(
        sessions, settings, routes=[{"handler": "flaky_n", "options": {"failures": "1"}}]
    )
    doomed = make_source(sessions, settings, routes=[{"handler": "permanent"}])
    steady = make_source(sessions, settings, routes=[{"handler": "effect"}])
    retried = accept_event(settings, flaky)
    dead = accept_event(settings, doomed)
    ok = accept_event(settings, steady)
    ids = {
        "retried": retried[1].delivery_ids[0],
        "dead": dead[1].delivery_ids[0],
        "ok": ok[1].delivery_ids[0],
    }
    made = {"retried": (retried[0], flaky), "dead": (dead[0], doomed), "ok": (ok[0], steady)}
    dispatches = {
        key: Dispatch(ids[key], event_id, source.public_id)
        for key, (event_id, source) in made.items()
    }
    publisher = Publisher(settings)  # the receiver's own publishing path
    events = EventLog()
    with (
        events.listening(),
        running_flower(tmp_path) as flower,
        running_worker("flower-truth", tmp_path),
    ):
        for dispatch in dispatches.values():  # one message each (together: a batch, below)
            publisher.publish_sync([dispatch])
        wait_status(engine, ids["retried"], "succeeded")
        wait_status(engine, ids["dead"], "dead")
        wait_status(engine, ids["ok"], "succeeded")
        publisher.publish_sync([dispatches["ok"]])  # a duplicate copy of a finished delivery

        def settled() -> bool:
            return len(events.of("task-succeeded")) >= 3 and len(events.of("task-failed")) >= 1

        wait_for(settled, timeout=30, what="the task events")

        def flower_tasks() -> dict[str, Any]:
            answer = httpx.get(f"{flower}/api/tasks", auth=FLOWER_AUTH, timeout=10)
            answer.raise_for_status()
            tasks: dict[str, Any] = answer.json()
            states = sorted(t["state"] for t in tasks.values() if t["name"] == DELIVER_TASK)
            return tasks if states == ["FAILURE", "RETRY", "SUCCESS", "SUCCESS", "SUCCESS"] else {}

        shown = wait_for(flower_tasks, timeout=30, what="Flower to show every task")
        unauthenticated = httpx.get(f"{flower}/api/tasks", timeout=10)
    publisher.close()

    received = {e["uuid"]: e for e in events.of("task-received")}

    def delivery_of(event: dict[str, Any]) -> int:
        return int(received[event["uuid"]]["args"].strip("(),"))

    # RETRY: the attempt that failed and will be retried, with its error.
    [retry] = events.of("task-retried")
    assert delivery_of(retry) == ids["retried"]
    assert "AttemptFailed" in retry["exception"]
    assert f"delivery {ids['retried']} attempt 1" in retry["exception"]
    assert "planned" in retry["exception"]
    # FAILURE: the dead letter, with its reason, after the dead state was committed.
    [failure] = events.of("task-failed")
    assert delivery_of(failure) == ids["dead"]
    assert "DeadLetter" in failure["exception"]
    assert "permanent" in failure["exception"]
    # SUCCESS: the real successes, and a duplicate copy that says so in its result.
    results = {delivery_of(e): [] for e in events.of("task-succeeded")}
    for e in events.of("task-succeeded"):
        results[delivery_of(e)].append(e["result"])
    assert results[ids["retried"]] == ["'succeeded'"]
    assert sorted(results[ids["ok"]]) == [
        "'duplicate: another copy holds or completed this delivery'",
        "'succeeded'",
    ]

    # Flower: the same states, every row findable by delivery id, event id and source.
    assert unauthenticated.status_code == 401
    rows = [t for t in shown.values() if t["name"] == DELIVER_TASK]
    by_delivery: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_delivery.setdefault(int(row["args"].strip("(),")), []).append(row)
    assert sorted(r["state"] for r in by_delivery[ids["retried"]]) == ["RETRY", "SUCCESS"]
    assert [r["state"] for r in by_delivery[ids["dead"]]] == ["FAILURE"]
    assert "permanent" in by_delivery[ids["dead"]][0]["exception"]
    for key, (event_id, source) in made.items():
        for row in by_delivery[ids[key]]:
            assert row["args"] == f"({ids[key]},)"
            assert event_id in row["kwargs"]
            assert source.public_id in row["kwargs"]
            assert '"data"' not in row["kwargs"]  # ids only, never the payload


def test_a_batch_message_shows_each_delivery_and_its_outcome(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Several deliveries published together travel in one message (tasks.pipeline): Flower's
    row for it lists every delivery id, event id and source it carried, takes the state of
    its worst outcome, and its text gives each delivery's own outcome; the retry of one of
    them comes back as a row of its own."""
    settings = worker_settings()
    made = {
        "retried": make_source(
            sessions, settings, routes=[{"handler": "flaky_n", "options": {"failures": "1"}}]
        ),
        "dead": make_source(sessions, settings, routes=[{"handler": "permanent"}]),
        "ok": make_source(sessions, settings, routes=[{"handler": "effect"}]),
    }
    dispatches = {}
    for key, source in made.items():
        event_id, outcome = accept_event(settings, source)
        dispatches[key] = Dispatch(outcome.delivery_ids[0], event_id, source.public_id)
    ids = {key: d.delivery_id for key, d in dispatches.items()}
    publisher = Publisher(settings)
    events = EventLog()
    with (
        events.listening(),
        running_flower(tmp_path) as flower,
        running_worker("flower-batch", tmp_path),
    ):
        publisher.publish_sync(list(dispatches.values()))  # one message of three
        wait_status(engine, ids["retried"], "succeeded")
        wait_status(engine, ids["dead"], "dead")
        wait_status(engine, ids["ok"], "succeeded")

        def flower_tasks() -> list[dict[str, Any]]:
            answer = httpx.get(f"{flower}/api/tasks", auth=FLOWER_AUTH, timeout=10)
            answer.raise_for_status()
            rows = [t for t in answer.json().values() if t["name"] == DELIVER_TASK]
            return rows if sorted(t["state"] for t in rows) == ["FAILURE", "SUCCESS"] else []

        rows = wait_for(flower_tasks, timeout=30, what="Flower to show the batch and the retry")
    publisher.close()

    [batch] = [r for r in rows if r["state"] == "FAILURE"]
    [retry] = [r for r in rows if r["state"] == "SUCCESS"]
    carried = [ids["retried"], ids["dead"], ids["ok"]]
    assert batch["args"] == f"({carried!r},)"
    for key, dispatch in dispatches.items():
        assert dispatch.event_id in batch["kwargs"]
        assert dispatch.source in batch["kwargs"]
        assert str(ids[key]) in batch["exception"]
    assert '"data"' not in batch["kwargs"]  # ids only, never the payload
    text_of = batch["exception"]
    assert "DeadLetter" in text_of
    assert "3 deliveries (1 dead, 1 retry, 1 succeeded)" in text_of
    assert f"{ids['ok']}: succeeded" in text_of
    assert f"{ids['retried']}: retry: planned" in text_of
    assert f"{ids['dead']}: dead: " in text_of
    assert "permanent" in text_of
    # The retry went out as a message of its own: one row, one delivery.
    assert retry["args"] == f"({ids['retried']},)"
    assert retry["result"] == "'succeeded'"
    [received] = [e for e in events.of("task-received") if e["args"].startswith("([")]
    assert received["args"] == f"({carried!r},)"

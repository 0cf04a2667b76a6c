"""``forward`` on the worker's event loop (issue 33 item 1): one worker process holds many
forwards in flight at once, each lands once, and a warm shutdown finishes those in flight.
A real worker process, a real downstream over loopback that holds its answers."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import Dispatch
from tests.factories import accept_event, make_source
from tests.loopback import Loopback, Quiet
from tests.workers import (
    publish_one_message,
    running_worker,
    wait_for,
    worker_settings,
)

# Calls the downstream holds until all of them arrived: their I/O timeout (1 s in the suite)
# outlasts the tests' 60 s wait for the last one, or on a loaded machine the first ones time
# out meanwhile.
LONG_CALLS = {
    "handler_io_timeout": 75.0,
    "soft_time_limit": 80.0,
    "hard_time_limit": 90.0,
    "visibility_timeout": 400.0,
}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]


class HoldingDownstream:
    """Answers 200 once :attr:`release` is set; counts the requests it holds at once (their
    peak) and every Idempotency-Key it saw."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.keys: list[str] = []
        self.holding = 0
        self.peak = 0
        self._lock = threading.Lock()
        server = self

        class Handler(Quiet):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                with server._lock:
                    server.keys.append(str(self.headers.get("idempotency-key")))
                    server.holding += 1
                    server.peak = max(server.peak, server.holding)
                server.release.wait(60)
                with server._lock:
                    server.holding -= 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook")
        self.url = self.loopback.url

    def close(self) -> None:
        self.release.set()
        self.loopback.close()


@pytest.fixture
def downstream() -> Iterator[HoldingDownstream]:
    server = HoldingDownstream()
    yield server
    server.close()


def forwards(
    sessions: sessionmaker[Session], downstream: HoldingDownstream, n: int
) -> list[Dispatch]:
    """``n`` events of one source, each with one delivery to ``downstream``."""
    settings = worker_settings()
    route = {"handler": "forward", "options": {"url": downstream.url, "allow_private": "true"}}
    source = make_source(sessions, settings, routes=[route])
    out = []
    for _ in range(n):
        event_id, outcome = accept_event(settings, source)
        out.append(Dispatch(outcome.delivery_ids[0], event_id, source.public_id))
    return out


def succeeded(engine: Engine, ids: list[int]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM deliveries WHERE id = ANY(:ids) AND status = 'succeeded'"
                ),
                {"ids": ids},
            ).scalar_one()
        )


def test_one_process_holds_many_forwards_in_flight_and_each_lands_once(
    engine: Engine, sessions: sessionmaker[Session], downstream: HoldingDownstream, tmp_path: Path
) -> None:
    """Four messages of 16 forwards to a downstream that answers none until all 64 arrived:
    one threads-pool worker process with 4 slots holds all 64 calls open at once, on its
    loop, and each delivery then succeeds with one call."""
    dispatches = forwards(sessions, downstream, 64)
    ids = [d.delivery_id for d in dispatches]
    for i in range(0, 64, 16):
        publish_one_message(dispatches[i : i + 16])
    with running_worker(
        "loop", tmp_path, pool="threads", concurrency=4, route_max_in_flight=100, **LONG_CALLS
    ) as worker:
        wait_for(lambda: downstream.holding == 64, timeout=60, what="64 calls held at once")
        assert worker.pool_pids() == []  # one process: the threads pool has no children
        downstream.release.set()
        wait_for(lambda: succeeded(engine, ids) == 64, timeout=60, what="64 successes")
    assert downstream.peak == 64
    assert len(downstream.keys) == 64 == len(set(downstream.keys))


def test_a_warm_shutdown_finishes_the_forwards_in_flight(
    engine: Engine, sessions: sessionmaker[Session], downstream: HoldingDownstream, tmp_path: Path
) -> None:
    """SIGTERM while 16 calls are held: the worker waits for their answers, records every
    success and exits 0; no call is repeated."""
    dispatches = forwards(sessions, downstream, 16)
    ids = [d.delivery_id for d in dispatches]
    publish_one_message(dispatches)
    with running_worker(
        "loop-stop", tmp_path, pool="threads", concurrency=2, **LONG_CALLS
    ) as worker:
        wait_for(lambda: downstream.holding == 16, timeout=60, what="16 calls held")
        worker.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "Warm shutdown" in worker.output(), timeout=30, what="the warm shutdown")
        assert worker.alive()  # waiting for its calls
        downstream.release.set()
        assert worker.proc.wait(60) == 0
    assert succeeded(engine, ids) == 16
    assert len(downstream.keys) == 16 == len(set(downstream.keys))

"""Fencing at the downstream (issue 32 item 3): a worker never starts a call for a delivery
whose lease it cannot show to be its own and live. A worker frozen right after its claim
(SIGSTOP of the whole process, as a frozen host) whose lease another worker took over makes
no call when it thaws; a fence that trips while the lease is still ours hands it back without
spending an attempt; ``forward`` sends nothing once the fence refuses. Real workers, a real
Postgres, a real HTTP downstream."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock, SystemClock
from core.messages import Dispatch
from models import transitions
from tasks.context import COMMIT_MARGIN, Event, EventMeta, HandlerContext, RouteInfo
from tasks.errors import LeaseFenced
from tasks.handlers.forward import forward
from tasks.pipeline import deliver_one
from tasks.runtime import build_runtime
from tests.factories import accept_event, make_source
from tests.leakcheck import remember
from tests.operators_support import cli
from tests.workers import (
    Worker,
    attempts,
    children,
    delivery,
    effects,
    new_dispatches,
    publish_one_message,
    running_worker,
    wait_for,
    wait_status,
    worker_env,
    worker_settings,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

FORWARD_SECRET = "whsec_" + "RmVuY2luZ1Rlc3RSb3V0ZVNpZ25pbmdTZWNyZXQx"


def _signal_all(worker: Worker, sig: signal.Signals) -> None:
    """``sig`` to the worker's main process and every pool child: a whole host's processes."""
    for pid in [worker.pid, *children(worker.pid)]:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def _lease_over(engine: Engine, delivery_id: int) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT lease_until <= now() FROM deliveries WHERE id = :id"),
                {"id": delivery_id},
            ).scalar()
        )


def test_a_worker_frozen_after_its_claim_makes_no_call_once_its_lease_is_taken_over(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """The multi-host drill's finding: frozen just after its claim, its lease taken over and
    the event delivered elsewhere, the thawed worker made the call anyway. Now it is fenced:
    the downstream sees the taker's call alone."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (dispatch,) = new_dispatches(sessions, [("fenced_call", {"marker_dir": str(marks)})])
    delivery_id = dispatch.delivery_id
    publish_one_message([dispatch])
    with running_worker("frozen", tmp_path) as frozen:
        wait_for(
            (marks / f"{delivery_id}.1.arrived").exists,
            timeout=30,
            what="the first worker to claim and reach its call",
        )
        _signal_all(frozen, signal.SIGSTOP)
        try:
            # The lease runs out on the database's clock while the worker is frozen.
            wait_for(lambda: _lease_over(engine, delivery_id), timeout=60, what="the lease")
            (marks / "open").write_text("")
            publish_one_message([dispatch])  # a copy, as the sweeper sends for a lost lease
            with running_worker("taker", tmp_path) as taker:
                wait_status(engine, delivery_id, "succeeded", timeout=30)
                taker_log = taker.output()
        finally:
            _signal_all(frozen, signal.SIGCONT)

        def fenced_lines() -> list[dict[str, Any]]:
            return [e for e in frozen.json_lines() if e.get("event") == "delivery.fenced"]

        wait_for(
            lambda: fenced_lines() or (marks / f"{delivery_id}.1.called").exists(),
            timeout=30,
            what="the thawed worker to reach its fence (or to call)",
        )
        fenced = fenced_lines()
        frozen_log = frozen.output()
    assert sorted(p.name for p in marks.glob("*.called")) == [f"{delivery_id}.2.called"]
    assert fenced, "the thawed worker was not fenced"
    assert fenced[0]["delivery_id"] == delivery_id
    assert fenced[0]["handed_back"] is False  # the taker's attempt decided
    assert fenced[0]["lease_left_s"] < 0
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [
        (1, "crashed"),
        (2, "succeeded"),
    ]
    assert delivery(engine, delivery_id).status == "succeeded"
    assert "Traceback" not in frozen_log + taker_log


def test_a_fence_that_trips_on_a_live_lease_hands_it_back_without_spending_an_attempt(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """A pause that leaves the lease too short for a call (on a pinned clock): no effect, the
    delivery is retrying and due at once, its attempt not counted against max_attempts; the
    next attempt delivers it once."""
    settings = worker_settings(max_attempts=1)
    pause = settings.processing_ttl - (settings.handler_io_timeout + COMMIT_MARGIN) + 0.5
    source = make_source(
        sessions, settings, routes=[{"handler": "pause_once", "options": {"pause_s": str(pause)}}]
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    rt = build_runtime(settings, clock=FrozenClock(datetime.now(UTC)), worker="paused")
    published: list[int] = []

    def publish(dispatch: Dispatch, countdown: float) -> None:
        published.append(dispatch.delivery_id)

    try:
        assert deliver_one(rt, delivery_id, publish_retry=publish) == "fenced"
        row = delivery(engine, delivery_id)
        assert (row.status, row.attempts, row.attempt_base) == ("retrying", 1, 1)
        assert row.next_attempt_at == rt.clock.now()  # due at once
        assert effects(engine, delivery_id) == []
        # max_attempts is 1: a counted first attempt would have made this one impossible.
        assert deliver_one(rt, delivery_id, publish_retry=publish) == "succeeded"
    finally:
        rt.close()
    assert len(effects(engine, delivery_id)) == 1
    assert [(a.number, a.outcome, a.error_class) for a in attempts(engine, delivery_id)] == [
        (1, "retry", "LeaseFenced"),
        (2, "succeeded", None),
    ]


class _Downstream:
    """Counts the requests it receives and answers each 200."""

    def __init__(self) -> None:
        self.requests = 0
        downstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                downstream.requests += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )


@pytest.fixture
def downstream() -> Iterator[_Downstream]:
    server = _Downstream()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def _forward_context(url: str, lease_left: float) -> tuple[Event, HandlerContext]:
    meta = EventMeta(
        receipt_id=1,
        source_id=1,
        source="src_test",
        provider="standard",
        event_id="evt_fence",
        event_type="fence.case",
        occurred_at=None,
        received_at=datetime.now(UTC),
        content_type="application/json",
    )
    ctx = HandlerContext(
        idempotency_key="key-fence",
        delivery_id=1,
        attempt=1,
        generation=0,
        meta=meta,
        route=RouteInfo(1, "forward", {"url": url, "allow_private": "true"}, "whsec_" + "A" * 32),
        session=None,  # type: ignore[arg-type]  # forward never touches the database
        clock=SystemClock(),
        io_timeout=5.0,
        lease_left=lambda: lease_left,
    )
    return Event(meta, b'{"id":"evt_fence"}'), ctx


def test_forward_sends_nothing_when_the_lease_cannot_outlive_its_call(
    downstream: _Downstream,
) -> None:
    """The fence stands right before the request: a lease shorter than the I/O timeout plus
    the commit margin sends nothing; one just long enough sends."""
    event, ctx = _forward_context(downstream.url, lease_left=5.0 + COMMIT_MARGIN - 0.01)
    with pytest.raises(LeaseFenced) as raised:
        forward(event, ctx)
    assert downstream.requests == 0
    assert raised.value.reason == "fenced"
    assert "no call was made" in str(raised.value)
    event, ctx = _forward_context(downstream.url, lease_left=5.0 + COMMIT_MARGIN)
    forward(event, ctx)
    assert downstream.requests == 1


def test_a_success_records_when_it_committed_and_deliveries_show_prints_it(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """Every repeat has a name (issue 32 item 2): each attempt's row says when its handler
    returned (``ended_at``: the downstream's 2xx) and when its outcome committed
    (``committed_at``, the database's clock), for a handler that wrote through ``ctx.session``
    (its writes and the success in one transaction) and one that did not (the batch
    statement); ``webhooks deliveries show`` prints the time between."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}, {"handler": "log"}])
    ids = accept_event(settings, source)[1].delivery_ids
    rt = build_runtime(settings, worker="commit-time")
    try:
        for delivery_id in ids:
            assert deliver_one(rt, delivery_id, publish_retry=lambda d, c: None) == "succeeded"
    finally:
        rt.close()
    for delivery_id in ids:
        (attempt,) = attempts(engine, delivery_id)
        assert attempt.committed_at is not None
        lag = (attempt.committed_at - attempt.ended_at).total_seconds()
        assert -0.05 <= lag < 5, lag  # ended_at is the claim's instant plus elapsed time
        shown = cli("deliveries", "show", str(delivery_id), "--json", env=worker_env())
        assert shown.returncode == 0, shown.stderr
        (logged,) = json.loads(shown.stdout)["delivery"]["attempt_log"]
        assert logged["committed_at"] is not None
        # A wide terminal, so the table does not wrap the outcome cell.
        wide = {**worker_env(), "COLUMNS": "200"}
        human = cli("deliveries", "show", str(delivery_id), env=wide).stdout
        assert re.search(r"\(committed \d+ ms after\)", human), human


def _repeat_windows(cause: str) -> float:
    return REGISTRY.get_sample_value("webhooks_repeat_windows_total", {"cause": cause}) or 0.0


def test_a_claim_that_takes_over_a_lost_workers_lease_names_the_repeat_window(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """A worker claimed and was lost (its lease runs out, nothing recorded): the claim that
    takes the lease over counts ``lease_taken_over`` and logs it, and ``deliveries show``
    names that attempt as one whose call may have reached the downstream too. On a pinned
    clock: nothing waits for the lease."""
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    start = datetime.now(UTC)
    with sessions() as session, session.begin():  # the lost worker's claim
        assert transitions.claim(
            session, delivery_id, now=start, lease=timedelta(seconds=settings.processing_ttl),
            max_redeliveries=3, worker="lost",
        ) is not None  # fmt: skip
    later = start + timedelta(seconds=settings.processing_ttl + 1)
    rt = build_runtime(settings, clock=FrozenClock(later), worker="taker")
    before = _repeat_windows("lease_taken_over")
    try:
        assert deliver_one(rt, delivery_id, publish_retry=lambda d, c: None) == "succeeded"
    finally:
        rt.close()
    assert _repeat_windows("lease_taken_over") == before + 1
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [
        (1, "crashed"),
        (2, "succeeded"),
    ]
    shown = cli("deliveries", "show", str(delivery_id), env=worker_env())
    assert shown.returncode == 0, shown.stderr
    assert "attempt 1's call may have reached the downstream too: lease taken over" in " ".join(
        shown.stdout.split()
    )


class _Slow(_Downstream):
    """Answers 200 after ``delay`` seconds: past the worker's I/O timeout."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.arrived = 0
        handler = self.server.RequestHandlerClass
        slow = self

        class Late(handler):  # type: ignore[misc,valid-type]
            def do_POST(self) -> None:
                slow.arrived += 1
                time.sleep(slow.delay)
                super().do_POST()

        self.server.RequestHandlerClass = Late


def test_a_retry_after_a_call_that_timed_out_names_the_repeat_window(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """A forward whose downstream answers after the I/O timeout: the call was sent, so the
    retry may repeat it. Counted as ``answer_timeout``, and shown by ``deliveries show``."""
    slow = _Slow(delay=1.5)  # the suite's WEBHOOKS_HANDLER_IO_TIMEOUT is 1 s
    slow.thread.start()
    remember(FORWARD_SECRET)
    settings = worker_settings()
    source = make_source(
        sessions,
        settings,
        routes=[
            {
                "handler": "forward",
                "options": {"url": slow.url, "secret": FORWARD_SECRET, "allow_private": "true"},
            }
        ],
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    rt = build_runtime(settings, worker="timed-out")
    before = _repeat_windows("answer_timeout")
    try:
        assert deliver_one(rt, delivery_id, publish_retry=lambda d, c: None) == "retry"
    finally:
        rt.close()
        slow.server.shutdown()
        slow.server.server_close()
    assert _repeat_windows("answer_timeout") == before + 1
    assert slow.arrived == 1  # it arrived: the downstream may have applied it
    # The next attempt's claim makes the first one's window visible to the operator.
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE deliveries SET next_attempt_at = now() WHERE id = :id"),
            {"id": delivery_id},
        )
    rt = build_runtime(settings, worker="next")
    try:
        deliver_one(rt, delivery_id, publish_retry=lambda d, c: None)
    finally:
        rt.close()
    shown = " ".join(cli("deliveries", "show", str(delivery_id), env=worker_env()).stdout.split())
    assert "attempt 1's call may have reached the downstream too: answer timed out" in shown


def test_a_worker_frozen_past_its_handlers_limits_carries_on_when_it_thaws(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """The whole worker stopped (SIGSTOP, a frozen host) longer than its handler's hard limit
    and kill deadline, but not its lease: on the thaw its watchdog sees a pause, not a stuck
    handler (the process spent no CPU meanwhile), moves the limits by it and logs
    ``worker.paused``; the handler finishes and its success is committed, one call, the
    worker alive. It used to kill itself on the thaw (worker.handler_stuck) with the answer in
    hand, taking a healthy host down."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (dispatch,) = new_dispatches(sessions, [("gate", {"marker_dir": str(marks)})])
    delivery_id = dispatch.delivery_id
    settings = worker_settings()
    publish_one_message([dispatch])
    with running_worker("thawed", tmp_path) as worker:
        wait_for(
            lambda: list(marks.glob(f"{delivery_id}.1.*")), timeout=30, what="the handler's call"
        )
        _signal_all(worker, signal.SIGSTOP)
        try:
            # Past the kill deadline (1.5 x the hard limit), well within the lease (4 x).
            time.sleep(1.5 * settings.hard_time_limit + 1)
        finally:
            _signal_all(worker, signal.SIGCONT)
        # The handler still waits: the watchdog looks first (it killed the worker here).
        paused = wait_for(
            lambda: [e for e in worker.json_lines() if e.get("event") == "worker.paused"],
            timeout=10,
            what="the watchdog to see the pause",
        )
        (marks / "open").write_text("")
        wait_status(engine, delivery_id, "succeeded", timeout=30)
        assert worker.alive()
        log = worker.output()
    assert paused[0]["seconds"] >= 1.5 * settings.hard_time_limit
    assert "worker.handler_stuck" not in log, log[-3000:]
    assert len(list(marks.glob(f"{delivery_id}.*"))) == 1  # one call
    assert [(a.number, a.outcome) for a in attempts(engine, delivery_id)] == [(1, "succeeded")]

"""The receiver's publisher thread cannot die silently (issue 19, section 2): a death is
counted, logged as one line and survived by a restart; ``/readyz`` is red in between; the
queue is bounded. Real Redis broker throughout; the fault is injected through the
publisher's ``before_publish`` hook, never by a mock of Redis."""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker
from structlog.testing import capture_logs

from core.messages import DELIVERIES_QUEUE, Dispatch
from ingest.app import create_app
from tasks.publisher import Publisher
from tests.conftest import make_settings
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.signing import sign
from tests.workers import BROKER_URL, flush_redis, wait_for


class Injected(RuntimeError):
    """The fault the tests inject into the publisher's loop."""


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def queued_ids(client: redis.Redis) -> list[int]:
    """Every delivery id in the deliveries queue, oldest message first."""
    ids: list[int] = []
    for wire in reversed(client.lrange(DELIVERIES_QUEUE, 0, -1)):
        arg = json.loads(base64.b64decode(json.loads(wire)["body"]))[0][0]
        ids += arg if isinstance(arg, list) else [arg]
    return ids


class KillOnce:
    """Raises in the publisher's loop for the first batch it is about to publish."""

    def __init__(self) -> None:
        self.fired = threading.Event()

    def __call__(self, batch: Sequence[Dispatch]) -> None:
        if not self.fired.is_set():
            self.fired.set()
            raise Injected("injected into the publisher loop")


@pytest.fixture(autouse=True)
def _no_admission_state() -> None:
    """Admission's keys (adm:*) live in the claims database of Redis, which outlives a test
    run's Postgres database: another run's in-flight sets under the same route ids would
    hold these deliveries back (seen: the readyz test's second event never published)."""
    flush_redis(make_settings().redis_url)


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    flush_redis(BROKER_URL)
    client = redis.Redis.from_url(BROKER_URL)
    yield client
    flush_redis(BROKER_URL)
    client.close()


# These tests' ids are no row's: admission (models/admission.py) looks each id's route up,
# and the rows of other tests in the shared database (ids 1, 2, ...) have routes with limits
# that would hold some of them back. An id with no row is published at once, as before.
_NO_ROW = 10**12


def _dispatch(n: int) -> Dispatch:
    return Dispatch(_NO_ROW + n, f"evt_{n}", "src_test")


def _queued(client: redis.Redis) -> list[int]:
    """The ``n`` of each :func:`_dispatch` in the deliveries queue, oldest first."""
    return [i - _NO_ROW for i in queued_ids(client) if i > _NO_ROW]


def test_a_dead_publisher_thread_is_counted_logged_and_restarted(broker: redis.Redis) -> None:
    kill = KillOnce()
    # A 1 s linger: a delivery published well within it was not lingered over.
    settings = make_settings(broker_url=BROKER_URL, publish_linger=1.0)
    publisher = Publisher(settings, restart_delay=0.5, before_publish=kill)
    deaths = sample("webhooks_publisher_deaths_total")
    died_holding = sample("webhooks_publish_deferred_total", source="t", reason="publisher_died")
    try:
        with capture_logs() as logs:
            publisher.submit("t", [_dispatch(1)])
            wait_for(kill.fired.is_set, timeout=5, what="the injected fault")
            wait_for(lambda: not publisher.running(), timeout=5, what="the thread to be down")
            publisher.submit("t", [_dispatch(2)])  # while it is down: queued, not lost
            wait_for(publisher.running, timeout=5, what="the restart")
            # The new thread starts quiet: a lone delivery goes out at once, not after the
            # 1 s linger (the dead thread took its last one only 0.5 s before).
            wait_for(lambda: _queued(broker) == [2], timeout=0.8, what="the queued one")
    finally:
        publisher.close()
        publisher.app.close()
    assert sample("webhooks_publisher_deaths_total") == deaths + 1
    # The delivery the dead thread held is left pending for the sweeper, and counted.
    assert (
        sample("webhooks_publish_deferred_total", source="t", reason="publisher_died")
        == died_holding + 1
    )
    died = [e for e in logs if e["event"] == "publisher_died"]
    assert died == [
        {
            "event": "publisher_died",
            "log_level": "error",
            "error": "Injected",
            "deliveries": 1,
            "restart_in": 0.5,
        }
    ]
    assert "exc_info" not in died[0]  # an expected condition: one line, no traceback


def test_the_queue_is_bounded_and_what_is_past_it_is_left_to_the_sweeper(
    broker: redis.Redis,
) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold(batch: Sequence[Dispatch]) -> None:  # the broker as slow as it gets
        entered.set()
        release.wait(10)

    publisher = Publisher(
        make_settings(broker_url=BROKER_URL, publish_queue_limit=3), before_publish=hold
    )
    full = sample("webhooks_publish_deferred_total", source="t", reason="queue_full")
    try:
        publisher.submit("t", [_dispatch(1)])  # taken by the thread, which then blocks
        wait_for(entered.is_set, timeout=5, what="the thread to hold the first")
        publisher.submit("t", [_dispatch(i) for i in range(2, 7)])  # 3 fit, 2 do not
        publisher.submit("t", [_dispatch(7)])
        assert publisher._queue.qsize() == 3  # noqa: SLF001  (the bound itself)
        assert sample("webhooks_publish_deferred_total", source="t", reason="queue_full") == (
            full + 3
        )
        release.set()
        wait_for(lambda: sorted(_queued(broker)) == [1, 2, 3, 4], timeout=5, what="drain")
        publisher.submit("t", [_dispatch(8)])  # room again
        wait_for(lambda: 8 in _queued(broker), timeout=5, what="room again")
    finally:
        release.set()
        publisher.close()
        publisher.app.close()
    assert sorted(_queued(broker)) == [1, 2, 3, 4, 8]  # 5, 6, 7: pending, for the sweeper


def test_the_queue_limit_setting_is_bounded() -> None:
    assert make_settings().publish_queue_limit == 10_000
    for bad in (0, -1, 1_000_001):
        with pytest.raises(ValueError, match="publish_queue_limit"):
            make_settings(publish_queue_limit=bad)


# --- through the receiver: /readyz red while the thread is down, then green ---------------


def _signed(source: MadeSource) -> tuple[str, dict[str, str], bytes]:
    event_id = f"evt_{uuid.uuid4().hex}"
    headers, body = sign("standard", source.secret, event_id=event_id, event_type="a.b")
    remember(body)
    return event_id, headers, body


def _delivery_ids(engine: Engine, source: MadeSource, event_id: str) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT d.id FROM deliveries d JOIN receipts r ON r.id = d.receipt_id"
                    " WHERE r.source_id = :s AND r.event_id = :e"
                ),
                {"s": source.id, "e": event_id},
            ).scalars()
        )


async def _until(
    client: httpx.AsyncClient, path: str, status: int, within: float = 10.0
) -> httpx.Response:
    """GET ``path`` until it answers ``status`` (bounded; returns the last answer)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        response = await client.get(path)
        if response.status_code == status or loop.time() > deadline:
            return response
        await asyncio.sleep(0.01)


def test_readyz_is_red_while_the_publisher_is_down_and_events_still_go_out(
    broker: redis.Redis, sessions: sessionmaker[Session], engine: Engine
) -> None:
    settings = make_settings(broker_url=BROKER_URL)
    source = make_source(sessions, settings, provider="standard")
    remember(source.secret)
    kill = KillOnce()
    deaths = sample("webhooks_publisher_deaths_total")

    async def scenario() -> dict[str, Any]:
        app = create_app(settings)
        publisher = app.state.receiver.publisher
        publisher.before_publish = kill
        publisher.restart_delay = 1.0
        seen: dict[str, Any] = {}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://receiver"
            ) as client,
        ):
            seen["before"] = await client.get("/readyz")
            posted = []
            for _ in range(3):
                event_id, headers, body = _signed(source)
                url = f"/webhooks/{source.public_id}"
                response = await client.post(url, headers=headers, content=body)
                assert response.status_code == 202
                posted.append(event_id)
                if len(posted) == 1:  # its batch kills the thread
                    seen["red"] = await _until(client, "/readyz", 503)
                if len(posted) == 2:  # accepted while the thread is down
                    seen["green"] = await _until(client, "/readyz", 200)
            seen["posted"] = posted
            wanted = {i for e in posted[1:] for i in _delivery_ids(engine, source, e)}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5  # well inside publish_grace: not the sweeper
            while not wanted <= set(queued_ids(broker)) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            seen["queued"] = set(queued_ids(broker))
        return seen

    seen = asyncio.run(scenario())
    assert seen["before"].status_code == 200
    assert seen["red"].status_code == 503
    assert seen["red"].json() == {
        "status": "not ready",
        "database": "ok",
        "broker": "ok",
        "publisher": "down",
    }
    assert seen["green"].status_code == 200
    assert seen["green"].json()["publisher"] == "ok"
    first, *later = seen["posted"]
    assert not set(_delivery_ids(engine, source, first)) & seen["queued"]  # the sweeper's
    for event_id in later:
        assert set(_delivery_ids(engine, source, event_id)) <= seen["queued"]
    assert sample("webhooks_publisher_deaths_total") == deaths + 1


class _CountingQueue(queue.SimpleQueue[Any]):
    """The publisher's own queue, counting the blocking takes that can wait for a submit:
    each such wait is a wake-up of the thread (and a GIL switch away from the event loop) at
    the next submit."""

    def __init__(self) -> None:
        self.waits = 0

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and timeout is not None:
            self.waits += 1
        return super().get(block, timeout)


def test_a_lingering_publisher_is_not_woken_by_each_submit() -> None:
    """Issue 24: while the thread lingers for the rest of a burst, it sleeps once and then
    takes what came; waiting on the queue instead woke it at every submit, which cost the
    event loop the GIL per request (py-spy: 10% of the receiver's samples). The batch is the
    same: the lingered delivery goes out with the ones that came during the linger."""
    flush_redis(BROKER_URL)
    client = redis.Redis.from_url(BROKER_URL)
    # Without admission: ids 1-3 may be rows of other tests (their routes' budgets would
    # decide); this test is about the thread's linger only.
    publisher = Publisher(make_settings(broker_url=BROKER_URL, publish_linger=0.2, admission=False))
    counting = _CountingQueue()
    publisher._queue = counting  # noqa: SLF001  (before the thread starts: it reads this one)
    try:
        first, second, third = (Dispatch(i, f"evt_{i}", "src") for i in (1, 2, 3))
        publisher.submit("test", [first])  # after a quiet spell: at once, no linger
        wait_for(lambda: client.llen(DELIVERIES_QUEUE) == 1, timeout=10, what="the first")
        publisher.submit("test", [second, third])  # right behind it: lingered over
        wait_for(lambda: client.llen(DELIVERIES_QUEUE) == 2, timeout=10, what="the burst")
        assert queued_ids(client) == [1, 2, 3]
        assert counting.waits == 0
    finally:
        publisher.close()
        publisher.app.close()
        flush_redis(BROKER_URL)
        client.close()

"""The failure paths of a lane's hand-over (tasks/deliver.py, issue 37): the worker's Redis
unreachable when a lane's next head is to take its predecessor's admission slot, or when a
head whose publish failed is to leave the slot it was handed. Each is a handled condition:
one structured line, no exception out of the task's end, and the head still goes out (the
hand-over failing never keeps a lane's next event from its publish). The real statements on
the suite's Postgres and a real Redis client refused at a closed port; the lane read and
published as the worker's task does, in this process."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session, sessionmaker
from structlog.testing import capture_logs

from core.messages import Dispatch
from models import transitions
from tasks import deliver
from tasks.runtime import Runtime, build_runtime
from tasks.steps.outcome import Outcome, Report
from tests.lanes_support import accept, delivery_of, lane_source
from tests.retention_support import claim
from tests.workers import worker_settings

NOWHERE = "http://127.0.0.1:9/hook"  # never called: no handler runs here
CLOSED = "redis://127.0.0.1:1/0"  # nothing listens: every command is refused


@pytest.fixture
def unreachable() -> Iterator[Runtime]:
    """A worker's runtime whose Redis (admission, limits) refuses every connection."""
    made = build_runtime(worker_settings(redis_url=CLOSED), worker="hand-over-test")
    yield made
    made.close()


def test_a_hand_over_that_cannot_reach_redis_still_publishes_the_lanes_next_head(
    unreachable: Runtime, sessions: sessionmaker[Session]
) -> None:
    """Two events of one key; the first succeeds. Its task's end reads the lane's next head
    (the second) and tries to hand it the first's slot: Redis refuses, one line
    (``delivery.hand_over_failed``, the error's class only), nothing counted as handed (the
    first's slot is released as usual by the caller), and the head is published all the
    same, in one message."""
    settings = worker_settings()
    source = lane_source(sessions, NOWHERE)
    (route,) = source.route_ids
    first, second = (
        delivery_of(settings, accept(settings, source, {"key": "k", "seq": n})[1]) for n in range(2)
    )
    now = datetime.now(UTC)
    found = claim(sessions, first, now)
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=now)
    published: list[list[int]] = []

    def publish(group: Sequence[Dispatch]) -> None:
        published.append([d.delivery_id for d in group])

    ended = Report(Outcome.SUCCEEDED, first, route_id=route, lane=(route, "k"))
    with capture_logs() as logs:
        handed = deliver.lane_heads(unreachable, [ended], publish)
    assert handed == set()  # nothing handed over: the caller releases the first's slot
    assert published == [[second]]
    failed = [e for e in logs if e["event"] == "delivery.hand_over_failed"]
    assert len(failed) == 1, logs
    assert failed[0]["log_level"] == "warning"
    assert failed[0]["error_class"] == "ConnectionError"
    assert "exc_info" not in failed[0]  # a handled condition: no traceback
    assert not [e for e in logs if e["event"] == "delivery.lane_publish_failed"]


def test_a_head_that_cannot_leave_its_slot_is_one_line_and_no_exception(
    unreachable: Runtime,
) -> None:
    """A head whose publish failed leaves the slot it was handed; with Redis refused, one
    line (``delivery.release_failed``): the reconcile frees the slot after the grace, and
    the task's end goes on."""
    with capture_logs() as logs:
        deliver.unpublished(unreachable, {41: 7, 42: 7, 43: 8})
    failed = [e for e in logs if e["event"] == "delivery.release_failed"]
    assert len(failed) == 1, logs
    assert failed[0]["error_class"] == "ConnectionError"
    with capture_logs() as logs:
        deliver.unpublished(unreachable, {})  # nothing handed: Redis not asked
    assert logs == []

"""Handlers: ``forward`` against a real local HTTP server, the subscription ordering guard,
the handler's session sharing the success transaction, and fencing of a stale attempt."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks.webhooks import Webhook

from core.clock import FrozenClock
from tasks.context import Event, HandlerContext
from tasks.errors import RetryableError
from tasks.handlers import register
from tasks.handlers.subscription import apply_subscription_event
from tasks.pipeline import deliver_one
from tasks.runtime import Runtime, build_runtime
from tests.factories import accept_event, make_source
from tests.handlers_for_tests import record_effect
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.workers import (
    Broker,
    attempts,
    delivery,
    effects,
    retry_logs,
    running_worker,
    wait_status,
    worker_settings,
)

pytestmark = pytest.mark.usefixtures("clean_worker_state")

ROUTE_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


# -- forward ------------------------------------------------------------------------------


class Downstream:
    """A real HTTP server. Bodies containing a key of ``plan`` get its statuses in turn."""

    def __init__(self, plan: dict[bytes, list[tuple[int, dict[str, str]]]]) -> None:
        self.plan = plan
        self.requests: list[tuple[dict[str, str], bytes]] = []
        downstream = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                downstream.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status, headers = 200, dict[str, str]()
                for marker, answers in downstream.plan.items():
                    if marker in body and answers:
                        status, headers = answers.pop(0)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def __enter__(self) -> Downstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loopback.close()

    def received(self, marker: bytes) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in self.requests if marker in b]


def _resource_event(event_id: str, tag: str) -> dict[str, Any]:
    # Two events about the same customer: the key must follow the event, not the resource.
    return {
        "id": event_id,
        "type": "customer.updated",
        "tag": tag,
        "data": {"object": {"id": "cus_1"}},
    }


@pytest.mark.slow
def test_forward_sends_one_key_per_event_on_every_retry_signed_with_the_route_secret(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    remember(ROUTE_SECRET)
    overrides: dict[str, Any] = {"retry_cap": timedelta(seconds=2)}
    settings = worker_settings(**overrides)
    plan: dict[bytes, list[tuple[int, dict[str, str]]]] = {
        b"flaky-downstream": [(503, {}), (429, {"Retry-After": "1"}), (200, {})],
        b"rejecting-downstream": [(400, {})],
    }
    with Downstream(plan) as downstream:
        source = make_source(
            sessions,
            settings,
            routes=[
                {
                    "handler": "forward",
                    "options": {
                        "url": downstream.url,
                        "secret": ROUTE_SECRET,
                        "allow_private": "true",
                    },
                }
            ],
        )
        first = accept_event(
            settings, source, event_id="evt_a", body=_resource_event("evt_a", "flaky-downstream")
        )
        second = accept_event(
            settings, source, event_id="evt_b", body=_resource_event("evt_b", "steady")
        )
        third = accept_event(
            settings,
            source,
            event_id="evt_c",
            body=_resource_event("evt_c", "rejecting-downstream"),
        )
        ids = [outcome.delivery_ids[0] for _, outcome in (first, second, third)]
        broker = Broker(settings)
        with running_worker("forward", tmp_path, **overrides) as worker:
            for delivery_id in ids:
                broker.publish(delivery_id)
            wait_status(engine, ids[0], "succeeded")
            wait_status(engine, ids[1], "succeeded")
            rejected = wait_status(engine, ids[2], "dead")
        broker.close()

    retried = downstream.received(b"flaky-downstream")
    assert len(retried) == 3
    keys = {headers["idempotency-key"] for headers, _ in retried}
    assert len(keys) == 1
    [other] = downstream.received(b'"steady"')
    assert other[0]["idempotency-key"] not in keys
    verifier = Webhook(ROUTE_SECRET)
    with sessions() as session:
        original = session.execute(
            text("SELECT payload FROM receipts WHERE event_id = 'evt_a' AND source_id = :s"),
            {"s": source.id},
        ).scalar_one()
    for headers, body in [*retried, other]:
        assert headers["webhook-id"] == headers["idempotency-key"]
        verifier.verify(body, headers)  # raises if the signature does not match
    assert all(body == bytes(original) for _, body in retried)
    # 429 with Retry-After: 1 -> the second retry waited exactly what was asked.
    delays = [line["delay_s"] for line in retry_logs(worker, ids[0])]
    assert len(delays) == 2
    assert delays[1] == 1.0
    # Other 4xx are permanent.
    assert (rejected.dead_reason, rejected.attempts) == ("permanent", 1)
    assert rejected.last_error == "http_rejected: downstream answered HTTP 400"


# -- the subscription handler's ordering guard --------------------------------------------


def _subscription_event(event_id: str, created: int, status: str) -> dict[str, Any]:
    return {
        "id": event_id,
        "type": "customer.subscription.updated",
        "created": created,
        "data": {"object": {"id": "sub_1", "customer": "cus_9", "status": status}},
    }


def _stored(engine: Engine, source_id: int, subscription_id: str = "sub_1") -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT * FROM subscriptions WHERE source_id = :s AND subscription_id = :id"),
            {"s": source_id, "id": subscription_id},
        ).one()


@pytest.mark.slow
def test_an_older_subscription_event_arriving_after_a_newer_one_changes_nothing(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    source = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "stripe_subscription", "events": "customer.subscription.*"}],
    )

    def accept(event_id: str, created: int, status: str) -> int:
        body = _subscription_event(event_id, created, status)
        return accept_event(
            settings, source, event_id=event_id, event_type=body["type"], body=body
        )[1].delivery_ids[0]

    newer = accept("evt_new", 1_780_000_200, "active")
    older = accept("evt_old", 1_780_000_100, "past_due")
    broker = Broker(settings)
    with running_worker("subs", tmp_path):
        broker.publish(newer)
        wait_status(engine, newer, "succeeded")
        assert _stored(engine, source.id).status == "active"
        broker.publish(older)
        wait_status(engine, older, "succeeded")
    broker.close()

    stored = _stored(engine, source.id)
    assert (stored.status, stored.event_id) == ("active", "evt_new")
    assert stored.event_created == datetime.fromtimestamp(1_780_000_200, UTC)


def test_the_ordering_guard_breaks_ties_by_event_id_whatever_the_arrival_order(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    same_second = datetime(2026, 5, 1, tzinfo=UTC)
    now = datetime.now(UTC)
    for source_id, order in ((900_001, ("evt_a", "evt_b")), (900_002, ("evt_b", "evt_a"))):
        for event_id in order:
            with sessions() as session, session.begin():
                apply_subscription_event(
                    session,
                    source_id=source_id,
                    subscription_id="sub_tie",
                    customer=None,
                    status=f"status_of_{event_id}",
                    event_id=event_id,
                    event_created=same_second,
                    now=now,
                )
        assert _stored(engine, source_id, "sub_tie").event_id == "evt_b"
    # Replaying the stored event itself changes nothing either.
    with sessions() as session, session.begin():
        assert not apply_subscription_event(
            session, source_id=900_001, subscription_id="sub_tie", customer=None,
            status="changed", event_id="evt_b", event_created=same_second, now=now,
        )  # fmt: skip


# -- the handler's session and fencing (the task's code in this process) -------------------

_nested: dict[str, Any] = {}


@register("effect_then_fail")
def effect_then_fail(event: Event, ctx: HandlerContext) -> None:
    record_effect(event, ctx)
    raise RetryableError("fails after writing", reason="planned")


@register("overtaken")
def overtaken(event: Event, ctx: HandlerContext) -> None:
    """Writes its effect, then (first run only) lets another worker take the delivery over
    as if this one had stalled past its lease, before returning."""
    record_effect(event, ctx)
    runtime = _nested.pop("runtime", None)
    if runtime is not None:
        runtime.redis.delete(runtime.claims.key(ctx.delivery_id, ctx.generation))  # its TTL ran out
        _nested["outcome"] = deliver_one(runtime, ctx.delivery_id, publish_retry=_no_publish)


def _no_publish(delivery_id: int, countdown: float) -> None:
    pass


@pytest.fixture
def runtimes() -> Iterator[list[Runtime]]:
    made: list[Runtime] = []
    yield made
    for runtime in made:
        runtime.close()


def _runtime(made: list[Runtime], at: datetime, name: str) -> Runtime:
    runtime = build_runtime(worker_settings(), clock=FrozenClock(at), worker=name)
    made.append(runtime)
    return runtime


def test_a_handler_session_commits_only_with_success(
    engine: Engine, sessions: sessionmaker[Session], runtimes: list[Runtime]
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "effect_then_fail"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    runtime = _runtime(runtimes, datetime.now(UTC), "w1")
    assert deliver_one(runtime, delivery_id, publish_retry=_no_publish) == "retry"
    assert effects(engine, delivery_id) == []  # written, then rolled back with the failure
    assert delivery(engine, delivery_id).status == "retrying"


def test_an_attempt_whose_lease_was_taken_over_cannot_commit_its_effect(
    engine: Engine, sessions: sessionmaker[Session], runtimes: list[Runtime]
) -> None:
    settings = worker_settings()
    source = make_source(sessions, settings, routes=[{"handler": "overtaken"}])
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    now = datetime.now(UTC)
    stalled = _runtime(runtimes, now, "stalled")
    later = now + timedelta(seconds=settings.processing_ttl + 1)
    _nested["runtime"] = _runtime(runtimes, later, "rescuer")

    assert deliver_one(stalled, delivery_id, publish_retry=_no_publish) == "lost"
    assert _nested["outcome"] == "succeeded"
    [effect] = effects(engine, delivery_id)
    assert effect.attempt == 2  # only the rescuer's write committed
    tries = attempts(engine, delivery_id)
    assert [(a.number, a.outcome, a.worker) for a in tries] == [
        (1, "crashed", "stalled"),
        (2, "succeeded", "rescuer"),
    ]


def test_a_dropped_payload_or_an_unknown_handler_is_a_dead_letter_with_its_reason(
    engine: Engine, sessions: sessionmaker[Session], runtimes: list[Runtime]
) -> None:
    settings = worker_settings()
    source = make_source(
        sessions, settings, routes=[{"handler": "effect"}, {"handler": "not_installed"}]
    )
    effect_route, unknown_route = source.route_ids

    def delivery_for(route_id: int) -> int:
        event_id = accept_event(settings, source)[0]
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT d.id FROM deliveries d JOIN receipts r ON r.id = d.receipt_id "
                        "WHERE r.event_id = :e AND d.route_id = :r"
                    ),
                    {"e": event_id, "r": route_id},
                ).scalar_one()
            )

    gone_payload = delivery_for(effect_route)
    with engine.begin() as conn:  # what retention does to an old receipt
        conn.execute(
            text(
                "UPDATE receipts SET payload = NULL FROM deliveries d "
                "WHERE d.id = :id AND receipts.id = d.receipt_id"
            ),
            {"id": gone_payload},
        )
    unknown = delivery_for(unknown_route)
    runtime = _runtime(runtimes, datetime.now(UTC), "w1")
    assert deliver_one(runtime, gone_payload, publish_retry=_no_publish) == "dead"
    assert deliver_one(runtime, unknown, publish_retry=_no_publish) == "dead"

    row = delivery(engine, gone_payload)
    assert (row.dead_reason, row.attempts) == ("permanent", 1)
    assert row.last_error.startswith("payload_gone: ")
    row = delivery(engine, unknown)
    assert row.last_error == "unknown_handler: no handler registered under 'not_installed'"


@pytest.mark.slow
def test_the_soft_time_limit_is_a_retryable_failure(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    settings = worker_settings()
    # Sleeps 2.8 s on its first attempt: past the soft limit (2.5 s), short of the hard (3 s).
    source = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "slow_effect", "options": {"marker_dir": str(tmp_path), "sleep": "2.8"}}
        ],
    )
    delivery_id = accept_event(settings, source)[1].delivery_ids[0]
    broker = Broker(settings)
    with running_worker("soft", tmp_path):
        broker.publish(delivery_id)
        row = wait_status(engine, delivery_id, "succeeded")
    broker.close()
    tries = attempts(engine, delivery_id)
    assert [(a.outcome, a.error_class) for a in tries] == [
        ("retry", "SoftTimeLimitExceeded"),
        ("succeeded", None),
    ]
    assert row.attempts == 2
    assert [e.attempt for e in effects(engine, delivery_id)] == [2]

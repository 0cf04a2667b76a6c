"""Fan-out to a broker (issue 37 item 5): the built-in ``publish`` handler, against the real
RabbitMQ on this machine.

Each test module run makes a vhost and a user of its own (``rabbitmqctl``) and removes them
at the end; the service itself is never stopped. A real worker publishes with publisher
confirms; the messages are read back from a queue bound to the exchange. A broker that
refuses (the user's permissions revoked) or cannot be reached (a TCP proxy cut in front of
it) makes retries that the route's breaker counts, nothing is lost, and once it is back every
event is in the queue, each with its idempotency key as message id.
"""

from __future__ import annotations

import json
import os
import secrets as pysecrets
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.docs import TOPICS
from core.idempotency import idempotency_key
from core.publish_target import publish_target, shown_options
from tests.factories import MadeSource, accept_event, make_source
from tests.leakcheck import remember
from tests.netproxy import CuttableProxy
from tests.operators_support import cli, ops_env
from tests.workers import Broker, running_worker, wait_for, worker_settings

AMQP_PORT = 5672
EXCHANGE = "wh.events"
# Three downstream failures in a minute open a route's breaker; one probe a second.
BREAKER: dict[str, Any] = {
    "breaker_min_requests": 3,
    "breaker_failure_ratio": 0.7,
    "breaker_window": timedelta(minutes=1),
    "breaker_probe_interval": timedelta(seconds=1),
    "max_attempts": 50,
}


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)  # noqa: S603, S607


@dataclass(frozen=True)
class Rabbit:
    vhost: str
    user: str
    password: str
    queue: str

    def url(self, port: int = AMQP_PORT) -> str:
        return f"amqp://{self.user}:{self.password}@127.0.0.1:{port}/{self.vhost}"

    def grant(self) -> None:
        _ctl("set_permissions", "-p", self.vhost, self.user, ".*", ".*", ".*")

    def revoke(self) -> None:
        _ctl("clear_permissions", "-p", self.vhost, self.user)

    def drain(self) -> list[Any]:
        """Every message in the bound queue, taken off it."""
        out = []
        with Connection(self.url()) as conn:
            channel = conn.channel()
            while (message := channel.basic_get(self.queue, no_ack=True)) is not None:
                out.append(message)
        return out


@pytest.fixture(scope="module")
def rabbit() -> Iterator[Rabbit]:
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    made = Rabbit(f"wh_test_{tag}", f"wh_user_{tag}", pysecrets.token_urlsafe(18), "wh.all")
    remember(made.password)  # never in a log line (tests/test_zz_no_leaks.py)
    _ctl("add_vhost", made.vhost)
    try:
        _ctl("add_user", made.user, made.password)
        made.grant()
        with Connection(made.url()) as conn:
            channel = conn.channel()
            channel.exchange_declare(EXCHANGE, "topic", durable=True, auto_delete=False)
            channel.queue_declare(made.queue, durable=True, auto_delete=False)
            channel.queue_bind(made.queue, EXCHANGE, "events.#")
        yield made
    finally:
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", made.vhost], check=False, timeout=60)  # noqa: S603, S607
        subprocess.run(["rabbitmqctl", "-q", "delete_user", made.user], check=False, timeout=60)  # noqa: S603, S607


# -- the options (pure) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"url": "http://mq/", "exchange": "x"}, "needs --option url=amqp://"),
        ({"url": "amqp://mq:99999/", "exchange": "x"}, "not a valid amqp:// URL"),
        ({"url": "amqp://mq/"}, "needs --option exchange=NAME"),
        (
            {"url": "amqp://mq/", "exchange": "x", "routing_key": "{type.__class__}"},
            "may use {type}, {source}, {event_id} only, not {type.__class__}",
        ),
        ({"url": "amqp://mq/", "exchange": "x", "routing_key": "a.{"}, "is not a template"),
        ({"url": "amqp://mq/", "exchange": "x", "queue": "q"}, "not queue"),
    ],
)
def test_bad_publish_options_are_refused_in_one_line(options: dict[str, str], refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        publish_target(options)
    assert refusal in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_publish_url_is_shown_without_its_password() -> None:
    target = publish_target(
        {"url": "amqp://app:s3cret@mq:5672/prod", "exchange": "e", "routing_key": "ev.{type}"}
    )
    assert (
        target.key_for(event_type="invoice.paid", source="src", event_id="e1") == "ev.invoice.paid"
    )
    shown = shown_options({"url": "amqp://app:s3cret@mq:5672/prod", "exchange": "e"})
    assert shown == {"url": "amqp://app:***@mq:5672/prod", "exchange": "e"}
    assert "s3cret" not in repr(target)


# -- saving a route through the CLI ----------------------------------------------------------


@pytest.mark.slow
def test_a_publish_route_is_checked_when_saved_and_shown_masked(
    sessions: sessionmaker[Session], engine: Engine, rabbit: Rabbit
) -> None:
    settings = worker_settings()
    made = make_source(sessions, settings, routes=[])
    env = {**ops_env(), "COLUMNS": "200"}
    refused = cli(
        "routes", "add", made.public_id, "--handler", "publish",
        "--option", f"url={rabbit.url()}", "--option", "routing_key={nope}", env=env,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "needs --option exchange=NAME" in refused.stderr
    assert refused.stderr.rstrip().endswith(f"(see {TOPICS['publish'].path})"), refused.stderr
    assert rabbit.password not in refused.stderr
    with engine.connect() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM routes WHERE source_id = :s"), {"s": made.id}
        ).scalar_one()
    assert count == 0

    added = cli(
        "routes", "add", made.public_id, "--handler", "publish",
        "--option", f"url={rabbit.url()}", "--option", f"exchange={EXCHANGE}",
        "--option", "routing_key=events.{type}", "--json", env=env,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    view = json.loads(added.stdout)
    assert view["options"]["url"] == rabbit.url().replace(rabbit.password, "***")
    for args in (("routes", "show", str(view["id"])), ("routes", "list", made.public_id)):
        shown = cli(*args, env=env)
        assert shown.returncode == 0, shown.stderr
        assert rabbit.password not in shown.stdout
        assert f"{rabbit.user}:***@" in shown.stdout


# -- a real worker, the real RabbitMQ ------------------------------------------------------


def _publishing(sessions: sessionmaker[Session], url: str, **overrides: Any) -> MadeSource:
    route = {
        "handler": "publish",
        "options": {"url": url, "exchange": EXCHANGE, "routing_key": "events.{type}"},
    }
    return make_source(sessions, worker_settings(**overrides), routes=[route])


def _accept(made: MadeSource, n: int, **overrides: Any) -> dict[str, tuple[int, str]]:
    """``n`` events: each one's delivery id and idempotency key, by event id."""
    settings = worker_settings(**overrides)
    out = {}
    for i in range(n):
        event_id, outcome = accept_event(
            settings, made, event_type="invoice.paid", body={"n": i, "type": "invoice.paid"}
        )
        route_id = made.route_ids[0]
        out[event_id] = (outcome.delivery_ids[0], idempotency_key(made.id, event_id, route_id, 0))
    return out


def _statuses(engine: Engine, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
        ).all()
    return {int(r.id): str(r.status) for r in rows}


def _route(engine: Engine, route_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM routes WHERE id = :id"), {"id": route_id}).one()


def _all_succeeded(engine: Engine, broker: Broker, ids: list[int]) -> bool:
    broker.sweep()
    return set(_statuses(engine, ids).values()) == {"succeeded"}


@pytest.mark.slow
@pytest.mark.usefixtures("clean_worker_state")
def test_published_events_land_in_a_bound_queue_with_their_key_as_message_id(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, rabbit: Rabbit
) -> None:
    rabbit.drain()
    made = _publishing(sessions, rabbit.url())
    events = _accept(made, 6)
    ids = [d for d, _ in events.values()]
    broker = Broker(worker_settings())
    with running_worker("publish", tmp_path) as worker:
        for delivery_id in ids:
            broker.publish(delivery_id)
        wait_for(lambda: _all_succeeded(engine, broker, ids), timeout=60, what="every publish")
        lines = worker.json_lines()
    broker.close()
    messages = rabbit.drain()
    assert len(messages) == 6
    by_id = {m.properties["message_id"]: m for m in messages}
    assert set(by_id) == {key for _, key in events.values()}
    for event_id, (_, key) in events.items():
        message = by_id[key]
        assert message.properties["application_headers"] == {
            "webhooks-source": made.public_id,
            "webhooks-event-type": "invoice.paid",
            "webhooks-event-id": event_id,
        }
        assert message.properties["delivery_mode"] == 2
        assert message.properties["content_type"] == "application/json"
        assert message.delivery_info["routing_key"] == "events.invoice.paid"
        assert json.loads(message.body)["type"] == "invoice.paid"
    assert not any(rabbit.password in json.dumps(line) for line in lines)


@pytest.mark.slow
@pytest.mark.usefixtures("clean_worker_state")
def test_a_refusing_broker_retries_opens_the_breaker_and_loses_nothing(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, rabbit: Rabbit
) -> None:
    """The user's permissions revoked: every publish is refused (access refused, then the
    vhost not allowed), retried, counted by the breaker, which opens; nothing goes dead.
    Permissions back: every event lands, each under its key."""
    rabbit.drain()
    made = _publishing(sessions, rabbit.url(), **BREAKER)
    (route_id,) = made.route_ids
    events = _accept(made, 5, **BREAKER)
    ids = [d for d, _ in events.values()]
    broker = Broker(worker_settings(**BREAKER))
    rabbit.revoke()
    try:
        with running_worker("publish-refused", tmp_path, **BREAKER) as worker:
            for delivery_id in ids:
                broker.publish(delivery_id)
            wait_for(
                lambda: _route(engine, route_id).breaker_state != "closed",
                timeout=60,
                what="the breaker to open",
            )
            assert "dead" not in _statuses(engine, ids).values()
            with engine.connect() as conn:
                classes = set(
                    conn.execute(
                        text(
                            "SELECT DISTINCT error_class FROM attempts WHERE delivery_id = ANY(:i)"
                            " AND outcome = 'retry'"
                        ),
                        {"i": ids},
                    ).scalars()
                )
            assert classes == {"DownstreamError"}
            rabbit.grant()
            wait_for(lambda: _all_succeeded(engine, broker, ids), timeout=90, what="the drain")
            lines = worker.json_lines()
    finally:
        rabbit.grant()
        broker.close()
    assert _route(engine, route_id).breaker_trips >= 1
    messages = rabbit.drain()
    # At least once: every event's key is there (a confirm lost to the outage may repeat one).
    assert {m.properties["message_id"] for m in messages} == {key for _, key in events.values()}
    assert "route.breaker_opened" in [line.get("event") for line in lines]
    assert not any(rabbit.password in json.dumps(line) for line in lines)


@pytest.mark.slow
@pytest.mark.usefixtures("clean_worker_state")
def test_an_unreachable_broker_retries_and_every_event_lands_once_it_is_back(
    sessions: sessionmaker[Session], engine: Engine, tmp_path: Path, rabbit: Rabbit
) -> None:
    """The broker behind a TCP proxy: one event lands on a pooled connection, then the proxy
    is cut (connections reset, new ones refused): the next events retry (DownstreamError,
    counted by the breaker) and none goes dead; restored, every event lands."""
    rabbit.drain()
    proxy = CuttableProxy(AMQP_PORT)
    made = _publishing(sessions, rabbit.url(proxy.port), **BREAKER)
    (route_id,) = made.route_ids
    first = _accept(made, 1, **BREAKER)
    first_ids = [d for d, _ in first.values()]
    broker = Broker(worker_settings(**BREAKER))
    try:
        with running_worker("publish-cut", tmp_path, **BREAKER):
            broker.publish(first_ids[0])
            wait_for(lambda: _all_succeeded(engine, broker, first_ids), timeout=60, what="one")
            proxy.cut()
            # Accepted once the broker is gone (the worker's sweep would publish events
            # accepted earlier as soon as it starts).
            later = _accept(made, 4, **BREAKER)
            later_ids = [d for d, _ in later.values()]
            for delivery_id in later_ids:
                broker.publish(delivery_id)
            wait_for(
                lambda: (
                    _route(engine, route_id).window_failures >= 3
                    or _route(engine, route_id).breaker_state != "closed"
                ),
                timeout=60,
                what="failures counted by the breaker",
            )
            assert "dead" not in _statuses(engine, later_ids).values()
            proxy.restore()
            wait_for(
                lambda: _all_succeeded(engine, broker, later_ids), timeout=90, what="the drain"
            )
    finally:
        proxy.close()
        broker.close()
    messages = rabbit.drain()
    keys = {key for _, key in (first | later).values()}
    assert {m.properties["message_id"] for m in messages} == keys

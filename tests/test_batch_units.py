"""Messages of several deliveries (issue 12): how the publisher packs them, what a message
carries, which arguments a worker accepts, and the state Flower shows for a batch. The
publisher tests use the real Redis broker."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis
from celery.exceptions import Retry

from core.messages import DELIVERIES_QUEUE, Dispatch, batch_time_limits, batches, message
from core.settings import MAX_DELIVERY_BATCH
from tasks.deliver import DeadLetter, celery_batch_state, message_ids
from tasks.publisher import Publisher
from tasks.steps.outcome import Report
from tests.conftest import make_settings
from tests.workers import BROKER_URL, flush_redis, wait_for


def _dispatches(n: int) -> list[Dispatch]:
    return [Dispatch(100 + i, f"evt_{i}", f"src_{i % 3}") for i in range(n)]


@pytest.mark.parametrize(
    ("n", "size", "sizes"),
    [(0, 16, []), (1, 16, [1]), (16, 16, [16]), (17, 16, [9, 8]), (33, 16, [11, 11, 11])],
)
def test_what_is_ready_is_split_into_even_messages(n: int, size: int, sizes: list[int]) -> None:
    dispatches = _dispatches(n)
    split = batches(dispatches, size)
    assert [len(b) for b in split] == sizes
    assert [d for b in split for d in b] == dispatches  # every one, once, in order


def test_a_lone_delivery_is_the_message_it_always_was() -> None:
    settings = make_settings()
    [dispatch] = _dispatches(1)
    args, options = message([dispatch], settings)
    assert args == (100,)
    assert options == dispatch.reprs()


def test_a_batch_message_names_every_delivery_and_carries_the_backstop_limits() -> None:
    settings = make_settings(hard_time_limit=60.0)
    dispatches = _dispatches(3)
    args, options = message(dispatches, settings)
    assert args == ([100, 101, 102],)
    assert options["argsrepr"] == "([100, 101, 102],)"
    shown = options["kwargsrepr"]
    assert all(d.event_id in shown and d.source in shown for d in dispatches)
    hard, soft = batch_time_limits(settings)
    assert (options["time_limit"], options["soft_time_limit"]) == (hard, soft)
    # Above each handler's kill (1.5 x hard), under the lease (4 x hard).
    assert 1.5 * 60 < soft < hard < settings.processing_ttl


@pytest.mark.parametrize(
    ("argument", "ids"),
    [
        (7, [7]),
        ([7, 8, 9], [7, 8, 9]),
        ([], None),
        ([7, "8"], None),
        ([True], None),
        (True, None),
        ("7", None),
        (None, None),
        ([[7]], None),
        (list(range(MAX_DELIVERY_BATCH)), list(range(MAX_DELIVERY_BATCH))),
        (list(range(MAX_DELIVERY_BATCH + 1)), None),
    ],
)
def test_a_worker_accepts_an_id_or_a_bounded_list_of_ids(
    argument: Any, ids: list[int] | None
) -> None:
    assert message_ids(argument) == ids


def _report(outcome: str, delivery_id: int, detail: str | None = None) -> Report:
    return Report(outcome, delivery_id, 1, f"evt_{delivery_id}", "src_x", detail)


def test_a_batch_of_successes_is_a_success_naming_each() -> None:
    text = celery_batch_state([_report("succeeded", 1), _report("duplicate", 2)])
    assert text.startswith("2 deliveries (1 duplicate, 1 succeeded): ")
    assert "1: succeeded" in text
    assert "2: duplicate: another copy" in text


def test_a_batch_with_a_retry_is_a_retry_and_with_a_dead_letter_a_failure() -> None:
    with pytest.raises(Retry) as retry:
        celery_batch_state([_report("succeeded", 1), _report("retry", 2, "planned: boom")])
    assert "2: retry: planned: boom" in str(retry.value)
    with pytest.raises(DeadLetter) as dead:
        celery_batch_state(
            [
                _report("retry", 1, "planned: x"),
                _report("dead", 2, "permanent: no"),
                _report("succeeded", 3),
            ]
        )
    assert "3 deliveries (1 dead, 1 retry, 1 succeeded)" in str(dead.value)
    assert "2: dead: permanent: no" in str(dead.value)


def _queued_args(client: redis.Redis) -> list[Any]:
    """The first argument of every queued deliver message, oldest first."""
    wire = reversed(client.lrange(DELIVERIES_QUEUE, 0, -1))  # LPUSH: newest at the head
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[0][0] for m in wire]


def test_the_publisher_sends_a_lone_delivery_at_once_and_lingers_only_under_load() -> None:
    flush_redis(BROKER_URL)
    client = redis.Redis.from_url(BROKER_URL)
    # Admission off: these made-up ids may name rows that earlier tests of this process left
    # in its database, whose routes' limits admission would apply (it held one back in CI:
    # never published). This test is about the linger.
    publisher = Publisher(make_settings(broker_url=BROKER_URL, publish_linger=1.0, admission=False))
    try:
        warm, first, *dense = _dispatches(7)
        # The first publish opens the publisher's thread, producer and connection, which a
        # loaded machine takes most of a second for: done before the timed part.
        publisher.submit("test", [warm])
        wait_for(lambda: client.llen(DELIVERIES_QUEUE) == 1, timeout=30, what="the first one")
        # A quiet spell longer than the linger (real time: the publisher's own clock).
        time.sleep(1.2)
        publisher.submit("test", [first])
        # After a quiet spell: published at once, not after the 1 s linger.
        wait_for(lambda: client.llen(DELIVERIES_QUEUE) == 2, timeout=0.8, what="the lone one")
        for dispatch in dense:  # five arriving close behind it: they wait for each other
            publisher.submit("test", [dispatch])
        wait_for(lambda: client.llen(DELIVERIES_QUEUE) == 3, timeout=10, what="the batch")
        assert _queued_args(client) == [
            warm.delivery_id,
            first.delivery_id,
            [d.delivery_id for d in dense],
        ]
    finally:
        publisher.close()
        publisher.app.close()
        flush_redis(BROKER_URL)
        client.close()


def test_publishing_together_packs_up_to_the_batch_size_per_message() -> None:
    flush_redis(BROKER_URL)
    client = redis.Redis.from_url(BROKER_URL)
    publisher = Publisher(make_settings(broker_url=BROKER_URL, delivery_batch=4))
    try:
        dispatches = _dispatches(10)
        publisher.publish_sync(dispatches)
        ids = [d.delivery_id for d in dispatches]
        assert _queued_args(client) == [ids[:4], ids[4:7], ids[7:]]
    finally:
        publisher.close()
        publisher.app.close()
        flush_redis(BROKER_URL)
        client.close()


def test_the_batch_size_setting_is_bounded() -> None:
    assert make_settings(delivery_batch=1).deliveries_per_message == 1
    assert make_settings(worker_pool="prefork", delivery_batch=8).deliveries_per_message == 8
    for bad in (0, MAX_DELIVERY_BATCH + 1):
        with pytest.raises(ValueError, match="delivery_batch"):
            make_settings(delivery_batch=bad)


def test_the_publisher_reads_a_worker_backlog_from_each_push() -> None:
    """The LPUSH reply is the queue's length: messages no worker took yet make the publisher
    linger longer (fuller messages let the workers catch up); an empty queue, its usual
    linger."""
    flush_redis(BROKER_URL)
    client = redis.Redis.from_url(BROKER_URL)
    publisher = Publisher(make_settings(broker_url=BROKER_URL))
    try:
        first, second, third = _dispatches(3)
        publisher.publish_sync([first])
        assert publisher.backlog == 0  # the queue was empty: nobody is behind
        publisher.publish_sync([second, third])
        assert publisher.backlog == 1  # the first message is still waiting
        client.delete(DELIVERIES_QUEUE)  # the workers took everything
        publisher.publish_sync([first])
        assert publisher.backlog == 0
    finally:
        publisher.close()
        publisher.app.close()
        flush_redis(BROKER_URL)
        client.close()

"""Pure parts of the workers (retry policy, idempotency key, time budgets, handler registry,
Retry-After) and the Redis claim tier against the real Redis."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded
from prometheus_client import REGISTRY

from core.messages import (
    DELIVER_TASK,
    DELIVERIES_QUEUE,
    MAINTENANCE_QUEUE,
    SWEEP_TASK,
    batch_time_limits,
)
from tasks.claims import ClaimStore, claim_key, make_client
from tasks.config import celery_config
from tasks.context import idempotency_key
from tasks.errors import HandlerRegistrationError, PermanentError, UnknownHandlerError
from tasks.handlers import load_registry, register
from tasks.handlers.forward import parse_retry_after
from tasks.policy import (
    DEAD_MAX_AGE,
    DEAD_MAX_ATTEMPTS,
    DEAD_PERMANENT,
    RetryPolicy,
    backoff_bound,
    decide,
)
from tasks.pools import (
    HardTimeLimitExceeded,
    PoolMismatchError,
    check_pool,
    run_limited,
    time_limits,
)
from tasks.runtime import engine_pool_size
from tasks.steps.record import describe_error
from tests.conftest import free_port, make_settings
from tests.workers import CLAIMS_URL

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def policy(**overrides: object) -> RetryPolicy:
    values: dict[str, object] = {
        "base": timedelta(seconds=5),
        "cap": timedelta(hours=6),
        "max_attempts": 12,
        "max_age": timedelta(days=3),
        "max_countdown": timedelta(seconds=3540),
    }
    values.update(overrides)
    return RetryPolicy(**values)  # type: ignore[arg-type]


# -- retry policy -------------------------------------------------------------------------


def test_backoff_bound_doubles_from_base_up_to_the_cap() -> None:
    p = policy(base=timedelta(seconds=5), cap=timedelta(seconds=60))
    bounds = [backoff_bound(p, n).total_seconds() for n in range(1, 8)]
    assert bounds == [5, 10, 20, 40, 60, 60, 60]
    assert backoff_bound(p, 10_000) == timedelta(seconds=60)  # no overflow
    with pytest.raises(ValueError):
        backoff_bound(p, 0)


def test_full_jitter_draws_uniformly_below_the_bound_with_the_injected_random() -> None:
    p = policy(base=timedelta(seconds=1), cap=timedelta(seconds=30))
    rng, replay = random.Random(7), random.Random(7)
    for attempt in range(1, 11):
        decision = decide(
            p,
            attempt=attempt,
            started_at=T0,
            now=T0,
            permanent=False,
            requested_delay=None,
            rng=rng,
        )
        bound = backoff_bound(p, attempt).total_seconds()
        assert decision.retry
        assert 0 <= decision.delay.total_seconds() <= bound
        # Exactly the seeded draw: the policy takes no other randomness.
        assert decision.delay.total_seconds() == pytest.approx(replay.uniform(0, bound), abs=1e-6)
        assert decision.next_attempt_at == T0 + decision.delay


def test_jitter_spreads_a_herd_of_failures() -> None:
    p = policy(base=timedelta(seconds=10), cap=timedelta(seconds=10))
    rng = random.Random(1)
    delays = {
        decide(
            p, attempt=1, started_at=T0, now=T0, permanent=False, requested_delay=None, rng=rng
        ).delay
        for _ in range(50)
    }
    assert len(delays) == 50


def test_exhausted_attempts_go_dead() -> None:
    p = policy(max_attempts=3)
    rng = random.Random(0)
    kwargs = {"started_at": T0, "now": T0, "permanent": False, "requested_delay": None, "rng": rng}
    assert decide(p, attempt=2, **kwargs).retry  # type: ignore[arg-type]
    final = decide(p, attempt=3, **kwargs)  # type: ignore[arg-type]
    assert (final.retry, final.reason, final.next_attempt_at) == (False, DEAD_MAX_ATTEMPTS, None)


def test_max_age_goes_dead_and_the_last_retry_is_clamped_to_the_deadline() -> None:
    p = policy(base=timedelta(hours=1), cap=timedelta(hours=1), max_age=timedelta(hours=2))
    rng = random.Random(3)
    late = T0 + timedelta(hours=1, minutes=59, seconds=50)
    d = decide(
        p, attempt=2, started_at=T0, now=late, permanent=False, requested_delay=None, rng=rng
    )
    assert d.retry
    assert d.next_attempt_at is not None
    assert d.next_attempt_at <= T0 + timedelta(hours=2)
    dead = decide(
        p, attempt=3, started_at=T0, now=T0 + timedelta(hours=2), permanent=False,
        requested_delay=None, rng=rng,
    )  # fmt: skip
    assert (dead.retry, dead.reason) == (False, DEAD_MAX_AGE)


def test_permanent_errors_go_dead_on_the_first_attempt() -> None:
    d = decide(
        policy(), attempt=1, started_at=T0, now=T0, permanent=True, requested_delay=None,
        rng=random.Random(0),
    )  # fmt: skip
    assert (d.retry, d.reason) == (False, DEAD_PERMANENT)


def test_a_requested_delay_is_honoured_within_the_cap() -> None:
    p = policy(cap=timedelta(seconds=60))
    rng = random.Random(0)
    common = {"attempt": 1, "started_at": T0, "now": T0, "permanent": False, "rng": rng}
    assert decide(p, requested_delay=42, **common).delay == timedelta(seconds=42)  # type: ignore[arg-type]
    assert decide(p, requested_delay=86400, **common).delay == timedelta(seconds=60)  # type: ignore[arg-type]
    assert decide(p, requested_delay=0, **common).delay == timedelta()  # type: ignore[arg-type]


def test_short_delays_use_a_countdown_and_long_ones_wait_for_the_sweeper() -> None:
    p = policy(cap=timedelta(hours=2), max_countdown=timedelta(seconds=100))
    rng = random.Random(0)
    common = {"attempt": 1, "started_at": T0, "now": T0, "permanent": False, "rng": rng}
    short = decide(p, requested_delay=99, **common)  # type: ignore[arg-type]
    long = decide(p, requested_delay=101, **common)  # type: ignore[arg-type]
    assert short.countdown == pytest.approx(99)
    assert long.retry
    assert long.countdown is None


def test_route_overrides_and_settings_defaults() -> None:
    settings = make_settings()
    default = RetryPolicy.for_route(settings)
    assert (default.max_attempts, default.max_age) == (settings.max_attempts, settings.max_age)
    assert default.max_countdown == timedelta(
        seconds=settings.visibility_timeout - settings.hard_time_limit
    )
    route = RetryPolicy.for_route(settings, max_attempts=2, max_age_s=600)
    assert (route.max_attempts, route.max_age) == (2, timedelta(minutes=10))


# -- idempotency key ----------------------------------------------------------------------


def test_the_downstream_key_is_stable_per_scope_event_route_and_generation() -> None:
    key = idempotency_key(1, "evt_1", 10, 0)
    assert key == idempotency_key(1, "evt_1", 10, 0)  # every retry and replay
    assert key.startswith("whk_")
    assert len(key) == 36
    others = {
        idempotency_key(2, "evt_1", 10, 0),  # another account's source
        idempotency_key(1, "evt_2", 10, 0),  # another event about the same resource
        idempotency_key(1, "evt_1", 11, 0),  # another route
        idempotency_key(1, "evt_1", 10, 1),  # an explicit re-run
    }
    assert key not in others
    assert len(others) == 4


# -- time budgets and the Celery configuration --------------------------------------------


def test_celery_configuration_follows_the_time_budgets() -> None:
    s = make_settings(
        handler_io_timeout=5, soft_time_limit=20, hard_time_limit=25, visibility_timeout=600
    )
    conf = celery_config(s)
    chain = [
        s.handler_io_timeout,
        conf["task_soft_time_limit"],
        conf["task_time_limit"],
        s.processing_ttl,
        conf["broker_transport_options"]["visibility_timeout"],
    ]
    assert chain == sorted(chain)
    assert len(set(chain)) == len(chain)
    assert s.processing_ttl == 4 * conf["task_time_limit"]
    assert conf["broker_transport_options"] == conf["result_backend_transport_options"]
    # The longest countdown plus the hard limit still fits in the visibility timeout.
    assert (
        s.max_countdown + s.hard_time_limit
        <= conf["broker_transport_options"]["visibility_timeout"]
    )


def test_celery_configuration_is_the_safe_one() -> None:
    conf = celery_config(make_settings())
    assert conf["task_serializer"] == "json"
    assert conf["accept_content"] == ["json"]
    assert conf["task_acks_late"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["task_reject_on_worker_lost"] is True
    # Cancelled on a lost broker where the pool can cancel (the thread pool cannot).
    assert conf["worker_cancel_long_running_tasks_on_connection_loss"] is False  # threads
    for pool in ("prefork", "gevent"):
        cancels = celery_config(make_settings(worker_pool=pool))
        assert cancels["worker_cancel_long_running_tasks_on_connection_loss"] is True, pool
    assert conf["broker_connection_retry_on_startup"] is True
    assert conf["worker_send_task_events"] is True
    assert conf["task_send_sent_event"] is True
    assert {q.name for q in conf["task_queues"]} == {DELIVERIES_QUEUE, MAINTENANCE_QUEUE}
    assert conf["task_routes"][SWEEP_TASK]["queue"] == MAINTENANCE_QUEUE


@pytest.mark.parametrize(
    ("values", "offender"),
    [
        ({"handler_io_timeout": 30, "soft_time_limit": 30}, "WEBHOOKS_HANDLER_IO_TIMEOUT"),
        ({"soft_time_limit": 60, "hard_time_limit": 60}, "WEBHOOKS_SOFT_TIME_LIMIT"),
        ({"hard_time_limit": 100, "visibility_timeout": 300}, "WEBHOOKS_VISIBILITY_TIMEOUT"),
    ],
)
def test_time_budgets_out_of_order_are_refused(values: dict[str, float], offender: str) -> None:
    with pytest.raises(ValueError, match=offender):
        make_settings(**values)


# -- handler registry ---------------------------------------------------------------------


def test_registry_has_the_builtins_the_entry_points_and_the_configured_modules() -> None:
    registry = load_registry(["tests.handlers_for_tests"])
    for name in ("forward", "log", "stripe_subscription", "noop", "flaky", "effect"):
        assert callable(registry.get(name))


def test_an_unknown_handler_is_a_permanent_error_naming_it() -> None:
    registry = load_registry()
    with pytest.raises(UnknownHandlerError) as caught:
        registry.get("no_such_handler")
    assert isinstance(caught.value, PermanentError)
    assert caught.value.reason == "unknown_handler"
    assert "no_such_handler" in str(caught.value)


def test_a_name_registered_twice_or_a_missing_module_is_refused() -> None:
    with pytest.raises(HandlerRegistrationError):
        register("log")(lambda event, ctx: None)
    with pytest.raises(HandlerRegistrationError, match="no_such_module"):
        load_registry(["tests.no_such_module"])


# -- errors and Retry-After ---------------------------------------------------------------


def test_foreign_exception_messages_are_not_stored() -> None:
    try:
        raise KeyError("card_4242424242424242")
    except KeyError as exc:
        described = describe_error(exc)
    assert "4242" not in described
    assert described.startswith("KeyError raised at ")
    assert describe_error(PermanentError("gone", reason="x")) == "x: gone"


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert parse_retry_after("120", now) == 120
    assert parse_retry_after("Sun, 01 Mar 2026 12:01:30 GMT", now) == 90
    assert parse_retry_after("Sun, 01 Mar 2026 11:00:00 GMT", now) == 0
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


# -- the Redis claim tier (real Redis) ----------------------------------------------------


@pytest.fixture
def claims_redis() -> Iterator[redis.Redis]:
    client = make_client(CLAIMS_URL, 0.5)
    client.flushdb()
    yield client
    client.close()


def test_first_claim_wins_and_a_copy_is_a_duplicate(claims_redis: redis.Redis) -> None:
    store = ClaimStore(claims_redis, installation="inst-a", processing_ttl=12)
    first, copy = store.acquire(1, 0), store.acquire(1, 0)
    assert (first.first, first.degraded) == (True, False)
    assert (copy.first, copy.degraded) == (False, False)
    assert 11_000 < claims_redis.pttl(claim_key("inst-a", 1, 0)) <= 12_000
    # Another key generation (an explicit re-run) is a different claim.
    assert store.acquire(1, 1).first


def test_a_key_of_another_installation_never_matches(claims_redis: redis.Redis) -> None:
    """Delivery 1 of a database dropped and recreated (or of another one sharing the Redis)
    is not delivery 1 of this one: its confirmed key, days long, must not stop ours."""
    old_life = ClaimStore(claims_redis, installation="inst-old", processing_ttl=12)
    assert old_life.confirm(old_life.acquire(1, 0), timedelta(days=6))
    store = ClaimStore(claims_redis, installation="inst-new", processing_ttl=12)
    assert store.acquire(1, 0).first
    assert [c.first for c in store.acquire_many([(1, 0), (2, 0)])] == [False, True]
    assert old_life.key(1, 0) != store.key(1, 0)
    assert store.key(1, 0) == "claim:inst-new:1:0"


def test_confirm_promotes_the_key_to_the_dedup_ttl_with_a_plain_set(
    claims_redis: redis.Redis,
) -> None:
    store = ClaimStore(claims_redis, installation="inst-a", processing_ttl=12)
    claim = store.acquire(2, 0)
    assert store.confirm(claim, timedelta(days=6))
    assert claims_redis.get(claim.key) == claim.token.encode()
    assert claims_redis.ttl(claim.key) > 5 * 86400
    assert not store.acquire(2, 0).first


def test_release_deletes_only_our_own_claim(claims_redis: redis.Redis) -> None:
    store = ClaimStore(claims_redis, installation="inst-a", processing_ttl=12)
    ours = store.acquire(3, 0)
    assert store.release(ours)
    assert store.acquire(3, 0).first  # released: the next copy is a first delivery
    # Our key expired and another worker holds it now: our release must leave theirs alone.
    stale = store.acquire(4, 0)
    claims_redis.set(stale.key, "someone-else")
    assert not store.release(stale)
    assert claims_redis.get(stale.key) == b"someone-else"


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_unreachable_redis_fails_open_and_is_counted_as_degraded() -> None:
    dead = make_client(f"redis://127.0.0.1:{free_port()}/0", 0.2)
    store = ClaimStore(dead, installation="inst-a", processing_ttl=12)
    before = _sample("webhooks_degraded_claims_total")
    before_label = _sample("webhooks_claims_total", result="degraded")
    claim = store.acquire(5, 0)
    assert (claim.first, claim.degraded) == (True, True)
    assert _sample("webhooks_degraded_claims_total") == before + 1
    assert _sample("webhooks_claims_total", result="degraded") == before_label + 1
    # Confirm and release do not wait on a Redis known to be down.
    assert not store.confirm(claim, timedelta(days=1))
    assert not store.release(claim)


# Pools (issue 12) ---------------------------------------------------------------------------


def test_the_default_pool_keeps_fifty_deliveries_in_flight_in_one_process() -> None:
    s = make_settings()
    assert (s.worker_pool, s.worker_slots) == ("threads", 50)
    conf = celery_config(s)
    assert conf["worker_concurrency"] == 50
    # The pool is the command line's only, and must be the setting's.
    assert "worker_pool" not in conf
    check_pool("threads", ["celery", "-A", "tasks", "worker", "-P", "threads"])
    check_pool("threads", ["celery", "worker", "--pool=threads"])
    with pytest.raises(PoolMismatchError, match="runs -P prefork but WEBHOOKS_WORKER_POOL=threads"):
        check_pool("threads", ["celery", "-A", "tasks", "worker"])
    # Kombu's Redis transport would refuse 50 concurrent acks with its default of 10.
    assert conf["broker_transport_options"]["max_connections"] >= 50
    # A task holds a connection only for its statements: the pool stays small.
    assert engine_pool_size(s) == s.db_pool_size == 10
    assert engine_pool_size(make_settings(worker_concurrency=4)) == 4


def test_prefork_and_gevent_settings() -> None:
    prefork = make_settings(worker_pool="prefork")
    assert prefork.worker_slots == (os.cpu_count() or 1)
    # One delivery per message by default (CPU-bound handlers), so one task's connections.
    assert prefork.deliveries_per_message == 1
    assert engine_pool_size(prefork) == 2
    # Batches asked for: their handlers run at once, each may hold a connection.
    batched = make_settings(worker_pool="prefork", delivery_batch=16)
    assert engine_pool_size(batched) == min(16, batched.db_pool_size) == 10
    assert make_settings().deliveries_per_message == 16  # threads (and gevent)
    assert make_settings(worker_pool="gevent").deliveries_per_message == 16
    check_pool("prefork", ["celery", "-A", "tasks", "worker", "-c", "2"])
    gevent = make_settings(worker_pool="gevent", worker_concurrency=300)
    assert celery_config(gevent)["worker_concurrency"] == 300
    # Under gevent each handler has its own soft and hard limits (tasks.pools.time_limits),
    # counted from its start: Celery's on the delivery task, counted from the task's start
    # (before the claim), are a backstop above them and under the lease, as on a batch.
    limits = celery_config(gevent)["task_annotations"][DELIVER_TASK]
    assert (limits["time_limit"], limits["soft_time_limit"]) == batch_time_limits(gevent)
    assert gevent.hard_time_limit < limits["time_limit"] < gevent.processing_ttl
    for other in (make_settings(), prefork):  # prefork: Celery's limits are the only ones
        assert celery_config(other)["task_annotations"] == {}
        assert celery_config(other)["task_time_limit"] == other.hard_time_limit
    with pytest.raises(PoolMismatchError, match="needs `celery worker -P gevent`"):
        check_pool("gevent", ["celery", "worker", "-Pgevent"])  # this process is not patched


def test_threads_get_the_soft_then_the_hard_limit_raised_in_the_handler() -> None:
    """The watchdog of tasks.pools on a real thread: a handler that swallows the soft limit
    (as ``hang`` does) is ended by HardTimeLimitExceeded, which ``except Exception`` misses."""
    seen: list[str] = []

    def handler() -> None:
        try:
            with time_limits(0.2, 0.5):
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        time.sleep(0.01)
                    except Exception as exc:  # noqa: BLE001 (the soft limit, swallowed)
                        seen.append(type(exc).__name__)
        except HardTimeLimitExceeded:
            seen.append("HardTimeLimitExceeded")

    started = time.monotonic()
    worker = threading.Thread(target=handler)
    worker.start()
    worker.join(5)
    assert seen == ["SoftTimeLimitExceeded", "HardTimeLimitExceeded"]
    assert 0.45 <= time.monotonic() - started < 1.0


def test_a_limit_that_did_not_fire_leaves_nothing_pending() -> None:
    done: list[bool] = []

    def quick() -> None:
        with time_limits(0.2, 0.5):
            pass
        time.sleep(0.7)  # past both deadlines: nothing may be raised here
        done.append(True)

    worker = threading.Thread(target=quick)
    worker.start()
    worker.join(5)
    assert done == [True]


def test_a_handler_that_returns_at_its_limits_instant_has_succeeded() -> None:
    """Issue 19: a limit signalled as the handler returns must not turn its success into a
    retry (a second downstream call), nor land later in the pipeline's own code.

    The handler here is a C function that blocks without the interpreter (``time.sleep``):
    the real watchdog signals the soft limit while it blocks, so the limit can only land at
    the first bytecode check after the handler has returned, every time. That is the instant
    a Python handler hits when it returns as the watchdog fires, which a test cannot aim at.
    Under ``with time_limits(...)`` the limit landed there and the success became a retry."""
    outcome: list[str] = []

    def pipeline() -> None:
        try:
            started = time.monotonic()
            run_limited(time.sleep, 0.4, soft=0.1, hard=5)
            outcome.append("returned" if time.monotonic() - started >= 0.4 else "early")
        except (SoftTimeLimitExceeded, HardTimeLimitExceeded) as exc:
            outcome.append(type(exc).__name__)
            return
        try:
            # The pipeline's own code after the handler (the success commit): nothing lands.
            busy = time.monotonic() + 0.3
            while time.monotonic() < busy:
                pass
            outcome.append("clean")
        except (SoftTimeLimitExceeded, HardTimeLimitExceeded) as exc:
            outcome.append(f"stray {type(exc).__name__}")

    thread = threading.Thread(target=pipeline)
    thread.start()
    thread.join(5)
    assert outcome == ["returned", "clean"]


def test_a_limit_that_lands_in_the_handler_still_fails_it() -> None:
    """The other side of the same line: a limit that lands while the handler's own Python
    code runs is its failure (a retry), raised from ``run_limited``."""
    outcome: list[str] = []

    def handler() -> None:
        end = time.monotonic() + 2
        while time.monotonic() < end:
            pass

    def pipeline() -> None:
        try:
            run_limited(handler, soft=0.1, hard=5)
            outcome.append("returned")
        except SoftTimeLimitExceeded:
            outcome.append("soft")
        busy = time.monotonic() + 0.2
        while time.monotonic() < busy:
            pass
        outcome.append("clean")

    thread = threading.Thread(target=pipeline)
    thread.start()
    thread.join(5)
    assert outcome == ["soft", "clean"]

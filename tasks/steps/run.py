"""Step 3 of a message: run each claimed delivery's ``handler(event, ctx)``, concurrently.

Each handler runs in its own thread (a greenlet under gevent; the calling thread for a
message of one bare id) with its own session, its own soft and hard time limits
(:func:`tasks.pools.run_limited`) and its own idempotency key. A handler that wrote through
``ctx.session`` commits its writes and its success together in its own transaction; the
others' successes are recorded together by :func:`tasks.steps.record.finish`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import redis
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.orm import Session

from core import shapes, tracing
from core.logs import get_logger
from core.settings import MAX_DELIVERY_BATCH
from models import transitions
from models.admission import Admission, Rate
from models.transitions import Claim, IllegalTransition
from tasks.context import Event, HandlerContext, idempotency_key, result_reference
from tasks.errors import DriftHeld, LeaseFenced, RetryableError
from tasks.policy import RetryPolicy
from tasks.pools import is_green, is_hard_timeout, run_limited
from tasks.runtime import Runtime
from tasks.steps.claim import Claimed, held_of
from tasks.steps.inputs import Loaded, load
from tasks.steps.outcome import PublishRetry, Report
from tasks.steps.record import Done, dropped, fail, fenced, held_for_drift, lost, succeeded
from tasks.transforms import TransformDropped, apply

log = get_logger(__name__)

T = TypeVar("T")


def handler_job(
    rt: Runtime, claimed: Claimed, publish_retry: PublishRetry
) -> Callable[[], Report | Done]:
    """The job that runs one claimed delivery's handler: its report, or :class:`Done` when
    the success is still to be recorded."""

    def job() -> Report | Done:
        # The handler's session takes a connection only if the handler uses it.
        with rt.sessions() as session:
            return attempt(rt, session, claimed, publish_retry)

    return job


def attempt(
    rt: Runtime, session: Session, claimed: Claimed, publish_retry: PublishRetry
) -> Report | Done:
    """Run the handler of a claimed delivery: its report, or :class:`Done` when the success
    is still to be recorded."""
    found, fast = claimed.found, claimed.fast
    loaded: Loaded | None = None
    try:
        loaded = load(rt, found, claimed.row)
        handler = _with_transform(rt, claimed.row.transform, rt.registry.get(loaded.route.handler))
        ctx = HandlerContext(
            idempotency_key=idempotency_key(
                found.source_id, loaded.event.event_id, found.route_id, found.generation
            ),
            delivery_id=found.id,
            attempt=found.attempt,
            generation=found.generation,
            meta=loaded.event.meta,
            route=loaded.route,
            session=session,
            clock=rt.clock,
            io_timeout=rt.settings.handler_io_timeout,
            lease_left=lambda: claimed.lease_left(rt.clock),
        )
        if shapes.quarantines(loaded.route.options):
            check_drift(rt, found, loaded.event.event_type, loaded.event.body)
        if claimed.row.rate_count and claimed.row.rate_period_s:
            pace(rt, found.route_id, Rate(claimed.row.rate_count, claimed.row.rate_period_s))
        # Frozen or starved since the claim (or paced), past what a call needs: no handler.
        ctx.fence()
        if tracing.STATE.on:
            returned = _traced_handler(rt, claimed, handler, loaded, ctx)
        else:
            returned = run_limited(
                handler,
                loaded.event,
                ctx,
                soft=rt.settings.soft_time_limit,
                hard=rt.settings.hard_time_limit,
                held=held_of(found),
            )
        ref = _result_ref(found.id, returned)
        session.flush()
        done_at = claimed.now(rt.clock)
        if not session.in_transaction():
            return Done(claimed, loaded, done_at, ref)
        # The handler used ctx.session: its writes and the success commit together.
        transitions.succeed(session, found, now=done_at, result_ref=ref)
        session.commit()
    except IllegalTransition:
        session.rollback()
        return lost(rt, found, fast, claimed.row)
    except TransformDropped as exc:  # no handler call: final, filtered
        assert loaded is not None
        _discard(session, exc)
        return dropped(rt, claimed, loaded, exc)
    except DriftHeld as exc:  # no call was made: held until the new shape is accepted
        _discard(session, exc)
        return held_for_drift(rt, session, claimed, exc)
    except LeaseFenced as exc:  # no call was made: not a failed attempt
        _discard(session, exc)
        return fenced(rt, session, claimed, exc, publish_retry)
    except Exception as exc:  # noqa: BLE001 (any handler error is a failed attempt)
        _discard(session, exc)
        policy = loaded.policy if loaded else RetryPolicy.for_route(rt.settings)
        return fail(
            rt,
            session,
            claimed,
            exc=exc,
            policy=policy,
            publish_retry=publish_retry,
            now=claimed.now(rt.clock),
        )
    except BaseException as exc:
        if not is_hard_timeout(exc):
            raise
        # The hard limit fired in this thread or greenlet (tasks.pools), e.g. in a handler
        # that caught the soft limit and went on waiting. The attempt fails now, retried
        # like any other failure, instead of holding its lease for the processing TTL.
        _discard(session, exc)
        log.warning("delivery.hard_time_limit", delivery_id=found.id, attempt=found.attempt)
        return fail(
            rt,
            session,
            claimed,
            exc=RetryableError(
                f"hard time limit ({rt.settings.hard_time_limit}s) exceeded",
                reason="hard_time_limit",
            ),
            policy=loaded.policy if loaded else RetryPolicy.for_route(rt.settings),
            publish_retry=publish_retry,
            now=claimed.now(rt.clock),
        )
    # Committed with the handler's writes: promote its fast claim now, as finish does for
    # the others.
    if loaded.dedup_ttl is not None:
        rt.claims.confirm(fast, loaded.dedup_ttl)
    return succeeded(rt, Done(claimed, loaded, done_at))


def _with_transform(
    rt: Runtime, name: str | None, handler: Callable[[Event, HandlerContext], object]
) -> Callable[[Event, HandlerContext], object]:
    """The handler, or, for a route with a transform, the handler behind it: the transform
    runs first (under its own time limit, inside the handler's limits: tasks.transforms) and
    the handler gets the event it made. An unknown transform is a permanent error here."""
    if name is None:
        return handler
    transform = rt.transforms.get(name)
    limit = min(rt.settings.transform_time_limit, rt.settings.soft_time_limit)

    def transformed(event: Event, ctx: HandlerContext) -> object:
        return handler(apply(transform, name, event, limit), ctx)

    return transformed


def check_drift(rt: Runtime, found: Claim, event_type: str, body: bytes) -> None:
    """A quarantined route's event (``--quarantine-drift``, docs/drift.md): raises
    :class:`DriftHeld` when its shape is not the accepted one of its source and event type,
    unless an operator replayed this held delivery by its id (one more indexed read, only for
    a drifted event). Only such routes pay for it (one fingerprint, two indexed reads); a body
    that is not JSON has no shape to drift."""
    from models import drift  # noqa: PLC0415 (only a quarantined route's delivery)

    try:
        sighting = shapes.fingerprint_body(body)
    except shapes.NotJson:
        return
    with rt.engine.connect() as conn:
        raw: Any = conn.connection.driver_connection
        accepted = drift.accepted_shape(raw, found.source_id, event_type)
        why = shapes.drift_of(accepted.paths, accepted.unaccepted, sighting, accepted.always)
        exempt = why is not None and drift.replayed_past_hold(
            raw, found.id, found.expires_at, found.attempt
        )
        conn.rollback()
    if exempt:
        log.info("delivery.drift_replayed", delivery_id=found.id, attempt=found.attempt, why=why)
    elif why is not None:
        raise DriftHeld(why)


def pace(rt: Runtime, route_id: int, rate: Rate) -> None:
    """Wait for the route's next call slot (:meth:`models.admission.Admission.pace`), then
    pass its gate (:meth:`~models.admission.Admission.gate`: a late wake-up does not bunch
    with the next caller's), so that the downstream sees the route's calls at most at its
    rate, however the broker and the workers bunched them after admission. At most the soft
    time limit in all (past it the lease is the fence's to judge). Redis unreachable: the call
    goes ahead, as admission fails open."""
    gate = Admission(rt.redis)
    left = float(rt.settings.soft_time_limit)
    try:
        wait = gate.pace(route_id, rate)
        while True:
            if wait > 0:
                if left <= 0:
                    return
                time.sleep(min(wait, left))
                left -= wait
            wait = gate.gate(route_id, rate)
            if wait == 0:
                return
    except redis.RedisError as exc:
        log.warning("delivery.pace_unavailable", route_id=route_id, error_class=type(exc).__name__)


def _traced_handler(
    rt: Runtime,
    claimed: Claimed,
    handler: Callable[..., object],
    loaded: Loaded,
    ctx: HandlerContext,
) -> object:
    """The handler's run as a span of its event's trace (core/tracing.py), the child of the
    claim's span; the handler gets the span's traceparent to hand on (``forward`` sends it)."""
    attributes = {
        "webhooks.delivery_id": claimed.found.id,
        "webhooks.attempt": claimed.found.attempt,
        "webhooks.handler": loaded.route.handler,
        "webhooks.event_id": loaded.event.event_id,
    }
    with tracing.span("webhooks.handler", parent=claimed.trace, attributes=attributes) as own:
        return run_limited(
            handler,
            loaded.event,
            dataclasses.replace(ctx, traceparent=own),
            soft=rt.settings.soft_time_limit,
            hard=rt.settings.hard_time_limit,
            held=held_of(claimed.found),
        )


def _result_ref(delivery_id: int, returned: object) -> str | None:
    """The result reference to store of what a handler returned; one line when it returned
    something that is not one (never its value: it may quote the payload)."""
    ref, refused = result_reference(returned)
    if refused is not None:
        log.warning("delivery.result_ref_refused", delivery_id=delivery_id, reason=refused)
    return ref


def _discard(session: Session, exc: BaseException) -> None:
    """End the handler's transaction after it failed. A time limit lands between two
    bytecodes, possibly inside psycopg or the pool while the handler used ``ctx.session``: that
    connection's protocol state is unknown, so it is invalidated (closed, never pooled again)
    instead of rolled back through; the session then takes a fresh one for the failure's
    record. Any other failure rolls back as usual."""
    if isinstance(exc, SoftTimeLimitExceeded) or is_hard_timeout(exc):
        session.invalidate()
    else:
        session.rollback()


# Runs a message's handlers; sized so that no handler ever waits for a thread (every slot's
# message fully concurrent, whatever batch size its publisher chose), threads made only as
# needed and then reused.
_EXECUTOR: tuple[int, ThreadPoolExecutor] | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor(rt: Runtime) -> ThreadPoolExecutor:
    global _EXECUTOR  # noqa: PLW0603
    pid = os.getpid()
    if _EXECUTOR is None or _EXECUTOR[0] != pid:  # none yet, or the parent's (after a fork)
        with _EXECUTOR_LOCK:
            if _EXECUTOR is None or _EXECUTOR[0] != pid:
                slots = 1 if rt.settings.worker_pool == "prefork" else rt.settings.worker_slots
                size = slots * MAX_DELIVERY_BATCH
                _EXECUTOR = (pid, ThreadPoolExecutor(size, thread_name_prefix="handler"))
    return _EXECUTOR[1]


def in_waves(
    rt: Runtime, jobs: list[Callable[[], T]], coalesce: float, *, inline: bool = False
) -> Iterator[list[tuple[int, T | BaseException]]]:
    """Run ``jobs`` at once; yield what finished, as (index, result or what it raised), as soon
    as one finishes, with those that finish within ``coalesce`` seconds after it (each job
    once): a handler's success is recorded right after its downstream answered, never held
    for its batch-mates, while a burst of returns still shares one statement. Threads under
    threads and prefork, greenlets under gevent. A lone job runs in the calling thread (or
    greenlet) when ``inline`` (the message's own Celery limits are its handler's: a bare id),
    or in a thread-pool thread that is not a prefork child's main thread (there, without
    ``inline``, the per-handler limits need a thread of their own, see :mod:`tasks.pools`)."""

    def guarded(job: Callable[[], T]) -> T | BaseException:
        try:
            return job()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            return exc

    if not jobs:
        return
    green = is_green()
    if len(jobs) == 1 and (
        inline or (not green and threading.current_thread() is not threading.main_thread())
    ):
        yield [(0, guarded(jobs[0]))]
        return
    if green:
        import gevent  # noqa: PLC0415 (only under the gevent pool)

        greenlets = {gevent.spawn(guarded, job): i for i, job in enumerate(jobs)}
        while greenlets:
            gevent.wait(list(greenlets), count=1)
            pending = [g for g in greenlets if not g.ready()]
            if pending:
                gevent.joinall(pending, timeout=coalesce)
            yield [(greenlets.pop(g), g.value) for g in list(greenlets) if g.ready()]
        return
    pool = _executor(rt)
    futures = {pool.submit(guarded, job): i for i, job in enumerate(jobs)}
    while futures:
        finished, rest = wait(futures, return_when=FIRST_COMPLETED)
        if rest:
            finished |= wait(rest, timeout=coalesce).done
        yield [(futures.pop(f), f.result()) for f in finished]

"""The ``webhooks.deliver`` task: run one delivery's handler so its effect happens once.

Flow (the message carries the delivery id only):

 0. read the delivery's key generation (it names the fast claim);
 1. fast claim in Redis: ``SET claim:<id>:<generation> <token> NX`` with the processing TTL;
    a held key means another copy is running or has succeeded: return;
 2. durable claim in Postgres (:func:`models.transitions.claim`), committed: one guarded
    UPDATE pending | retrying (due) | processing (lease expired) -> processing, attempts + 1,
    lease = processing TTL; no row means done, dead, not due or owned: release and return.
    A claim that finds a dead worker's lease counts a redelivery; at ``max_redeliveries`` it
    returns the verdict "dead" (crash loop) instead of running the handler again;
 3. load receipt, route and source; run ``handler(event, ctx)``;
 4. success: :func:`transitions.succeed` in the *same transaction* as the handler's writes
    through ``ctx.session``; commit; then promote the Redis key to the source's dedup TTL;
 5. caught failure: roll the handler's writes back; commit ``retry_later`` (next_attempt_at =
    now + full-jitter backoff) or ``kill`` (permanent, attempts or age exhausted); release
    the Redis key; only then publish the countdown retry (short delays), so the message can
    never arrive before the state that allows it to be claimed. Longer delays are left to
    the sweeper.

Why each effect happens exactly once
------------------------------------
*Effects in our database* (``ctx.session``). The effect and the move to ``succeeded`` commit in
one transaction, and that move is guarded by ``status = 'processing' AND attempts = <ours>
AND generation = <ours>``. The attempt number is a fencing token: whichever attempt commits
first wins, and any other attempt that ran the handler (a duplicate message racing us with
Redis down or flushed, a worker whose lease ran out) fails the guard and rolls its writes
back. A crash before the commit rolls back everything: the effect did not happen, the lease
expires, and the delivery is claimed again. After the commit, every later copy finds
``succeeded`` and the guarded claim matches no row. So the effect commits exactly once.

*Effects elsewhere* (``forward`` and any HTTP handler). No local transaction can span another
service: a crash after the downstream applied the effect but before our commit means the
next attempt calls it again. Every attempt of one event carries the same idempotency key
(scope, event id, route, generation), so a downstream that honours it applies the effect
once. That is the honest guarantee: at-least-once calls, exactly-once effect at an
idempotent downstream.

*Why nothing is lost.* The receipt and its delivery rows commit before the provider gets its
2xx. Everything after that may drop a *message* (a publish that fails, a broker flush, a
message acked by a worker that then died, a copy dropped because a stale fast-claim key was
still held) but never the row: the row stays pending / retrying / processing, and the sweeper
republishes pending rows after the publish grace, retries once they are due, and processing
rows whose lease ran out. A key left by a dead worker expires after the processing TTL.

*Why Redis cannot cause a second effect.* The fast tier only ever *skips* work; Postgres
decides. Unreachable Redis fails open (counted as degraded) and the guarded claim alone
serialises workers; a flushed Redis admits the copy to the durable claim, which refuses it.

*Durability.* The claim commits asynchronously (no fsync wait): if Postgres crashes before
flushing it, the claim is undone, the claiming worker's connection died with the server so
it can commit nothing more, and the delivery is claimed again, as after a worker crash. The
success commit is synchronous (it also flushes the claim), and only after it returns is the
Redis key promoted: a promoted key always stands for a durable success.

*Budgets.* The lease is the processing TTL (4 x hard time limit): a live task is killed by the
hard limit long before its lease can run out, even with some clock skew between hosts, and
the fencing token protects the commit if it ever does. The soft limit raises inside the
handler and is handled as a retryable failure; the hard limit kills the process (a crash).

Logs carry ids, outcomes and error classes, never payloads or secrets.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import psycopg
from celery import Task, shared_task
from psycopg.rows import namedtuple_row
from sqlalchemy.orm import Session

from models import transitions
from models.transitions import Claim, IllegalTransition
from tasks import get_runtime
from tasks.claims import FastClaim
from tasks.config import DELIVER_TASK
from tasks.context import Event, EventMeta, HandlerContext, RouteInfo, idempotency_key
from tasks.errors import HandlerError, PermanentError, RetryableError
from tasks.policy import DEAD_CRASHED, RetryPolicy, decide
from tasks.runtime import Runtime
from webhooks.crypto import SecretDecryptError
from webhooks.logs import get_logger
from webhooks.metrics import DEAD_LETTERS, DELIVERIES, RECEIPT_TO_SUCCESS, RETRIES
from webhooks.ttl import TtlConfigError, TtlOverrides, derive_ttl

log = get_logger(__name__)

# Publishes the delivery again after ``countdown`` seconds.
PublishRetry = Callable[[int, float], None]

# Reads the key generation and makes this (claim) transaction's commit asynchronous.
# Also its partition key, so the claim touches one partition.
_GENERATION = (
    "SELECT generation, expires_at, set_config('synchronous_commit', 'off', true) "
    "FROM deliveries WHERE id = %(id)s"
)

_LOAD = """
    SELECT rt.handler, rt.options, rt.signing_ciphertext, rt.max_attempts, rt.max_age_s,
           rt.active, s.public_id, s.name, s.provider, s.retry_window_s, s.queue_lag_s,
           s.clock_skew_s, s.replay_grace_s,
           r.id AS receipt_id, r.event_id, r.event_type, r.occurred_at, r.received_at,
           r.content_type, r.payload
    FROM routes rt
    JOIN sources s ON s.id = rt.source_id
    LEFT JOIN receipts r ON r.id = %(receipt_id)s AND r.expires_at = %(expires_at)s
    WHERE rt.id = %(route_id)s
    """


def _raw(session: Session) -> psycopg.Connection[Any]:
    """The session's own psycopg connection (same transaction): the hot-path reads skip
    SQLAlchemy's result machinery, which cost more CPU than the statements (see
    models.transitions)."""
    raw = session.connection().connection.driver_connection
    assert raw is not None
    return cast("psycopg.Connection[Any]", raw)


@dataclass(frozen=True)
class Loaded:
    event: Event
    route: RouteInfo
    policy: RetryPolicy
    dedup_ttl: timedelta | None


def describe_error(exc: BaseException) -> str:
    """An error message fit for storage and logs: our typed errors carry payload-free
    messages by contract; for anything else only the class and where it was raised (its
    message may quote the payload)."""
    if isinstance(exc, HandlerError):
        return f"{exc.reason}: {exc}"[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    where = "/".join(Path(last.filename).parts[-2:])
    return f"{type(exc).__name__} raised at {where}:{last.lineno} in {last.name}"


def _dedup_ttl(rt: Runtime, row: Any) -> timedelta | None:
    overrides = TtlOverrides.from_seconds(
        row.retry_window_s, row.queue_lag_s, row.clock_skew_s, row.replay_grace_s
    )
    try:
        return derive_ttl(row.provider, overrides, rt.settings, source_name=row.name).total
    except (TtlConfigError, KeyError):
        # Misconfigured source: keep only the processing TTL; Postgres still dedups.
        log.warning("delivery.dedup_ttl_invalid", source=row.public_id)
        return None


def load(session: Session, rt: Runtime, found: Claim) -> Loaded:
    """Receipt, route and source of a claimed delivery; what is missing is permanent."""
    row: Any = (
        _raw(session)
        .cursor(row_factory=namedtuple_row)
        .execute(
            _LOAD,
            {
                "route_id": found.route_id,
                "receipt_id": found.receipt_id,
                "expires_at": found.expires_at,
            },
        )
        .fetchone()
    )
    if row is None:
        raise PermanentError("the route of this delivery no longer exists", reason="route_gone")
    if row.event_id is None:
        raise PermanentError("the receipt of this delivery no longer exists", reason="receipt_gone")
    if row.payload is None:
        raise PermanentError("the event's payload was dropped (retention)", reason="payload_gone")
    if not row.active:
        raise PermanentError("the route is disabled", reason="route_inactive")
    secret: str | None = None
    if row.signing_ciphertext is not None:
        try:
            secret = rt.box.decrypt(bytes(row.signing_ciphertext))
        except SecretDecryptError:
            raise PermanentError(
                "the route's signing secret cannot be decrypted", reason="secret_undecryptable"
            ) from None
    meta = EventMeta(
        receipt_id=row.receipt_id,
        source_id=found.source_id,
        source=row.public_id,
        provider=row.provider,
        event_id=row.event_id,
        event_type=row.event_type,
        occurred_at=row.occurred_at,
        received_at=row.received_at,
        content_type=row.content_type,
    )
    return Loaded(
        event=Event(meta, bytes(row.payload)),
        route=RouteInfo(found.route_id, row.handler, dict(row.options or {}), secret),
        policy=RetryPolicy.for_route(
            rt.settings, max_attempts=row.max_attempts, max_age_s=row.max_age_s
        ),
        dedup_ttl=_dedup_ttl(rt, row),
    )


def deliver_one(rt: Runtime, delivery_id: int, *, publish_retry: PublishRetry) -> str:
    """Run one delivery. Returns the outcome: succeeded, retry, dead, duplicate (fast tier),
    skipped (durable tier: done, dead, not due or owned), missing, or lost (our lease was
    taken over)."""
    # One pooled connection for the task's short transactions: one checkout, one ping.
    with rt.engine.connect() as conn, rt.sessions(bind=conn) as session:
        return _deliver(rt, session, delivery_id, publish_retry)


def _deliver(rt: Runtime, session: Session, delivery_id: int, publish_retry: PublishRetry) -> str:
    fast: FastClaim | None = None
    try:
        with session.begin():
            # The claim's commit is asynchronous: losing it in a Postgres crash only undoes
            # the claim (the delivery runs again, as after a worker crash), and the success
            # commit, which is synchronous, flushes it first. One fsync per delivery saved.
            first = _raw(session).execute(_GENERATION, {"id": delivery_id}).fetchone()
            if first is None:
                return _quiet(delivery_id, "missing")
            generation, expires_at = first[0], first[1]
            fast = rt.claims.acquire(delivery_id, generation)
            if not fast.first:
                return _quiet(delivery_id, "duplicate")
            found = transitions.claim(
                session,
                delivery_id,
                now=rt.clock.now(),
                lease=timedelta(seconds=rt.settings.processing_ttl),
                max_redeliveries=rt.settings.max_redeliveries,
                worker=rt.worker,
                expires_at=expires_at,
            )
    except BaseException:
        if fast is not None and fast.first:
            rt.claims.release(fast)
        raise
    if found is None:
        rt.claims.release(fast)
        return _quiet(delivery_id, "skipped")
    if found.crashed_too_often:
        rt.claims.release(fast)
        DEAD_LETTERS.labels(reason=DEAD_CRASHED).inc()
        DELIVERIES.labels(outcome="dead").inc()
        log.warning(
            "delivery.dead",
            delivery_id=delivery_id,
            reason=DEAD_CRASHED,
            redeliveries=found.redeliveries,
        )
        return "dead"
    return _run(rt, session, found, fast, publish_retry)


def _quiet(delivery_id: int, outcome: str) -> str:
    DELIVERIES.labels(outcome=outcome).inc()
    log.info("delivery.not_claimed", delivery_id=delivery_id, outcome=outcome)
    return outcome


def _run(
    rt: Runtime, session: Session, found: Claim, fast: FastClaim, publish_retry: PublishRetry
) -> str:
    loaded: Loaded | None = None
    transaction = session.begin()
    try:
        loaded = load(session, rt, found)
        handler = rt.registry.get(loaded.route.handler)
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
        )
        handler(loaded.event, ctx)
        done_at = rt.clock.now()
        transitions.succeed(session, found, now=done_at)
        transaction.commit()
    except IllegalTransition:
        transaction.rollback()
        return _lost(rt, found, fast)
    except Exception as exc:  # noqa: BLE001 (any handler error is a failed attempt)
        transaction.rollback()
        policy = loaded.policy if loaded else RetryPolicy.for_route(rt.settings)
        return _fail(
            rt, session, found, fast=fast, exc=exc, policy=policy, publish_retry=publish_retry
        )
    assert loaded is not None
    if loaded.dedup_ttl is not None:
        rt.claims.confirm(fast, loaded.dedup_ttl)
    DELIVERIES.labels(outcome="succeeded").inc()
    RECEIPT_TO_SUCCESS.observe(max(0.0, (done_at - loaded.event.meta.received_at).total_seconds()))
    log.info(
        "delivery.succeeded",
        delivery_id=found.id,
        event_id=loaded.event.event_id,
        handler=loaded.route.handler,
        attempt=found.attempt,
        degraded=fast.degraded,
    )
    return "succeeded"


def _lost(rt: Runtime, found: Claim, fast: FastClaim) -> str:
    """Our lease ran out and another attempt took over: our writes were rolled back."""
    rt.claims.release(fast)
    DELIVERIES.labels(outcome="lost").inc()
    log.warning("delivery.lease_lost", delivery_id=found.id, attempt=found.attempt)
    return "lost"


def _fail(
    rt: Runtime,
    session: Session,
    found: Claim,
    *,
    fast: FastClaim,
    exc: Exception,
    policy: RetryPolicy,
    publish_retry: PublishRetry,
) -> str:
    now: datetime = rt.clock.now()
    decision = decide(
        policy,
        attempt=found.attempt,
        started_at=found.first_attempt_at or found.created_at,
        now=now,
        permanent=isinstance(exc, PermanentError),
        requested_delay=exc.delay if isinstance(exc, RetryableError) else None,
        rng=rt.rng,
    )
    error_class, error = type(exc).__name__, describe_error(exc)
    try:
        with session.begin():
            if decision.retry:
                assert decision.next_attempt_at is not None
                transitions.retry_later(
                    session,
                    found,
                    now=now,
                    next_attempt_at=decision.next_attempt_at,
                    error_class=error_class,
                    error=error,
                )
            else:
                transitions.kill(
                    session,
                    found,
                    now=now,
                    reason=decision.reason,
                    error_class=error_class,
                    error=error,
                )
    except IllegalTransition:
        return _lost(rt, found, fast)
    # The state is committed: now the next copy may come.
    rt.claims.release(fast)
    fields = {
        "delivery_id": found.id,
        "attempt": found.attempt,
        "error_class": error_class,
        "error_reason": getattr(exc, "reason", None),
    }
    if not decision.retry:
        DEAD_LETTERS.labels(reason=decision.reason).inc()
        DELIVERIES.labels(outcome="dead").inc()
        log.warning("delivery.dead", reason=decision.reason, **fields)
        return "dead"
    RETRIES.inc()
    DELIVERIES.labels(outcome="retry").inc()
    via = "sweeper"
    if decision.countdown is not None:
        try:
            publish_retry(found.id, decision.countdown)
            via = "countdown"
        except Exception as publish_exc:  # noqa: BLE001 (the sweeper publishes it later)
            log.warning(
                "delivery.retry_publish_failed",
                delivery_id=found.id,
                error_class=type(publish_exc).__name__,
            )
    log.info("delivery.retry", delay_s=decision.delay.total_seconds(), via=via, **fields)
    return "retry"


@shared_task(bind=True, name=DELIVER_TASK, ignore_result=True)
def deliver(self: Task[Any, Any], delivery_id: int) -> str:
    """Celery entry point; the work is :func:`deliver_one`."""
    if isinstance(delivery_id, bool) or not isinstance(delivery_id, int):
        log.error("delivery.bad_message", error_class=type(delivery_id).__name__)
        return "rejected"

    def publish_retry(target: int, countdown: float) -> None:
        self.apply_async(args=(target,), countdown=countdown)

    return deliver_one(get_runtime(), delivery_id, publish_retry=publish_retry)

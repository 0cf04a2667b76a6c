"""The ``webhooks.deliver`` task: run one delivery's handler so its effect happens once.

Flow (the message carries the delivery id only; a message of several ids runs the same
steps with one statement for all of them, :mod:`tasks.batch`):

 0. read the delivery's key generation (it names the fast claim) and partition key;
 1. fast claim in Redis: ``SET claim:<id>:<generation> <token> NX`` with the processing TTL;
    a held key means another copy is running or has succeeded: return;
 2. durable claim in Postgres (:func:`models.transitions.claim_with_event`), committed: one
    guarded UPDATE pending | retrying (due) | processing (lease expired) -> processing,
    attempts + 1, lease = processing TTL, for this generation; no row means done, dead, not
    due, owned or replayed since: release and return. A claim that finds a dead worker's
    lease counts a redelivery; at ``max_redeliveries`` it returns the verdict "dead" (crash
    loop) instead of running the handler again. The same statement returns the receipt,
    route and source;
 3. run ``handler(event, ctx)``;
 4. success: :func:`transitions.succeed` in the *same transaction* as the handler's writes
    through ``ctx.session``; commit; then promote the Redis key to the source's dedup TTL;
 5. caught failure: roll the handler's writes back; commit ``retry_later`` (next_attempt_at =
    now + full-jitter backoff) or ``kill`` (permanent, attempts or age exhausted); release
    the Redis key; only then schedule the retry with admission (models/admission.py: the
    dispatcher admits it once due, within its route's limits), so the message can never
    arrive before the state that allows it to be claimed. With admission off (or Redis
    failing), a countdown message for short delays; longer ones are left to the sweeper.

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

*Round trips.* Steps 0, 2 and (for a handler that wrote nothing through ``ctx.session``) 4 are
each one autocommit statement: no BEGIN, no separate COMMIT, no ping on checkout (a pooled
connection found dead by step 0, which changes nothing, is replaced and the task starts
again). The connection goes back to the pool while the handler runs (under the threads and
gevent pools a hundred handlers wait on downstreams at once; step 4 takes one again).
Steps 2 and 4 name the delivery's leaf partitions directly (a generic plan on the
partitioned parents locks every partition), falling back to the parents when that leaf does
not exist. Three statements and two Redis commands per delivery.

*Budgets and clocks.* The lease is the processing TTL (4 x hard time limit): a live task is
killed by the hard limit long before its lease can run out. Leases and due times are judged
on the database's clock (``now()`` in the guarded statements, :mod:`webhooks.clock`), never
this host's: a worker whose clock runs minutes ahead cannot see a live lease as expired, and
the fencing token protects the commit if a lease ever does run out. The soft limit raises
inside the handler and is handled as a retryable failure; the hard limit kills the process
(a crash) under prefork, and fails the attempt under threads and gevent (:mod:`tasks.pools`
says how each pool enforces both).

Logs carry ids, outcomes and error classes, never payloads or secrets.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from celery import Task, shared_task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from models import transitions
from models.admission import Admission
from models.breaker import held
from models.partitions import leaf_suffix
from models.transitions import Claim, ClaimedEvent, Held, IllegalTransition
from tasks import breaker, dispatcher, get_runtime
from tasks.claims import FastClaim
from tasks.config import DELIVER_TASK, Dispatch
from tasks.context import Event, EventMeta, HandlerContext, RouteInfo, idempotency_key
from tasks.durable import Unrecorded, discard_pooled, on_connection, record
from tasks.durable import autocommit as _autocommit
from tasks.errors import DownstreamError, HandlerError, PermanentError, RetryableError
from tasks.policy import DEAD_CRASHED, RetryPolicy, decide
from tasks.pools import in_flight, is_hard_timeout, run_limited
from tasks.runtime import Runtime
from webhooks.clock import pinned
from webhooks.crypto import SecretDecryptError
from webhooks.logs import get_logger
from webhooks.metrics import ADMISSIONS, DEAD_LETTERS, DELIVERIES, RECEIPT_TO_SUCCESS, RETRIES
from webhooks.settings import MAX_DELIVERY_BATCH
from webhooks.ttl import TtlConfigError, TtlOverrides, effective_ttl

log = get_logger(__name__)

# Publishes the delivery again after ``countdown`` seconds.
PublishRetry = Callable[[Dispatch, float], None]

# The key generation (it names the fast claim), the partition key (the claim then touches
# one partition), and whether Postgres shows the row claimable now and past its publish grace
# or lease, or pending after two of the sweeper's re-publishes, which move its next_attempt_at
# ahead each time (a fast-claim key held for such a row is stale: see _claim). On the
# database's clock, like the claim.
_PROBE = """
    SELECT d.generation, d.expires_at,
           d.status IN ('pending', 'retrying', 'processing')
           AND (CASE d.status WHEN 'processing' THEN d.lease_until
                              ELSE d.next_attempt_at END <= t.now
                OR d.status = 'pending' AND d.republished >= 2)
    FROM deliveries d, (SELECT coalesce(%(now)s::timestamptz, now()) AS now) t
    WHERE d.id = %(id)s
"""


class _StaleConnection(Exception):
    """The pooled connection died while idle (a Postgres restart): take a fresh one."""


@dataclass(frozen=True)
class Report:
    """What one run of the task did, for the task's Celery state (what Flower shows) and
    the tests: the outcome (succeeded, retry, dead, duplicate, skipped, missing, lost,
    unrecorded: the database stayed away longer than WEBHOOKS_RECORD_RETRY_SECONDS), and
    for a claimed delivery its attempt, event, source and the reason of a retry or death
    (payload-free, as stored)."""

    outcome: str
    delivery_id: int
    attempt: int | None = None
    event_id: str | None = None
    source: str | None = None
    detail: str | None = None
    countdown: float | None = None  # retry: the next copy's countdown; None: the sweeper's
    # The route of a finished attempt (succeeded, retry, dead): its admission slot is freed
    # as soon as the task ends (:func:`release_slots`), not at the dispatcher's next reconcile.
    route_id: int | None = None


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
        # Raised to the safe floor when the terms no longer cover the retry window, as the
        # receiver does (reported at the start of every process).
        return effective_ttl(row.provider, overrides, rt.settings, source_name=row.name).total
    except (TtlConfigError, KeyError):
        # Misconfigured source: keep only the processing TTL; Postgres still dedups.
        log.warning("delivery.dedup_ttl_invalid", source=row.public_id)
        return None


def load(rt: Runtime, found: Claim, row: ClaimedEvent) -> Loaded:
    """The handler's inputs from the claim's row; what is missing is permanent."""
    if not row.route_found:
        raise PermanentError("the route of this delivery no longer exists", reason="route_gone")
    if not row.receipt_found:
        raise PermanentError("the receipt of this delivery no longer exists", reason="receipt_gone")
    if row.payload is None:
        raise PermanentError("the event's payload was dropped (retention)", reason="payload_gone")
    if not row.active:
        raise PermanentError("the route is disabled", reason="route_inactive")
    # NOT NULL columns of rows that were found:
    assert row.handler is not None
    assert row.public_id is not None
    assert row.provider is not None
    assert row.event_id is not None
    assert row.event_type is not None
    assert row.received_at is not None
    secret: str | None = None
    if row.signing_ciphertext is not None:
        try:
            secret = rt.box.decrypt(bytes(row.signing_ciphertext))
        except SecretDecryptError:
            raise PermanentError(
                "the route's signing secret cannot be decrypted", reason="secret_undecryptable"
            ) from None
    meta = EventMeta(
        receipt_id=found.receipt_id,
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
    skipped (durable tier: done, dead, not due or owned), held (its route is paused or its
    breaker open: no attempt), missing, or lost (our lease was
    taken over)."""
    return run_delivery(rt, delivery_id, publish_retry=publish_retry).outcome


@dataclass(frozen=True)
class _Claimed:
    """A delivery this task now owns (durable claim committed), ready for its handler."""

    found: Claim
    row: ClaimedEvent
    fast: FastClaim
    leaf: str | None
    started: float


def run_delivery(rt: Runtime, delivery_id: int, *, publish_retry: PublishRetry) -> Report:
    """:func:`deliver_one` with the whole :class:`Report`."""
    # One pooled connection for the read and the claim, given back before the handler runs:
    # under gevent a hundred handlers wait on their downstreams at once, and holding a
    # connection each through that wait would need a hundred. No ping per checkout (a round
    # trip per task): a connection that died while pooled fails the first read, which
    # changes nothing, and the task starts again once on a fresh connection.
    for fresh in (False, True):
        try:
            with rt.engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert raw is not None
                claimed = _claim(rt, conn, raw, delivery_id, fresh)
        except _StaleConnection:
            discard_pooled(rt.engine)  # a restart killed them all: replace every one
            log.warning("delivery.stale_connection", delivery_id=delivery_id)
            continue
        if isinstance(claimed, Report):
            return claimed
        # The handler's session takes a connection only if the handler uses it.
        with in_flight([_held(claimed.found)]), rt.sessions() as session:
            return _run(rt, session, claimed, publish_retry)
    raise AssertionError("unreachable: a fresh connection raises instead")  # pragma: no cover


def _claim(
    rt: Runtime,
    conn: Connection,
    raw: psycopg.Connection[Any],
    delivery_id: int,
    fresh: bool,
) -> Report | _Claimed:
    try:
        with _autocommit(raw):
            first = raw.execute(_PROBE, {"id": delivery_id, "now": pinned(rt.clock)}).fetchone()
    except (psycopg.OperationalError, psycopg.ProgrammingError):
        if fresh or not raw.closed:
            raise
        conn.invalidate()
        raise _StaleConnection from None
    if first is None:
        return _quiet(delivery_id, "missing")
    generation, expires_at, overdue = first
    fast = rt.claims.acquire(delivery_id, generation)
    if not fast.first:
        if not overdue:
            return _quiet(delivery_id, "duplicate")
        # The key is held, yet Postgres shows the row claimable and past its publish grace
        # (or lease): a key left by a success whose commit was lost (failover, restore) or by
        # a worker that died. Never let it hide the row: the durable claim decides.
        rt.claims.note_stale(fast, delivery_id)
    leaf = _leaf_for(rt, expires_at)
    started = time.monotonic()
    try:
        with _autocommit(raw):
            claimed = _on_leaf(
                leaf,
                lambda on: transitions.claim_with_event(
                    raw,
                    delivery_id,
                    generation=generation,
                    expires_at=expires_at,
                    now=pinned(rt.clock),
                    lease=timedelta(seconds=rt.settings.processing_ttl),
                    max_redeliveries=rt.settings.max_redeliveries,
                    worker=rt.worker,
                    leaf=on,
                ),
            )
    except BaseException:
        rt.claims.release(fast)
        raise
    if claimed is None:
        rt.claims.release(fast)
        return _quiet(delivery_id, _not_claimed(raw, [delivery_id])[delivery_id])
    found, row = claimed
    if found.crashed_too_often:
        return _crash_looped(rt, found, row, fast)
    return _Claimed(found, row, fast, leaf, started)


def _held(found: Claim) -> Held:
    """What a watchdog names if it kills this process while ``found`` is in flight."""
    return Held(found.id, found.expires_at, found.attempt)


def _not_claimed(raw: psycopg.Connection[Any], ids: list[int]) -> dict[int, str]:
    """Why the claim took none of these: "held" (its route is paused or its breaker open:
    not an attempt, :mod:`models.breaker`) or "skipped" (done, dead, not due or owned). One
    more statement, on this path only."""
    with _autocommit(raw):
        holding = held(raw, ids)
    return {i: "held" if i in holding else "skipped" for i in ids}


def _crash_looped(rt: Runtime, found: Claim, row: ClaimedEvent, fast: FastClaim) -> Report:
    """The claim found one crash too many and made the delivery dead instead (crash loop)."""
    rt.claims.release(fast)
    DEAD_LETTERS.labels(reason=DEAD_CRASHED).inc()
    DELIVERIES.labels(outcome="dead").inc()
    log.warning(
        "delivery.dead",
        delivery_id=found.id,
        reason=DEAD_CRASHED,
        redeliveries=found.redeliveries,
    )
    return Report(
        "dead",
        found.id,
        found.attempt,
        row.event_id,
        row.public_id,
        f"{DEAD_CRASHED}: its worker died {found.redeliveries} times holding the lease",
    )


def _now(rt: Runtime, found: Claim, started: float) -> datetime:
    """Now on the database's clock: the claim's instant (read by the claim statement) plus
    the time elapsed since on this host's monotonic clock, which no wall-clock skew or step
    can move; or the pinned instant of a test."""
    return pinned(rt.clock) or found.at + timedelta(seconds=time.monotonic() - started)


# Leaf partitions found missing in this process (an unusual layout): use the parents.
_MISSING_LEAVES: set[str] = set()

T = TypeVar("T")


def _leaf_for(rt: Runtime, expires_at: datetime) -> str | None:
    leaf = leaf_suffix(expires_at, rt.settings.retention_mode)
    return None if leaf in _MISSING_LEAVES else leaf


def _on_leaf(leaf: str | None, statement: Callable[[str | None], T]) -> T:
    """Run an autocommit statement on the delivery's leaf partitions, or on the parents when
    that leaf does not exist (nothing ran: the failed statement was its own transaction)."""
    if leaf is None:
        return statement(None)
    try:
        return statement(leaf)
    except psycopg.errors.UndefinedTable:
        _MISSING_LEAVES.add(leaf)
        return statement(None)


def _quiet(delivery_id: int, outcome: str) -> Report:
    DELIVERIES.labels(outcome=outcome).inc()
    log.info("delivery.not_claimed", delivery_id=delivery_id, outcome=outcome)
    return Report(outcome, delivery_id)


@dataclass(frozen=True)
class _Done:
    """A handler that returned without writing through ``ctx.session``: its success is still
    to be recorded (alone: one autocommit statement; in a batch: one for the batch)."""

    claimed: _Claimed
    loaded: Loaded
    at: datetime


def _run(rt: Runtime, session: Session, claimed: _Claimed, publish_retry: PublishRetry) -> Report:
    outcome = _attempt(rt, session, claimed, publish_retry)
    if isinstance(outcome, Report):
        return outcome
    found = claimed.found

    def succeed() -> None:
        on_connection(
            rt.engine,
            lambda raw: _on_leaf(
                claimed.leaf, lambda on: transitions.succeed(raw, found, now=outcome.at, leaf=on)
            ),
        )

    try:
        # Nothing of the handler's to commit: the success alone, one round trip; retried
        # through database faults, since the handler's effect already happened.
        record(rt.engine, "succeed", [found.id], succeed, within=rt.settings.record_retry_seconds)
    except IllegalTransition:
        if found.id not in _recorded(rt, [found]):
            return _lost(rt, found, claimed.fast, claimed.row)
    except Unrecorded:
        return _unrecorded(outcome.claimed)
    except Exception as exc:  # noqa: BLE001 (as a handler error: the attempt failed)
        return _fail_done(rt, outcome, exc, publish_retry)
    return _succeeded(rt, outcome)


# Which of these attempts' successes are committed: asked only when a success statement
# matched no row, which is either a lease lost to another attempt or a commit whose answer
# was lost to a connection error and that was tried again.
_RECORDED = """
    SELECT id FROM deliveries
    WHERE id = ANY(%(ids)s::bigint[]) AND status = 'succeeded'
      AND (id, attempts, generation) IN (
          SELECT * FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(generations)s::int[]))
"""


def _recorded(rt: Runtime, found: Sequence[Claim]) -> set[int]:
    params = {
        "ids": [f.id for f in found],
        "attempts": [f.attempt for f in found],
        "generations": [f.generation for f in found],
    }
    rows = record(
        rt.engine,
        "check",
        params["ids"],
        lambda: on_connection(rt.engine, lambda raw: raw.execute(_RECORDED, params).fetchall()),
        within=rt.settings.record_retry_seconds,
    )
    return {int(r[0]) for r in rows}


def _unrecorded(claimed: _Claimed) -> Report:
    """The outcome could not be recorded within WEBHOOKS_RECORD_RETRY_SECONDS: the delivery
    keeps its lease (and its fast claim, which expires with it) and is taken over once the
    lease runs out, as after a crash."""
    found, row = claimed.found, claimed.row
    DELIVERIES.labels(outcome="unrecorded").inc()
    return Report(
        "unrecorded",
        found.id,
        found.attempt,
        row.event_id,
        row.public_id,
        "the database stayed unreachable: the lease hands the delivery on when it ends",
    )


def _fail_done(rt: Runtime, done: _Done, exc: Exception, publish_retry: PublishRetry) -> Report:
    """Recording the success failed (the database went away): a failed attempt, like any."""
    with rt.sessions() as session:
        return _fail(
            rt,
            session,
            done.claimed.found,
            fast=done.claimed.fast,
            exc=exc,
            policy=done.loaded.policy,
            publish_retry=publish_retry,
            now=_now(rt, done.claimed.found, done.claimed.started),
            row=done.claimed.row,
        )


def _attempt(
    rt: Runtime, session: Session, claimed: _Claimed, publish_retry: PublishRetry
) -> Report | _Done:
    """Run the handler of a claimed delivery: its report, or :class:`_Done` when the success
    is still to be recorded."""
    found, row, fast, started = claimed.found, claimed.row, claimed.fast, claimed.started
    loaded: Loaded | None = None
    try:
        loaded = load(rt, found, row)
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
        run_limited(
            handler,
            loaded.event,
            ctx,
            soft=rt.settings.soft_time_limit,
            hard=rt.settings.hard_time_limit,
            held=_held(found),
        )
        session.flush()
        done_at = _now(rt, found, started)
        if not session.in_transaction():
            return _Done(claimed, loaded, done_at)
        # The handler used ctx.session: its writes and the success commit together.
        transitions.succeed(session, found, now=done_at)
        session.commit()
    except IllegalTransition:
        session.rollback()
        return _lost(rt, found, fast, row)
    except Exception as exc:  # noqa: BLE001 (any handler error is a failed attempt)
        _discard(session, exc)
        policy = loaded.policy if loaded else RetryPolicy.for_route(rt.settings)
        return _fail(
            rt,
            session,
            found,
            fast=fast,
            exc=exc,
            policy=policy,
            publish_retry=publish_retry,
            now=_now(rt, found, started),
            row=row,
        )
    except BaseException as exc:
        if not is_hard_timeout(exc):
            raise
        # The hard limit fired in this thread or greenlet (tasks.pools), e.g. in a handler
        # that caught the soft limit and went on waiting. The attempt fails now, retried
        # like any other failure, instead of holding its lease for the processing TTL.
        _discard(session, exc)
        log.warning("delivery.hard_time_limit", delivery_id=found.id, attempt=found.attempt)
        return _fail(
            rt,
            session,
            found,
            fast=fast,
            exc=RetryableError(
                f"hard time limit ({rt.settings.hard_time_limit}s) exceeded",
                reason="hard_time_limit",
            ),
            policy=loaded.policy if loaded else RetryPolicy.for_route(rt.settings),
            publish_retry=publish_retry,
            now=_now(rt, found, started),
            row=row,
        )
    return _succeeded(rt, _Done(claimed, loaded, done_at))


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


def _succeeded(rt: Runtime, done: _Done, *, confirm: bool = True) -> Report:
    """The success is committed: promote the fast claim (unless the caller does it for a
    whole batch), count and log it."""
    found, loaded, fast = done.claimed.found, done.loaded, done.claimed.fast
    if confirm and loaded.dedup_ttl is not None:
        rt.claims.confirm(fast, loaded.dedup_ttl)
    breaker.after_success(rt, found, done.claimed.row)
    DELIVERIES.labels(outcome="succeeded").inc()
    RECEIPT_TO_SUCCESS.observe(max(0.0, (done.at - loaded.event.meta.received_at).total_seconds()))
    log.info(
        "delivery.succeeded",
        delivery_id=found.id,
        event_id=loaded.event.event_id,
        handler=loaded.route.handler,
        attempt=found.attempt,
        degraded=fast.degraded,
    )
    row = done.claimed.row
    return Report(
        "succeeded", found.id, found.attempt, row.event_id, row.public_id, route_id=found.route_id
    )


def _lost(rt: Runtime, found: Claim, fast: FastClaim, row: ClaimedEvent) -> Report:
    """Our lease ran out and another attempt took over: our writes were rolled back."""
    rt.claims.release(fast)
    DELIVERIES.labels(outcome="lost").inc()
    log.warning("delivery.lease_lost", delivery_id=found.id, attempt=found.attempt)
    return Report(
        "lost",
        found.id,
        found.attempt,
        row.event_id,
        row.public_id,
        "its lease ran out and another attempt took the delivery over",
    )


def _fail(
    rt: Runtime,
    session: Session,
    found: Claim,
    *,
    fast: FastClaim,
    exc: Exception,
    policy: RetryPolicy,
    publish_retry: PublishRetry,
    now: datetime,
    row: ClaimedEvent,
) -> Report:
    # A failed probe of a half-open route is the outage going on, not this delivery's
    # budget: never its last attempt, and not counted by the next ones (models/breaker.py).
    probe = row.breaker_state == "half_open" and isinstance(exc, DownstreamError)
    if probe:
        policy = dataclasses.replace(policy, max_attempts=found.attempts_in_run + 1)
    decision = decide(
        policy,
        attempt=found.attempts_in_run,
        started_at=age_from(found, row, now=now, probe=probe),
        now=now,
        permanent=isinstance(exc, PermanentError),
        requested_delay=exc.delay if isinstance(exc, RetryableError) else None,
        rng=rt.rng,
    )
    error_class, error = type(exc).__name__, describe_error(exc)

    def transition(on: Session) -> None:
        if decision.retry:
            assert decision.next_attempt_at is not None
            transitions.retry_later(
                on,
                found,
                now=now,
                next_attempt_at=decision.next_attempt_at,
                error_class=error_class,
                error=error,
                uncounted=probe,
            )
        else:
            transitions.kill(
                on, found, now=now, reason=decision.reason, error_class=error_class, error=error
            )

    handler_session = [session]

    def write() -> None:
        # The handler's session first; after a connection error, a fresh one each time.
        if handler_session:
            first = handler_session.pop()
            with first.begin():
                transition(first)
            return
        with rt.sessions() as fresh, fresh.begin():
            transition(fresh)

    action = "retry" if decision.retry else "dead"
    try:
        record(rt.engine, action, [found.id], write, within=rt.settings.record_retry_seconds)
    except IllegalTransition:
        return _lost(rt, found, fast, row)
    except Unrecorded:
        return _unrecorded(_Claimed(found, row, fast, None, 0.0))
    # The state is committed: now the next copy may come.
    rt.claims.release(fast)
    breaker.after_failure(rt, found, exc)
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
        return Report(
            "dead",
            found.id,
            found.attempt,
            row.event_id,
            row.public_id,
            f"{decision.reason}: {error}",
            route_id=found.route_id,
        )
    RETRIES.inc()
    DELIVERIES.labels(outcome="retry").inc()
    via = "sweeper"
    if rt.settings.admission and _schedule(rt, found.id, decision.delay.total_seconds()):
        via = "admission"
    elif decision.countdown is not None:
        try:
            publish_retry(Dispatch(found.id, row.event_id, row.public_id), decision.countdown)
            via = "countdown"
        except Exception as publish_exc:  # noqa: BLE001 (the sweeper publishes it later)
            log.warning(
                "delivery.retry_publish_failed",
                delivery_id=found.id,
                error_class=type(publish_exc).__name__,
            )
    log.info("delivery.retry", delay_s=decision.delay.total_seconds(), via=via, **fields)
    return Report(
        "retry",
        found.id,
        found.attempt,
        row.event_id,
        row.public_id,
        error,
        {"countdown": decision.countdown, "admission": decision.delay.total_seconds()}.get(via),
        route_id=found.route_id,
    )


def age_from(found: Claim, row: ClaimedEvent, *, now: datetime, probe: bool) -> datetime:
    """Where a delivery's max_age counts from: its first attempt (or creation), but never
    before its route's last release from a hold (breaker closed, resumed by hand), and a
    half-open probe's failure not at all (the outage goes on). So time a route spent held
    never ages its work into the dead letters (issue 23 item 4; README)."""
    if probe:
        return now
    start = found.first_attempt_at or found.created_at
    return start if row.released_at is None else max(start, row.released_at)


def _schedule(rt: Runtime, delivery_id: int, delay_s: float) -> bool:
    """The retry waits for admission (models/admission.py, ``adm:d``): the dispatcher admits
    it once due, within its route's in-flight budget and rate limit, instead of a countdown
    message that would reach the downstream around both. False when Redis fails: the
    countdown then (admission fails open, as everywhere)."""
    try:
        Admission(rt.redis).schedule(delivery_id, delay_s)
    except Exception as exc:  # noqa: BLE001 (fail open: the caller publishes the countdown)
        ADMISSIONS.labels("failed_open").inc()
        log.warning(
            "delivery.retry_schedule_failed",
            delivery_id=delivery_id,
            error_class=type(exc).__name__,
        )
        return False
    ADMISSIONS.labels("scheduled").inc()
    return True


class DeadLetter(Exception):
    """Raised by the task once the dead state is committed, so that Celery (and Flower)
    shows the attempt as FAILURE with the reason. Declared in the task's ``throws``: an
    expected outcome, logged without a traceback; the message is acknowledged all the same
    (a failed task is acked), so nothing redelivers it."""


class AttemptFailed(Exception):
    """The error of an attempt that will be retried: the exception of its RETRY state."""


def celery_state(report: Report) -> str:
    """Turn a run's report into the task's Celery state: RETRY (with the error) for an
    attempt that will be retried, FAILURE (with the reason) for a dead letter, SUCCESS
    otherwise, with a result that says what happened, so a duplicate or skipped copy is
    never mistaken for a real success."""
    where = f"delivery {report.delivery_id} attempt {report.attempt}"
    if report.outcome == "retry":
        then = (
            f"next copy in {report.countdown:.1f}s"
            if report.countdown is not None
            else "the sweeper publishes the next copy when it is due"
        )
        raise Retry(
            f"{where} failed, will retry: {report.detail}; {then}",
            exc=AttemptFailed(f"{where}: {report.detail}"),
        )
    if report.outcome == "dead":
        raise DeadLetter(f"{where}: dead letter ({report.detail})")
    if report.outcome == "succeeded":
        return "succeeded"
    if report.outcome == "lost":
        return f"lost: {report.detail}"
    if report.outcome == "unrecorded":
        return f"unrecorded: {report.detail}"
    return {
        "duplicate": "duplicate: another copy holds or completed this delivery",
        "skipped": "skipped: done, dead, not due yet or owned by a live lease",
        "held": "held: its route is paused or its circuit breaker is open (not an attempt)",
        "missing": "missing: no such delivery",
        "isolated": "isolated: its worker died holding it; published again alone",
    }.get(report.outcome, report.outcome)


def celery_batch_state(reports: list[Report]) -> str:
    """A message of several deliveries: its Celery state is its worst delivery's (FAILURE if
    one went dead, RETRY if one will be retried, SUCCESS otherwise), and its text, what
    Flower shows, names every delivery it carried with its own outcome."""
    lines = [
        f"{r.delivery_id}: {r.outcome}: {r.detail}"[:300]
        if r.outcome in ("retry", "dead")
        else f"{r.delivery_id}: {celery_state(r)}"
        for r in reports
    ]
    counts: dict[str, int] = {}
    for report in reports:
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    text = f"{len(reports)} deliveries ({summary}): " + "; ".join(lines)
    if counts.get("dead"):
        raise DeadLetter(text)
    if counts.get("retry"):
        raise Retry(text, exc=AttemptFailed(text))
    return text


def message_ids(argument: object) -> list[int] | None:
    """The delivery ids a message carries: one id, or a non-empty list of at most
    ``MAX_DELIVERY_BATCH``; None for anything else."""
    values = argument if isinstance(argument, list) else [argument]
    if not 0 < len(values) <= MAX_DELIVERY_BATCH:
        return None
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return ids if len(ids) == len(values) else None


@shared_task(bind=True, name=DELIVER_TASK, ignore_result=True, throws=(DeadLetter,))
def deliver(self: Task[Any, Any], delivery_id: int | list[int]) -> str:
    """Celery entry point: one delivery id (:func:`run_delivery`), or a list of them
    (:func:`tasks.batch.run_batch`)."""
    ids = message_ids(delivery_id)
    if ids is None:
        log.error("delivery.bad_message", error_class=type(delivery_id).__name__)
        return "rejected: not a delivery id or a list of them"

    def publish_retry(dispatch: Dispatch, countdown: float) -> None:
        options: dict[str, Any] = {"countdown": countdown, **dispatch.reprs()}
        self.apply_async(args=(dispatch.delivery_id,), **options)

    rt = get_runtime()
    if not isinstance(delivery_id, list):
        report = run_delivery(rt, ids[0], publish_retry=publish_retry)
        release_slots(rt, [report])
        return celery_state(report)
    from tasks.batch import run_batch  # noqa: PLC0415 (it imports this module)

    reports = run_batch(rt, ids, publish_retry=publish_retry)
    release_slots(rt, reports)
    return celery_batch_state(reports)


def release_slots(rt: Runtime, reports: list[Report]) -> None:
    """Free the admission slots (models/admission.py) of the attempts that finished here, at
    once, and wake this process's dispatcher to fill them: a route at its in-flight budget
    gets its next delivery now, not after the next reconcile (which still frees whatever this
    misses: a failure here is logged and changes nothing else). Without it a lone route ran
    well under its budget's worth of concurrent calls (bench_forward: 0.58x main at budget 40)."""
    if not rt.settings.admission:
        return
    done: dict[int, list[int]] = {}
    for report in reports:
        if report.route_id is not None:
            done.setdefault(report.route_id, []).append(report.delivery_id)
    if not done:
        return
    try:
        Admission(rt.redis).release(done)
    except Exception as exc:  # noqa: BLE001 (the dispatcher's reconcile frees them later)
        log.warning("delivery.release_failed", error_class=type(exc).__name__)
        return
    dispatcher.wake()

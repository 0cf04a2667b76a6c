"""The delivery pipeline: claim, run and finish the deliveries of one task message, n >= 1.

A message carries one delivery id (the receiver's publisher under light load, the sweeper, a
retry) or a list of up to ``WEBHOOKS_DELIVERY_BATCH`` (:func:`tasks.config.batches`). Both
take the same steps through the same code, :func:`run`: a message of one id is a batch of
one. Celery's per-message work (fetch, ack, task events) and our round trips are paid once
per message, not once per delivery (bench/results_forward.txt); each delivery keeps its own
fate.

 0. one read of every delivery's key generation (it names the fast claim), partition key, and
    whether Postgres shows the row overdue (``_PROBE``);
 1. the fast claims in Redis: ``SET claim:<installation>:<id>:<generation> <token> NX`` with
    the processing TTL, each won or lost on its own (one pipeline; one plain command for one
    id); a held key means another copy is running or has succeeded: that delivery's report is
    "duplicate";
 2. one guarded claim statement per partition, in autocommit
    (:func:`models.transitions.claim_many_with_event`; its one-row form
    :func:`~models.transitions.claim_with_event` for one delivery): pending | retrying (due) |
    processing (lease expired) -> processing, attempts + 1, lease = processing TTL, for this
    generation, each row on its own guard, in id order; no row means done, dead, not due,
    owned or replayed since: release the fast claim and report why. A claim that finds a dead
    worker's lease counts a redelivery; at ``max_redeliveries`` it returns the verdict "dead"
    (crash loop) instead of running the handler again. The same statement returns each
    receipt, route and source;
 3. run each ``handler(event, ctx)``, *concurrently*: each in its own thread (a greenlet under
    gevent; the calling thread for a message of one id) with its own session, its own soft
    and hard time limits (:func:`tasks.pools.run_limited`) and its own idempotency key;
 4. the successes of handlers that wrote nothing through ``ctx.session``: one guarded
    statement per partition (:func:`models.transitions.succeed_many`; :func:`~models.
    transitions.succeed` for one), one synchronous commit, then the fast claims promoted to
    the source's dedup TTL in one round trip; while some handlers still run, those that
    returned are recorded every :data:`FINISH_WINDOW`, so a slow one holds back no other. A
    handler that wrote through ``ctx.session`` commits its writes and its success together in
    its own transaction;
 5. each caught failure is recorded on its own: roll the handler's writes back; commit
    ``retry_later`` (next_attempt_at = now + full-jitter backoff) or ``kill`` (permanent,
    attempts or age exhausted); release the Redis key; only then schedule the retry with
    admission (models/admission.py: the dispatcher admits it once due, within its route's
    limits), so the message can never arrive before the state that allows it to be claimed.
    With admission off (or Redis failing), a countdown message of its own for short delays;
    longer ones are left to the sweeper.

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
idempotent downstream. Once a handler has returned, recording its outcome (success, retry,
dead) is retried through database faults on a fresh connection for
``WEBHOOKS_RECORD_RETRY_SECONDS`` (:mod:`tasks.durable`): a failed commit is never a reason
to call the downstream again. Only when that time runs out does the lease hand the delivery
on ("unrecorded").

*Why nothing is lost.* The receipt and its delivery rows commit before the provider gets its
2xx. Everything after that may drop a *message* (a publish that fails, a broker flush, a
message acked by a worker that then died, a copy dropped because a stale fast-claim key was
still held) but never the row: the row stays pending / retrying / processing, and the sweeper
republishes pending rows after the publish grace, retries once they are due, and processing
rows whose lease ran out. A key left by a dead worker expires after the processing TTL.

*Why Redis cannot cause a second effect.* The fast tier only ever *skips* work; Postgres
decides. Unreachable Redis fails open (counted as degraded) and the guarded claim alone
serialises workers; a flushed Redis admits the copy to the durable claim, which refuses it. A
key held for a row Postgres shows overdue, or pending after two of the sweeper's
re-publishes, is stale and the durable claim decides.

*A worker killed mid-message* loses the leases it held (lease, sweeper); the successes it had
committed stay committed and their redelivered copies are skipped. Whether the redelivery
counts as a crash (``max_redeliveries``) depends on who was to blame: a worker killed by its
own watchdog over a stuck handler marks that delivery the suspect and the others it ran
bystanders (:mod:`tasks.crashes`), and only the suspect's crash counts; a kill -9 from outside
names nobody and each counts. Either way a batch does not run together again: the sweeper
republishes lease-expired deliveries one per message, and a requeued copy of a batch
publishes each lease-expired delivery it carries alone instead of claiming it
(:func:`_isolate`), so a handler that kills its worker next time kills it alone.

*Durability.* The claim commits asynchronously (no fsync wait): if Postgres crashes before
flushing it, the claim is undone, the claiming worker's connection died with the server so
it can commit nothing more, and the delivery is claimed again, as after a worker crash. The
success commit is synchronous (it also flushes the claim), and only after it returns is the
Redis key promoted: a promoted key always stands for a durable success.

*Round trips.* Steps 0, 2 and (for handlers that wrote nothing through ``ctx.session``) 4 are
each one autocommit statement per message (per partition it spans): no BEGIN, no separate
COMMIT, no ping on checkout (a pooled connection found dead by step 0, which changes nothing,
makes every pooled connection be replaced, :func:`tasks.durable.discard_pooled`, and the
message starts again once on a fresh one). The connection goes back to the pool while the
handlers run (under the threads and gevent pools a hundred handlers wait on downstreams at
once; step 4 takes one again). Steps 2 and 4 name the deliveries' leaf partitions directly (a
generic plan on the partitioned parents locks every partition), falling back to the parents
when that leaf does not exist. Three statements and two Redis round trips per message
(tests/test_worker_connections.py counts them for one id and for three); for one id the
one-row statements and plain Redis commands, the measured fastest.

*Budgets and clocks.* The lease is the processing TTL (4 x hard time limit): a live task is
killed by the hard limit long before its lease can run out. Leases and due times are judged
on the database's clock (``now()`` in the guarded statements, :mod:`core.clock`), never
this host's: a worker whose clock runs minutes ahead cannot see a live lease as expired, and
the fencing token protects the commit if a lease ever does run out. The soft limit raises
inside the handler and is handled as a retryable failure; the hard limit kills the process
(a crash) under prefork, and fails the attempt under threads and gevent (:mod:`tasks.pools`
says how each pool enforces both). A message of several ids carries Celery limits of twice
the hard limit (:func:`tasks.config.batch_time_limits`), a backstop above the per-handler
limits, which end each handler first: a stuck handler fails its own delivery and no other.

Logs carry ids, outcomes and error classes, never payloads or secrets.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from core.clock import pinned
from core.crypto import SecretDecryptError
from core.errors import WebhooksError
from core.logs import get_logger
from core.messages import Dispatch
from core.metrics import ADMISSIONS, DEAD_LETTERS, DELIVERIES, RECEIPT_TO_SUCCESS, RETRIES
from core.settings import MAX_DELIVERY_BATCH
from core.ttl import TtlConfigError, TtlOverrides, effective_ttl
from models import transitions
from models.admission import Admission
from models.breaker import held
from models.partitions import leaf_suffix
from models.transitions import Claim, ClaimedEvent, Held, IllegalTransition, Wanted
from tasks import breaker
from tasks.claims import FastClaim
from tasks.context import Event, EventMeta, HandlerContext, RouteInfo, idempotency_key
from tasks.durable import (
    CONNECTION_ERRORS,
    Unrecorded,
    autocommit,
    discard_pooled,
    on_connection,
    record,
)
from tasks.errors import DownstreamError, HandlerError, PermanentError, RetryableError
from tasks.policy import DEAD_CRASHED, RetryPolicy, decide
from tasks.pools import in_flight, is_green, is_hard_timeout, run_limited
from tasks.runtime import Runtime

log = get_logger(__name__)

T = TypeVar("T")

# Publishes the delivery again after ``countdown`` seconds.
PublishRetry = Callable[[Dispatch, float], None]

# While some handlers of a message still run, the successes of those that returned are
# recorded at least this often (seconds): one slow or stuck handler never holds its
# batch-mates' successes until its own time limit.
FINISH_WINDOW = 0.25

# Each delivery's key generation (it names the fast claim), its partition key (the claim then
# touches one partition), whether Postgres shows the row claimable now and past its publish
# grace or lease, or pending after two of the sweeper's re-publishes, which move its
# next_attempt_at ahead each time (a fast-claim key held for such a row is stale: see
# _claim), and whether its previous holder died with the lease (see _isolate). On the
# database's clock, like the claim. One id: ``d.id = %(id)s`` (its one-row plan).
_PROBE = """
    SELECT d.id, d.generation, d.expires_at,
           d.status IN ('pending', 'retrying', 'processing')
           AND (CASE d.status WHEN 'processing' THEN d.lease_until
                              ELSE d.next_attempt_at END <= t.now
                OR d.status = 'pending' AND d.republished >= 2),
           d.status = 'processing' AND d.lease_until <= t.now
    FROM deliveries d, (SELECT coalesce(%(now)s::timestamptz, now()) AS now) t
    WHERE {where}
"""
_PROBE_ONE = _PROBE.format(where="d.id = %(id)s")
_PROBE_MANY = _PROBE.format(where="d.id = ANY(%(ids)s::bigint[])")


class _StaleConnection(WebhooksError):
    """The pooled connection died while idle (a Postgres restart): take a fresh one."""


@dataclass(frozen=True)
class Report:
    """What the task did with one delivery, for the task's Celery state (what Flower
    shows) and the tests: the outcome (succeeded, retry, dead, duplicate, skipped, held,
    missing, lost, isolated, unclaimed, unrecorded: the database stayed away longer than
    WEBHOOKS_RECORD_RETRY_SECONDS), and
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
    # as soon as the task ends (:func:`tasks.deliver.release_slots`), not at the dispatcher's
    # next reconcile.
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
    """A message of one id (:func:`run`). Returns the outcome: succeeded, retry, dead,
    duplicate (fast tier), skipped (durable tier: done, dead, not due or owned), held (its
    route is paused or its breaker open: no attempt), missing, lost (our lease was taken
    over) or unrecorded."""
    return run(rt, [delivery_id], publish_retry=publish_retry, alone=True)[0].outcome


@dataclass(frozen=True)
class _Claimed:
    """A delivery this task now owns (durable claim committed), ready for its handler."""

    found: Claim
    row: ClaimedEvent
    fast: FastClaim
    leaf: str | None
    started: float


def run(
    rt: Runtime,
    delivery_ids: Sequence[int],
    *,
    publish_retry: PublishRetry,
    alone: bool = False,
) -> list[Report]:
    """Run the deliveries of one message; one report per distinct id, in the message's order.

    ``alone``: the message is one bare id, whose Celery time limits are its handler's own, so
    the calling thread runs that handler, under them (a list, even of one, carries the batch
    backstop limits: its handlers get limits of their own, see :func:`in_waves`)."""
    ids = list(dict.fromkeys(delivery_ids))
    reports: dict[int, Report] = {}
    claimed: list[_Claimed] = []
    # One pooled connection for the read and the claims, given back before the handlers run:
    # under gevent a hundred handlers wait on their downstreams at once, and holding a
    # connection each through that wait would need a hundred. No ping per checkout (a round
    # trip per message): a connection that died while pooled fails the first read, which
    # changes nothing, and the message starts again once on a fresh connection.
    for fresh in (False, True):
        try:
            with rt.engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert raw is not None
                claimed = _claim(rt, conn, raw, ids, fresh, reports, publish_retry)
        except _StaleConnection:
            discard_pooled(rt.engine)  # a restart killed them all: replace every one
            log.warning("delivery.stale_connection", delivery_ids=ids)
            continue
        break
    with in_flight([_held(c.found) for c in claimed]):
        return _run_claimed(rt, ids, claimed, reports, publish_retry, inline=alone)


# -- steps 0 to 2: the claims ------------------------------------------------------------


def _claim(
    rt: Runtime,
    conn: Connection,
    raw: psycopg.Connection[Any],
    ids: list[int],
    fresh: bool,
    reports: dict[int, Report],
    publish_retry: PublishRetry,
) -> list[_Claimed]:
    """Steps 0-2: the deliveries this task now owns; a report for each of the others."""
    now = pinned(rt.clock)
    try:
        with autocommit(raw):
            if len(ids) == 1:
                rows = raw.execute(_PROBE_ONE, {"id": ids[0], "now": now}).fetchall()
            else:
                rows = raw.execute(_PROBE_MANY, {"ids": ids, "now": now}).fetchall()
    except (psycopg.OperationalError, psycopg.ProgrammingError):
        if fresh or not raw.closed:
            raise
        conn.invalidate()
        raise _StaleConnection from None
    found = {int(r[0]): (int(r[1]), r[2], bool(r[3])) for r in rows}
    crashed = {int(r[0]) for r in rows if r[4]} if len(ids) > 1 else set()
    for delivery_id in ids:
        if delivery_id not in found:
            reports[delivery_id] = _quiet(delivery_id, "missing")
        elif delivery_id in crashed:
            reports[delivery_id] = _isolate(delivery_id, publish_retry)
    present = [i for i in ids if i in found and i not in crashed]
    fast = rt.claims.acquire_many([(i, found[i][0]) for i in present])
    by_leaf: dict[str | None, list[tuple[Wanted, FastClaim]]] = defaultdict(list)
    for delivery_id, claim in zip(present, fast, strict=True):
        generation, expires_at, overdue = found[delivery_id]
        if not claim.first:
            if not overdue:
                reports[delivery_id] = _quiet(delivery_id, "duplicate")
                continue
            # The key is held, yet Postgres shows the row claimable and past its publish
            # grace (or lease): a key left by a success whose commit was lost (failover,
            # restore) or by a worker that died. Never let it hide the row: the durable
            # claim decides.
            rt.claims.note_stale(claim, delivery_id)
        wanted = Wanted(delivery_id, generation, expires_at)
        by_leaf[_leaf_for(rt, expires_at)].append((wanted, claim))
    out: list[_Claimed] = []
    for leaf, group in by_leaf.items():
        try:
            out += _claim_group(rt, raw, leaf, group, reports)
        except CONNECTION_ERRORS as exc:
            if not out:
                raise  # nothing claimed yet: the message fails whole, nothing left behind
            # Earlier partitions' claims are committed: their handlers run and their outcomes
            # are recorded. This group claimed nothing (its fast claims were released); its
            # rows are as they were, for the sweeper or another copy.
            log.warning(
                "delivery.claim_failed",
                delivery_ids=[wanted.id for wanted, _ in group],
                error_class=type(exc).__name__,
            )
            for wanted, _ in group:
                reports[wanted.id] = _quiet(wanted.id, "unclaimed")
    return out


def _isolate(delivery_id: int, publish_retry: PublishRetry) -> Report:
    """A delivery of a message of several whose previous holder died with the lease: a copy
    of a batch whose worker was killed (by its watchdog, over one stuck handler, or by a
    kill -9 from outside that named nobody). Not claimed with its batch-mates again:
    published alone (one id per message, as the sweeper does), so that a handler that kills
    its worker next time takes no batch-mate with it. If the publish fails, the sweeper's
    pick publishes it alone all the same."""
    try:
        publish_retry(Dispatch(delivery_id), 0.0)
    except Exception as exc:  # noqa: BLE001 (the sweeper republishes lease-expired rows)
        log.warning(
            "delivery.isolate_publish_failed",
            delivery_id=delivery_id,
            error_class=type(exc).__name__,
        )
    return _quiet(delivery_id, "isolated")


def _claim_group(
    rt: Runtime,
    raw: psycopg.Connection[Any],
    leaf: str | None,
    group: list[tuple[Wanted, FastClaim]],
    reports: dict[int, Report],
) -> list[_Claimed]:
    """Step 2 for the deliveries of one partition: one guarded statement."""
    claims = {wanted.id: claim for wanted, claim in group}
    started = time.monotonic()
    try:
        with autocommit(raw):
            rows = _on_leaf(leaf, lambda on: _claim_rows(rt, raw, [w for w, _ in group], on))
    except psycopg.errors.DeadlockDetected:
        # Two copies claiming the same rows at once (only with the fast tier down or
        # flushed): nothing of ours committed, the other copy's claim decides.
        rows = []
        log.warning("delivery.claim_conflict", delivery_ids=list(claims))
    except BaseException:
        for claim in claims.values():
            rt.claims.release(claim)
        raise
    out: list[_Claimed] = []
    for found, row in rows:
        claim = claims.pop(found.id)
        if found.crashed_too_often:
            reports[found.id] = _crash_looped(rt, found, row, claim)
        else:
            out.append(_Claimed(found, row, claim, leaf, started))
    why = _not_claimed(raw, list(claims)) if claims else {}
    for delivery_id, claim in claims.items():
        rt.claims.release(claim)
        reports[delivery_id] = _quiet(delivery_id, why[delivery_id])
    return out


def _claim_rows(
    rt: Runtime, raw: psycopg.Connection[Any], wanted: list[Wanted], leaf: str | None
) -> list[tuple[Claim, ClaimedEvent]]:
    """The guarded claim statement: its one-row form for one delivery (the single-id plan, the
    measured fastest), the unnest form for several."""
    now, lease = pinned(rt.clock), timedelta(seconds=rt.settings.processing_ttl)
    if len(wanted) == 1:
        one = wanted[0]
        claimed = transitions.claim_with_event(
            raw,
            one.id,
            generation=one.generation,
            expires_at=one.expires_at,
            now=now,
            lease=lease,
            max_redeliveries=rt.settings.max_redeliveries,
            worker=rt.worker,
            leaf=leaf,
        )
        return [] if claimed is None else [claimed]
    return transitions.claim_many_with_event(
        raw,
        wanted,
        now=now,
        lease=lease,
        max_redeliveries=rt.settings.max_redeliveries,
        worker=rt.worker,
        leaf=leaf,
    )


def _held(found: Claim) -> Held:
    """What a watchdog names if it kills this process while ``found`` is in flight."""
    return Held(found.id, found.expires_at, found.attempt)


def _not_claimed(raw: psycopg.Connection[Any], ids: list[int]) -> dict[int, str]:
    """Why the claim took none of these: "held" (its route is paused or its breaker open:
    not an attempt, :mod:`models.breaker`) or "skipped" (done, dead, not due or owned). One
    more statement, on this path only."""
    with autocommit(raw):
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
    to be recorded, with the message's others of its partition in one statement (step 4)."""

    claimed: _Claimed
    loaded: Loaded
    at: datetime


# -- steps 3 to 5: the handlers and their outcomes --------------------------------------


def _run_claimed(
    rt: Runtime,
    ids: list[int],
    claimed: list[_Claimed],
    reports: dict[int, Report],
    publish_retry: PublishRetry,
    *,
    inline: bool,
) -> list[Report]:
    """Steps 3 to 5: the claimed deliveries' handlers, their outcomes recorded."""
    errors: list[BaseException] = []
    jobs = [_handler_job(rt, c, publish_retry) for c in claimed]
    for wave in in_waves(rt, jobs, FINISH_WINDOW, inline=inline):
        done: list[_Done] = []
        for index, outcome in wave:
            if isinstance(outcome, _Done):
                done.append(outcome)
            elif isinstance(outcome, Report):
                reports[claimed[index].found.id] = outcome
            else:
                # Not a handler error (those are reports): the database failed while
                # recording one. The delivery stays processing; its lease runs out and the
                # sweeper republishes it, as after a crash. Finish the others first.
                errors.append(outcome)
        try:
            finished = _finish(rt, done, publish_retry)
        except Exception as exc:  # noqa: BLE001 (raised once every handler is accounted for)
            # Recording these outcomes failed on a database error that is not a lost
            # connection's (those are retried in _finish): their deliveries keep their lease,
            # as after a crash. The handlers still running are waited for and their outcomes
            # recorded first: none is left claimed and forgotten.
            errors.append(exc)
            continue
        for report in finished:
            reports[report.delivery_id] = report
    if errors:
        raise errors[0]
    return [reports[i] for i in ids]


def _handler_job(
    rt: Runtime, claimed: _Claimed, publish_retry: PublishRetry
) -> Callable[[], Report | _Done]:
    def job() -> Report | _Done:
        # The handler's session takes a connection only if the handler uses it.
        with rt.sessions() as session:
            return _attempt(rt, session, claimed, publish_retry)

    return job


def _finish(rt: Runtime, done: list[_Done], publish_retry: PublishRetry) -> list[Report]:
    """Step 4: the successes still to record, one statement per partition, each retried
    through database faults (:mod:`tasks.durable`): these handlers' effects already happened."""
    if not done:
        return []
    by_leaf: dict[str | None, list[_Done]] = defaultdict(list)
    for d in done:
        by_leaf[d.claimed.leaf].append(d)
    reports: list[Report] = []
    confirmed: list[tuple[FastClaim, timedelta]] = []
    for leaf, group in by_leaf.items():
        pairs = [(d.claimed.found, d.at) for d in group]
        ids = [found.id for found, _ in pairs]

        def succeed(
            leaf: str | None = leaf, pairs: list[tuple[Claim, datetime]] = pairs
        ) -> set[int]:
            return on_connection(
                rt.engine, lambda raw: _on_leaf(leaf, lambda on: _succeed_rows(raw, pairs, on))
            )

        try:
            won = record(
                rt.engine, "succeed", ids, succeed, within=rt.settings.record_retry_seconds
            )
        except Unrecorded:
            reports += [_unrecorded(d.claimed) for d in group]
            continue
        except Exception as exc:  # noqa: BLE001 (each one's attempt failed, like a handler error)
            reports += [_fail_done(rt, d, exc, publish_retry) for d in group]
            continue
        if len(won) < len(group):  # a lease lost, or a commit retried after its answer was lost
            won |= _recorded(rt, [d.claimed.found for d in group if d.claimed.found.id not in won])
        for d in group:
            if d.claimed.found.id in won:
                reports.append(_succeeded(rt, d))
                if d.loaded.dedup_ttl is not None:
                    confirmed.append((d.claimed.fast, d.loaded.dedup_ttl))
            else:
                reports.append(_lost(rt, d.claimed.found, d.claimed.fast, d.claimed.row))
    rt.claims.confirm_many(confirmed)
    return reports


def _succeed_rows(
    raw: psycopg.Connection[Any], pairs: list[tuple[Claim, datetime]], leaf: str | None
) -> set[int]:
    """The guarded success statement (one synchronous commit): its one-row form for one
    delivery, the unnest form for several. The ids that moved; one missing lost its lease,
    or this is a retry of a commit whose answer was lost (:func:`_recorded` tells)."""
    if len(pairs) == 1:
        found, at = pairs[0]
        try:
            transitions.succeed(raw, found, now=at, leaf=leaf)
        except IllegalTransition:
            return set()
        return {found.id}
    return transitions.succeed_many(raw, pairs, leaf=leaf)


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
    # Committed with the handler's writes: promote its fast claim now, as _finish does for
    # the others.
    if loaded.dedup_ttl is not None:
        rt.claims.confirm(fast, loaded.dedup_ttl)
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


def _succeeded(rt: Runtime, done: _Done) -> Report:
    """The success is committed: count and log it (:func:`_finish` promotes the fast claims
    of the message's successes together)."""
    found, loaded, fast = done.claimed.found, done.loaded, done.claimed.fast
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
    rt: Runtime, jobs: list[Callable[[], T]], window: float, *, inline: bool = False
) -> Iterator[list[tuple[int, T | BaseException]]]:
    """Run ``jobs`` at once; yield what finished, as (index, result or what it raised), when
    all are done or every ``window`` seconds meanwhile (each job once). Threads under threads
    and prefork, greenlets under gevent. A lone job runs in the calling thread (or greenlet)
    when ``inline`` (the message's own Celery limits are its handler's: a bare id), or in a
    thread-pool thread that is not a prefork child's main thread (there, without ``inline``,
    the per-handler limits need a thread of their own, see :mod:`tasks.pools`)."""

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
        import gevent  # noqa: PLC0415

        greenlets = {gevent.spawn(guarded, job): i for i, job in enumerate(jobs)}
        while greenlets:
            gevent.joinall(list(greenlets), timeout=window)
            ready = [g for g in greenlets if g.ready()]
            if ready:
                yield [(greenlets.pop(g), g.value) for g in ready]
        return
    pool = _executor(rt)
    futures = {pool.submit(guarded, job): i for i, job in enumerate(jobs)}
    while futures:
        finished, _ = wait(futures, timeout=window)
        if finished:
            yield [(futures.pop(f), f.result()) for f in finished]

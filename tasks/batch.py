"""Several deliveries in one task message: the per-message costs paid once, each delivery
keeping its own fate.

The receiver's publisher packs the deliveries it finds queued together into one message of
up to ``WEBHOOKS_DELIVERY_BATCH`` ids (:func:`tasks.config.batches`; one id under light
load). Celery's per-message work (fetch, ack, task events) and our round trips are then paid
once per message instead of once per delivery (bench/results_forward.txt):

 0. one read of every delivery's key generation and partition key (as ``_PROBE``);
 1. the fast claims in one Redis pipeline (``SET NX`` each, each won or lost on its own);
 2. one guarded claim statement for all of them
    (:func:`models.transitions.claim_many_with_event`): each row claimed or not on its own
    guard, in id order;
 3. the handlers run *concurrently*, each in its own thread (a greenlet under gevent) with its
    own session, its own soft and hard time limits (:mod:`tasks.pools`) and its own
    idempotency key;
 4. the successes of handlers that wrote nothing through ``ctx.session`` in one guarded
    statement (:func:`models.transitions.succeed_many`, one synchronous commit), then their
    fast claims promoted in one pipeline; while some handlers still run, those that returned
    are recorded every :data:`FINISH_WINDOW`, so a slow one holds back no other. A handler
    that wrote through ``ctx.session`` commits its writes and its success together in its
    own transaction, as alone;
 5. each failure is recorded on its own (retry, dead, lost) exactly as for a lone delivery,
    and its retry is published as a message of its own.

Every guarantee of :mod:`tasks.deliver` holds per delivery: each claim and each success is
guarded by that delivery's status, attempt and generation, so a batch is only a way of
sending several guarded statements in one round trip. A worker killed mid-batch loses the
leases it held (lease, sweeper); the successes it had committed stay committed and their
redelivered copies are skipped. Whether the redelivery counts as a crash
(``max_redeliveries``) depends on who was to blame: a worker killed by its own watchdog over
a stuck handler marks that delivery the suspect and the others it ran bystanders
(:mod:`tasks.crashes`), and only the suspect's crash counts; a kill -9 from outside names
nobody and each counts. Either way the batch does not run together again: the sweeper
republishes lease-expired deliveries one per message, and a requeued copy of the batch
publishes each lease-expired delivery it carries alone instead of claiming it
(:func:`_isolate`), so a handler that kills its worker next time kills it alone.

Time limits: a batch message carries Celery limits of twice the hard limit
(:func:`tasks.config.batch_time_limits`), a backstop above the per-handler limits, which end
each handler first: a stuck handler fails its own delivery (retry) and no other.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection

from models import transitions
from models.transitions import Wanted
from tasks.claims import FastClaim
from tasks.config import Dispatch
from tasks.deliver import (
    PublishRetry,
    Report,
    _attempt,
    _Claimed,
    _crash_looped,
    _Done,
    _fail_done,
    _held,
    _leaf_for,
    _lost,
    _not_claimed,
    _on_leaf,
    _quiet,
    _recorded,
    _StaleConnection,
    _succeeded,
    _unrecorded,
)
from tasks.durable import CONNECTION_ERRORS, Unrecorded, discard_pooled, on_connection, record
from tasks.durable import autocommit as _autocommit
from tasks.pools import in_flight, is_green
from tasks.runtime import Runtime
from webhooks.clock import pinned
from webhooks.logs import get_logger
from webhooks.settings import MAX_DELIVERY_BATCH

log = get_logger(__name__)

T = TypeVar("T")

# While some handlers of a message still run, the successes of those that returned are
# recorded at least this often (seconds): one slow or stuck handler never holds its
# batch-mates' successes until its own time limit.
FINISH_WINDOW = 0.25

# Every delivery's generation, partition key and overdue flag (see tasks.deliver._PROBE), and
# whether its previous holder died with the lease (it crashed: see _claim_all).
_PROBE_MANY = """
    SELECT d.id, d.generation, d.expires_at,
           d.status IN ('pending', 'retrying', 'processing')
           AND (CASE d.status WHEN 'processing' THEN d.lease_until
                              ELSE d.next_attempt_at END <= t.now
                OR d.status = 'pending' AND d.republished >= 2),
           d.status = 'processing' AND d.lease_until <= t.now
    FROM deliveries d, (SELECT coalesce(%(now)s::timestamptz, now()) AS now) t
    WHERE d.id = ANY(%(ids)s::bigint[])
"""


def run_batch(
    rt: Runtime, delivery_ids: Sequence[int], *, publish_retry: PublishRetry
) -> list[Report]:
    """Run the deliveries of one message; one report per distinct id, in the message's order."""
    ids = list(dict.fromkeys(delivery_ids))
    reports: dict[int, Report] = {}
    claimed: list[_Claimed] = []
    for fresh in (False, True):
        try:
            with rt.engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert raw is not None
                claimed = _claim_all(rt, conn, raw, ids, fresh, reports, publish_retry)
        except _StaleConnection:
            discard_pooled(rt.engine)
            log.warning("delivery.stale_connection", delivery_ids=ids)
            continue
        break
    with in_flight([_held(c.found) for c in claimed]):
        return _run_claimed(rt, ids, claimed, reports, publish_retry)


def _run_claimed(
    rt: Runtime,
    ids: list[int],
    claimed: list[_Claimed],
    reports: dict[int, Report],
    publish_retry: PublishRetry,
) -> list[Report]:
    """Steps 3 to 5: the claimed deliveries' handlers, their outcomes recorded."""
    errors: list[BaseException] = []
    jobs = [_handler_job(rt, c, publish_retry) for c in claimed]
    for wave in in_waves(rt, jobs, FINISH_WINDOW):
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
        for report in _finish_all(rt, done, publish_retry):
            reports[report.delivery_id] = report
    if errors:
        raise errors[0]
    return [reports[i] for i in ids]


def _handler_job(
    rt: Runtime, claimed: _Claimed, publish_retry: PublishRetry
) -> Callable[[], Report | _Done]:
    def job() -> Report | _Done:
        with rt.sessions() as session:
            return _attempt(rt, session, claimed, publish_retry)

    return job


def _claim_all(
    rt: Runtime,
    conn: Connection,
    raw: psycopg.Connection[Any],
    ids: list[int],
    fresh: bool,
    reports: dict[int, Report],
    publish_retry: PublishRetry,
) -> list[_Claimed]:
    """Steps 0-2: the deliveries this task now owns; a report for each of the others."""
    try:
        with _autocommit(raw):
            rows = raw.execute(_PROBE_MANY, {"ids": ids, "now": pinned(rt.clock)}).fetchall()
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
    """A delivery of this message whose previous holder died with the lease: a copy of a
    batch whose worker was killed (by its watchdog, over one stuck handler, or by a kill -9
    from outside that named nobody). Not claimed with its batch-mates again: published alone
    (one id per message, as the sweeper does), so that a handler that kills its worker next
    time takes no batch-mate with it. If the publish fails, the sweeper's pick publishes it
    alone all the same."""
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
    claims = {wanted.id: claim for wanted, claim in group}
    started = time.monotonic()
    try:
        with _autocommit(raw):
            rows = _on_leaf(
                leaf,
                lambda on: transitions.claim_many_with_event(
                    raw,
                    [wanted for wanted, _ in group],
                    now=pinned(rt.clock),
                    lease=timedelta(seconds=rt.settings.processing_ttl),
                    max_redeliveries=rt.settings.max_redeliveries,
                    worker=rt.worker,
                    leaf=on,
                ),
            )
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


def _finish_all(rt: Runtime, done: list[_Done], publish_retry: PublishRetry) -> list[Report]:
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

        def succeed(leaf: str | None = leaf, pairs: list[Any] = pairs) -> set[int]:
            return on_connection(
                rt.engine,
                lambda raw: _on_leaf(
                    leaf, lambda on: transitions.succeed_many(raw, pairs, leaf=on)
                ),
            )

        try:
            won = record(
                rt.engine, "succeed", ids, succeed, within=rt.settings.record_retry_seconds
            )
        except Unrecorded:
            reports += [_unrecorded(d.claimed) for d in group]
            continue
        except Exception as exc:  # noqa: BLE001 (each one's attempt failed, as alone)
            reports += [_fail_done(rt, d, exc, publish_retry) for d in group]
            continue
        if len(won) < len(group):  # a lease lost, or a commit retried after its answer was lost
            won |= _recorded(rt, [d.claimed.found for d in group if d.claimed.found.id not in won])
        for d in group:
            if d.claimed.found.id in won:
                reports.append(_succeeded(rt, d, confirm=False))
                if d.loaded.dedup_ttl is not None:
                    confirmed.append((d.claimed.fast, d.loaded.dedup_ttl))
            else:
                reports.append(_lost(rt, d.claimed.found, d.claimed.fast, d.claimed.row))
    rt.claims.confirm_many(confirmed)
    return reports


# Runs a batch's handlers; sized so that no handler ever waits for a thread (every slot's
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
    rt: Runtime, jobs: list[Callable[[], T]], window: float
) -> Iterator[list[tuple[int, T | BaseException]]]:
    """Run ``jobs`` at once; yield what finished, as (index, result or what it raised), when
    all are done or every ``window`` seconds meanwhile (each job once). Threads under threads
    and prefork, greenlets under gevent."""

    def guarded(job: Callable[[], T]) -> T | BaseException:
        try:
            return job()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            return exc

    if not jobs:
        return
    if is_green():
        import gevent  # noqa: PLC0415

        greenlets = {gevent.spawn(guarded, job): i for i, job in enumerate(jobs)}
        while greenlets:
            gevent.joinall(list(greenlets), timeout=window)
            ready = [g for g in greenlets if g.ready()]
            if ready:
                yield [(greenlets.pop(g), g.value) for g in ready]
        return
    if len(jobs) == 1 and threading.current_thread() is not threading.main_thread():
        # One handler: this thread runs it (a prefork child's main thread does not: there
        # the per-handler limits need a thread of their own, see tasks.pools).
        yield [(0, guarded(jobs[0]))]
        return
    pool = _executor(rt)
    futures = {pool.submit(guarded, job): i for i, job in enumerate(jobs)}
    while futures:
        finished, _ = wait(futures, timeout=window)
        if finished:
            yield [(futures.pop(f), f.result()) for f in finished]

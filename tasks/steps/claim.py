"""Steps 0 to 2 of a message: the probe, the fast claims (Redis), the guarded claims
(Postgres); the deliveries this task now owns, and a report for each of the others.

0. one read of every delivery's key generation, partition key and whether Postgres shows it
   overdue (:func:`models.deliveries.probe`);
1. ``SET claim:<installation>:<id>:<generation> <token> NX`` for each, won or lost on its own
   (:meth:`tasks.claims.ClaimStore.acquire_many`): a held key is a "duplicate", unless
   Postgres shows the row overdue (the key is stale and the durable claim decides);
2. one guarded claim statement per partition, in autocommit (:func:`models.deliveries.claim`):
   no row means done, dead, not due, owned, replayed since, or held by its route; a claim
   that finds a dead worker's lease counts a redelivery, and at ``max_redeliveries`` makes the
   delivery dead instead (crash loop). In a message of several, a delivery whose previous
   holder died is published alone instead (:func:`isolate`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import Connection

from core.clock import Clock, pinned
from core.errors import WebhooksError
from core.logs import get_logger
from core.messages import Dispatch
from core.metrics import DEAD_LETTERS, DELIVERIES, REPEAT_WINDOWS, SUPERSEDED
from models import deliveries, lanes, ledger, transitions
from models.breaker import held
from models.crash_marks import Held
from models.transitions import Claim, ClaimedEvent, Wanted
from tasks.claims import FastClaim
from tasks.connections import (
    CONNECTION_ERRORS,
    autocommit,
    discard_pooled,
    on_connection,
    record,
)
from tasks.policy import DEAD_CRASHED
from tasks.runtime import Runtime
from tasks.steps.outcome import Outcome, PublishRetry, Report, quiet, scope, source_label

log = get_logger(__name__)


class _StaleConnection(WebhooksError):
    """The pooled connection died while idle (a Postgres restart): take a fresh one."""


@dataclass(frozen=True)
class Claimed:
    """A delivery this task now owns (durable claim committed), ready for its handler."""

    found: Claim
    row: ClaimedEvent
    fast: FastClaim
    leaf: str | None
    started: float
    # The claim's span (a traceparent) when traces are on: the handler's parent.
    trace: str | None = None

    def now(self, clock: Clock) -> datetime:
        """Now on the database's clock: the claim's instant (read by the claim statement)
        plus the time elapsed since on this host's monotonic clock, which no wall-clock skew
        or step can move; or the pinned instant of a test."""
        return pinned(clock) or self.found.at + timedelta(seconds=time.monotonic() - self.started)

    def lease_left(self, clock: Clock) -> float:
        """Seconds this attempt's lease has left as :meth:`now` reads the time: ``started``
        was read before the claim statement was sent, so this is never more than the
        database's own reckoning (the fence of docs/workers.md)."""
        assert self.found.lease_until is not None  # a claim that holds a lease
        return (self.found.lease_until - self.now(clock)).total_seconds()


def held_of(found: Claim) -> Held:
    """What a watchdog names if it kills this process while ``found`` is in flight."""
    return Held(found.id, found.expires_at, found.attempt)


def claim(
    rt: Runtime,
    ids: list[int],
    reports: dict[int, Report],
    publish_retry: PublishRetry,
    *,
    isolate: bool | None = None,
) -> list[Claimed]:
    """Steps 0-2 on one pooled connection, given back before the handlers run: under gevent
    a hundred handlers wait on their downstreams at once, and holding a connection each
    through that wait would need a hundred. No ping per checkout (a round trip per message):
    a connection that died while pooled fails the first read, which changes nothing, and the
    message starts again once on a fresh connection. ``isolate``: publish alone a delivery
    whose previous holder died (a message of several; by default, when ``ids`` are several:
    the bare ids claimed together by :mod:`tasks.steps.together` are each a message alone)."""
    alone = len(ids) <= 1 if isolate is None else not isolate
    claimed: list[Claimed] = []
    for fresh in (False, True):
        try:
            with rt.engine.connect() as conn:
                raw = conn.connection.driver_connection
                assert raw is not None
                try:
                    claimed = _claim(rt, conn, raw, ids, fresh, reports, publish_retry, alone)
                except CONNECTION_ERRORS:
                    # Lost after the probe (cut mid-message): never handed back to the pool,
                    # whose reset would fail on it and log a traceback.
                    conn.invalidate()
                    raise
        except _StaleConnection:
            discard_pooled(rt.engine)  # a restart killed them all: replace every one
            log.warning("delivery.stale_connection", delivery_ids=ids)
            continue
        break
    return claimed


def _probe(
    rt: Runtime, conn: Connection, raw: psycopg.Connection[Any], ids: Sequence[int], fresh: bool
) -> dict[int, deliveries.Probed]:
    try:
        with autocommit(raw):
            return deliveries.probe(raw, ids, now=pinned(rt.clock))
    except (psycopg.OperationalError, psycopg.ProgrammingError):
        if fresh or not raw.closed:
            raise
        conn.invalidate()
        raise _StaleConnection from None


def _claim(
    rt: Runtime,
    conn: Connection,
    raw: psycopg.Connection[Any],
    ids: list[int],
    fresh: bool,
    reports: dict[int, Report],
    publish_retry: PublishRetry,
    alone: bool,
) -> list[Claimed]:
    found = _probe(rt, conn, raw, ids, fresh)
    # Isolation splits a batch; a message of one id is already alone.
    batch = not alone
    present: list[int] = []
    for delivery_id in ids:
        if delivery_id not in found:
            reports[delivery_id] = quiet(delivery_id, Outcome.MISSING)
        elif batch and found[delivery_id].lease_expired:
            reports[delivery_id] = isolate(delivery_id, publish_retry)
        else:
            present.append(delivery_id)
    fast = rt.claims.acquire_many([(i, found[i].generation) for i in present])
    by_leaf: dict[str | None, list[tuple[Wanted, FastClaim]]] = defaultdict(list)
    for delivery_id, claim in zip(present, fast, strict=True):
        probed = found[delivery_id]
        if not claim.first:
            if not probed.overdue:
                reports[delivery_id] = quiet(delivery_id, Outcome.DUPLICATE)
                continue
            # The key is held, yet Postgres shows the row claimable and past its publish
            # grace (or lease): a key left by a success whose commit was lost (failover,
            # restore) or by a worker that died. Never let it hide the row: the durable
            # claim decides.
            rt.claims.note_stale(claim, delivery_id)
        wanted = Wanted(delivery_id, probed.generation, probed.expires_at)
        leaf = deliveries.leaf_for(probed.expires_at, rt.settings.retention_mode)
        by_leaf[leaf].append((wanted, claim))
    out: list[Claimed] = []
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
                reports[wanted.id] = quiet(wanted.id, Outcome.UNCLAIMED)
    for c in out:
        if found[c.found.id].lease_expired:
            _took_over(c.found)
    return out


def _took_over(found: Claim) -> None:
    """This claim took over the lease of a worker lost holding it: whatever that worker sent
    the downstream, this attempt may send again (under the same idempotency key). Counted by
    cause and logged, so that a repeat the downstream sees has a name."""
    REPEAT_WINDOWS.labels(cause="lease_taken_over").inc()
    log.warning("delivery.lease_taken_over", delivery_id=found.id, attempt=found.attempt)


def isolate(delivery_id: int, publish_retry: PublishRetry) -> Report:
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
    return quiet(delivery_id, Outcome.ISOLATED)


def _claim_group(
    rt: Runtime,
    raw: psycopg.Connection[Any],
    leaf: str | None,
    group: list[tuple[Wanted, FastClaim]],
    reports: dict[int, Report],
) -> list[Claimed]:
    """Step 2 for the deliveries of one partition: one guarded statement."""
    claims = {wanted.id: claim for wanted, claim in group}
    started = time.monotonic()
    wanted = [w for w, _ in group]
    now, lease = pinned(rt.clock), timedelta(seconds=rt.settings.processing_ttl)
    try:
        with autocommit(raw):
            rows = deliveries.on_leaf(
                leaf,
                lambda on: deliveries.claim(
                    raw,
                    wanted,
                    now=now,
                    lease=lease,
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
    out: list[Claimed] = []
    for found, row in rows:
        claim = claims.pop(found.id)
        if found.crashed_too_often:
            reports[found.id] = _crash_looped(rt, found, row, claim)
        else:
            out.append(Claimed(found, row, claim, leaf, started))
    why = _not_claimed(rt, raw, list(claims)) if claims else {}
    for delivery_id, claim in claims.items():
        rt.claims.release(claim)
        reports[delivery_id] = why.get(delivery_id) or quiet(delivery_id, Outcome.SKIPPED)
    return _superseded(rt, raw, leaf, out, reports)


def _superseded(
    rt: Runtime,
    raw: psycopg.Connection[Any],
    leaf: str | None,
    claimed: list[Claimed],
    reports: dict[int, Report],
) -> list[Claimed]:
    """The claimed deliveries of a ``supersede`` route whose event a newer one of its lane
    has already succeeded on: moved to superseded (their handler never called), under the
    lane (models/lanes.py); the others, to run. One read per candidate, on this path only."""
    out: list[Claimed] = []
    for c in claimed:
        found, row = c.found, c.row
        if not (row.supersede and found.lane_key is not None and row.occurred_at is not None):
            out.append(c)
            continue
        with autocommit(raw):
            newer = lanes.newer_success(
                raw,
                delivery_id=found.id,
                route_id=found.route_id,
                lane_key=found.lane_key,
                occurred_at=row.occurred_at,
            )
            if newer is None:
                out.append(c)
                continue
            now = c.now(rt.clock)
            transitions.supersede(raw, found, now=now, newer_event_id=newer, leaf=leaf)
        rt.claims.release(c.fast)
        SUPERSEDED.labels(source=source_label(row), route=str(found.route_id)).inc()
        log.info(
            "delivery.superseded",
            delivery_id=found.id,
            newer_event_id=newer,
            **scope(found, row, now),
        )
        report = Report.of(
            Outcome.SUPERSEDED, found, row, f"superseded by event {newer}", finished=True
        )
        reports[found.id] = dataclasses.replace(report, lane=(found.route_id, found.lane_key))
    return out


def _not_claimed(rt: Runtime, raw: psycopg.Connection[Any], ids: list[int]) -> dict[int, Report]:
    """Why the claim took none of these: "held" (its route is paused or its breaker open:
    not an attempt, :mod:`models.breaker`), "lane" (an earlier delivery of its lane is
    unfinished: not an attempt, :mod:`models.lanes`; its admission slot is freed and its lane
    looked at again once the task ends) or "skipped" (done, dead, not due or owned). One or
    two more statements, on this path only."""
    with autocommit(raw):
        holding = held(raw, ids)
        rest = [i for i in ids if i not in holding]
        waiting = lanes.waiting(raw, rest, now=pinned(rt.clock)) if rest else {}
    out = {i: quiet(i, Outcome.HELD) for i in holding}
    for i, (route_id, key) in waiting.items():
        out[i] = dataclasses.replace(
            quiet(i, Outcome.LANE), route_id=route_id, lane=(route_id, key)
        )
    return out


def _crash_looped(rt: Runtime, found: Claim, row: ClaimedEvent, fast: FastClaim) -> Report:
    """The claim found one crash too many and made the delivery dead instead (crash loop).
    Its ledger row is one more statement, on this rare path only (the claim, every
    delivery's, does not carry one); retried through database faults like an outcome."""
    rt.claims.release(fast)
    try:
        record(
            rt.engine,
            "ledger",
            [found.id],
            lambda: on_connection(rt.engine, lambda raw: ledger.record(raw, [found.id])),
            within=rt.settings.record_retry_seconds,
        )
    except Exception as exc:  # noqa: BLE001 (the dead letter is committed; its ledger row is not)
        log.warning("ledger.unrecorded", delivery_id=found.id, error_class=type(exc).__name__)
    source = source_label(row)
    DEAD_LETTERS.labels(reason=DEAD_CRASHED, source=source).inc()
    DELIVERIES.labels(outcome=Outcome.DEAD, source=source).inc()
    log.warning(
        "delivery.dead",
        delivery_id=found.id,
        reason=DEAD_CRASHED,
        redeliveries=found.redeliveries,
        **scope(found, row, found.at),
    )
    return Report.of(
        Outcome.DEAD,
        found,
        row,
        f"{DEAD_CRASHED}: its worker died {found.redeliveries} times holding the lease",
    )

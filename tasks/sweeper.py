"""Beat's periodic tasks, on the maintenance queue. Each run is idempotent: running twice or
missing a run only changes when, never whether, work is published.

``webhooks.sweep`` picks (``requeue.due_for_publish``, SKIP LOCKED, committed before any
publish) pending deliveries never published or whose message was lost, retries that are due
but whose countdown message did not come (or that were too long for a countdown), and
processing deliveries whose lease expired (the worker died), skipping deliveries their route
holds (paused, breaker open), and one probe delivery per open route whose probe is due
(:func:`models.breaker.pick_probes`). Before the probes, in the same transaction, what an
open breaker must not keep forever (:mod:`models.route_ends`): routes open longer than
``WEBHOOKS_ROUTE_DISABLE_AFTER`` disabled (their waiting deliveries dead, ``route_disabled``),
and held deliveries past their ``max_age`` dead (``expired``). Then it publishes each id the
route's admission lets out (models/admission.py; the others wait for the dispatcher) and each
probe. A published id that turns out not to be claimable is dropped quietly by the delivery task.
Each pick counts in the row's ``republished`` (reset by a claim): from the second, a pending
row goes to Postgres' claim even while a fast-claim key says duplicate, so a stale key (a
success whose commit was lost to a restore or failover) holds it for two grace periods at
most, never for the key's days-long TTL.

``webhooks.maintenance`` runs the retention work of :mod:`models.retention`. Both use the
worker's engine, so they run on any worker that consumes the maintenance queue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, Task
from sqlalchemy import text

from core.clock import pinned
from core.horizon import utc_day
from core.logs import get_logger
from core.messages import MAINTENANCE_TASK, SWEEP_TASK, Dispatch, batches, message
from core.metrics import (
    ADMISSIONS,
    BREAKER_CHANGES,
    BREAKER_STATE,
    DEAD_LETTERS,
    FAIL_OPEN_LAST,
    LANES_BLOCKED,
    OLDEST_PENDING,
    ROUTES_DISABLED,
    SWEPT,
)
from core.states import DeadReason
from models import admission, breaker, lanes, requeue, retention, route_ends
from models.admission import Admission
from models.db import DatabaseUnavailable, session_scope
from tasks import capacity, horizon
from tasks.connections import (
    CONNECTION_ERRORS,
    discard_pooled,
    on_connection,
    periodic_done,
    periodic_failed,
    periodic_runtime,
)
from tasks.runtime import Runtime

log = get_logger(__name__)

# Age of the oldest unfinished delivery, on the database's clock.
_OLDEST_UNFINISHED = text(
    """
    SELECT extract(epoch FROM coalesce(CAST(:now AS timestamptz), now()) - min(created_at))
    FROM deliveries WHERE status IN ('pending', 'retrying', 'processing')
    """
)


def sweep_once(rt: Runtime, publish: Callable[[Sequence[Dispatch]], None]) -> list[int]:
    """One sweep: returns the delivery ids published (``publish`` sends one message)."""
    now = pinned(rt.clock)
    held = holding(rt)
    with session_scope(rt.sessions) as session:
        disabled = route_ends.disable_stale(session, now=now, after=rt.settings.route_disable_after)
        expired = route_ends.expire_held(
            session, now=now, max_age=rt.settings.max_age, limit=rt.settings.sweep_batch
        )
        picked = requeue.due_for_publish(
            session,
            now=now,
            grace=rt.settings.publish_grace,
            limit=rt.settings.sweep_batch,
            admitted=held,
        )
        probes = breaker.pick_probes(
            session,
            now=now,
            interval=rt.settings.breaker_probe_interval,
            grace=rt.settings.publish_grace,
        )
        oldest = session.execute(_OLDEST_UNFINISHED, {"now": now}).scalar_one_or_none()
        raw = session.connection().connection.driver_connection
        assert raw is not None
        blocked = lanes.blocked(raw)
    gauge_blocked(blocked)
    ended(disabled, expired)
    alone = {due.delivery_id for due in picked if due.lease_expired}
    out = admitted(rt, [Dispatch(*due[:3]) for due in picked])
    OLDEST_PENDING.set(0.0 if oldest is None else max(0.0, float(oldest)))
    # In messages of several ids, as the receiver and the dispatcher publish (a worker's cost
    # is per message, and a sweep after an outage picks hundreds); alone, a delivery whose
    # worker died holding it (tasks.steps.claim.isolate), and each breaker probe.
    groups = batches(
        [d for d in out if d.delivery_id not in alone], rt.settings.deliveries_per_message
    )
    groups += [[d] for d in out if d.delivery_id in alone] + [[d] for d in probed(probes)]
    published: list[int] = []
    for group in groups:
        ids = [d.delivery_id for d in group]
        try:
            publish(group)
        except Exception as exc:  # noqa: BLE001 (next sweep retries them after the grace)
            log.warning("sweep.publish_failed", delivery_ids=ids, error_class=type(exc).__name__)
            continue
        published += ids
    SWEPT.inc(len(published))
    if picked:
        log.info("sweep.published", count=len(published), picked=len(picked))
    return published


_BLOCKED_SEEN: set[int] = set()


def gauge_blocked(blocked: dict[int, int]) -> None:
    """``webhooks_lanes_blocked``: each route's lanes held by a dead letter (block), 0 for a
    route that had some at an earlier sweep of this process and has none now."""
    for route_id in _BLOCKED_SEEN - set(blocked):
        LANES_BLOCKED.labels(route=str(route_id)).set(0)
    for route_id, count in blocked.items():
        LANES_BLOCKED.labels(route=str(route_id)).set(count)
    _BLOCKED_SEEN.clear()
    _BLOCKED_SEEN.update(blocked)


def ended(disabled: list[route_ends.Disabled], expired: list[route_ends.Expired]) -> None:
    """Count and log what the sweep ended (committed): one ``route.disabled`` line per
    route disabled for a breaker open too long (alerted: ``WebhookRouteDisabled``), one
    ``sweep.expired`` line per sweep that sent held deliveries to the dead letters."""
    for off in disabled:
        route = str(off.route_id)
        ROUTES_DISABLED.labels(route=route).inc()
        BREAKER_STATE.labels(route=route).set(breaker.STATE_VALUES[breaker.CLOSED])
        if off.dead:
            DEAD_LETTERS.labels(reason=DeadReason.ROUTE_DISABLED, source=off.source).inc(off.dead)
        log.warning(
            "route.disabled",
            route_id=off.route_id,
            source=off.source,
            handler=off.handler,
            open_for_s=off.open_for_s,
            trips=off.trips,
            dead=off.dead,
            audit_id=off.audit_id,
            reason=off.reason,
        )
    if expired:
        for source, n in Counter(e.source for e in expired).items():
            DEAD_LETTERS.labels(reason=DeadReason.EXPIRED, source=source).inc(n)
        log.warning(
            "sweep.expired",
            count=len(expired),
            route_ids=sorted({e.route_id for e in expired}),
            sources=sorted({e.source for e in expired}),
            longest_open_s=max((e.open_for_s or 0.0) for e in expired),
        )


def holding(rt: Runtime) -> list[int]:
    """The deliveries admission holds (waiting for their route's limits, or in flight): not
    lost, so not picked. Redis failing (or flushed): none, and the pick takes every overdue
    row, as before admission: that is how a flush's waiting rows are offered again."""
    if not rt.settings.admission:
        return []
    try:
        return Admission(rt.redis).members()
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        log.warning("sweep.admission_unreadable", error_class=type(exc).__name__)
        return []


def admitted(rt: Runtime, picked: list[Dispatch]) -> list[Dispatch]:
    """The picked deliveries admission lets out now (models/admission.py); the others wait
    for the dispatcher. Redis or Postgres failing here fails open: all are published."""
    if not picked or not rt.settings.admission:
        return picked
    try:
        return on_connection(
            rt.engine,
            lambda raw: admission.offer(
                rt.redis, lambda: raw, picked, rt.settings.route_max_in_flight
            ),
        )
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        ADMISSIONS.labels("failed_open").inc(len(picked))
        FAIL_OPEN_LAST.set_to_current_time()
        log.warning("sweep.admission_failed_open", error_class=type(exc).__name__)
        return picked


def probed(probes: list[breaker.Probe]) -> list[Dispatch]:
    """The probe deliveries to publish (one per open route whose probe is due, at most one
    per probe interval: :func:`models.breaker.pick_probes`), each change logged and counted."""
    out = []
    for probe in probes:
        state = breaker.OPEN if probe.delivery_id is None else breaker.HALF_OPEN
        BREAKER_CHANGES.labels(route=str(probe.route_id), state=state).inc()
        BREAKER_STATE.labels(route=str(probe.route_id)).set(breaker.STATE_VALUES[state])
        log.info("route.breaker_probe", route_id=probe.route_id, delivery_id=probe.delivery_id)
        if probe.delivery_id is not None:
            out.append(Dispatch(probe.delivery_id, probe.event_id, probe.source))
    return out


def register(
    app: Celery, runtime: Callable[[], Runtime], deliver: Task[Any, Any]
) -> tuple[Task[Any, Any], Task[Any, Any]]:
    """The ``webhooks.sweep`` and ``webhooks.maintenance`` tasks on ``app``, with this
    process's runtime; the sweep publishes through ``deliver`` (the delivery task)."""

    @app.task(name=SWEEP_TASK, ignore_result=True, throws=(DatabaseUnavailable,))
    def sweep() -> int:
        return sweep_task(runtime, deliver)

    @app.task(name=MAINTENANCE_TASK, ignore_result=True, throws=(DatabaseUnavailable,))
    def maintenance() -> str:
        return maintenance_task(runtime)

    return sweep, maintenance


def sweep_task(runtime: Callable[[], Runtime], deliver: Task[Any, Any]) -> int:
    rt = periodic_runtime(runtime, "sweep.failed")

    def publish(group: Sequence[Dispatch]) -> None:
        args, options = message(group, rt.settings)
        deliver.apply_async(args=args, **options)

    try:
        published = len(sweep_once(rt, publish))
    except CONNECTION_ERRORS as exc:
        # Postgres restarting or unreachable: a handled condition, one line; the next sweep
        # (WEBHOOKS_SWEEP_INTERVAL) picks up where this one could not. The pool is renewed so
        # that sweep does not meet the same dead connections.
        discard_pooled(rt.engine)
        raise periodic_failed("sweep.failed", exc) from None
    periodic_done(rt, "sweep")
    return published


def maintenance_task(runtime: Callable[[], Runtime]) -> str:
    """Retention (:func:`models.retention.run_maintenance`): partitions laid out ahead,
    expired ones dropped (or a batched delete), payloads past their retention cleared. Then
    the capacity gauges (:mod:`tasks.capacity`), read even when retention failed: a failing
    drop is what the past-days gauge is there to show; and each source's measured p99 queue
    lag beside its budget (:func:`tasks.capacity.record_queue_lag`). Before all of it, the
    providers' retry windows due for review, the live processes' TTL inputs compared and the
    intake gaps' rows past every retry window removed (:mod:`tasks.horizon`)."""
    rt = periodic_runtime(runtime, "maintenance.failed")
    # The horizon, re-checked (issue 35 item 3): pure arithmetic over the provider registry,
    # on this worker's clock (a UTC day), first, so no database or Redis fault skips it.
    horizon.record(rt.settings, utc_day(rt.clock.now()))
    # Do the live receivers and workers derive the same TTLs? (Its own failure is one line.)
    horizon.record_fingerprints(rt.engine, rt.settings, pinned(rt.clock))
    # The receivers' heartbeats and error counts past every retry window (webhooks gaps).
    horizon.prune_intake_gaps(rt.engine, pinned(rt.clock))
    capacity.record_fast_tier(rt.redis)
    try:
        try:
            report = retention.run_maintenance(rt.engine, rt.settings, pinned(rt.clock))
        finally:
            capacity.record_partitions(rt.engine, rt.settings, pinned(rt.clock))
            capacity.record_queue_lag(rt.engine, rt.settings, pinned(rt.clock))
    except CONNECTION_ERRORS as exc:
        # As for the sweep: one line, and the next run (hourly) does the work.
        discard_pooled(rt.engine)
        raise periodic_failed("maintenance.failed", exc) from None
    log.info(
        "maintenance.done",
        mode=report.mode,
        partitions_created=len(report.partitions_created),
        partitions_dropped=len(report.partitions_dropped),
        rows_deleted=sum(report.rows_deleted.values()),
        payloads_dropped=report.payloads_dropped,
    )
    capacity.record_expired(rt.engine, rt.settings, report.now)
    periodic_done(rt, "maintenance")
    return "done"

"""Beat's reconciliation (issue 22): every :data:`TICK` seconds, ``webhooks.reconcile`` runs
:func:`tasks.reconcile.run.reconcile` for each source whose ``--reconcile-every`` period
has passed since its last scheduled run, on the maintenance queue.

A source is claimed by one guarded UPDATE on the database's clock (``reconciled_at`` moved to
``now()`` only if the period has passed; SKIP LOCKED), so two workers, or a beat that ran
twice, never run one source twice in a period. A run that fails is not retried before its
next period: the next run's window covers the same events (within a run, a dropped
connection is tried again: :func:`tasks.reconcile.paging.walk`). Recovered Stripe events are left
pending for the sweeper to publish (``WEBHOOKS_PUBLISH_GRACE``); events created in the last
:data:`SETTLE` are left to their webhooks, which are usually in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from sqlalchemy import text

from core.logs import get_logger
from core.messages import RECONCILE_TASK, RECONCILE_TICK
from models.db import DatabaseUnavailable
from tasks.connections import (
    CONNECTION_ERRORS,
    discard_pooled,
    periodic_done,
    periodic_failed,
    periodic_runtime,
)
from tasks.reconcile.run import ReconcileError, reconcile
from tasks.runtime import Runtime

log = get_logger("reconcile")

TICK = RECONCILE_TICK  # seconds between beat's checks; a source's period: --reconcile-every
SETTLE = timedelta(minutes=5)
MAX_SOURCES_PER_TICK = 10

CLAIM_DUE = text(
    """
UPDATE sources SET reconciled_at = now()
WHERE id = (
    SELECT id FROM sources
    WHERE reconcile_every_s IS NOT NULL AND active AND reconcile_ciphertext IS NOT NULL
      AND (reconciled_at IS NULL
           OR reconciled_at + make_interval(secs => reconcile_every_s) <= now())
    ORDER BY reconciled_at NULLS FIRST, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING public_id
"""
)


def claim_due(rt: Runtime) -> str | None:
    with rt.sessions() as session, session.begin():
        return session.execute(CLAIM_DUE).scalar()


def run_due(
    rt: Runtime,
    *,
    limit: int = MAX_SOURCES_PER_TICK,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """Reconcile each due source (at most ``limit``); returns their public ids. ``sleep``:
    the waits of a run (a 429's, a dropped connection's)."""
    done: list[str] = []
    while len(done) < limit:
        public_id = claim_due(rt)
        if public_id is None:
            break
        done.append(public_id)
        try:
            report = reconcile(
                rt.settings,
                rt.sessions,
                rt.box,
                public_id,
                since=None,
                dry_run=False,
                sleep=sleep,
                settle=SETTLE,
            )
        except ReconcileError as exc:
            log.warning("reconcile.skipped", source=public_id, reason=str(exc))
            continue
        if report.missing:
            log.warning(
                "reconcile.missing_found",
                source=public_id,
                missing=len(report.missing),
                recovered=report.recovered,
            )
    return done


def register(app: Celery, runtime: Callable[[], Runtime]) -> Task[Any, Any]:
    """The ``webhooks.reconcile`` task on ``app``, with this process's runtime."""

    @app.task(name=RECONCILE_TASK, ignore_result=True, throws=(DatabaseUnavailable,))
    def reconcile_due() -> int:
        return reconcile_task(runtime)

    return reconcile_due


def reconcile_task(runtime: Callable[[], Runtime]) -> int:
    rt = periodic_runtime(runtime, "reconcile.failed")
    try:
        ran = len(run_due(rt))
    except CONNECTION_ERRORS as exc:
        discard_pooled(rt.engine)
        raise periodic_failed("reconcile.failed", exc) from None
    periodic_done(rt, "reconcile")
    return ran

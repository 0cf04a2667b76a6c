"""Beat's watchdog (issue 38 item 1): every :data:`TICK` seconds, ``webhooks.watch`` checks
each source due (an active Stripe, GitHub, Svix or Shopify source with an API credential, not
checked within ``WEBHOOKS_WATCH_EVERY``), on the maintenance queue, then sets
``webhooks_subscription_findings`` from the findings table.

A source is claimed by one guarded UPDATE on the database's clock (``watched_at`` moved to
``now()`` only if the period has passed; SKIP LOCKED), before its provider is asked: two
workers, or a beat that ran twice, never check one source twice in a period, and a check
that failed or hung (each call is cut at ``WEBHOOKS_WATCH_TIMEOUT``) waits for its next
period, as a ``cannot_check`` finding. A tick claims no new source after :data:`BUDGET`
seconds, so hanging APIs cannot stretch it past its own period.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery import Celery, Task
from sqlalchemy import text

from core.logs import get_logger
from core.messages import WATCH_TASK, WATCH_TICK
from core.watchdog import WATCHED
from models.db import DatabaseUnavailable
from tasks.connections import (
    CONNECTION_ERRORS,
    discard_pooled,
    periodic_done,
    periodic_failed,
    periodic_runtime,
)
from tasks.runtime import Runtime
from tasks.watchdog.run import WatchError, check, refresh_gauge

log = get_logger("watchdog")

TICK = WATCH_TICK
MAX_SOURCES_PER_TICK = 20
# A tick claims no new source after this many seconds: with every API hanging, a tick lasts
# at most this plus one WEBHOOKS_WATCH_TIMEOUT, within its period (the stale-job alert reads
# two), and the sources left wait for the next tick, still due.
BUDGET = TICK / 2

CLAIM_DUE = text(
    """
UPDATE sources SET watched_at = now()
WHERE id = (
    SELECT id FROM sources
    WHERE active AND reconcile_ciphertext IS NOT NULL AND provider = ANY(:providers)
      AND (watched_at IS NULL OR watched_at + make_interval(secs => :every) <= now())
    ORDER BY watched_at NULLS FIRST, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING public_id
"""
)


def claim_due(rt: Runtime) -> str | None:
    every = rt.settings.watch_every.total_seconds()
    with rt.sessions() as session, session.begin():
        found = session.execute(CLAIM_DUE, {"every": every, "providers": list(WATCHED)})
        return found.scalar()


def run_due(rt: Runtime, *, limit: int = MAX_SOURCES_PER_TICK, budget: float = BUDGET) -> list[str]:
    """Check each due source (at most ``limit``, and no new one once ``budget`` seconds have
    passed: the rest stay due for the next tick); returns their public ids."""
    done: list[str] = []
    started = time.monotonic()
    while len(done) < limit and time.monotonic() - started < budget:
        public_id = claim_due(rt)
        if public_id is None:
            break
        done.append(public_id)
        try:
            check(rt.settings, rt.sessions, rt.box, public_id, via="beat")
        except WatchError as exc:
            log.warning("watchdog.skipped", source=public_id, reason=str(exc))
    with rt.sessions() as session:
        refresh_gauge(session)
    return done


def register(app: Celery, runtime: Callable[[], Runtime]) -> Task[Any, Any]:
    """The ``webhooks.watch`` task on ``app``, with this process's runtime."""

    @app.task(name=WATCH_TASK, ignore_result=True, throws=(DatabaseUnavailable,))
    def watch_due() -> int:
        return watch_task(runtime)

    return watch_due


def watch_task(runtime: Callable[[], Runtime]) -> int:
    rt = periodic_runtime(runtime, "watchdog.failed")
    try:
        ran = len(run_due(rt))
    except CONNECTION_ERRORS as exc:
        discard_pooled(rt.engine)
        raise periodic_failed("watchdog.failed", exc) from None
    periodic_done(rt, "watchdog")
    return ran

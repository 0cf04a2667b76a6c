"""Beat's payload shape learning (issue 38 item 3): ``webhooks.drift``, on the maintenance
queue every ``WEBHOOKS_DRIFT_EVERY``, runs :func:`models.drift.learn_due` (which claims its
period on the database's clock: a second worker or a repeated beat does nothing), then sets
the open findings' gauge. The receiver and the delivery workers pay nothing for it: they
never fingerprint; this run reads the receipts' stored bodies afterwards, a sample of them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from celery import Celery, Task

from core import metrics
from core.logs import get_logger
from core.messages import DRIFT_TASK
from core.settings import Settings
from models import drift, pg
from models.db import DatabaseUnavailable
from tasks.connections import CONNECTION_ERRORS, periodic_done, periodic_failed, periodic_runtime
from tasks.runtime import Runtime

log = get_logger("drift")

# A period claimed by a run ends a little before beat's next tick, so that a tick that comes
# early by a few seconds is not skipped.
CLAIM_SLACK = 0.9


def learn(settings: Settings, *, every: timedelta | None = None) -> drift.LearnReport:
    """One learning run (if its period has passed) and the gauge of open findings."""
    period = settings.drift_every * CLAIM_SLACK if every is None else every
    with pg.connect(settings) as conn:
        report = drift.learn_due(
            conn,
            every=period,
            sample=settings.drift_sample,
            absent=timedelta(days=settings.drift_absent_days),
        )
        for (source, kind), n in drift.open_counts(conn).items():
            metrics.DRIFT_FINDINGS.labels(source, kind).set(n)
    if report.claimed:
        log.info(
            "drift.learned",
            read=report.read,
            shapes=report.shapes,
            not_json=report.not_json,
            cut_paths=report.cut_paths,
            opened=len(report.opened),
            through_receipt_id=report.through_receipt_id,
        )
        for source_id, event_type, path, kind in report.opened:
            # A path names keys, never values; still no payload here.
            log.warning(
                "drift.finding", source_id=source_id, event_type=event_type, path=path, kind=kind
            )
    return report


def register(app: Celery, runtime: Callable[[], Runtime]) -> Task[Any, Any]:
    """The ``webhooks.drift`` task on ``app``, with this process's runtime."""

    @app.task(name=DRIFT_TASK, ignore_result=True, throws=(DatabaseUnavailable,))
    def learn_drift() -> int:
        return drift_task(runtime)

    return learn_drift


def drift_task(runtime: Callable[[], Runtime]) -> int:
    rt = periodic_runtime(runtime, "drift.failed")
    try:
        report = learn(rt.settings)
    except CONNECTION_ERRORS as exc:
        raise periodic_failed("drift.failed", exc) from None
    periodic_done(rt, "drift")
    return report.read

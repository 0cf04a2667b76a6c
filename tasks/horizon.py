"""Maintenance's half of the horizon check (issue 35 item 3).

:func:`record` (:mod:`core.horizon`): each run sets, for every registered provider, how many
days ago its retry window was last verified against its cited page and whether that makes it
due for review under ``WEBHOOKS_HORIZON_REVIEW_AFTER``; deploy/alerts.yml's
WebhookProviderWindowReviewDue fires on the second. Pure arithmetic over the registry this
process already loaded: no I/O, a few microseconds a provider, and nothing that can fail on
Postgres or Redis.

:func:`record_fingerprints` (:mod:`core.ttl_fingerprint`): the live receivers' and workers'
recorded TTL inputs compared over every source, dead processes' rows removed first; one
warning line and the gauge WebhookTtlFingerprintsDisagree reads when they derive different
TTLs for a source. Two short statements and a read of the (few) sources."""

from __future__ import annotations

import math
from datetime import date, datetime

import psycopg
import sqlalchemy.exc
from sqlalchemy import Engine

from core import metrics
from core.horizon import WindowReview, review
from core.logs import get_logger
from core.providers import registry
from core.settings import Settings
from models import intake_gaps, ttl_fingerprints

log = get_logger(__name__)


def record(settings: Settings, today: date) -> tuple[WindowReview, ...]:
    """Every provider's review as of ``today`` (the worker's clock, a UTC day), as the gauges
    ``webhooks_provider_window_verified_age_days`` (+Inf: never verified) and
    ``webhooks_provider_window_review_due`` (0 or 1); one info line naming those due."""
    reviews = review(registry.providers().values(), today, settings.horizon_review_after)
    for r in reviews:
        age = math.inf if r.age_days is None else float(r.age_days)
        metrics.PROVIDER_WINDOW_AGE.labels(r.provider).set(age)
        metrics.PROVIDER_WINDOW_DUE.labels(r.provider).set(1.0 if r.due else 0.0)
    due = [r.provider for r in reviews if r.due]
    if due:
        log.info(
            "horizon.review_due",
            providers=due,
            review_after_days=settings.horizon_review_after.days,
            hint="webhooks ttl check",
        )
    return reviews


def prune_intake_gaps(engine: Engine, now: datetime | None) -> int | None:
    """Remove the receivers' heartbeat segments and error counts older than the longest
    retry window of the sources' providers plus a day (:func:`models.intake_gaps.prune`);
    None (and a warning) when the database could not be written."""
    try:
        with engine.begin() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            pruned = intake_gaps.prune(raw, now)
    except (sqlalchemy.exc.SQLAlchemyError, psycopg.Error) as exc:
        log.warning("intake.gaps_unpruned", error_class=type(exc).__name__)
        return None
    if pruned:
        log.info("intake.gaps_pruned", rows=pruned)
    return pruned


def record_fingerprints(
    engine: Engine, settings: Settings, now: datetime | None
) -> ttl_fingerprints.FingerprintCheck | None:
    """Remove the rows of processes not seen for ``WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER``,
    compare the live ones, and set ``webhooks_ttl_fingerprint_disagreements`` (sources they
    disagree on), ``webhooks_ttl_fingerprint_processes`` and when (``..._checked_timestamp_
    seconds``: the alert reads the latest worker's reading); one warning line naming the
    sources, the terms that differ and the processes, when they disagree. None (and a
    warning) when the database could not be read: the gauges keep their last values."""
    try:
        with engine.begin() as conn:
            found = ttl_fingerprints.check(conn, settings, now, prune=True)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        log.warning("ttl.fingerprints_unchecked", error_class=type(exc).__name__)
        return None
    metrics.TTL_FINGERPRINT_DISAGREEMENTS.set(len(found.disagreements))
    metrics.TTL_FINGERPRINT_PROCESSES.set(len(found.processes))
    metrics.TTL_FINGERPRINT_CHECKED.set(found.at.timestamp())
    if found.unreadable:
        log.warning(
            "ttl.fingerprints_unreadable",
            processes=[f"{h}:{p}:{r}" for h, p, r in found.unreadable],
            hint="a process of another version: compare its settings by hand",
        )
    if found.disagreements:
        differing = sorted({name for d in found.disagreements for name in d.differing})
        log.warning(
            "ttl.fingerprints_disagree",
            sources=[d.source.public_id for d in found.disagreements],
            differing=differing,
            processes=ttl_fingerprints.keys(found.processes),
            hint="webhooks ttl check",
        )
    return found

"""Maintenance's half of the horizon check (issue 35 item 3; :mod:`core.horizon`): each run
sets, for every registered provider, how many days ago its retry window was last verified
against its cited page and whether that makes it due for review under
``WEBHOOKS_HORIZON_REVIEW_AFTER``; deploy/alerts.yml's WebhookProviderWindowReviewDue fires on
the second. Pure arithmetic over the registry this process already loaded: no I/O, a few
microseconds a provider, and nothing that can fail on Postgres or Redis."""

from __future__ import annotations

import math
from datetime import date

from core import metrics
from core.horizon import WindowReview, review
from core.logs import get_logger
from core.providers import registry
from core.settings import Settings

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

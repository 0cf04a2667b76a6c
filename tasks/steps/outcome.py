"""What the task did with one delivery (its :class:`Outcome` and :class:`Report`), and how it
publishes a delivery's next copy (:data:`PublishRetry`)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from core.logs import get_logger
from core.messages import Dispatch
from core.metrics import DELIVERIES
from models.transitions import Claim, ClaimedEvent

log = get_logger(__name__)

# Publishes the delivery again after ``countdown`` seconds.
PublishRetry = Callable[[Dispatch, float], None]


class Outcome(enum.StrEnum):
    """A delivery's outcome in one message: the value is what logs, the ``outcome`` label of
    ``webhooks_deliveries_total`` and the task's Celery state (Flower) show."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"
    DEAD = "dead"
    DUPLICATE = "duplicate"  # the fast tier: another copy holds or completed it
    SKIPPED = "skipped"  # the durable tier: done, dead, not due or owned by a live lease
    HELD = "held"  # its route is paused or its breaker open: no attempt
    MISSING = "missing"  # no such delivery
    LOST = "lost"  # our lease ran out and another attempt took over
    ISOLATED = "isolated"  # its worker died holding it: published again alone
    UNCLAIMED = "unclaimed"  # its partition's claim failed on a lost connection
    UNRECORDED = "unrecorded"  # the database stayed away past WEBHOOKS_RECORD_RETRY_SECONDS
    FENCED = "fenced"  # its lease could not outlive a call: no call made, the lease handed back
    FILTERED = "filtered"  # its route's transform dropped the event: no handler call
    LANE = "lane"  # an earlier delivery of its lane is unfinished: no attempt (models/lanes.py)
    SUPERSEDED = "superseded"  # a newer event of its lane had succeeded: handler not called


@dataclass(frozen=True)
class Report:
    """What the task did with one delivery, for the task's Celery state (what Flower
    shows) and the tests: the outcome, and for a claimed delivery its attempt, event, source
    and the reason of a retry or death (payload-free, as stored)."""

    outcome: Outcome
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
    # Its lane (route id, lane key) when it has one (models/lanes.py): the task publishes the
    # lane's next head once this one ended, or once this one was refused by its lane.
    lane: tuple[int, str] | None = None

    @classmethod
    def of(
        cls,
        outcome: Outcome,
        found: Claim,
        row: ClaimedEvent,
        detail: str | None = None,
        *,
        countdown: float | None = None,
        finished: bool = False,
    ) -> Report:
        """The report of a claimed delivery; ``finished``: an attempt that ended here
        (succeeded, retry, dead), whose route's admission slot is to be freed."""
        return cls(
            outcome,
            found.id,
            found.attempt,
            row.event_id,
            row.public_id,
            detail,
            countdown,
            found.route_id if finished else None,
        )


def source_label(row: ClaimedEvent) -> str:
    """The ``source`` label of a claimed delivery's counters: its source's public id, read by
    the claim statement (no statement of its own); "" if its source row is gone."""
    return row.public_id or ""


def scope(found: Claim, row: ClaimedEvent, at: datetime) -> dict[str, Any]:
    """What a transition's log line says of where the delivery belongs and how old its event
    is (seed 004: attempt, age, scope, transition): the source's public id, the route, and the
    seconds since the event was received (the database's clock), never a payload."""
    age = None if row.received_at is None else round((at - row.received_at).total_seconds(), 3)
    return {"source": row.public_id, "route_id": found.route_id, "event_age_s": age}


def quiet(delivery_id: int, outcome: Outcome) -> Report:
    """A delivery this message did not attempt: counted (``source=""``: its message carries
    its id alone, and its source is not read for a count) and logged, nothing else."""
    DELIVERIES.labels(outcome=outcome, source="").inc()
    log.info("delivery.not_claimed", delivery_id=delivery_id, outcome=outcome)
    return Report(outcome, delivery_id)

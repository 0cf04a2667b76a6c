"""The closed sets of state strings the project stores and compares, as enums.

``StrEnum`` members are ``str``: a member is its value in SQL parameters, JSON, log lines and
CLI output (``f"{DeliveryStatus.DEAD}" == "dead"``), and a status read back from the database
(a plain ``str``) compares equal to its member. The SQL statements name the same strings
literally (guards, partial indexes); ``models.schema`` checks the column against these.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class DeliveryStatus(StrEnum):
    """Where one (event, route) unit of work stands (the state diagram: models.transitions)."""

    PENDING = "pending"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    RETRYING = "retrying"
    DEAD = "dead"
    DISCARDED = "discarded"
    # Final at the accept: the route's filter did not match the event (core.filters); no
    # work was made for it, ``last_error`` says why. Replayed only when chosen by its id.
    # Also final on the worker when the route's transform dropped it (tasks.transforms).
    FILTERED = "filtered"
    # Final at its claim (a route with --supersede, models/lanes.py): a newer event of its
    # lane key had already succeeded on the route; its handler was not called, ``last_error``
    # names the newer event. Replayed only when chosen by its id.
    SUPERSEDED = "superseded"


#: Work not finished yet: it holds its receipt and keeps a route from being removed.
UNFINISHED = (DeliveryStatus.PENDING, DeliveryStatus.RETRYING, DeliveryStatus.PROCESSING)
#: What a replay moves: dead letters back to pending, succeeded ones re-run.
REPLAYABLE = (DeliveryStatus.DEAD, DeliveryStatus.SUCCEEDED)
#: ``last_error_class`` of a retrying delivery a quarantined route holds for drift
#: (models/drift.py, docs/drift.md). Replayed only when chosen by its id.
DRIFT_HELD = "DriftHeld"
#: ``last_error_class`` a replay of a held delivery leaves: the attempts it makes until it
#: fails or succeeds are not held for drift again (tasks/steps/run.py check_drift).
DRIFT_REPLAYED = "DriftReplayed"


class AttemptOutcome(StrEnum):
    """How one attempt ended (``attempts.outcome``; None while it runs)."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"
    DEAD = "dead"
    CRASHED = "crashed"
    FILTERED = "filtered"  # the route's transform dropped the event (tasks.transforms)
    SUPERSEDED = "superseded"  # not run: a newer event of its lane had succeeded


class BreakerState(StrEnum):
    """A route's circuit breaker (``routes.breaker_state``; models.breaker decides)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class DeadReason(StrEnum):
    """Why a delivery went dead (``deliveries.dead_reason``)."""

    PERMANENT = "permanent"  # a permanent error (a 4xx, a refused address, a route disabled)
    MAX_ATTEMPTS = "max_attempts"  # its retry budget spent
    MAX_AGE = "max_age"  # a failed attempt after its max_age had passed
    CRASHED = "crashed"  # its worker died holding it WEBHOOKS_MAX_REDELIVERIES times
    # Its max_age passed while its route's breaker was open (held, or a failed probe): an
    # open breaker never keeps a delivery alive past its max_age (models/route_ends.py).
    EXPIRED = "expired"
    # Waiting when its route was disabled for a breaker open past WEBHOOKS_ROUTE_DISABLE_AFTER.
    ROUTE_DISABLED = "route_disabled"
    # The route's transform raised, overran its limit or returned nonsense (tasks.transforms).
    TRANSFORM_FAILED = "transform_failed"


class ReplayStatus(StrEnum):
    """How a bulk replay's run stands (``replays.status``)."""

    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    FAILED = "failed"


#: A receipt's work in the order its answer names it: unfinished work first (the sender's
#: event is still being handled), then how finished work ended.
_OUTCOME_ORDER = (
    DeliveryStatus.PROCESSING,
    DeliveryStatus.RETRYING,
    DeliveryStatus.PENDING,
    DeliveryStatus.DEAD,
    DeliveryStatus.SUCCEEDED,
    DeliveryStatus.DISCARDED,
    DeliveryStatus.FILTERED,
)
#: The outcome of a receipt no route matched: recorded, nothing to deliver.
NO_ROUTES = "no_routes"


def receipt_outcome(counts: Mapping[str, int]) -> str:
    """One word for where a receipt's deliveries stand, from their statuses counted: the
    first of processing, retrying, pending (still in flight), dead, succeeded, discarded,
    filtered that any of them holds, or ``no_routes`` when it has none (pure)."""
    for status in _OUTCOME_ORDER:
        if counts.get(status, 0) > 0:
            return status.value
    return NO_ROUTES

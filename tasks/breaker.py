"""The worker's side of the route circuit breaker (:mod:`models.breaker`): count a finished
attempt, and log and count every state change.

Counting never fails an attempt: the attempt's own outcome is committed first, and a breaker
statement that fails (the database went away) is logged and skipped; the breaker then learns
from the next attempt.
"""

from __future__ import annotations

from core.clock import pinned
from core.logs import get_logger
from core.metrics import BREAKER_CHANGES, BREAKER_STATE
from models import breaker
from models.breaker import BreakerChange, Thresholds
from models.transitions import Claim, ClaimedEvent
from tasks.durable import on_connection
from tasks.errors import DownstreamError
from tasks.runtime import Runtime

log = get_logger(__name__)


def note_change(change: BreakerChange | None, *, via: str) -> None:
    """One structured line (``route.breaker_opened`` / ``_closed``), the change counter and
    the state gauge, for a change that changed something."""
    if change is None or not change.changed:
        return
    route = str(change.route_id)
    BREAKER_CHANGES.labels(route=route, state=change.after).inc()
    BREAKER_STATE.labels(route=route).set(breaker.STATE_VALUES[change.after])
    event = "route.breaker_opened" if change.after == breaker.OPEN else "route.breaker_closed"
    log.warning(
        event,
        route_id=change.route_id,
        before=change.before,
        after=change.after,
        trips=change.trips,
        via=via,
    )


def after_success(rt: Runtime, found: Claim, row: ClaimedEvent) -> None:
    """A committed success: closes a half-open route, counts a request in an open failure
    window; nothing at all on a healthy route."""
    if row.breaker_state == breaker.CLOSED and not row.window_failures:
        return
    try:
        change = on_connection(
            rt.engine,
            lambda raw: breaker.record_success(
                raw,
                found.route_id,
                Thresholds.of(rt.settings),
                state=row.breaker_state,
                window_failures=row.window_failures,
                now=pinned(rt.clock),
            ),
        )
    except Exception as exc:  # noqa: BLE001 (the success is committed; see the docstring)
        log.warning(
            "route.breaker_not_counted", route_id=found.route_id, error_class=type(exc).__name__
        )
        return
    note_change(change, via="success")


def after_failure(rt: Runtime, found: Claim, exc: BaseException) -> None:
    """A committed failed attempt: a downstream failure counts; anything else (a permanent
    4xx, a handler's own error) never does."""
    if not isinstance(exc, DownstreamError):
        return
    try:
        change = on_connection(
            rt.engine,
            lambda raw: breaker.record_failure(
                raw, found.route_id, Thresholds.of(rt.settings), now=pinned(rt.clock)
            ),
        )
    except Exception as err:  # noqa: BLE001 (the failure is committed; see the docstring)
        log.warning(
            "route.breaker_not_counted", route_id=found.route_id, error_class=type(err).__name__
        )
        return
    note_change(change, via="failure")

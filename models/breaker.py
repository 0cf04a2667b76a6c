"""A circuit breaker per route, and pausing a route by hand: deliveries held, not attempted.

    closed --(failures >= ratio x requests, requests >= min, in the window)--> open
    closed --(a streak: every request failed, >= streak of them, over >= streak_span)--> open
    open --(probe due: the sweeper picks the waiting delivery touched longest ago)--> half_open
    half_open --(a success)--> closed        half_open --(a downstream failure)--> open

State lives on the route (migration 0010), in Postgres, so every worker and sweeper on every
host reads one state, in statements they already run:

- *The gate* is in the worker's guarded claim (:mod:`models.transitions`, ``_GATE``): a
  delivery of a paused route, or of a route whose breaker is open (or half-open, unless it is
  the probe), is simply not claimed: no attempt row, ``attempts`` unchanged, no backoff. So
  waiting on an open breaker or a pause never spends the retry budget (``max_attempts``
  counts attempts made while closed or half-open). The sweeper skips held deliveries, so a
  held backlog is not republished every sweep; it publishes them again once the route is
  resumed or its breaker closes (their ``next_attempt_at`` is already past).
- *Counting*: a downstream failure (:class:`tasks.errors.DownstreamError`: 5xx, timeout,
  connection error; never a permanent 4xx) runs :func:`record_failure`, one guarded UPDATE.
  The failure window starts at the route's first counted failure and lasts
  ``breaker_window``; successes count as requests only while such a window is open (the
  claim returns ``window_failures``), so a healthy route pays nothing for the breaker. This
  is an approximation: successes before the first failure are not in the window, so the
  ratio is "failures among the requests since the first failure".
- *A quiet route's outage* never reaches ``min_requests`` in a window: one delivery alone
  makes six or seven attempts in five minutes, then waits longer than the window between
  them, and would spend its whole ``max_attempts`` on the outage. So a window in which every
  request failed does not expire until a success is counted in it, and such a *streak* opens
  the breaker once it holds ``breaker_streak`` failures spanning at least
  ``breaker_streak_span``. The span keeps a busy route from tripping on a burst of
  failures among claims made before its window opened (their successes are not counted):
  within a minute of a failure, a route with any working delivery counts a success.
- *Probing*: :func:`pick_probes` (each sweep) moves every open or half-open route whose
  ``breaker_probe_at`` has passed to half_open, names the probe and pushes
  ``breaker_probe_at`` one ``breaker_probe_interval`` ahead: at most one call per interval
  reaches the failing downstream. The probe is the waiting delivery touched longest ago
  (``updated_at``: at first the oldest; a failed probe goes to the back), so the probes take
  the backlog in turn and one delivery the downstream always refuses (a poison payload)
  cannot keep a route shut while others would succeed: a failed probe is not an attempt,
  so always probing the same one would hold the route for its whole max_age. A success on
  a half-open route closes it; a failure reopens it (``breaker_trips`` + 1).
- *Ending*: an open breaker never keeps a delivery alive past its ``max_age`` (counted from
  its first attempt, through the open time: a failed probe ages like any attempt), and a
  route whose breaker stays open past ``WEBHOOKS_ROUTE_DISABLE_AFTER`` is disabled
  (:mod:`models.route_ends`, each sweep). Only an operator's pause holds deliveries whatever
  their age; its resume (``released_at``) is where their age counts from at the earliest.

Times are the database's clock (``now()`` in the statements), or a test's pinned instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.states import BreakerState
from models.catalog import CatalogError, Change, Changed, record_audit
from models.route_catalog import get_route, route_target
from models.schema import Route, Source
from models.statements import placeholders, sql_text
from models.views import (
    RouteState,
    limits_view,
    state_of,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "RouteState",
    "limits_view",
    "state_of",
]


CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
# The gauge's value per state (webhooks_route_breaker_state).
STATE_VALUES: dict[str, int] = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(frozen=True)
class BreakerChange:
    """What a breaker statement did to a route's state."""

    route_id: int
    before: str
    after: str
    trips: int

    @property
    def changed(self) -> bool:
        return self.before != self.after


# One downstream failure: opens (or extends) the route's window and counts it; opens the
# breaker on a closed route past the ratio, reopens a half-open one. The window is read
# FOR UPDATE so concurrent failures each count.
_FAILURE_SQL = placeholders(
    """
    WITH old AS (
        SELECT id, breaker_state AS before,
               (window_started_at IS NULL
                OR (window_started_at <= :now - :window
                    AND window_requests > window_failures)) AS fresh,
               window_started_at, window_requests, window_failures
        FROM routes WHERE id = :route FOR UPDATE
    ), counted AS (
        SELECT id, before,
               CASE WHEN fresh THEN :now ELSE window_started_at END AS started,
               CASE WHEN fresh THEN 1 ELSE window_requests + 1 END AS requests,
               CASE WHEN fresh THEN 1 ELSE window_failures + 1 END AS failures
        FROM old
    ), next AS (
        SELECT id, before, started, requests, failures,
               CASE WHEN before = 'half_open' THEN 'open'
                    WHEN before = 'closed' AND requests >= :min_requests
                         AND failures >= CAST(:ratio AS double precision) * requests
                    THEN 'open'
                    WHEN before = 'closed' AND failures = requests AND failures >= :streak
                         AND started <= :now - :streak_span
                    THEN 'open'
                    ELSE before END AS after
        FROM counted
    )
    UPDATE routes r SET
        breaker_state = next.after,
        window_started_at = CASE WHEN next.after = 'closed' THEN next.started END,
        window_requests = CASE WHEN next.after = 'closed' THEN next.requests ELSE 0 END,
        window_failures = CASE WHEN next.after = 'closed' THEN next.failures ELSE 0 END,
        breaker_opened_at = CASE WHEN next.before = 'closed' AND next.after = 'open'
                                 THEN :now ELSE r.breaker_opened_at END,
        breaker_probe_at = CASE WHEN next.before <> 'open' AND next.after = 'open'
                                THEN :now + :interval ELSE r.breaker_probe_at END,
        probe_delivery = CASE WHEN next.after = 'open' THEN NULL ELSE r.probe_delivery END,
        breaker_trips = r.breaker_trips
            + CASE WHEN next.before <> 'open' AND next.after = 'open' THEN 1 ELSE 0 END
    FROM next WHERE r.id = next.id
    RETURNING r.id, next.before, next.after, r.breaker_trips
    """
)

# A success on a half-open route (the probe, or any success while half-open): closed.
_CLOSE_SQL = placeholders(
    """
    UPDATE routes SET breaker_state = 'closed', breaker_probe_at = NULL, probe_delivery = NULL,
        window_started_at = NULL, window_requests = 0, window_failures = 0
    WHERE id = :route AND breaker_state = 'half_open'
    RETURNING id, 'half_open', 'closed', breaker_trips
    """
)

# A success on a closed route whose failure window is open (within its time, or a streak of
# failures, which a success ends): one more request in it.
_COUNT_SUCCESS_SQL = placeholders(
    """
    UPDATE routes SET window_requests = window_requests + 1
    WHERE id = :route AND breaker_state = 'closed' AND window_started_at IS NOT NULL
      AND (window_started_at > :now - :window OR window_requests = window_failures)
    """
)


@dataclass(frozen=True)
class Thresholds:
    """The breaker's settings (``WEBHOOKS_BREAKER_*``)."""

    window: timedelta
    min_requests: int
    ratio: float
    probe_interval: timedelta
    streak: int
    streak_span: timedelta

    @classmethod
    def of(cls, settings: Any) -> Thresholds:
        return cls(
            settings.breaker_window,
            settings.breaker_min_requests,
            settings.breaker_failure_ratio,
            settings.breaker_probe_interval,
            settings.breaker_streak,
            settings.breaker_streak_span,
        )


def record_failure(
    conn: psycopg.Connection[Any], route_id: int, limits: Thresholds, *, now: datetime | None
) -> BreakerChange | None:
    """Count one downstream failure of the route (autocommit: one round trip). None when
    the route is gone."""
    row = conn.execute(
        _FAILURE_SQL,
        {
            "route": route_id,
            "now": now,
            "window": limits.window,
            "min_requests": limits.min_requests,
            "ratio": limits.ratio,
            "interval": limits.probe_interval,
            "streak": limits.streak,
            "streak_span": limits.streak_span,
        },
    ).fetchone()
    return None if row is None else BreakerChange(int(row[0]), row[1], row[2], int(row[3]))


def record_success(
    conn: psycopg.Connection[Any],
    route_id: int,
    limits: Thresholds,
    *,
    state: str | None,
    window_failures: int | None,
    now: datetime | None,
) -> BreakerChange | None:
    """A success, as the claim saw the route: a half-open route closes; a closed one with an
    open failure window counts a request; a healthy route costs nothing (no statement)."""
    if state == HALF_OPEN:
        row = conn.execute(_CLOSE_SQL, {"route": route_id, "now": now}).fetchone()
        return None if row is None else BreakerChange(int(row[0]), row[1], row[2], int(row[3]))
    if state == CLOSED and window_failures:
        conn.execute(_COUNT_SUCCESS_SQL, {"route": route_id, "now": now, "window": limits.window})
    return None


@dataclass(frozen=True)
class Probe:
    """A route moved to half_open by the sweeper, and the delivery that probes it (None: the
    route has nothing waiting; it stays open and is looked at again one interval later)."""

    route_id: int
    delivery_id: int | None
    event_id: str | None
    source: str | None


_PROBES = """
    WITH due AS (
        SELECT id FROM routes
        WHERE breaker_state IN ('open', 'half_open') AND paused_at IS NULL
          AND breaker_probe_at <= :now
        ORDER BY id
        FOR UPDATE SKIP LOCKED
    ), pick AS (
        SELECT DISTINCT ON (d.route_id) d.route_id, d.id, d.expires_at
        FROM deliveries d JOIN due ON d.route_id = due.id
        WHERE d.status IN ('pending', 'retrying')
        ORDER BY d.route_id, d.updated_at, d.id
    ), moved AS (
        UPDATE routes r SET
            breaker_state = CASE WHEN pick.id IS NULL THEN 'open' ELSE 'half_open' END,
            probe_delivery = pick.id,
            breaker_probe_at = :now + :interval
        FROM due LEFT JOIN pick ON pick.route_id = due.id
        WHERE r.id = due.id
        RETURNING r.id AS route_id, pick.id AS delivery_id, pick.expires_at
    ), freed AS (
        -- the probe is claimable now, whatever its backoff said: waiting is not an attempt
        UPDATE deliveries d SET status = 'pending', next_attempt_at = :now + :grace,
            updated_at = :now
        FROM moved WHERE d.id = moved.delivery_id AND d.expires_at = moved.expires_at
          AND d.status IN ('pending', 'retrying')
        RETURNING d.id, d.receipt_id, d.expires_at, d.source_id
    )
    SELECT m.route_id, f.id, r.event_id, s.public_id FROM moved m
    LEFT JOIN freed f ON f.id = m.delivery_id
    LEFT JOIN receipts r ON r.id = f.receipt_id AND r.expires_at = f.expires_at
    LEFT JOIN sources s ON s.id = f.source_id
    ORDER BY m.route_id
    """


def pick_probes(
    session: Session, *, now: datetime | None, interval: timedelta, grace: timedelta
) -> list[Probe]:
    """The sweeper's probes (SKIP LOCKED: two sweepers never probe one route twice); the
    caller publishes each probe delivery after committing."""
    rows = session.execute(
        sql_text(_PROBES), {"now": now, "interval": interval, "grace": grace}
    ).all()
    return [Probe(int(r[0]), None if r[1] is None else int(r[1]), r[2], r[3]) for r in rows]


_HELD = """
    SELECT d.id FROM deliveries d JOIN routes g ON g.id = d.route_id
    WHERE d.id = ANY(%(ids)s::bigint[])
      AND d.status IN ('pending', 'retrying', 'processing')
      AND (g.paused_at IS NOT NULL
           OR (g.breaker_state <> 'closed' AND g.probe_delivery IS DISTINCT FROM d.id))
"""


def held(conn: psycopg.Connection[Any], ids: list[int]) -> set[int]:
    """Which of these deliveries (that the claim did not take) their route holds: asked only
    on the not-claimed path, to tell "held" from "skipped"."""
    return {int(r[0]) for r in conn.execute(_HELD, {"ids": ids}).fetchall()}


def route_state(session: Session, route_id: int) -> RouteState:
    """Raises CatalogError for an unknown route."""
    session.expire_all()
    return state_of(get_route(session, route_id))


def set_paused(
    session: Session, route_id: int, paused: bool, change: Change, *, now: datetime | None
) -> Changed:
    """Pause a route (its deliveries are held, not attempted, new events still accepted and
    stored) or resume it (its held deliveries become eligible again: the sweeper publishes
    them). Refuses a route that is already so; one audit row (``route.pause`` /
    ``route.resume``) in the caller's transaction."""
    change.check()
    route = get_route(session, route_id)
    when: Any = now if now is not None else _db_now(session)
    values: dict[str, Any] = (
        {"paused_at": when, "pause_reason": change.reason.strip()}
        if paused
        else {"paused_at": None, "pause_reason": None, "released_at": when}
    )
    guard = Route.paused_at.is_(None) if paused else Route.paused_at.is_not(None)
    moved = session.execute(
        update(Route).where(Route.id == route_id, guard).values(**values).returning(Route.id)
    ).first()
    if moved is None:
        raise CatalogError(f"route {route_id} is {'already paused' if paused else 'not paused'}")
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = route_target(route, source)
    action = "route.pause" if paused else "route.resume"
    audit_id = record_audit(session, change, action, target, count=1, now=now)
    held_now = session.execute(
        sql_text(
            "SELECT count(*) FROM deliveries WHERE route_id = :route"
            " AND status IN ('pending', 'retrying', 'processing')"
        ),
        {"route": route_id},
    ).scalar_one()
    return Changed(audit_id, target, int(held_now))


def _db_now(session: Session) -> datetime:
    value: datetime = session.execute(sql_text("SELECT now()")).scalar_one()
    return value


_UNSET: Any = object()


def set_limits(
    session: Session,
    route_id: int,
    change: Change,
    *,
    max_in_flight: Any = _UNSET,
    rate: Any = _UNSET,
    now: datetime | None,
) -> Changed:
    """Set a route's admission limits (models/admission.py): ``max_in_flight`` a count or
    None (the default budget), ``rate`` an :class:`models.admission.Rate` or None (no rate
    limit); one left out is kept. One audit row (``route.limits``) with the old and new
    values, in the caller's transaction; admission reads the new ones at its next batch."""
    change.check()
    if max_in_flight is _UNSET and rate is _UNSET:
        raise CatalogError("nothing to change: give --rate-limit and/or --max-in-flight")
    route = get_route(session, route_id)
    before = limits_view(route)
    if max_in_flight is not _UNSET:
        route.max_in_flight = max_in_flight
    if rate is not _UNSET:
        route.rate_count = None if rate is None else rate.count
        route.rate_period_s = None if rate is None else rate.period_s
    session.flush()
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = {**route_target(route, source), "before": before, "after": limits_view(route)}
    audit_id = record_audit(session, change, "route.limits", target, count=1, now=now)
    return Changed(audit_id, target, 0)

"""Every route and delivery ends (issue 34 item 3): what the sweep does about an open breaker
that does not close.

A delivery's ``max_age`` bounds its life whatever the breaker does. While its route's
breaker is open (or half-open), the delivery is held, not claimed (:mod:`models.breaker`), so
no failed attempt ever asks the retry policy about its age; :func:`expire_held` does, each
sweep, for each route whose probe is due (so once per ``WEBHOOKS_BREAKER_PROBE_INTERVAL`` a
route, as :func:`models.breaker.pick_probes` reads its backlog, not every sweep): a pending
or retrying delivery of a route whose breaker is not closed, past its ``max_age``, goes
dead with reason ``expired``, and its ``last_error`` says how long the route had been
open. (A failed probe past ``max_age`` goes dead the same way in the worker:
:func:`tasks.steps.record.fail`.) The age counts from the delivery's first attempt, else its
creation; a replayed delivery not attempted since is not aged until it is (as the worker
counts it). A route *paused by an operator* keeps its deliveries whatever their age (the
sweep skips it), and its resume (``routes.released_at``) is the earliest its deliveries' age
counts from: a pause is a decision a person made and undoes; an open breaker is not.

A route whose breaker has stayed open longer than ``WEBHOOKS_ROUTE_DISABLE_AFTER`` (5 days:
Svix's figure), counted from its opening or from its resume by hand if later, is disabled by
:func:`disable_stale`: ``active`` false with ``disabled_at`` / ``disabled_reason`` (migration
0022), its breaker reset to closed (it holds nothing while disabled; enabled again it starts
afresh), one ``route.disable`` audit row by ``sweeper``, and its pending and retrying
deliveries dead with reason ``route_disabled``: replayable once an operator has fixed the
downstream and run ``webhooks routes enable``. A paused route is never disabled this way.

Every statement is guarded (the states it leaves are in its WHERE, re-checked under the row
lock) and decides on the database's clock (``:now``), or a test's pinned instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from core.durations import format_duration
from core.states import DeadReason
from models import ledger
from models.catalog import Change, record_audit
from models.statements import sql_text

# What the dead letter says of its route's breaker: how long it had been open, since when.
_OPEN_FOR = """coalesce(' the breaker had been open for '
                || floor(extract(epoch FROM :now - {opened}))::bigint || ' s (since '
                || to_char({opened} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
                || ')', '')"""

# The age start of a waiting delivery: its first attempt, else its creation when it never
# made one; NULL for a replayed delivery not attempted since (not aged until it is). Never
# before its route's last resume by hand.
_AGE_START = """CASE WHEN d.first_attempt_at IS NOT NULL OR d.attempts = 0
                 THEN greatest(coalesce(d.first_attempt_at, d.created_at), g.released_at) END"""

# A dead letter's outcome in the ledger (models/ledger.py), written by the statement that
# makes it.
_DEAD_OUTCOME = ledger.dead("d")

_EXPIRE_SQL = f"""
    WITH held AS (
        SELECT g.id, g.source_id, s.public_id, g.breaker_opened_at,
               coalesce(g.max_age_s * interval '1 second', CAST(:max_age AS interval)) AS max_age,
               g.released_at
        FROM routes g JOIN sources s ON s.id = g.source_id
        WHERE g.breaker_state <> 'closed' AND g.paused_at IS NULL
          AND (g.breaker_probe_at IS NULL OR g.breaker_probe_at <= :now)
    ), due AS (
        SELECT d.id, d.expires_at, g.id AS route_id, g.public_id, g.breaker_opened_at, g.max_age
        FROM held g
        JOIN deliveries d ON d.source_id = g.source_id AND d.route_id = g.id
        WHERE d.status IN ('pending', 'retrying')
          AND {_AGE_START} + g.max_age <= :now
        ORDER BY d.id
        LIMIT :limit
        FOR UPDATE OF d SKIP LOCKED
    ), dead AS (
        UPDATE deliveries d SET status = 'dead', dead_reason = :reason, dead_at = :now,
            next_attempt_at = NULL, lease_until = NULL, updated_at = :now,
            last_error_class = coalesce(d.last_error_class, 'BreakerOpen'),
            last_error = 'expired: its max_age ('
                || floor(extract(epoch FROM due.max_age))::bigint
                || ' s) passed while its route''s breaker was open;'
                || {_OPEN_FOR.format(opened="due.breaker_opened_at")}
                || coalesce('; last error: ' || d.last_error, '')
        FROM due
        WHERE d.id = due.id AND d.expires_at = due.expires_at
          AND d.status IN ('pending', 'retrying')
        RETURNING d.id, due.route_id, d.receipt_id, d.expires_at,
                  {_DEAD_OUTCOME} AS outcome,
                  floor(extract(epoch FROM :now - due.breaker_opened_at)) AS open_for,
                  due.public_id
    ), {ledger.append("dead")}
    SELECT id, route_id, open_for, public_id FROM dead
    """  # noqa: S608 (fragments of this module, no input)


@dataclass(frozen=True)
class Expired:
    """A delivery the sweep sent to the dead letters: its route's breaker had been open for
    ``open_for_s`` (None: the route never recorded its opening); ``source``: its source's
    public id (the ``source`` label of ``webhooks_dead_letters_total``)."""

    delivery_id: int
    route_id: int
    open_for_s: float | None
    source: str


def expire_held(
    session: Session, *, now: datetime | None, max_age: timedelta, limit: int
) -> list[Expired]:
    """pending | retrying -> dead (``expired``) for at most ``limit`` deliveries held by an
    open or half-open breaker past their ``max_age`` (the route's, else ``max_age``, the
    setting). SKIP LOCKED: a row a worker is claiming this instant is its to decide (a
    failed probe past its age goes dead there)."""
    rows = session.execute(
        sql_text(_EXPIRE_SQL),
        {"now": now, "max_age": max_age, "limit": limit, "reason": DeadReason.EXPIRED},
    ).all()
    return [
        Expired(int(r[0]), int(r[1]), None if r[2] is None else float(r[2]), str(r[3]))
        for r in rows
    ]


_DISABLE_SQL = f"""
    WITH stale AS (
        SELECT id, source_id, breaker_opened_at FROM routes
        WHERE active AND paused_at IS NULL AND breaker_state <> 'closed'
          AND greatest(breaker_opened_at, released_at) <= :now - :after
        ORDER BY id
        FOR UPDATE SKIP LOCKED
    ), off AS (
        UPDATE routes r SET active = false, disabled_at = :now,
            disabled_reason = 'breaker open longer than ' || CAST(:after_text AS text) || ':'
                || {_OPEN_FOR.format(opened="stale.breaker_opened_at")},
            breaker_state = 'closed', breaker_probe_at = NULL, probe_delivery = NULL,
            window_started_at = NULL, window_requests = 0, window_failures = 0
        FROM stale
        WHERE r.id = stale.id AND r.active AND r.paused_at IS NULL
          AND r.breaker_state <> 'closed'
        RETURNING r.id, r.source_id, r.handler, r.events_glob, r.disabled_reason,
                  stale.breaker_opened_at, r.breaker_trips
    ), dead AS (
        UPDATE deliveries d SET status = 'dead', dead_reason = :reason, dead_at = :now,
            next_attempt_at = NULL, lease_until = NULL, updated_at = :now,
            last_error_class = coalesce(d.last_error_class, 'RouteDisabled'),
            last_error = 'route_disabled: ' || off.disabled_reason
                || coalesce('; last error: ' || d.last_error, '')
        FROM off
        WHERE d.source_id = off.source_id AND d.route_id = off.id
          AND d.status IN ('pending', 'retrying')
        RETURNING d.route_id, d.receipt_id, d.expires_at, {_DEAD_OUTCOME} AS outcome
    ), {ledger.append("dead")}
    SELECT off.id, s.public_id, off.handler, off.events_glob, off.disabled_reason,
           floor(extract(epoch FROM :now - off.breaker_opened_at)), off.breaker_trips,
           (SELECT count(*) FROM dead WHERE dead.route_id = off.id)
    FROM off JOIN sources s ON s.id = off.source_id
    ORDER BY off.id
    """  # noqa: S608 (fragments of this module, no input)

# The operator the sweep's own changes are audited as.
SWEEPER = "sweeper"


@dataclass(frozen=True)
class Disabled:
    """A route the sweep disabled: what the audit row and the alert say of it."""

    route_id: int
    source: str
    handler: str
    events: str
    reason: str
    open_for_s: float | None
    trips: int
    dead: int  # its waiting deliveries sent to the dead letters (route_disabled)
    audit_id: int


def disable_stale(session: Session, *, now: datetime | None, after: timedelta) -> list[Disabled]:
    """Disable every active, unpaused route whose breaker has been open longer than
    ``after`` (``WEBHOOKS_ROUTE_DISABLE_AFTER``), send its waiting deliveries to the dead
    letters (``route_disabled``) and audit each (``route.disable``, operator ``sweeper``),
    all in the caller's transaction."""
    rows = session.execute(
        sql_text(_DISABLE_SQL),
        {
            "now": now,
            "after": after,
            "after_text": format_duration(after),
            "reason": DeadReason.ROUTE_DISABLED,
        },
    ).all()
    out = []
    for r in rows:
        target: dict[str, Any] = {
            "route": int(r[0]),
            "source": r[1],
            "handler": r[2],
            "events": r[3],
            "dead": int(r[7]),
        }
        audit_id = record_audit(
            session, Change(SWEEPER, str(r[4]), via="sweep"), "route.disable", target, count=1,
            now=now,
        )  # fmt: skip
        open_for = None if r[5] is None else float(r[5])
        out.append(
            Disabled(
                int(r[0]), r[1], r[2], r[3], str(r[4]), open_for, int(r[6]), int(r[7]), audit_id
            )
        )
    return out

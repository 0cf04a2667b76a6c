"""Read-only queries of the operator console (``ingest.console``): the overview's counts, an
event's payload and conflicts, the catalog with route states, and the audit trail (the CLI's
``audit_log`` and ``replays`` rows) filtered by operator, action and time.

Nothing here changes a row: the console's actions go through :mod:`models.replays`,
:mod:`models.discards`, :mod:`models.catalog` and :mod:`models.breaker`, as the CLI's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, select, text
from sqlalchemy.orm import Session

from core.states import REPLAYABLE
from models import queries
from models.breaker import RouteState, state_of
from models.candidates import (
    Candidate,
    ReplayFilter,
    candidates_by_ids,
)
from models.catalog import CatalogError, get_source
from models.schema import AuditEntry, Conflict, Delivery, Receipt, Replay, Route, Source

WINDOWS = (("hour", timedelta(hours=1)), ("day", timedelta(days=1)))


@dataclass(frozen=True)
class RouteCounts:
    """One route's deliveries created in a window, by what became of them."""

    source: str
    source_name: str
    route_id: int
    handler: str
    succeeded: int
    retrying: int
    dead: int
    pending: int


@dataclass(frozen=True)
class Overview:
    accepted: dict[str, dict[str, int]]  # window -> source public id -> receipts received
    routes: dict[str, list[RouteCounts]]  # window -> per route
    backlog: int  # pending, retrying or processing now
    oldest_pending_age: timedelta | None  # of the oldest pending or retrying delivery
    now: datetime  # the database's clock


_ROUTE_COUNTS = text(
    """
    SELECT s.public_id, s.name, r.id, r.handler,
           count(*) FILTER (WHERE d.status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE d.status = 'retrying') AS retrying,
           count(*) FILTER (WHERE d.status = 'dead') AS dead,
           count(*) FILTER (WHERE d.status IN ('pending', 'processing')) AS pending
    FROM routes r
    JOIN sources s ON s.id = r.source_id
    LEFT JOIN deliveries d ON d.route_id = r.id AND d.created_at >= :since
    GROUP BY s.public_id, s.name, r.id, r.handler
    ORDER BY s.public_id, r.id
    """
)

_ACCEPTED = text(
    """
    SELECT s.public_id, count(r.id)
    FROM sources s
    LEFT JOIN receipts r ON r.source_id = s.id AND r.received_at >= :since
    GROUP BY s.public_id
    """
)

_BACKLOG = text(
    """
    SELECT count(*),
           now() - min(created_at) FILTER (WHERE status IN ('pending', 'retrying')),
           now()
    FROM deliveries
    WHERE status IN ('pending', 'retrying', 'processing')
    """
)


def overview(session: Session) -> Overview:
    """Counts over the last hour and day, on the database's clock."""
    backlog, oldest, now = session.execute(_BACKLOG).one()
    accepted: dict[str, dict[str, int]] = {}
    routes: dict[str, list[RouteCounts]] = {}
    for name, span in WINDOWS:
        since = now - span
        accepted[name] = {r[0]: int(r[1]) for r in session.execute(_ACCEPTED, {"since": since})}
        routes[name] = [
            RouteCounts(*row) for row in session.execute(_ROUTE_COUNTS, {"since": since})
        ]
    return Overview(accepted, routes, int(backlog), oldest, now)


# The charts' windows: (name, length, bucket). A day at 15-minute buckets, shown per minute.
CHART_WINDOWS = (
    ("hour", timedelta(hours=1), timedelta(minutes=1)),
    ("day", timedelta(days=1), timedelta(minutes=15)),
)


@dataclass(frozen=True)
class Scope:
    """What a chart counts: everything, one source's or one route's deliveries."""

    source_id: int | None = None
    route_id: int | None = None


@dataclass(frozen=True)
class Activity:
    """Counts per bucket of one window, oldest bucket first, on the database's clock:
    events accepted (receipts; a route's: its deliveries made), deliveries that succeeded,
    attempts that ended in a retry, deliveries that went dead (and are still dead), and the
    p50 and p99 receipt-to-success seconds of each bucket's successes (None: none)."""

    window: str
    start: datetime
    step: timedelta
    accepted: list[int]
    succeeded: list[int]
    retrying: list[int]
    dead: list[int]
    p50: list[float | None]
    p99: list[float | None]


_BUCKET = "floor(extract(epoch FROM {at} - :start) / :step_s)::int"
_SCOPE = (
    "(CAST(:source AS bigint) IS NULL OR d.source_id = :source)"
    " AND (CAST(:route AS bigint) IS NULL OR d.route_id = :route)"
)
_ACCEPTED_PER_BUCKET = text(
    f"""
    SELECT {_BUCKET.format(at="r.received_at")} AS b, count(*) FROM receipts r
    WHERE r.received_at >= :start AND r.received_at < :end
      AND (CAST(:source AS bigint) IS NULL OR r.source_id = :source)
    GROUP BY b
    """  # noqa: S608 (fragments of this module)
)
_MADE_PER_BUCKET = text(
    f"""
    SELECT {_BUCKET.format(at="d.created_at")} AS b, count(*) FROM deliveries d
    WHERE d.created_at >= :start AND d.created_at < :end AND {_SCOPE}
    GROUP BY b
    """  # noqa: S608 (fragments of this module)
)
_SUCCEEDED_PER_BUCKET = text(
    f"""
    SELECT b, count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY lag),
           percentile_cont(0.99) WITHIN GROUP (ORDER BY lag)
    FROM (SELECT {_BUCKET.format(at="d.succeeded_at")} AS b,
                 extract(epoch FROM d.succeeded_at - d.created_at) AS lag
          FROM deliveries d
          WHERE d.status = 'succeeded' AND d.succeeded_at >= :start AND d.succeeded_at < :end
            AND {_SCOPE}) s
    GROUP BY b
    """  # noqa: S608 (fragments of this module)
)
_RETRIES_PER_BUCKET = text(
    f"""
    SELECT {_BUCKET.format(at="a.ended_at")} AS b, count(*) FROM attempts a
    JOIN deliveries d ON d.id = a.delivery_id AND d.expires_at = a.expires_at
    WHERE a.outcome = 'retry' AND a.ended_at >= :start AND a.ended_at < :end AND {_SCOPE}
    GROUP BY b
    """  # noqa: S608 (fragments of this module)
)
_DEAD_PER_BUCKET = text(
    f"""
    SELECT {_BUCKET.format(at="d.dead_at")} AS b, count(*) FROM deliveries d
    WHERE d.status = 'dead' AND d.dead_at >= :start AND d.dead_at < :end AND {_SCOPE}
    GROUP BY b
    """  # noqa: S608 (fragments of this module)
)


@dataclass(frozen=True)
class Charted:
    """The overview's counts, and the charts' activity of a scope (named for the page)."""

    overview: Overview
    activity: list[Activity]
    scope: str | None  # None: everything; else "source NAME" or "route N HANDLER"


def charted(session: Session, source: str | None, route: str | None) -> Charted:
    """:func:`overview` and :func:`activity` of everything, a source (public id or name) or a
    route (its id). QueryError for one that does not exist."""
    counts = overview(session)
    scope, label = Scope(), None
    if route is not None:
        if not route.isdigit():
            raise queries.QueryError(f"route must be a route id, not {route!r}", "bad_input")
        found = session.get(Route, int(route))
        if found is None:
            raise queries.NotFoundError(f"no such route: {route}")
        scope, label = Scope(route_id=found.id), f"route {found.id} {found.handler}"
    elif source is not None:
        try:
            named = get_source(session, source)
        except CatalogError as exc:
            raise queries.NotFoundError(str(exc)) from None
        scope, label = Scope(source_id=named.id), f"source {named.name}"
    return Charted(counts, activity(session, counts.now, scope), label)


def _per_bucket(
    session: Session, statement: Any, params: dict[str, Any], buckets: int
) -> list[int]:
    per = [0] * buckets
    for b, n in session.execute(statement, params):
        if 0 <= b < buckets:
            per[b] = int(n)
    return per


def activity(session: Session, now: datetime, scope: Scope) -> list[Activity]:
    """Each of :data:`CHART_WINDOWS` up to ``now`` (the database's clock), its last bucket the
    one ``now`` is in."""
    out = []
    for window, length, step in CHART_WINDOWS:
        buckets = int(length / step)
        epoch = datetime.fromtimestamp(0, now.tzinfo)
        end = epoch + ((now - epoch) // step + 1) * step
        start = end - buckets * step
        params = {
            "start": start,
            "end": end,
            "step_s": step.total_seconds(),
            "source": scope.source_id,
            "route": scope.route_id,
        }

        succeeded = [0] * buckets
        p50: list[float | None] = [None] * buckets
        p99: list[float | None] = [None] * buckets
        for b, n, q50, q99 in session.execute(_SUCCEEDED_PER_BUCKET, params):
            if 0 <= b < buckets:
                succeeded[b], p50[b], p99[b] = int(n), float(q50), float(q99)
        out.append(
            Activity(
                window,
                start,
                step,
                _per_bucket(
                    session,
                    _MADE_PER_BUCKET if scope.route_id else _ACCEPTED_PER_BUCKET,
                    params,
                    buckets,
                ),
                succeeded,
                _per_bucket(session, _RETRIES_PER_BUCKET, params, buckets),
                _per_bucket(session, _DEAD_PER_BUCKET, params, buckets),
                p50,
                p99,
            )
        )
    return out


@dataclass(frozen=True)
class Payload:
    """An event's stored body (None once retention dropped it) and the conflicts seen."""

    body: bytes | None
    dropped_at: datetime | None
    conflicts: list[datetime]  # when a different body arrived under the same event id


def payload(session: Session, receipt_id: int) -> Payload:
    row = session.execute(
        select(
            Receipt.payload,
            Receipt.payload_dropped_at,
            Receipt.source_id,
            Receipt.event_id,
            Receipt.expires_at,
        )
        .where(Receipt.id == receipt_id)
        .limit(1)
    ).first()
    if row is None:
        return Payload(None, None, [])
    seen = session.scalars(
        select(Conflict.received_at)
        .where(
            Conflict.source_id == row.source_id,
            Conflict.event_id == row.event_id,
            Conflict.expires_at == row.expires_at,
        )
        .order_by(Conflict.received_at)
        .limit(100)
    ).all()
    return Payload(row.payload, row.payload_dropped_at, list(seen))


@dataclass(frozen=True)
class RouteRow:
    id: int
    handler: str
    events: str
    active: bool
    state: RouteState


@dataclass(frozen=True)
class SourceRow:
    public_id: str
    name: str
    provider: str
    active: bool
    routes: list[RouteRow]


def catalog(session: Session) -> list[SourceRow]:
    """Every source with its routes and their pause and breaker state."""
    session.expire_all()
    sources = session.scalars(select(Source).order_by(Source.name, Source.id)).all()
    by_source: dict[int, list[RouteRow]] = {s.id: [] for s in sources}
    for route in session.scalars(select(Route).order_by(Route.id)):
        by_source.setdefault(route.source_id, []).append(
            RouteRow(route.id, route.handler, route.events_glob, route.active, state_of(route))
        )
    return [SourceRow(s.public_id, s.name, s.provider, s.active, by_source[s.id]) for s in sources]


@dataclass(frozen=True)
class AuditRow:
    """One operator action: an ``audit_log`` row, or a replay (action ``replay``)."""

    kind: str  # "audit" or "replay"
    id: int
    at: datetime
    operator: str
    action: str
    target: dict[str, Any]
    reason: str
    count: int
    via: str
    status: str | None  # a replay's


def audit(
    session: Session,
    *,
    operator: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
) -> list[AuditRow]:
    """Most recent first; ``action`` is a prefix (``route``, ``discard``, ``replay``)."""
    entries = select(AuditEntry).order_by(AuditEntry.at.desc(), AuditEntry.id.desc()).limit(limit)
    runs = select(Replay).order_by(Replay.started_at.desc(), Replay.id.desc()).limit(limit)
    if operator:
        entries = entries.where(AuditEntry.operator == operator)
        runs = runs.where(Replay.operator == operator)
    if since is not None:
        entries = entries.where(AuditEntry.at >= since)
        runs = runs.where(Replay.started_at >= since)
    if until is not None:
        entries = entries.where(AuditEntry.at < until)
        runs = runs.where(Replay.started_at < until)
    rows: list[AuditRow] = []
    if action:
        entries = entries.where(AuditEntry.action.startswith(action, autoescape=True))
    rows += [
        AuditRow(
            "audit", e.id, e.at, e.operator, e.action, e.target, e.reason, e.count, e.via, None
        )
        for e in session.scalars(entries)
    ]
    if not action or "replay".startswith(action):
        rows += [
            AuditRow(
                "replay",
                r.id,
                r.started_at,
                r.operator,
                "replay",
                r.filter,
                r.reason,
                r.replayed,
                r.via,
                r.status,
            )
            for r in session.scalars(runs)
        ]
    rows.sort(key=lambda r: r.at, reverse=True)
    return rows[:limit]


@dataclass(frozen=True)
class Preview:
    """What a bulk replay or discard by filter will touch: the matching delivery ids, frozen
    in id order (the confirmation acts on exactly these), and the first few as a sample."""

    ids: tuple[int, ...]
    sample: tuple[Candidate, ...]

    @property
    def count(self) -> int:
        return len(self.ids)


def preview(session: Session, flt: ReplayFilter, *, limit: int, sample: int = 10) -> Preview:
    """The ids of the deliveries :func:`models.candidates.candidates_by_filter` would return
    (same filter, same order, at most ``limit``), read from ``ix_deliveries_source_status``
    alone when only the source is given; the receipts are joined only for a type or time
    window. Only the sample is read in full (:func:`models.candidates.candidates_by_ids`).

    Why: reading every candidate joined to its receipt, source and route (10,000 of them in
    the benchmark) is what made the preview miss 500 ms; the ids are enough to freeze."""
    queries.check_status(flt.status, REPLAYABLE)
    conds: list[Any] = [Delivery.status == flt.status]
    if flt.source is not None:
        conds.append(Delivery.source_id == get_source(session, flt.source).id)
    query = select(Delivery.id)
    if flt.event_type is not None or flt.since is not None or flt.until is not None:
        conds += queries.receipt_conditions(session, None, flt.event_type, flt.since, flt.until)
        query = query.join(
            Receipt,
            and_(Delivery.receipt_id == Receipt.id, Delivery.expires_at == Receipt.expires_at),
        )
    ids = tuple(session.scalars(query.where(*conds).order_by(Delivery.id).limit(limit)))
    first = candidates_by_ids(session, ids[:sample]) if ids else []
    return Preview(ids, tuple(first))


def db_now(session: Session) -> datetime:
    value: datetime = session.execute(select(func.now())).scalar_one()
    return value

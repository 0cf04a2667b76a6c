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
from models.breaker import RouteState, limits_view, state_of
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
    p50 and p99 receipt-to-success seconds of each bucket's successes (None: none), within
    4.4% (:data:`LAG_BINS_PER_DOUBLING`)."""

    window: str
    start: datetime
    step: timedelta
    accepted: list[int]
    succeeded: list[int]
    retrying: list[int]
    dead: list[int]
    p50: list[float | None]
    p99: list[float | None]


# The charts read minutes: each table once, grouped by minute (of the longest window) and
# kind; the windows' buckets are sums of minutes. Receipt-to-success seconds go into
# logarithmic bins (8 a doubling: a bin's middle is within 4.4% of any value in it), counted
# like the rest, so no statement sorts a day of successes; the percentiles are read off the
# bins (:func:`quantile`), as Prometheus reads a histogram's.
LAG_BINS_PER_DOUBLING = 8
# date_part, not extract: float8 arithmetic (extract's numeric cost a third of the scan).
_MINUTE = "floor(date_part('epoch', {at} - :since) / 60)::int"
_SCOPE = (
    "(CAST(:source AS bigint) IS NULL OR d.source_id = :source)"
    " AND (CAST(:route AS bigint) IS NULL OR d.route_id = :route)"
)
_ACCEPTED_PER_MINUTE = text(
    f"""
    SELECT 'accepted', {_MINUTE.format(at="r.received_at")} AS m, NULL, count(*)
    FROM receipts r
    WHERE r.received_at >= :since AND r.received_at < :end
      AND (CAST(:source AS bigint) IS NULL OR r.source_id = :source)
    GROUP BY m
    """  # noqa: S608 (fragments of this module)
)
# One pass over the deliveries: each row's making (a route's "accepted"), success (with its
# receipt-to-success bin) and death, in the minutes they fall in.
_DELIVERIES_PER_MINUTE = text(
    f"""
    SELECT e.kind, {_MINUTE.format(at="e.at")} AS m,
           CASE WHEN e.kind = 'succeeded'
                THEN floor({LAG_BINS_PER_DOUBLING} * ln(greatest(e.lag, 0.001)) / ln(2))::int
           END AS k,
           count(*)
    FROM deliveries d
    CROSS JOIN LATERAL (VALUES
        -- a route's "accepted" (everything's and a source's are the receipts')
        ('made', CASE WHEN CAST(:route AS bigint) IS NOT NULL THEN d.created_at END,
         CAST(NULL AS float8)),
        ('succeeded', CASE WHEN d.status = 'succeeded' THEN d.succeeded_at END,
         date_part('epoch', d.succeeded_at - d.created_at)),
        ('dead', CASE WHEN d.status = 'dead' THEN d.dead_at END, NULL)) AS e(kind, at, lag)
    WHERE (d.created_at >= :since OR d.succeeded_at >= :since OR d.dead_at >= :since)
      AND {_SCOPE} AND e.at >= :since AND e.at < :end
    GROUP BY e.kind, m, k
    """  # noqa: S608 (fragments of this module)
)
_RETRIES_PER_MINUTE = text(
    f"""
    SELECT 'retrying', {_MINUTE.format(at="a.ended_at")} AS m, NULL, count(*)
    FROM attempts a JOIN deliveries d ON d.id = a.delivery_id AND d.expires_at = a.expires_at
    WHERE a.outcome = 'retry' AND a.ended_at >= :since AND a.ended_at < :end AND {_SCOPE}
    GROUP BY m
    """  # noqa: S608 (fragments of this module)
)


def quantile(bins: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile of the receipt-to-success seconds counted in ``bins`` (bin ->
    count), as its bin's middle; None when there are none (pure)."""
    total = sum(bins.values())
    if not total:
        return None
    rank, seen = q * total, 0
    for k in sorted(bins):
        seen += bins[k]
        if seen >= rank:
            return float(2 ** ((k + 0.5) / LAG_BINS_PER_DOUBLING))
    return None  # unreachable: seen reaches total


def activity(session: Session, now: datetime, scope: Scope) -> list[Activity]:
    """Each of :data:`CHART_WINDOWS` up to ``now`` (the database's clock), its last bucket the
    one ``now`` is in: three statements, each reading its table once, by minute."""
    epoch = datetime.fromtimestamp(0, now.tzinfo)
    minute = timedelta(minutes=1)
    shapes = []
    for window, length, step in CHART_WINDOWS:
        end = epoch + ((now - epoch) // step + 1) * step  # the end of now's bucket
        shapes.append((window, end - length, step, int(length / step)))
    since = min(start for _, start, _, _ in shapes)
    end = max(start + n * step for _, start, step, n in shapes)
    minutes = int((end - since) / minute)
    params = {"since": since, "end": end, "source": scope.source_id, "route": scope.route_id}
    counts: dict[str, list[int]] = {}
    lag_bins: list[dict[int, int]] = [{} for _ in range(minutes)]
    statements = [_DELIVERIES_PER_MINUTE, _RETRIES_PER_MINUTE]
    if not scope.route_id:
        statements.append(_ACCEPTED_PER_MINUTE)
    for statement in statements:
        for kind, m, k, n in session.execute(statement, params):
            if not 0 <= m < minutes:
                continue
            counts.setdefault(kind, [0] * minutes)[m] += int(n)
            if kind == "succeeded":
                lag_bins[m][k] = lag_bins[m].get(k, 0) + int(n)
    out = []
    for window, start, step, n in shapes:
        first, width = int((start - since) / minute), int(step / minute)
        spans = [range(first + i * width, first + (i + 1) * width) for i in range(n)]

        def summed(kind: str, spans: list[range] = spans) -> list[int]:
            per = counts.get(kind, [0] * minutes)
            return [sum(per[m] for m in span) for span in spans]

        merged = []
        for span in spans:
            bins: dict[int, int] = {}
            for m in span:
                for k, c in lag_bins[m].items():
                    bins[k] = bins.get(k, 0) + c
            merged.append(bins)
        out.append(
            Activity(
                window,
                start,
                step,
                summed("made" if scope.route_id else "accepted"),
                summed("succeeded"),
                summed("retrying"),
                summed("dead"),
                [quantile(bins, 0.5) for bins in merged],
                [quantile(bins, 0.99) for bins in merged],
            )
        )
    return out


@dataclass(frozen=True)
class Charted:
    """The charts' activity of a scope, and the scope named for the page."""

    activity: list[Activity]
    scope: str | None  # None: everything; else "source NAME" or "route N HANDLER"


def scope_of(session: Session, source: str | None, route: str | None) -> tuple[Scope, str | None]:
    """Everything, a source (public id or name) or a route (its id), and its name for the
    page. QueryError (NotFoundError) for one that does not exist."""
    if route is not None:
        if not route.isdigit():
            raise queries.QueryError(f"route must be a route id, not {route!r}", "bad_input")
        found = session.get(Route, int(route))
        if found is None:
            raise queries.NotFoundError(f"no such route: {route}")
        return Scope(route_id=found.id), f"route {found.id} {found.handler}"
    if source is not None:
        try:
            named = get_source(session, source)
        except CatalogError as exc:
            raise queries.NotFoundError(str(exc)) from None
        return Scope(source_id=named.id), f"source {named.name}"
    return Scope(), None


def charted(session: Session, source: str | None, route: str | None) -> Charted:
    """:func:`activity` of a scope (:func:`scope_of`), up to the database's now."""
    scope, label = scope_of(session, source, route)
    return Charted(activity(session, db_now(session), scope), label)


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
    limits: dict[str, Any]  # models.breaker.limits_view: max_in_flight, rate_limit (None: unset)
    filter: str | None = None  # its JMESPath filter (core.filters), None: every event
    transform: str | None = None  # its transform's name (tasks.transforms), None: none
    # Its lanes (models/lanes.py): the order key (None: unordered), block or skip, supersede.
    order_key: str | None = None
    lane_on_dead: str = "block"
    supersede: bool = False


@dataclass(frozen=True)
class SourceRow:
    public_id: str
    name: str
    provider: str
    active: bool
    routes: list[RouteRow]


def _with_routes(session: Session, sources: list[Source]) -> list[SourceRow]:
    """These sources with their routes (only theirs are read) and each one's state."""
    by_source: dict[int, list[RouteRow]] = {s.id: [] for s in sources}
    found = select(Route).where(Route.source_id.in_(list(by_source))).order_by(Route.id)
    for route in session.scalars(found) if by_source else ():
        by_source[route.source_id].append(
            RouteRow(
                route.id,
                route.handler,
                route.events_glob,
                route.active,
                state_of(route),
                limits_view(route),
                route.filter,
                route.transform,
                route.order_key,
                route.lane_on_dead,
                route.supersede,
            )
        )
    return [SourceRow(s.public_id, s.name, s.provider, s.active, by_source[s.id]) for s in sources]


def catalog(session: Session) -> list[SourceRow]:
    """Every source with its routes and their pause and breaker state."""
    session.expire_all()
    return _with_routes(
        session, list(session.scalars(select(Source).order_by(Source.name, Source.id)))
    )


#: Sources per page of the console's routes page.
CATALOG_PAGE = 25


@dataclass(frozen=True)
class CatalogPage:
    """One page of the routes page: its sources (newest first), and the cursor of the next
    page (the public id of this page's last source), None on the last page."""

    sources: list[SourceRow]
    after: str | None


def catalog_page(
    session: Session, *, q: str | None = None, after: str | None = None, limit: int = CATALOG_PAGE
) -> CatalogPage:
    """A page of sources, newest first, with their routes: those whose name or public id
    holds ``q`` (any case), after the source ``after`` (the previous page's cursor; an
    unknown one is a NotFoundError). Reads only the page's sources and their routes, however
    many the catalog holds."""
    session.expire_all()
    chosen = select(Source).order_by(Source.id.desc()).limit(limit + 1)
    if q:
        chosen = chosen.where(
            Source.name.icontains(q, autoescape=True)
            | Source.public_id.icontains(q, autoescape=True)
        )
    if after is not None:
        last = session.scalar(select(Source.id).where(Source.public_id == after))
        if last is None:
            raise queries.NotFoundError(f"no such source {after!r} (the page's cursor)")
        chosen = chosen.where(Source.id < last)
    sources = list(session.scalars(chosen))
    more = len(sources) > limit
    sources = sources[:limit]
    return CatalogPage(_with_routes(session, sources), sources[-1].public_id if more else None)


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

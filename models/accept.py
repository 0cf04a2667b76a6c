"""The accept statement: what the receiver and reconciliation run to record an event.

Accepting an event is one autocommit statement, ``webhooks_accept(...)`` (a PL/pgSQL function,
migration 0003), so one round trip. Inside its transaction it:

1. takes ``pg_advisory_xact_lock`` on (scope, event_id): serialises the arrivals of one event,
   so uniqueness holds across partitions even for formats without an event time (where
   ``expires_at`` is anchored on the first arrival and is not known in advance);
2. runs one data-modifying statement, in a snapshot taken after the lock, that only if the
   matching secret is still unrevoked inserts the receipt unless a live receipt for
   (scope, event_id) exists (``ON CONFLICT DO NOTHING`` on the primary key as the backstop),
   inserts one delivery per matching route, and records a conflict when the digest differs.

Nothing is acknowledged before that statement's COMMIT returns.

The receiver runs it in groups (group commit, ``ingest.store``): ``webhooks_accept_many``
(migration 0004) decides each element exactly as ``webhooks_accept`` does, in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
import psycopg
from psycopg.rows import TupleRow

from core.filters import RouteFilter, Verdict
from core.messages import Dispatch, RouteRow
from core.states import receipt_outcome

# One statement, one round trip, autocommit: the function (migration 0003) takes the
# per-event advisory lock, then inserts the receipt unless a live one exists, one delivery per
# matching route, and a conflict row when the digest differs; all or nothing.
ACCEPT_SQL = """
SELECT authorised, receipt_id, existing_digest, delivery_ids, route_limits, filtered_routes,
       stale
FROM webhooks_accept(%(source_id)s, %(secret_id)s, %(event_id)s, %(event_type)s,
                     %(occurred_at)s, %(expires_at)s, %(now)s::timestamptz, %(digest)s,
                     %(content_type)s, %(payload)s, %(grace)s, %(ttl)s, %(verdicts)s::json)
"""


# A batch (migration 0004), one statement and one transaction: the small fields as one JSON
# array, the digests and bodies as binary arrays (``%b``: the text array format would escape
# every quote of every JSON body); one row per element with its 1-based position.
ACCEPT_MANY_SQL = """
SELECT ord, authorised, receipt_id, existing_digest, delivery_ids, route_limits,
       filtered_routes, stale
FROM webhooks_accept_many(%(items)s::json, %(digests)b::bytea[], %(payloads)b::bytea[],
                          %(grace)s, %(now)s::timestamptz, %(verdicts)s::json)
"""


@dataclass(frozen=True)
class Outcome:
    """What the accept transaction decided."""

    status: str  # "accepted" | "duplicate" | "conflict" | "revoked" | "stale"
    receipt_id: int | None
    delivery_ids: tuple[int, ...]
    # For each delivery id, in order, what admission reads of its route (migration 0018:
    # route id, max_in_flight, rate_count, rate_period_s, held), as the accept read it.
    route_limits: tuple[RouteRow, ...] = ()
    # The routes whose filter did not match: each has a ``filtered`` delivery, not published
    # (migration 0027).
    filtered_routes: tuple[int, ...] = ()

    def dispatches(self, event_id: str, source: str) -> list[Dispatch]:
        """Its deliveries to publish, each with its route's limits when the accept read them."""
        routes: Sequence[RouteRow | None] = self.route_limits or [None] * len(self.delivery_ids)
        return [
            Dispatch(i, event_id, source, route)
            for i, route in zip(self.delivery_ids, routes, strict=True)
        ]


@dataclass(frozen=True)
class NewReceipt:
    """One authenticated arrival. ``expires_at`` is computed on the receiver's clock
    (:func:`core.ttl.expires_at`); the accept statement decides on the database's: it
    stamps ``received_at`` with its own instant and, should ``expires_at`` not lie after
    that instant (a receiver clock behind the database's), anchors it there instead
    (``instant + ttl``), so no receipt is ever written into a day maintenance has passed.
    ``received_at``: None in production; a test pins the instant."""

    source_id: int
    secret_id: str
    event_id: str
    event_type: str
    occurred_at: datetime | None
    expires_at: datetime
    received_at: datetime | None
    digest: bytes
    content_type: str | None
    payload: bytes
    ttl: timedelta
    # The source's route filters decided for this event (core.filters), each with the text
    # it evaluated: the accept refuses to decide (``stale``) when a route's filter is not
    # among them as it now stands (migration 0027).
    verdicts: tuple[Verdict, ...] = ()


def verdict_rows(verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    """The verdicts as the accept functions read them (migration 0027; pure)."""
    return [
        {
            "route_id": v.route_id,
            "filter": v.expression,
            "matched": v.matched,
            "reason": v.reason,
            "order_key": v.order_key,
            "lane_key": v.lane_key,
        }
        for v in verdicts
    ]


def accept_params(receipt: NewReceipt, grace: timedelta) -> dict[str, Any]:
    return {
        "secret_id": receipt.secret_id,
        "source_id": receipt.source_id,
        "event_id": receipt.event_id,
        "event_type": receipt.event_type,
        "occurred_at": receipt.occurred_at,
        "expires_at": receipt.expires_at,
        "now": receipt.received_at,
        "digest": receipt.digest,
        "content_type": receipt.content_type,
        "payload": receipt.payload,
        "grace": grace,
        "ttl": receipt.ttl,
        "verdicts": orjson.dumps(verdict_rows(receipt.verdicts)).decode(),
    }


def accept_many_params(receipts: Sequence[NewReceipt], grace: timedelta) -> dict[str, Any]:
    """The batch statement's parameters: the small fields as one JSON array (element i has
    ``ord`` i + 1), the digests and bodies as binary arrays in the same order (pure).

    The batch is decided at one instant, the database's (or the first element's pinned one:
    a test pins the same instant for every element of a batch)."""
    instants = {r.received_at for r in receipts}
    if len(instants) > 1:
        raise ValueError("a batch is decided at one instant: pin the same time for all")
    items = [
        {
            "ord": position,
            "source_id": r.source_id,
            "secret_id": r.secret_id,
            "event_id": r.event_id,
            "event_type": r.event_type,
            "occurred_at": r.occurred_at,
            "expires_at": r.expires_at,
            "ttl_s": r.ttl.total_seconds(),
            "content_type": r.content_type,
        }
        for position, r in enumerate(receipts, start=1)
    ]
    return {
        "items": orjson.dumps(items).decode(),
        "digests": [r.digest for r in receipts],
        "payloads": [r.payload for r in receipts],
        "grace": grace,
        "now": receipts[0].received_at if receipts else None,
        "verdicts": orjson.dumps(
            [
                {"ord": position, **row}
                for position, r in enumerate(receipts, start=1)
                for row in verdict_rows(r.verdicts)
            ]
        ).decode(),
    }


def decide_many(receipts: Sequence[NewReceipt], rows: Sequence[TupleRow]) -> list[Outcome]:
    """Interpret the batch statement's rows: one per element, by position (pure)."""
    by_position = {int(row[0]): row[1:] for row in rows}
    if sorted(by_position) != list(range(1, len(receipts) + 1)):
        raise RuntimeError("accept batch returned a row set that does not match its input")
    outcomes = []
    for position, receipt in enumerate(receipts, start=1):
        row = by_position[position]
        outcomes.append(with_conflict(decide(row), row, receipt.digest))
    return outcomes


def decide(row: TupleRow | None) -> Outcome:
    """Interpret the accept statement's single row (pure)."""
    if row is None:
        raise RuntimeError("accept statement returned no row")
    authorised, receipt_id, _existing_digest, delivery_ids, route_limits, filtered, stale = row
    if stale:
        return Outcome("stale", None, ())
    if not authorised:
        return Outcome("revoked", None, ())
    if receipt_id is not None:
        ids = tuple(int(i) for i in delivery_ids)
        routes = tuple(tuple(r) for r in route_limits)
        if len(routes) != len(ids):
            raise RuntimeError("accept statement returned route limits that do not match")
        return Outcome(
            "accepted", int(receipt_id), ids, routes, tuple(int(r) for r in filtered or ())
        )
    return Outcome("duplicate", None, ())


# A source's active routes that hold a filter, as the receiver's source read has them
# (ingest.store.SOURCE_SQL): for the accepts that do not go through the receiver.
ROUTE_FILTERS_SQL = """
SELECT rt.id, rt.events_glob, rt.filter, rt.order_key FROM routes rt
WHERE rt.source_id = %(source_id)s AND rt.active
  AND (rt.filter IS NOT NULL OR rt.order_key IS NOT NULL)
ORDER BY rt.id
"""


def route_filters_sync(conn: psycopg.Connection[Any], source_id: int) -> tuple[RouteFilter, ...]:
    rows = conn.execute(ROUTE_FILTERS_SQL, {"source_id": source_id}).fetchall()
    return tuple(RouteFilter(int(r), glob, expr, key) for r, glob, expr, key in rows)


def accept_sync(conn: psycopg.Connection[Any], receipt: NewReceipt, grace: timedelta) -> Outcome:
    """The same statement on a synchronous autocommit connection (tools, tests, benchmarks)."""
    row = conn.execute(ACCEPT_SQL, accept_params(receipt, grace)).fetchone()
    return with_conflict(decide(row), row, receipt.digest)


def with_conflict(outcome: Outcome, row: TupleRow | None, digest: bytes) -> Outcome:
    if (
        outcome.status == "duplicate"
        and row is not None
        and row[2] is not None
        and bytes(row[2]) != digest
    ):
        return Outcome("conflict", None, ())
    return outcome


# -- a duplicate's answer: the recorded outcome ---------------------------------------------
# Read only for duplicates (the first delivery of an event never runs it): the live receipt
# of each event id (the newest by expiry, the one that deduplicated), and its deliveries'
# statuses and result references. Index-only on both sides' keys: the receipts' primary key
# (source_id, event_id, expires_at) and deliveries' unique (receipt_id, route_id, expires_at).
RECEIPT_STATES_SQL = """
SELECT r.event_id, r.received_at, d.status, d.result_ref
FROM (SELECT DISTINCT ON (event_id) id, event_id, expires_at, received_at
      FROM receipts WHERE source_id = %(source_id)s AND event_id = ANY(%(event_ids)s)
      ORDER BY event_id, expires_at DESC) AS r
LEFT JOIN deliveries d ON d.receipt_id = r.id AND d.expires_at = r.expires_at
ORDER BY r.event_id, d.id
"""


@dataclass(frozen=True)
class ReceiptState:
    """Where a recorded event stands, as a duplicate of it is answered: when it was first
    accepted, its deliveries' statuses counted, and the result references its handlers
    returned. Never its payload, never a secret."""

    first_accepted_at: datetime
    counts: dict[str, int]
    results: tuple[str, ...]

    @property
    def outcome(self) -> str:
        return receipt_outcome(self.counts)

    def answer(self) -> dict[str, Any]:
        """The fields a duplicate's JSON answer carries."""
        out: dict[str, Any] = {
            "outcome": self.outcome,
            "first_accepted_at": self.first_accepted_at.isoformat(),
            "deliveries": dict(sorted(self.counts.items())),
        }
        if self.results:
            out["results"] = list(self.results)
        return out


def receipt_states(rows: Sequence[TupleRow]) -> dict[str, ReceiptState]:
    """RECEIPT_STATES_SQL's rows by event id (pure): one row per delivery, or one with a NULL
    status for a receipt without deliveries."""
    found: dict[str, tuple[datetime, dict[str, int], list[str]]] = {}
    for event_id, received_at, status, ref in rows:
        _, counts, refs = found.setdefault(event_id, (received_at, {}, []))
        if status is not None:
            counts[status] = counts.get(status, 0) + 1
        if ref is not None:
            refs.append(ref)
    return {
        event_id: ReceiptState(at, counts, tuple(refs))
        for event_id, (at, counts, refs) in found.items()
    }


# -- a test send (``webhooks send``, its mark verified: core.send_marks) ---------------------
# Recorded as any event, in one transaction that first says how it arrived (the receipts'
# arrived_via default reads this setting; reconciliation sets it the same way) and then
# audits it: one audit_log row per event the accept authorised, naming the operator the mark
# carries, the source, the event's id and type and what the accept decided; never the payload.
SENT_ARRIVAL_SQL = "SELECT set_config('webhooks.arrived_via', 'test', true)"

SENT_AUDIT_SQL = """
INSERT INTO audit_log (at, operator, action, target, reason, count, via)
SELECT coalesce(%(now)s::timestamptz, now()), %(operator)s, 'event.send', t, %(reason)s, 1, 'cli'
FROM jsonb_array_elements(%(targets)s::jsonb) AS t
"""
SENT_REASON = "test event (webhooks send)"


def sent_audit_params(
    receipts: Sequence[NewReceipt],
    outcomes: Sequence[Outcome],
    *,
    operator: str,
    source: str,
    provider: str,
) -> dict[str, Any]:
    """SENT_AUDIT_SQL's parameters (pure): a target per receipt whose accept was authorised
    (a revoked secret, or a route filter changed since it was judged, wrote nothing, so there
    is nothing to audit)."""
    targets = [
        {
            "source": source,
            "provider": provider,
            "event_id": r.event_id,
            "event_type": r.event_type,
            "arrived_via": "test",
            "outcome": o.status,
        }
        for r, o in zip(receipts, outcomes, strict=True)
        if o.status not in ("revoked", "stale")
    ]
    return {
        "now": receipts[0].received_at if receipts else None,
        "operator": operator,
        "targets": orjson.dumps(targets).decode(),
        "reason": SENT_REASON,
    }

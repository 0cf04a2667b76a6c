"""The processed-events ledger (issue 35 item 2; migration 0023): one compact row per receipt
whose work ended, kept ``WEBHOOKS_LEDGER_RETENTION`` months, long after the receipt itself
(deleted at its dedup TTL). What it answers is a customer's dispute months later: did this
event arrive, when, with which body (an 8-byte digest), and what became of it on each route.

Written by the statement that ends a delivery, never by one of its own: :func:`upsert` is a
CTE the worker's success and dead-letter statements (:mod:`models.transitions`), the sweep's
``expired`` and ``route_disabled`` endings (:mod:`models.route_ends`) and an operator's
discard (:mod:`models.requeue`) carry, so the worker's success path pays no round trip for it
(bench/results_ledger.txt). Each ending merges its route's outcome into the receipt's row
(``ON CONFLICT ... outcomes || new``): the row appears with the first route to end and is
complete when the last one has; a replay that later succeeds overwrites its route's ``d``.
Merging (rather than writing once, when a statement sees the last sibling end) is what keeps
two routes ending at once in two transactions from both seeing the other unfinished.

It is never a dedup key: after the TTL a redelivered event is new work, with a receipt and,
once it ends, a ledger row of its own; the ledger only tells the operator it ran before.
Receipts that matched no route have no work, and no row.

Outcomes: ``{"<route id>": "s" | "s:<result ref>" | "d:<dead reason>" | "x"}`` (succeeded,
dead, discarded). Reading it: :mod:`models.ledger_reads`.
"""

from __future__ import annotations

from core.states import DeliveryStatus
from models.statements import Target, fetchone, placeholders

# What each final status is written as (the first character of a route's outcome).
CODES = {
    DeliveryStatus.SUCCEEDED: "s",
    DeliveryStatus.DEAD: "d",
    DeliveryStatus.DISCARDED: "x",
}
STATUS_OF_CODE = {code: status for status, code in CODES.items()}

# A route's outcome, as an expression over an ended delivery row (columns unqualified).
SUCCEEDED = "'s' || coalesce(':' || result_ref, '')"
DEAD = "'d' || coalesce(':' || dead_reason, '')"
DISCARDED = "'x'"
ANY_END = (
    f"CASE status WHEN 'succeeded' THEN {SUCCEEDED} WHEN 'dead' THEN {DEAD}"
    f" WHEN 'discarded' THEN {DISCARDED} END"
)

# The receipt's row, merged with what an earlier ending wrote. The hash is only the index's
# key: the update happens for the same source and event id alone (a 64-bit collision at the
# same microsecond would leave that row unwritten, never write into another event's).
_UPSERT = """ledger_row AS (
        INSERT INTO ledger AS l (received_at, source_id, event_id, event_type, digest,
                                 outcomes, via)
        SELECT r.received_at, r.source_id, r.event_id, r.event_type,
               substring(r.body_digest FROM 1 FOR 8), e.outcomes,
               left(r.arrived_via, 1)
        FROM (SELECT receipt_id, expires_at, jsonb_object_agg(route_id::text, outcome) AS outcomes
              FROM {ended} GROUP BY receipt_id, expires_at) e
        JOIN {receipts} r ON r.id = e.receipt_id AND r.expires_at = e.expires_at
        ON CONFLICT (hashtextextended(event_id, source_id), received_at) DO UPDATE
            SET outcomes = l.outcomes || EXCLUDED.outcomes
            WHERE l.source_id = EXCLUDED.source_id AND l.event_id = EXCLUDED.event_id
    )"""


def upsert(ended: str, receipts: str = "receipts") -> str:
    """The CTE (``ledger_row``) that writes the ledger rows of the deliveries a statement
    ended. ``ended`` names a CTE of that statement with the columns ``receipt_id``,
    ``expires_at``, ``route_id`` and ``outcome`` (:data:`SUCCEEDED`, :data:`DEAD`, ...);
    ``receipts`` the table to read the receipts from (a leaf partition on the worker's path).
    One row per receipt, however many of its deliveries the statement ended."""
    return _UPSERT.format(ended=ended, receipts=receipts)


_RECORD = placeholders(f"""
    WITH ended AS (
        SELECT receipt_id, expires_at, route_id, {ANY_END} AS outcome FROM deliveries
        WHERE id = ANY(CAST(:ids AS bigint[]))
          AND status IN ('succeeded', 'dead', 'discarded')
    ), {upsert("ended")}
    SELECT count(*) FROM ended
""")  # noqa: S608 (fragments of this module, no input)


def record(target: Target, delivery_ids: list[int]) -> int:
    """Merge these deliveries' outcomes (those that ended) into their receipts' ledger rows,
    in the caller's transaction: for an ending whose own statement does not carry
    :func:`upsert` (a crash loop's dead letter, found by the claim). Returns the deliveries
    recorded."""
    row = fetchone(target, _RECORD, {"ids": list(delivery_ids)})
    return 0 if row is None else int(row[0])

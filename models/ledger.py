"""The processed-events ledger (issue 35 item 2; migrations 0023, 0026): compact rows of the
receipts whose work ended, kept ``WEBHOOKS_LEDGER_RETENTION`` months, long after the receipt
itself (deleted at its dedup TTL). What it answers is a customer's dispute months later: did
this event arrive, when, with which body (an 8-byte digest), and what became of it on each
route.

Written by the statement that ends a delivery, never by one of its own: :func:`append` is a
CTE the worker's success and dead-letter statements (:mod:`models.transitions`), the sweep's
``expired`` and ``route_disabled`` endings (:mod:`models.route_ends`) and an operator's
discard (:mod:`models.requeue`) carry, so the worker's success path pays no round trip for it
(bench/results_ledger.txt).

Appended, never updated: each statement adds one row per receipt it ended deliveries of,
holding their routes' entries, and a reader merges a receipt's rows (each route's entry with
the highest attempt number wins: :mod:`models.ledger_reads`). A replay that ends later ends a
later attempt (the attempt number goes on across replays and re-runs), so it wins over the
dead letter it replayed. Appending is what keeps two routes ending at once in two
transactions from both missing each other's outcome, with no unique index to merge on.

A row is 80 bytes for a Stripe-shaped event with one route: ``received_at``, ``kind`` (4
bytes naming the source, event type and way of arrival in ``ledger_kinds``, which the
statement extends when it meets a new one), ``event_id``, ``digest`` and ``outcomes``.

It is never a dedup key: after the TTL a redelivered event is new work, with a receipt and,
once it ends, ledger rows of its own; the ledger only tells the operator it ran before.
Receipts that matched no route have no work, and no row.

Outcomes: entries ``<route id>.<attempt><code>[:<detail>]`` joined by U+001F (:data:`SEP`,
which neither a result reference nor a dead reason can hold), code ``s`` succeeded (detail:
the result reference), ``d`` dead (the reason), ``x`` discarded, ``u`` superseded or ``f``
filtered: by its transform, written by the worker's statement
(:func:`models.transitions.filter_out`), or by the route's filter, at the accept (attempt 0).
That one is the exception to "written by the statement that ends it": the accept writes no
ledger row (migration 0035 took 0034's append out of it, issue 37's receiver floor), and its
row is appended by the statement that deletes the filtered delivery at its expiry
(:func:`deleting`: retention, in both modes). Until then the delivery itself is the record,
and it is what every reader shows while the receipt lives.
"""

from __future__ import annotations

from models.statements import Target, fetchone, placeholders
from models.views import (
    CODES,
    SEP,
    STATUS_OF_CODE,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "CODES",
    "SEP",
    "STATUS_OF_CODE",
]


def _entry(code: str, detail: str | None, row: str) -> str:
    """A route's entry, as an expression over an ended delivery row (``row``: its alias,
    where the statement's other tables share its column names)."""
    at = f"{row}." if row else ""
    tail = f" || coalesce(':' || {at}{detail}, '')" if detail else ""
    return f"{at}route_id || '.' || {at}attempts || '{code}'{tail}"


def succeeded(row: str = "") -> str:
    return _entry("s", "result_ref", row)


def dead(row: str = "") -> str:
    return _entry("d", "dead_reason", row)


def discarded(row: str = "") -> str:
    return _entry("x", None, row)


def superseded(row: str = "") -> str:
    return _entry("u", None, row)


def filtered(row: str = "") -> str:
    return _entry("f", None, row)


ANY_END = (
    f"CASE status WHEN 'succeeded' THEN {succeeded()} WHEN 'dead' THEN {dead()}"
    f" WHEN 'discarded' THEN {discarded()} WHEN 'superseded' THEN {superseded()}"
    f" WHEN 'filtered' THEN {filtered()} END"
)

# The ended receipts' rows, and the kinds among them not seen before. A kind is added by the
# first statement that meets it: ``DO UPDATE`` (a no-op write) when another transaction
# added it meanwhile, so that RETURNING still names it (a snapshot taken before that commit
# would not see it, and ``DO NOTHING`` returns nothing).
_APPEND = """ledger_new AS (
        SELECT r.received_at, r.source_id, r.event_type, left(r.arrived_via, 1) AS via,
               r.event_id, substring(r.body_digest FROM 1 FOR 8) AS digest, e.outcomes
        FROM (SELECT receipt_id, expires_at, string_agg(outcome, chr(31)) AS outcomes
              FROM {ended} GROUP BY receipt_id, expires_at) e
        JOIN {receipts} r ON r.id = e.receipt_id AND r.expires_at = e.expires_at
    ), ledger_kind AS (
        INSERT INTO ledger_kinds (source_id, event_type, via)
        SELECT DISTINCT source_id, event_type, via FROM ledger_new n
        WHERE NOT EXISTS (SELECT FROM ledger_kinds k WHERE k.source_id = n.source_id
                          AND k.event_type = n.event_type AND k.via = n.via)
        ON CONFLICT (source_id, event_type, via) DO UPDATE SET via = EXCLUDED.via
        RETURNING id, source_id, event_type, via
    ), ledger_row AS (
        INSERT INTO ledger (received_at, kind, event_id, digest, outcomes)
        SELECT n.received_at, coalesce(k.id, a.id), n.event_id, n.digest, n.outcomes
        FROM ledger_new n
        LEFT JOIN ledger_kinds k ON k.source_id = n.source_id AND k.event_type = n.event_type
                                AND k.via = n.via
        LEFT JOIN ledger_kind a ON a.source_id = n.source_id AND a.event_type = n.event_type
                               AND a.via = n.via
    )"""


def append(ended: str, receipts: str = "receipts") -> str:
    """The CTEs (``ledger_new``, ``ledger_kind``, ``ledger_row``) that append the ledger rows
    of the deliveries a statement ended. ``ended`` names a CTE of that statement with the
    columns ``receipt_id``, ``expires_at`` and ``outcome`` (an entry: :func:`succeeded`,
    :func:`dead`, ...); ``receipts`` the table to read the receipts from (a leaf partition
    on the worker's path). One row per receipt, however many of its deliveries the statement
    ended."""
    return _APPEND.format(ended=ended, receipts=receipts)


# A delivery its route's filter kept from its work at the accept (attempt 0): one whose
# transform dropped it (attempt 1 and on) has its ledger row from the worker's statement.
FILTERED_AT_ACCEPT = "status = 'filtered' AND attempts = 0"


def deleting(delete: str, receipts: str, returning: str) -> str:
    """A statement of retention's: ``delete`` (a ``DELETE`` of deliveries rows, without
    ``RETURNING``), the ledger rows of the filtered-at-the-accept ones among them appended in
    the same statement (the receipts read from ``receipts``, which must still hold them), and
    ``returning`` (an expression over a deleted row) selected per deleted row. The row is
    appended exactly once: by the statement that removes the delivery."""
    return f"""
    WITH gone AS (
        {delete}
        RETURNING receipt_id, expires_at, route_id, attempts, status
    ), filtered_end AS (
        SELECT receipt_id, expires_at, {filtered("gone")} AS outcome FROM gone
        WHERE gone.status = 'filtered' AND gone.attempts = 0
    ), {append("filtered_end", receipts)}
    SELECT {returning} FROM gone
    """  # noqa: S608 (fragments of this module and the caller's, no input)


_RECORD = placeholders(f"""
    WITH ended AS (
        SELECT receipt_id, expires_at, {ANY_END} AS outcome FROM deliveries
        WHERE id = ANY(CAST(:ids AS bigint[]))
          AND status IN ('succeeded', 'dead', 'discarded', 'superseded')
    ), {append("ended")}
    SELECT count(*) FROM ended
""")  # noqa: S608 (fragments of this module, no input)


def record(target: Target, delivery_ids: list[int]) -> int:
    """Append these deliveries' outcomes (those that ended) to the ledger, in the caller's
    transaction: for an ending whose own statement does not carry :func:`append` (a crash
    loop's dead letter, found by the claim). Returns the deliveries recorded."""
    row = fetchone(target, _RECORD, {"ids": list(delivery_ids)})
    return 0 if row is None else int(row[0])

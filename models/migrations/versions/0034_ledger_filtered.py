"""ledger rows for filtered deliveries: the accept appends them in its own statement

Issue 37's left-overs. A delivery that a route's filter keeps from its work ends ``filtered``
at the accept, and until now wrote no ledger row: once its receipt expired (the dedup TTL),
``events show`` found the event in the ledger only if another route of it ended, and never
listed the filtered route. The accept's statement now carries the ledger's append CTE
(:mod:`models.ledger`, frozen here as it stood) for the deliveries it wrote ``filtered``:
one row per receipt with such a delivery, its entries ``<route>.0f`` (attempt 0, code ``f``).
Only the branch that runs for a call with verdicts changes: a call without any (a source
none of whose routes holds a filter or an order key) writes no filtered delivery, and runs
its statement as before. (A delivery its transform drops ends ``filtered`` at the worker,
whose statement carries the same CTE: no migration needed.)

The receipt's columns the ledger keeps are taken from the accept's own ``receipt`` CTE
(``RETURNING``): the table itself does not show a row inserted by the same statement.

The bodies are 0028's, edited at marked places (each asserted to occur as often as it
should) in their verdict branch only; the signatures stay, so each is replaced in place.

Downgrade: 0028's bodies again; the ledger rows written meanwhile stay (their ``f`` entries
are read as the status ``filtered`` by this code, and left out by older code, which does not
know the code: :func:`models.views.entries` keeps any letter, the status shown is the code).

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0034"
down_revision: str | None = "0033"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# models.ledger's append CTEs as they stood at this revision (``{ended}``: the CTE of ended
# deliveries, ``{receipts}``: where to read their receipts), its columns qualified: in these
# PL/pgSQL bodies a bare ``receipt_id`` would be ambiguous with the function's OUT column.
_APPEND = """ledger_new AS (
        SELECT r.received_at, r.source_id, r.event_type, left(r.arrived_via, 1) AS via,
               r.event_id, substring(r.body_digest FROM 1 FOR 8) AS digest, e.outcomes
        FROM (SELECT f.receipt_id, f.expires_at, string_agg(f.outcome, chr(31)) AS outcomes
              FROM {ended} f GROUP BY f.receipt_id, f.expires_at) e
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

_LEDGER_COLUMNS = "receipts.received_at, receipts.arrived_via, receipts.body_digest"

# The filtered deliveries' entries (attempt 0: none was made), then the append.
_ONE_ENDED = (
    "    ), filtered_end AS (\n"  # noqa: S608 (constants of this module, no input)
    "        SELECT receipt.id AS receipt_id, receipt.expires_at,\n"
    "               delivery.route_id || '.0f' AS outcome\n"
    "        FROM delivery CROSS JOIN receipt WHERE delivery.status = 'filtered'\n"
    "    ), " + _APPEND.format(ended="filtered_end", receipts="receipt") + ", conflict AS (\n"
)
_MANY_ENDED = (
    "    ), filtered_end AS (\n"  # noqa: S608 (constants of this module, no input)
    "        SELECT d.receipt_id, r.expires_at, d.route_id || '.0f' AS outcome\n"
    "        FROM delivery d JOIN receipt r ON r.id = d.receipt_id\n"
    "        WHERE d.status = 'filtered'\n"
    "    ), " + _APPEND.format(ended="filtered_end", receipts="receipt") + ", prior AS"
    " MATERIALIZED (\n"
)

_ONE_EDITS = (
    ("        RETURNING receipts.id, receipts.expires_at\n",
     "        RETURNING receipts.id, receipts.expires_at, receipts.source_id, receipts.event_id,\n"
     "                  receipts.event_type, " + _LEDGER_COLUMNS + "\n"),
    ("    ), conflict AS (\n", _ONE_ENDED),
)  # fmt: skip

_MANY_EDITS = (
    ("        RETURNING receipts.id, receipts.source_id, receipts.event_id, receipts.expires_at,\n"
     "                  receipts.event_type\n",
     "        RETURNING receipts.id, receipts.source_id, receipts.event_id, receipts.expires_at,\n"
     "                  receipts.event_type, " + _LEDGER_COLUMNS + "\n"),
    ("    ), prior AS MATERIALIZED (\n", _MANY_ENDED),
)  # fmt: skip

# Where a body's verdict branch starts (0027's two ways: models/migrations 0027, _two_ways).
_BRANCH = "    ELSE\n    RETURN QUERY\n"


def _revision_0028() -> object:
    return importlib.import_module("models.migrations.versions.0028_route_lanes")


def _edited(body: str, edits: Sequence[tuple[str, str]]) -> str:
    if body.count(_BRANCH) != 1:
        raise RuntimeError("0028's function body has not exactly one verdict branch")
    head, branch = body.split(_BRANCH)
    for old, new in edits:
        if branch.count(old) != 1:
            raise RuntimeError(f"0028's function body changed: {old.strip()!r}")
        branch = branch.replace(old, new)
    return head + _BRANCH + branch


def _replaced(function: str) -> str:
    if "CREATE OR REPLACE FUNCTION " not in function:
        raise RuntimeError("0028's function is not created with CREATE OR REPLACE")
    return function


def accept_function() -> str:
    body: str = _revision_0028().accept_function()  # type: ignore[attr-defined]
    return _replaced(_edited(body, _ONE_EDITS))


def accept_many_function() -> str:
    body: str = _revision_0028().accept_many_function()  # type: ignore[attr-defined]
    return _replaced(_edited(body, _MANY_EDITS))


def upgrade() -> None:
    op.execute(accept_function())
    op.execute(accept_many_function())


def downgrade() -> None:
    old = _revision_0028()
    op.execute(_replaced(old.accept_function()))  # type: ignore[attr-defined]
    op.execute(_replaced(old.accept_many_function()))  # type: ignore[attr-defined]

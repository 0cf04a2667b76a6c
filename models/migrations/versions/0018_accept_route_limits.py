"""the accept functions return each delivery's route and its admission limits

``webhooks_accept`` and ``webhooks_accept_many`` gain one output column, ``route_limits``:
for each id of ``delivery_ids``, in the same order, ``[route id, max_in_flight,
rate_count, rate_period_s, held (0/1)]`` (a two-dimensional bigint array; NULL where the
route has no limit of its own), read in the accept's own statement from the routes rows its
delivery inserts joined. The receiver's publisher hands them to admission, which no longer
reads them back with a statement of its own per publish batch (``models.admission.routes_of``,
~10% of the database's time per accepted webhook under load, bench/results_receiver.txt);
the sweeper and the retries, which publish rows they did not insert, still read them.

A route changed between the accept and the publish is seen as it was at the accept: the same
race ``routes_of`` had between its read and the Lua call. The worker's claim re-checks the
pause and the breaker, so a delivery admitted for a route paused since waits as pending, with
no attempt.

Otherwise the bodies are 0012's (loaded from that revision's file and extended at marked
places, each asserted to occur once). The return type changes, so each function is dropped
and created again, in the upgrade's transaction: no accept sees neither.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# What admission reads of a route (models.admission._LIMITS_COLUMNS), as one bigint array.
_LIMITS = (
    "ARRAY[rt.id, rt.max_in_flight::bigint, rt.rate_count::bigint, rt.rate_period_s::bigint,"
    " (rt.paused_at IS NOT NULL OR rt.breaker_state <> 'closed')::int::bigint]"
)

_ONE_EDITS = (
    ("                 delivery_ids bigint[])",
     "                 delivery_ids bigint[], route_limits bigint[])"),
    ("        RETURNING deliveries.id\n",
     "        RETURNING deliveries.id, deliveries.route_id\n"),
    ("           ARRAY(SELECT delivery.id FROM delivery ORDER BY delivery.id);",
     "           ARRAY(SELECT delivery.id FROM delivery ORDER BY delivery.id),\n"
     "           ARRAY(SELECT <limits> FROM delivery\n"
     "                 JOIN routes rt ON rt.id = delivery.route_id ORDER BY delivery.id);"),
)  # fmt: skip

_MANY_EDITS = (
    ("                 delivery_ids bigint[])",
     "                 delivery_ids bigint[], route_limits bigint[])"),
    ("        RETURNING deliveries.id, deliveries.receipt_id\n",
     "        RETURNING deliveries.id, deliveries.receipt_id, deliveries.route_id\n"),
    ("                     WHERE d.receipt_id = r.id), '{}')\n",
     "                     WHERE d.receipt_id = r.id), '{}'),\n"
     "           coalesce((SELECT array_agg(<limits> ORDER BY d.id)\n"
     "                     FROM delivery d JOIN routes rt ON rt.id = d.route_id\n"
     "                     WHERE d.receipt_id = r.id), '{}')\n"),
)  # fmt: skip

DROP_ONE = (
    "DROP FUNCTION webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
    " timestamptz, bytea, text, bytea, interval, interval)"
)
DROP_MANY = "DROP FUNCTION webhooks_accept_many(json, bytea[], bytea[], interval, timestamptz)"


def _revision_0012(name: str) -> str:
    """A function body as revision 0012 created it (its module, imported by name)."""
    module = importlib.import_module("models.migrations.versions.0012_accept_floor_discard_ids")
    body: str = getattr(module, name)
    return body


def _edited(body: str, edits: Sequence[tuple[str, str]]) -> str:
    for old, new in edits:
        if body.count(old) != 1:
            raise RuntimeError(f"0012's function body changed: {old.strip()!r}")
        body = body.replace(old, new.replace("<limits>", _LIMITS))
    return body


def accept_function() -> str:
    return _edited(_revision_0012("ACCEPT_FUNCTION"), _ONE_EDITS)


def accept_many_function() -> str:
    return _edited(_revision_0012("ACCEPT_MANY_FUNCTION"), _MANY_EDITS)


def upgrade() -> None:
    op.execute(DROP_ONE)
    op.execute(DROP_MANY)
    op.execute(accept_function())
    op.execute(accept_many_function())


def downgrade() -> None:
    op.execute(DROP_ONE)
    op.execute(DROP_MANY)
    op.execute(_revision_0012("ACCEPT_FUNCTION"))
    op.execute(_revision_0012("ACCEPT_MANY_FUNCTION"))

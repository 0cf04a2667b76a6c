"""route lanes: ``routes.order_key``, ``lane_on_dead``, ``supersede``; ``deliveries.lane_key``;
the delivery status ``superseded``; the accept writes each delivery's lane key

Issue 37 items 2 and 3. A route may hold an order key, a JMESPath expression over the same
``{body, type, headers}`` document as its filter (:mod:`core.filters`). Deliveries of one
route whose events share a key (its value, ``deliveries.lane_key``) run one at a time, in
delivery id order (the order the accept wrote them); a delivery whose key is null (the
expression gives nothing on its event) is unordered, as every delivery was before.

Where the key is computed: by the receiver, before the accept, exactly where 0027's filters
are judged, and passed in each route's verdict (``p_verdicts`` gains ``order_key``, the text
evaluated, and ``lane_key``, its value). Not at the worker's first claim: a claim that keyed
delivery 5 could not know whether an earlier delivery of the route, not claimed yet, has the
same key, so the lane would have to wait for every earlier unkeyed delivery of the route (all
keys in one line). Keyed at the accept, every delivery has its key from its first commit and
the lane is complete in every snapshot. The accept returns for publishing only the
deliveries that are their lane's head as it sees them (``webhooks_lane_clear``); one behind an
unfinished delivery of its key is published when that one ends (the worker that ends it reads
the lane's next head after its commit), or by the sweeper's pick of lane heads should that
end commit between this accept's read and its commit.

A route that applies to the event and holds an order key is judged like a filtered route: the
accept answers ``stale`` (writes nothing) when its verdict is missing or was computed for
another order key (or filter) than the route holds now, so a changed order key applies to every
event accepted after the change commits. The verdict join compares the filter and the order key
with ``IS NOT DISTINCT FROM`` (a route may hold an order key and no filter).

The lane itself is kept by the claim (:mod:`models.lanes`, :mod:`models.transitions`),
through ``webhooks_lane_clear(route, key, id, now)`` (a function, so that the claim statements
stay under psycopg's cached statement size): a delivery with a lane key is claimed only when
no other delivery of its route and key with a lower id is unfinished (pending, retrying,
processing, or dead when the route's ``lane_on_dead`` is ``block``) and none is processing
under a live lease. The partial index ``ix_deliveries_lane`` on (route_id, lane_key, id) over
the unfinished rows makes that one index probe per partition; ``ix_deliveries_lane_done`` on
(route_id, lane_key) over the succeeded ones is what the supersede check reads.

``deliveries.status``'s CHECK allows ``superseded``: final, the handler was not called, the
newer event's id in ``last_error``.

Downgrade: superseded deliveries become ``discarded`` (the old code knows no such
status; they never ran), the columns and indexes dropped, 0027's functions restored, the lane
function dropped.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = (
    "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead', 'discarded', 'filtered')"
)
NEW_STATES = (
    "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead', 'discarded',"
    " 'filtered', 'superseded')"
)

#: The rows a lane waits for (the partial index's predicate; models.lanes repeats it).
LANE_OPEN = "lane_key IS NOT NULL AND status IN ('pending', 'processing', 'retrying', 'dead')"
LANE_DONE = "lane_key IS NOT NULL AND status = 'succeeded'"

#: The lane condition, as a function: the claim statements must stay under psycopg's cached
#: statement size (tests/test_transitions.py), and the claim, the sweeper's pick and the
#: next-head read share it (models/lanes.py). STABLE: it reads in its caller's snapshot.
#: PL/pgSQL, not SQL: its statement's plan is prepared once per session (a SQL function with
#: a subquery is not inlined, and was planned again, over every partition, on each call:
#: bench/results_lanes.txt).
LANE_CLEAR = """
CREATE FUNCTION webhooks_lane_clear(p_route bigint, p_key text, p_id bigint, p_now timestamptz)
RETURNS boolean LANGUAGE plpgsql STABLE AS $fn$
BEGIN
    RETURN NOT EXISTS (
        SELECT 1 FROM deliveries l
        WHERE l.route_id = p_route AND l.lane_key = p_key
          AND l.lane_key IS NOT NULL
          AND l.status IN ('pending', 'processing', 'retrying', 'dead') AND l.id <> p_id
          AND ((l.id < p_id
                AND (l.status <> 'dead'
                     OR EXISTS (SELECT 1 FROM routes lr WHERE lr.id = p_route
                                  AND lr.lane_on_dead = 'block')))
               OR (l.status = 'processing' AND l.lease_until > p_now)));
END
$fn$;
"""

# Each edit: (old, new, how many times old occurs in 0027's body).
_EDITS = (
    ("reason text)", "reason text, order_key text, lane_key text)", 2),
    ("rt.filter IS NOT NULL", "(rt.filter IS NOT NULL OR rt.order_key IS NOT NULL)", 1),
    ("v.filter = rt.filter",
     "v.filter IS NOT DISTINCT FROM rt.filter AND v.order_key IS NOT DISTINCT FROM rt.order_key",
     2),
    ("last_error_class, last_error)", "last_error_class, last_error, lane_key)", 1),
    ("CASE WHEN v.matched IS FALSE THEN v.reason END\n",
     "CASE WHEN v.matched IS FALSE THEN v.reason END,\n"
     "               CASE WHEN v.matched IS FALSE THEN NULL ELSE v.lane_key END\n", 1),
)  # fmt: skip


# A delivery is returned for publishing (``delivery_ids``, ``route_limits``) only when it is its
# lane's head as the accept sees it: one behind an unfinished delivery of its key is published
# by whoever ends the one ahead of it (models/lanes.py), so an ordered backlog costs no message
# that its lane would refuse.
_HEAD = "({d}.lane_key IS NULL OR webhooks_lane_clear({d}.route_id, {d}.lane_key, {d}.id, v_now))"
_ONE_HEADS = (
    ("RETURNING deliveries.id, deliveries.route_id, deliveries.status\n",
     "RETURNING deliveries.id, deliveries.route_id, deliveries.status, deliveries.lane_key\n", 1),
    ("delivery.status = 'pending'",
     "delivery.status = 'pending' AND " + _HEAD.format(d="delivery"), 2),
)  # fmt: skip
_MANY_HEADS = (
    ("RETURNING deliveries.id, deliveries.receipt_id, deliveries.route_id, deliveries.status\n",
     "RETURNING deliveries.id, deliveries.receipt_id, deliveries.route_id, deliveries.status,"
     " deliveries.lane_key\n", 1),
    ("d.receipt_id = r.id AND d.status = 'pending'",
     "d.receipt_id = r.id AND d.status = 'pending' AND " + _HEAD.format(d="d"), 2),
)  # fmt: skip


def _revision_0027() -> object:
    return importlib.import_module("models.migrations.versions.0027_route_filters")


def _edited(body: str, more: Sequence[tuple[str, str, int]] = ()) -> str:
    for old, new, times in (*_EDITS, *more):
        if body.count(old) != times:
            raise RuntimeError(f"0027's function body changed: {old.strip()!r}")
        body = body.replace(old, new)
    return body


def accept_function() -> str:
    return _edited(_revision_0027().accept_function(), _ONE_HEADS)  # type: ignore[attr-defined]


def accept_many_function() -> str:
    return _edited(_revision_0027().accept_many_function(), _MANY_HEADS)  # type: ignore[attr-defined]


def upgrade() -> None:
    old = _revision_0027()
    op.execute("ALTER TABLE routes ADD COLUMN order_key text")
    op.execute(
        "ALTER TABLE routes ADD COLUMN lane_on_dead text NOT NULL DEFAULT 'block'"
        " CONSTRAINT ck_routes_lane_on_dead CHECK (lane_on_dead IN ('block', 'skip'))"
    )
    op.execute("ALTER TABLE routes ADD COLUMN supersede boolean NOT NULL DEFAULT false")
    op.execute("ALTER TABLE deliveries ADD COLUMN lane_key text")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", NEW_STATES)
    op.execute(
        f"CREATE INDEX ix_deliveries_lane ON deliveries (route_id, lane_key, id) WHERE {LANE_OPEN}"
    )
    op.execute(
        f"CREATE INDEX ix_deliveries_lane_done ON deliveries (route_id, lane_key) WHERE {LANE_DONE}"
    )
    op.execute(LANE_CLEAR)
    op.execute(old.DROP_ONE_NEW)  # type: ignore[attr-defined]
    op.execute(old.DROP_MANY_NEW)  # type: ignore[attr-defined]
    op.execute(accept_function())
    op.execute(accept_many_function())


def downgrade() -> None:
    old = _revision_0027()
    op.execute(old.DROP_ONE_NEW)  # type: ignore[attr-defined]
    op.execute(old.DROP_MANY_NEW)  # type: ignore[attr-defined]
    op.execute(old.accept_function())  # type: ignore[attr-defined]
    op.execute(old.accept_many_function())  # type: ignore[attr-defined]
    op.execute("UPDATE deliveries SET status = 'discarded' WHERE status = 'superseded'")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", OLD_STATES)
    op.execute("DROP FUNCTION webhooks_lane_clear(bigint, text, bigint, timestamptz)")
    op.execute("DROP INDEX ix_deliveries_lane_done")
    op.execute("DROP INDEX ix_deliveries_lane")
    op.execute("ALTER TABLE deliveries DROP COLUMN lane_key")
    op.execute("ALTER TABLE routes DROP COLUMN supersede")
    op.execute("ALTER TABLE routes DROP COLUMN lane_on_dead")
    op.execute("ALTER TABLE routes DROP COLUMN order_key")

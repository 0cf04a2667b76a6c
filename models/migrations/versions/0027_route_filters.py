"""route filters: ``routes.filter``, the delivery status ``filtered``, the accept judges them

Issue 37 item 1. A route may hold a filter, a JMESPath expression over the event
(:mod:`core.filters`). The receiver evaluates the filters of a source's routes before its
accept statement and passes what it decided, per route, with the filter text it evaluated
(``verdicts``, JSON: ``[{"route_id", "filter", "matched", "reason"}]``). The accept then:

- writes a route whose filter did not match as a delivery in the final status ``filtered``
  (``last_error_class`` ``filtered``, ``last_error`` the reason: which route's filter and
  whether it did not match or failed on the event), never published, never claimed;
- returns only the other deliveries in ``delivery_ids`` / ``route_limits``, and the routes it
  filtered in a new column, ``filtered_routes``;
- writes nothing, and answers ``stale``, when a route that applies to the event holds a filter
  the receiver did not evaluate as it now stands (it was added or changed since the receiver
  read the source): the receiver reads the source's routes again and accepts once more. So a
  changed filter applies to every event accepted after the change commits, whatever any
  receiver had cached.

A route with no filter costs the accept nothing new but a join that finds no verdict. The
deliveries are inserted in route order (their ids follow it, as they did without the join).

The bodies are 0018's (loaded from that revision's file and extended at marked places, each
asserted to occur once). The signatures and return types change: each function is dropped and
created again in the upgrade's transaction, so no accept sees neither.

``deliveries.status``'s CHECK allows ``filtered`` (a scan of ``deliveries`` under its lock,
once, as 0025 did for receipts).

Downgrade: filtered deliveries are deleted (they never ran, and the old code knows no such
status), the column dropped, the 0018 functions restored.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead', 'discarded')"
NEW_STATES = (
    "status IN ('pending', 'processing', 'succeeded', 'retrying', 'dead', 'discarded', 'filtered')"
)

# The verdicts of one arrival, as rows.
_VERDICTS = (
    "json_to_recordset(coalesce({src}, '[]'::json))"
    " AS v(route_id bigint, filter text, matched boolean, reason text)"
)

_ONE_STALE = """
    -- A route that applies to this event and holds a filter the receiver did not evaluate as
    -- it stands now: nothing is written, and the receiver reads its routes again.
    IF EXISTS (SELECT 1 FROM routes rt
               WHERE rt.source_id = p_source_id AND rt.active AND rt.filter IS NOT NULL
                 AND p_event_type LIKE rt.events_like
                 AND NOT EXISTS (SELECT 1 FROM <verdicts:p_verdicts>
                                 WHERE v.route_id = rt.id AND v.filter = rt.filter)) THEN
        RETURN QUERY SELECT false, NULL::bigint, NULL::bytea, '{}'::bigint[], '{}'::bigint[],
                            '{}'::bigint[], true;
        RETURN;
    END IF;
    RETURN QUERY
"""

_ONE_EDITS = (
    ("    p_digest bytea, p_content_type text, p_payload bytea, p_grace interval, p_ttl interval\n",
     "    p_digest bytea, p_content_type text, p_payload bytea, p_grace interval, p_ttl interval,\n"
     "    p_verdicts json\n"),
    ("                 delivery_ids bigint[], route_limits bigint[])",
     "                 delivery_ids bigint[], route_limits bigint[], filtered_routes bigint[],\n"
     "                 stale boolean)"),
    ("\n    RETURN QUERY\n", _ONE_STALE),
    ("""        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at)
        SELECT receipt.expires_at, receipt.id, p_source_id, rt.id, 'pending',
               v_now + p_grace, v_now, v_now
        FROM receipt JOIN routes rt
          ON rt.source_id = p_source_id AND rt.active AND p_event_type LIKE rt.events_like
        RETURNING deliveries.id, deliveries.route_id
""",
     """        INSERT INTO deliveries (expires_at, receipt_id, source_id, route_id, status,
                                next_attempt_at, created_at, updated_at,
                                last_error_class, last_error)
        SELECT receipt.expires_at, receipt.id, p_source_id, rt.id,
               CASE WHEN v.matched IS FALSE THEN 'filtered' ELSE 'pending' END,
               CASE WHEN v.matched IS FALSE THEN NULL ELSE v_now + p_grace END, v_now, v_now,
               CASE WHEN v.matched IS FALSE THEN 'filtered' END,
               CASE WHEN v.matched IS FALSE THEN v.reason END
        FROM receipt JOIN routes rt
          ON rt.source_id = p_source_id AND rt.active AND p_event_type LIKE rt.events_like
        LEFT JOIN <verdicts:p_verdicts> ON v.route_id = rt.id AND v.filter = rt.filter
        ORDER BY rt.id
        RETURNING deliveries.id, deliveries.route_id, deliveries.status
"""),
    ("           ARRAY(SELECT delivery.id FROM delivery ORDER BY delivery.id),\n",
     "           ARRAY(SELECT delivery.id FROM delivery WHERE delivery.status = 'pending'\n"
     "                 ORDER BY delivery.id),\n"),
    ("                 JOIN routes rt ON rt.id = delivery.route_id ORDER BY delivery.id);",
     "                 JOIN routes rt ON rt.id = delivery.route_id\n"
     "                 WHERE delivery.status = 'pending' ORDER BY delivery.id),\n"
     "           ARRAY(SELECT delivery.route_id FROM delivery\n"
     "                 WHERE delivery.status = 'filtered' ORDER BY delivery.route_id),\n"
     "           false;"),
)  # fmt: skip

_MANY_STALE = """
    -- A route that applies to an element's event and holds a filter the receiver did not
    -- evaluate as it stands now: nothing of the batch is written, every element answers
    -- stale, and each request reads its routes again.
    IF EXISTS (SELECT 1 FROM json_to_recordset(p_items)
                             AS e(source_id bigint, event_type text, verdicts json)
               JOIN routes rt ON rt.source_id = e.source_id AND rt.active
                             AND rt.filter IS NOT NULL AND e.event_type LIKE rt.events_like
               WHERE NOT EXISTS (SELECT 1 FROM <verdicts:e.verdicts>
                                 WHERE v.route_id = rt.id AND v.filter = rt.filter)) THEN
        RETURN QUERY SELECT e.ord, false, NULL::bigint, NULL::bytea, '{}'::bigint[],
                            '{}'::bigint[], '{}'::bigint[], true
                     FROM json_to_recordset(p_items) AS e(ord integer) ORDER BY e.ord;
        RETURN;
    END IF;
    RETURN QUERY
"""

_MANY_EDITS = (
    ("                 delivery_ids bigint[], route_limits bigint[])",
     "                 delivery_ids bigint[], route_limits bigint[], filtered_routes bigint[],\n"
     "                 stale boolean)"),
    ("\n    RETURN QUERY\n", _MANY_STALE),
    ("               e.content_type, p_digests[e.ord] AS digest, p_payloads[e.ord] AS payload\n",
     "               e.content_type, p_digests[e.ord] AS digest, p_payloads[e.ord] AS payload,\n"
     "               e.verdicts\n"),
    ("            content_type text)\n",
     "            content_type text, verdicts json)\n"),
    ("""        SELECT r.expires_at, r.id, r.source_id, rt.id, 'pending',
               v_now + p_grace, v_now, v_now
        FROM receipt r JOIN routes rt
          ON rt.source_id = r.source_id AND rt.active AND r.event_type LIKE rt.events_like
        RETURNING deliveries.id, deliveries.receipt_id, deliveries.route_id
""",
     """        SELECT r.expires_at, r.id, r.source_id, rt.id,
               CASE WHEN v.matched IS FALSE THEN 'filtered' ELSE 'pending' END,
               CASE WHEN v.matched IS FALSE THEN NULL ELSE v_now + p_grace END, v_now, v_now,
               CASE WHEN v.matched IS FALSE THEN 'filtered' END,
               CASE WHEN v.matched IS FALSE THEN v.reason END
        FROM receipt r
        JOIN candidate c ON c.source_id = r.source_id AND c.event_id = r.event_id
        JOIN routes rt
          ON rt.source_id = r.source_id AND rt.active AND r.event_type LIKE rt.events_like
        LEFT JOIN LATERAL (SELECT v.matched, v.reason FROM <verdicts:c.verdicts>
                           WHERE v.route_id = rt.id AND v.filter = rt.filter LIMIT 1) v ON true
        ORDER BY r.id, rt.id
        RETURNING deliveries.id, deliveries.receipt_id, deliveries.route_id, deliveries.status
"""),
    ("                                next_attempt_at, created_at, updated_at)\n"
     "        SELECT r.expires_at",
     "                                next_attempt_at, created_at, updated_at,\n"
     "                                last_error_class, last_error)\n"
     "        SELECT r.expires_at"),
    ("           coalesce((SELECT array_agg(d.id ORDER BY d.id) FROM delivery d\n"
     "                     WHERE d.receipt_id = r.id), '{}'),\n",
     "           coalesce((SELECT array_agg(d.id ORDER BY d.id) FROM delivery d\n"
     "                     WHERE d.receipt_id = r.id AND d.status = 'pending'), '{}'),\n"),
    ("                     WHERE d.receipt_id = r.id), '{}')\n",
     "                     WHERE d.receipt_id = r.id AND d.status = 'pending'), '{}'),\n"
     "           coalesce((SELECT array_agg(d.route_id ORDER BY d.route_id) FROM delivery d\n"
     "                     WHERE d.receipt_id = r.id AND d.status = 'filtered'), '{}'),\n"
     "           false\n"),
)  # fmt: skip

DROP_ONE = (
    "DROP FUNCTION webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
    " timestamptz, bytea, text, bytea, interval, interval)"
)
DROP_ONE_NEW = (
    "DROP FUNCTION webhooks_accept(bigint, text, text, text, timestamptz, timestamptz,"
    " timestamptz, bytea, text, bytea, interval, interval, json)"
)
DROP_MANY = "DROP FUNCTION webhooks_accept_many(json, bytea[], bytea[], interval, timestamptz)"


def _revision_0018() -> object:
    return importlib.import_module("models.migrations.versions.0018_accept_route_limits")


def _edited(body: str, edits: Sequence[tuple[str, str]]) -> str:
    for old, new in edits:
        if body.count(old) != 1:
            raise RuntimeError(f"0018's function body changed: {old.strip()!r}")
        body = body.replace(old, new)
    for src in ("p_verdicts", "e.verdicts", "c.verdicts"):
        body = body.replace(f"<verdicts:{src}>", _VERDICTS.format(src=src))
    return body


def accept_function() -> str:
    body: str = _revision_0018().accept_function()  # type: ignore[attr-defined]
    return _edited(body, _ONE_EDITS)


def accept_many_function() -> str:
    body: str = _revision_0018().accept_many_function()  # type: ignore[attr-defined]
    return _edited(body, _MANY_EDITS)


def upgrade() -> None:
    op.execute("ALTER TABLE routes ADD COLUMN filter text")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", NEW_STATES)
    op.execute(DROP_ONE)
    op.execute(DROP_MANY)
    op.execute(accept_function())
    op.execute(accept_many_function())


def downgrade() -> None:
    op.execute(DROP_ONE_NEW)
    op.execute(DROP_MANY)
    old = _revision_0018()
    op.execute(old.accept_function())  # type: ignore[attr-defined]
    op.execute(old.accept_many_function())  # type: ignore[attr-defined]
    op.execute("DELETE FROM deliveries WHERE status = 'filtered'")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", OLD_STATES)
    op.execute("ALTER TABLE routes DROP COLUMN filter")

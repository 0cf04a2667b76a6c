"""route filters: ``routes.filter``, the delivery status ``filtered``, the accept judges them

Issue 37 item 1. A route may hold a filter, a JMESPath expression over the event
(:mod:`core.filters`). The receiver evaluates the filters of a source's routes before its
accept statement and passes what it decided, per route, with the filter text it evaluated
(``p_verdicts``, JSON: ``[{"route_id", "filter", "matched", "reason"}]``, with the element's
``ord`` for ``webhooks_accept_many``: its own parameter, read once into a materialised CTE,
so a batch without filters joins an empty set). The accept then:

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

A call without verdicts (a source none of whose routes holds a filter) passes the stale check
and then runs 0018's statement unchanged; only a call with verdicts runs the statement that
joins them. The deliveries are inserted in route order (their ids follow it, as they did
without the join).

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

# The verdicts of a batch's elements, each naming its element (``ord``).
_MANY_VERDICTS = (
    "json_to_recordset(coalesce(p_verdicts, '[]'::json))"
    " AS v(ord integer, route_id bigint, filter text, matched boolean, reason text)"
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
    ("    WITH authorised AS (\n",
     "    WITH verdict AS MATERIALIZED (\n"
     "        SELECT v.* FROM <verdicts:p_verdicts>\n"
     "    ), authorised AS (\n"),
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
        LEFT JOIN verdict v ON v.route_id = rt.id AND v.filter = rt.filter
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
                             AS e(ord integer, source_id bigint, event_type text)
               JOIN routes rt ON rt.source_id = e.source_id AND rt.active
                             AND rt.filter IS NOT NULL AND e.event_type LIKE rt.events_like
               WHERE NOT EXISTS (SELECT 1 FROM <many-verdicts>
                                 WHERE v.ord = e.ord AND v.route_id = rt.id
                                   AND v.filter = rt.filter)) THEN
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
    ("    p_items json, p_digests bytea[], p_payloads bytea[], p_grace interval,"
     " p_now timestamptz\n",
     "    p_items json, p_digests bytea[], p_payloads bytea[], p_grace interval,"
     " p_now timestamptz,\n    p_verdicts json\n"),
    ("    WITH item AS MATERIALIZED (\n",
     "    WITH verdict AS MATERIALIZED (\n"
     "        SELECT v.* FROM <many-verdicts>\n"
     "    ), item AS MATERIALIZED (\n"),
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
        LEFT JOIN verdict v ON v.ord = c.ord AND v.route_id = rt.id AND v.filter = rt.filter
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
DROP_MANY_NEW = (
    "DROP FUNCTION webhooks_accept_many(json, bytea[], bytea[], interval, timestamptz, json)"
)


def _revision_0018() -> object:
    return importlib.import_module("models.migrations.versions.0018_accept_route_limits")


def _edited(body: str, edits: Sequence[tuple[str, str]]) -> str:
    for old, new in edits:
        if body.count(old) != 1:
            raise RuntimeError(f"0018's function body changed: {old.strip()!r}")
        body = body.replace(old, new)
    body = body.replace("<verdicts:p_verdicts>", _VERDICTS.format(src="p_verdicts"))
    return body.replace("<many-verdicts>", _MANY_VERDICTS)


# The main statement of a body: from its RETURN QUERY ... WITH to the function's END.
_QUERY_START = "    RETURN QUERY\n    WITH "
_QUERY_END = "END\n$fn$;"


def _query(body: str) -> tuple[int, int]:
    start, end = body.index(_QUERY_START), body.index(_QUERY_END)
    if body.count(_QUERY_START) != 1 or body.count(_QUERY_END) != 1:
        raise RuntimeError("a function body without exactly one main statement")
    return start, end


def _two_ways(old: str, new: str, old_tail: tuple[str, str]) -> str:
    """``new``, whose main statement runs only when the call carries verdicts: without any
    (every call for a source with no filtered route, once the stale check has passed) the
    old statement runs as it was, returning no filtered route, so that the accept costs a
    source without filters only the check (bench/results_filters.txt)."""
    o_start, o_end = _query(old)
    unchanged = _edited_once(old[o_start:o_end], *old_tail)
    n_start, n_end = _query(new)
    return (
        new[:n_start]
        + "    IF json_array_length(coalesce(p_verdicts, '[]'::json)) = 0 THEN\n"
        + unchanged
        + "    ELSE\n"
        + new[n_start:n_end]
        + "    END IF;\n"
        + new[n_end:]
    )


def _edited_once(body: str, old: str, new: str) -> str:
    if body.count(old) != 1:
        raise RuntimeError(f"0018's function body changed: {old.strip()!r}")
    return body.replace(old, new)


def accept_function() -> str:
    body: str = _revision_0018().accept_function()  # type: ignore[attr-defined]
    tail = (
        "ORDER BY delivery.id);\n",
        "ORDER BY delivery.id),\n           '{}'::bigint[], false;\n",
    )
    return _two_ways(body, _edited(body, _ONE_EDITS), tail)


def accept_many_function() -> str:
    body: str = _revision_0018().accept_many_function()  # type: ignore[attr-defined]
    tail = (
        "                     WHERE d.receipt_id = r.id), '{}')\n    FROM item i\n",
        "                     WHERE d.receipt_id = r.id), '{}'),\n"
        "           '{}'::bigint[], false\n    FROM item i\n",
    )
    return _two_ways(body, _edited(body, _MANY_EDITS), tail)


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
    op.execute(DROP_MANY_NEW)
    old = _revision_0018()
    op.execute(old.accept_function())  # type: ignore[attr-defined]
    op.execute(old.accept_many_function())  # type: ignore[attr-defined]
    op.execute("DELETE FROM deliveries WHERE status = 'filtered'")
    op.drop_constraint(op.f("ck_deliveries_status"), "deliveries", type_="check")
    op.create_check_constraint(op.f("ck_deliveries_status"), "deliveries", OLD_STATES)
    op.execute("ALTER TABLE routes DROP COLUMN filter")

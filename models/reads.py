"""The CLI's read commands on plain psycopg: SQL text, parameters bound, no ORM.

``events list|show``, ``deliveries show``, ``dead list``, ``sources list`` and ``routes list``
run these, so that a read starts without SQLAlchemy, the schema, Celery or a provider module
(bench/bench_cli.py, tests/test_cli_lazy.py). Each function answers what its namesake in
:mod:`models.queries`, :mod:`models.delivery_history`, :mod:`models.ledger_reads` or the
catalog answers, as the same :mod:`models.views` types (tests/test_reads.py compares them on
one database); those stay the admin API's and the console's. Writes are not here.

Every statement is a SELECT; payloads and secrets are never selected for display (the key
check reads ciphertexts only to decrypt them).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from core.crypto import SecretBox, check_keys
from core.states import DeliveryStatus
from models.views import (
    ARRIVED_VIA_OF,
    DELIVERY_PREFIX,
    EVENT_PREFIX,
    MAX_LIST_LIMIT,
    MAX_RUNS,
    RECEIPT_PREFIX,
    REMOVED_ROUTE,
    AttemptView,
    CatalogError,
    DeadGroup,
    DeliveryDetail,
    DeliveryView,
    EventDetail,
    EventFilter,
    EventSummary,
    KeyOf,
    LedgerEntry,
    LedgerEvent,
    NotFoundError,
    QueryError,
    ReplayAudit,
    _delivery_number_message,
    _event_id_of,
    _fits,
    _outcomes,
    _window,
    check_status,
    glob_to_like,
    is_number,
    merged,
    parse_delivery_ref,
    parse_id,
    receipt_ref,
    replay_marks,
    unsigned_type_of,
)

Conn = psycopg.Connection[Any]

# As models.catalog.KEY_SAMPLE: how many stored secrets of each kind the key check reads.
KEY_SAMPLE = 200
# As models.event_walk: the threshold of a rare status, and how the dead-letter walk grows.
RARE_STATUS_ROWS = 20_000
WALK_FIRST_BATCH = 2
WALK_GROWTH = 4

EVENT_COLUMNS = (
    "r.id, r.expires_at, r.source_id, r.event_id, r.event_type, r.received_at, r.occurred_at,"
    " r.payload_dropped_at"
)
_RECEIPT = """
    SELECT r.id, r.expires_at, s.public_id, s.name, s.provider, r.event_id, r.event_type,
           r.occurred_at, r.received_at, r.content_type,
           octet_length(r.payload) AS payload_bytes, r.payload_dropped_at, r.source_id,
           r.arrived_via, s.config
    FROM receipts r JOIN sources s ON s.id = r.source_id
"""


def check_stored_keys(conn: Conn, box: SecretBox, *, sample: int = KEY_SAMPLE) -> int:
    """:func:`models.catalog.check_stored_keys`: the newest ``sample`` active source secrets,
    route signing secrets and reconciliation credentials decrypt, or KeyMismatch."""
    found: list[bytes] = []
    for query in (
        "SELECT ciphertext FROM source_secrets WHERE revoked_at IS NULL"
        " ORDER BY created_at DESC LIMIT %s",
        "SELECT signing_ciphertext FROM routes WHERE signing_ciphertext IS NOT NULL"
        " ORDER BY id DESC LIMIT %s",
        "SELECT reconcile_ciphertext FROM sources WHERE reconcile_ciphertext IS NOT NULL"
        " ORDER BY id DESC LIMIT %s",
    ):
        found += [bytes(r[0]) for r in conn.execute(query, (sample,)) if r[0] is not None]
    return check_keys(box, found)


def source_id(conn: Conn, ref: str) -> int:
    """:func:`models.catalog.get_source`'s id: by public id, else by an unambiguous name."""
    row = conn.execute("SELECT id FROM sources WHERE public_id = %s LIMIT 1", (ref,)).fetchone()
    if row is not None:
        return int(row.id)
    by_name = conn.execute("SELECT id FROM sources WHERE name = %s", (ref,)).fetchall()
    if len(by_name) == 1:
        return int(by_name[0].id)
    if len(by_name) > 1:
        raise CatalogError(f"source name {ref!r} is ambiguous; use the source id")
    raise CatalogError(f"no such source: {ref!r}")


def source_id_of(conn: Conn, ref: str | None) -> int | None:
    return None if ref is None else source_id(conn, ref)


# Events --------------------------------------------------------------------------------------


def _receipt_conditions(conn: Conn, flt: EventFilter, params: dict[str, Any]) -> list[str]:
    """The filter's conditions on receipts ``r`` (their values put in ``params``)."""
    _window(flt.since, flt.until)
    conds = []
    params["source_id"] = source_id_of(conn, flt.source)
    if params["source_id"] is not None:
        conds.append("r.source_id = %(source_id)s")
    if flt.event_type is not None:
        params["type_like"] = glob_to_like(flt.event_type)
        conds.append("r.event_type LIKE %(type_like)s ESCAPE '\\'")
    if flt.since is not None:
        params["since"] = flt.since
        conds.append("r.received_at >= %(since)s")
    if flt.until is not None:
        params["until"] = flt.until
        conds.append("r.received_at < %(until)s")
    if flt.before is not None:
        params["before_at"], params["before_id"] = flt.before
        conds.append("(r.received_at, r.id) < (%(before_at)s, %(before_id)s)")
    return conds


def _and(conds: Sequence[str]) -> str:
    return "".join(f" AND {c}" for c in conds)


def is_rare_status(conn: Conn, status: str, source: int | None) -> bool:
    """At most RARE_STATUS_ROWS deliveries (of the source) in ``status``."""
    mine = "" if source is None else " AND source_id = %(source)s"
    row = conn.execute(
        "SELECT count(*) AS n FROM (SELECT id FROM deliveries WHERE status = %(status)s"  # noqa: S608 (fragments of this module; values bound)
        f"{mine} LIMIT %(cap)s) p",
        {"status": status, "source": source, "cap": RARE_STATUS_ROWS + 1},
    ).fetchone()
    return row is not None and int(row.n) <= RARE_STATUS_ROWS


def _walk_statement(conds: list[str], after: bool) -> str:
    """:func:`models.event_walk.walk_by_created`'s statement: a batch of a source's dead
    deliveries newest first, each one's receipt probed, the page's receipts and the edge."""
    past = (
        " AND (d.created_at, d.receipt_id, d.expires_at) < (%(after_c)s, %(after_r)s, %(after_e)s)"
        if after
        else ""
    )
    # 'dead' inline, not a parameter: the partial index's predicate must be provable from the
    # statement text, generic plans included.
    return f"""
        WITH walk AS (
            SELECT d.created_at AS walk_created_at, d.receipt_id AS walk_receipt_id,
                   d.expires_at AS walk_expires_at
            FROM deliveries d
            WHERE d.source_id = %(walk_source)s AND d.status = 'dead'{past}
            ORDER BY d.created_at DESC, d.receipt_id DESC, d.expires_at DESC
            LIMIT %(batch)s
        )
        SELECT edge.walk_created_at, edge.walk_receipt_id, edge.walk_expires_at,
               (SELECT count(*) FROM walk) AS walked, top.*, s.public_id, s.name
        FROM (SELECT walk_created_at, walk_receipt_id, walk_expires_at FROM walk
              ORDER BY walk_created_at, walk_receipt_id, walk_expires_at LIMIT 1) edge
        LEFT JOIN (
            SELECT DISTINCT probed.* FROM walk JOIN LATERAL (
                SELECT {EVENT_COLUMNS} FROM receipts r
                WHERE r.id = walk.walk_receipt_id AND r.expires_at = walk.walk_expires_at
                      {_and(conds)}
                LIMIT 1
            ) probed ON true
            ORDER BY probed.received_at DESC, probed.id DESC
            LIMIT %(limit)s
        ) top ON true
        LEFT JOIN sources s ON s.id = top.source_id
    """  # noqa: S608 (fragments of this module; values bound)


def walk_by_created(
    conn: Conn, source: int, conds: list[str], params: dict[str, Any], flt: EventFilter
) -> list[Any]:
    """:func:`models.event_walk.walk_by_created` (its docstring says why the walk may stop)."""
    found: dict[tuple[int, datetime], Any] = {}
    after: tuple[datetime, int, datetime] | None = None
    batch = WALK_FIRST_BATCH * flt.limit
    while True:
        values = {**params, "walk_source": source, "batch": batch, "limit": flt.limit}
        if after is not None:
            values.update(after_c=after[0], after_r=after[1], after_e=after[2])
        rows = conn.execute(_walk_statement(conds, after is not None), values).fetchall()
        for r in rows:
            if r.id is not None:
                found[(r.id, r.expires_at)] = r
        if not rows or rows[0].walked < batch:
            break  # every delivery in the status walked
        last = (rows[0].walk_created_at, rows[0].walk_receipt_id, rows[0].walk_expires_at)
        horizon = last[0]
        if sum(1 for r in found.values() if r.received_at > horizon) >= flt.limit:
            break
        if flt.since is not None and horizon < flt.since:
            break  # everything behind the walk was received before ``since``
        after = last
        batch *= WALK_GROWTH
    ranked = sorted(found.values(), key=lambda r: (r.received_at, r.id), reverse=True)
    return ranked[: flt.limit]


def probe_every_key(
    conn: Conn, status: str, source: int | None, conds: list[str], params: dict[str, Any]
) -> list[Any]:
    """:func:`models.event_walk.probe_every_key`: every delivery in ``status`` (of the source)
    has its receipt probed by its key; the page is the newest of those."""
    mine = "" if source is None else " AND source_id = %(probe_source)s"
    return conn.execute(
        f"""
        SELECT probed.*, s.public_id, s.name
        FROM (SELECT DISTINCT receipt_id, expires_at FROM deliveries
              WHERE status = %(probe_status)s{mine}) k
        JOIN LATERAL (
            SELECT {EVENT_COLUMNS} FROM receipts r
            WHERE r.id = k.receipt_id AND r.expires_at = k.expires_at{_and(conds)}
            LIMIT 1
        ) probed ON true
        JOIN sources s ON s.id = probed.source_id
        ORDER BY probed.received_at DESC, probed.id DESC
        LIMIT %(limit)s
        """,  # noqa: S608 (fragments of this module; values bound)
        {**params, "probe_status": status, "probe_source": source},
    ).fetchall()


def list_events(conn: Conn, flt: EventFilter) -> list[EventSummary]:
    """:func:`models.queries.list_events`: newest first, with their deliveries' states."""
    check_status(flt.status)
    if not 1 <= flt.limit <= MAX_LIST_LIMIT:
        raise QueryError(f"--limit must be between 1 and {MAX_LIST_LIMIT}")
    params: dict[str, Any] = {"limit": flt.limit}
    conds = _receipt_conditions(conn, flt, params)
    source = None if flt.status is None else source_id_of(conn, flt.source)
    rows: list[Any]
    if flt.status is not None and is_rare_status(conn, flt.status, source):
        if source is not None and flt.status == DeliveryStatus.DEAD:
            rows = walk_by_created(conn, source, conds, params, flt)
        else:
            rows = probe_every_key(conn, flt.status, source, conds, params)
    else:
        if flt.status is not None:
            params["status"] = flt.status
            conds.append(
                "EXISTS (SELECT 1 FROM deliveries d WHERE d.receipt_id = r.id"
                " AND d.expires_at = r.expires_at AND d.status = %(status)s)"
            )
        rows = conn.execute(
            f"""
            SELECT found.*, s.public_id, s.name
            FROM (SELECT {EVENT_COLUMNS} FROM receipts r WHERE true{_and(conds)}) found
            JOIN sources s ON s.id = found.source_id
            ORDER BY found.received_at DESC, found.id DESC
            LIMIT %(limit)s
            """,  # noqa: S608 (fragments of this module; values bound)
            params,
        ).fetchall()
    counts: dict[int, dict[str, int]] = {r.id: {} for r in rows}
    if rows:
        keys = sql.SQL(", ").join(
            sql.SQL("({}, {})").format(r.id, r.expires_at) for r in rows
        )  # a row list, as the ORM wrote it: each key's partition is pruned
        query = sql.SQL(
            "SELECT receipt_id, status, count(*) AS n FROM deliveries"
            " WHERE (receipt_id, expires_at) IN ({}) GROUP BY receipt_id, status"
        ).format(keys)
        for c in conn.execute(query):
            counts[c.receipt_id][c.status] = int(c.n)
    return [
        EventSummary(
            id=r.id,
            source=r.public_id,
            source_name=r.name,
            event_id=r.event_id,
            event_type=r.event_type,
            received_at=r.received_at,
            occurred_at=r.occurred_at,
            deliveries=counts[r.id],
            payload_dropped=r.payload_dropped_at is not None,
        )
        for r in rows
    ]


def _exists(conn: Conn, table: str, column: str, value: object) -> bool:
    query = sql.SQL("SELECT 1 FROM {} WHERE {} = %s LIMIT 1").format(
        sql.Identifier(table), sql.Identifier(column)
    )
    return conn.execute(query, (value,)).fetchone() is not None


def _by_event_id(conn: Conn, event_id: str, source: str | None) -> list[Any]:
    """The newest receipt of this provider event id per source (older ones expired)."""
    mine = ""
    params: dict[str, Any] = {"event_id": event_id}
    if source is not None:
        params["source_id"] = source_id(conn, source)
        mine = " AND r.source_id = %(source_id)s"
    newest: dict[int, Any] = {}
    rows = conn.execute(
        f"{_RECEIPT} WHERE r.event_id = %(event_id)s{mine} ORDER BY r.received_at DESC LIMIT 50",
        params,
    )
    for row in rows:
        newest.setdefault(row.source_id, row)
    return list(newest.values())


def _find_receipt(conn: Conn, ref: str | int, source: str | None) -> Any:
    """:func:`models.queries._find_receipt`: the receipt an operator means; refuses a bare
    number that could mean something else."""
    key = str(ref).strip()
    receipt_id: int | None = None
    event_id: str | None = None
    if key.startswith(RECEIPT_PREFIX) and key[len(RECEIPT_PREFIX) :].isdigit():
        receipt_id = parse_id(key[len(RECEIPT_PREFIX) :], "receipt id")
    elif key.startswith(DELIVERY_PREFIX) and key[len(DELIVERY_PREFIX) :].isdigit():
        delivery_id = parse_id(key[len(DELIVERY_PREFIX) :], "delivery id")
        found = conn.execute(
            "SELECT receipt_id FROM deliveries WHERE id = %s LIMIT 1", (delivery_id,)
        ).fetchone()
        if found is None:
            raise NotFoundError(f"no such delivery: {delivery_id}")
        receipt_id = found.receipt_id
    elif key.startswith(EVENT_PREFIX):
        event_id = key[len(EVENT_PREFIX) :]
    elif is_number(key) and _fits(key):  # a larger number is a provider event id
        number = int(key)
        is_receipt = _exists(conn, "receipts", "id", number)
        is_delivery = _exists(conn, "deliveries", "id", number)
        is_event = _exists(conn, "receipts", "event_id", key)
        if is_delivery:
            raise QueryError(
                _delivery_number_message(number, is_receipt or is_event), "ambiguous_id"
            )
        if is_receipt and is_event:
            raise QueryError(
                f"{number} is both receipt {number} and a provider event id: use "
                f"{RECEIPT_PREFIX}{number} or {EVENT_PREFIX}{number}",
                "ambiguous_id",
            )
        if is_receipt:
            receipt_id = number
        else:
            event_id = key
    else:
        event_id = key
    if receipt_id is not None:
        if source is not None:
            raise QueryError("--source goes with a provider event id, not a receipt id")
        rows = conn.execute(
            f"{_RECEIPT} WHERE r.id = %s ORDER BY r.received_at DESC LIMIT 1", (receipt_id,)
        ).fetchall()
    else:
        assert event_id is not None
        rows = _by_event_id(conn, event_id, source)
        if len(rows) > 1:
            names = ", ".join(sorted(r.public_id for r in rows))
            raise QueryError(
                f"event id {event_id!r} exists in several sources ({names}); add --source, "
                f"or use the receipt id ({', '.join(receipt_ref(r.id) for r in rows)})",
                "ambiguous_id",
            )
    if not rows:
        raise NotFoundError(f"no such event: {key!r}")
    return rows[0]


def get_event(conn: Conn, ref: str | int, *, source: str | None = None) -> EventDetail:
    """:func:`models.queries.get_event`."""
    r = _find_receipt(conn, ref, source)
    return EventDetail(
        id=r.id,
        source=r.public_id,
        source_name=r.name,
        provider=r.provider,
        event_id=r.event_id,
        event_type=r.event_type,
        occurred_at=r.occurred_at,
        received_at=r.received_at,
        expires_at=r.expires_at,
        content_type=r.content_type,
        payload_bytes=r.payload_bytes,
        payload_dropped_at=r.payload_dropped_at,
        deliveries=delivery_views(conn, r),
        arrived_via=r.arrived_via,
        type_unsigned=unsigned_type_of(r.provider, r.config, r.event_type, r.arrived_via),
    )


def get_event_or_ledger(
    conn: Conn, ref: str | int, *, source: str | None = None
) -> EventDetail | LedgerEvent:
    """:func:`models.ledger_reads.get_event`: the receipt while it lives, else what the
    processed-events ledger kept of the event; NotFoundError when neither has it."""
    try:
        return get_event(conn, ref, source=source)
    except NotFoundError:
        event_id = _event_id_of(ref)
        if not event_id:
            raise
        runs = ledger_find(conn, event_id, source_id_of(conn, source))
        if not runs:
            raise
        sources = sorted({r.source for r in runs})
        if len(sources) > 1:
            raise QueryError(
                f"event id {event_id!r} is in the ledger of several sources "
                f"({', '.join(sources)}); add --source",
                "ambiguous_id",
            ) from None
        return LedgerEvent(source=sources[0], event_id=event_id, runs=runs)


# As models.ledger_reads._FIND: the event id's rows, by the index on its hash.
_LEDGER_FIND = """
    SELECT l.received_at, s.public_id, s.name, s.provider, l.event_id, k.event_type,
           l.digest, l.outcomes, k.via
    FROM ledger l
    JOIN ledger_kinds k ON k.id = l.kind
    JOIN sources s ON s.id = k.source_id
    WHERE hashtextextended(l.event_id, 0) = hashtextextended(%(e)s, 0) AND l.event_id = %(e)s
      AND (CAST(%(s)s AS bigint) IS NULL OR k.source_id = %(s)s)
    ORDER BY l.received_at DESC, s.public_id
    LIMIT 500
"""


def ledger_find(conn: Conn, event_id: str, source: int | None = None) -> list[LedgerEntry]:
    """:func:`models.ledger_reads.find`: the ledger's receipts of this event id, newest
    first, each with its rows merged."""
    receipts: dict[tuple[str, datetime], list[Any]] = {}
    for r in conn.execute(_LEDGER_FIND, {"e": event_id, "s": source}):
        receipts.setdefault((r.public_id, r.received_at), []).append(r)
    runs = list(receipts.values())[:MAX_RUNS]
    finals = [merged([r.outcomes for r in rows]) for rows in runs]
    route_ids = sorted({route for final in finals for route in final})
    handlers: dict[int, str] = {}
    if route_ids:
        for h in conn.execute("SELECT id, handler FROM routes WHERE id = ANY(%s)", (route_ids,)):
            handlers[int(h.id)] = str(h.handler)
    return [
        LedgerEntry(
            source=rows[0].public_id,
            source_name=rows[0].name,
            provider=rows[0].provider,
            event_id=rows[0].event_id,
            event_type=rows[0].event_type,
            received_at=rows[0].received_at,
            digest=None if rows[0].digest is None else bytes(rows[0].digest).hex(),
            arrived_via=ARRIVED_VIA_OF.get(str(rows[0].via), "webhook"),
            outcomes=_outcomes(final, handlers),
        )
        for rows, final in zip(runs, finals, strict=True)
    ]


# Deliveries ----------------------------------------------------------------------------------

_DELIVERY_COLUMNS = (
    "d.id, d.route_id, d.status, d.attempts, d.attempt_base, d.generation, d.dead_reason,"
    " d.last_error_class, d.last_error, d.next_attempt_at, d.created_at, d.updated_at,"
    " d.succeeded_at, d.result_ref"
)


def delivery_views(conn: Conn, r: Any, *, only: int | None = None) -> list[DeliveryView]:
    """:func:`models.delivery_history.delivery_views`: a receipt's deliveries (or one) with
    their attempts in time order and the replays that split them into runs."""
    params: dict[str, Any] = {"receipt": r.id, "expires": r.expires_at, "only": only}
    mine = "" if only is None else " AND d.id = %(only)s"
    deliveries = conn.execute(
        f"SELECT {_DELIVERY_COLUMNS}, coalesce(rt.handler, %(removed)s) AS handler"  # noqa: S608 (fragments of this module; values bound)
        " FROM deliveries d LEFT JOIN routes rt ON rt.id = d.route_id"
        f" WHERE d.receipt_id = %(receipt)s AND d.expires_at = %(expires)s{mine} ORDER BY d.id",
        {**params, "removed": REMOVED_ROUTE},
    ).fetchall()
    if not deliveries:
        return []
    attempts: dict[int, list[AttemptView]] = {d.id: [] for d in deliveries}
    for a in conn.execute(
        "SELECT delivery_id, number, generation, worker, started_at, ended_at, outcome,"
        " error_class, error_message, committed_at FROM attempts"
        " WHERE delivery_id = ANY(%(ids)s) AND expires_at = %(expires)s"
        # Time order; the number breaks ties (it only grows, across replays too).
        " ORDER BY delivery_id, started_at, number, id",
        {"ids": list(attempts), "expires": r.expires_at},
    ):
        attempts[a.delivery_id].append(
            AttemptView(
                a.number,
                a.generation,
                a.worker,
                a.started_at,
                a.ended_at,
                a.outcome,
                a.error_class,
                a.error_message,
                a.committed_at,
            )
        )
    audit = _replays_since(conn, min(d.created_at for d in deliveries), list(attempts))
    return [
        DeliveryView(
            id=d.id,
            route_id=d.route_id,
            handler=d.handler,
            status=d.status,
            attempts=d.attempts,
            attempts_since_replay=d.attempts - d.attempt_base,
            generation=d.generation,
            dead_reason=d.dead_reason,
            last_error_class=d.last_error_class,
            last_error=d.last_error,
            next_attempt_at=d.next_attempt_at,
            created_at=d.created_at,
            updated_at=d.updated_at,
            succeeded_at=d.succeeded_at,
            result_ref=d.result_ref,
            attempt_log=attempts[d.id],
            replays=replay_marks(
                attempts[d.id],
                [a for a in audit if a.could_have_moved(d.id, r.public_id, r.name, r.event_type)],
                attempt_base=d.attempt_base,
            ),
        )
        for d in deliveries
    ]


def _replays_since(conn: Conn, since: datetime, ids: list[int]) -> list[ReplayAudit]:
    """The replays since ``since`` that could have moved one of ``ids``: filter replays, and
    the ones naming one of them."""
    rows = conn.execute(
        "SELECT id, operator, reason, via, started_at, rerun_succeeded, filter FROM replays"
        " WHERE started_at >= %(since)s AND (NOT (filter ? 'ids') OR EXISTS ("
        "   SELECT 1 FROM unnest(%(ids)s::bigint[]) AS i(id)"
        "   WHERE filter -> 'ids' @> jsonb_build_array(i.id)))"
        " ORDER BY started_at, id",
        {"since": since, "ids": ids},
    )
    return [
        ReplayAudit(r.id, r.operator, r.reason, r.via, r.started_at, r.rerun_succeeded, r.filter)
        for r in rows
    ]


def get_delivery(conn: Conn, ref: str | int, *, key_of: KeyOf | None = None) -> DeliveryDetail:
    """:func:`models.queries.get_delivery`: by delivery id (``11`` or ``delivery:11``)."""
    delivery_id = parse_delivery_ref(ref)
    found = conn.execute(
        "SELECT receipt_id, expires_at FROM deliveries WHERE id = %s LIMIT 1", (delivery_id,)
    ).fetchone()
    if found is None:
        hint = ""
        if _exists(conn, "receipts", "id", delivery_id):
            ref = receipt_ref(delivery_id)
            hint = f" ({ref} is an event: webhooks events show {ref})"
        raise NotFoundError(f"no such delivery: {delivery_id}{hint}")
    r = conn.execute(
        f"{_RECEIPT} WHERE r.id = %s AND r.expires_at = %s ORDER BY r.received_at DESC LIMIT 1",
        (found.receipt_id, found.expires_at),
    ).fetchone()
    if r is None:  # the ORM's .one(): a delivery's receipt exists
        raise NotFoundError(f"no such event: receipt {found.receipt_id}")
    [view] = delivery_views(conn, r, only=delivery_id)
    route = conn.execute(
        "SELECT events_glob, active FROM routes WHERE id = %s", (view.route_id,)
    ).fetchone()
    key = key_of(r.source_id, r.event_id, view.route_id, view.generation) if key_of else None
    return DeliveryDetail(
        id=view.id,
        receipt=receipt_ref(r.id),
        receipt_id=r.id,
        source=r.public_id,
        source_name=r.name,
        provider=r.provider,
        event_id=r.event_id,
        event_type=r.event_type,
        received_at=r.received_at,
        route_events=None if route is None else route.events_glob,
        route_active=None if route is None else route.active,
        idempotency_key=key,
        delivery=view,
    )


def dead_letters(conn: Conn, *, source: str | None = None, samples: int = 5) -> list[DeadGroup]:
    """:func:`models.queries.dead_letters`: grouped by source, route and reason; largest
    groups first."""
    params: dict[str, Any] = {"dead": DeliveryStatus.DEAD.value, "removed": REMOVED_ROUTE}
    params["source_id"] = source_id_of(conn, source)
    mine = "" if params["source_id"] is None else " AND d.source_id = %(source_id)s"
    rows = conn.execute(
        f"""
        SELECT s.public_id, s.name, d.route_id, coalesce(rt.handler, %(removed)s) AS handler,
               d.dead_reason, count(*) AS n, min(d.updated_at) AS oldest,
               max(d.updated_at) AS newest,
               array_remove(array_agg(DISTINCT d.last_error_class), NULL) AS errors,
               array_agg(DISTINCT d.id) AS ids
        FROM deliveries d
        JOIN sources s ON s.id = d.source_id
        LEFT JOIN routes rt ON rt.id = d.route_id
        WHERE d.status = %(dead)s{mine}
        GROUP BY s.public_id, s.name, d.route_id, coalesce(rt.handler, %(removed)s),
                 d.dead_reason
        ORDER BY count(*) DESC, s.public_id, d.route_id
        """,  # noqa: S608 (fragments of this module; values bound)
        params,
    )
    return [
        DeadGroup(
            source=r.public_id,
            source_name=r.name,
            route_id=r.route_id,
            handler=r.handler,
            reason=r.dead_reason,
            count=r.n,
            oldest=r.oldest,
            newest=r.newest,
            error_classes=sorted(r.errors or []),
            sample_ids=sorted(r.ids or [], reverse=True)[:samples],
        )
        for r in rows
    ]


# Sources and routes --------------------------------------------------------------------------

_SOURCE_COLUMNS = (
    "id, public_id, account, name, provider, config, tolerance_s, max_body_bytes,"
    " retry_window_s, queue_lag_s, clock_skew_s, replay_grace_s, active, created_at,"
    " reconcile_ciphertext, reconcile_every_s, reconciled_at"
)
# Every column of routes but the signing secret's ciphertext.
_ROUTE_COLUMNS = (
    "rt.id, rt.source_id, rt.handler, rt.events_glob, rt.events_like, rt.options,"
    " rt.max_attempts, rt.max_age_s, rt.active, rt.created_at, rt.paused_at, rt.pause_reason,"
    " rt.breaker_state, rt.breaker_opened_at, rt.breaker_probe_at, rt.probe_delivery,"
    " rt.breaker_trips, rt.window_started_at, rt.window_requests, rt.window_failures,"
    " rt.max_in_flight, rt.released_at, rt.rate_count, rt.rate_period_s, rt.disabled_at,"
    " rt.disabled_reason, rt.filter, rt.transform, rt.order_key, rt.lane_on_dead,"
    " rt.supersede"
)


def list_sources(conn: Conn) -> list[Any]:
    """Every source by id: the columns of :class:`models.schema.Source` (the reconciliation
    credential's ciphertext only says whether one is set: it is never shown)."""
    return conn.execute(f"SELECT {_SOURCE_COLUMNS} FROM sources ORDER BY id").fetchall()  # noqa: S608 (fragments of this module; values bound)


def list_routes(conn: Conn, source: int) -> list[Any]:
    """A source's routes by id: :class:`models.schema.Route`'s columns but its secret."""
    return conn.execute(
        f"SELECT {_ROUTE_COLUMNS} FROM routes rt WHERE rt.source_id = %s ORDER BY rt.id",  # noqa: S608 (fragments of this module; values bound)
        (source,),
    ).fetchall()


def list_all_routes(conn: Conn) -> list[Any]:
    """Every route with its source's ``source_public_id`` and ``source_name``, by source then
    route id (:func:`models.route_catalog.list_all_routes`)."""
    return conn.execute(
        f"SELECT s.public_id AS source_public_id, s.name AS source_name, {_ROUTE_COLUMNS}"  # noqa: S608 (fragments of this module; values bound)
        " FROM sources s JOIN routes rt ON rt.source_id = s.id ORDER BY s.id, rt.id"
    ).fetchall()

"""Events filtered by a rare delivery status: which receipts to read, and how.

:func:`models.queries.list_events` starts from the deliveries when few are in the status
asked for (:func:`is_rare_status`): a source's dead letters are walked newest first
(:func:`walk_by_created`), any other rare status has every key probed (:func:`probe_every_key`).
:mod:`models.reads` runs the same statements on plain psycopg for the CLI (with these
constants: tests/test_cli_lazy.py holds both to one answer).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, literal_column, select, true, tuple_
from sqlalchemy.orm import Session

from models.schema import (
    Delivery,
    Receipt,
    Source,
)

# Events filtered by a delivery status: when at most this many deliveries (of the source) are
# in that status, the query starts from them; above it, the status is common and walking the
# receipts newest first with an EXISTS per receipt finds a page sooner. For a source's dead
# deliveries (the dead-letter view, and the floor of issue 21) it walks them newest first and
# stops after a page (walk_by_created, on a partial index the hot path never writes); for
# another rare status, or without a source, it reads every delivery in the status (of the
# source), probes each one's receipt and sorts those.
# (Benchmark and plans: bench/results_console.txt.)
RARE_STATUS_ROWS = 20_000


# The walk reads the index in batches: the first of WALK_FIRST_BATCH x the page size, each
# next one WALK_GROWTH times larger, so a page needs one statement when the receipts it finds
# pass the other filters, and a handful when few do.
WALK_FIRST_BATCH = 2


WALK_GROWTH = 4


def is_rare_status(session: Session, status: str, source_id: int | None) -> bool:
    """At most RARE_STATUS_ROWS deliveries (of the source) in ``status``: an index-only count
    that stops one row past the threshold."""
    conds: list[Any] = [Delivery.status == status]
    if source_id is not None:
        conds.append(Delivery.source_id == source_id)
    probe = select(Delivery.id).where(*conds).limit(RARE_STATUS_ROWS + 1).subquery()
    found = session.execute(select(func.count()).select_from(probe)).scalar_one()
    return bool(found <= RARE_STATUS_ROWS)


EVENT_COLUMNS = (
    Receipt.id,
    Receipt.expires_at,
    Receipt.source_id,
    Receipt.event_id,
    Receipt.event_type,
    Receipt.received_at,
    Receipt.occurred_at,
    Receipt.payload_dropped_at,
)


def walk_by_created(
    session: Session,
    source_id: int,
    conds: list[Any],
    limit: int,
    since: datetime | None,
) -> list[Any]:
    """The first ``limit`` receipts (newest first by received_at, id) meeting ``conds`` that
    have a dead delivery of the source: exactly what probing every such delivery's
    receipt and sorting would return, reading only the newest deliveries.

    The walk reads the deliveries newest first by created_at (ix_deliveries_source_dead,
    index-only) and probes each one's receipt by its key. A delivery is never created before
    its receipt was received: ``webhooks_accept`` and ``webhooks_accept_many`` (the only
    writers of deliveries) stamp both columns from one instant, and nothing updates either
    (tests/test_console_queries.py checks both functions). So once the walk is at created_at
    ``c``, every receipt it has not reached was received at or before ``c``, and it can stop
    as soon as ``limit`` receipts found were received after ``c``: those outrank every receipt
    behind it. It does not rely on the two instants being equal, only on the order: a
    delivery created later than its receipt only makes the walk go deeper. Cursor pages
    (``conds`` holds the cursor) walk from the newest again, which costs at most what reading
    every key costs; ``since`` ends the walk once it is past it."""
    walked = (Delivery.created_at, Delivery.receipt_id, Delivery.expires_at)
    found: dict[tuple[int, datetime], Any] = {}
    after: tuple[datetime, int, datetime] | None = None
    batch = WALK_FIRST_BATCH * limit
    while True:
        # 'dead' inline, not a parameter: the partial index's predicate must be provable
        # from the statement text, generic plans included.
        where: list[Any] = [
            Delivery.source_id == source_id,
            Delivery.status == literal_column("'dead'"),
        ]
        if after is not None:
            where.append(tuple_(*walked) < tuple_(*after))
        keys = (
            select(
                Delivery.created_at.label("walk_created_at"),
                Delivery.receipt_id.label("walk_receipt_id"),
                Delivery.expires_at.label("walk_expires_at"),
            )
            .where(*where)
            .order_by(*(c.desc() for c in walked))
            .limit(batch)
            .cte("walk")
        )
        key_columns = (keys.c.walk_created_at, keys.c.walk_receipt_id, keys.c.walk_expires_at)
        # One receipt per key (LATERAL, pruned to its partition at run time), or none when it
        # fails the other filters; of those only the batch's first ``limit`` can be on the
        # page, so only they leave the database.
        receipt = (
            select(*EVENT_COLUMNS)
            .where(
                Receipt.id == keys.c.walk_receipt_id,
                Receipt.expires_at == keys.c.walk_expires_at,
                *conds,
            )
            .limit(1)
            .lateral()
        )
        top = (
            select(receipt)
            .select_from(keys.join(receipt, true()))
            .distinct()  # a receipt with two deliveries in the status is one row of the page
            .order_by(receipt.c.received_at.desc(), receipt.c.id.desc())
            .limit(limit)
            .subquery()
        )
        # Where the batch ended (its oldest key) and how many keys it read.
        edge = select(*key_columns).order_by(*key_columns).limit(1).subquery()
        size = select(func.count()).select_from(keys).scalar_subquery()
        rows = session.execute(
            select(edge, size.label("walked"), top, Source.public_id, Source.name).select_from(
                edge.outerjoin(top, true()).outerjoin(Source, Source.id == top.c.source_id)
            )
        ).all()
        for r in rows:
            if r.id is not None:
                found[(r.id, r.expires_at)] = r
        if not rows or rows[0].walked < batch:
            break  # every delivery in the status walked
        last = (rows[0].walk_created_at, rows[0].walk_receipt_id, rows[0].walk_expires_at)
        horizon = last[0]
        if sum(1 for r in found.values() if r.received_at > horizon) >= limit:
            break
        if since is not None and horizon < since:
            break  # everything behind the walk was received before ``since``
        after = last
        batch *= WALK_GROWTH
    ranked = sorted(found.values(), key=lambda r: (r.received_at, r.id), reverse=True)
    return ranked[:limit]


def probe_every_key(
    session: Session, status: str, source_id: int | None, conds: list[Any], limit: int
) -> list[Any]:
    """The first ``limit`` receipts (newest first) meeting ``conds`` that have a delivery in
    ``status`` (of the source, or any source): every such delivery's receipt probed by its
    key, then sorted."""
    where: list[Any] = [Delivery.status == status]
    if source_id is not None:
        where.append(Delivery.source_id == source_id)  # ix_deliveries_source_status
    keys = select(Delivery.receipt_id, Delivery.expires_at).where(*where).distinct().subquery()
    # One receipt per key: a delivery's receipt is the one with its (id, expires_at).
    probed = (
        select(*EVENT_COLUMNS)
        .where(Receipt.id == keys.c.receipt_id, Receipt.expires_at == keys.c.expires_at, *conds)
        .limit(1)
        .lateral()
    )
    query = (
        select(probed, Source.public_id, Source.name)
        .select_from(keys.join(probed, true()).join(Source, Source.id == probed.c.source_id))
        .order_by(probed.c.received_at.desc(), probed.c.id.desc())
        .limit(limit)
    )
    return list(session.execute(query).all())

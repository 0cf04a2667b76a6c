"""The admin API's reads: events, deliveries and dead letters (``GET``; no change made)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ingest.admin.deps import Db, State, parse_time
from ingest.admin.schemas import NOT_FOUND
from models import ledger_reads, queries
from models.ledger_reads import LedgerEvent
from models.queries import DeadGroup, DeliveryDetail, EventDetail, EventFilter, EventSummary
from tasks.context import idempotency_key

router = APIRouter()


@router.get("/events", tags=["events"], summary="List events, newest first")
def list_events(
    session: Db,
    state: State,
    source: Annotated[str | None, Query(description="Source id or name.")] = None,
    type: Annotated[str | None, Query(description="Event type, globs allowed.")] = None,
    status: Annotated[
        str | None, Query(description="Events with a delivery in this state.")
    ] = None,
    since: Annotated[
        str | None, Query(description="Received at or after (ISO time, or `2h` ago).")
    ] = None,
    until: Annotated[
        str | None, Query(description="Received before (ISO time, or `30m` ago).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=queries.MAX_LIST_LIMIT)] = 50,
) -> list[EventSummary]:
    """Received events with the count of their deliveries in each state."""
    return queries.list_events(
        session,
        EventFilter(
            source, type, status, parse_time(state, since), parse_time(state, until), limit
        ),
    )


@router.get(
    "/events/{event}",
    tags=["events"],
    summary="Show one event",
    responses=NOT_FOUND,
)
def show_event(
    event: str,
    session: Db,
    source: Annotated[
        str | None, Query(description="The source, when several have this event id.")
    ] = None,
) -> EventDetail | LedgerEvent:
    """The receipt, its deliveries and every attempt with its error; once the receipt has
    expired (its dedup TTL), what the processed-events ledger kept of the event
    (`found_in: ledger`, each receipt of it with each route's outcome). `event` is
    `receipt:N`, `delivery:N` (that delivery's event), `event:ID` or a provider event id;
    a bare number that is a delivery id is refused (400, `ambiguous_id`): look it up with
    `GET /deliveries/{id}`. A bare number beyond a bigint is refused (400,
    `out_of_range`): a provider event id of that form is `event:ID`. The payload's size
    is shown, never its content."""
    bare = event.strip()
    if queries.is_number(bare):
        try:
            queries.parse_id(bare, "receipt id")
        except queries.QueryError:
            raise queries.QueryError(
                f"receipt id out of range (at most {queries.MAX_ID}); a provider event id "
                "of this form is looked up as event:ID",
                "out_of_range",
            ) from None
    return ledger_reads.get_event(session, event, source=source)


@router.get(
    "/deliveries/{delivery}",
    tags=["deliveries"],
    summary="Show one delivery",
    responses=NOT_FOUND,
)
def show_delivery(delivery: str, session: Db) -> DeliveryDetail:
    """A delivery by the id Flower, the logs and `GET /dead` show (`11` or `delivery:11`):
    its event, route and handler, status, attempts in time order with the replays that
    split them, dead reason and downstream idempotency key."""
    return queries.get_delivery(session, delivery, key_of=idempotency_key)


@router.get("/dead", tags=["dead letters"], summary="Dead letters, grouped")
def dead(
    session: Db,
    source: Annotated[str | None, Query(description="Source id or name.")] = None,
) -> list[DeadGroup]:
    """Dead deliveries grouped by source, route and reason, with counts and recent ids."""
    return queries.dead_letters(session, source=source)

"""The console's events: the list (filters, search by id, pages by cursor) and one event
with its deliveries and its payload, shown (never run) and cut at 256 KiB; once its receipt
has expired, what the processed-events ledger kept of it (``/console/ledger``)."""

from __future__ import annotations

from datetime import datetime
from urllib.parse import urlencode

import orjson
from starlette.responses import Response
from starlette.routing import Route

from ingest.console.base import Console, Visit, args_of, opt, parse_when, redirect
from models import console as reads
from models import ledger_reads, queries
from models.catalog import CatalogError
from models.ledger_reads import LedgerEvent
from models.queries import EventDetail, EventFilter

PAGE_SIZE = 50
MAX_PAYLOAD_SHOWN = 256 * 1024


def routes(c: Console) -> list[Route]:
    return [c.get("/events", events), c.get("/events/{receipt}", event), c.get("/ledger", ledger)]


async def events(c: Console, v: Visit) -> Response:
    p = v.request.query_params
    args = args_of(p, ("source", "type", "status", "since", "until", "q"))
    try:
        if args["q"]:
            ref = opt(args["q"])
            assert ref is not None
            found = await c.db(lambda s: ledger_reads.get_event(s, ref, source=opt(args["source"])))
            return redirect(_page_of(found))
        now = await c.db(reads.db_now)
        flt = EventFilter(
            opt(args["source"]),
            opt(args["type"]),
            opt(args["status"]),
            parse_when(args["since"], now),
            parse_when(args["until"], now),
            PAGE_SIZE,
            _cursor(p.get("before")),
        )
        rows = await c.db(lambda s: queries.list_events(s, flt))
    except (queries.QueryError, CatalogError) as exc:
        return c.show(
            v,
            "events.html",
            {"args": args, "rows": [], "next": None, "message": str(exc)},
            400,
        )
    next_url = None
    if len(rows) == PAGE_SIZE:
        last = rows[-1]
        kept = {k: val for k, val in args.items() if val and k != "q"}
        kept["before"] = f"{last.received_at.isoformat()}_{last.id}"
        next_url = "/console/events?" + urlencode(kept)
    return c.show(v, "events.html", {"args": args, "rows": rows, "next": next_url, "message": None})


async def event(c: Console, v: Visit) -> Response:
    try:
        rid = queries.parse_id(v.request.path_params["receipt"], "receipt id")
        detail = await c.db(lambda s: queries.get_event(s, queries.receipt_ref(rid)))
    except queries.NotFoundError as exc:
        return c.error(v, str(exc), 404)
    except queries.QueryError as exc:
        return c.error(v, str(exc))
    stored = await c.db(lambda s: reads.payload(s, rid))
    body = None if stored.body is None else _pretty(stored.body)
    return c.show(v, "event.html", {"e": detail, "body": body, "stored": stored})


def _page_of(found: EventDetail | LedgerEvent) -> str:
    """The event's page: its receipt's while it lives, else the ledger's."""
    if isinstance(found, LedgerEvent):
        return "/console/ledger?" + urlencode({"event": found.event_id, "source": found.source})
    return f"/console/events/{found.id}"


async def ledger(c: Console, v: Visit) -> Response:
    """An event whose receipt expired, from the processed-events ledger (a live receipt's
    event goes to its own page)."""
    args = args_of(v.request.query_params, ("event", "source"))
    try:
        event_id = opt(args["event"])
        if event_id is None:
            raise queries.QueryError("which event? (?event=ID)", "bad_input")
        found = await c.db(
            lambda s: ledger_reads.get_event(s, f"event:{event_id}", source=opt(args["source"]))
        )
    except queries.NotFoundError as exc:
        return c.error(v, str(exc), 404)
    except (queries.QueryError, CatalogError) as exc:
        return c.error(v, str(exc))
    if not isinstance(found, LedgerEvent):
        return redirect(_page_of(found))
    return c.show(v, "ledger.html", {"e": found})


def _cursor(text: str | None) -> tuple[datetime, int] | None:
    if not text:
        return None
    when, _, rid = text.rpartition("_")
    try:
        return datetime.fromisoformat(when), queries.parse_id(rid, "cursor")
    except (ValueError, queries.QueryError):
        raise queries.QueryError("bad cursor", "bad_input") from None


def _pretty(body: bytes) -> str:
    shown = body[:MAX_PAYLOAD_SHOWN]
    try:
        text = orjson.dumps(orjson.loads(shown), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        text = shown.decode("utf-8", errors="replace")
    if len(body) > MAX_PAYLOAD_SHOWN:
        text += f"\n... ({len(body) - MAX_PAYLOAD_SHOWN} more bytes not shown)"
    return text

"""``webhooks events list|show`` and ``webhooks deliveries show``: look up any id an operator
sees.

Receipts and deliveries are numbered by two sequences, so one number can be both. Flower, the
logs and ``dead list`` show delivery ids (``deliveries show 11``); ``events list`` prints
receipts as ``receipt:12`` and ``events show`` takes that, ``delivery:11``, ``event:ID`` or a
provider event id (``--source`` when several sources have it), and refuses a bare number that
is a delivery id rather than show another event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from core.states import DeliveryStatus
from webhooks.cli.common import console, env, handle_errors, print_json
from webhooks.cli.render import (
    JsonOpt,
    SourceOpt,
    fitted,
    parse_when,
    plain,
    print_delivery,
    row,
    say,
    stamp,
    when,
    whole,
)

if TYPE_CHECKING:
    from models.views import LedgerEvent

events_app = typer.Typer(
    help="Received events, their deliveries and attempts.", no_args_is_help=True
)
deliveries_app = typer.Typer(
    help="One delivery (an event on one route): the id Flower, the logs and `dead list` show.",
    no_args_is_help=True,
)

TypeOpt = Annotated[str | None, typer.Option("--type", help="Event type, globs allowed: invoice.*")]
SinceOpt = Annotated[
    str | None,
    typer.Option("--since", help="Received at or after: ISO time, or 2h for 2 hours ago."),
]
UntilOpt = Annotated[
    str | None,
    typer.Option("--until", help="Received before: ISO time, or 30m for 30 minutes ago."),
]


@events_app.command("list")
@handle_errors
def events_list(
    *,
    source: SourceOpt = None,
    event_type: TypeOpt = None,
    status: Annotated[
        str | None, typer.Option("--status", help="Events with a delivery in this state.")
    ] = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List received events, newest first, with their deliveries' states."""
    from models import reads
    from models.views import EventFilter, receipt_ref

    e = env()
    flt = EventFilter(source, event_type, status, parse_when(e, since), parse_when(e, until), limit)
    with e.reads() as conn:
        rows = reads.list_events(conn, flt)
    if as_json:
        print_json([plain(r) for r in rows])
        return
    table = Table(
        "receipt", "received (UTC)", "source", "type", "event id", "deliveries", title="events"
    )
    for r in rows:
        states = ", ".join(f"{k} {v}" for k, v in sorted(r.deliveries.items())) or "none"
        if r.payload_dropped:
            states += " (payload dropped)"
        row(
            table,
            receipt_ref(r.id),
            stamp(r.received_at),
            r.source_name,
            r.event_type,
            r.event_id,
            states,
        )
    console.print(fitted(whole(table, "receipt", "received (UTC)", "source", "type", "event id")))
    if not rows:
        console.print("no events match")
    else:
        say("show one: webhooks events show receipt:N (or its event id)")


@events_app.command("show")
@handle_errors
def events_show(
    event: Annotated[
        str,
        typer.Argument(
            metavar="EVENT",
            help=(
                "receipt:N (from `events list`), a provider event id, event:ID, or delivery:N "
                "for a delivery's event. A bare number that is a delivery id is refused: use "
                "`webhooks deliveries show N`."
            ),
        ),
    ],
    source: Annotated[
        str | None,
        typer.Option("--source", help="The source, when several have this event id."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """One event: the receipt, its deliveries and every attempt with its error. Once the
    receipt has expired (its dedup TTL), what the processed-events ledger kept of it."""
    from models import reads
    from models.views import LedgerEvent, receipt_ref

    e = env()
    with e.reads() as conn:
        detail = reads.get_event_or_ledger(conn, event, source=source)
    if as_json:
        shown = plain(detail)
        if not isinstance(detail, LedgerEvent):
            shown["sender_retries"] = detail.sender_retries
        print_json(shown)
        return
    if isinstance(detail, LedgerEvent):
        print_ledger_event(detail)
        return
    payload = (
        f"dropped {when(detail.payload_dropped_at)}"
        if detail.payload_dropped_at
        else f"{detail.payload_bytes} bytes ({detail.content_type or 'unknown type'})"
    )
    for label, value in (
        ("receipt", receipt_ref(detail.id)),
        ("source", f"{detail.source_name} ({detail.source}, {detail.provider})"),
        ("event id", detail.event_id),
        ("type", type_shown(detail.event_type, detail.type_unsigned)),
        ("occurred", when(detail.occurred_at) or "-"),
        ("received", when(detail.received_at)),
        ("via", detail.arrived_via),
        ("expires", when(detail.expires_at)),
        ("retried", detail.sender_retries),
        ("payload", payload),
    ):
        say(f"{label + ':':<10} {escape(str(value))}")
    if not detail.deliveries:
        console.print("no deliveries (no route matched)")
    for d in detail.deliveries:
        console.print()
        print_delivery(d)


def type_shown(event_type: str, unsigned: str | None) -> str:
    """The type, with where it was read from when the signature does not cover it."""
    if unsigned is None:
        return event_type
    return f"{event_type} (unsigned: read from {unsigned}, outside the signature)"


def print_ledger_event(found: LedgerEvent) -> None:
    """An event whose receipt expired: each receipt of it the ledger kept, newest first."""
    say(escape(found.note))
    for n, run in enumerate(found.runs):
        if n:
            console.print()
        for label, value in (
            ("source", f"{run.source_name} ({run.source}, {run.provider})"),
            ("event id", run.event_id),
            ("type", run.event_type),
            ("received", when(run.received_at)),
            ("via", run.arrived_via),
            ("digest", f"sha256 {run.digest}..." if run.digest else "-"),
        ):
            say(f"{label + ':':<10} {escape(str(value))}")
        for o in run.outcomes:
            detail = o.result_ref or o.dead_reason
            more = f" ({'result ' if o.result_ref else ''}{detail})" if detail else ""
            say(escape(f"route {o.route_id} {o.handler}: {o.status}{more}"))
    if len(found.runs) > 1:
        say(f"\n{len(found.runs)} receipts of this event: each redelivery after the TTL ran anew")


@deliveries_app.command("show")
@handle_errors
def deliveries_show(
    delivery: Annotated[
        str,
        typer.Argument(
            metavar="ID",
            help="Delivery id, as `dead list`, Flower's task arguments and the logs show it.",
        ),
    ],
    as_json: JsonOpt = False,
) -> None:
    """One delivery: its event, route and handler, status, attempts (replays marked), dead
    reason and downstream idempotency key."""
    from core.idempotency import idempotency_key
    from models import reads

    e = env()
    with e.reads() as conn:
        detail = reads.get_delivery(conn, delivery, key_of=idempotency_key)
    if as_json:
        print_json(plain(detail))
        return
    d = detail.delivery
    if detail.route_active is None:
        route = f"{d.route_id} (removed)"
    else:
        state = "" if detail.route_active else ", disabled"
        route = f"{d.route_id}: {d.handler} for {detail.route_events}{state}"
    for label, value in (
        ("delivery", d.id),
        ("event", f"{detail.event_id} ({detail.event_type})"),
        ("receipt", f"{detail.receipt} (webhooks events show {detail.receipt})"),
        ("source", f"{detail.source_name} ({detail.source}, {detail.provider})"),
        ("received", when(detail.received_at)),
        ("route", route),
        ("key", f"{detail.idempotency_key} (generation {d.generation})"),
    ):
        say(f"{label + ':':<10} {escape(str(value))}")
    console.print()
    print_delivery(d)
    if d.status == DeliveryStatus.DEAD:
        say(
            f"\nreplay it: webhooks replay {d.id} --reason TEXT; "
            f"discard it: webhooks dead discard {d.id} --reason TEXT"
        )


def register(app: typer.Typer) -> None:
    app.add_typer(events_app, name="events")
    app.add_typer(deliveries_app, name="deliveries")

"""Operators' commands: ``dead list|discard`` and ``audit list`` here; ``replay`` and
``replays list`` in :mod:`webhooks.cli.replay`, ``demo`` in :mod:`webhooks.cli.demo`,
``events`` and ``deliveries`` in :mod:`webhooks.cli.events` (all registered from here).

Every listing takes ``--json``. Nothing printed here carries a secret or a payload: events
show their payload's size and whether retention dropped it, never its content. Event data is
printed literally (:mod:`webhooks.cli.render`).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from webhooks.cli import events
from webhooks.cli.common import (
    console,
    env,
    handle_errors,
    print_json,
)
from webhooks.cli.demo import demo
from webhooks.cli.events import SinceOpt, TypeOpt, UntilOpt
from webhooks.cli.render import (
    JsonOpt,
    SourceOpt,
    fitted,
    login,
    plain,
    row,
    say,
    stamp,
    when,
    whole,
)
from webhooks.cli.replay import replay, replays_app, selection

# The database, HTTP and logging modules are imported by the commands that use them (see
# webhooks.cli.common).

dead_app = typer.Typer(help="Dead letters: deliveries that gave up.", no_args_is_help=True)
audit_app = typer.Typer(
    help="The audit trail of operator actions: sends, discards, replays, routes, sources, logins.",
    no_args_is_help=True,
)

# dead letters --------------------------------------------------------------------------------


@dead_app.command("list")
@handle_errors
def dead_list(source: SourceOpt = None, as_json: JsonOpt = False) -> None:
    """Dead deliveries grouped by source, route and reason, with counts."""
    from models import reads

    e = env()
    with e.reads() as conn:
        groups = reads.dead_letters(conn, source=source)
    if as_json:
        print_json([plain(g) for g in groups])
        return
    if not groups:
        console.print("no dead letters")
        return
    table = Table(
        "source",
        "route",
        "reason",
        "count",
        "oldest (UTC)",
        "newest (UTC)",
        "errors",
        "latest delivery ids",
        title="dead letters",
    )
    for g in groups:
        row(
            table,
            f"{g.source_name} ({g.source})",
            f"{g.route_id} {g.handler}",
            g.reason or "-",
            str(g.count),
            stamp(g.oldest),
            stamp(g.newest),
            ", ".join(g.error_classes),
            " ".join(str(i) for i in g.sample_ids),
        )
    console.print(fitted(whole(table, "source", "route", "reason", "oldest (UTC)", "newest (UTC)")))
    total = sum(g.count for g in groups)
    say(
        f"{total} dead. Look one up: webhooks deliveries show ID. Replay: webhooks replay ID ... "
        "--reason TEXT, or webhooks replay --source S [--type T] --reason TEXT"
    )


@dead_app.command("discard")
@handle_errors
def dead_discard(
    ids: Annotated[
        list[int] | None,
        typer.Argument(help="Dead delivery ids (see `dead list`).", show_default=False),
    ] = None,
    *,
    source: SourceOpt = None,
    event_type: TypeOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why (required; recorded in the audit).")
    ] = None,
    operator: Annotated[
        str | None,
        typer.Option("--operator", "--as", help="Who is discarding (default: your login name)."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the preview only.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Discard dead letters by id or by filter: preview, confirm, audit.

    A discarded delivery is never replayed and retention no longer keeps it (dead letters
    are otherwise kept for WEBHOOKS_DEAD_LETTER_RETENTION). Audited in audit_log.
    """
    from core.clock import pinned
    from core.logs import configure_logging
    from models import discards

    e = env()
    given, flt = selection(
        e,
        ids,
        source=source,
        event_type=event_type,
        status=None,
        since=since,
        until=until,
        reason=reason,
        dry_run=dry_run,
        yes=yes,
        as_json=as_json,
    )
    request = discards.DiscardRequest(
        operator=operator or login(),
        reason=reason or "(dry run)",
        via="cli",
        filter_as_given=given,
        ids=tuple(sorted(set(ids or []))),
        flt=flt,
    )
    with e.session() as session:
        plan = discards.plan_discard(session, request)
    preview = {"count": plan.count, "sample": [plain(c) for c in plan.sample]}
    if as_json and (dry_run or plan.count == 0):
        print_json({"preview": preview, "dry_run": dry_run, "result": None})
        return
    if not as_json:
        if plan.count == 0:
            console.print("nothing to discard: no dead letter matches")
            return
        table = Table("delivery", "source", "event id", "type", "handler", "dead reason")
        for c in plan.sample:
            row(
                table, c.delivery_id, c.source, c.event_id, c.event_type, c.handler,
                c.dead_reason or "",
            )  # fmt: skip
        console.print(fitted(whole(table, "delivery", "source", "event id", "type")))
        more = f" (showing {len(plan.sample)})" if plan.count > len(plan.sample) else ""
        console.print(f"would discard {plan.count} dead letters{more}", highlight=False)
        if dry_run:
            console.print("dry run: nothing changed")
            return
    if not yes:
        typer.confirm(
            f"Discard {plan.count} dead letters? They can no longer be replayed", abort=True
        )
    # Log lines (counts only) go to stderr, so stdout stays the result; the audit row is the
    # record.
    configure_logging(e.settings.log_level, json=e.settings.log_json)
    with e.session() as session:
        result = discards.execute_discard(session, plan, now=pinned(e.clock))
    discards.record_discarded(result, "cli")
    if as_json:
        print_json({"preview": preview, "dry_run": False, "result": plain(result)})
        return
    console.print(
        f"discarded {result.discarded} of {result.planned} planned (audit {result.audit_id})",
        highlight=False,
    )


# replay --------------------------------------------------------------------------------------


# replay audit --------------------------------------------------------------------------------


@audit_app.command("list")
@handle_errors
def audit_list(
    limit: Annotated[int, typer.Option("--limit", help="Most recent first.")] = 20,
    action: Annotated[
        str | None,
        typer.Option(
            "--action",
            help="Only these (a prefix): discard, replay, route, source, secret, event.send, "
            "login, route.disable, ...",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Every audited operator action, newest first: who, when, through what and why. Test
    events sent (event.send), dead letters discarded, replays (one row per run, its filter and
    how many it replayed; progress: webhooks replays list), routes and sources added, changed,
    disabled, enabled or removed, secrets added or revoked, console logins (login,
    login.failed)."""
    from models import console as reads

    e = env()
    with e.session() as session:
        entries = reads.audit(session, limit=limit, action=action)
    if as_json:
        print_json([plain(a) for a in entries])
        return
    if not entries:
        console.print("no audited changes")
        return
    # Two lines per change rather than a table: its target holds ids (sources, routes,
    # secrets) that a table at 80 columns would cut.
    for a in entries:
        target = ", ".join(f"{k}={v}" for k, v in a.target.items())
        count = "" if a.count in (None, 1) else f" ({a.count})"
        # A replay's id is its own (webhooks replays list), not an audit_log row's.
        head, what = (
            (f"#{a.id}", a.action)
            if a.kind == "audit"
            else (f"replay:{a.id}", f"replay ({a.status})")
        )
        say(escape(f"{head} {when(a.at)}  {what}  by {a.operator} via {a.via}{count}"))
        say(escape(f"    {target}: {a.reason}" if target else f"    {a.reason}"))
    say("[dim](--json for every field)[/dim]")


# demo ----------------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    events.register(app)
    app.add_typer(dead_app, name="dead")
    app.command("replay")(replay)
    app.add_typer(replays_app, name="replays")
    app.add_typer(audit_app, name="audit")
    app.command("demo")(demo)

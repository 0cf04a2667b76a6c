"""``webhooks reconcile SOURCE``: find the events the provider sent that never arrived, and
recover them (issue 22; :mod:`tasks.reconcile.run`). Without SOURCE: every source the intake
gaps affect (``webhooks gaps``), in the order of their deadlines (issue 38 item 2;
:mod:`tasks.reconcile.gaps`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from core.durations import parse_duration
from webhooks.cli.common import CliError, env, handle_errors, print_json
from webhooks.cli.render import row, say, show_table, whole

if TYPE_CHECKING:
    from tasks.reconcile.gaps import GapRun
    from tasks.reconcile.run import Report


@handle_errors
def reconcile_command(
    source: Annotated[
        str | None,
        typer.Argument(
            metavar="[SOURCE]",
            help="Source id or name; without it, every source the intake gaps affect "
            "(webhooks gaps), earliest deadline first.",
            show_default=False,
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="The window: events created this long ago or later (default 3d, or the "
            "source's dedup TTL when shorter).",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what is missing; recover nothing.")
    ] = False,
    max_pages: Annotated[
        int, typer.Option("--max-pages", help="Stop after this many API pages (100 events each).")
    ] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the provider's events in the window, compare them with the source's receipts
    and print the missing ones; without --dry-run, recover each (Stripe: accepted from the
    API's event object, with its deliveries; GitHub: a redelivery request, the signed webhook
    then arrives). Exit code 1 when the provider's API failed (what was found before the
    failure is still recovered). Without SOURCE (and without --since): the sources the
    intake gaps affect, each over its gaps' window, in the order of their deadlines; those
    without a reconciliation credential are named as not recoverable."""
    from core.crypto import SecretBox
    from tasks.reconcile.run import ReconcileError, reconcile

    if source is None and since is not None:
        raise CliError(
            "--since needs a SOURCE: without one, reconcile recovers the intake gaps over "
            "their own windows (webhooks gaps)",
            doc="gaps",
        )
    window = None if since is None else parse_duration(since)
    e = env()
    if not e.keys_checked:
        e.check_keys()
    box = SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)
    publisher = None
    if not dry_run:
        from tasks.publisher import CeleryPublisher  # only when recovering

        publisher = CeleryPublisher(e.settings)
    if source is None:
        from tasks.reconcile.gaps import reconcile_gaps

        try:
            run = reconcile_gaps(
                e.settings, e.sessions, box, dry_run=dry_run, max_pages=max_pages,
                sleep=time.sleep, publish=publisher.one if publisher is not None else None,
            )  # fmt: skip
        finally:
            if publisher is not None:
                publisher.close()
        if as_json:
            print_json(run.view())
        else:
            _show_gaps(run)
        if run.failed:
            raise typer.Exit(1)
        return
    try:
        report = reconcile(
            e.settings,
            e.sessions,
            box,
            source,
            since=window,
            dry_run=dry_run,
            max_pages=max_pages,
            sleep=time.sleep,
            publish=publisher.one if publisher is not None else None,
        )
    except ReconcileError as exc:
        raise CliError(str(exc)) from None
    finally:
        if publisher is not None:
            publisher.close()
    if as_json:
        print_json(report.view())
    else:
        _show(report)
    if report.error is not None:
        raise typer.Exit(1)


def _show(report: Report) -> None:
    listing = report.listing
    say(
        escape(
            f"{report.source} ({report.name}, {report.provider}): {len(listing.events)} events "
            f"since {report.since:%Y-%m-%d %H:%M:%S}Z in {listing.pages} pages; "
            f"{len(report.missing)} missing"
        )
    )
    if report.missing:
        table = Table("event id", "type", "created", box=None)
        for event in report.missing:
            row(table, event.event_id, event.event_type, f"{event.created:%Y-%m-%d %H:%M:%S}Z")
        show_table(whole(table, "event id", "type"))
    if listing.waits:
        say(f"rate limited {len(listing.waits)} times: waited {sum(listing.waits):g}s")
    if listing.truncated:
        say(
            "stopped after --max-pages pages with more to list: the oldest events of the "
            "window were not compared (run again with a shorter --since or more --max-pages)"
        )
    if report.dry_run:
        if report.missing:
            say("dry run: nothing recovered (run without --dry-run to recover them)")
    elif report.missing:
        meanwhile = (
            f"; {report.arrived_meanwhile} arrived as webhooks meanwhile"
            if report.arrived_meanwhile
            else ""
        )
        if report.provider == "svix":
            say(
                f"asked Svix to recover the window: it resends the failed messages "
                f"({report.recovered} missing here){meanwhile}"
            )
        elif report.provider == "github":
            say(
                f"asked GitHub to redeliver {report.recovered}: they arrive as signed webhooks"
                f"{meanwhile}"
            )
        else:
            say(f"recovered {report.recovered}{meanwhile}")
    if report.error is not None:
        say(escape(f"error: {report.error}; run again to compare the rest"))


def _show_gaps(run: GapRun) -> None:
    from core.gaps import INVISIBLE

    if not run.runs:
        say(
            f"no intake gap since {run.gaps.since:%Y-%m-%d %H:%M:%S}Z: nothing to recover "
            "(webhooks reconcile SOURCE compares a source's whole window)"
        )
    for n, one in enumerate(run.runs, 1):
        r = one.recovery
        head = (
            f"{n}. {r.source.name} ({r.source.public_id}, {r.source.provider}): deadline "
            f"{r.deadline:%Y-%m-%d %H:%M:%S}Z, {r.gaps} gap(s)"
        )
        if not r.source.reconcilable:
            say(
                escape(
                    f"{head}: not recoverable here (no reconciliation credential, or a "
                    "provider reconciliation does not know): only the sender can resend it"
                )
            )
            continue
        say(escape(head))
        if one.error is not None:
            say(escape(f"   error: {one.error}"))
        elif one.report is not None:
            if one.clamped:
                say(
                    "   the gaps reach further back than reconciliation may compare (the "
                    "source's dedup TTL or the provider's listing horizon): the rest is lost"
                )
            _show(one.report)
    say(escape(INVISIBLE))


def register(app: typer.Typer) -> None:
    app.command("reconcile")(reconcile_command)

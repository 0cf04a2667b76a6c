"""``webhooks gaps``: the time ranges in which senders got errors or no answer from us, and
per source whether its provider still retries them (issue 38 item 2; :mod:`core.gaps`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from core.durations import parse_duration
from webhooks.cli.common import CliError, env, handle_errors, print_json
from webhooks.cli.render import prose, row, say, show_table, stamp, whole

if TYPE_CHECKING:
    from core.gaps import GapReport

KIND_TEXT = {
    "no_receiver_seen": "no receiver seen",
    "database_unreachable": "database unreachable (503 answered)",
    "errors_answered": "errors answered (5xx)",
}


@handle_errors
def gaps_command(
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="How far back (default: the longest retry window of the sources' "
            "providers, at least 1d).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The ranges in which no receiver was up, the database did not answer, or 5xx were
    answered; per source, whether its provider still retries what failed then (and until
    when) or only reconciliation recovers it (`webhooks reconcile` without SOURCE)."""
    from models.intake_gaps import read

    try:
        window = None if since is None else parse_duration(since)
    except ValueError as exc:
        raise CliError(f"--since: {exc}", doc="gaps-command") from None
    e = env()
    with e.reads() as conn:
        report = read(conn, e.settings, window)
    if as_json:
        print_json(report.view())
    else:
        show(report)


def show(report: GapReport) -> None:
    from core.gaps import INVISIBLE

    # At 80 columns: each line of prose wraps between words, the tables fit (render.fitted).
    prose(f"since {stamp(report.since)} UTC, now {stamp(report.now)} UTC (the database's clock)")
    if not report.gaps:
        say("no gap: a receiver was seen throughout and answered no 5xx")
    else:
        table = Table("from (UTC)", "until (UTC)", "kind", "source", "5xx", box=None)
        for g in report.gaps:
            row(
                table,
                stamp(g.start),
                "still open" if g.end is None else stamp(g.end),
                KIND_TEXT[g.kind.value],
                g.source or "every source",
                g.errors or "",
            )
        show_table(whole(table, "from (UTC)", "until (UTC)"))
        table = Table("source", "provider", "range from (UTC)", "the provider", box=None)
        for s in report.sources:
            row(table, s.source.name, s.source.provider, stamp(s.gap.start), s.describe())
        show_table(whole(table, "source", "range from (UTC)"), "by deadline; --json for more")
    prose(escape(report.resolution_text()))
    prose(escape(INVISIBLE))


def register(app: typer.Typer) -> None:
    app.command("gaps")(gaps_command)

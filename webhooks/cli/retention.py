"""``webhooks ttl explain SOURCE``, ``webhooks ttl check`` and ``webhooks maintenance run``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from core.durations import format_duration
from webhooks.cli.common import CliError, Env, console, env, handle_errors, print_json
from webhooks.cli.render import JsonOpt, fitted, say

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.horizon import WindowReview
    from models.ttl_fingerprints import FingerprintCheck

ttl_app = typer.Typer(
    help="Deduplication TTLs derived from each sender's contract.", no_args_is_help=True
)
maintenance_app = typer.Typer(help="Expiry maintenance (what beat runs).", no_args_is_help=True)


@contextmanager
def _database(e: Env) -> Iterator[None]:
    """A database that cannot be reached is a one-line error, not a traceback."""
    from sqlalchemy.exc import OperationalError

    from models.db import DatabaseUnavailable, describe_db_error

    try:
        yield
    except OperationalError as exc:
        message = describe_db_error(exc, e.settings.database_url)
        raise DatabaseUnavailable(
            message or f"cannot reach database {e.settings.database_name()}"
        ) from None


@ttl_app.command("explain")
@handle_errors
def ttl_explain(
    source: Annotated[str, typer.Argument(help="Source id or unambiguous name.")],
    as_json: JsonOpt = False,
) -> None:
    """Each term of the source's dedup TTL, where its value came from, and the sum; and the
    p99 queue lag measured from the database over the last day beside the queue_lag term."""
    from core.clock import pinned
    from core.ttl import dedup_terms
    from models import catalog

    e = env()
    with _database(e), e.session() as session:
        try:
            row = catalog.get_source(session, source)
        except catalog.CatalogError as exc:
            raise CliError(str(exc)) from None
        ttl = dedup_terms(
            row.provider, catalog.source_ttl_overrides(row), e.settings, source_name=row.name
        )
        view: dict[str, Any] = {
            "source": row.public_id,
            "name": row.name,
            "provider": row.provider,
            "terms": [
                {
                    "name": t.name,
                    "value": format_duration(t.value),
                    "seconds": int(t.value.total_seconds()),
                    "origin": t.origin,
                }
                for t in ttl.terms
            ],
            "dedup_ttl": format_duration(ttl.total),
            "dedup_ttl_seconds": int(ttl.total.total_seconds()),
            "retry_window": format_duration(ttl.retry_window),
            "covers_retries": ttl.covers_retries,
        }
        budget = next(t.value for t in ttl.terms if t.name == "queue_lag")
        view["queue_lag_measured"] = _measured_lag(session, row.id, budget, pinned(e.clock))
    if as_json:
        print_json(view)
    else:
        table = Table(title=f"dedup TTL of {row.name} ({row.public_id}, {row.provider})")
        for column in ("term", "value", "seconds"):
            table.add_column(column, no_wrap=True)
        table.add_column("from", overflow="fold")  # a cited URL is folded, never cut
        for term in view["terms"]:
            table.add_row(term["name"], term["value"], str(term["seconds"]), term["origin"])
            if term["name"] == "queue_lag":  # beside it, what the pipeline measured
                table.add_row(*_measured_row(view["queue_lag_measured"]))
        table.add_row("= dedup_ttl", view["dedup_ttl"], str(view["dedup_ttl_seconds"]), "sum")
        console.print(fitted(table))
    if not ttl.covers_retries:
        raise CliError(
            f"source {row.name}: dedup TTL {ttl.describe()} is not above the retry window "
            f"{view['retry_window']}; the receiver refuses it until a term is raised"
        )
    if not as_json:
        console.print(
            f"above the {row.provider} retry window ({view['retry_window']}) "
            f"by {format_duration(ttl.total - ttl.retry_window)}",
            highlight=False,
        )


def _measured_lag(
    session: Session, source_id: int, budget: timedelta, now: datetime | None
) -> dict[str, Any]:
    """The source's p99 queue lag over the window, read now (models/queue_lag.py), against
    its queue_lag term; never changes the term (docs/retention.md)."""
    from core.ttl import QUEUE_LAG_WINDOW
    from models import queue_lag

    found = queue_lag.measure(session.connection(), now, QUEUE_LAG_WINDOW, source_id)
    lag = found.get(source_id)
    p99 = None if lag is None else lag.p99
    return {
        "p99": None if p99 is None else _short(p99),
        "p99_seconds": None if p99 is None else round(p99.total_seconds(), 3),
        "deliveries": 0 if lag is None else lag.deliveries,
        "window": format_duration(QUEUE_LAG_WINDOW),
        "window_seconds": int(QUEUE_LAG_WINDOW.total_seconds()),
        "budget": format_duration(budget),
        "budget_seconds": int(budget.total_seconds()),
        "over_budget": p99 is not None and p99 > budget,
    }


def _short(value: timedelta) -> str:
    """A duration as the terms show it; under a second, in milliseconds (not "0s")."""
    if value < timedelta(seconds=1):
        return f"{round(value.total_seconds() * 1000)}ms"
    return format_duration(value)


def _measured_row(m: dict[str, Any]) -> tuple[str, str, str, str]:
    """The table row under queue_lag: the measured p99, its window, against the term."""
    if m["p99"] is None:
        return ("  p99 measured", "-", "-", f"no delivery in the last {m['window']}")
    verdict = "OVER the budget" if m["over_budget"] else "within the budget"
    return (
        "  p99 measured",
        m["p99"],
        str(round(m["p99_seconds"])),
        f"receipt to outcome, last {m['window']} ({m['deliveries']} deliveries): {verdict}",
    )


# `webhooks ttl check` (issue 35 item 3): the providers' retry windows due for review. ------

# Its exit status when some window is due: neither an error (1) nor bad usage (2), so that a
# CI job or a cron can tell "someone must read a provider's page" from "the check broke".
DUE_EXIT = 3
# When live processes derive different TTLs for a source: a deployment to correct now (a late
# retry may run twice), so it wins over DUE_EXIT when both hold (both are printed).
DISAGREE_EXIT = 4


def _as_of(text: str | None) -> date | None:
    if text is None:
        return None
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a day (YYYY-MM-DD)", param_hint="'--as-of'"
        ) from None


def _window_view(r: WindowReview, builtin: bool) -> dict[str, Any]:
    return {
        "provider": r.provider,
        "builtin": builtin,
        "retry_window": format_duration(r.retry_window),
        "retry_window_s": int(r.retry_window.total_seconds()),
        "citation": r.citation,
        "verified_on": r.verified_on,
        "age_days": r.age_days,
        "due": r.due,
        "reason": r.reason,
    }


def _print_windows(views: list[dict[str, Any]], mark_due: bool) -> None:
    """One line per window (provider, window, verified on, age), its citation on the next,
    indented and never cut: a URL stays whole for the terminal to open, whatever the width."""
    rows = [
        (
            v["provider"] if v["builtin"] else f"{v['provider']} (plug-in)",
            v["retry_window"],
            "never" if v["verified_on"] is None else str(v["verified_on"]),
            "-" if v["age_days"] is None else f"{v['age_days']}d",
            " due" if mark_due and v["due"] else "",
        )
        for v in views
    ]
    name_w = max(len("provider"), *(len(r[0]) for r in rows))
    window_w = max(len("window"), *(len(r[1]) for r in rows))
    say(escape(f"{'provider':<{name_w}}  {'window':<{window_w}}  {'verified on':<11}  age"))
    for (name, window, verified, age, mark), v in zip(rows, views, strict=True):
        say(escape(f"{name:<{name_w}}  {window:<{window_w}}  {verified:<11}  {age}{mark}"))
        say("  " + escape(v["citation"]))


def _prose(text: str) -> None:
    """A sentence, wrapped at the terminal's width between words."""
    console.print(escape(text), highlight=False)


@ttl_app.command("check")
@handle_errors
def ttl_check(
    as_json: JsonOpt = False,
    every: Annotated[
        bool, typer.Option("--all", help="List every provider's window, not only those due.")
    ] = False,
    as_of: Annotated[
        str | None,
        typer.Option(
            "--as-of",
            metavar="YYYY-MM-DD",
            help="Check as of this day (what will be due by then). Default: today, in UTC.",
            show_default=False,
        ),
    ] = None,
    windows_only: Annotated[
        bool,
        typer.Option(
            "--windows-only",
            help="Check the retry windows only: read no database (a CI job without one).",
        ),
    ] = False,
) -> None:
    """The providers' retry windows due for review: last verified against their cited page
    longer ago than WEBHOOKS_HORIZON_REVIEW_AFTER (default 180d), never, or on a day after
    today. Each is the provider term of every dedup TTL of its sources; a sender may have
    changed its policy since.

    Then the live receivers and workers (each records its TTL inputs in the database at
    start; live: seen within WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER) that derive different dedup
    TTLs for a source: each with its host, pid, role, TTL and the terms that differ.

    Exit status: 0 when no window is due and the processes agree, 3 when some window is due,
    4 when processes disagree (either way the list is printed, or the JSON written; 4 when
    both), 1 on an error such as an invalid setting or a database that cannot be read, 2 on
    bad usage such as an --as-of that is not a day. --windows-only reads no database."""
    from core.clock import pinned
    from core.horizon import due, review, utc_day
    from core.providers import registry
    from models import ttl_fingerprints

    day = _as_of(as_of)
    e = env()
    today = day if day is not None else utc_day(e.clock.now())
    after = e.settings.horizon_review_after
    builtin = set(registry.builtin_names())
    reviews = review(registry.providers().values(), today, after)
    late = due(reviews)
    views = [_window_view(r, r.provider in builtin) for r in (reviews if every else late)]
    found = None
    if not windows_only:
        try:
            with _database(e), e.engine.connect() as conn:
                found = ttl_fingerprints.check(conn, e.settings, pinned(e.clock))
        finally:
            e.engine.dispose()
    if as_json:
        print_json(
            {
                "as_of": today,
                "review_after_days": after.days,
                "checked": len(reviews),
                "due": [r.provider for r in late],
                "windows": views,
                "processes": None
                if found is None
                else _processes_view(found, e.settings.ttl_fingerprint_stale_after),
            }
        )
    elif late or every:
        _prose(
            f"{len(late)} of {len(reviews)} retry windows due for review on {today} "
            f"(review after {after.days} days):"
        )
        _print_windows(views, mark_due=every)
    else:
        oldest = max(reviews, key=lambda r: r.age_days or 0, default=None)
        since = "" if oldest is None else f"; the oldest, {oldest.provider}'s, {oldest.reason}"
        _prose(f"None of {len(reviews)} retry windows is due for review on {today}{since}.")
    if late and not as_json:
        _prose(
            "Read each cited page, then in one commit correct the window or citation if the "
            "sender changed them and set verified_on to that day (built-ins: "
            "core/providers/descriptions.toml; a plug-in: its Provider). See docs/providers.md."
        )
    if found is not None and not as_json:
        _print_processes(found, e.settings.ttl_fingerprint_stale_after, every=every)
    if found is not None and found.disagreements:
        raise typer.Exit(DISAGREE_EXIT)
    if late:
        raise typer.Exit(DUE_EXIT)


def _processes_view(found: FingerprintCheck, stale: timedelta) -> dict[str, Any]:
    from models.ttl_fingerprints import describe

    return {
        "stale_after_s": int(stale.total_seconds()),
        "live": [
            {
                "host": p.host,
                "pid": p.pid,
                "role": p.role,
                "environment": p.environment,
                "digest": p.inputs.digest(),
                "started_at": p.started_at,
                "last_seen": p.last_seen,
            }
            for p in found.processes
        ],
        "unreadable": [{"host": h, "pid": pid, "role": r} for h, pid, r in found.unreadable],
        "disagreements": [describe(d) for d in found.disagreements],
    }


def _ttl_text(value: timedelta | None) -> str:
    return "not installed" if value is None else format_duration(value)


def _print_processes(found: FingerprintCheck, stale: timedelta, *, every: bool) -> None:
    """The processes' half of ``ttl check``: each source they disagree on, a line per
    process (host, pid, role, environment, its TTL, its value of each term that differs);
    with --all, every live process."""
    live = found.processes
    roles = ", ".join(
        f"{sum(p.role == role for p in live)} {role}s" for role in ("receiver", "worker")
    )
    if found.unreadable:
        names = ", ".join(f"{h}:{pid} {r}" for h, pid, r in found.unreadable)
        _prose(f"Unreadable TTL inputs (a process of another version?): {names}.")
    if not live:
        _prose(
            "No live receiver or worker has recorded its TTL inputs (none seen in the last "
            f"{format_duration(stale)}): nothing to compare."
        )
        return
    if not found.disagreements:
        _prose(
            f"The {len(live)} live processes ({roles}) derive the same dedup TTL for every source."
        )
    else:
        count = len(found.disagreements)
        _prose(
            f"Live processes ({roles}) derive different dedup TTLs for {count} "
            f"source{'s' if count > 1 else ''}:"
        )
    for d in found.disagreements:
        say(escape(f"{d.source.name} ({d.source.public_id}, {d.source.provider}):"))
        header = ["host", "pid", "role", "environment", "dedup TTL", *d.differing]
        rows = [
            [
                x.process.host,
                str(x.process.pid),
                x.process.role,
                x.process.environment,
                _ttl_text(x.ttl),
                *(_ttl_text(x.values[name]) for name in d.differing),
            ]
            for x in d.derived
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            say(
                "  "
                + escape("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
            )
    if found.disagreements:
        _prose(
            "Each process derives a TTL from its own settings (WEBHOOKS_QUEUE_LAG_BUDGET, "
            "WEBHOOKS_CLOCK_SKEW_ALLOWANCE, WEBHOOKS_MANUAL_REPLAY_GRACE) and its installed "
            "providers: give them the same and restart the odd ones, or set the term on the "
            "source (webhooks sources update SOURCE --queue-lag ...). See docs/retention.md."
        )
    elif every:
        for p in live:
            say(escape(f"  {p.host}  {p.pid}  {p.role}  {p.environment}  {p.inputs.digest()}"))


@maintenance_app.command("run")
@handle_errors
def maintenance_run(as_json: JsonOpt = False) -> None:
    """Run one maintenance pass now: partitions or batched delete, then payload retention.

    Unfinished deliveries and dead letters within their retention are held (moved forward
    with their receipt and attempts), never removed; the database's clock decides."""
    from core.clock import pinned
    from core.logs import configure_logging
    from models.retention import run_maintenance

    e = env()
    configure_logging(e.settings.log_level, json=e.settings.log_json)  # stderr: stdout is data
    try:
        with _database(e):
            # None unless a test pinned the clock: the database's clock decides expiry.
            report = run_maintenance(e.engine, e.settings, pinned(e.clock))
    finally:
        e.engine.dispose()
    if as_json:
        print_json(report.as_dict())
        return
    console.print(f"mode {report.mode}", highlight=False)
    if report.mode == "partition":
        console.print(
            f"partitions created {len(report.partitions_created)}, "
            f"dropped {len(report.partitions_dropped)}, "
            f"empty days ahead dropped {len(report.partitions_trimmed)}, "
            f"laid out through {report.partitions_through}",
            highlight=False,
        )
    for table, rows in report.rows_deleted.items():
        statements = report.delete_statements.get(table, 0)
        console.print(
            f"{table}: {rows} expired rows deleted in {statements} statements", highlight=False
        )
    moved = ", ".join(f"{n} {t}" for t, n in report.rows_moved.items())
    console.print(
        f"held receipts moved forward {report.held_receipts}" + (f" ({moved})" if moved else ""),
        highlight=False,
    )
    if report.postponed:
        what = "days" if report.mode == "partition" else "receipts"
        console.print(
            f"postponed {len(report.postponed)} {what}: a delivery in them is being processed",
            highlight=False,
        )
    console.print(
        f"dead letters past their retention removed {report.dead_letters_expired}",
        highlight=False,
    )
    console.print(f"payloads dropped {report.payloads_dropped}", highlight=False)
    console.print(
        f"ledger months created {len(report.ledger_months_created)}, "
        f"dropped {len(report.ledger_months_dropped)} (past WEBHOOKS_LEDGER_RETENTION)",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(ttl_app, name="ttl")
    app.add_typer(maintenance_app, name="maintenance")

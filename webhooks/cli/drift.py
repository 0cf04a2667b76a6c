"""``webhooks drift list|accept|learn``: payload shape drift (issue 38 item 3, docs/drift.md).

``list`` is a read command (plain psycopg, no ORM); ``accept`` closes findings, audited;
``learn`` runs one learning run now (what beat runs every WEBHOOKS_DRIFT_EVERY).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from webhooks.cli.common import CliError, console, env, handle_errors, print_json
from webhooks.cli.render import (
    JsonOpt,
    OperatorOpt,
    ReasonOpt,
    SourceOpt,
    fitted,
    login,
    parse_when,
    row,
    say,
    stamp,
)

drift_app = typer.Typer(
    help="Payload shape drift: JSON key paths new, changed in type, or gone.",
    no_args_is_help=True,
)

DOC = "drift"


@drift_app.command("list")
@handle_errors
def drift_list(
    *,
    source: SourceOpt = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Opened at or after: ISO time, or 7d for 7 days ago."),
    ] = None,
    accepted: Annotated[
        bool, typer.Option("--accepted", help="Include accepted (closed) findings.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Open drift findings, newest first (with --accepted, the closed ones too)."""
    from models import drift
    from models.views import CatalogError

    e = env()
    after = parse_when(e, since)
    with e.reads() as conn:
        try:
            found = drift.list_findings(conn, source=source, include_accepted=accepted)
        except CatalogError as exc:
            raise CliError(str(exc), doc=DOC) from None
    if after is not None:
        found = [f for f in found if f.opened_at >= after]
    if as_json:
        print_json([f.as_json() for f in found])
        return
    if not found:
        say("no open drift findings" if not accepted else "no drift findings")
        return
    table = Table(title="payload shape drift")
    for column in ("id", "source", "event type", "path", "kind", "detail", "opened (UTC)"):
        table.add_column(column)
    if accepted:
        table.add_column("accepted by")
    for f in found:
        cells: list[object] = [
            f.id,
            f.source_name,
            f.event_type,
            f.path,
            f.kind,
            f.detail,
            stamp(f.opened_at),
        ]
        if accepted:
            cells.append(f.accepted_by or "")
        row(table, *cells)
    console.print(fitted(table))


@drift_app.command("accept")
@handle_errors
def drift_accept(
    source: Annotated[str, typer.Argument(help="Source id or unambiguous name.")],
    *,
    event_type: Annotated[
        str | None, typer.Option("--type", help="Only this event type's findings.")
    ] = None,
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Accept the source's new payload shape: close its open findings (of one event type with
    --type); a path reported gone leaves the learnt shape. Audited (audit_log)."""
    from models import drift
    from models.views import CatalogError

    if reason is None or not reason.strip():
        raise CliError("--reason is required: it is recorded in the audit trail", doc=DOC)
    e = env()
    with e.reads() as conn:
        try:
            sid, public_id = drift.source_id(conn, source)
            pending = [
                f
                for f in drift.list_findings(conn, source=public_id)
                if event_type is None or f.event_type == event_type
            ]
            held = drift.held_count(conn, sid, event_type)
        except CatalogError as exc:
            raise CliError(str(exc), doc=DOC) from None
    if not pending and not held:
        raise CliError(
            f"no open drift findings and no held deliveries for {source}"
            + (f" of type {event_type}" if event_type else ""),
            doc=DOC,
        )
    if not yes:
        if as_json:
            raise CliError("--json needs --yes (there is no prompt in JSON mode)", doc=DOC)
        typer.confirm(
            f"accept {len(pending)} drift finding(s) of {source}"
            f" and release {held} held delivery(ies)?",
            abort=True,
        )
    from models import pg

    with pg.connect(e.settings) as conn:
        try:
            done = drift.accept(
                conn, source, event_type=event_type, operator=operator or login(), reason=reason
            )
        except CatalogError as exc:
            raise CliError(str(exc), doc=DOC) from None
    if as_json:
        print_json(
            {"source": done.source, "event_type": done.event_type, "accepted": done.findings,
             "released": done.released, "audit_id": done.audit_id}
        )  # fmt: skip
    else:
        say(
            f"accepted {done.findings} finding(s) of {escape(done.source)}, released"
            f" {done.released} held delivery(ies) (audit {done.audit_id})"
        )


@drift_app.command("learn")
@handle_errors
def drift_learn(as_json: JsonOpt = False) -> None:
    """Run one learning run now (beat runs one every WEBHOOKS_DRIFT_EVERY)."""
    from models import drift, pg

    e = env()
    with pg.connect(e.settings) as conn:
        report = drift.learn_due(
            conn,
            every=timedelta(0),
            sample=e.settings.drift_sample,
            absent=timedelta(days=e.settings.drift_absent_days),
        )
    view = {
        "read": report.read,
        "shapes": report.shapes,
        "not_json": report.not_json,
        "cut_paths": report.cut_paths,
        "opened": len(report.opened),
        "through_receipt_id": report.through_receipt_id,
    }
    if as_json:
        print_json(view)
    else:
        say(", ".join(f"{k} {v}" for k, v in view.items()))


def register(app: typer.Typer) -> None:
    app.add_typer(drift_app, name="drift")


__all__ = ["CliError", "register"]

"""``webhooks replay`` (dead deliveries by id or by filter: preview, confirm, run at a capped
rate) and ``webhooks replays list`` (the replay audit trail). Nothing printed carries a
secret or a payload."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from core.states import DeliveryStatus
from models import replay_rates
from webhooks.cli.common import (
    CliError,
    Env,
    console,
    env,
    err_console,
    handle_errors,
    print_json,
)
from webhooks.cli.events import SinceOpt, TypeOpt, UntilOpt
from webhooks.cli.render import (
    JsonOpt,
    SourceOpt,
    count,
    fitted,
    login,
    parse_when,
    plain,
    row,
    say,
    show_table,
    stamp,
    whole,
)

# The database, HTTP and logging modules are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    from models import replays
    from models.candidates import ReplayFilter


replays_app = typer.Typer(help="The replay audit trail.", no_args_is_help=True)


def _preview_view(plan: replays.Plan) -> dict[str, Any]:
    return {
        "count": plan.count,
        "by_status": plan.by_status,
        "without_payload": plan.without_payload,
        "rate": plan.request.rate,
        "rerun_succeeded": plan.request.rerun_succeeded,
        "sample": [plain(c) for c in plan.sample],
    }


def _show_preview(plan: replays.Plan) -> None:
    req = plan.request
    if plan.count == 0:
        console.print("nothing to replay: no delivery matches")
        return
    table = Table("delivery", "source", "event id", "type", "handler", "status", "dead reason")
    for c in plan.sample:
        row(
            table,
            str(c.delivery_id),
            c.source,
            c.event_id,
            c.event_type,
            c.handler,
            c.status,
            c.dead_reason or "",
        )
    console.print(fitted(whole(table, "delivery", "source", "event id", "type")))
    states = ", ".join(f"{n} {s}" for s, n in sorted(plan.by_status.items()))
    more = f" (showing {len(plan.sample)})" if plan.count > len(plan.sample) else ""
    console.print(f"would replay {count(plan.count, 'delivery')}{more}: {states}")
    if plan.by_status.get(DeliveryStatus.SUCCEEDED):
        console.print("succeeded ones run again under a NEW downstream key (--rerun-succeeded)")
    if plan.by_status.get(DeliveryStatus.FILTERED):
        console.print("filtered ones run although their route's filter did not match them")
    if plan.without_payload:
        console.print(
            f"{plan.without_payload} of them lost their payload to retention and will be skipped"
        )
    seconds = plan.count / req.rate
    console.print(f"at most {req.rate:g}/s: about {seconds:.0f}s", highlight=False)


def _result_view(result: replays.ReplayResult) -> dict[str, Any]:
    return {
        "replay_id": result.replay_id,
        "status": result.status,
        "planned": result.planned,
        "replayed": result.replayed,
        "skipped": result.skipped,
        "publish_failed": result.publish_failed,
        "skips": [plain(s) for s in result.skips],
    }


def _show_result(result: replays.ReplayResult) -> None:
    console.print(
        f"replay {result.replay_id} {result.status}: {result.replayed} replayed, "
        f"{result.skipped} skipped of {result.planned} planned"
    )
    for skip in result.skips[:20]:
        say(f"  skipped delivery {skip.delivery_id}: {escape(skip.reason)}")
    if len(result.skips) > 20:
        reasons = Counter(s.reason.split(":")[0] for s in result.skips)
        console.print(f"  ... {len(result.skips) - 20} more; by reason: {dict(reasons)}")
    if result.publish_failed:
        console.print(
            f"{result.publish_failed} could not be queued now (broker unreachable); they are "
            "pending and the sweeper queues them shortly"
        )


@handle_errors
def replay(
    ids: Annotated[
        list[int] | None,
        typer.Argument(
            help="Delivery ids (see `events show` and `dead list`).", show_default=False
        ),
    ] = None,
    *,
    source: SourceOpt = None,
    event_type: TypeOpt = None,
    status: Annotated[
        str, typer.Option("--status", help="dead, or succeeded with --rerun-succeeded.")
    ] = DeliveryStatus.DEAD.value,
    since: SinceOpt = None,
    until: UntilOpt = None,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why (required; recorded in the audit).")
    ] = None,
    operator: Annotated[
        str | None, typer.Option("--as", help="Who is replaying (default: your login name).")
    ] = None,
    rate: Annotated[
        float, typer.Option("--rate", help=f"At most N per second (max {replay_rates.MAX_RATE:g}).")
    ] = replay_rates.DEFAULT_RATE,
    rerun_succeeded: Annotated[
        bool,
        typer.Option(
            "--rerun-succeeded", help="Run succeeded deliveries again with a new downstream key."
        ),
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the preview only.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Replay dead deliveries by id or by filter: preview, confirm, run at a capped rate.

    A dead delivery keeps its downstream idempotency key. A succeeded one runs again only
    with --rerun-succeeded, under a new key. Named by id only: filtered, superseded, and
    held-for-drift deliveries (the latter then runs once on its shape: docs/drift.md).
    Every run is audited: webhooks replays list.
    """
    from models import replays

    e = env()
    given, flt = selection(
        e,
        ids,
        source=source,
        event_type=event_type,
        status=status,
        since=since,
        until=until,
        reason=reason,
        dry_run=dry_run,
        yes=yes,
        as_json=as_json,
    )
    request = replays.ReplayRequest(
        operator=operator or login(),
        reason=reason or "(dry run)",
        via="cli",
        filter_as_given=given,
        ids=tuple(sorted(set(ids or []))),
        flt=flt,
        rerun_succeeded=rerun_succeeded,
        rate=rate,
    )
    with e.session() as session:
        plan = replays.plan_replay(session, request)
    if as_json and dry_run:
        print_json({"preview": _preview_view(plan), "dry_run": True})
        return
    if not as_json:
        _show_preview(plan)
    if plan.count == 0:
        if as_json:
            print_json({"preview": _preview_view(plan), "result": None})
        return
    if dry_run:
        console.print("dry run: nothing changed")
        return
    if not yes:
        typer.confirm(f"Replay {count(plan.count, 'delivery')}?", abort=True)
    result = run_replay(e, plan, show_progress=not as_json)
    if as_json:
        print_json({"preview": _preview_view(plan), "result": _result_view(result)})
    else:
        _show_result(result)
    if result.skipped:
        raise typer.Exit(1)


def run_replay(e: Env, plan: replays.Plan, *, show_progress: bool) -> replays.ReplayResult:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from core.logs import configure_logging
    from models import replays

    # Log lines go to stderr, warnings only: the terminal shows the progress and the summary
    # (and stdout stays pure JSON with --json); the audit row is the record.
    configure_logging("WARNING", json=e.settings.log_json)
    from tasks.publisher import CeleryPublisher  # Celery only when publishing

    publisher = CeleryPublisher(e.settings)
    replay_id = replays.start_replay(e.sessions, plan, now=e.clock.now())
    progress = Progress(
        TextColumn(f"replay {replay_id}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("replayed {task.fields[replayed]} skipped {task.fields[skipped]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not show_progress,
    )
    task = progress.add_task("replay", total=plan.count, replayed=0, skipped=0)

    def advance(result: replays.ReplayResult) -> None:
        progress.update(
            task, completed=result.done, replayed=result.replayed, skipped=result.skipped
        )

    try:
        with progress:
            return replays.execute(
                e.sessions,
                plan,
                replay_id,
                settings=e.settings,
                clock=e.clock,
                sleep=time.sleep,
                publish=publisher,
                on_progress=advance,
            )
    except KeyboardInterrupt:
        err_console.print(
            f"interrupted: replay {replay_id} recorded as interrupted; deliveries not reached "
            "are still dead, run the same command again to continue"
        )
        raise typer.Exit(130) from None
    finally:
        publisher.close()


@replays_app.command("list")
@handle_errors
def replays_list(
    limit: Annotated[int, typer.Option("--limit", help="Most recent first.")] = 20,
    wide: Annotated[
        bool, typer.Option("--wide", help="Add ended, via, filter, planned and skipped.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Who replayed what, when (UTC) and why."""
    from models import replays

    e = env()
    with e.session() as session:
        rows = replays.list_replays(session, limit=limit)
    if as_json:
        print_json([plain(r) for r in rows])
        return
    if not rows:
        console.print("no replays")
        return
    headers = ["id", "started (UTC)", "operator", "replayed", "status", "reason"]
    if wide:
        headers[2:2] = ["ended (UTC)"]
        headers[4:4] = ["via"]
        headers += ["filter", "planned", "skipped"]
    table = Table(*headers, title="replays")
    for r in rows:
        cells: list[object] = [
            r.id, stamp(r.started_at), r.operator, r.replayed, r.status, r.reason
        ]  # fmt: skip
        if wide:
            flt = ", ".join(f"{k}={v}" for k, v in r.filter.items())
            if r.rerun_succeeded:
                flt += " (rerun succeeded)"
            cells[2:2] = [stamp(r.ended_at)]
            cells[4:4] = [r.via]
            cells += [flt, r.planned, r.skipped]
        row(table, *cells)
    show_table(
        whole(table, "id", "started (UTC)", "operator", "replayed", "status"),
        "--wide for ended, via, filter, planned, skipped; --json for every field",
    )


def selection(
    e: Env,
    ids: list[int] | None,
    *,
    source: str | None,
    event_type: str | None,
    status: str | None,
    since: str | None,
    until: str | None,
    reason: str | None,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> tuple[dict[str, Any], ReplayFilter | None]:
    """What replay and dead discard select, checked alike: delivery ids or a filter (never
    both), a reason unless it is a dry run, no prompt in JSON mode. Returns the filter as
    given (for the audit row) and the filter itself (None for ids). ``status`` None: dead
    letters only, not an option of the command."""
    from models.candidates import ReplayFilter

    has_filter = any(v is not None for v in (source, event_type, since, until))
    if ids and (has_filter or (status or DeliveryStatus.DEAD) != DeliveryStatus.DEAD):
        raise CliError("give delivery ids or filter options, not both")
    if not ids and not has_filter:
        raise CliError("give delivery ids, or a filter such as --source S (see `dead list`)")
    if not dry_run and not (reason or "").strip():
        raise CliError("--reason is required: it is recorded in the audit trail")
    if as_json and not (yes or dry_run):
        raise CliError("--json needs --yes or --dry-run (there is no prompt in JSON mode)")
    if ids:
        return {"ids": sorted(set(ids))}, None
    given = {"source": source, "type": event_type, "status": status, "since": since, "until": until}
    flt = ReplayFilter(
        source,
        event_type,
        status or DeliveryStatus.DEAD,
        parse_when(e, since),
        parse_when(e, until),
    )
    return {k: v for k, v in given.items() if v is not None}, flt

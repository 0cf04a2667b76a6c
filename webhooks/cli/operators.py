"""Operators' commands: ``dead list|discard``, ``replay``, ``replays list``, ``audit list``,
``demo`` (``events`` and ``deliveries`` live in :mod:`webhooks.cli.events`).

Every listing takes ``--json``. Nothing printed here carries a secret or a payload: events
show their payload's size and whether retention dropped it, never its content. Event data is
printed literally (:mod:`webhooks.cli.render`).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from models import replay_rates
from webhooks.cli import events
from webhooks.cli.common import (
    CliError,
    Env,
    cli_command,
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
    login,
    parse_when,
    plain,
    row,
    say,
    show_table,
    stamp,
    when,
    whole,
)

# The database, HTTP and logging modules are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    import httpx

    from models import queries, replays
    from models.candidates import ReplayFilter

dead_app = typer.Typer(help="Dead letters: deliveries that gave up.", no_args_is_help=True)
replays_app = typer.Typer(help="The replay audit trail.", no_args_is_help=True)
audit_app = typer.Typer(
    help="The audit trail of operator changes: discards, routes, sources.", no_args_is_help=True
)

# dead letters --------------------------------------------------------------------------------


@dead_app.command("list")
@handle_errors
def dead_list(source: SourceOpt = None, as_json: JsonOpt = False) -> None:
    """Dead deliveries grouped by source, route and reason, with counts."""
    from models import queries  # noqa: PLC0415

    e = env()
    with e.session() as session:
        groups = queries.dead_letters(session, source=source)
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
    console.print(table)
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
    from core.clock import pinned  # noqa: PLC0415
    from core.logs import configure_logging  # noqa: PLC0415
    from models import discards  # noqa: PLC0415

    e = env()
    given, flt = _selection(
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
        console.print(table)
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
    console.print(table)
    states = ", ".join(f"{n} {s}" for s, n in sorted(plan.by_status.items()))
    more = f" (showing {len(plan.sample)})" if plan.count > len(plan.sample) else ""
    console.print(f"would replay {count(plan.count, 'delivery')}{more}: {states}")
    if plan.by_status.get("succeeded"):
        console.print("succeeded ones run again under a NEW downstream key (--rerun-succeeded)")
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
    ] = "dead",
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
    with --rerun-succeeded, under a new key. Every run is audited: webhooks replays list.
    """
    from models import replays  # noqa: PLC0415

    e = env()
    given, flt = _selection(
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
    result = _run(e, plan, show_progress=not as_json)
    if as_json:
        print_json({"preview": _preview_view(plan), "result": _result_view(result)})
    else:
        _show_result(result)
    if result.skipped:
        raise typer.Exit(1)


def _run(e: Env, plan: replays.Plan, *, show_progress: bool) -> replays.ReplayResult:
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from core.logs import configure_logging  # noqa: PLC0415
    from models import replays  # noqa: PLC0415

    # Log lines go to stderr, warnings only: the terminal shows the progress and the summary
    # (and stdout stays pure JSON with --json); the audit row is the record.
    configure_logging("WARNING", json=e.settings.log_json)
    from tasks.publisher import CeleryPublisher  # noqa: PLC0415  (Celery only when publishing)

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


# replay audit --------------------------------------------------------------------------------


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
    from models import replays  # noqa: PLC0415

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


@audit_app.command("list")
@handle_errors
def audit_list(
    limit: Annotated[int, typer.Option("--limit", help="Most recent first.")] = 20,
    action: Annotated[
        str | None,
        typer.Option(
            "--action", help="Only these: discard, route, source, secret, route.disable, ..."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Who discarded dead letters, disabled, enabled or removed routes and sources, revoked
    secrets, when and why (replays have their own trail: webhooks replays list)."""
    from models import catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        entries = catalog.list_audit(session, limit=limit, action=action)
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
        say(escape(f"#{a.id} {when(a.at)}  {a.action}  by {a.operator} via {a.via}{count}"))
        say(escape(f"    {target}: {a.reason}" if target else f"    {a.reason}"))
    say("[dim](--json for every field)[/dim]")


# demo ----------------------------------------------------------------------------------------

DEMO_ACCOUNT = "demo"
DEMO_SOURCE = "demo"
# (handler, event types): "flaky" is the built-in handler that fails until replayed.
DEMO_ROUTES = (("log", "order.*"), ("flaky", "payment.*"))
DEMO_EVENTS = ("order.created", "order.paid", "order.shipped", "payment.captured")


def _receiver_url(e: Env) -> str:
    host = e.settings.host
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{e.settings.port}"  # noqa: S104


def _demo_source(e: Env) -> tuple[str, str]:
    """The demo source (created on first use) and its newest secret."""
    from sqlalchemy import select  # noqa: PLC0415

    from core.crypto import SecretBox  # noqa: PLC0415
    from models import catalog, route_catalog  # noqa: PLC0415
    from models.schema import Source  # noqa: PLC0415

    box = SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)
    with e.session() as session:
        source = session.scalars(
            select(Source).where(Source.account == DEMO_ACCOUNT, Source.name == DEMO_SOURCE)
        ).first()
        if source is None:
            source, created = catalog.create_source(
                session, box, e.settings, name=DEMO_SOURCE, provider="standard",
                account=DEMO_ACCOUNT,
            )  # fmt: skip
            secret = created.plaintext
        else:
            active = [s for s in catalog.list_secrets(session, source) if s.revoked_at is None]
            secret = box.decrypt(active[-1].ciphertext) if active else None
            if secret is None:
                secret = catalog.add_secret(session, box, source).plaintext
        have = {(r.handler, r.events_glob) for r in route_catalog.list_routes(session, source)}
        for handler, events in DEMO_ROUTES:
            if (handler, events) not in have:
                route_catalog.add_route(session, box, source, handler=handler, events=events)
        assert secret is not None
        return source.public_id, secret


def _send(
    client: httpx.Client, url: str, secret: str, event_id: str, body: bytes, now: datetime
) -> str:
    import standardwebhooks  # noqa: PLC0415

    signature = standardwebhooks.Webhook(secret).sign(event_id, now, body.decode())
    response = client.post(
        url,
        content=body,
        headers={
            "webhook-id": event_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signature,
            "content-type": "application/json",
        },
    )
    if response.status_code not in (200, 202):
        raise CliError(f"the receiver answered {response.status_code} to {event_id}")
    return str(response.json().get("status", response.status_code))


def _states_table(states: list[queries.DeliveryState], title: str) -> Table:
    # 80 columns without cutting anything: no box, short headers (tries = the attempts, gen =
    # the idempotency key's generation).
    table = Table(
        "event",
        "type",
        "delivery",
        "handler",
        "status",
        "tries",
        "gen",
        title=title,
        box=None,
        pad_edge=False,
    )
    colours = {"succeeded": "green", "dead": "red", "retrying": "yellow"}
    for st in states:
        colour = colours.get(st.status, "cyan")
        row(
            table, st.event_id, st.event_type, st.delivery_id, st.handler,
            Text(st.status, style=colour), st.attempts, st.generation,
        )  # fmt: skip
    # Ids and types whole; a handler or status too long for what is left folds, never cut.
    table.columns[3].overflow = "fold"
    table.columns[4].overflow = "fold"
    return whole(table, "event", "type", "delivery")


def _watch(
    e: Env,
    source: str,
    event_ids: list[str],
    title: str,
    done: Callable[[list[queries.DeliveryState]], bool],
    timeout: float,
) -> list[queries.DeliveryState]:
    from rich.live import Live  # noqa: PLC0415

    from models import queries  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    with Live(console=console, refresh_per_second=8) as live:
        while True:
            with e.session() as session:
                states = queries.deliveries_of(session, source, event_ids)
            live.update(_states_table(states, title))
            if done(states):
                break
            if time.monotonic() > deadline:
                raise CliError(
                    f"deliveries did not get there within {timeout:g}s: {_stalled(e, states)}"
                )
            time.sleep(0.2)
    console.print()  # Live leaves the cursor on the table's last line when not a terminal
    return states


def _workers_answering(e: Env) -> list[str]:
    """The workers that answer a Celery ping within a second (none when the broker is
    unreachable: that is no worker either, as far as the demo can tell)."""
    from tasks.config import create_app  # noqa: PLC0415

    app = create_app(e.settings)
    try:
        replies = app.control.ping(timeout=1.0)
    except Exception:  # noqa: BLE001 (broker down or refusing: nobody answered)
        return []
    finally:
        app.close()
    return sorted(name for reply in replies or [] for name in reply)


def _held_keys(e: Env, pending: list[queries.DeliveryState]) -> list[int]:
    """The pending deliveries whose fast-claim key exists in Redis: a worker refuses each
    copy of them as a duplicate until Postgres' claim takes over (tasks.claims)."""
    import redis  # noqa: PLC0415

    from models.installation import InstallationUnknown, installation_id  # noqa: PLC0415
    from tasks.claims import claim_key, make_client  # noqa: PLC0415

    try:
        installation = installation_id(e.engine)
    except InstallationUnknown:
        return []  # no worker can claim on this database either (its runtime needs the id)
    client = make_client(e.settings.redis_url, e.settings.redis_socket_timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for st in pending:
            pipe.exists(claim_key(installation, st.delivery_id, st.generation))
        held = pipe.execute()
    except redis.RedisError:
        return []
    finally:
        client.close()
    return [st.delivery_id for st, n in zip(pending, held, strict=True) if n]


def _stalled(e: Env, states: list[queries.DeliveryState]) -> str:
    """What holds the deliveries: no worker, keys that say duplicate, or something else."""
    waiting = [st for st in states if st.status in ("pending", "retrying", "processing")]
    workers = _workers_answering(e)
    if not workers:
        return (
            "no worker answered a ping: is a worker running? "
            "(`webhooks run` starts receiver, worker and beat)"
        )
    ids = ", ".join(str(st.delivery_id) for st in waiting) or "none"
    held = _held_keys(e, [st for st in waiting if st.status == "pending"])
    if held:
        return (
            f"deliveries {', '.join(map(str, held))} pending while a worker answered "
            f"({', '.join(workers)}), and their fast-claim keys in Redis say duplicate "
            "(the worker logs delivery.not_claimed outcome=duplicate): keys from a success "
            "Postgres no longer shows, such as after a restore. The sweeper hands such a "
            "delivery to Postgres' claim at its second re-publish (2 x WEBHOOKS_PUBLISH_GRACE)"
        )
    return (
        f"deliveries {ids} unfinished while a worker answered ({', '.join(workers)}): "
        "see the worker's log"
    )


@handle_errors
def demo(
    receiver: Annotated[
        str | None,
        typer.Option("--receiver", help="Receiver URL (default from WEBHOOKS_HOST/PORT)."),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per stage.")] = 60.0,
) -> None:
    """Run the whole flow against the running pipeline (start it with `webhooks run`).

    Creates a demo source and routes, sends signed events (one duplicate, one whose handler
    fails until replayed), shows them move through the states, replays the dead one and
    prints a summary.
    """
    import httpx  # noqa: PLC0415

    from core.logs import configure_logging  # noqa: PLC0415
    from models import replays  # noqa: PLC0415

    e = env()
    configure_logging("WARNING", json=e.settings.log_json)
    base = (receiver or _receiver_url(e)).rstrip("/")
    started = time.monotonic()
    with httpx.Client(timeout=10) as client:
        try:
            client.get(f"{base}/healthz").raise_for_status()
        except httpx.HTTPError:
            raise CliError(
                f"no receiver at {base}: start the pipeline first (`make run` or `webhooks run`)"
            ) from None
        source, secret = _demo_source(e)
        console.print(
            f"demo source {source} (Standard Webhooks), routes: "
            + ", ".join(f"{h} for {t}" for h, t in DEMO_ROUTES)
        )
        run = secrets.token_hex(4)
        now = e.clock.now()
        events = [
            (f"evt_demo_{run}_{n}", kind, json.dumps({
                "type": kind, "timestamp": now.isoformat(), "data": {"order": f"ord_{run}_{n}"},
            }).encode())
            for n, kind in enumerate(DEMO_EVENTS, 1)
        ]  # fmt: skip
        console.rule("1. a provider sends 5 signed webhooks; the last is a retry of the first")
        answers: Counter[str] = Counter()
        for event_id, kind, body in [*events, events[0]]:
            answer = _send(client, f"{base}/webhooks/{source}", secret, event_id, body, now)
            answers[answer] += 1
            console.print(f"  {event_id} {kind:<17} -> {answer}", highlight=False)
    ids = [event_id for event_id, _, _ in events]

    def settled(states: list[queries.DeliveryState]) -> bool:
        return len(states) == len(ids) and all(
            st.status == ("dead" if st.handler == "flaky" else "succeeded") for st in states
        )

    console.rule("2. workers deliver them; the flaky handler fails and its delivery goes dead")
    states = _watch(e, source, ids, "deliveries", settled, timeout)
    dead = [st.delivery_id for st in states if st.status == "dead"]

    console.rule("3. an operator replays the dead letter (audited, same downstream key)")
    request = replays.ReplayRequest(
        operator=login(),
        reason="webhooks demo: the flaky handler fails until its delivery is replayed",
        via="cli",
        filter_as_given={"ids": dead},
        ids=tuple(dead),
    )
    with e.session() as session:
        plan = replays.plan_replay(session, request)
    result = _run(e, plan, show_progress=False)
    console.print(
        f"  replay {result.replay_id} by {request.operator}: {result.replayed} replayed",
        highlight=False,
    )
    final = _watch(
        e, source, ids, "after the replay",
        lambda sts: len(sts) == len(ids) and all(st.status == "succeeded" for st in sts), timeout,
    )  # fmt: skip

    console.rule("summary")
    first_time = sum(1 for st in final if st.delivery_id not in dead)
    for label, value in (
        ("webhooks sent", f"{sum(answers.values())} ({len(ids)} events + 1 provider retry)"),
        ("receiver said", ", ".join(f"{n} {k}" for k, n in sorted(answers.items()))),
        (
            "deliveries",
            f"{len(final)} succeeded: {first_time} first time, {len(dead)} after replay",
        ),
        ("replay audit", f"#{result.replay_id} by {request.operator} (webhooks replays list)"),
        ("took", f"{time.monotonic() - started:.1f}s"),
    ):
        console.print(f"  {label + ':':<14} {value}", highlight=False)
    cmd = cli_command()  # `webhooks` is on PATH only in an activated virtualenv
    for delivery_id in dead:
        console.print(
            f"  {'dead letter:':<14} delivery {delivery_id}: its failed attempt in Flower "
            f"{_flower_row(e, delivery_id)}; {cmd} deliveries show {delivery_id}",
            highlight=False,
            soft_wrap=True,  # a URL cut in two cannot be opened
        )
    console.print(
        f"\nnext:\n  {cmd} events list --source {source}\n  {cmd} events show {ids[-1]}\n"
        f"  {cmd} dead list\n  {cmd} replays list\n"
        f"Flower: http://127.0.0.1:{e.settings.flower_port} (workers, tasks, retries)",
        highlight=False,
    )


def _flower_row(e: Env, delivery_id: int) -> str:
    """The URL of the Flower page of the delivery's FAILURE task (its dead attempt), asked of
    Flower's API with the configured login; else where to search for it."""
    import httpx  # noqa: PLC0415

    from core.messages import DELIVER_TASK  # noqa: PLC0415

    base = f"http://127.0.0.1:{e.settings.flower_port}"
    fallback = f"{base}/tasks (search: ({delivery_id},))"
    if e.settings.flower_password is None:
        return fallback
    auth = (e.settings.flower_user, e.settings.flower_password.get_secret_value())
    params = {"taskname": DELIVER_TASK, "state": "FAILURE", "limit": "200"}
    try:
        answer = httpx.get(f"{base}/api/tasks", params=params, auth=auth, timeout=5)
        tasks = answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return fallback
    for task_id, task in tasks.items():
        # "(7,)", or "([6, 7],)" for a message the publisher packed (its state is its worst
        # delivery's: FAILURE when one of them went dead).
        if delivery_id in [int(i) for i in re.findall(r"\d+", str(task.get("args") or ""))]:
            return f"{base}/task/{task_id}"
    return fallback


def _selection(
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
    from models.candidates import ReplayFilter  # noqa: PLC0415

    has_filter = any(v is not None for v in (source, event_type, since, until))
    if ids and (has_filter or (status or "dead") != "dead"):
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
        source, event_type, status or "dead", parse_when(e, since), parse_when(e, until)
    )
    return {k: v for k, v in given.items() if v is not None}, flt


def register(app: typer.Typer) -> None:
    events.register(app)
    app.add_typer(dead_app, name="dead")
    app.command("replay")(replay)
    app.add_typer(replays_app, name="replays")
    app.add_typer(audit_app, name="audit")
    app.command("demo")(demo)

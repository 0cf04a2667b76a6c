"""``webhooks routes`` (handlers bound to a source: add, list, show, update, pause, resume,
disable, enable, remove) and ``webhooks handlers`` (the handlers this installation
registers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from webhooks.cli.catalog_input import DurationOpt, change_by, duration_or_none, pairs, secret_box
from webhooks.cli.common import (
    CliError,
    Env,
    console,
    env,
    err_console,
    handle_errors,
    print_json,
)
from webhooks.cli.render import (
    JsonOpt,
    OperatorOpt,
    ReasonOpt,
    count,
    fitted,
    login,
    row,
    say,
    show_table,
    whole,
)

# The catalog, providers and crypto are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    from models import catalog


FilterOpt = Annotated[
    str | None,
    typer.Option(
        "--filter",
        help="JMESPath predicate over body, type, headers, e.g. "
        '"body.data.object.amount >= `1000`"; none clears it (docs/routing.md).',
    ),
]

TransformOpt = Annotated[
    str | None,
    typer.Option(
        "--transform",
        help="A registered transform's name (webhooks transforms list): reshapes or drops "
        "each event before the handler; none clears it (docs/routing.md).",
    ),
]
OrderKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--order-key",
        help="JMESPath over body, type, headers whose value orders the route's deliveries per "
        "entity, e.g. body.data.object.customer; none clears it (docs/routing.md).",
    ),
]
LaneOnDeadOpt = Annotated[
    str | None,
    typer.Option(
        "--lane-on-dead",
        help="block (default): a dead event holds its key's lane until replayed or "
        "discarded; skip: the next event of the key runs.",
    ),
]

routes_app = typer.Typer(help="Handlers bound to a source.", no_args_is_help=True)


handlers_app = typer.Typer(help="The handlers this installation registers.", no_args_is_help=True)
transforms_app = typer.Typer(
    help="The transforms this installation registers.", no_args_is_help=True
)


def route_view(r: Any) -> dict[str, Any]:
    """A route (the ORM's row, or :mod:`models.reads`' with the same columns) as printed."""
    from core.publish_target import shown_options
    from models import views as breaker

    return {
        "id": r.id,
        "handler": r.handler,
        "events": r.events_glob,
        "options": shown_options(r.options),  # a URL's password masked
        "max_attempts": r.max_attempts,
        "max_age_s": r.max_age_s,
        "filter": r.filter,
        "transform": r.transform,
        "order_key": r.order_key,
        "lane_on_dead": r.lane_on_dead,
        "supersede": bool(r.supersede),
        "active": r.active,
        **breaker.state_of(r).view(),
    }


def _lanes_text(v: dict[str, Any]) -> str:
    """A route's lane options in one line (models/lanes.py)."""
    if v["order_key"] is None:
        return "none (unordered)"
    supersede = ", supersede" if v["supersede"] else ""
    return f"order key {v['order_key']}, on dead: {v['lane_on_dead']}{supersede}"


def _breaker_cell(v: dict[str, Any]) -> str:
    """``paused`` or the breaker state, for the routes table."""
    state = str(v["breaker"]["state"])
    return f"paused, {state}" if v["paused"] else state


def _quarantine(on: bool) -> dict[str, str]:
    from core.shapes import QUARANTINE_OPTION

    return {QUARANTINE_OPTION: "true"} if on else {}


@routes_app.command("add")
@handle_errors
def routes_add(
    source: str,
    handler: Annotated[str, typer.Option(help="Handler name (forward, log, ...).")],
    events: Annotated[str, typer.Option(help="Event type glob, e.g. invoice.*")] = "*",
    option: Annotated[
        list[str] | None, typer.Option("--option", help="KEY=VALUE, repeatable.")
    ] = None,
    max_attempts: Annotated[int | None, typer.Option(help="Retry budget for this route.")] = None,
    max_age: DurationOpt = None,
    filter_: FilterOpt = None,
    transform: TransformOpt = None,
    quarantine_drift: Annotated[
        bool,
        typer.Option(
            "--quarantine-drift",
            help="Hold events whose payload shape drifted until `webhooks drift accept`.",
        ),
    ] = False,
    order_key: OrderKeyOpt = None,
    lane_on_dead: LaneOnDeadOpt = None,
    supersede: Annotated[
        bool,
        typer.Option(
            "--supersede",
            help="With --order-key: an event older (by its signed time) than one of its key "
            "already succeeded here is recorded superseded, its handler not called.",
        ),
    ] = False,
    operator: OperatorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Bind a handler to a source, optionally for matching event types only (audited).

    The handler must be registered here (webhooks handlers list). A route on types its
    source's provider reads from an unsigned header is added with a warning saying so.
    --filter: a JMESPath predicate over body, type and headers (docs/routing.md); a bad one
    is refused with its position and nothing is saved. --transform: a registered transform
    (webhooks transforms list); an unknown name is refused and nothing is saved. --order-key:
    deliveries whose events share its value run one at a time, in the order accepted
    (docs/routing.md)."""
    from models import catalog, route_catalog

    e = env()
    _registry(e).require(handler)
    if route_catalog.stored_transform(transform) is not None:
        _transforms(e).require(route_catalog.stored_transform(transform))
    with e.session() as session:
        found = catalog.get_source(session, source)
        route, signing = route_catalog.add_route(
            session,
            secret_box(e),
            found,
            handler=handler,
            events=events,
            options={**pairs(option, "--option"), **_quarantine(quarantine_drift)},
            max_attempts=max_attempts,
            max_age=duration_or_none(max_age),
            filter=filter_,
            transform=transform,
            order_key=order_key,
            lane_on_dead=lane_on_dead or "block",
            supersede=supersede,
            operator=operator or login(),
        )
        view = route_view(route)
        warning = route_catalog.unsigned_type_warning(found, events)
    if signing is not None:
        view["signing_secret"] = signing
    if warning is not None:
        view["warning"] = warning
    if as_json:
        print_json(view)
        return
    say(escape(f"route {view['id']}: {handler} for {events}"))
    if view["filter"] is not None:
        say(escape(f"filter: {view['filter']}"))
    if view["transform"] is not None:
        say(escape(f"transform: {view['transform']}"))
    if view["order_key"] is not None:
        say(escape(f"lanes: {_lanes_text(view)}"))
    if warning is not None:
        err_console.print(f"warning: {escape(warning)}", highlight=False, soft_wrap=True)
    if signing is not None:
        console.print(f"signing secret (give it to the downstream): {signing}", highlight=False)


@routes_app.command("list")
@handle_errors
def routes_list(
    source: Annotated[
        str | None, typer.Argument(help="A source's id or name; every source's when omitted.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """A source's routes, or every route with its source."""
    from models import reads

    e = env()
    with e.reads() as conn:
        if source is not None:
            views = [route_view(r) for r in reads.list_routes(conn, reads.source_id(conn, source))]
        else:
            views = [
                {"source": r.source_public_id, "source_name": r.source_name, **route_view(r)}
                for r in reads.list_all_routes(conn)
            ]
    if as_json:
        print_json(views)
        return
    if not views:
        say("no routes: webhooks routes add SOURCE --handler NAME")
        return
    if source is not None:
        table = Table("id", "handler", "events", "active", "breaker")
        table.add_column("limits", overflow="fold")
        table.add_column("options", overflow="fold")  # a URL is folded, never cut
        default_budget = e.settings.route_max_in_flight
        for v in views:
            options = "\n".join(f"{k}={o}" for k, o in v["options"].items())
            if v["filter"] is not None:
                options = "\n".join(x for x in (options, f"filter: {v['filter']}") if x)
            if v["transform"] is not None:
                options = "\n".join(x for x in (options, f"transform: {v['transform']}") if x)
            if v["order_key"] is not None:
                options = "\n".join(x for x in (options, f"lanes: {_lanes_text(v)}") if x)
            limits = _limits_cell(v, default_budget).replace(", ", ",\n")
            row(
                table,
                v["id"],
                v["handler"],
                v["events"],
                v["active"],
                _breaker_cell(v),
                limits,
                options,
            )
        show_table(whole(table, "id", "handler", "events"))
        return
    # Every source's routes: whole ids, sources, handlers and event types take the width, so
    # no box and one state column (disabled, paused, else the breaker's state).
    table = Table("id", "source", "handler", "events", "state", box=None)
    for v in views:
        state = "disabled" if not v["active"] else "paused" if v["paused"] else _breaker_cell(v)
        row(table, v["id"], v["source"], v["handler"], v["events"], state)
    # Event types fold rather than push the state out: another route's long list of types
    # must not cut this one's state at 80 columns.
    table.columns[3].overflow = "fold"
    show_table(
        whole(table, "id", "source", "handler", "state"),
        "routes list SOURCE for a source's options; --json for every field",
    )


def _limits_cell(v: dict[str, Any], default_budget: int) -> str:
    """The route's in-flight budget and rate limit, for the routes table and `routes show`."""
    limits = v["limits"]
    budget = limits["max_in_flight"]
    flight = f"{budget} in flight" if budget else f"{default_budget} in flight (default)"
    return f"{flight}, rate {limits['rate_limit'] or 'unlimited'}"


def _registry(e: Env) -> Any:
    from tasks.handlers.registry import load_registry

    return load_registry(e.settings.handler_modules)


def _transforms(e: Env) -> Any:
    from tasks.transforms import load_transforms

    return load_transforms(e.settings.handler_modules)


def _say_route(verb: str, changed: catalog.Changed, extra: str = "") -> None:
    t = changed.target
    say(
        escape(
            f"route {t['route']} ({t['handler']} for {t['events']} on {t['source']}) {verb} "
            f"(audit {changed.audit_id}){extra}"
        )
    )


RouteIdArg = Annotated[int, typer.Argument(metavar="ROUTE_ID", help="See `routes list SOURCE`.")]


@routes_app.command("disable")
@handle_errors
def routes_disable(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Stop routing new events to this route (audited). Its deliveries that are not finished
    go dead with route_inactive when a worker picks them up; replay them after
    `routes enable`."""
    from models import route_catalog

    e = env()
    with e.session() as session:
        changed = route_catalog.set_route_active(
            session, route_id, False, change_by(operator, reason), now=None
        )
    extra = ""
    if changed.unfinished:
        extra = (
            f"; {changed.unfinished} of its deliveries are not finished: they go dead with "
            f"route_inactive (replay them after webhooks routes enable {route_id})"
        )
    _say_route("disabled: new events no longer get a delivery for it", changed, extra)


@routes_app.command("enable")
@handle_errors
def routes_enable(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Route new events to this route again (audited); its handler must be registered."""
    from models import route_catalog

    e = env()
    registry = _registry(e)
    with e.session() as session:
        registry.require(route_catalog.get_route(session, route_id).handler)
        changed = route_catalog.set_route_active(
            session, route_id, True, change_by(operator, reason), now=None
        )
    _say_route("enabled", changed)


@routes_app.command("show")
@handle_errors
def routes_show(route_id: RouteIdArg, as_json: JsonOpt = False) -> None:
    """One route: its handler, and whether it is paused and its circuit breaker's state."""
    from models import route_catalog

    e = env()
    with e.session() as session:
        view = route_view(route_catalog.get_route(session, route_id))
    if as_json:
        print_json(view)
        return
    b = view["breaker"]
    say(escape(f"route {view['id']}: {view['handler']} for {view['events']}"))
    say(escape(f"filter: {view['filter'] or 'none (every event of its types)'}"))
    shaped = view["transform"] or "none (the handler gets the event as received)"
    say(escape(f"transform: {shaped}"))
    if view["options"]:
        say(escape("options: " + ", ".join(f"{k}={o}" for k, o in view["options"].items())))
    say(escape(f"lanes: {_lanes_text(view)}"))
    if not view["active"]:
        since = f" since {view['disabled_at']}: {view['disabled_reason']}"
        say(escape(f"disabled{since if view['disabled_at'] else ''}"))
    if view["paused"]:
        say(escape(f"paused since {view['paused_at']}: {view['pause_reason']}"))
    say(escape(f"limits: {_limits_cell(view, e.settings.route_max_in_flight)}"))
    say(
        escape(
            f"breaker {b['state']} (trips {b['trips']}, opened {b['opened_at']}, next probe "
            f"{b['probe_at']}); window since {b['window_started_at']}: "
            f"{b['window_failures']} failures of {b['window_requests']} requests"
        )
    )


@routes_app.command("update")
@handle_errors
def routes_update(
    route_id: RouteIdArg,
    rate_limit: Annotated[
        str | None,
        typer.Option(
            "--rate-limit", help="Most calls to the downstream: 50/s, 3000/m, 100/h, none."
        ),
    ] = None,
    max_in_flight: Annotated[
        str | None,
        typer.Option(
            "--max-in-flight",
            help="Most deliveries in flight at once, or none (the default budget).",
        ),
    ] = None,
    filter_: FilterOpt = None,
    transform: TransformOpt = None,
    quarantine_drift: Annotated[
        bool | None,
        typer.Option(
            "--quarantine-drift/--no-quarantine-drift",
            help="Hold events whose payload shape drifted until `webhooks drift accept`"
            " (docs/drift.md).",
        ),
    ] = None,
    order_key: OrderKeyOpt = None,
    lane_on_dead: LaneOnDeadOpt = None,
    supersede: Annotated[
        bool | None,
        typer.Option(
            "--supersede/--no-supersede", help="Supersede stale events of a key (or stop)."
        ),
    ] = None,
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
) -> None:
    """Set the route's delivery limits (audited): they hold across every worker and host;
    waiting for them is not an attempt. --filter sets its filter (``none`` clears it): it
    applies to the events accepted after the change; a bad one is refused with its position
    and nothing is saved. --transform sets its transform (``none`` clears it): deliveries
    claimed afterwards run it; an unknown name is refused and nothing is saved."""
    from models import breaker, route_catalog
    from models.admission import parse_max_in_flight, parse_rate

    values: dict[str, Any] = {}
    if rate_limit is not None:
        values["rate"] = parse_rate(rate_limit)
    if max_in_flight is not None:
        values["max_in_flight"] = parse_max_in_flight(max_in_flight)
    lane_change = (order_key, lane_on_dead, supersede) != (None, None, None)
    others = (filter_, transform, quarantine_drift)
    if not values and others == (None, None, None) and not lane_change:
        raise CliError(
            "nothing to change: give --rate-limit, --max-in-flight, --filter, --transform,"
            " --quarantine-drift, --order-key, --lane-on-dead and/or --supersede"
        )
    if filter_ is not None:
        route_catalog.check_filter(filter_)  # before anything is written
    if order_key is not None:
        route_catalog.check_order_key(order_key)
    e = env()
    if route_catalog.stored_transform(transform) is not None:
        _transforms(e).require(route_catalog.stored_transform(transform))
    with e.session() as session:
        limits = None
        if values:
            change = change_by(operator, reason or "limits updated")
            limits = breaker.set_limits(session, route_id, change, now=None, **values)
        filtered = None
        if filter_ is not None:
            change = change_by(operator, reason or "filter updated")
            filtered = route_catalog.set_filter(session, route_id, filter_, change, now=None)
        transformed = None
        if transform is not None:
            change = change_by(operator, reason or "transform updated")
            transformed = route_catalog.set_transform(
                session, route_id, transform, change, now=None
            )
        quarantined = None
        if quarantine_drift is not None:
            change = change_by(operator, reason or "drift quarantine updated")
            quarantined = route_catalog.set_quarantine_drift(
                session, route_id, quarantine_drift, change, now=None
            )
        laned = None
        if lane_change:
            change = change_by(operator, reason or "lanes updated")
            laned = route_catalog.set_lanes(
                session,
                route_id,
                change,
                order_key=order_key,
                lane_on_dead=lane_on_dead,
                supersede=supersede,
                now=None,
            )
    if limits is not None:
        after = limits.target["after"]
        _say_route(
            "updated",
            limits,
            f": {_limits_cell({'limits': after}, e.settings.route_max_in_flight)}",
        )
    if filtered is not None:
        now = filtered.target["after"]
        _say_route("updated", filtered, f": filter {now if now is not None else 'none'}")
    if transformed is not None:
        name = transformed.target["after"]
        _say_route("updated", transformed, f": transform {name or 'none'}")
    if quarantined is not None:
        _say_route(
            "updated", quarantined, f": drift quarantine {'on' if quarantine_drift else 'off'}"
        )
    if laned is not None:
        _say_route("updated", laned, f": lanes {_lanes_text(laned.target['after'])}")


@routes_app.command("pause")
@handle_errors
def routes_pause(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Hold this route's deliveries without attempting them (audited): new events are still
    accepted and stored; `routes resume` delivers them."""
    from models import breaker

    e = env()
    with e.session() as session:
        changed = breaker.set_paused(session, route_id, True, change_by(operator, reason), now=None)
    _say_route(f"paused: {count(changed.unfinished, 'delivery')} held", changed)


@routes_app.command("resume")
@handle_errors
def routes_resume(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Deliver a paused route's held deliveries again (audited; the sweeper publishes them)."""
    from models import breaker

    e = env()
    with e.session() as session:
        changed = breaker.set_paused(
            session, route_id, False, change_by(operator, reason or "resumed"), now=None
        )
    _say_route(f"resumed: {count(changed.unfinished, 'delivery')} to deliver", changed)


@routes_app.command("remove")
@handle_errors
def routes_remove(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Delete a route (audited). Refused while it has deliveries that are not finished or
    dead (disable it instead); finished ones keep their history."""
    from models import route_catalog

    e = env()
    with e.session() as session:
        changed = route_catalog.remove_route(
            session, route_id, change_by(operator, reason), now=None
        )
    _say_route("removed", changed)


@handlers_app.command("list")
@handle_errors
def handlers_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Handlers a route can name: the built-ins, the webhooks.handlers entry points and the
    modules in WEBHOOKS_HANDLER_MODULES, with the active routes using each."""
    from models import route_catalog

    e = env()
    infos = _registry(e).describe()
    with e.session() as session:
        routes = route_catalog.active_routes(session)
    used: dict[str, list[int]] = {}
    for route, _source in routes:
        used.setdefault(route.handler, []).append(route.id)
    views = [
        {
            "name": i.name,
            "origin": i.origin,
            "module": i.module,
            "summary": i.summary,
            "active_routes": used.get(i.name, []),
        }
        for i in infos
    ]
    known = {i.name for i in infos}
    unknown = {h: ids for h, ids in used.items() if h not in known}
    if as_json:
        print_json({"handlers": views, "unknown_in_routes": unknown})
        return
    table = Table("name", "from", "active routes", "what it does")
    for v in views:
        routes_text = " ".join(str(i) for i in v["active_routes"]) or "-"
        row(table, v["name"], v["origin"], routes_text, v["summary"])
    console.print(fitted(table))
    for handler, ids in sorted(unknown.items()):
        say(
            escape(
                f"active route {' '.join(str(i) for i in ids)} names {handler!r}, which is not "
                "registered here: its events go dead with unknown_handler (deploy the handler, "
                "or webhooks routes disable ROUTE_ID)"
            )
        )


@transforms_app.command("list")
@handle_errors
def transforms_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Transforms a route can name (--transform): the built-ins, the webhooks.transforms
    entry points and those WEBHOOKS_HANDLER_MODULES register."""
    names = _transforms(env()).names()
    if as_json:
        print_json(names)
        return
    for name in names:
        say(escape(name))


def register(app: typer.Typer) -> None:
    app.add_typer(routes_app, name="routes")
    app.add_typer(handlers_app, name="handlers")
    app.add_typer(transforms_app, name="transforms")

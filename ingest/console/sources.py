"""The console's sources and routes: the catalog with each route's pause and breaker state,
and the audited changes (a source created, enabled or disabled; a route added, enabled,
disabled, removed, paused or resumed, or its limits, filter, transform or lane options
set), the session's token name as the operator, ``via: console``. A created source's
generated signing secret and a forward route's are shown once, on the page that answers the
form, as ``webhooks sources add`` and ``routes add`` print them: never logged, never stored
in the clear."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from sqlalchemy.orm import Session
from starlette.responses import Response
from starlette.routing import Route

from core.crypto import SecretBox
from core.errors import WebhooksError
from core.ttl import known_providers
from ingest.console.base import Console, Visit, args_of, log, one, opt, redirect
from models import breaker, catalog, queries, route_catalog
from models import console as reads
from models.admission import parse_max_in_flight, parse_rate
from models.catalog import CatalogError, Change
from models.findings import open_findings
from models.retention_layout import ensure_partitions
from tasks.handlers.registry import load_registry
from tasks.transforms import load_transforms

ROUTE_ACTIONS = ("enable", "disable", "remove", "pause", "resume")
SOURCE_ACTIONS = ("enable", "disable")


def routes(c: Console) -> list[Route]:
    # The named forms before the generic actions (Starlette takes the first match).
    return [
        c.get("/routes", routes_page),
        c.post("/sources/new", source_new),
        c.post("/sources/{source}/routes", route_new),
        c.post("/routes/{route}/limits", route_limits),
        c.post("/routes/{route}/filter", route_filter),
        c.post("/routes/{route}/transform", route_transform),
        c.post("/routes/{route}/lanes", route_lanes),
        c.post("/routes/{route}/{action}", route_action),
        c.post("/sources/{source}/{action}", source_action),
    ]


# The routes page's view (its search and its page's cursor): the forms carry it back as
# ``back``, and an action returns there.
VIEW_ARGS = ("q", "after")


def _view(values: Mapping[str, str]) -> dict[str, str]:
    """The view's arguments that are set (``q``, ``after``), from a query or a form."""
    return {k: v for k, v in args_of(values, VIEW_ARGS).items() if v}


def _routes_url(view: dict[str, str]) -> str:
    return "/console/routes" + (f"?{urlencode(view)}" if view else "")


def _back(v: Visit) -> str:
    """Where an action returns: the routes page as the form's page showed it (its search and
    page, read from the form's ``back``, never a URL it names: no redirect elsewhere)."""
    return _routes_url(_view(dict(parse_qsl(one(v.form, "back") or ""))))


async def routes_page(c: Console, v: Visit) -> Response:
    """A page of sources, newest first (``?q=`` a part of a name or public id; ``?after=``
    the cursor), with their routes and forms: only the page's sources are read."""
    view = _view(v.request.query_params)
    try:
        q, after = opt(view.get("q")), opt(view.get("after"))
        page = await c.db(lambda s: reads.catalog_page(s, q=q, after=after))
    except queries.QueryError as exc:
        return c.error(v, str(exc), 404 if isinstance(exc, queries.NotFoundError) else 400)
    shown = {s.public_id for s in page.sources}
    findings = [f for f in await c.db(open_findings) if f.source in shown]
    context = {
        "sources": page.sources,
        "findings": findings,
        "message": None,
        "q": view.get("q", ""),
        "back": urlencode(view),
        "first": _routes_url({"q": view["q"]} if "q" in view else {}) if after else None,
        "next": _routes_url({**view, "after": page.after}) if page.after else None,
        "providers": known_providers(),
        "handlers": load_registry(c.settings.handler_modules).names(),
        "transforms": load_transforms(c.settings.handler_modules).names(),
    }
    return c.show(v, "routes.html", context)


def _box(c: Console) -> SecretBox:
    key = c.settings.secret_key.get_secret_value()
    return SecretBox(key, legacy=c.settings.secret_key_legacy)


async def source_new(c: Console, v: Visit) -> Response:
    """A new source (audited): its id, URL path and, when generated, its secret (once)."""
    name = (one(v.form, "name") or "").strip()
    provider = (one(v.form, "provider") or "").strip()
    account = (one(v.form, "account") or "").strip() or "default"
    secret = one(v.form, "secret") or None
    try:

        def create(s: Session) -> tuple[str, str, str | None]:
            source, created = catalog.create_source(
                s,
                _box(c),
                c.settings,
                name=name,
                provider=provider,
                account=account,
                secret=secret,
                operator=v.session.operator,
                via="console",
            )
            return source.public_id, created.id, created.plaintext

        public_id, secret_id, plaintext = await c.db(create)
        # A longer TTL needs partitions further ahead (as `sources add` lays them out).
        await c.db(lambda s: ensure_partitions(s.get_bind(), c.settings, None))  # type: ignore[arg-type]
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.source_created", source=public_id, operator=v.session.operator)
    context = {
        "what": f"source {name}",
        "facts": [
            ("source id", public_id),
            ("url path", f"/webhooks/{public_id}"),
            ("secret id", secret_id),
        ],
        "secret": plaintext,
        "secret_for": "the provider's webhook settings",
    }
    return c.show(v, "created.html", context, 201)


async def route_new(c: Console, v: Visit) -> Response:
    """A new route on a source (audited); a forward route's signing secret, once."""
    ref = v.request.path_params["source"]
    handler = (one(v.form, "handler") or "").strip()
    events = (one(v.form, "events") or "").strip() or "*"
    url = (one(v.form, "url") or "").strip()
    attempts = (one(v.form, "max_attempts") or "").strip()
    expression = (one(v.form, "filter") or "").strip() or None
    transform = (one(v.form, "transform") or "").strip() or None
    try:
        load_registry(c.settings.handler_modules).require(handler)
        if transform is not None:
            load_transforms(c.settings.handler_modules).require(transform)
        if attempts and not attempts.isdigit():
            raise queries.QueryError(f"max attempts must be a whole number, not {attempts!r}")
        options = {"url": url} if url else {}

        def add(s: Session) -> tuple[int, str | None, str | None]:
            source = catalog.get_source(s, ref)
            route, signing = route_catalog.add_route(
                s,
                _box(c),
                source,
                handler=handler,
                events=events,
                options=options,
                max_attempts=int(attempts) if attempts else None,
                filter=expression,
                transform=transform,
                operator=v.session.operator,
                via="console",
            )
            return route.id, signing, route_catalog.unsigned_type_warning(source, events)

        route_id, signing, warning = await c.db(add)
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.route_added", route=route_id, operator=v.session.operator)
    context = {
        "what": f"route {route_id}: {handler} for {events}",
        "facts": [("route id", str(route_id))],
        "secret": signing,
        "secret_for": "the downstream, to verify what this route forwards",
        "warning": warning,
    }
    return c.show(v, "created.html", context, 201)


async def route_limits(c: Console, v: Visit) -> Response:
    """A route's admission limits (audited: before and after)."""
    change = Change(v.session.operator, one(v.form, "reason") or "", via="console")
    rate = (one(v.form, "rate") or "").strip()
    in_flight = (one(v.form, "max_in_flight") or "").strip()
    try:
        route_id = queries.parse_id(v.request.path_params["route"], "route id")
        values: dict[str, Any] = {}
        if rate:
            values["rate"] = parse_rate(rate)
        if in_flight:
            values["max_in_flight"] = parse_max_in_flight(in_flight)
        await c.db(lambda s: breaker.set_limits(s, route_id, change, now=None, **values))
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.route_changed", route=route_id, action="limits", operator=change.operator)
    return redirect(_back(v))


async def route_filter(c: Console, v: Visit) -> Response:
    """Set or clear a route's filter (audited: before and after); a bad expression is refused
    with its position and nothing is saved."""
    change = Change(v.session.operator, one(v.form, "reason") or "", via="console")
    expression = (one(v.form, "filter") or "").strip() or None
    try:
        route_id = queries.parse_id(v.request.path_params["route"], "route id")
        await c.db(lambda s: route_catalog.set_filter(s, route_id, expression, change, now=None))
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.route_changed", route=route_id, action="filter", operator=change.operator)
    return redirect(_back(v))


async def route_transform(c: Console, v: Visit) -> Response:
    """Set or clear a route's transform (audited ``route.transform``: before and after); a
    name no module registers is refused, naming the registered ones, and nothing is saved."""
    change = Change(v.session.operator, one(v.form, "reason") or "", via="console")
    name = route_catalog.stored_transform(one(v.form, "transform"))
    try:
        route_id = queries.parse_id(v.request.path_params["route"], "route id")
        if name is not None:
            load_transforms(c.settings.handler_modules).require(name)
        await c.db(lambda s: route_catalog.set_transform(s, route_id, name, change, now=None))
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.route_changed", route=route_id, action="transform", operator=change.operator)
    return redirect(_back(v))


async def route_lanes(c: Console, v: Visit) -> Response:
    """Set a route's lane options as the form holds them (audited ``route.lanes``: before and
    after): its order key (empty: none), what a dead event does to its lane, and whether it
    supersedes stale events. The checks of ``webhooks routes update``: a bad order key is
    refused with its position, ``--supersede`` needs an order key and a source that signs its
    event time; nothing is saved when one fails."""
    change = Change(v.session.operator, one(v.form, "reason") or "", via="console")
    key = (one(v.form, "order_key") or "").strip() or "none"
    on_dead = (one(v.form, "lane_on_dead") or "").strip() or "block"
    supersede = (one(v.form, "supersede") or "") == "on"
    try:
        route_id = queries.parse_id(v.request.path_params["route"], "route id")
        route_catalog.check_order_key(key)  # before anything is written

        def save(s: Session) -> None:
            route_catalog.set_lanes(
                s,
                route_id,
                change,
                order_key=key,
                lane_on_dead=on_dead,
                supersede=supersede,
                now=None,
            )

        await c.db(save)
    except WebhooksError as exc:
        return c.error(v, str(exc))
    log.info("console.route_changed", route=route_id, action="lanes", operator=change.operator)
    return redirect(_back(v))


def _change(c: Console, v: Visit, allowed: tuple[str, ...]) -> tuple[str, Change] | Response:
    """The requested action and its audit record, or the error page of an unknown action."""
    action: str = v.request.path_params["action"]
    if action not in allowed:
        return c.error(v, f"unknown action: {action}", 404)
    return action, Change(v.session.operator, one(v.form, "reason") or "", via="console")


async def route_action(c: Console, v: Visit) -> Response:
    asked = _change(c, v, ROUTE_ACTIONS)
    if isinstance(asked, Response):
        return asked
    action, change = asked
    try:
        route_id = queries.parse_id(v.request.path_params["route"], "route id")

        def act(s: Session) -> None:
            if action in ("enable", "disable"):
                route_catalog.set_route_active(s, route_id, action == "enable", change, now=None)
            elif action == "remove":
                route_catalog.remove_route(s, route_id, change, now=None)
            else:
                breaker.set_paused(s, route_id, action == "pause", change, now=None)

        await c.db(act)
    except (CatalogError, queries.QueryError) as exc:
        return c.error(v, str(exc), 409)
    log.info("console.route_changed", route=route_id, action=action, operator=change.operator)
    return redirect(_back(v))


async def source_action(c: Console, v: Visit) -> Response:
    asked = _change(c, v, SOURCE_ACTIONS)
    if isinstance(asked, Response):
        return asked
    action, change = asked
    ref = v.request.path_params["source"]
    try:

        def act(s: Session) -> None:
            source = catalog.get_source(s, ref)
            catalog.set_source_active(s, source, action == "enable", change, now=None)

        await c.db(act)
    except CatalogError as exc:
        return c.error(v, str(exc), 409)
    log.info("console.source_changed", action=action, operator=change.operator)
    return redirect(_back(v))

"""The console's sources and routes: the catalog with each route's pause and breaker state,
and the audited changes (a route enabled, disabled, removed, paused or resumed; a source
enabled or disabled), the session's token name as the operator, ``via: console``."""

from __future__ import annotations

from sqlalchemy.orm import Session
from starlette.responses import Response
from starlette.routing import Route

from ingest.console.base import Console, Visit, log, one, redirect
from models import breaker, catalog, queries, route_catalog
from models import console as reads
from models.catalog import CatalogError, Change

ROUTE_ACTIONS = ("enable", "disable", "remove", "pause", "resume")
SOURCE_ACTIONS = ("enable", "disable")


def routes(c: Console) -> list[Route]:
    return [
        c.get("/routes", routes_page),
        c.post("/routes/{route}/{action}", route_action),
        c.post("/sources/{source}/{action}", source_action),
    ]


async def routes_page(c: Console, v: Visit) -> Response:
    sources = await c.db(reads.catalog)
    return c.show(v, "routes.html", {"sources": sources, "message": None})


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
    return redirect("/console/routes")


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
    return redirect("/console/routes")

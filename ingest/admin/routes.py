"""The admin API's routes: a route (its handler, options, filter, transform) with its pause
and circuit breaker state; pause and resume
(audited, the token's name as the operator, ``via: api``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from core.publish_target import shown_options
from ingest.admin.deps import Db, Operator, PathId, error
from ingest.admin.schemas import NOT_FOUND, ErrorOut, PauseIn
from models import breaker, queries, route_catalog
from models.catalog import CatalogError, Change

router = APIRouter()
CHANGE_RESPONSES: dict[int | str, dict[str, Any]] = {**NOT_FOUND, 409: {"model": ErrorOut}}


def _route_state(session: Session, route_id: int) -> dict[str, Any]:
    """The route as ``webhooks routes show --json`` describes it: handler, event types,
    options (a URL's password masked), filter and transform, then its pause and breaker."""
    try:
        state = breaker.route_state(session, route_id).view()
        route = route_catalog.get_route(session, route_id)
    except CatalogError as exc:
        raise queries.NotFoundError(str(exc)) from None
    # What decides which events make work for it, in what shape and order (docs/routing.md).
    routing = {
        "filter": route.filter,
        "transform": route.transform,
        "order_key": route.order_key,
        "lane_on_dead": route.lane_on_dead,
        "supersede": route.supersede,
    }
    return {
        "route": route_id,
        "handler": route.handler,
        "events": route.events_glob,
        "active": route.active,
        "options": shown_options(route.options),
        **state,
        **routing,
    }


@router.get(
    "/routes/{route_id}",
    tags=["routes"],
    summary="A route: its handler, options, filter, transform, lanes, pause and breaker state",
    responses=NOT_FOUND,
)
def show_route(route_id: PathId, session: Db) -> dict[str, Any]:
    """The route's handler, event types, options (a URL's password shown as `***`), filter
    (JMESPath, or null), transform (a registered name, or null), order key, what a dead event
    does to its lane, and whether it supersedes stale events; whether it is paused (since
    when, why) and its breaker: `closed`, `open` or `half_open`, when it opened, the next
    probe, trips, and the failure window."""
    return _route_state(session, route_id)


def _set_paused(session: Session, route_id: int, paused: bool, body: PauseIn, operator: str) -> Any:
    _route_state(session, route_id)  # 404 for an unknown route
    try:
        breaker.set_paused(
            session, route_id, paused, Change(operator, body.reason, via="api"), now=None
        )
    except CatalogError as exc:
        return error(409, str(exc), "already" if paused else "not_paused")
    return _route_state(session, route_id)


def _pause_endpoint(paused: bool) -> Callable[..., Any]:
    def endpoint(route_id: PathId, body: PauseIn, session: Db, operator: Operator) -> Any:
        return _set_paused(session, route_id, paused, body, operator)

    return endpoint


def _add_pause_and_resume() -> None:
    """Pause and resume: one endpoint each, the same but for the state they ask for."""
    for action, paused, summary, description in (
        (
            "pause",
            True,
            "Pause a route: hold its deliveries without attempting them",
            "New events are still accepted and stored; nothing is attempted until resumed.",
        ),
        (
            "resume",
            False,
            "Resume a paused route: its held deliveries go out again",
            "The sweeper publishes the held deliveries on its next runs.",
        ),
    ):
        router.add_api_route(
            f"/routes/{{route_id}}/{action}",
            _pause_endpoint(paused),
            methods=["POST"],
            name=f"{action}_route",
            tags=["routes"],
            summary=summary,
            description=description,
            responses=CHANGE_RESPONSES,
        )


_add_pause_and_resume()

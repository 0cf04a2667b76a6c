"""The admin API's routes: a route (its handler, options, filter, transform) with its pause
and circuit breaker state; pause and resume; its filter, transform and lane options changed
(each audited, the token's name as the operator, ``via: api``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from core.filters import FilterError
from core.publish_target import shown_options
from ingest.admin.deps import Db, Operator, PathId, State, Writes, error
from ingest.admin.schemas import NOT_FOUND, ErrorOut, PauseIn, RouteUpdateIn
from ingest.plane import PlaneState
from models import breaker, queries, route_catalog
from models.catalog import CatalogError, Change
from tasks.transforms import UnregisteredTransformError, load_transforms

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
    def endpoint(route_id: PathId, body: PauseIn, session: Writes, operator: Operator) -> Any:
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


ROUTING = ("filter", "transform", "order_key", "lane_on_dead", "supersede")
LANES = ("order_key", "lane_on_dead", "supersede")


def _check_routing(state: PlaneState, body: RouteUpdateIn, given: set[str]) -> None:
    """What ``webhooks routes update`` checks before it writes: the filter and the order key
    compile (the position of what is wrong), the transform is registered."""
    if "filter" in given:
        route_catalog.check_filter(body.filter)
    if "order_key" in given:
        route_catalog.check_order_key(body.order_key)
    name = route_catalog.stored_transform(body.transform) if "transform" in given else None
    if name is not None:
        load_transforms(state.settings.handler_modules).require(name)


@router.patch(
    "/routes/{route_id}",
    tags=["routes"],
    summary="Change a route's filter, transform or lane options",
    responses={**CHANGE_RESPONSES, 400: {"model": ErrorOut}},
)
def update_route(
    route_id: PathId, body: RouteUpdateIn, session: Writes, state: State, operator: Operator
) -> Any:
    """The fields given change, each audited as `webhooks routes update` does it
    (`route.filter`, `route.transform`, `route.lanes`: before and after); `null` clears a
    filter, a transform or an order key. A filter or order key that does not compile is
    refused (400, reason `bad_filter`, the position in the detail), so is an unregistered
    transform (`bad_transform`) and a `supersede` without an order key or on a source that
    signs no event time (`bad_source`): nothing is saved. Answers the route as
    `GET /routes/{id}` shows it."""
    given = body.model_fields_set & set(ROUTING)
    if not given:
        return error(400, f"nothing to change: give one of {', '.join(ROUTING)}", "bad_input")
    _route_state(session, route_id)  # 404 for an unknown route
    try:
        _check_routing(state, body, given)
    except FilterError as exc:
        return error(400, str(exc), "bad_filter")
    except UnregisteredTransformError as exc:
        return error(400, str(exc), "bad_transform")
    except CatalogError as exc:  # an order key refused
        return error(400, str(exc), "bad_filter")
    change = Change(operator, body.reason, via="api")
    # A refusal below raises: the request's transaction rolls back whatever came first.
    if "filter" in given:
        route_catalog.set_filter(session, route_id, body.filter, change, now=None)
    if "transform" in given:
        route_catalog.set_transform(session, route_id, body.transform, change, now=None)
    if given & set(LANES):
        route_catalog.set_lanes(
            session,
            route_id,
            change,
            order_key=(body.order_key or "none") if "order_key" in given else None,
            lane_on_dead=body.lane_on_dead,
            supersede=body.supersede,
            now=None,
        )
    return _route_state(session, route_id)

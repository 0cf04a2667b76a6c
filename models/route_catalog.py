"""Routes: a handler bound to a source's events (add, list, look up), and their lifecycle
(disable, enable, remove), each change audited in the caller's transaction
(:func:`models.catalog.record_audit`). Sources and their secrets: :mod:`models.catalog`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.addresses import allows_private, check_host
from core.crypto import (
    SecretBox,
    generate_secret,
    route_secret_place,
)
from core.filters import FilterError, compile_filter
from core.providers import registry
from core.providers.contract import SIGNED_FIELD
from core.publish_target import publish_target
from core.states import DeliveryStatus
from models.catalog import (
    CatalogError,
    Change,
    Changed,
    audit_config,
    check_whsec,
    count_unfinished,
    glob_to_like,
    record_audit,
    whole_seconds,
)
from models.schema import (
    Delivery,
    Route,
    Source,
)


class PublishOptionsError(CatalogError):
    """A ``publish`` route's options that cannot work (core.publish_target): nothing saved."""

    doc = "publish"  # the docs topic a CLI refusal names (core.docs)


def add_route(
    session: Session,
    box: SecretBox,
    source: Source,
    *,
    handler: str,
    events: str = "*",
    options: dict[str, str] | None = None,
    max_attempts: int | None = None,
    max_age: timedelta | None = None,
    filter: str | None = None,  # noqa: A002 (the option's and the column's name)
    transform: str | None = None,
    order_key: str | None = None,
    lane_on_dead: str = "block",
    supersede: bool = False,
    operator: str | None = None,
    via: str = "cli",
) -> tuple[Route, str | None]:
    """Bind a handler (audited: ``operator``, default this process's login name).
    ``forward`` routes get their own signing secret (returned once, never audited). A
    ``filter`` is checked first (:func:`check_filter`): a bad one saves nothing; so are the
    lane options (:func:`check_lanes`). A ``transform`` names a registered one: the caller
    checks it against the registry (:meth:`tasks.transforms.TransformRegistry.require`)
    before calling."""
    expression = check_filter(filter)
    key = check_lanes(source, order_key, lane_on_dead, supersede)
    transform = stored_transform(transform)
    if not handler.strip():
        raise CatalogError("handler name must not be empty")
    if not events.strip():
        raise CatalogError("event pattern must not be empty")
    if max_attempts is not None and max_attempts < 1:
        raise CatalogError("max attempts must be at least 1")
    opts = dict(options or {})
    signing_plain: str | None = None
    if handler == "forward":
        _check_forward_target(opts)
        signing_plain = opts.pop("secret", None) or generate_secret("standard")
        check_whsec(signing_plain)
    elif handler == "publish":
        try:
            publish_target(opts)
        except ValueError as exc:
            raise PublishOptionsError(str(exc)) from None
    route = Route(
        source_id=source.id,
        handler=handler,
        events_glob=events,
        events_like=glob_to_like(events),
        options=opts,
        max_attempts=max_attempts,
        max_age_s=whole_seconds(max_age),
        filter=expression,
        transform=transform,
        order_key=key,
        lane_on_dead=lane_on_dead,
        supersede=supersede,
    )
    session.add(route)
    session.flush()
    if signing_plain is not None:  # sealed for this row: its id exists once flushed
        route.signing_ciphertext = box.seal(signing_plain, route_secret_place(route.id))
        session.flush()
    audit_config(
        session,
        "route.add",
        route_target(route, source.public_id),
        operator,
        "route added",
        via=via,
    )
    return route, signing_plain


def check_filter(expression: str | None) -> str | None:
    """The filter to store: None for none (``None``, empty, or ``none``), else the expression
    as given once it compiles; :class:`core.filters.FilterError` with the position of what is
    wrong otherwise. The one check every way of saving a filter goes through."""
    if expression is None or expression.strip() in ("", "none"):
        return None
    compile_filter(expression)
    return expression


LANE_ON_DEAD = ("block", "skip")


def check_order_key(expression: str | None) -> str | None:
    """The order key to store: None for none (``None``, empty, or ``none``), else the
    expression once it compiles (the filter's language and check: :func:`check_filter`)."""
    try:
        return check_filter(expression)
    except FilterError as exc:
        where = "" if exc.position is None else f" at position {exc.position}"
        raise CatalogError(f"order key refused{where}: {exc.reason}") from None


def check_lanes(
    source: Source, order_key: str | None, lane_on_dead: str, supersede: bool
) -> str | None:
    """The lane options of a route (models/lanes.py), checked before anything is saved: the
    order key compiles, ``lane_on_dead`` is block or skip, and ``supersede`` has an order key
    and a source whose provider signs its event time. Returns the order key to store."""
    key = check_order_key(order_key)
    if lane_on_dead not in LANE_ON_DEAD:
        raise CatalogError(f"--lane-on-dead must be block or skip, not {lane_on_dead!r}")
    if supersede:
        if key is None:
            raise CatalogError("--supersede needs --order-key: it compares events of one key")
        why = unsigned_time(source)
        if why is not None:
            raise CatalogError(f"--supersede refused: {why}")
    return key


def unsigned_time(source: Source) -> str | None:
    """Why this source's events carry no signed event time (so none can supersede another),
    or None when its provider's signature covers the time it reports."""
    try:
        provider = registry.get(source.provider)
    except registry.UnknownProvider:
        return f"provider {source.provider} is not installed here"
    time = provider.signed_fields(source.config or {}).get("time")
    if time == SIGNED_FIELD:
        return None
    if time is None:
        return f"{source.provider} events carry no event time"
    return f"{source.provider} reads its event time from a part the signature does not cover"


def set_lanes(
    session: Session,
    route_id: int,
    change: Change,
    *,
    order_key: str | None = None,
    lane_on_dead: str | None = None,
    supersede: bool | None = None,
    now: datetime | None,
) -> Changed:
    """Set a route's lane options (audited ``route.lanes``, before and after; None: left as
    is; an order key of ``none`` clears it). A new order key applies to the events accepted
    after this commits (the accept refuses a key it was not given as it now stands, as for a
    filter: migration 0028); deliveries accepted before keep their lane."""
    change.check()
    route = session.scalars(select(Route).where(Route.id == route_id).with_for_update()).first()
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    source = session.scalars(select(Source).where(Source.id == route.source_id)).one()
    before = _lanes_of(route)
    key = route.order_key if order_key is None else order_key
    after_key = check_lanes(
        source,
        key,
        route.lane_on_dead if lane_on_dead is None else lane_on_dead,
        route.supersede if supersede is None else supersede,
    )
    route.order_key = after_key
    if lane_on_dead is not None:
        route.lane_on_dead = lane_on_dead
    if supersede is not None:
        route.supersede = supersede
    session.flush()
    target = {**route_target(route, source.public_id), "before": before, "after": _lanes_of(route)}
    audit_id = record_audit(session, change, "route.lanes", target, count=1, now=now)
    return Changed(audit_id, target, 0)


def _lanes_of(route: Route) -> dict[str, Any]:
    return {
        "order_key": route.order_key,
        "lane_on_dead": route.lane_on_dead,
        "supersede": route.supersede,
    }


def set_filter(
    session: Session, route_id: int, expression: str | None, change: Change, *, now: datetime | None
) -> Changed:
    """Set or clear a route's filter (audited ``route.filter``, the old and new text). It
    applies to the events accepted after this commits: every accept checks that it judged
    each filter as it stands (migration 0027); events accepted before keep their deliveries."""
    change.check()
    stored = check_filter(expression)
    route = session.scalars(select(Route).where(Route.id == route_id).with_for_update()).first()
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    before = route.filter
    route.filter = stored
    session.flush()
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = {**route_target(route, source), "before": before, "after": stored}
    audit_id = record_audit(session, change, "route.filter", target, count=1, now=now)
    return Changed(audit_id, target, 0)


def stored_transform(name: str | None) -> str | None:
    """The transform name to store: None for none (``None``, empty, or ``none``)."""
    if name is None or name.strip() in ("", "none"):
        return None
    return name.strip()


def set_transform(
    session: Session, route_id: int, name: str | None, change: Change, *, now: datetime | None
) -> Changed:
    """Set or clear a route's transform (audited ``route.transform``, the old and new name;
    the caller checked the name against the registry). Deliveries claimed after this
    commits run it, those of events accepted before included."""
    change.check()
    stored = stored_transform(name)
    route = session.scalars(select(Route).where(Route.id == route_id).with_for_update()).first()
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    before = route.transform
    route.transform = stored
    session.flush()
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = {**route_target(route, source), "before": before, "after": stored}
    audit_id = record_audit(session, change, "route.transform", target, count=1, now=now)
    return Changed(audit_id, target, 0)


def set_quarantine_drift(
    session: Session, route_id: int, on: bool, change: Change, *, now: datetime | None
) -> Changed:
    """Turn a route's drift quarantine on or off (audited ``route.quarantine_drift``): with
    it on, a delivery whose event's payload shape drifted from the accepted one waits, held,
    until ``webhooks drift accept`` (docs/drift.md). Turned off, held deliveries stay held
    until their recheck (a day) or an accept."""
    from core.shapes import QUARANTINE_OPTION  # noqa: PLC0415 (a rare change)

    change.check()
    route = session.scalars(select(Route).where(Route.id == route_id).with_for_update()).first()
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    options = dict(route.options or {})
    before = options.get(QUARANTINE_OPTION) == "true"
    if on:
        options[QUARANTINE_OPTION] = "true"
    else:
        options.pop(QUARANTINE_OPTION, None)
    route.options = options
    session.flush()
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = {**route_target(route, source), "before": before, "after": on}
    audit_id = record_audit(session, change, "route.quarantine_drift", target, count=1, now=now)
    return Changed(audit_id, target, 0)


def unsigned_type_warning(source: Source, events: str) -> str | None:
    """Why a route on ``events`` can be run by a forged type, or None: its source's provider
    reads such types from a part the signature does not cover (GitHub's ``X-GitHub-Event``
    for an event the body does not identify, Shopify's topic, ...), so one captured signed
    delivery re-sent with another value there runs this route. A catch-all route (``*``)
    matches on no type and is never flagged; the route is added either way."""
    if events.strip() == "*":
        return None
    try:
        provider = registry.get(source.provider)
    except registry.UnknownProvider:
        return None
    where = provider.unsigned_type(source.config or {}, events)
    if where is None:
        return None
    return (
        f"{source.provider} event types matching {events!r} are read from {where}, which the "
        "signature does not cover: a captured delivery re-sent with another value there runs "
        "this route (docs/providers.md, event types from unsigned headers)"
    )


def _check_forward_target(options: Mapping[str, str]) -> None:
    """A forward route's URL and ``allow_private``, judged as the worker will judge them
    (:mod:`core.addresses`) where no DNS is needed: a refused address literal, metadata
    host or ``localhost`` fails here, not on every delivery."""
    url = options.get("url", "")
    if not url.startswith(("http://", "https://")):
        raise CatalogError("the forward handler needs --option url=http(s)://...")
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise CatalogError("the forward handler's url has no host")
    try:
        check_host(host, allow_private=allows_private(options))
    except ValueError as exc:  # AddressRefused is one
        raise CatalogError(str(exc)) from None


def list_routes(session: Session, source: Source) -> list[Route]:
    return list(
        session.scalars(select(Route).where(Route.source_id == source.id).order_by(Route.id))
    )


def list_all_routes(session: Session) -> list[tuple[Source, Route]]:
    """Every route with its source, by source then route id (``webhooks routes list``)."""
    rows = session.execute(
        select(Source, Route)
        .join(Route, Route.source_id == Source.id)
        .order_by(Source.id, Route.id)
    )
    return [(source, route) for source, route in rows.tuples()]


def get_route(session: Session, route_id: int) -> Route:
    route = session.get(Route, route_id)
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    return route


def active_routes(session: Session) -> list[tuple[Route, str]]:
    """Every active route, with its source's public id (a disabled source's routes too: the
    deliveries it accepted still run through them)."""
    rows = session.execute(
        select(Route, Source.public_id)
        .join(Source, Source.id == Route.source_id)
        .where(Route.active)
        .order_by(Route.id)
    ).all()
    return [(route, public) for route, public in rows]


def route_target(route: Route, source: str) -> dict[str, Any]:
    target = {
        "route": route.id,
        "source": source,
        "handler": route.handler,
        "events": route.events_glob,
    }
    if route.filter is not None:
        target["filter"] = route.filter
    if route.transform is not None:
        target["transform"] = route.transform
    if route.order_key is not None:
        target["order_key"] = route.order_key
    return target


def set_route_active(
    session: Session, route_id: int, active: bool, change: Change, *, now: datetime | None
) -> Changed:
    """Disable (new events no longer get a delivery for it) or enable a route. Refuses a
    route that is already so. Deliveries it already has keep their state; a worker turns
    those it picks up while the route is disabled into dead letters (``route_inactive``),
    which a replay runs once the route is enabled again. The route records when and why
    (``disabled_at``, ``disabled_reason``); enabling clears them and counts as a release
    (``released_at``), so a breaker left open from before is judged afresh by the sweep's
    WEBHOOKS_ROUTE_DISABLE_AFTER (models/route_ends.py)."""
    change.check()
    route = get_route(session, route_id)
    when: Any = now if now is not None else func.now()
    # Enabled again: a release, as a resume is (``released_at``: the disable-after clock of
    # models/route_ends.py, and the earliest its deliveries' max_age counts from).
    values: dict[str, Any] = (
        {"active": True, "disabled_at": None, "disabled_reason": None, "released_at": when}
        if active
        else {"active": False, "disabled_at": when, "disabled_reason": change.reason.strip()}
    )
    moved = session.execute(
        update(Route)
        .where(Route.id == route_id, Route.active.is_not(active))
        .values(**values)
        .returning(Route.id)
    ).first()
    if moved is None:
        state = "enabled" if active else "disabled"
        raise CatalogError(f"route {route_id} is already {state}")
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = route_target(route, source)
    unfinished = count_unfinished(session, Delivery.route_id == route_id)
    action = "route.enable" if active else "route.disable"
    audit_id = record_audit(session, change, action, target, count=1, now=now)
    return Changed(audit_id, target, unfinished)


def remove_route(
    session: Session, route_id: int, change: Change, *, now: datetime | None
) -> Changed:
    """Delete a route, refused while any of its deliveries is unfinished or dead (a dead
    letter must stay replayable): disable it instead, or let them finish and discard the dead
    ones. Finished deliveries keep their history and show the route as removed."""
    change.check()
    route = session.scalars(select(Route).where(Route.id == route_id).with_for_update()).first()
    if route is None:
        raise CatalogError(f"no such route: {route_id} (see `webhooks routes list SOURCE`)")
    unfinished = count_unfinished(session, Delivery.route_id == route_id)
    dead = int(
        session.scalar(
            select(func.count()).where(
                Delivery.route_id == route_id, Delivery.status == DeliveryStatus.DEAD
            )
        )
        or 0
    )
    if unfinished or dead:
        parts = [f"{n} {what}" for n, what in ((unfinished, "unfinished"), (dead, "dead")) if n]
        raise CatalogError(
            f"route {route_id} still has {' and '.join(parts)} deliveries: disable it instead "
            f"(webhooks routes disable {route_id}), or remove it once they have finished and its "
            "dead letters are replayed or discarded (webhooks dead discard)"
        )
    source = session.scalars(select(Source.public_id).where(Source.id == route.source_id)).one()
    target = route_target(route, source)
    session.delete(route)
    session.flush()
    audit_id = record_audit(session, change, "route.remove", target, count=1, now=now)
    return Changed(audit_id, target, 0)

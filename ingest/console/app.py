"""The console's ASGI app (mounted at ``/console`` by :func:`ingest.admin.create_admin_app`,
behind AdminGuard, which checks the session cookie before any body is read): each page's
routes, its static files, and the security headers on every response."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from ingest.console import (
    dead,
    deliveries,
    docs,
    drift,
    events,
    gaps,
    login,
    overview,
    sources,
)
from ingest.console.base import HERE, Console, SecurityHeaders
from ingest.plane import PlaneState


def create_console(state: PlaneState) -> ASGIApp:
    """The console of this admin plane (its tokens, database and running replays)."""
    c = Console(state)
    routes: list[BaseRoute] = [
        *overview.routes(c),
        *login.routes(c),
        *events.routes(c),
        *deliveries.routes(c),
        *dead.routes(c),
        *sources.routes(c),
        *overview.audit_routes(c),
        *gaps.routes(c),
        *drift.routes(c),
        *docs.routes(c),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return SecurityHeaders(Starlette(routes=routes))

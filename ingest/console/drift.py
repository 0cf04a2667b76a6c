"""The console's payload shape drift page (issue 38 item 3, docs/drift.md): the open findings,
of every source or of ``?source=`` (id or name); accepting stays with ``webhooks drift
accept`` (audited)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from starlette.responses import Response
from starlette.routing import Route

from ingest.console.base import Console, Visit, args_of, opt
from models import drift
from models.views import CatalogError


def routes(c: Console) -> list[Route]:
    return [c.get("/drift", drift_page)]


def _findings(session: Session, source: str | None) -> list[drift.Finding]:
    # The session's own psycopg connection, in its transaction (models/drift.py is psycopg).
    conn: Any = session.connection().connection.driver_connection
    return drift.list_findings(conn, source=source)


async def drift_page(c: Console, v: Visit) -> Response:
    args = args_of(v.request.query_params, ("source",))
    try:
        source = opt(args["source"])
        rows = await c.db(lambda s: _findings(s, source))
    except CatalogError as exc:
        return c.show(v, "drift.html", {"args": args, "rows": [], "message": str(exc)}, 404)
    return c.show(v, "drift.html", {"args": args, "rows": rows, "message": None})

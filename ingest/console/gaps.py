"""The console's Gaps page (issue 38 item 2): what ``webhooks gaps`` prints, from the same read
(:func:`models.intake_gaps.read`, on the console's database connection)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from starlette.responses import Response
from starlette.routing import Route

from core.durations import DurationError, parse_duration
from core.gaps import INVISIBLE, GapReport
from ingest.console.base import Console, Visit, args_of, opt
from models import queries
from models.intake_gaps import read

KIND_TEXT = {
    "no_receiver_seen": "no receiver seen",
    "database_unreachable": "database unreachable (503 answered)",
    "errors_answered": "errors answered (5xx)",
}


def routes(c: Console) -> list[Route]:
    return [c.get("/gaps", gaps_page)]


def _read(session: Session, c: Console, since: Any) -> GapReport:
    raw = session.connection().connection.driver_connection  # psycopg: the CLI's read
    assert raw is not None
    return read(raw, c.settings, since)


async def gaps_page(c: Console, v: Visit) -> Response:
    args = args_of(v.request.query_params, ("since",))
    context: dict[str, Any] = {"args": args, "kinds": KIND_TEXT, "invisible": INVISIBLE}
    try:
        given = opt(args["since"])
        since = None if given is None else parse_duration(given)
    except (DurationError, queries.QueryError) as exc:
        return c.show(v, "gaps.html", {**context, "report": None, "message": str(exc)}, 400)
    report = await c.db(lambda s: _read(s, c, since))
    return c.show(v, "gaps.html", {**context, "report": report, "message": None})

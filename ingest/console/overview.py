"""The console's overview (counts, sources, whether the fast claim tier answers) and the
audit trail (every operator change, filtered by operator, action and time)."""

from __future__ import annotations

import redis
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from core.settings import Settings
from ingest.console.base import Console, Visit, args_of, opt, parse_when
from models import console as reads
from models import queries


def routes(c: Console) -> list[Route]:
    return [c.get("/", overview)]


def audit_routes(c: Console) -> list[Route]:
    return [c.get("/audit", audit_page)]


def _claims_signal(settings: Settings) -> str | None:
    """None when the fast claim tier (Redis) answers; else what degraded means."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        return (
            "Redis (the fast claim tier) does not answer: workers claim on the database "
            "alone (degraded claims, webhooks_degraded_claims_total)"
        )
    finally:
        client.close()
    return None


async def overview(c: Console, v: Visit) -> Response:
    data = await c.db(reads.overview)
    sources = await c.db(reads.catalog)
    degraded = await run_in_threadpool(_claims_signal, c.settings)
    return c.show(v, "overview.html", {"o": data, "sources": sources, "degraded": degraded})


async def audit_page(c: Console, v: Visit) -> Response:
    args = args_of(v.request.query_params, ("operator", "action", "since", "until"))
    try:
        now = await c.db(reads.db_now)
        since = parse_when(args["since"], now)
        until = parse_when(args["until"], now)
        rows = await c.db(
            lambda s: reads.audit(
                s,
                operator=opt(args["operator"]),
                action=opt(args["action"]),
                since=since,
                until=until,
            )
        )
    except queries.QueryError as exc:
        return c.show(v, "audit.html", {"args": args, "rows": [], "message": str(exc)}, 400)
    return c.show(v, "audit.html", {"args": args, "rows": rows, "message": None})

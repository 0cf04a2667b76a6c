"""The console's overview (counts, sources, whether admission failed open lately) and the
audit trail (every operator change, filtered by operator, action and time)."""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from core import metrics
from ingest.console.base import Console, Visit, args_of, opt, parse_when
from ingest.console.charts import charts_of
from models import console as reads
from models import queries
from models.findings import OpenFinding, open_findings


def routes(c: Console) -> list[Route]:
    return [c.get("/", overview)]


def audit_routes(c: Console) -> list[Route]:
    return [c.get("/audit", audit_page)]


# A fail-open within this long makes the card say degraded (seconds).
DEGRADED_WINDOW_S = 300.0


def _fail_open_signal(c: Console) -> str | None:
    """None unless admission failed open within :data:`DEGRADED_WINDOW_S` (Redis or Postgres
    failed and deliveries were published without their routes' limits), by this receiver's
    own counts, as /metrics reads them (``webhooks_admissions_total{outcome="failed_open"}``
    and ``webhooks_fail_open_last_timestamp_seconds``); else what degraded means. The
    workers' degraded claims are theirs to export (webhooks_degraded_claims_total)."""
    read = c.state.read_metrics
    if read is None:
        return None
    total, last = metrics.fail_open_reading(read())
    if last is None:
        return None
    ago = c.clock.now().timestamp() - last
    if ago > DEGRADED_WINDOW_S:
        return None
    return (
        f"admission failed open {total:.0f} times, the last {max(ago, 0):.0f} s ago (Redis or"
        " Postgres failed): deliveries were published without their routes' limits"
        ' (webhooks_admissions_total{outcome="failed_open"})'
    )


async def overview(c: Console, v: Visit) -> Response:
    """The counts, and charts of everything, or of ``?source=`` (id or name) or ``?route=``."""
    args = args_of(v.request.query_params, ("source", "route"))
    try:
        source, route = opt(args["source"]), opt(args["route"])
        # The counts and the charts each read a day of deliveries: on two connections at once.
        counts, data = await asyncio.gather(
            c.db(reads.overview), c.db(lambda s: reads.charted(s, source, route))
        )
    except queries.QueryError as exc:
        return c.error(v, str(exc), 404 if isinstance(exc, queries.NotFoundError) else 400)
    sources = await c.db(reads.catalog)
    degraded = await run_in_threadpool(_fail_open_signal, c)
    findings = await c.db(open_findings)
    if source is not None:  # a source's page: its own findings
        findings = scoped(findings, source)
    context = {
        "findings": findings,
        "o": counts,
        "charts": [chart for window in data.activity for chart in charts_of(window)],
        "scope": data.scope,
        "sources": sources,
        "degraded": degraded,
    }
    return c.show(v, "overview.html", context)


def scoped(findings: list[OpenFinding], source: str) -> list[OpenFinding]:
    """The findings of one source, named by id or name."""
    return [f for f in findings if source in (f.source, f.name)]


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

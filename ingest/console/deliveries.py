"""The console's deliveries: one delivery with its attempts in time order (each replay a
separator before the attempt it opened), and a link to an attempt's task in Flower."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from core.messages import DELIVER_TASK
from core.settings import Settings
from ingest.console.base import Console, Visit, redirect
from models import delivery_history, queries
from tasks.context import idempotency_key


def routes(c: Console) -> list[Route]:
    return [
        c.get("/deliveries/{delivery}", delivery),
        c.get("/deliveries/{delivery}/attempts/{number}/flower", flower_task),
    ]


async def delivery(c: Console, v: Visit) -> Response:
    try:
        ref = v.request.path_params["delivery"]
        detail = await c.db(lambda s: queries.get_delivery(s, ref, key_of=idempotency_key))
    except queries.NotFoundError as exc:
        return c.error(v, str(exc), 404)
    except queries.QueryError as exc:
        return c.error(v, str(exc))
    timeline = _timeline(detail.delivery)
    return c.show(v, "delivery.html", {"d": detail, "timeline": timeline})


async def flower_task(c: Console, v: Visit) -> Response:
    """Redirect to the Flower page of one attempt's task (asked of Flower's API); its
    task list when Flower does not know it."""
    try:
        did = queries.parse_delivery_ref(v.request.path_params["delivery"])
        number = queries.parse_id(v.request.path_params["number"], "attempt number")
        detail = await c.db(lambda s: queries.get_delivery(s, did))
    except queries.QueryError as exc:
        return c.error(v, str(exc), 404)
    started = [a.started_at for a in detail.delivery.attempt_log if a.number == number]
    task = await run_in_threadpool(_flower_task_id, c.settings, did, started)
    if task is None:
        return redirect(f"{c.flower_url}/tasks")
    return redirect(f"{c.flower_url}/task/{task}")


@dataclass(frozen=True)
class TimelineRow:
    """An attempt, or a replay separator before the attempt it opened."""

    attempt: delivery_history.AttemptView | None
    replay: delivery_history.ReplayMark | None
    duration_ms: int | None


def _timeline(view: delivery_history.DeliveryView) -> list[TimelineRow]:
    marks = {m.first_attempt: m for m in view.replays}
    rows: list[TimelineRow] = []
    for a in view.attempt_log:
        mark = marks.pop(a.number, None)
        if mark is not None:
            rows.append(TimelineRow(None, mark, None))
        duration = (
            None if a.ended_at is None else int((a.ended_at - a.started_at).total_seconds() * 1000)
        )
        rows.append(TimelineRow(a, None, duration))
    rows += [TimelineRow(None, m, None) for m in marks.values()]  # replayed, not yet attempted
    return rows


def _flower_task_id(settings: Settings, delivery_id: int, started: list[datetime]) -> str | None:
    """The Flower task of this delivery whose start is nearest the attempt's."""
    if settings.flower_password is None:
        return None
    auth = (settings.flower_user, settings.flower_password.get_secret_value())
    base = f"http://127.0.0.1:{settings.flower_port}"
    try:
        answer = httpx.get(
            f"{base}/api/tasks",
            params={"taskname": DELIVER_TASK, "limit": "500"},
            auth=auth,
            timeout=5,
        )
        tasks = answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    mine = [(tid, t) for tid, t in tasks.items() if t.get("args") == f"({delivery_id},)"]
    if not mine:
        return None
    if not started:
        return str(mine[-1][0])
    at = started[0].timestamp()

    def distance(item: tuple[str, dict[str, Any]]) -> float:
        when = item[1].get("started") or item[1].get("received") or 0
        return abs(float(when) - at)

    return str(min(mine, key=distance)[0])

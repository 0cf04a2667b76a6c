"""The console's dead letters and replays: the list with its groups, a preview of a replay
or a discard (of the selected ids, or of every match of the filter), its confirmation with
a reason (the audit row, ``via: console``), and a replay's progress with its Cancel (audited
too: ``replay.cancel``, the replay's id, the operator).

Actions reuse the CLI's and the API's modules (plans, guarded transitions, audit rows), with
the session's token name as the operator. A preview freezes what it counted
(:mod:`ingest.console.plans`), so the confirmation moves exactly the rows the preview showed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from ingest.console.base import Console, Visit, args_of, log, one, opt, parse_when, redirect
from ingest.console.plans import PendingPlan
from models import candidates, discards, queries, replays
from models import console as reads
from models.candidates import ReplayFilter
from models.catalog import CatalogError, Change, record_audit
from models.discards import DiscardError
from models.replays import ReplayError

DEAD_PAGE = 100
FILTER_KEYS = ("source", "type", "since", "until")


def routes(c: Console) -> list[Route]:
    return [
        c.get("/dead", dead),
        c.post("/dead/preview", dead_preview),
        c.post("/dead/confirm", dead_confirm),
        c.get("/replays/{replay}", replay_page),
        c.post("/replays/{replay}/cancel", replay_cancel),
    ]


def _dead_filter(args: dict[str, str], now: datetime) -> ReplayFilter:
    return ReplayFilter(
        opt(args.get("source")),
        opt(args.get("type")),
        "dead",
        parse_when(args.get("since", ""), now),
        parse_when(args.get("until", ""), now),
    )


async def dead(c: Console, v: Visit) -> Response:
    args = args_of(v.request.query_params, FILTER_KEYS)
    try:
        now = await c.db(reads.db_now)
        flt = _dead_filter(args, now)
        rows = await c.db(lambda s: candidates.candidates_by_filter(s, flt, limit=DEAD_PAGE + 1))
        groups = await c.db(lambda s: queries.dead_letters(s, source=flt.source))
    except (queries.QueryError, CatalogError) as exc:
        return c.show(
            v,
            "dead.html",
            {"args": args, "rows": [], "groups": [], "more": False, "message": str(exc)},
            400,
        )
    return c.show(
        v,
        "dead.html",
        {
            "args": args,
            "rows": rows[:DEAD_PAGE],
            "groups": groups,
            "more": len(rows) > DEAD_PAGE,
            "message": None,
        },
    )


async def dead_preview(c: Console, v: Visit) -> Response:
    form = v.form
    action = one(form, "action")
    if action not in ("replay", "discard"):
        return c.error(v, "action must be replay or discard")
    args = {k: (one(form, k) or "").strip() for k in FILTER_KEYS}
    try:
        if one(form, "scope") == "all":
            now = await c.db(reads.db_now)
            flt: ReplayFilter | None = _dead_filter(args, now)
            ids: tuple[int, ...] = ()
            given: dict[str, Any] = {k: val for k, val in args.items() if val}
            if not given:
                return c.error(v, "give a filter for all matching (source, type, since or until)")
            given["status"] = "dead"
        else:
            flt = None
            ids = tuple(sorted({queries.parse_id(i, "delivery id") for i in form.get("ids", [])}))
            if not ids:
                return c.error(v, "select at least one dead letter")
            given = {"ids": list(ids)}
        operator = v.session.operator

        def plan(s: Session) -> reads.Preview:
            if flt is not None:
                # All matching: the ids are frozen now, the rows read at the confirmation.
                return reads.preview(s, flt, limit=replays.MAX_PLAN + 1)
            if action == "replay":
                req = replays.ReplayRequest(operator, "preview", "console", given, ids, flt)
                found = replays.plan_replay(s, req).candidates
            else:
                dreq = discards.DiscardRequest(operator, "preview", "console", given, ids, flt)
                found = discards.plan_discard(s, dreq).candidates
            return reads.Preview(tuple(f.delivery_id for f in found), found)

        shown = await c.db(plan)
        if shown.count > replays.MAX_PLAN:
            what = "deliveries" if action == "replay" else "dead letters"
            return c.error(
                v,
                f"more than {replays.MAX_PLAN} {what} match; narrow the filter "
                "(type, since or until)",
            )
    except (queries.QueryError, CatalogError, ReplayError, DiscardError) as exc:
        return c.error(v, str(exc))
    pending = PendingPlan(
        operator,
        action,
        given,
        ids,
        flt,
        shown.sample,
        c.clock.now(),
        frozen=shown.ids if flt is not None else (),
    )
    token = c.plans.keep(pending) if shown.count else None
    return c.show(
        v,
        "preview.html",
        {
            "action": action,
            "count": shown.count,
            "sample": shown.sample[:10],
            "given": given,
            "plan": token,
            "default_rate": replays.DEFAULT_RATE,
        },
    )


async def dead_confirm(c: Console, v: Visit) -> Response:
    form, operator = v.form, v.session.operator
    reason = (one(form, "reason") or "").strip()
    if not reason or "\x00" in reason:
        return c.error(v, "a reason is required: it goes into the audit")
    pending = c.plans.take(one(form, "plan") or "", operator)
    if pending is None:
        return c.error(v, "this preview expired or was already confirmed: preview again")
    if pending.frozen:
        # The ids the preview counted, read now (the rows move only through guarded SQL
        # at execution, which skips any that are no longer dead).
        try:
            rows = await c.db(lambda s: candidates.candidates_by_ids(s, pending.frozen))
        except queries.NotFoundError as exc:
            return c.error(v, f"{exc}: preview again")
        pending.candidates = tuple(rows)
    target = (pending.filter_as_given, pending.ids, pending.flt)
    if pending.action == "discard":
        dreq = discards.DiscardRequest(operator, reason, "console", *target)
        dplan = discards.DiscardPlan(dreq, pending.candidates)
        try:
            result = await c.db(lambda s: discards.execute_discard(s, dplan, now=None))
        except DiscardError as exc:
            return c.error(v, str(exc))
        discards.record_discarded(result, "console")
        return c.show(v, "discarded.html", {"r": result})
    try:
        rate = float(one(form, "rate") or replays.DEFAULT_RATE)
    except ValueError:
        return c.error(v, "rate must be a number")
    req = replays.ReplayRequest(operator, reason, "console", *target, rate=rate)
    try:
        replays.validate_request(req)
    except ReplayError as exc:
        return c.error(v, str(exc))
    replay_id = await run_in_threadpool(c.state.start_replay, replays.Plan(req, pending.candidates))
    if replay_id is None:
        return c.error(v, "too many replays running here; retry later", 429)
    return redirect(f"/console/replays/{replay_id}")


async def replay_page(c: Console, v: Visit) -> Response:
    try:
        rid = queries.parse_id(v.request.path_params["replay"], "replay id")
        record = await c.db(lambda s: replays.get_replay(s, rid))
    except queries.NotFoundError as exc:
        return c.error(v, str(exc), 404)
    except queries.QueryError as exc:
        return c.error(v, str(exc))
    return c.show(v, "replay.html", {"r": record, "cancellable": record.id in c.state.cancels})


async def replay_cancel(c: Console, v: Visit) -> Response:
    try:
        rid = queries.parse_id(v.request.path_params["replay"], "replay id")
    except queries.QueryError as exc:
        return c.error(v, str(exc))
    cancel = c.state.cancels.get(rid)
    if cancel is None:
        return c.error(v, f"replay {rid} is not running in this process", 409)
    # Audited before it takes effect: a cancel whose row cannot be written cancels nothing.
    change = Change(v.session.operator, "cancelled from the console", via="console")
    await c.db(
        lambda s: record_audit(s, change, "replay.cancel", {"replay": rid}, count=1, now=None)
    )
    cancel.set()
    log.info("console.replay_cancelled", replay_id=rid, operator=v.session.operator)
    return redirect(f"/console/replays/{rid}")

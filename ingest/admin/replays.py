"""The admin API's replays: preview or start one (audited, ``via: api``), the audit trail,
and one replay's progress. Same semantics and limits as ``webhooks replay``
(:mod:`models.replays`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ingest.admin.deps import Db, Operator, PathId, State, error, parse_time
from ingest.admin.schemas import NOT_FOUND, ErrorOut, ReplayCreatedOut, ReplayIn, preview
from models import replays
from models.candidates import ReplayFilter
from models.replays import ReplayError, ReplayRecord

router = APIRouter()


@router.post(
    "/replays",
    tags=["replays"],
    summary="Preview or start a replay",
    status_code=202,
    response_model=ReplayCreatedOut,
    responses={
        200: {"model": ReplayCreatedOut, "description": "Dry run, or nothing matched."},
        409: {"model": ErrorOut, "description": "Refused (e.g. a succeeded delivery)."},
        429: {"model": ErrorOut, "description": "Too many replays running here."},
    },
)
def create_replay(body: ReplayIn, session: Db, operator: Operator, state: State) -> Any:
    """Plan the replay (the preview), write its audit row and run it in the background
    at `rate` per second. Poll `GET /replays/{id}` for progress. The audit records the
    name of the token used as the operator."""
    given = body.model_dump(exclude={"reason", "rerun_succeeded", "rate", "dry_run"})
    given = {k: v for k, v in given.items() if v is not None}
    if body.ids:
        if set(given) - {"ids", "status"} or body.status != "dead":
            raise ReplayError("give delivery ids or a filter, not both", "bad_target")
        given = {"ids": sorted(set(body.ids))}
        flt = None
    else:
        flt = ReplayFilter(
            body.source,
            body.type,
            body.status,
            parse_time(state, body.since),
            parse_time(state, body.until),
        )
        if not set(given) - {"status"}:
            raise ReplayError(
                "give delivery ids or a filter (source, type, since, until)", "bad_target"
            )
    request = replays.ReplayRequest(
        operator=operator,
        reason=body.reason,
        via="api",
        filter_as_given=given,
        ids=tuple(sorted(set(body.ids or []))),
        flt=flt,
        rerun_succeeded=body.rerun_succeeded,
        rate=body.rate,
    )
    plan = replays.plan_replay(session, request)
    shown = preview(plan)
    if body.dry_run or plan.count == 0:
        return JSONResponse(ReplayCreatedOut(preview=shown, replay=None).model_dump(mode="json"))
    replay_id = state.start_replay(plan)
    if replay_id is None:
        return error(429, "too many replays running in this process; retry later", "busy")
    return ReplayCreatedOut(preview=shown, replay=replays.get_replay(session, replay_id))


@router.get("/replays", tags=["replays"], summary="The replay audit trail")
def list_replays(
    session: Db, limit: Annotated[int, Query(ge=1, le=500)] = 20
) -> list[ReplayRecord]:
    """Who replayed what, when and why; most recent first."""
    return replays.list_replays(session, limit=limit)


@router.get(
    "/replays/{replay_id}",
    tags=["replays"],
    summary="A replay's progress",
    responses=NOT_FOUND,
)
def show_replay(replay_id: PathId, session: Db) -> ReplayRecord:
    """The audit row: `planned`, `replayed` and `skipped` grow as the run goes; `status`
    is `running`, then `done`, `failed` or `interrupted`."""
    return replays.get_replay(session, replay_id)

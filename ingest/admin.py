"""The admin HTTP API, mounted by the receiver under ``/admin``.

Bearer token from ``WEBHOOKS_ADMIN_TOKEN``, compared in constant time. Without a token the API
is off: :func:`create_admin_app` returns an app with no routes and no schema, so every
``/admin`` path is a 404 and nothing reveals that the API exists.

Replays have the CLI's semantics and limits (:mod:`models.replays`): a required reason, a
capped rate, the same refusals and the same audit row (``via: api``); the operator defaults
to ``admin-token``, the name of the one token there is (until named tokens exist). ``POST
/replays`` plans synchronously, writes the audit row and answers 202 with its id; the replay
then runs in a background thread of this process at the requested rate, and ``GET
/replays/{id}`` shows its progress from the audit row, which the run updates in the same
transaction as each delivery it moves. If the process stops mid-run the row stays
``running``; the deliveries it did not reach are still dead, so a new replay with the same
filter finishes the job.

The interactive docs (``/admin/docs``) work offline: Swagger UI's files come from the
``swagger-ui-bundle`` package, served here. The docs, their files and ``/admin/openapi.json``
need the token like every other path; since a browser cannot send a bearer header when it
opens a page, the token is also accepted as the password of HTTP Basic (any user name), and
those paths ask for it with a Basic challenge.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import threading
import time
from collections.abc import Iterator
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from models import queries, replays
from models.catalog import CatalogError
from models.db import make_engine, make_sessionmaker
from models.queries import (
    Candidate,
    DeadGroup,
    DeliveryDetail,
    EventDetail,
    EventFilter,
    EventSummary,
    ReplayFilter,
)
from models.replays import ReplayError, ReplayRecord
from webhooks.clock import Clock, SystemClock
from webhooks.logs import configure_logging, get_logger
from webhooks.settings import Settings, load_settings

log = get_logger("admin")

MAX_RUNNING_REPLAYS = 2  # per process; more answer 429
# The operator recorded for an API replay that names none: the token's name (one token).
DEFAULT_OPERATOR = "admin-token"  # noqa: S105  (a name, not a secret)
# Swagger UI's files served to /admin/docs (from the swagger-ui-bundle package).
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")

# Numeric inputs within their column's range (a bigint), or 422 like any other bad input:
# text ids and times go through models.queries (parse_id, parse_time) the same way.
RowId = Annotated[int, Field(ge=1, le=queries.MAX_ID)]

DESCRIPTION = """
Operators' API of the webhook pipeline: received events with their deliveries and attempts,
dead letters, and audited replays. Authenticate with `Authorization: Bearer <WEBHOOKS_ADMIN_TOKEN>`
(these docs: the token as the password of HTTP Basic, any user name). Times are ISO 8601 UTC
(`...Z`). Responses never contain a secret or a payload.
"""


class ReplayIn(BaseModel):
    """A replay: delivery ids, or a filter. Same rules as `webhooks replay`."""

    model_config = ConfigDict(extra="forbid")

    operator: str | None = Field(
        default=None,
        min_length=1,
        description=f"Who replays (recorded in the audit). Default: `{DEFAULT_OPERATOR}`.",
    )
    reason: str = Field(min_length=1, description="Why (required; recorded in the audit).")
    ids: list[RowId] | None = Field(
        default=None, min_length=1, description="Delivery ids. Excludes the filter fields."
    )
    source: str | None = Field(default=None, description="Filter: source id or name.")
    type: str | None = Field(default=None, description="Filter: event type, globs allowed.")
    status: str = Field(
        default="dead", description="Filter: `dead`, or `succeeded` with rerun_succeeded."
    )
    since: str | None = Field(
        default=None, description="Filter: received at or after (ISO time, or `2h` ago)."
    )
    until: str | None = Field(
        default=None, description="Filter: received before (ISO time, or `30m` ago)."
    )
    rerun_succeeded: bool = Field(
        default=False,
        description="Allow succeeded deliveries to run again, under a new downstream key.",
    )
    rate: float = Field(
        default=replays.DEFAULT_RATE,
        gt=0,
        le=replays.MAX_RATE,
        description="At most this many replays per second.",
    )
    dry_run: bool = Field(default=False, description="Preview only: count and sample.")

    @field_validator("operator", "reason", "source", "type", "status", "since", "until")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("NUL characters are not allowed (Postgres text cannot hold them)")
        return value


class PreviewOut(BaseModel):
    """What the replay covers: frozen when planned, so this count is what runs."""

    count: int
    by_status: dict[str, int]
    without_payload: int = Field(description="Candidates whose payload retention dropped.")
    sample: list[Candidate]


class ReplayCreatedOut(BaseModel):
    """The preview, and the audit row when the replay started (null for a dry run or 0)."""

    preview: PreviewOut
    replay: ReplayRecord | None


class ErrorOut(BaseModel):
    """An error with a machine-readable reason."""

    detail: str
    reason: str


def _preview(plan: replays.Plan) -> PreviewOut:
    return PreviewOut(
        count=plan.count,
        by_status=plan.by_status,
        without_payload=plan.without_payload,
        sample=list(plan.sample),
    )


class _State:
    """Lazily built per-app resources (the mounted app has no lifespan of its own)."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        assert settings.admin_token is not None
        self.token = settings.admin_token.get_secret_value().encode()
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._publisher: replays.CeleryPublisher | None = None
        self.running = threading.BoundedSemaphore(MAX_RUNNING_REPLAYS)

    @property
    def sessions(self) -> sessionmaker[Session]:
        with self._lock:
            if self._sessions is None:
                self._engine = make_engine(self.settings, pool_size=2)
                self._sessions = make_sessionmaker(self._engine)
            return self._sessions

    @property
    def publisher(self) -> replays.CeleryPublisher:
        with self._lock:
            if self._publisher is None:
                self._publisher = replays.CeleryPublisher(self.settings)
            return self._publisher

    def run_in_background(self, plan: replays.Plan, replay_id: int) -> None:
        def work() -> None:
            try:
                replays.execute(
                    self.sessions,
                    plan,
                    replay_id,
                    settings=self.settings,
                    clock=self.clock,
                    sleep=time.sleep,
                    publish=self.publisher,
                )
            except Exception as exc:  # noqa: BLE001  (the audit row says failed; log the class)
                log.error("replay.failed", replay_id=replay_id, error=exc.__class__.__name__)
            finally:
                self.running.release()

        threading.Thread(target=work, name=f"replay-{replay_id}", daemon=True).start()


_bearer = HTTPBearer(auto_error=False, description="WEBHOOKS_ADMIN_TOKEN")


def _basic_password(request: Request) -> bytes | None:
    """The password of an ``Authorization: Basic`` header (the user name is ignored)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, sep, password = decoded.partition(b":")
    return password if sep else None


def _check(request: Request, creds: HTTPAuthorizationCredentials | None, challenge: str) -> None:
    state: _State = request.app.state.admin
    given = creds.credentials.encode() if creds is not None else None
    if given is None and challenge != "Bearer":  # the docs' paths: Basic too
        given = _basic_password(request)
    # compare_digest on every request, even without a header, so timing tells nothing.
    if not hmac.compare_digest(given or b"", state.token) or given is None:
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": challenge}
        )


def _require_token(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    _check(request, creds, "Bearer")


def _require_token_browser(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The docs' paths: a browser that opens them is asked for the token (Basic)."""
    _check(request, creds, 'Basic realm="webhooks admin API (password: the admin token)"')


def _storable_inputs(request: Request) -> None:
    """Every path and query value: Postgres text cannot hold NUL, so refuse it (422) here
    rather than let a query fail with a 500."""
    values = [*request.path_params.values(), *request.query_params.values()]
    if any("\x00" in str(value) for value in values):
        raise queries.QueryError("NUL characters are not allowed in ids and filters", "bad_input")


def _session(request: Request) -> Iterator[Session]:
    state: _State = request.app.state.admin
    with state.sessions() as session, session.begin():
        yield session


Db = Annotated[Session, Depends(_session)]


def _error(code: int, detail: str, reason: str) -> JSONResponse:
    return JSONResponse({"detail": detail, "reason": reason}, status_code=code)


def _off() -> FastAPI:
    return FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


def _docs_assets() -> FilePath | None:
    try:
        import swagger_ui_bundle  # type: ignore[import-untyped]  # noqa: PLC0415
    except ImportError:
        return None
    return FilePath(swagger_ui_bundle.swagger_ui_path)


def _add_docs(app: FastAPI) -> None:
    """The schema and Swagger UI from local files, behind the token (no CDN, no public page).
    Without the swagger-ui-bundle package only the schema is served."""
    docs = [Depends(_require_token_browser)]
    assets = _docs_assets()

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    if assets is None:
        return

    @app.get("/docs", include_in_schema=False, dependencies=docs)
    def swagger(request: Request) -> HTMLResponse:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return get_swagger_ui_html(
            openapi_url=f"{root}/openapi.json",
            title=f"{app.title}: docs",
            swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
        )

    @app.get("/docs/assets/{name}", include_in_schema=False, dependencies=docs)
    def swagger_asset(name: str) -> FileResponse:
        if name not in DOCS_ASSETS:
            raise HTTPException(404, "not found")
        return FileResponse(assets / name)


def create_admin_app(settings: Settings, *, clock: Clock | None = None) -> FastAPI:
    """The admin API, or (no WEBHOOKS_ADMIN_TOKEN) an app that answers 404 to everything."""
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        return _off()
    state = _State(settings, clock or SystemClock())
    app = FastAPI(
        title="webhooks admin API",
        description=DESCRIPTION,
        version="1",
        responses={401: {"description": "Missing or wrong bearer token."}},
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    # The bundled Swagger UI (4.x, served offline) renders OpenAPI 3.0 documents only; the
    # schema uses nothing of 3.1 that 3.0 readers cannot show.
    app.openapi_version = "3.0.3"
    _add_docs(app)
    router = APIRouter(dependencies=[Depends(_require_token), Depends(_storable_inputs)])

    @app.exception_handler(queries.NotFoundError)
    def _not_found(request: Request, exc: queries.NotFoundError) -> JSONResponse:
        return _error(404, str(exc), exc.reason)

    @app.exception_handler(queries.QueryError)
    def _bad_query(request: Request, exc: queries.QueryError) -> JSONResponse:
        return _error(422, str(exc), exc.reason)

    @app.exception_handler(CatalogError)
    def _bad_source(request: Request, exc: CatalogError) -> JSONResponse:
        return _error(422, str(exc), "bad_source")

    @app.exception_handler(ReplayError)
    def _refused(request: Request, exc: ReplayError) -> JSONResponse:
        refused = exc.reason in ("succeeded", "not_replayable")
        return _error(409 if refused else 422, str(exc), exc.reason)

    @app.exception_handler(OperationalError)
    def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        return _error(503, "database unavailable", "database_unavailable")

    def _time(text: str | None) -> Any:
        return None if text is None else queries.parse_time(text, now=state.clock.now())

    @router.get("/events", tags=["events"], summary="List events, newest first")
    def list_events(
        session: Db,
        source: Annotated[str | None, Query(description="Source id or name.")] = None,
        type: Annotated[str | None, Query(description="Event type, globs allowed.")] = None,
        status: Annotated[
            str | None, Query(description="Events with a delivery in this state.")
        ] = None,
        since: Annotated[
            str | None, Query(description="Received at or after (ISO time, or `2h` ago).")
        ] = None,
        until: Annotated[
            str | None, Query(description="Received before (ISO time, or `30m` ago).")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_LIST_LIMIT)] = 50,
    ) -> list[EventSummary]:
        """Received events with the count of their deliveries in each state."""
        return queries.list_events(
            session, EventFilter(source, type, status, _time(since), _time(until), limit)
        )

    @router.get(
        "/events/{event}",
        tags=["events"],
        summary="Show one event",
        responses={404: {"model": ErrorOut}},
    )
    def show_event(
        event: str,
        session: Db,
        source: Annotated[
            str | None, Query(description="The source, when several have this event id.")
        ] = None,
    ) -> EventDetail:
        """The receipt, its deliveries and every attempt with its error. `event` is
        `receipt:N`, `delivery:N` (that delivery's event), `event:ID` or a provider event id;
        a bare number that is a delivery id is refused (422, `ambiguous_id`): look it up with
        `GET /deliveries/{id}`. The payload's size is shown, never its content."""
        return queries.get_event(session, event, source=source)

    @router.get(
        "/deliveries/{delivery}",
        tags=["deliveries"],
        summary="Show one delivery",
        responses={404: {"model": ErrorOut}},
    )
    def show_delivery(delivery: str, session: Db) -> DeliveryDetail:
        """A delivery by the id Flower, the logs and `GET /dead` show (`11` or `delivery:11`):
        its event, route and handler, status, attempts in time order with the replays that
        split them, dead reason and downstream idempotency key."""
        from tasks.context import idempotency_key  # noqa: PLC0415

        return queries.get_delivery(session, delivery, key_of=idempotency_key)

    @router.get("/dead", tags=["dead letters"], summary="Dead letters, grouped")
    def dead(
        session: Db,
        source: Annotated[str | None, Query(description="Source id or name.")] = None,
    ) -> list[DeadGroup]:
        """Dead deliveries grouped by source, route and reason, with counts and recent ids."""
        return queries.dead_letters(session, source=source)

    @router.post(
        "/replays",
        tags=["replays"],
        summary="Preview or start a replay",
        status_code=202,
        response_model=ReplayCreatedOut,
        responses={
            200: {"model": ReplayCreatedOut, "description": "Dry run, or nothing matched."},
            409: {"model": ErrorOut, "description": "Refused (e.g. a succeeded delivery)."},
            422: {"model": ErrorOut},
            429: {"model": ErrorOut, "description": "Too many replays running here."},
        },
    )
    def create_replay(body: ReplayIn, session: Db) -> Any:
        """Plan the replay (the preview), write its audit row and run it in the background
        at `rate` per second. Poll `GET /replays/{id}` for progress."""
        given = body.model_dump(
            exclude={"operator", "reason", "rerun_succeeded", "rate", "dry_run"}
        )
        given = {k: v for k, v in given.items() if v is not None}
        if body.ids:
            if set(given) - {"ids", "status"} or body.status != "dead":
                raise ReplayError("give delivery ids or a filter, not both", "bad_target")
            given = {"ids": sorted(set(body.ids))}
            flt = None
        else:
            flt = ReplayFilter(
                body.source, body.type, body.status, _time(body.since), _time(body.until)
            )
            if not set(given) - {"status"}:
                raise ReplayError(
                    "give delivery ids or a filter (source, type, since, until)", "bad_target"
                )
        request = replays.ReplayRequest(
            operator=body.operator or DEFAULT_OPERATOR,
            reason=body.reason,
            via="api",
            filter_as_given=given,
            ids=tuple(sorted(set(body.ids or []))),
            flt=flt,
            rerun_succeeded=body.rerun_succeeded,
            rate=body.rate,
        )
        plan = replays.plan_replay(session, request)
        preview = _preview(plan)
        if body.dry_run or plan.count == 0:
            return JSONResponse(
                ReplayCreatedOut(preview=preview, replay=None).model_dump(mode="json")
            )
        if not state.running.acquire(blocking=False):
            return _error(429, "too many replays running in this process; retry later", "busy")
        try:
            replay_id = replays.start_replay(state.sessions, plan, now=state.clock.now())
            record = replays.get_replay(session, replay_id)
        except BaseException:
            state.running.release()
            raise
        state.run_in_background(plan, replay_id)
        return ReplayCreatedOut(preview=preview, replay=record)

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
        responses={404: {"model": ErrorOut}},
    )
    def show_replay(
        replay_id: Annotated[int, Path(ge=1, le=queries.MAX_ID)], session: Db
    ) -> ReplayRecord:
        """The audit row: `planned`, `replayed` and `skipped` grow as the run goes; `status`
        is `running`, then `done`, `failed` or `interrupted`."""
        return replays.get_replay(session, replay_id)

    app.include_router(router)
    app.state.admin = state
    return app


def app_from_env() -> FastAPI:
    """``uvicorn --factory ingest.admin:app_from_env``: the admin API on its own."""
    settings = load_settings()
    configure_logging(settings.log_level, json=settings.log_json)
    return create_admin_app(settings)

"""The admin plane: the operators' API under ``/admin`` and the receiver's ``/metrics``, on an
address of their own (``WEBHOOKS_ADMIN_HOST``/``WEBHOOKS_ADMIN_PORT``, loopback by default),
never on the public receiver port. ``webhooks serve`` runs it in the receiver's process
(:class:`AdminServer`); ``uvicorn --factory ingest.admin:app_from_env`` runs it alone.

:class:`AdminGuard`, a plain ASGI middleware in front of everything here, decides before a
single byte of the body is read: the token (``Authorization: Bearer``; on the docs' paths also
the password of HTTP Basic, which a browser can send), compared in constant time with every
configured one, else 401; then the body is capped at 64 KiB (a larger ``Content-Length``: 413
at once, unread; a chunked body: 413 where it passes the cap). So no unauthenticated request
costs more than its headers, and none reaches a JSON parser. The matched token's *name*
(``WEBHOOKS_ADMIN_TOKENS=name:token,...``; ``WEBHOOKS_ADMIN_TOKEN`` is named ``admin``) goes
on the request, and every audit row the API writes records it as the operator: who replayed
is what authenticated, not what a body claims. Without any token the API is off: every
``/admin`` path is a 404 and nothing reveals that it exists.

``/metrics`` needs no token: Prometheus scrapes it from the private network the admin address
is on. It lists per-source counts (every source's public id), which is why it left the public
port. With several receiver processes it adds up their multiprocess files.

Bad input is a 400 with the field it concerns (never a 422 or a 500, never the value).

Replays have the CLI's semantics and limits (:mod:`models.replays`): a required reason, a
capped rate, the same refusals and the same audit row (``via: api``). ``POST /replays`` plans
synchronously, writes the audit row and answers 202 with its id; the replay then runs in a
background thread of this process at the requested rate, and ``GET /replays/{id}`` shows its
progress from the audit row, which the run updates in the same transaction as each delivery
it moves. If the process stops mid-run the row stays ``running``; the deliveries it did not
reach are still dead, so a new replay with the same filter finishes the job.

``/console/`` is the operator console (:mod:`ingest.console`): AdminGuard lets it through
without a bearer token (it still caps the body, and it is off with the API when no token is
configured); the console checks its own session cookie, started by logging in with one of
the same named tokens. ``/admin`` still demands the bearer token, a console cookie or not.

The interactive docs (``/admin/docs``) work offline: Swagger UI's files come from the
``swagger-ui-bundle`` package, served here, behind the token like the schema. A browser given
the token in the URL (``http://any:TOKEN@host:8001/admin/docs``) or at its prompt loads the
page with HTTP Basic; the page then fetches the schema from ``location.origin`` (a fetch from
a URL carrying credentials is refused by browsers), and the answer to the page set a session
cookie that authenticates that fetch: ``HttpOnly``, ``SameSite=Strict``, path ``/admin/``,
for :data:`DOCS_SESSION_SECONDS`, an HMAC of the token's name and expiry keyed by the token, so
removing the token ends it. The cookie opens the docs' own paths only, never the API.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import html
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path as FilePath
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import metrics
from core.clock import Clock, SystemClock
from core.logs import configure_logging, get_logger
from core.settings import Settings, load_settings
from ingest.server import Limits, ReceiverProtocol
from models import breaker, queries, replays
from models.candidates import Candidate, ReplayFilter
from models.catalog import CatalogError, Change
from models.db import make_engine, make_sessionmaker
from models.queries import (
    DeadGroup,
    DeliveryDetail,
    EventDetail,
    EventFilter,
    EventSummary,
)
from models.replays import ReplayError, ReplayRecord
from tasks.publisher import CeleryPublisher

log = get_logger("admin")

MAX_RUNNING_REPLAYS = 2  # per process; more answer 429
# The largest admin request body: a replay request is a few hundred bytes.
MAX_BODY_BYTES = 64 * 1024
# Where AdminGuard puts the matched token's name (the request's state).
TOKEN_NAME = "admin_token_name"  # noqa: S105  (a key, not a secret)
DOCS_PATHS = ("/admin/openapi.json", "/admin/docs")
CONSOLE_PREFIX = "/console"  # the operator console (ingest.console): its own session login
# The docs page's session (see the module docstring): the schema fetch carries it.
DOCS_COOKIE = "webhooks_admin_docs"
DOCS_SESSION_SECONDS = 3600
BASIC_CHALLENGE = 'Basic realm="webhooks admin API (password: the admin token)"'
# Swagger UI's files served to /admin/docs (from the swagger-ui-bundle package).
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")

# Numeric inputs within their column's range (a bigint), or 400 like any other bad input:
# text ids and times go through models.queries (parse_id, parse_time) the same way.
RowId = Annotated[int, Field(ge=1, le=queries.MAX_ID)]

DESCRIPTION = """
Operators' API of the webhook pipeline: received events with their deliveries and attempts,
dead letters, and audited replays. Authenticate with `Authorization: Bearer <token>`, one of
`WEBHOOKS_ADMIN_TOKENS` (or `WEBHOOKS_ADMIN_TOKEN`); the audit records the token's name as the
operator (these docs: the token as the password of HTTP Basic, any user name). Bodies are at
most 64 KiB. Bad input answers 400 naming the field. Times are ISO 8601 UTC (`...Z`).
Responses never contain a secret or a payload.
"""


class PauseIn(BaseModel):
    """Pause or resume a route (audited, the token's name as the operator)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, description="Why (required; recorded in the audit).")


class ReplayIn(BaseModel):
    """A replay: delivery ids, or a filter. Same rules as `webhooks replay`."""

    model_config = ConfigDict(extra="forbid")

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

    @field_validator("reason", "source", "type", "status", "since", "until")
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
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._publisher: CeleryPublisher | None = None
        self.running = threading.BoundedSemaphore(MAX_RUNNING_REPLAYS)
        # The replays this process runs, by id: set to cancel one (the console's Cancel).
        self.cancels: dict[int, threading.Event] = {}

    @property
    def sessions(self) -> sessionmaker[Session]:
        with self._lock:
            if self._sessions is None:
                self._engine = make_engine(self.settings, pool_size=2)
                self._sessions = make_sessionmaker(self._engine)
            return self._sessions

    @property
    def publisher(self) -> CeleryPublisher:
        with self._lock:
            if self._publisher is None:
                self._publisher = CeleryPublisher(self.settings)
            return self._publisher

    def run_in_background(self, plan: replays.Plan, replay_id: int) -> None:
        cancel = self.cancels.setdefault(replay_id, threading.Event())

        def work() -> None:
            try:
                replays.execute(
                    self.sessions,
                    plan,
                    replay_id,
                    settings=self.settings,
                    clock=self.clock,
                    sleep=lambda seconds: _wait(cancel, seconds),
                    publish=self.publisher,
                    cancelled=cancel.is_set,
                )
            except Exception as exc:  # noqa: BLE001  (the audit row says failed; log the class)
                log.error("replay.failed", replay_id=replay_id, error=exc.__class__.__name__)
            finally:
                self.cancels.pop(replay_id, None)
                self.running.release()

        threading.Thread(target=work, name=f"replay-{replay_id}", daemon=True).start()


def _wait(event: threading.Event, seconds: float) -> None:
    """A replay's pacing sleep, cut short by a cancel."""
    event.wait(seconds)


# In the schema only (the bearer scheme, for clients and the docs' Authorize button): the
# token itself was checked by AdminGuard before the request got here.
_bearer = HTTPBearer(auto_error=False, description="An admin token (WEBHOOKS_ADMIN_TOKENS)")


def _operator(
    request: Request, _documented: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The name of the token AdminGuard matched: the operator every audit row records."""
    name = request.scope.get("state", {}).get(TOKEN_NAME)
    if not isinstance(name, str):  # not behind AdminGuard: refuse rather than guess
        raise HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return name


Operator = Annotated[str, Depends(_operator)]


def _basic_password(value: bytes) -> bytes | None:
    """The password of an ``Authorization: Basic`` value (the user name is ignored)."""
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, sep, password = decoded.partition(b":")
    return password if sep else None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class AdminGuard:
    """Authenticate, then cap the body, before anything reads it (see the module docstring).

    A plain ASGI middleware rather than FastAPI dependencies: FastAPI reads and parses a JSON
    body before it resolves any dependency, so a token check there comes after the cost (and
    after a 422 for bad JSON, which would tell a stranger the API is there).
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: Mapping[str, SecretStr],
        *,
        max_body: int = MAX_BODY_BYTES,
        clock: Clock | None = None,
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.clock = clock or SystemClock()
        # Digests, so every comparison is of 32 bytes whatever the lengths involved.
        self._tokens = [
            (name, _digest(t.get_secret_value().encode())) for name, t in tokens.items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        if not self._tokens:  # the API is off: as if it did not exist
            await _answer(send, 404, "Not Found", "not_found")
            return
        path: str = scope["path"]
        if path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/"):
            # The console authenticates with its session cookie (its login page, the named
            # token, checked by the console against the same tokens); the body cap holds.
            body = await self._read_body(scope, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
            return
        docs = path in DOCS_PATHS or path.startswith("/admin/docs/")
        name = self._match(scope, docs=docs)
        if name is None and docs:
            name = self._session(scope)
        elif name is not None and path == "/admin/docs":
            send = self._start_session(send, name)
        if name is None:
            challenge = BASIC_CHALLENGE if docs else "Bearer"
            await _answer(send, 401, "missing or wrong bearer token", "unauthenticated", challenge)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        scope.setdefault("state", {})[TOKEN_NAME] = name
        await self.app(scope, _replay(body, receive), send)

    def _session_mac(self, key: bytes, name: str, expires: int) -> str:
        return hmac.new(key, f"docs:{name}:{expires}".encode(), hashlib.sha256).hexdigest()

    def _start_session(self, send: Send, name: str) -> Send:
        """``send`` that adds the docs' session cookie to a successful answer."""
        [key] = [digest for n, digest in self._tokens if n == name]
        expires = int(self.clock.now().timestamp()) + DOCS_SESSION_SECONDS
        value = f"{name}.{expires}.{self._session_mac(key, name, expires)}"
        cookie = (
            f"{DOCS_COOKIE}={value}; Path=/admin/; Max-Age={DOCS_SESSION_SECONDS}; "
            "HttpOnly; SameSite=Strict"
        )

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                headers = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
                message = {**message, "headers": headers}
            await send(message)

        return with_cookie

    def _session(self, scope: Scope) -> str | None:
        """The token name of a valid, unexpired docs session cookie, else None."""
        for key, value in scope["headers"]:
            if key != b"cookie":
                continue
            for part in value.decode("latin-1").split(";"):
                cookie_name, _, cookie_value = part.strip().partition("=")
                if cookie_name == DOCS_COOKIE:
                    return self._check_session(cookie_value)
        return None

    def _check_session(self, value: str) -> str | None:
        name, _, rest = value.partition(".")
        expires_text, _, mac = rest.partition(".")
        if not expires_text.isdigit() or len(expires_text) > 12:
            return None
        expires = int(expires_text)
        if expires <= self.clock.now().timestamp():
            return None
        found = None
        for token_name, digest in self._tokens:
            expected = self._session_mac(digest, token_name, expires)
            if hmac.compare_digest(expected.encode(), mac.encode()) and token_name == name:
                found = token_name
        return found

    def _match(self, scope: Scope, *, docs: bool) -> str | None:
        given: bytes | None = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = credentials.strip()
                elif scheme.lower() == b"basic" and docs:
                    given = _basic_password(credentials)
                break
        # Every token is compared, a match or not, so timing tells nothing of which or how many.
        digest = _digest(given or b"")
        found = None
        for name, expected in self._tokens:
            if hmac.compare_digest(digest, expected) and given:
                found = name
        return found

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, at most ``max_body`` bytes; None once an answer has been sent."""
        too_large = f"body too large (at most {self.max_body} bytes)"
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            if not declared[0].isdigit():
                await _answer(send, 400, "bad Content-Length", "bad_input")
                return None
            if int(declared[0]) > self.max_body:
                await _answer(send, 413, too_large, "too_large")
                return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await _answer(send, 413, too_large, "too_large")
                return None
            if not message.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the buffered body once, then whatever the client does next
    (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(
    send: Send, status: int, detail: str, reason: str, challenge: str | None = None
) -> None:
    """A refusal, sent before the body was read: the connection closes after it, so a client
    still sending a large body is not read to its end."""
    body = orjson.dumps({"detail": detail, "reason": reason})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    if challenge is not None:
        headers.append((b"www-authenticate", challenge.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _storable_inputs(request: Request) -> None:
    """Every path and query value: Postgres text cannot hold NUL, so refuse it (400) here
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


def _docs_assets() -> FilePath | None:
    try:
        import swagger_ui_bundle  # type: ignore[import-untyped]  # noqa: PLC0415
    except ImportError:
        return None
    return FilePath(swagger_ui_bundle.swagger_ui_path)


def _add_docs(app: FastAPI) -> None:
    """The schema and Swagger UI from local files, behind the token (no CDN, no public page).
    Without the swagger-ui-bundle package only the schema is served."""
    docs = [Depends(_operator)]  # AdminGuard asked for the token (Basic, for a browser)
    assets = _docs_assets()

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    if assets is None:
        return

    @app.get("/docs", include_in_schema=False, dependencies=docs)
    def swagger(request: Request) -> HTMLResponse:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return HTMLResponse(_swagger_page(root, f"{app.title}: docs"))

    @app.get("/docs/assets/{name}", include_in_schema=False, dependencies=docs)
    def swagger_asset(name: str) -> FileResponse:
        if name not in DOCS_ASSETS:
            raise HTTPException(404, "not found")
        return FileResponse(assets / name)


def _swagger_page(root: str, title: str) -> str:
    """Swagger UI's page. The schema's URL is made from ``location.origin``, which never holds
    credentials: a page opened as ``http://user:TOKEN@host/...`` resolves a relative URL to
    one that does, and browsers refuse to fetch that ("Failed to load API definition"). The
    fetch is authenticated by the session cookie the page's answer set."""
    schema = orjson.dumps(f"{root}/openapi.json").decode().replace("</", "<\\/")
    assets = html.escape(f"{root}/docs/assets")
    return f"""<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="shortcut icon" href="{assets}/favicon-32x32.png">
<title>{html.escape(title)}</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script>
const ui = SwaggerUIBundle({{
    url: window.location.origin + {schema},
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}})
</script>
</body>
</html>
"""


def _bad_input(exc: RequestValidationError) -> JSONResponse:
    """400 naming the field and what is wrong with it; never the value (it may be anything,
    a token pasted in the wrong place included)."""
    errors = [
        {
            "field": ".".join(str(part) for part in error.get("loc", ())),
            "problem": str(error.get("msg", "invalid")),
        }
        for error in exc.errors()
    ]
    first = errors[0] if errors else {"field": "request", "problem": "invalid"}
    detail = f"{first['field']}: {first['problem']}"
    return JSONResponse(
        {"detail": detail, "reason": "bad_input", "errors": errors}, status_code=400
    )


def _schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with FastAPI's generated 422 responses described as the 400s
    this API answers instead."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            openapi_version=app.openapi_version,
            description=app.description,
            routes=app.routes,
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault(
                        "400",
                        {
                            "description": "Bad input (the field is named).",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ErrorOut"}
                                }
                            },
                        },
                    )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_api(
    settings: Settings, *, clock: Clock | None = None, state: _State | None = None
) -> FastAPI:
    """The admin API (mounted at ``/admin`` by :func:`create_admin_app`, behind AdminGuard).
    ``state``: shared with the console, so both count the same running replays."""
    state = state or _State(settings, clock or SystemClock())
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
    app.openapi = lambda: _schema(app)  # type: ignore[method-assign]
    _add_docs(app)
    router = APIRouter(dependencies=[Depends(_operator), Depends(_storable_inputs)])

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad_input(exc)

    @app.exception_handler(queries.NotFoundError)
    def _not_found(request: Request, exc: queries.NotFoundError) -> JSONResponse:
        return _error(404, str(exc), exc.reason)

    @app.exception_handler(queries.QueryError)
    def _bad_query(request: Request, exc: queries.QueryError) -> JSONResponse:
        return _error(400, str(exc), exc.reason)

    @app.exception_handler(CatalogError)
    def _bad_source(request: Request, exc: CatalogError) -> JSONResponse:
        return _error(400, str(exc), "bad_source")

    @app.exception_handler(ReplayError)
    def _refused(request: Request, exc: ReplayError) -> JSONResponse:
        refused = exc.reason in ("succeeded", "not_replayable")
        return _error(409 if refused else 400, str(exc), exc.reason)

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
        a bare number that is a delivery id is refused (400, `ambiguous_id`): look it up with
        `GET /deliveries/{id}`. A bare number beyond a bigint is refused (400,
        `out_of_range`): a provider event id of that form is `event:ID`. The payload's size
        is shown, never its content."""
        bare = event.strip()
        if queries.is_number(bare):
            try:
                queries.parse_id(bare, "receipt id")
            except queries.QueryError:
                raise queries.QueryError(
                    f"receipt id out of range (at most {queries.MAX_ID}); a provider event id "
                    "of this form is looked up as event:ID",
                    "out_of_range",
                ) from None
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
            429: {"model": ErrorOut, "description": "Too many replays running here."},
        },
    )
    def create_replay(body: ReplayIn, session: Db, operator: Operator) -> Any:
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
                body.source, body.type, body.status, _time(body.since), _time(body.until)
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

    def _route_state(session: Session, route_id: int) -> dict[str, Any]:
        try:
            return {"route": route_id, **breaker.route_state(session, route_id).view()}
        except CatalogError as exc:
            raise queries.NotFoundError(str(exc)) from None

    @router.get(
        "/routes/{route_id}",
        tags=["routes"],
        summary="A route's pause and circuit breaker state",
        responses={404: {"model": ErrorOut}},
    )
    def show_route(
        route_id: Annotated[int, Path(ge=1, le=queries.MAX_ID)], session: Db
    ) -> dict[str, Any]:
        """Whether the route is paused (since when, why) and its breaker: `closed`, `open` or
        `half_open`, when it opened, the next probe, trips, and the failure window."""
        return _route_state(session, route_id)

    def _set_paused(
        session: Session, route_id: int, paused: bool, body: PauseIn, operator: str
    ) -> Any:
        _route_state(session, route_id)  # 404 for an unknown route
        try:
            breaker.set_paused(
                session, route_id, paused, Change(operator, body.reason, via="api"), now=None
            )
        except CatalogError as exc:
            return _error(409, str(exc), "already" if paused else "not_paused")
        return _route_state(session, route_id)

    @router.post(
        "/routes/{route_id}/pause",
        tags=["routes"],
        summary="Pause a route: hold its deliveries without attempting them",
        responses={404: {"model": ErrorOut}, 409: {"model": ErrorOut}},
    )
    def pause_route(
        route_id: Annotated[int, Path(ge=1, le=queries.MAX_ID)],
        body: PauseIn,
        session: Db,
        operator: Operator,
    ) -> Any:
        """New events are still accepted and stored; nothing is attempted until resumed."""
        return _set_paused(session, route_id, True, body, operator)

    @router.post(
        "/routes/{route_id}/resume",
        tags=["routes"],
        summary="Resume a paused route: its held deliveries go out again",
        responses={404: {"model": ErrorOut}, 409: {"model": ErrorOut}},
    )
    def resume_route(
        route_id: Annotated[int, Path(ge=1, le=queries.MAX_ID)],
        body: PauseIn,
        session: Db,
        operator: Operator,
    ) -> Any:
        """The sweeper publishes the held deliveries on its next runs."""
        return _set_paused(session, route_id, False, body, operator)

    app.include_router(router)
    app.state.admin = state
    return app


def metrics_endpoint(
    multiprocess_dir: str | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """``GET /metrics``: the receiver's families. With ``multiprocess_dir`` (several receiver
    processes, this one their supervisor) the sum of every process's files there; otherwise
    this process's own registry, or its multiprocess directory when it runs in that mode."""

    async def endpoint(request: Request) -> Response:
        from prometheus_client import (  # noqa: PLC0415
            CONTENT_TYPE_LATEST,
            REGISTRY,
            CollectorRegistry,
            generate_latest,
            multiprocess,
            values,
        )

        # Multiprocess mode is fixed when prometheus_client is first imported: ask it.
        source: Any = REGISTRY
        if multiprocess_dir is not None or values.ValueClass is not values.MutexValue:
            source = CollectorRegistry()
            multiprocess.MultiProcessCollector(source, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        # The receiver's own families only: the workers' are defined here too, at zero.
        body = generate_latest(metrics.exposed("receiver", source))
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    return endpoint


def create_admin_app(
    settings: Settings, *, clock: Clock | None = None, multiprocess_dir: str | None = None
) -> AdminGuard:
    """The admin plane: ``/metrics`` (no token) and, when a token is configured, the API under
    ``/admin``; all behind :class:`AdminGuard`."""
    from ingest.console import create_console  # noqa: PLC0415

    tokens = settings.admin_tokens_by_name()
    routes: list[Route | Mount] = [
        Route("/metrics", metrics_endpoint(multiprocess_dir), methods=["GET"])
    ]
    if tokens:
        state = _State(settings, clock or SystemClock())
        routes.append(Mount("/admin", app=create_api(settings, clock=clock, state=state)))
        routes.append(Mount(CONSOLE_PREFIX, app=create_console(settings, state, tokens)))
    return AdminGuard(Starlette(routes=routes), tokens, clock=clock)


class AdminServer:
    """The admin plane's uvicorn server in a thread of the process that runs ``webhooks
    serve``: the receiver's process itself (one process: ``/metrics`` reads its registry), or
    the supervisor of several (``/metrics`` adds up their multiprocess files).

    The socket is bound here, at once, so a taken port stops ``webhooks serve`` before the
    receiver starts. ``uvicorn.Server.run`` in a thread other than the main one installs no
    signal handlers; :meth:`stop` ends it.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        host: str,
        port: int,
        multiprocess_dir: str | None = None,
    ) -> None:
        import uvicorn  # noqa: PLC0415

        self.sock = _bind(host, port)
        config = uvicorn.Config(
            create_admin_app(settings, multiprocess_dir=multiprocess_dir),
            log_config=None,  # the receiver's logging stays as it is
            log_level="warning",
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            # The public port's protocol, so the same read timeouts apply here: without them
            # 64 idle connections would hold every slot and answer /admin and /metrics 503.
            http=admin_protocol(settings),
            loop="asyncio",
            timeout_keep_alive=settings.keep_alive_timeout,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="admin", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


# An operators' port: few clients, small requests.
ADMIN_MAX_CONNECTIONS = 64
ADMIN_MAX_HEADER_BYTES = 16 * 1024


def admin_protocol(settings: Settings) -> type[ReceiverProtocol]:
    """The receiver's protocol (:mod:`ingest.server`) with the admin port's limits: the public
    port's header, body and keep-alive timeouts, a 16 KiB head and at most
    :data:`ADMIN_MAX_CONNECTIONS` connections. A connection that sends nothing is closed
    ``WEBHOOKS_HEADER_TIMEOUT`` after it opened, so idle sockets cannot hold the port; its
    refusals are counted under ``limit="admin_..."``."""
    limits = Limits(
        max_header_bytes=ADMIN_MAX_HEADER_BYTES,
        max_headers=settings.max_headers,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        max_connections=ADMIN_MAX_CONNECTIONS,
    )
    return type("AdminProtocol", (ReceiverProtocol,), {"limits": limits, "limit_prefix": "admin_"})


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def app_from_env() -> AdminGuard:
    """``uvicorn --factory ingest.admin:app_from_env``: the admin API on its own (its
    ``/metrics`` shows this process's registry only; ``webhooks serve`` runs the admin plane
    beside the receiver, where ``/metrics`` means something)."""
    settings = load_settings()
    configure_logging(settings.log_level, json=settings.log_json)
    return create_admin_app(settings)

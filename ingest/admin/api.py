"""The admin API (FastAPI, mounted at ``/admin`` behind AdminGuard; see :mod:`ingest.admin`):
the routers of :mod:`ingest.admin.events`, :mod:`ingest.admin.replays` and
:mod:`ingest.admin.routes` behind one authentication dependency (the operator AdminGuard
matched), its offline docs, and the answers to bad input (400 naming the field, never a 422
or a 500, never the value)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from ingest.admin import events, replays, routes
from ingest.admin.deps import error, operator, storable_inputs
from ingest.admin.docs import add_docs, openapi_document
from ingest.plane import PlaneState
from models import queries
from models.catalog import CatalogError
from models.replays import ReplayError

DESCRIPTION = """
Operators' API of the webhook pipeline: received events with their deliveries and attempts,
dead letters, and audited replays. Authenticate with `Authorization: Bearer <token>`, one of
`WEBHOOKS_ADMIN_TOKENS` (or `WEBHOOKS_ADMIN_TOKEN`); the audit records the token's name as the
operator (these docs: the token as the password of HTTP Basic, any user name). Bodies are at
most 64 KiB. Bad input answers 400 naming the field. Times are ISO 8601 UTC (`...Z`).
Responses never contain a secret or a payload.
"""


def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the field and what is wrong with it; never the value (it may be anything,
    a token pasted in the wrong place included)."""
    errors = [
        {
            "field": ".".join(str(part) for part in item.get("loc", ())),
            "problem": str(item.get("msg", "invalid")),
        }
        for item in exc.errors()
    ]
    first = errors[0] if errors else {"field": "request", "problem": "invalid"}
    detail = f"{first['field']}: {first['problem']}"
    return JSONResponse(
        {"detail": detail, "reason": "bad_input", "errors": errors}, status_code=400
    )


def _not_found(request: Request, exc: queries.NotFoundError) -> JSONResponse:
    return error(404, str(exc), exc.reason)


def _bad_query(request: Request, exc: queries.QueryError) -> JSONResponse:
    return error(400, str(exc), exc.reason)


def _bad_source(request: Request, exc: CatalogError) -> JSONResponse:
    return error(400, str(exc), "bad_source")


def _refused(request: Request, exc: ReplayError) -> JSONResponse:
    refused = exc.reason in ("succeeded", "not_replayable")
    return error(409 if refused else 400, str(exc), exc.reason)


def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
    return error(503, "database unavailable", "database_unavailable")


def create_api(state: PlaneState) -> FastAPI:
    """The admin API; ``state`` is shared with the console, so both count the same running
    replays."""
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
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    add_docs(app)
    app.exception_handler(RequestValidationError)(_invalid)
    app.exception_handler(queries.NotFoundError)(_not_found)
    app.exception_handler(queries.QueryError)(_bad_query)
    app.exception_handler(CatalogError)(_bad_source)
    app.exception_handler(ReplayError)(_refused)
    app.exception_handler(OperationalError)(_db_down)
    # The one authentication dependency of every route (the docs' own: ingest.admin.docs).
    guarded = [Depends(operator), Depends(storable_inputs)]
    for module in (events, replays, routes):
        app.include_router(module.router, dependencies=guarded)
    app.state.admin = state
    return app

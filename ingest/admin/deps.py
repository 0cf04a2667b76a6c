"""What every admin API route depends on: the operator (the one authentication dependency),
storable inputs, the shared state and a database session."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from ingest.admin.guard import TOKEN_NAME
from ingest.plane import PlaneState
from models import queries

# A row id in the path: within its column's range (a bigint), or 400 like any bad input.
PathId = Annotated[int, Path(ge=1, le=queries.MAX_ID)]

# In the schema only (the bearer scheme, for clients and the docs' Authorize button): the
# token itself was checked by AdminGuard before the request got here.
_bearer = HTTPBearer(auto_error=False, description="An admin token (WEBHOOKS_ADMIN_TOKENS)")


def operator(
    request: Request, _documented: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The name of the token AdminGuard matched: the operator every audit row records."""
    name = request.scope.get("state", {}).get(TOKEN_NAME)
    if not isinstance(name, str):  # not behind AdminGuard: refuse rather than guess
        raise HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return name


Operator = Annotated[str, Depends(operator)]


def storable_inputs(request: Request) -> None:
    """Every path and query value: Postgres text cannot hold NUL, so refuse it (400) here
    rather than let a query fail with a 500."""
    values = [*request.path_params.values(), *request.query_params.values()]
    if any("\x00" in str(value) for value in values):
        raise queries.QueryError("NUL characters are not allowed in ids and filters", "bad_input")


def _state(request: Request) -> PlaneState:
    state: PlaneState = request.app.state.admin
    return state


State = Annotated[PlaneState, Depends(_state)]


def _session(state: State) -> Iterator[Session]:
    with state.sessions() as session, session.begin():
        yield session


Db = Annotated[Session, Depends(_session)]
# A change's session: committed when the endpoint returns, before the answer is sent (a
# ``Db`` commits after it), so a client that reads what it changed finds it.
Writes = Annotated[Session, Depends(_session, scope="function")]


def parse_time(state: PlaneState, text: str | None) -> datetime | None:
    """An ISO time or a duration ago (``2h``), by the plane's clock."""
    return None if text is None else queries.parse_time(text, now=state.clock.now())


def error(code: int, detail: str, reason: str) -> JSONResponse:
    return JSONResponse({"detail": detail, "reason": reason}, status_code=code)

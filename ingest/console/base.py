"""What every console page shares: :class:`Console` (the templates, the database, the session
check) and its one authentication step, :meth:`Console.get` / :meth:`Console.post`, which
give a handler a :class:`Visit` only for a live session (and, for a POST, the session's CSRF
token); otherwise a redirect to the login page, or 403.

Every response carries the security headers of :class:`SecurityHeaders`. Templates
autoescape every value: payloads, headers and event types are attacker-controlled.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

import orjson
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import docs
from core.logs import get_logger
from ingest.console import sessions as sess
from ingest.console.plans import PlanStore
from ingest.plane import PlaneState, secure_cookie
from models import queries

log = get_logger("console")

HERE = Path(__file__).resolve().parent
COOKIE = "wh_console"
LOGIN_COOKIE = "wh_console_login"
COOKIE_PATH = "/console"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
]

HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
T = TypeVar("T")


class SecurityHeaders:
    """Adds the console's security headers to every response (pages, redirects, errors,
    static files)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in SECURITY_HEADERS}
                headers = [(k, v) for k, v in message.get("headers", []) if k not in names]
                message["headers"] = headers + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, sending)


@dataclass(frozen=True)
class Visit:
    """A request with a live session: what a console handler is given."""

    request: Request
    session: sess.ConsoleSession
    form: dict[str, list[str]]  # a POST's urlencoded body; empty for a GET


Handler = Callable[["Console", Visit], Awaitable[Response]]


class Console:
    def __init__(self, state: PlaneState) -> None:
        self.settings = state.settings
        self.state = state
        self.clock = state.clock
        self.tokens = state.tokens
        self.store = state.console_sessions
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.autoescape = True
        self.templates.env.filters["ago"] = _ago
        self.templates.env.filters["when"] = _when
        self.templates.env.filters["jsonish"] = _jsonish
        self.templates.env.filters["status_code"] = _status_code
        self.plans = PlanStore(state.clock)
        self.flower_url = (
            self.settings.console_flower_url or f"http://127.0.0.1:{self.settings.flower_port}"
        ).rstrip("/")

    # access -----------------------------------------------------------------------------

    def match(self, token: str) -> tuple[str, bytes] | None:
        """The named token this is, compared with every one in constant time."""
        return self.tokens.match(token.encode())

    def secure(self, request: Request) -> bool:
        return secure_cookie(self.settings, request.url.scheme)

    def session(self, request: Request) -> sess.ConsoleSession | None:
        return self.store.get(request.cookies.get(COOKIE), self.tokens.digests)

    def get(self, path: str, handler: Handler) -> Route:
        """A page: ``handler`` runs for a live session; without one, the login page."""
        return Route(
            path, self._authed(handler, post=False), methods=["GET"], name=handler.__name__
        )

    def post(self, path: str, handler: Handler) -> Route:
        """An action: ``handler`` runs for a live session whose CSRF token the form carries;
        otherwise 403 and nothing changes."""
        return Route(
            path, self._authed(handler, post=True), methods=["POST"], name=handler.__name__
        )

    def _authed(self, handler: Handler, *, post: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = self.session(request)
            if session is None:  # the body is never read (AdminGuard did not let it through)
                if post:
                    return Response("session expired: log in again", 403)
                return redirect("/console/login")
            form = await read_form(request) if post else {}
            if post and not sess.same(one(form, "csrf"), session.csrf):
                log.info("console.csrf_refused")
                return Response("missing or wrong CSRF token", 403)
            visit = Visit(request, session, form)
            values = [
                *request.path_params.values(),
                *request.query_params.values(),
                *(v for vs in form.values() for v in vs),
            ]
            if any("\x00" in str(v) for v in values):  # Postgres text cannot hold NUL
                return self.error(visit, "NUL characters are not allowed")
            return await handler(self, visit)

        return endpoint

    # database -----------------------------------------------------------------------------

    async def db(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self.state.sessions() as session, session.begin():
                return work(session)

        return await run_in_threadpool(run)

    # pages --------------------------------------------------------------------------------

    def page(
        self,
        request: Request,
        name: str,
        context: dict[str, Any],
        *,
        status: int = 200,
        session: sess.ConsoleSession | None = None,
    ) -> Response:
        context = {
            "operator": session.operator if session else None,
            "csrf": session.csrf if session else None,
            "flower_url": self.flower_url,
            **context,
        }
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def show(self, visit: Visit, name: str, context: dict[str, Any], status: int = 200) -> Response:
        """A page of the session's operator."""
        return self.page(visit.request, name, context, status=status, session=visit.session)

    def error(self, visit: Visit, message: str, status: int = 400) -> Response:
        """A refusal: why, and a link back to the page the operator was on."""
        href, label = back_to(visit.request.url.path)
        topic = docs_for(visit.request.url.path)
        context = {
            "message": message,
            "back_href": href,
            "back_label": label,
            "doc_href": topic.href,
            "doc_title": topic.title,
        }
        return self.show(visit, "error.html", context, status)


ROOT = "/console"
# The page each part of the console is reached from: where a refusal links back to (the
# console sends no Referer, so the path decides).
_BACK = {
    "dead": ("/console/dead", "the dead letters"),
    "replays": ("/console/dead", "the dead letters"),
    "events": ("/console/events", "the events"),
    "ledger": ("/console/events", "the events"),
    "deliveries": ("/console/events", "the events"),
    "routes": ("/console/routes", "the sources and routes"),
    "sources": ("/console/routes", "the sources and routes"),
    "audit": ("/console/audit", "the audit log"),
}


# The docs section that explains each part of the console, linked from its refusals.
_DOCS = {
    "dead": "dead-letters",
    "replays": "dead-letters",
    "deliveries": "dead-letters",
    "ledger": "ledger",
    "routes": "routes",
    "sources": "sources",
}


def docs_for(path: str) -> docs.Topic:
    """The docs section a refusal at ``path`` links to (pure): its part's, else the console's."""
    parts = [p for p in path.removeprefix(ROOT).split("/") if p]
    return docs.TOPICS[_DOCS.get(parts[0] if parts else "", "console")]


def back_to(path: str) -> tuple[str, str]:
    """(href, label) of the page a refusal at ``path`` links back to (pure): a delivery's or
    a replay's own page when the refusal was an action on it, else its part's list, else
    the overview."""
    parts = [p for p in path.removeprefix(ROOT).split("/") if p]
    if len(parts) >= 3 and parts[0] in {"deliveries", "replays"} and parts[1].isdigit():
        noun = "delivery" if parts[0] == "deliveries" else "replay"
        return f"{ROOT}/{parts[0]}/{parts[1]}", f"{noun} {parts[1]}"
    return _BACK.get(parts[0] if parts else "", (f"{ROOT}/", "the overview"))


def _ago(value: timedelta | None) -> str:
    if value is None:
        return "-"
    seconds = int(value.total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _status_code(error: str | None) -> str:
    """The downstream's HTTP status in a forward attempt's error ("... HTTP 503")."""
    found = HTTP_STATUS.search(error or "")
    return found.group(1) if found else "-"


def _jsonish(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


async def read_form(request: Request) -> dict[str, list[str]]:
    """An urlencoded form body (the only kind the console sends)."""
    body = await request.body()
    try:
        return parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20_000)
    except (UnicodeDecodeError, ValueError):
        return {}


def one(form: dict[str, list[str]], key: str) -> str | None:
    values = form.get(key)
    return values[0] if values else None


def opt(value: str | None) -> str | None:
    value = (value or "").strip()
    if "\x00" in value:
        raise queries.QueryError("NUL characters are not allowed", "bad_input")
    return value or None


def args_of(values: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """The stripped text of each of ``keys`` in the query, "" when absent."""
    return {k: (values.get(k) or "").strip() for k in keys}


def parse_when(text: str, now: datetime) -> datetime | None:
    """A filter's time (ISO, or a duration ago by the database's clock); None when empty."""
    return queries.parse_time(text, now=now) if text else None


def redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303)

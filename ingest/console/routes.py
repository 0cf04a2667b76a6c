"""The operator console's pages and actions (mounted at ``/console`` by
:func:`ingest.admin.create_admin_app`, behind AdminGuard's body cap).

Access: ``/console/login`` takes a named admin token (``WEBHOOKS_ADMIN_TOKENS``), compared
in constant time with every configured one; a match starts a server-side session
(:mod:`ingest.console.sessions`) whose id goes in an HttpOnly, SameSite=Strict cookie
(Secure on https, or with ``WEBHOOKS_CONSOLE_SECURE_COOKIES``), ending after
``WEBHOOKS_CONSOLE_IDLE_TIMEOUT`` unused, or at logout. Any other page without a live session
redirects to the login page. Every POST carries the session's CSRF token (the login form a
token of its own cookie): without it, 403 and nothing changes.

Every response carries a Content-Security-Policy without inline script or style,
``X-Frame-Options: DENY`` and ``Referrer-Policy: no-referrer``. Templates autoescape every
value: payloads, headers and event types are attacker-controlled.

Actions reuse the CLI's and the API's modules (plans, guarded transitions, audit rows), with
the session's token name as the operator and ``via: console``. A preview freezes what it
counted (server-side, under a one-use token for this session), so the confirmation moves
exactly the rows the preview showed.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlencode

import httpx
import orjson
import redis
from pydantic import SecretStr
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.logs import get_logger
from core.settings import Settings
from ingest.console import sessions as sess
from models import (
    breaker,
    candidates,
    catalog,
    delivery_history,
    discards,
    queries,
    replays,
    route_catalog,
)
from models import console as reads
from models.candidates import ReplayFilter
from models.catalog import CatalogError, Change
from models.discards import DiscardError
from models.queries import EventFilter
from models.replays import ReplayError

if TYPE_CHECKING:
    from ingest.admin import _State

log = get_logger("console")

HERE = Path(__file__).resolve().parent
COOKIE = "wh_console"
LOGIN_COOKIE = "wh_console_login"
COOKIE_PATH = "/console"
PAGE_SIZE = 50
DEAD_PAGE = 100
MAX_PAYLOAD_SHOWN = 256 * 1024
PLAN_TTL = timedelta(minutes=15)
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
ROUTE_ACTIONS = ("enable", "disable", "remove", "pause", "resume")
SOURCE_ACTIONS = ("enable", "disable")

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


@dataclass
class PendingPlan:
    """A previewed replay or discard, waiting for its confirmation."""

    operator: str
    action: str  # "replay" or "discard"
    filter_as_given: dict[str, Any]
    ids: tuple[int, ...]
    flt: ReplayFilter | None
    # By ids: the candidates as planned. By filter: the sample only; ``frozen`` holds every
    # matching id, and the confirmation reads the candidates of exactly those.
    candidates: tuple[candidates.Candidate, ...]
    made_at: datetime
    frozen: tuple[int, ...] = ()


class Console:
    def __init__(self, settings: Settings, state: _State, tokens: dict[str, SecretStr]) -> None:
        self.settings = settings
        self.state = state
        self.clock = state.clock
        self.tokens = [(name, sess.digest(t.get_secret_value())) for name, t in tokens.items()]
        self.valid = {d for _, d in self.tokens}
        self.store = sess.SessionStore(state.clock, settings.console_idle_timeout)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.autoescape = True
        self.templates.env.filters["ago"] = _ago
        self.templates.env.filters["when"] = _when
        self.templates.env.filters["jsonish"] = _jsonish
        self.templates.env.filters["status_code"] = _status_code
        self.plans: dict[str, PendingPlan] = {}
        self._plans_lock = threading.Lock()
        self.flower_url = (
            settings.console_flower_url or f"http://127.0.0.1:{settings.flower_port}"
        ).rstrip("/")

    # access -----------------------------------------------------------------------------

    def match(self, token: str) -> tuple[str, bytes] | None:
        """The named token this is, compared with every one in constant time."""
        given = sess.digest(token)
        found = None
        for name, expected in self.tokens:
            if sess.same_bytes(given, expected) and token:
                found = (name, expected)
        return found

    def secure(self, request: Request) -> bool:
        return self.settings.console_secure_cookies or request.url.scheme == "https"

    def session(self, request: Request) -> sess.ConsoleSession | None:
        return self.store.get(request.cookies.get(COOKIE), self.valid)

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

    def error(
        self, request: Request, session: sess.ConsoleSession, message: str, status: int = 400
    ) -> Response:
        return self.page(
            request, "error.html", {"message": message}, status=status, session=session
        )

    # plans --------------------------------------------------------------------------------

    def keep_plan(self, plan: PendingPlan) -> str:
        token = secrets.token_urlsafe(24)
        now = self.clock.now()
        with self._plans_lock:
            for key in [k for k, p in self.plans.items() if now - p.made_at > PLAN_TTL]:
                del self.plans[key]
            self.plans[token] = plan
        return token

    def take_plan(self, token: str, operator: str) -> PendingPlan | None:
        with self._plans_lock:
            plan = self.plans.get(token)
            if plan is None or plan.operator != operator:
                return None
            if self.clock.now() - plan.made_at > PLAN_TTL:
                del self.plans[token]
                return None
            del self.plans[token]
            return plan


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


def _pretty(body: bytes) -> str:
    shown = body[:MAX_PAYLOAD_SHOWN]
    try:
        text = orjson.dumps(orjson.loads(shown), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        text = shown.decode("utf-8", errors="replace")
    if len(body) > MAX_PAYLOAD_SHOWN:
        text += f"\n... ({len(body) - MAX_PAYLOAD_SHOWN} more bytes not shown)"
    return text


async def _form(request: Request) -> dict[str, list[str]]:
    """An urlencoded form body (the only kind the console sends)."""
    body = await request.body()
    try:
        return parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20_000)
    except (UnicodeDecodeError, ValueError):
        return {}


def _one(form: dict[str, list[str]], key: str) -> str | None:
    values = form.get(key)
    return values[0] if values else None


def _opt(value: str | None) -> str | None:
    value = (value or "").strip()
    if "\x00" in value:
        raise queries.QueryError("NUL characters are not allowed", "bad_input")
    return value or None


def _cursor(text: str | None) -> tuple[datetime, int] | None:
    if not text:
        return None
    when, _, rid = text.rpartition("_")
    try:
        return datetime.fromisoformat(when), queries.parse_id(rid, "cursor")
    except (ValueError, queries.QueryError):
        raise queries.QueryError("bad cursor", "bad_input") from None


def _redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303)


def create_console(settings: Settings, state: _State, tokens: dict[str, SecretStr]) -> ASGIApp:
    """The console's ASGI app (mount it at ``/console``)."""
    c = Console(settings, state, tokens)

    def login_redirect() -> Response:
        return _redirect("/console/login")

    async def authed(
        request: Request, *, post: bool = False
    ) -> tuple[sess.ConsoleSession | None, dict[str, list[str]], Response | None]:
        """The live session, the form (for a POST) and an early answer (login or 403)."""
        session = c.session(request)
        form = await _form(request) if post else {}
        if session is None:
            if post:
                return None, form, Response("session expired: log in again", 403)
            return None, form, login_redirect()
        if post and not sess.same(_one(form, "csrf"), session.csrf):
            log.info("console.csrf_refused")
            return None, form, Response("missing or wrong CSRF token", 403)
        values = [
            *request.path_params.values(),
            *request.query_params.values(),
            *(v for vs in form.values() for v in vs),
        ]
        if any("\x00" in str(v) for v in values):  # Postgres text cannot hold NUL
            return None, form, c.error(request, session, "NUL characters are not allowed")
        return session, form, None

    # login / logout -------------------------------------------------------------------------

    async def login_page(request: Request) -> Response:
        token = secrets.token_urlsafe(24)
        response = c.page(request, "login.html", {"login_csrf": token, "message": None})
        response.set_cookie(
            LOGIN_COOKIE,
            token,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=c.secure(request),
        )
        return response

    async def login(request: Request) -> Response:
        form = await _form(request)
        expected = request.cookies.get(LOGIN_COOKIE)
        if expected is None or not sess.same(_one(form, "csrf"), expected):
            return Response("missing or wrong CSRF token", 403)
        found = c.match(_one(form, "token") or "")
        if found is None:
            log.info("console.login_refused")
            token = secrets.token_urlsafe(24)
            response = c.page(
                request, "login.html", {"login_csrf": token, "message": "wrong token"}, status=401
            )
            response.set_cookie(
                LOGIN_COOKIE,
                token,
                path=COOKIE_PATH,
                httponly=True,
                samesite="strict",
                secure=c.secure(request),
            )
            return response
        name, digest = found
        sid, _ = c.store.create(name, digest)
        log.info("console.login", operator=name)
        response = _redirect("/console/")
        response.set_cookie(
            COOKIE,
            sid,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=c.secure(request),
        )
        response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
        return response

    async def logout(request: Request) -> Response:
        session, _, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        c.store.end(request.cookies.get(COOKIE))
        log.info("console.logout", operator=session.operator)
        response = login_redirect()
        response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
        return response

    # overview -------------------------------------------------------------------------------

    def claims_signal() -> str | None:
        """None when the fast claim tier (Redis) answers; else what degraded means."""
        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=1, socket_connect_timeout=1
        )
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

    async def overview(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        data = await c.db(reads.overview)
        sources = await c.db(reads.catalog)
        degraded = await run_in_threadpool(claims_signal)
        return c.page(
            request,
            "overview.html",
            {"o": data, "sources": sources, "degraded": degraded},
            session=session,
        )

    # events ---------------------------------------------------------------------------------

    async def events(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        p = request.query_params
        args = {
            k: (p.get(k) or "").strip() for k in ("source", "type", "status", "since", "until", "q")
        }
        try:
            if args["q"]:
                ref = _opt(args["q"])
                assert ref is not None
                found = await c.db(lambda s: queries.get_event(s, ref, source=_opt(args["source"])))
                return _redirect(f"/console/events/{found.id}")
            now = await c.db(reads.db_now)
            flt = EventFilter(
                _opt(args["source"]),
                _opt(args["type"]),
                _opt(args["status"]),
                queries.parse_time(args["since"], now=now) if args["since"] else None,
                queries.parse_time(args["until"], now=now) if args["until"] else None,
                PAGE_SIZE,
                _cursor(p.get("before")),
            )
            rows = await c.db(lambda s: queries.list_events(s, flt))
        except (queries.QueryError, CatalogError) as exc:
            return c.page(
                request,
                "events.html",
                {"args": args, "rows": [], "next": None, "message": str(exc)},
                status=400,
                session=session,
            )
        next_url = None
        if len(rows) == PAGE_SIZE:
            last = rows[-1]
            kept = {k: v for k, v in args.items() if v and k != "q"}
            kept["before"] = f"{last.received_at.isoformat()}_{last.id}"
            next_url = "/console/events?" + urlencode(kept)
        return c.page(
            request,
            "events.html",
            {"args": args, "rows": rows, "next": next_url, "message": None},
            session=session,
        )

    async def event(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        try:
            rid = queries.parse_id(request.path_params["receipt"], "receipt id")
            detail = await c.db(lambda s: queries.get_event(s, queries.receipt_ref(rid)))
        except queries.NotFoundError as exc:
            return c.error(request, session, str(exc), 404)
        except queries.QueryError as exc:
            return c.error(request, session, str(exc))
        stored = await c.db(lambda s: reads.payload(s, rid))
        body = None if stored.body is None else _pretty(stored.body)
        return c.page(
            request, "event.html", {"e": detail, "body": body, "stored": stored}, session=session
        )

    async def delivery(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        from tasks.context import idempotency_key  # noqa: PLC0415

        try:
            ref = request.path_params["delivery"]
            detail = await c.db(lambda s: queries.get_delivery(s, ref, key_of=idempotency_key))
        except queries.NotFoundError as exc:
            return c.error(request, session, str(exc), 404)
        except queries.QueryError as exc:
            return c.error(request, session, str(exc))
        timeline = _timeline(detail.delivery)
        return c.page(
            request, "delivery.html", {"d": detail, "timeline": timeline}, session=session
        )

    async def flower_task(request: Request) -> Response:
        """Redirect to the Flower page of one attempt's task (asked of Flower's API); its
        task list when Flower does not know it."""
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        try:
            did = queries.parse_delivery_ref(request.path_params["delivery"])
            number = queries.parse_id(request.path_params["number"], "attempt number")
            detail = await c.db(lambda s: queries.get_delivery(s, did))
        except queries.QueryError as exc:
            return c.error(request, session, str(exc), 404)
        started = [a.started_at for a in detail.delivery.attempt_log if a.number == number]
        task = await run_in_threadpool(_flower_task_id, settings, did, started)
        if task is None:
            return _redirect(f"{c.flower_url}/tasks")
        return _redirect(f"{c.flower_url}/task/{task}")

    # dead letters ---------------------------------------------------------------------------

    def dead_filter(args: dict[str, str], now: datetime) -> ReplayFilter:
        return ReplayFilter(
            _opt(args.get("source")),
            _opt(args.get("type")),
            "dead",
            queries.parse_time(args["since"], now=now) if args.get("since") else None,
            queries.parse_time(args["until"], now=now) if args.get("until") else None,
        )

    async def dead(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        p = request.query_params
        args = {k: (p.get(k) or "").strip() for k in ("source", "type", "since", "until")}
        try:
            now = await c.db(reads.db_now)
            flt = dead_filter(args, now)
            rows = await c.db(
                lambda s: candidates.candidates_by_filter(s, flt, limit=DEAD_PAGE + 1)
            )
            groups = await c.db(lambda s: queries.dead_letters(s, source=flt.source))
        except (queries.QueryError, CatalogError) as exc:
            return c.page(
                request,
                "dead.html",
                {"args": args, "rows": [], "groups": [], "more": False, "message": str(exc)},
                status=400,
                session=session,
            )
        return c.page(
            request,
            "dead.html",
            {
                "args": args,
                "rows": rows[:DEAD_PAGE],
                "groups": groups,
                "more": len(rows) > DEAD_PAGE,
                "message": None,
            },
            session=session,
        )

    async def dead_preview(request: Request) -> Response:
        session, form, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        action = _one(form, "action")
        if action not in ("replay", "discard"):
            return c.error(request, session, "action must be replay or discard")
        args = {k: (_one(form, k) or "").strip() for k in ("source", "type", "since", "until")}
        try:
            if _one(form, "scope") == "all":
                now = await c.db(reads.db_now)
                flt: ReplayFilter | None = dead_filter(args, now)
                ids: tuple[int, ...] = ()
                given: dict[str, Any] = {k: v for k, v in args.items() if v}
                if not given:
                    return c.error(
                        request,
                        session,
                        "give a filter for all matching (source, type, since or until)",
                    )
                given["status"] = "dead"
            else:
                flt = None
                ids = tuple(
                    sorted({queries.parse_id(v, "delivery id") for v in form.get("ids", [])})
                )
                if not ids:
                    return c.error(request, session, "select at least one dead letter")
                given = {"ids": list(ids)}
            operator = session.operator

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
                    request,
                    session,
                    f"more than {replays.MAX_PLAN} {what} match; narrow the filter "
                    "(type, since or until)",
                )
        except (queries.QueryError, CatalogError, ReplayError, DiscardError) as exc:
            return c.error(request, session, str(exc))
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
        token = c.keep_plan(pending) if shown.count else None
        return c.page(
            request,
            "preview.html",
            {
                "action": action,
                "count": shown.count,
                "sample": shown.sample[:10],
                "given": given,
                "plan": token,
                "default_rate": replays.DEFAULT_RATE,
            },
            session=session,
        )

    async def dead_confirm(request: Request) -> Response:
        session, form, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        reason = (_one(form, "reason") or "").strip()
        if not reason or "\x00" in reason:
            return c.error(request, session, "a reason is required: it goes into the audit")
        pending = c.take_plan(_one(form, "plan") or "", session.operator)
        if pending is None:
            return c.error(
                request, session, "this preview expired or was already confirmed: preview again"
            )
        if pending.frozen:
            # The ids the preview counted, read now (the rows move only through guarded SQL
            # at execution, which skips any that are no longer dead).
            try:
                rows = await c.db(lambda s: candidates.candidates_by_ids(s, pending.frozen))
            except queries.NotFoundError as exc:
                return c.error(request, session, f"{exc}: preview again")
            pending.candidates = tuple(rows)
        if pending.action == "discard":
            dreq = discards.DiscardRequest(
                session.operator,
                reason,
                "console",
                pending.filter_as_given,
                pending.ids,
                pending.flt,
            )
            dplan = discards.DiscardPlan(dreq, pending.candidates)
            try:
                result = await c.db(lambda s: discards.execute_discard(s, dplan, now=None))
            except DiscardError as exc:
                return c.error(request, session, str(exc))
            discards.record_discarded(result, "console")
            return c.page(request, "discarded.html", {"r": result}, session=session)
        try:
            rate = float(_one(form, "rate") or replays.DEFAULT_RATE)
        except ValueError:
            return c.error(request, session, "rate must be a number")
        req = replays.ReplayRequest(
            session.operator,
            reason,
            "console",
            pending.filter_as_given,
            pending.ids,
            pending.flt,
            rate=rate,
        )
        try:
            replays.validate_request(req)
        except ReplayError as exc:
            return c.error(request, session, str(exc))
        plan = replays.Plan(req, pending.candidates)
        if not c.state.running.acquire(blocking=False):
            return c.error(request, session, "too many replays running here; retry later", 429)
        try:
            replay_id = await run_in_threadpool(
                replays.start_replay, c.state.sessions, plan, now=c.clock.now()
            )
        except BaseException:
            c.state.running.release()
            raise
        c.state.run_in_background(plan, replay_id)
        return _redirect(f"/console/replays/{replay_id}")

    async def replay_page(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        try:
            rid = queries.parse_id(request.path_params["replay"], "replay id")
            record = await c.db(lambda s: replays.get_replay(s, rid))
        except queries.NotFoundError as exc:
            return c.error(request, session, str(exc), 404)
        except queries.QueryError as exc:
            return c.error(request, session, str(exc))
        return c.page(
            request,
            "replay.html",
            {"r": record, "cancellable": record.id in c.state.cancels},
            session=session,
        )

    async def replay_cancel(request: Request) -> Response:
        session, _, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        try:
            rid = queries.parse_id(request.path_params["replay"], "replay id")
        except queries.QueryError as exc:
            return c.error(request, session, str(exc))
        cancel = c.state.cancels.get(rid)
        if cancel is None:
            return c.error(request, session, f"replay {rid} is not running in this process", 409)
        cancel.set()
        log.info("console.replay_cancelled", replay_id=rid, operator=session.operator)
        return _redirect(f"/console/replays/{rid}")

    # routes and sources ---------------------------------------------------------------------

    async def routes_page(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        sources = await c.db(reads.catalog)
        return c.page(
            request, "routes.html", {"sources": sources, "message": None}, session=session
        )

    async def route_action(request: Request) -> Response:
        session, form, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        action = request.path_params["action"]
        if action not in ROUTE_ACTIONS:
            return c.error(request, session, f"unknown action: {action}", 404)
        change = Change(session.operator, _one(form, "reason") or "", via="console")
        try:
            route_id = queries.parse_id(request.path_params["route"], "route id")

            def act(s: Session) -> None:
                if action in ("enable", "disable"):
                    route_catalog.set_route_active(
                        s, route_id, action == "enable", change, now=None
                    )
                elif action == "remove":
                    route_catalog.remove_route(s, route_id, change, now=None)
                else:
                    breaker.set_paused(s, route_id, action == "pause", change, now=None)

            await c.db(act)
        except (CatalogError, queries.QueryError) as exc:
            return c.error(request, session, str(exc), 409)
        log.info("console.route_changed", route=route_id, action=action, operator=session.operator)
        return _redirect("/console/routes")

    async def source_action(request: Request) -> Response:
        session, form, early = await authed(request, post=True)
        if early is not None:
            return early
        assert session is not None
        action = request.path_params["action"]
        if action not in SOURCE_ACTIONS:
            return c.error(request, session, f"unknown action: {action}", 404)
        change = Change(session.operator, _one(form, "reason") or "", via="console")
        ref = request.path_params["source"]
        try:

            def act(s: Session) -> None:
                source = catalog.get_source(s, ref)
                catalog.set_source_active(s, source, action == "enable", change, now=None)

            await c.db(act)
        except CatalogError as exc:
            return c.error(request, session, str(exc), 409)
        log.info("console.source_changed", action=action, operator=session.operator)
        return _redirect("/console/routes")

    # audit ----------------------------------------------------------------------------------

    async def audit_page(request: Request) -> Response:
        session, _f, early = await authed(request)
        if early is not None:
            return early
        assert session is not None
        p = request.query_params
        args = {k: (p.get(k) or "").strip() for k in ("operator", "action", "since", "until")}
        try:
            now = await c.db(reads.db_now)
            since = queries.parse_time(args["since"], now=now) if args["since"] else None
            until = queries.parse_time(args["until"], now=now) if args["until"] else None
            rows = await c.db(
                lambda s: reads.audit(
                    s,
                    operator=_opt(args["operator"]),
                    action=_opt(args["action"]),
                    since=since,
                    until=until,
                )
            )
        except queries.QueryError as exc:
            return c.page(
                request,
                "audit.html",
                {"args": args, "rows": [], "message": str(exc)},
                status=400,
                session=session,
            )
        return c.page(
            request, "audit.html", {"args": args, "rows": rows, "message": None}, session=session
        )

    routes = [
        Route("/", overview, methods=["GET"]),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/events", events, methods=["GET"]),
        Route("/events/{receipt}", event, methods=["GET"]),
        Route("/deliveries/{delivery}", delivery, methods=["GET"]),
        Route("/deliveries/{delivery}/attempts/{number}/flower", flower_task, methods=["GET"]),
        Route("/dead", dead, methods=["GET"]),
        Route("/dead/preview", dead_preview, methods=["POST"]),
        Route("/dead/confirm", dead_confirm, methods=["POST"]),
        Route("/replays/{replay}", replay_page, methods=["GET"]),
        Route("/replays/{replay}/cancel", replay_cancel, methods=["POST"]),
        Route("/routes", routes_page, methods=["GET"]),
        Route("/routes/{route}/{action}", route_action, methods=["POST"]),
        Route("/sources/{source}/{action}", source_action, methods=["POST"]),
        Route("/audit", audit_page, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes)
    return SecurityHeaders(app)


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
    from core.messages import DELIVER_TASK  # noqa: PLC0415

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

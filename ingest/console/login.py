"""The console's login and logout. ``/console/login`` takes a named admin token, compared in
constant time with every configured one; a match starts a server-side session
(:mod:`ingest.console.sessions`) whose id goes in an HttpOnly, SameSite=Strict cookie (Secure
on https, or with ``WEBHOOKS_CONSOLE_SECURE_COOKIES``). The login form carries a CSRF token
of its own cookie. Failed logins are limited per client address and in all
(:mod:`models.login_throttle`): a throttled attempt is answered 429 with ``Retry-After`` and a
page that says how long to wait, its token never compared.

Every compared login is audited (``audit_log``, ``via: console``): a success as ``login``
under the token's name, with the client's address; a refused token as ``login.failed``
(operator ``anonymous``), with the address; never the token. A throttled attempt is not
(its token is never compared; it is counted and logged), so the rows a flood can write are
bounded by the throttle's budgets. A success whose row cannot be written (the database is
down) is refused with 503: no session starts unaudited. A failure is still answered 401 then,
and its log line is the record."""

from __future__ import annotations

import secrets

from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ingest.console import sessions as sess
from ingest.console.base import (
    COOKIE,
    COOKIE_PATH,
    LOGIN_COOKIE,
    Console,
    Visit,
    log,
    one,
    read_form,
    redirect,
)
from ingest.plane import throttled
from models.catalog import record_login
from models.login_throttle import client_key


def routes(c: Console) -> list[Route]:
    async def login_page(request: Request) -> Response:
        return _login_form(c, request, None, 200)

    async def login(request: Request) -> Response:
        return await _login(c, request)

    return [
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        c.post("/logout", logout),
    ]


def _login_form(c: Console, request: Request, message: str | None, status: int) -> Response:
    """The login page, with a new CSRF token in its own cookie."""
    token = secrets.token_urlsafe(24)
    response = c.page(
        request, "login.html", {"login_csrf": token, "message": message}, status=status
    )
    _set_cookie(c, request, response, LOGIN_COOKIE, token)
    return response


def _set_cookie(c: Console, request: Request, response: Response, name: str, value: str) -> None:
    response.set_cookie(
        name, value, path=COOKIE_PATH, httponly=True, samesite="strict", secure=c.secure(request)
    )


def _named_match(c: Console, given: str) -> tuple[str, bytes] | None:
    """The named token ``given`` is; also as written in WEBHOOKS_ADMIN_TOKENS, ``NAME:TOKEN``
    (what an operator copies from ``.env``), when NAME is that token's own name."""
    found = c.match(given)
    if found is None and ":" in given:
        name, _, token = given.partition(":")
        named = c.match(token)
        if named is not None and secrets.compare_digest(named[0].encode(), name.encode()):
            return named
    return found


async def _login(c: Console, request: Request) -> Response:
    form = await read_form(request)
    expected = request.cookies.get(LOGIN_COOKIE)
    if expected is None or not sess.same(one(form, "csrf"), expected):
        return Response("missing or wrong CSRF token", 403)
    client = client_key(request.client.host if request.client else None)
    decision = await run_in_threadpool(c.state.throttle.check, client)
    if not decision.allowed:  # the token is not even compared
        response = _login_form(c, request, throttled(decision, client, "console"), 429)
        response.headers["Retry-After"] = str(decision.retry_after)
        return response
    found = _named_match(c, one(form, "token") or "")
    address = request.client.host if request.client else "unknown"
    if found is None:
        await run_in_threadpool(c.state.throttle.failed, client, decision)
        log.info("console.login_refused", client=client)
        try:
            await c.db(lambda s: record_login(s, operator=None, client=address, via="console"))
        except OperationalError:
            log.warning("console.login_unaudited", client=client, outcome="refused")
        return _login_form(c, request, "wrong token", 401)
    name, digest = found
    try:
        await c.db(lambda s: record_login(s, operator=name, client=address, via="console"))
    except OperationalError:
        log.warning("console.login_unaudited", client=client, outcome="refused_unaudited")
        message = "the database is unavailable (every login is audited): try again shortly"
        return _login_form(c, request, message, 503)
    sid, _ = c.store.create(name, digest)
    log.info("console.login", operator=name, client=client)
    response = redirect("/console/")
    _set_cookie(c, request, response, COOKIE, sid)
    response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
    return response


async def logout(c: Console, v: Visit) -> Response:
    c.store.end(v.request.cookies.get(COOKIE))
    log.info("console.logout", operator=v.session.operator)
    response = redirect("/console/login")
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response

"""AdminGuard: the admin plane's ASGI middleware, in front of everything on its address
(:mod:`ingest.admin`). It decides before a single byte of the body is read: the token
(``Authorization: Bearer``; on the docs' paths also the password of HTTP Basic, or the docs'
session cookie), compared in constant time with every configured one, else 401; then the body
is capped at :data:`MAX_BODY_BYTES` (a larger ``Content-Length``: 413 at once, unread; a
chunked body: 413 where it passes the cap). The console's requests are judged the same way
by their session cookie (:meth:`AdminGuard._console`): only the login form's body, at most
:data:`LOGIN_MAX_BODY_BYTES`, is read before anyone is known, and the admin protocol
(:mod:`ingest.admin.protocol`) may close it for room. The matched token's name goes on the request
(:data:`TOKEN_NAME`): the operator every audit row records. A request that offers a token
goes through the login throttle first (:mod:`models.login_throttle`, shared with the
console's login form): refused, it is answered 429 with ``Retry-After`` and its token is
never compared. Its session cookie, like the console's, is ``Secure`` on https or with
``WEBHOOKS_CONSOLE_SECURE_COOKIES`` (:func:`ingest.plane.secure_cookie`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.clock import Clock, SystemClock
from core.settings import Settings
from ingest.admin.protocol import mark_unproven
from ingest.console.base import COOKIE as CONSOLE_COOKIE
from ingest.console.base import LOGIN_COOKIE as CONSOLE_LOGIN_COOKIE
from ingest.console.sessions import SessionStore
from ingest.plane import OperatorTokens, secure_cookie, throttled
from models.login_throttle import LoginThrottle, client_key

# The largest admin request body: a replay request is a few hundred bytes.
MAX_BODY_BYTES = 64 * 1024
# The largest console login form (its CSRF token and an admin token): read before anything
# is known of its sender, so kept small.
LOGIN_MAX_BODY_BYTES = 8 * 1024
# Where AdminGuard puts the matched token's name (the request's state).
TOKEN_NAME = "admin_token_name"  # noqa: S105  (a key, not a secret)
DOCS_PATHS = ("/admin/openapi.json", "/admin/docs")
CONSOLE_PREFIX = "/console"  # the operator console (ingest.console): its own session login
CONSOLE_LOGIN = CONSOLE_PREFIX + "/login"
# The docs page's session (see ingest.admin): the schema fetch carries it.
DOCS_COOKIE = "webhooks_admin_docs"
DOCS_SESSION_SECONDS = 3600
BASIC_CHALLENGE = 'Basic realm="webhooks admin API (password: the admin token)"'


def _basic_password(value: bytes) -> bytes | None:
    """The password of an ``Authorization: Basic`` value (the user name is ignored)."""
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, sep, password = decoded.partition(b":")
    return password if sep else None


class AdminGuard:
    """Authenticate, then cap the body, before anything reads it (see the module docstring).

    A plain ASGI middleware rather than FastAPI dependencies: FastAPI reads and parses a JSON
    body before it resolves any dependency, so a token check there comes after the cost (and
    after a 422 for bad JSON, which would tell a stranger the API is there).
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: OperatorTokens,
        *,
        max_body: int = MAX_BODY_BYTES,
        clock: Clock | None = None,
        settings: Settings | None = None,
        throttle: LoginThrottle | None = None,
        sessions: SessionStore | None = None,
    ) -> None:
        self.app = app
        self.sessions = sessions  # the console's: without them no console request has a body
        self.max_body = max_body
        self.clock = clock or SystemClock()
        self.tokens = tokens
        self.settings = settings
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        if not self.tokens:  # the API is off: as if it did not exist
            await _answer(send, 404, "Not Found", "not_found")
            return
        path: str = scope["path"]
        if path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/"):
            await self._console(scope, receive, send)
            return
        docs = path in DOCS_PATHS or path.startswith("/admin/docs/")
        given = self._credentials(scope, docs=docs)
        decision = None
        client = client_key((scope.get("client") or (None,))[0])
        if given is not None and self.throttle is not None:
            decision = await run_in_threadpool(self.throttle.check, client)
            if not decision.allowed:  # the token is not even compared
                message = throttled(decision, client, "docs" if docs else "api")
                await _answer(send, 429, message, "throttled", retry_after=decision.retry_after)
                return
        found = self.tokens.match(given)
        name = None if found is None else found[0]
        if name is None and decision is not None and self.throttle is not None:
            await run_in_threadpool(self.throttle.failed, client, decision)
        if name is None and docs:
            name = self._session(scope)
        elif name is not None and path == "/admin/docs":
            send = self._start_session(send, name, secure=self._secure(scope))
        if name is None:
            challenge = BASIC_CHALLENGE if docs else "Bearer"
            await _answer(send, 401, "missing or wrong bearer token", "unauthenticated", challenge)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        scope.setdefault("state", {})[TOKEN_NAME] = name
        await self.app(scope, _replay(body, receive), send)

    async def _console(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The console authenticates with its session cookie (started by its login form with
        one of the same tokens), checked here from the headers before any body is read. With
        a live session the body cap holds; the login form's body (at most
        :data:`LOGIN_MAX_BODY_BYTES`) is read only when the form's own cookie came with it,
        and the admin protocol may close it for room while it arrives. Any other request
        reaches the console without its body (the login page, a redirect to it, ``403`` for
        an action), and a connection that was sending one is closed after the answer."""
        cookies = _cookies(scope)
        session = None
        if self.sessions is not None:
            session = self.sessions.get(cookies.get(CONSOLE_COOKIE), self.tokens.digests)
        if session is not None:
            body = await self._read_body(scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] == CONSOLE_LOGIN:
            if not cookies.get(CONSOLE_LOGIN_COOKIE):
                await _answer(send, 403, "missing or wrong CSRF token", "csrf")
                return
            mark_unproven(scope, True)
            try:
                body = await self._read_body(scope, receive, send, LOGIN_MAX_BODY_BYTES)
            finally:
                mark_unproven(scope, False)
        else:
            closing = _closing(send) if _has_body(scope) else send
            await self.app(scope, _replay(b"", receive), closing)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _session_mac(self, key: bytes, name: str, expires: int) -> str:
        return hmac.new(key, f"docs:{name}:{expires}".encode(), hashlib.sha256).hexdigest()

    def _secure(self, scope: Scope) -> bool:
        """The console's rule for its cookies (:func:`ingest.plane.secure_cookie`)."""
        scheme = str(scope.get("scheme", "http"))
        return scheme == "https" if self.settings is None else secure_cookie(self.settings, scheme)

    def _start_session(self, send: Send, name: str, *, secure: bool) -> Send:
        """``send`` that adds the docs' session cookie to a successful answer (``Secure`` by
        the console's rule: https, or ``WEBHOOKS_CONSOLE_SECURE_COOKIES``)."""
        [key] = [digest for n, digest in self.tokens.named if n == name]
        expires = int(self.clock.now().timestamp()) + DOCS_SESSION_SECONDS
        value = f"{name}.{expires}.{self._session_mac(key, name, expires)}"
        cookie = (
            f"{DOCS_COOKIE}={value}; Path=/admin/; Max-Age={DOCS_SESSION_SECONDS}; "
            "HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")
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
        for token_name, digest in self.tokens.named:
            expected = self._session_mac(digest, token_name, expires)
            if hmac.compare_digest(expected.encode(), mac.encode()) and token_name == name:
                found = token_name
        return found

    def _credentials(self, scope: Scope, *, docs: bool) -> bytes | None:
        """The token the request offers (a bearer token; on the docs' paths also a Basic
        password), None when it offers none."""
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given: bytes = credentials.strip()
                    return given
                if scheme.lower() == b"basic" and docs:
                    return _basic_password(credentials)
                return None
        return None

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send, cap: int | None = None
    ) -> bytes | None:
        """The whole body, at most ``cap`` (``max_body``) bytes; None once an answer has been
        sent."""
        limit = self.max_body if cap is None else cap
        too_large = f"body too large (at most {limit} bytes)"
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            if not declared[0].isdigit():
                await _answer(send, 400, "bad Content-Length", "bad_input")
                return None
            if int(declared[0]) > limit:
                await _answer(send, 413, too_large, "too_large")
                return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                await _answer(send, 413, too_large, "too_large")
                return None
            if not message.get("more_body", False):
                return bytes(body)


def _cookies(scope: Scope) -> dict[str, str]:
    """The request's cookies, as Starlette's ``Request.cookies`` reads them."""
    for key, value in scope["headers"]:
        if key == b"cookie":
            return cookie_parser(value.decode("latin-1"))
    return {}


def _has_body(scope: Scope) -> bool:
    """Whether the request says a body follows (chunked, or a length other than 0)."""
    return any(
        k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0")
        for k, v in scope["headers"]
    )


def _closing(send: Send) -> Send:
    """``send`` that closes the connection after the answer (``Connection: close``)."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing


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
    send: Send,
    status: int,
    detail: str,
    reason: str,
    challenge: str | None = None,
    *,
    retry_after: int | None = None,
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
    if retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

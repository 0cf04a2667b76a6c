"""The admin plane: the operators' API under ``/admin`` and the receiver's ``/metrics``, on an
address of their own (``WEBHOOKS_ADMIN_HOST``/``WEBHOOKS_ADMIN_PORT``, loopback by default),
never on the public receiver port. ``webhooks serve`` runs it in the receiver's process
(:class:`AdminServer`); ``uvicorn --factory ingest.admin:app_from_env`` runs it alone.

AdminGuard (:mod:`ingest.admin.guard`), a plain ASGI middleware in front of everything here,
decides before a single byte of the body is read: the token (``Authorization: Bearer``; on the
docs' paths also the password of HTTP Basic, which a browser can send), compared in constant
time with every configured one, else 401; then the body is capped at 64 KiB (a larger
``Content-Length``: 413 at once, unread; a chunked body: 413 where it passes the cap). So no
unauthenticated request costs more than its headers, and none reaches a JSON parser. The
matched token's *name* (``WEBHOOKS_ADMIN_TOKENS=name:token,...``; ``WEBHOOKS_ADMIN_TOKEN`` is
named ``admin``) goes on the request, and every audit row the API writes records it as the
operator: who replayed is what authenticated, not what a body claims. Without any token the API
is off: every ``/admin`` path is a 404 and nothing reveals that it exists.

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
without a bearer token (it is off with the API when no token is configured) but checks its
session cookie, started by logging in with one of the same named tokens, before reading any
body (the login form alone is read first, at most 8 KiB); the body cap holds there too.
Slow clients cannot hold the address: :mod:`ingest.admin.protocol` has its timeouts and
connection caps. ``/admin`` still demands the bearer token, a console cookie or not.

The interactive docs (``/admin/docs``) work offline: Swagger UI's files come from the
``swagger-ui-bundle`` package, served here, behind the token like the schema. A browser given
the token in the URL (``http://any:TOKEN@host:8001/admin/docs``) or at its prompt loads the
page with HTTP Basic; the page then fetches the schema from ``location.origin`` (a fetch from
a URL carrying credentials is refused by browsers), and the answer to the page set a session
cookie that authenticates that fetch: ``HttpOnly``, ``SameSite=Strict``, path ``/admin/``,
for ``DOCS_SESSION_SECONDS`` (an hour), an HMAC of the token's name and expiry keyed by the
token, so removing the token ends it. The cookie opens the docs' own paths only, never the API.

Where each part lives: :mod:`ingest.admin.server` (the assembly, ``/metrics``, the
server), :mod:`ingest.admin.protocol` (its HTTP limits), :mod:`ingest.admin.guard`
(AdminGuard), :mod:`ingest.admin.api` with its routers (:mod:`~ingest.admin.events`,
:mod:`~ingest.admin.replays`, :mod:`~ingest.admin.routes`) and :mod:`ingest.admin.docs`;
what the API and the console share: :mod:`ingest.plane`.
"""

from ingest.admin.server import AdminServer, app_from_env, create_admin_app

__all__ = ["AdminServer", "app_from_env", "create_admin_app"]

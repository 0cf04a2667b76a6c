"""The operator console: server-rendered pages on the admin plane at ``/console/``.

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

The app: :mod:`ingest.console.app`; the session check every page shares:
:mod:`ingest.console.base`; the pages by concern: :mod:`~ingest.console.overview` (and the
audit trail), :mod:`~ingest.console.login`, :mod:`~ingest.console.events`,
:mod:`~ingest.console.deliveries`, :mod:`~ingest.console.dead` (dead letters and replays),
:mod:`~ingest.console.sources` (sources and routes). Templates and static files ship inside
this package.
"""

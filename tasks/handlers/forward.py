"""Built-in ``forward``: POST the original body to the route's URL, signed.

    webhooks routes add SOURCE --handler forward --option url=https://downstream.example/hook

Headers: ``Idempotency-Key`` carries the downstream key (the same on every retry and replay
of one event), and Standard Webhooks headers (``webhook-id`` = that key,
``webhook-timestamp``, ``webhook-signature``) are made with the route's own signing secret, so
the downstream verifies us with any Standard Webhooks library; with traces on
(core/tracing.py), ``traceparent`` names the call's span in the event's trace. Connect and
read timeouts are ``WEBHOOKS_HANDLER_IO_TIMEOUT`` (below the soft time limit). 2xx
succeeds; 408, 429, 5xx, timeouts and connection errors retry, honouring ``Retry-After``
within the policy's cap;
redirects and other 4xx are permanent. 5xx, timeouts and connection errors raise
:class:`~tasks.errors.DownstreamError`, which the route's circuit breaker counts. Errors name
the status, never the URL (it may carry a token) nor the body.

The call itself is :func:`tasks.handlers.forward_client.post`: on this process's event loop
(aiohttp; the handler's thread waits for it) under the threads and prefork pools, httpx under
gevent. The whole call is bounded by the I/O timeout on the loop, and at most
:data:`~tasks.handlers.forward_client.MAX_RESPONSE_BYTES` of the answer is read (nothing of it
is needed: a downstream answering with a huge body cannot grow the worker's memory). A
``Retry-After`` that is neither delta-seconds nor an HTTP date is ignored and counted.
``http://`` targets are refused (the event would travel in clear) unless the host is
loopback or the route sets ``--option allow_http=true``.

Addresses (:mod:`core.addresses`): link-local and cloud metadata addresses are refused
always; loopback and private ones unless the route sets ``--option allow_private=true``. The
host is resolved once per connection, every address it resolves to is checked, and the
connection goes to a checked address (:mod:`tasks.handlers.forward_client`), so DNS rebinding
cannot switch the target; TLS still verifies, and SNI and ``Host`` still name, the URL's host.
A refused address is a PermanentError (``address_refused``), never retried. Forwards connect
directly: ``HTTP(S)_PROXY`` is not used (a proxy would resolve the host itself).

A route's transform (``--transform``, :mod:`tasks.transforms`) reshapes what is sent: the
body posted and signed is the transform's, its headers go along (the signature's, the key's
and ``traceparent`` are ours, never the transform's).

Header values are ASCII: an event type with other characters goes as
``X-Webhooks-Event-Type-UTF8`` (its UTF-8 percent-encoded) instead of
``X-Webhooks-Event-Type``, and a stored content type that is not printable ASCII is replaced
by ``application/octet-stream``; a delivery never fails on our own header encoding.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping
from datetime import datetime
from email.utils import parsedate_to_datetime
from urllib.parse import quote, urlsplit

from standardwebhooks.webhooks import Webhook

from core import tracing
from core.addresses import ALLOW_PRIVATE, AddressRefused, allows_private, check_host
from core.metrics import RETRY_AFTER_IGNORED
from tasks.context import Event, HandlerContext
from tasks.errors import DownstreamError, PermanentError, RetryableError
from tasks.handlers.forward_client import post
from tasks.handlers.registry import register

# The longest Retry-After honoured as given (the retry policy caps it further).
_MAX_RETRY_AFTER_S = 7 * 86400.0
_DELTA_SECONDS = re.compile(r"[0-9]{1,12}")  # ASCII digits only: "²".isdigit() is True
# What a header value may carry as it is: printable ASCII and spaces (no controls, no CR/LF).
_HEADER_SAFE = re.compile(r"[\x20-\x7e]*")


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date); None for
    no header, and for anything else, which is counted
    (``webhooks_retry_after_ignored_total``): the retry policy's own backoff applies."""
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return min(float(value), _MAX_RETRY_AFTER_S)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        when = None
    if when is None or when.tzinfo is None:
        RETRY_AFTER_IGNORED.inc()
        return None
    return min(max(0.0, (when - now).total_seconds()), _MAX_RETRY_AFTER_S)


def check_url(url: object, options: Mapping[str, object] | None = None) -> str:
    """The route's target, if it may be used: http(s) with a host; plain http only to a
    loopback host or with ``allow_http=true``; not an address :mod:`core.addresses`
    refuses (judged here by what needs no DNS: a literal, ``localhost``, metadata names).
    Raises PermanentError (``misconfigured``, ``insecure_url`` or ``address_refused``).

    A pure function of the URL and the two options, judged once per process for a URL that
    passes (:func:`_judged`, cached): every forward of a route asks it again, and parsing the
    URL and the address each time was 2-3% of a forwarding worker's CPU (py-spy)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise PermanentError("forward route has no http(s) url option", reason="misconfigured")
    found = options or {}
    _judged(url, str(found.get(ALLOW_PRIVATE, "")), str(found.get("allow_http", "")))
    return url


@functools.lru_cache(maxsize=4096)
def _judged(url: str, allow_private_option: str, allow_http_option: str) -> bool:
    """:func:`check_url`'s judgement of an http(s) URL and the route's ``allow_private`` and
    ``allow_http`` options (as given): True, or PermanentError (never cached: a refused URL
    is judged again on each use)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise PermanentError("forward route's url has no host", reason="misconfigured")
    try:
        allow_private = allows_private({ALLOW_PRIVATE: allow_private_option})
    except ValueError as exc:
        raise PermanentError(f"forward route: {exc}", reason="misconfigured") from None
    try:
        check_host(host, allow_private=allow_private)
    except AddressRefused as exc:
        raise PermanentError(str(exc), reason="address_refused") from None
    if url.startswith("http://") and not _loopback(host):
        allowed = allow_http_option.lower() in ("true", "1", "yes")
        if not allowed:
            raise PermanentError(
                "forward route's url is plain http to a host that is not loopback: use https,"
                " or set --option allow_http=true",
                reason="insecure_url",
            )
    return True


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def signed_headers(event: Event, ctx: HandlerContext, secret: str, now: datetime) -> dict[str, str]:
    try:
        text = event.body.decode("utf-8")
    except UnicodeDecodeError:
        raise PermanentError(
            "body is not UTF-8, cannot sign it as Standard Webhooks", reason="malformed_body"
        ) from None
    signature = Webhook(secret).sign(ctx.idempotency_key, now, text)
    headers = {
        "content-type": _content_type(event.meta.content_type),
        "idempotency-key": ctx.idempotency_key,
        "webhook-id": ctx.idempotency_key,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    if _HEADER_SAFE.fullmatch(event.event_type):
        headers["x-webhooks-event-type"] = event.event_type
    else:  # not sendable as it is: its UTF-8, percent-encoded, under a name saying so
        headers["x-webhooks-event-type-utf8"] = quote(event.event_type, safe="")
    return headers


def _content_type(stored: str | None) -> str:
    if not stored:
        return "application/json"
    return stored if _HEADER_SAFE.fullmatch(stored) else "application/octet-stream"


@register("forward")
def forward(event: Event, ctx: HandlerContext) -> None:
    options = dict(ctx.route.options)
    url = check_url(options.get("url"), options)
    if not ctx.route.signing_secret:
        raise PermanentError("forward route has no signing secret", reason="misconfigured")
    now = ctx.clock.now()
    # A route's transform may add headers (tasks.transforms refuses ours): ours win.
    headers = {**event.headers, **signed_headers(event, ctx, ctx.route.signing_secret, now)}
    if ctx.traceparent is None:
        answer = post(
            url,
            event.body,
            headers,
            timeout=ctx.io_timeout,
            allow_private=allows_private(options),
            fence=ctx.fence,
        )
    else:  # traces on: the call is a span of the event's trace, and the downstream's parent
        # The host only: a URL may carry a token.
        attributes = {"http.request.method": "POST", "server.address": urlsplit(url).hostname or ""}
        with tracing.span(
            "webhooks.downstream", parent=ctx.traceparent, kind="client", attributes=attributes
        ) as call:
            answer = post(
                url,
                event.body,
                {**headers, "traceparent": call or ctx.traceparent},
                timeout=ctx.io_timeout,
                allow_private=allows_private(options),
                fence=ctx.fence,
            )
    status = answer.status
    if 200 <= status < 300:
        return
    if status >= 500:  # the downstream failing: its route's breaker counts it
        raise DownstreamError(
            f"downstream answered HTTP {status}",
            delay=parse_retry_after(answer.retry_after, now),
            reason="http_retryable",
        )
    if status in (408, 429):
        raise RetryableError(
            f"downstream answered HTTP {status}",
            delay=parse_retry_after(answer.retry_after, now),
            reason="http_retryable",
        )
    raise PermanentError(f"downstream answered HTTP {status}", reason="http_rejected")

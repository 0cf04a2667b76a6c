"""Built-in ``forward``: POST the original body to the route's URL, signed.

    webhooks routes add SOURCE --handler forward --option url=https://downstream.example/hook

Headers: ``Idempotency-Key`` carries the downstream key (the same on every retry and replay
of one event), and Standard Webhooks headers (``webhook-id`` = that key,
``webhook-timestamp``, ``webhook-signature``) are made with the route's own signing secret, so
the downstream verifies us with any Standard Webhooks library. Connect and read timeouts are
``WEBHOOKS_HANDLER_IO_TIMEOUT`` (below the soft time limit). 2xx succeeds; 408, 429, 5xx,
timeouts and connection errors retry, honouring ``Retry-After`` within the policy's cap;
redirects and other 4xx are permanent. 5xx, timeouts and connection errors raise
:class:`~tasks.errors.DownstreamError`, which the route's circuit breaker counts. Errors name
the status, never the URL (it may carry a token) nor the body.

The response is streamed and at most :data:`MAX_RESPONSE_BYTES` of it read (nothing of it is
needed: a downstream answering with a huge body cannot grow the worker's memory). A
``Retry-After`` that is neither delta-seconds nor an HTTP date is ignored and counted.
``http://`` targets are refused (the event would travel in clear) unless the host is
loopback or the route sets ``--option allow_http=true``.

Addresses (:mod:`core.addresses`): link-local and cloud metadata addresses are refused
always; loopback and private ones unless the route sets ``--option allow_private=true``. The
host is resolved once per connection, every address it resolves to is checked, and the
connection goes to a checked address (a custom httpcore network backend), so DNS rebinding
cannot switch the target; TLS still verifies, and SNI and ``Host`` still name, the URL's host.
A refused address is a PermanentError (``address_refused``), never retried. Forwards connect
directly: ``HTTP(S)_PROXY`` is not used (a proxy would resolve the host itself).

Header values are ASCII: an event type with other characters goes as
``X-Webhooks-Event-Type-UTF8`` (its UTF-8 percent-encoded) instead of
``X-Webhooks-Event-Type``, and a stored content type that is not printable ASCII is replaced
by ``application/octet-stream``; a delivery never fails on our own header encoding.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from email.utils import parsedate_to_datetime
from urllib.parse import quote, urlsplit

import httpcore
import httpx
from standardwebhooks.webhooks import Webhook

from core.addresses import AddressRefused, IPAddress, allows_private, check_address, check_host
from core.metrics import RETRY_AFTER_IGNORED
from core.outbound import CheckedBackend, WrappedStream, resolve
from tasks.context import Event, HandlerContext
from tasks.errors import DownstreamError, PermanentError, RetryableError
from tasks.handlers.registry import register

USER_AGENT = "webhook-pipeline/0.1"
# What is read of a downstream's answer at most; the rest is never read.
MAX_RESPONSE_BYTES = 64 * 1024
# The longest Retry-After honoured as given (the retry policy caps it further).
_MAX_RETRY_AFTER_S = 7 * 86400.0
_DELTA_SECONDS = re.compile(r"[0-9]{1,12}")  # ASCII digits only: "²".isdigit() is True
# What a header value may carry as it is: printable ASCII and spaces (no controls, no CR/LF).
_HEADER_SAFE = re.compile(r"[\x20-\x7e]*")

# Idle clients, most recently used last, apart by whether they may reach private addresses.
# Each running call borrows one (a gevent worker runs ~100 at once): one client shared by them
# all spends its CPU in httpcore's pool, which checks every pooled connection for expiry on
# each request (bench_forward.py measured it as most of the worker's CPU). A borrowed client
# keeps its connections alive for the next call (of a route with the same address policy: a
# connection a private route opened is never reused for one that may not reach it).
_idle: dict[bool, list[httpx.Client]] = {False: [], True: []}
# One TLS context for every client: building one per client costs milliseconds.
_tls: ssl.SSLContext | None = None


def _reset_clients() -> None:
    # A pooled connection must not be shared across fork.
    global _tls  # noqa: PLW0603
    for clients in _idle.values():
        clients.clear()
    _tls = None


os.register_at_fork(after_in_child=_reset_clients)


class _CheckedBackend(CheckedBackend):
    """:class:`core.outbound.CheckedBackend` judging addresses as a route allows (every
    address checked, the connection to one of them), each connection fenced at its first
    write (:func:`_fenced_at_send`)."""

    def __init__(self, allow_private: bool) -> None:
        super().__init__(self._check_all)
        self.allow_private = allow_private

    def _check_all(self, addresses: Sequence[IPAddress]) -> None:
        for address in addresses:
            check_address(address, allow_private=self.allow_private)  # AddressRefused

    def lookup(self, host: str, port: int) -> list[IPAddress]:
        return resolve(host, port)  # this module's name: a test stands a DNS server in

    def wrap(self, stream: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return _FencedStream(stream)


# The fence of the call this thread (or greenlet) is about to make: checked once, by the
# connection's first write of the request, then dropped.
_pending_fence = threading.local()


@contextmanager
def _fenced_at_send(fence: Callable[[], None]) -> Iterator[None]:
    """Check ``fence`` at the last instant before the request's first byte is written:
    after the pooled connection was found or a new one opened (DNS, TCP, TLS), where a worker
    frozen or starved in between would otherwise wake up and send (issue 32's drill: a thread
    frozen right after an earlier check called the downstream 1.3 s after another worker had
    committed the delivery's success). What is left is the interpreter's few steps between
    the check and the socket's send."""
    _pending_fence.check = fence
    try:
        yield
    finally:
        _pending_fence.check = None


class _FencedStream(WrappedStream):
    """A connection that runs the pending fence (:func:`_fenced_at_send`) before a write."""

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        fence = getattr(_pending_fence, "check", None)
        if fence is not None:
            _pending_fence.check = None
            fence()  # LeaseFenced: nothing of this request was sent
        self._inner.write(buffer, timeout)


class _CheckedTransport(httpx.HTTPTransport):
    """httpx's transport over a pool that connects through :class:`_CheckedBackend`."""

    def __init__(self, tls: ssl.SSLContext, allow_private: bool) -> None:
        super().__init__(verify=tls, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=tls, network_backend=_CheckedBackend(allow_private)
        )


@contextmanager
def _http(allow_private: bool = False) -> Iterator[httpx.Client]:
    global _tls  # noqa: PLW0603
    idle = _idle[allow_private]
    if idle:
        client = idle.pop()
    else:
        if _tls is None:
            _tls = httpx.create_ssl_context()  # what httpx.Client() itself builds
        client = httpx.Client(
            transport=_CheckedTransport(_tls, allow_private),
            follow_redirects=False,
            headers={"user-agent": USER_AGENT},
        )
    try:
        yield client
    finally:
        idle.append(client)


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
    Raises PermanentError (``misconfigured``, ``insecure_url`` or ``address_refused``)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise PermanentError("forward route has no http(s) url option", reason="misconfigured")
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise PermanentError("forward route's url has no host", reason="misconfigured")
    try:
        allow_private = allows_private(options)
    except ValueError as exc:
        raise PermanentError(f"forward route: {exc}", reason="misconfigured") from None
    try:
        check_host(host, allow_private=allow_private)
    except AddressRefused as exc:
        raise PermanentError(str(exc), reason="address_refused") from None
    if url.startswith("http://") and not _loopback(host):
        allowed = str((options or {}).get("allow_http", "")).lower() in ("true", "1", "yes")
        if not allowed:
            raise PermanentError(
                "forward route's url is plain http to a host that is not loopback: use https,"
                " or set --option allow_http=true",
                reason="insecure_url",
            )
    return url


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


def _read_at_most(response: httpx.Response, limit: int) -> int:
    """Read up to ``limit`` bytes of the body and stop (leaving the stream closes the
    connection instead of draining it). Returns the bytes read."""
    seen = 0
    for chunk in response.iter_raw(chunk_size=16 * 1024):
        seen += len(chunk)
        if seen >= limit:
            break
    return seen


@register("forward")
def forward(event: Event, ctx: HandlerContext) -> None:
    options = dict(ctx.route.options)
    url = check_url(options.get("url"), options)
    if not ctx.route.signing_secret:
        raise PermanentError("forward route has no signing secret", reason="misconfigured")
    now = ctx.clock.now()
    headers = signed_headers(event, ctx, ctx.route.signing_secret, now)
    try:
        with _http(allows_private(options)) as client, _fenced_at_send(ctx.fence):
            ctx.fence()  # before a connection is opened for a call that will not be made
            with client.stream(
                "POST",
                url,
                content=event.body,
                headers=headers,
                timeout=httpx.Timeout(ctx.io_timeout),
            ) as response:
                _read_at_most(response, MAX_RESPONSE_BYTES)
    except AddressRefused as exc:  # the host resolved to an address the route may not reach
        raise PermanentError(str(exc), reason="address_refused") from None
    except httpx.TimeoutException as exc:
        raise DownstreamError(
            f"downstream timed out ({type(exc).__name__})", reason="timeout"
        ) from None
    except httpx.TransportError as exc:
        raise DownstreamError(
            f"downstream unreachable ({type(exc).__name__})", reason="connection"
        ) from None
    status = response.status_code
    if 200 <= status < 300:
        return
    if status >= 500:  # the downstream failing: its route's breaker counts it
        raise DownstreamError(
            f"downstream answered HTTP {status}",
            delay=parse_retry_after(response.headers.get("retry-after"), now),
            reason="http_retryable",
        )
    if status in (408, 429):
        raise RetryableError(
            f"downstream answered HTTP {status}",
            delay=parse_retry_after(response.headers.get("retry-after"), now),
            reason="http_retryable",
        )
    raise PermanentError(f"downstream answered HTTP {status}", reason="http_rejected")

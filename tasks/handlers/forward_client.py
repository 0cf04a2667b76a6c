"""The HTTP client of ``forward`` routes: one POST, its status and ``Retry-After``.

Two transports, one contract (:func:`post`):

- **On this process's event loop** (:mod:`tasks.aio`; the threads and prefork pools):
  aiohttp, chosen by measured CPU per request (bench/results_http_clients.txt: 0.15 ms at
  256 in flight, 0.06x the httpx client per thread it replaces). The handler's thread waits
  for the answer; the loop carries every call of the process.
- **Synchronous** (the gevent pool, whose greenlets already wait cheaply): httpx over
  :class:`core.outbound.CheckedBackend`, an ``httpx.Client`` borrowed per running call.

Both keep what the route's guarantees need:

- Addresses (:mod:`core.addresses`): the host is resolved once per connection (:func:`resolve`),
  every address it resolves to is checked, and the connection goes to a checked address (an
  aiohttp resolver, an httpcore network backend), so DNS rebinding cannot switch the target;
  TLS still verifies, and SNI and ``Host`` still name, the URL's host. No proxy, no redirects,
  no decompression.
- The lease's fence (``ctx.fence``) is checked once more at the last instant before the
  request's first byte is written: after the pooled connection was found or a new one opened
  (DNS, TCP, TLS), where a worker frozen or starved in between would otherwise wake up and
  send (issue 32's drill).
- Time: the whole call, from waiting for a connection to the last byte read, is bounded by
  the handler's I/O timeout on the loop (httpx: connect, each write and each read).
- At most :data:`MAX_RESPONSE_BYTES` of the answer is read; the rest never is.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import aiohttp
import httpcore
import httpx
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

from core.addresses import AddressRefused, IPAddress, check_address
from core.outbound import CheckedBackend, WrappedStream, resolve
from tasks import aio
from tasks.errors import DownstreamError, PermanentError
from tasks.pools import is_green

USER_AGENT = "webhook-pipeline/0.1"
# What is read of a downstream's answer at most; the rest is never read.
MAX_RESPONSE_BYTES = 64 * 1024
# Connections one process keeps open at most per address policy, on the loop: above the
# deliveries a process runs at once (slots x 16), so no call waits for one; past it a call
# waits, within its I/O timeout.
MAX_CONNECTIONS = 2048

Fence = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    retry_after: str | None


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    allow_private: bool,
    fence: Fence,
) -> Answer:
    """POST ``body`` to ``url``; the answer's status and ``Retry-After``. Raises
    :class:`~tasks.errors.DownstreamError` (``timeout``, ``connection``),
    :class:`~tasks.errors.PermanentError` (``address_refused``, ``misconfigured``) or
    :class:`~tasks.errors.LeaseFenced` (nothing of the request was sent)."""
    fence()  # before a connection is opened for a call that will not be made
    try:
        if is_green():
            return _post_sync(url, body, headers, timeout, allow_private, fence)
        return aio.call(_post_async(url, body, headers, timeout, allow_private, fence), timeout)
    except AddressRefused as exc:  # the host resolved to an address the route may not reach
        raise PermanentError(str(exc), reason="address_refused") from None
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise DownstreamError(
            f"downstream timed out ({type(exc).__name__})", reason="timeout"
        ) from None
    except aiohttp.InvalidURL:
        raise PermanentError("forward route's url is not valid", reason="misconfigured") from None
    except (aiohttp.ClientError, httpx.TransportError) as exc:
        raise DownstreamError(
            f"downstream unreachable ({type(exc).__name__})", reason="connection"
        ) from None


# --- on the loop: aiohttp -------------------------------------------------------------------

# The fence of the call this task is about to make, read by the connector once it holds a
# connection (each call runs in a task of its own, with its own context).
_call_fence: ContextVar[Fence | None] = ContextVar("_call_fence", default=None)


class _CheckedResolver(AbstractResolver):
    """Resolves a host once per connection (:func:`resolve`, in the loop's executor), checks
    every address, and hands aiohttp only those: the connection goes to a checked address.
    IP literals never reach a resolver; :func:`tasks.handlers.forward.check_url` judged
    them when the route was used."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            addresses = await asyncio.get_running_loop().run_in_executor(None, _lookup, host, port)
        except UnicodeError as exc:
            raise OSError(f"cannot resolve the host ({type(exc).__name__})") from None
        _check_all(addresses, self.allow_private)  # AddressRefused: no connection is opened
        return [
            {
                "hostname": host,
                "host": str(address),
                "port": port,
                "family": socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in addresses
        ]

    async def close(self) -> None:
        return None


def _lookup(host: str, port: int) -> list[IPAddress]:
    return resolve(host, port)  # this module's name: a test stands a DNS server in


def _check_all(addresses: Sequence[IPAddress], allow_private: bool) -> None:
    for address in addresses:
        check_address(address, allow_private=allow_private)  # AddressRefused


class _FencedConnector(aiohttp.TCPConnector):
    """A connector that runs the call's fence once it holds the connection (pooled or new),
    right before the request is written; a refused fence closes that connection."""

    async def connect(
        self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        fence = _call_fence.get()
        if fence is not None:
            try:
                fence()  # LeaseFenced: nothing of this request was sent
            except BaseException:
                connection.close()
                raise
        return connection


# One session per address policy, made on the loop (a connection a private route opened is
# never reused for one that may not reach it); dropped at fork, closed at exit.
_sessions: dict[bool, aiohttp.ClientSession] = {}


def _session(allow_private: bool) -> aiohttp.ClientSession:
    session = _sessions.get(allow_private)
    if session is None or session.closed:
        connector = _FencedConnector(
            resolver=_CheckedResolver(allow_private),
            use_dns_cache=False,  # one lookup per connection, checked
            limit=MAX_CONNECTIONS,
            limit_per_host=0,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            headers={"user-agent": USER_AGENT},
            auto_decompress=False,
            trust_env=False,  # no proxy: it would resolve the host itself
            # No cookies: a downstream's Set-Cookie is never sent on a later call (of this
            # route or another), and no jar is filtered and updated on every request.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        _sessions[allow_private] = session
        aio.on_exit(session.close)
    return session


async def _post_async(
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    allow_private: bool,
    fence: Fence,
) -> Answer:
    _call_fence.set(fence)
    async with _session(allow_private).post(
        url,
        data=body,
        headers=headers,
        ssl=_tls_context(),
        allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as response:
        seen = 0
        async for chunk in response.content.iter_chunked(16 * 1024):
            seen += len(chunk)
            if seen >= MAX_RESPONSE_BYTES:
                break  # leaving unread closes the connection instead of draining it
        return Answer(response.status, response.headers.get("retry-after"))


# --- synchronous: httpx (gevent) ------------------------------------------------------------

# Idle clients, most recently used last, apart by whether they may reach private addresses.
# Each running call borrows one: one client shared by them all spends its CPU in httpcore's
# pool, which checks every pooled connection for expiry on each request.
_idle: dict[bool, list[httpx.Client]] = {False: [], True: []}
# One TLS context for every client and session: building one costs milliseconds.
_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    global _tls  # noqa: PLW0603
    if _tls is None:
        _tls = httpx.create_ssl_context()  # the system's trust store, as httpx.Client() builds
    return _tls


def _reset_clients() -> None:
    # A pooled connection, a session or a loop must not be shared across fork.
    global _tls  # noqa: PLW0603
    for clients in _idle.values():
        clients.clear()
    _sessions.clear()
    _tls = None


os.register_at_fork(after_in_child=_reset_clients)


class _CheckedBackend(CheckedBackend):
    """:class:`core.outbound.CheckedBackend` judging addresses as a route allows, each
    connection fenced at its first write (:func:`_fenced_at_send`)."""

    def __init__(self, allow_private: bool) -> None:
        super().__init__(lambda addresses: _check_all(addresses, allow_private))

    def lookup(self, host: str, port: int) -> list[IPAddress]:
        return _lookup(host, port)

    def wrap(self, stream: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return _FencedStream(stream)


# The fence of the call this greenlet is about to make: checked once, by the connection's
# first write of the request, then dropped.
_pending_fence = threading.local()


@contextmanager
def _fenced_at_send(fence: Fence) -> Iterator[None]:
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
    idle = _idle[allow_private]
    if idle:
        client = idle.pop()
    else:
        client = httpx.Client(
            transport=_CheckedTransport(_tls_context(), allow_private),
            follow_redirects=False,
            headers={"user-agent": USER_AGENT},
        )
    try:
        yield client
    finally:
        client.cookies.clear()  # no cookies: what a downstream set never goes on a later call
        idle.append(client)


def _post_sync(
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    allow_private: bool,
    fence: Fence,
) -> Answer:
    with (
        _http(allow_private) as client,
        _fenced_at_send(fence),
        client.stream(
            "POST", url, content=body, headers=headers, timeout=httpx.Timeout(timeout)
        ) as response,
    ):
        seen = 0
        for chunk in response.iter_raw(chunk_size=16 * 1024):
            seen += len(chunk)
            if seen >= MAX_RESPONSE_BYTES:
                break  # leaving the stream closes the connection instead of draining it
        return Answer(response.status_code, response.headers.get("retry-after"))

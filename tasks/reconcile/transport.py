"""The one way reconciliation reaches a provider's API: an httpx client for one ``api_base``
(issue 34 item 4, a security review's findings). The three providers' clients all go through
it: GitHub's directly, Stripe's library through a custom ``stripe.HTTPClient``, Svix's library
with its httpx client replaced.

- **Addresses**: the host is resolved once per connection and every address judged
  (:func:`core.addresses.check_api_address`) before the connection goes to one of them
  (:class:`core.outbound.CheckedBackend`): metadata and link-local addresses refused always,
  private ones unless the source sets ``allow_private=true``, and plain ``http://`` only when
  every address is loopback, so DNS cannot turn "plain http only to loopback" into plain http
  elsewhere. No proxy from the environment is used (it would resolve the host itself).
- **Only the api_base's origin**: a request for another scheme, host or port is refused.
- **No redirect**: a 3xx answer is an error naming its status, never followed (the ``stripe``
  library's default client, requests, followed one to another plain-http host, stripping the
  key header but still leaving loopback).
- **Size**: at most :data:`MAX_RESPONSE_BYTES` of an answer's body are read: a longer
  ``Content-Length`` is refused before the body is read, a longer body once that much has
  been read (the rest is never read; the connection is closed). Bodies are asked for
  uncompressed (``Accept-Encoding: identity``) and an encoded one is refused: a compressed
  body's size says nothing about what it decodes to.
- **Time**: each call, from connecting to the body's last byte, within :data:`CALL_TIMEOUT`
  seconds: every socket read and write waits at most what is left of it (a body trickling one
  byte at a time cannot hold the run).

Refusals raise :class:`~tasks.reconcile.paging.ApiError` (the walk stops, never tried again)
with the status when there was one, never the key, the URL's path or the API's body; a
timeout is httpx's ``TimeoutException`` (the caller's "did not answer").
"""

from __future__ import annotations

import math
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final
from urllib.parse import urlsplit

import httpcore
import httpx

from core.addresses import AddressRefused, IPAddress, check_api_address
from core.outbound import CheckedBackend, WrappedStream
from tasks.reconcile.paging import ApiError

# An answer's body, read at most. A GitHub page of 100 deliveries is ~50 KiB, a Stripe page
# of 100 event objects usually well under 1 MiB, a Svix page of 100 messages (no content) less.
MAX_RESPONSE_BYTES: Final = 8 * 1024 * 1024
# Each call: connect, TLS, send, the answer and its whole body.
CALL_TIMEOUT: Final = 30.0
_MIB = 1024 * 1024


def _mib(size: int) -> str:
    return f"{size / _MIB:g} MiB"


class _Deadline(threading.local):
    """The running call's deadline (``time.monotonic()``), per thread."""

    at: float = math.inf

    def left(self, timeout: float | None, late: type[Exception]) -> float:
        """``timeout`` bounded by what is left of the call; ``late`` raised once nothing is."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise late("the call's time is up")
        return left if timeout is None else min(timeout, left)


class _BoundedStream(WrappedStream):
    """A connection whose every read and write waits at most what is left of the call."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: _Deadline) -> None:
        super().__init__(inner)
        self._deadline = deadline

    def rewrap(self, inner: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return _BoundedStream(inner, self._deadline)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._deadline.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._deadline.left(timeout, httpcore.WriteTimeout))

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        bounded = self._deadline.left(timeout, httpcore.ConnectTimeout)
        return super().start_tls(ssl_context, server_hostname, bounded)


class _ApiBackend(CheckedBackend):
    def __init__(self, plain_http: bool, allow_private: bool, deadline: _Deadline) -> None:
        super().__init__(self._check_all)
        self.plain_http = plain_http
        self.allow_private = allow_private
        self.deadline = deadline

    def _check_all(self, addresses: Sequence[IPAddress]) -> None:
        for address in addresses:
            check_api_address(address, plain_http=self.plain_http, allow_private=self.allow_private)

    def wrap(self, stream: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return _BoundedStream(stream, self.deadline)

    def connect_one(
        self,
        address: IPAddress,
        port: int,
        timeout: float | None,
        local_address: str | None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
    ) -> httpcore.NetworkStream:
        bounded = self.deadline.left(timeout, httpcore.ConnectTimeout)
        return super().connect_one(address, port, bounded, local_address, socket_options)


class _CappedBody(httpx.SyncByteStream):
    """The answer's body, refused (:class:`ApiError`) past ``limit`` bytes."""

    def __init__(
        self, inner: httpx.SyncByteStream, limit: int, refused: Callable[[], ApiError]
    ) -> None:
        self._inner = inner
        self._limit = limit
        self._refused = refused

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise self._refused()
            yield chunk

    def close(self) -> None:
        self._inner.close()


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port or {"http": 80, "https": 443}.get(url.scheme)


class ApiTransport(httpx.HTTPTransport):
    """httpx's transport for one API base: see the module's docstring."""

    def __init__(
        self, base: str, what: str, *, allow_private: bool = False, timeout: float | None = None
    ) -> None:
        tls = httpx.create_ssl_context()  # what httpx.Client() itself builds
        super().__init__(verify=tls, trust_env=False)
        self._what = what  # "GitHub API at https://..." (no path, no key)
        self._origin = _origin(httpx.URL(base))
        # Each call's bound: CALL_TIMEOUT unless the caller has a shorter one (the watchdog).
        self._timeout = CALL_TIMEOUT if timeout is None else timeout
        self._max_bytes = MAX_RESPONSE_BYTES
        self._deadline = _Deadline()
        backend = _ApiBackend(urlsplit(base).scheme == "http", allow_private, self._deadline)
        self._pool = httpcore.ConnectionPool(ssl_context=tls, network_backend=backend)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if _origin(request.url) != self._origin:
            raise ApiError(None, f"{self._what}: a request for another origin was refused")
        request.headers["accept-encoding"] = "identity"
        limit = self._timeout
        request.extensions["timeout"] = dict.fromkeys(("connect", "read", "write", "pool"), limit)
        self._deadline.at = time.monotonic() + limit
        try:
            response = super().handle_request(request)
        except AddressRefused as exc:  # raised by the backend before connecting
            raise ApiError(None, f"{self._what}: {exc}") from None
        status = response.status_code
        if 300 <= status < 400:
            response.close()
            raise ApiError(
                status,
                f"{self._what} answered a redirect ({status}): refused, reconciliation follows"
                " none (set api_base to where the API is)",
            )
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            response.close()
            raise ApiError(
                status, f"{self._what} answered an encoded body ({encoding}) it was not asked for"
            )

        def too_large() -> ApiError:
            return ApiError(
                status,
                f"{self._what} answered a body larger than {_mib(self._max_bytes)}: refused"
                " (reconciliation reads at most that much of an answer)",
            )

        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self._max_bytes:
            response.close()
            raise too_large()
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _CappedBody(response.stream, self._max_bytes, too_large)
        return response


def timed_out(what: str) -> ApiError:
    """The error of a call that did not finish within :data:`CALL_TIMEOUT` (httpx's
    ``TimeoutException``): ``what`` is "GitHub API at https://..."."""
    return ApiError(None, f"{what} did not answer within {CALL_TIMEOUT:g} s")


def api_client(
    base: str,
    what: str,
    *,
    allow_private: bool = False,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> httpx.Client:
    """An httpx client for ``base`` over :class:`ApiTransport` (no redirects, no proxy);
    ``timeout``: each call's bound (None: :data:`CALL_TIMEOUT`)."""
    bound = CALL_TIMEOUT if timeout is None else timeout
    return httpx.Client(
        base_url=base,
        transport=ApiTransport(base, what, allow_private=allow_private, timeout=bound),
        follow_redirects=False,
        trust_env=False,
        timeout=bound,  # the transport bounds each call by it
        headers=headers,
    )

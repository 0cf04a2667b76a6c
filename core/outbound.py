"""Connections to an address that was judged (server-side request forgery, DNS rebinding).

:class:`CheckedBackend` is an httpcore network backend that resolves the host itself, once per
connection, hands every address it resolved to a ``check`` (which raises to refuse, e.g.
:func:`core.addresses.check_address`), and connects to one of those checked addresses, never
after a second lookup: a name that resolves to a public address when checked and to
``127.0.0.1`` a moment later cannot switch the target. TLS is started by httpcore afterwards
with the URL's host as SNI and for verification, so certificates are checked as usual.

Used by ``forward`` routes (``tasks.handlers.forward``) and by reconciliation's API clients
(``tasks.reconcile.transport``). An httpx client over this backend must not use a proxy
(``trust_env=False``): a proxy would resolve the host itself.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpcore

from core.addresses import IPAddress

# Raises (core.addresses.AddressRefused) when one of the addresses may not be reached.
Check = Callable[[Sequence[IPAddress]], None]


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (the system resolver, once)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found]


class WrappedStream(httpcore.NetworkStream):
    """A connection that hands everything to ``inner``: a subclass changes what it must (a
    fence before a write, a deadline on each wait), and :meth:`rewrap` keeps the stream a TLS
    upgrade returns wrapped the same way."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def rewrap(self, inner: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return type(self)(inner)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return self.rewrap(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class CheckedBackend(httpcore.SyncBackend):
    """httpcore's socket backend, resolving the host itself (:meth:`lookup`): every address
    is checked, and the connection goes to one of those checked addresses
    (:meth:`connect_one`, in the resolver's order). :meth:`wrap` lets a subclass wrap each
    new connection's stream."""

    def __init__(self, check: Check) -> None:
        self.check = check

    def lookup(self, host: str, port: int) -> list[IPAddress]:
        return resolve(host, port)

    def wrap(self, stream: httpcore.NetworkStream) -> httpcore.NetworkStream:
        return stream

    def connect_one(
        self,
        address: IPAddress,
        port: int,
        timeout: float | None,
        local_address: str | None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
    ) -> httpcore.NetworkStream:
        """A connection to one checked address (a subclass may bound its timeout)."""
        return super().connect_tcp(str(address), port, timeout, local_address, socket_options)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self.lookup(host, port)
        except (OSError, UnicodeError) as exc:
            raise httpcore.ConnectError(type(exc).__name__) from None
        self.check(addresses)  # AddressRefused: no connection is opened
        failure: Exception = httpcore.ConnectError("no address")
        for address in addresses:
            try:
                stream = self.connect_one(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
                continue
            return self.wrap(stream)
        raise failure

"""Which addresses a ``forward`` route may reach (server-side request forgery).

A route's URL is chosen by whoever may add routes, and the worker that POSTs to it sits inside
the network: next to the admin port, Flower, Redis, Postgres and, in a cloud, the instance
metadata service that hands out credentials. So:

- **always refused**: link-local addresses (``169.254.0.0/16``, ``fe80::/10``) and the cloud
  metadata addresses (:data:`METADATA`, some of which are not link-local), whatever the route
  says;
- **refused unless the route sets** ``allow_private=true``: loopback, the unspecified address
  (``0.0.0.0`` reaches this host), private ranges (``10/8``, ``172.16/12``, ``192.168/16``,
  ``fc00::/7``, carrier-grade NAT ``100.64/10``) and any other address that is not global;
- everything else (public addresses) is allowed.

An IPv4 address inside IPv6 (``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``) is judged as the IPv4
address it carries. A host name is judged by every address it resolves to, at delivery time,
and the connection goes to the address that was judged (``tasks.handlers.forward``): a name
that resolves to a public address when checked and to ``127.0.0.1`` a moment later (DNS
rebinding) cannot switch the target. Creating a route checks what can be checked without DNS:
an address literal, ``localhost`` and the metadata host names.

Reconciliation's ``api_base`` (the provider API a source's stored credential is sent to,
``tasks.reconcile.transport``) is judged by :func:`check_api_address` with the same classes:
metadata and link-local refused always; private refused unless the source sets
``--config allow_private=true``; loopback allowed (a test's fake, a local proxy); and plain
``http://`` only when every address is loopback, so the credential never crosses a network in
clear, whatever a name resolves to when the connection is made.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

from core.errors import WebhooksError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Cloud instance metadata services: AWS (IPv4, IPv6, ECS task metadata), GCP and Azure
#: (169.254.169.254), Alibaba Cloud (100.100.100.200), Oracle Cloud (192.0.0.192).
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "169.254.170.2",
        "169.254.170.23",
        "fd00:ec2::254",
        "fd00:ec2::23",
        "100.100.100.200",
        "192.0.0.192",
    )
)
METADATA_NAMES = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "metadata.azure"}
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
ALLOW_PRIVATE = "allow_private"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


class AddressRefused(WebhooksError, ValueError):  # noqa: N818 - a refusal, like PermanentError
    """A target address a forward (or reconciliation) may not reach; ``reason`` is
    ``metadata``, ``link_local``, ``loopback``, ``private`` or ``plain_http`` (reconciliation:
    plain http to an address that is not loopback). The message names the class of address,
    never the URL."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def allows_private(options: Mapping[str, object] | None) -> bool:
    """The route's ``allow_private`` option: ``true``/``false`` (also 1/0, yes/no; absent is
    false). ValueError for anything else, so a typo is refused rather than read as false."""
    value = str((options or {}).get(ALLOW_PRIVATE, "")).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"option {ALLOW_PRIVATE} must be true or false")


def _unwrap(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def refusal(address: IPAddress) -> str | None:
    """The class of a non-public address (``metadata``, ``link_local``, ``loopback``,
    ``private``), or None for a public one."""
    address = _unwrap(address)
    if address in METADATA:
        return "metadata"
    if address.is_link_local:
        return "link_local"
    if address.is_loopback or address.is_unspecified:
        return "loopback"
    site_local = isinstance(address, ipaddress.IPv6Address) and address.is_site_local
    if address.is_private or not address.is_global or address.is_multicast or site_local:
        return "private"
    return None


def check_address(address: IPAddress, *, allow_private: bool) -> None:
    """AddressRefused unless a forward may connect to ``address``."""
    kind = refusal(address)
    if kind is None or (allow_private and kind in ("loopback", "private")):
        return
    if kind in ("metadata", "link_local"):
        what = "a cloud metadata" if kind == "metadata" else "a link-local"
        raise AddressRefused(
            f"forward target is {what} address: refused whatever the route's options", kind
        )
    raise AddressRefused(
        f"forward target is a {kind} address: refused unless the route sets"
        f" --option {ALLOW_PRIVATE}=true",
        kind,
    )


def literal(host: str) -> IPAddress | None:
    """The address ``host`` spells without DNS (also ``2130706433`` and ``0x7f.1``, which the
    resolver reads as 127.0.0.1), or None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        return None
    return ipaddress.ip_address(str(found[0][4][0]).partition("%")[0])


def check_host(host: str, *, allow_private: bool) -> None:
    """What a route's host can be judged by without DNS: an address literal, ``localhost``
    and the metadata names. AddressRefused when refused; a name passes (judged at delivery)."""
    name = host.rstrip(".").lower()
    if name in METADATA_NAMES:
        raise AddressRefused(
            "forward target is a cloud metadata host: refused whatever the route's options",
            "metadata",
        )
    if name == "localhost" or name.endswith(".localhost"):
        check_address(ipaddress.IPv4Address("127.0.0.1"), allow_private=allow_private)
        return
    address = literal(host)
    if address is not None:
        check_address(address, allow_private=allow_private)


def check_api_address(address: IPAddress, *, plain_http: bool, allow_private: bool) -> None:
    """AddressRefused unless reconciliation may send a source's API credential to
    ``address``: never a metadata or link-local address; a private one only with the source's
    ``allow_private=true``; over plain http (``plain_http``) only a loopback address."""
    kind = refusal(address)
    if kind in ("metadata", "link_local"):
        what = "a cloud metadata" if kind == "metadata" else "a link-local"
        raise AddressRefused(
            f"api_base is {what} address: refused whatever the source's options", str(kind)
        )
    if plain_http:
        if not _unwrap(address).is_loopback:
            raise AddressRefused(
                "api_base is plain http to an address that is not loopback: refused (the API"
                " key would cross a network in clear); use https",
                "plain_http",
            )
        return
    if kind == "private" and not allow_private:
        raise AddressRefused(
            "api_base is a private address: refused unless the source sets --config"
            f" {ALLOW_PRIVATE}=true",
            kind,
        )


def check_api_host(host: str, *, plain_http: bool, allow_private: bool) -> None:
    """What an ``api_base`` host can be judged by without DNS (as :func:`check_host`); a name
    passes here and is judged by every address it resolves to when a connection is made."""
    name = host.rstrip(".").lower()
    if name in METADATA_NAMES:
        raise AddressRefused(
            "api_base is a cloud metadata host: refused whatever the source's options",
            "metadata",
        )
    if name == "localhost" or name.endswith(".localhost"):
        return
    address = literal(host)
    if address is not None:
        check_api_address(address, plain_http=plain_http, allow_private=allow_private)
